"""Ring attention (``parallel.cp_comm: ring``): keys and values pass around the cp ranks while
each rank attends to the block it holds.

Each cp rank holds two chunks of every sequence (``parallel/context.py``'s causal load balance).
Step ``t`` of ``cp`` steps, rank ``r`` attends its queries to the keys and values of rank
``r - t`` (its own first), while it already sends that block on to rank ``r + 1`` and receives the
next one from ``r - 1``: each exchange runs under the previous block's attention. A block's result
is an output and the log-sum-exp of each query's scores there; the blocks merge by their
log-sum-exps (an online softmax across blocks, ``model/blockwise.py``'s ``merge_partial``), which
gives exactly softmax over all keys.

Which (query, key) pairs a block computes comes from a :class:`TilePlan` per source rank, built
from the tokens' global positions — and, under document masking, their documents — as O(s) data
(``model/attention.py``'s :class:`DocumentMask` with the source's key positions): with the
two-chunk split a rank's own block is half causal, and every other block is exactly half visible
(all its keys to the rank's late chunk, or its early keys to both chunks), so every step costs
every rank the same. The plans are made once per micro-batch (once per run without documents)
and shared by every layer. Under a sliding window a plan may hold no tile at all (the source's
keys are all too far back, or ahead, for every query of this rank): that step computes nothing,
forward or backward; its block still travels on, since other ranks need it.

Backward passes the blocks around again (FlashAttention-2's backward per block, from the saved
output and the merged log-sum-exp), and with each block an fp32 accumulator of its keys' and
values' gradients, which travels one rank behind it and arrives home after ``cp`` steps. Memory:
a rank keeps its own K/V for the backward (not the whole sequence's, as the all-gather does), plus
one block in flight. The blocks compute with the blockwise kernel on every device (exact, fp32
arithmetic; no attention dropout).

Shapes: b batch, n query heads, k kv heads (this tp rank's), s the sequence, s/cp a rank's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parallel.context import local_positions, rank_positions
from ..parallel.state import Group
from .attention import TILE, DocumentMask
from .blockwise import TilePlan, merge_partial, tile_backward, tile_forward

# the ring's point-to-point tags: K/V blocks, their gradients' accumulators
KV_TAG, GRAD_TAG = 16, 32


def ring_plans(cp: Group, seq: int, device, q_doc: torch.Tensor | None = None,
               k_doc: torch.Tensor | None = None, window: int = 0) -> tuple[TilePlan, ...]:
    """For each cp rank ``j``, the plan of this rank's queries against ``j``'s keys: causal by
    global position, within each document when ``q_doc`` (b, s/cp) and ``k_doc`` (b, s, global
    order) are given, within the sliding ``window`` when one is (0: none). Tiles as large as the
    blockwise kernel's, at most one chunk of the load-balanced split, so that a tile never
    straddles two chunks when they are small."""
    queries = local_positions(seq, cp, device)  # (s/cp,)
    if q_doc is None:  # causal only: one document
        q_doc = torch.zeros(1, len(queries), dtype=torch.int32, device=device)
        k_doc = torch.zeros(1, seq, dtype=torch.int32, device=device)
    tile = max(1, min(TILE, seq // (2 * cp.size)))
    plans = []
    for j in range(cp.size):
        keys = rank_positions(seq, cp.size, j, device)  # (s/cp,): rank j's tokens
        plans.append(DocumentMask(q_doc, k_doc[:, keys], queries, k_pos=keys,
                                  window=window).tile_plan(tile))
    return tuple(plans)


class _RingAttention(torch.autograd.Function):
    """softmax(q kᵀ / √d) v over every cp rank's keys, the blocks passed around the ring (see the
    module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, cp: Group, plans: tuple[TilePlan, ...]):
        heads = k.shape[1]
        kv = torch.cat([k, v], dim=1)  # (b, 2k, s/cp, d): one message per step
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (b, n, s/cp, d)
        # (b, n, s/cp)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(cp.size):
            last = step == cp.size - 1
            if not last:  # the next block travels while this one computes
                (incoming,), work = cp.shift_async([kv], KV_TAG)
            source = (cp.rank - step) % cp.size
            if not plans[source].empty():  # none of its keys in reach: nothing to add
                part, part_lse = tile_forward(q, kv[:, :heads], kv[:, heads:], plans[source])
                merge_partial(out, lse, part, part_lse)
            if not last:
                work.wait()
                kv = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.plans = cp, plans
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        cp, plans, heads = ctx.cp, ctx.plans, k.shape[1]
        # (b, n, s/cp, 1): rowsum(dO · O)
        delta = (grad_out.float() * out.float()).sum(-1, keepdim=True)
        kv = torch.cat([k, v], dim=1)  # (b, 2k, s/cp, d)
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        pending = None  # the accumulator sent on last step: (its arrival here, handle)
        for step in range(cp.size):
            last = step == cp.size - 1
            if not last:
                (incoming,), work = cp.shift_async([kv], KV_TAG)
            source = (cp.rank - step) % cp.size
            if plans[source].empty():  # no pair computed: no share of the gradients
                block = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            else:
                dq, dk, dv = tile_backward(q, kv[:, :heads], kv[:, heads:], grad_out, lse, delta,
                                           plans[source])
                grad_q += dq
                # (b, 2k, s/cp, d) fp32: this rank's share for the source's keys
                block = torch.cat([dk, dv], dim=1)
            # the source's accumulator, from the ranks that saw its block before
            if pending is not None:
                (arrived,), done = pending
                done.wait()
                block += arrived
            # on to the rank whose turn with this source is next
            pending = cp.shift_async([block], GRAD_TAG)
            if not last:
                work.wait()
                kv = incoming
        (home,), done = pending  # after cp steps the accumulator of this rank's own keys is back
        done.wait()
        grad_k, grad_v = home.split(heads, dim=1)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None


@dataclass(frozen=True)
class RingMask:
    """A micro-batch's attention under ``parallel.cp_comm: ring``: the plans of :func:`ring_plans`
    and the cp group (a prepared mask: ``model/attention.py``'s ``PreparedMask``)."""
    plans: tuple[TilePlan, ...]
    cp: Group

    def attend(self, q, k, v, dropout: float) -> torch.Tensor:
        """(b, n, s/cp, d) queries against this rank's (b, k, s/cp, d) keys and values and, around
        the ring, every other rank's -> (b, n, s/cp, d)."""
        if dropout:
            raise ValueError("ring attention has no attention dropout (parallel/context.py: "
                             "check_cp_comm)")
        return _RingAttention.apply(q, k, v, self.cp, self.plans)


def ring_mask(cp: Group, seq: int, device, documents: DocumentMask | None = None) -> RingMask:
    """The :class:`RingMask` of a sequence of ``seq`` tokens, under the micro-batch's document mask
    (its queries this rank's tokens, its keys every position in global order; its window too) or
    causal."""
    if documents is None:
        return RingMask(ring_plans(cp, seq, device), cp)
    return RingMask(ring_plans(cp, seq, device, documents.q_doc, documents.k_doc,
                               documents.window), cp)
