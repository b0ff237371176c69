"""Context parallelism: every sequence split across the cp ranks, attention over all of it.

Load balance: a sequence of ``s`` tokens is cut into ``2·cp`` chunks of ``s / (2·cp)`` and cp rank
``r`` holds chunks ``r`` and ``2·cp − 1 − r``, so that under a causal mask every rank has the same
number of (query, key) pairs to compute (an early chunk, few keys each; a late one, many)::

    cp = 2, s = 8:   positions 0 1 | 2 3 | 4 5 | 6 7        rank 0: 0 1 6 7    rank 1: 2 3 4 5

Everything outside attention is local to a rank's tokens (norms, MLP, the loss on its targets).
Attention all-gathers K and V over the cp group (as Llama 3 did): each rank's queries meet every
key, masked by each token's *global* position (and document, with document masking). Rotary
embeddings rotate each token by its global position, so the function is exactly that of one process.

    gather_kv_from_cp   forward: all-gather K and V along seq,   backward: put the grads back in
                        rank then put them in global order            order, reduce-scatter them

``parallel.cp_comm`` chooses how the queries meet the other ranks' keys:

- ``allgather`` (above): K and V all-gathered before attention, kept whole for the backward.
- ``ring``: K and V travel around the cp ranks, one rank's block per step, while the previous
  block's attention computes; the blocks' partial results merge by their log-sum-exp (an online
  softmax across blocks). Only one other rank's K/V is held at a time, none is kept for the
  backward, which passes them around again with their gradients (``model/context_attention.py``).
- ``a2a`` (Ulysses): one all-to-all turns (its tokens, all heads) into (all tokens, 1/cp of the
  heads) for q, k and v together, attention runs over the whole sequence, and a second all-to-all
  turns the output back (:func:`heads_from_cp`, :func:`heads_to_cp`); heads and kv heads must
  divide by tp × cp.

With plain causal masking no mask is built: each of the rank's two query chunks attends to the
keys before its end, its own chunk under a lower-right causal mask (:func:`query_chunks`), which
the fused attention kernels run without materializing it. With document masking the rank's
queries carry their global positions and documents, the keys their documents, O(s) each, and
the attention kernels judge each pair by them (``model/attention.py``); :func:`causal_mask` builds
the dense mask only for ``model.attention: sdpa`` and as the tests' reference. Like the mappings of
``parallel/tensor.py``, everything here returns at once when the cp group has one rank.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .state import Group

SEQ_DIM = 1   # of (b, s, ...) token ids, targets and hidden states
HEAD_SEQ_DIM = 2  # of (b, heads, s, d) queries, keys and values


def _chunks(seq: int, cp: int) -> int:
    if seq % (2 * cp):
        raise ValueError(f"a sequence of {seq} tokens does not cut into 2·cp = {2 * cp} equal "
                         "chunks")
    return seq // (2 * cp)


def rank_positions(seq: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """(s/cp,) int64: the global positions of cp rank ``rank``'s tokens, in its order."""
    c = _chunks(seq, cp)
    late = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange(late * c, (late + 1) * c, device=device)])  # (s/cp,)


def local_positions(seq: int, cp: Group, device=None) -> torch.Tensor:
    """(s/cp,) int64: the global positions of this rank's tokens (all of them with one rank)."""
    if cp.size == 1:
        return torch.arange(seq, device=device)
    return rank_positions(seq, cp.size, cp.rank, device)


def gathered_positions(seq: int, cp: Group, device=None) -> torch.Tensor:
    """(s,) int64: the global position of each token of an all-gather over cp (rank order)."""
    if cp.size == 1:
        return torch.arange(seq, device=device)
    return torch.cat([rank_positions(seq, cp.size, r, device) for r in range(cp.size)])  # (s,)


def query_chunks(seq_local: int, cp: Group) -> list[tuple[slice, int]]:
    """The rank's two query chunks (rows of its s/cp tokens) and, for each, how many keys in global
    order it may attend to: chunk g of c tokens sees positions [0, (g + 1)·c), the last c of them
    under a lower-right causal mask."""
    c = seq_local // 2
    return [(slice(0, c), (cp.rank + 1) * c), (slice(c, 2 * c), (2 * cp.size - cp.rank) * c)]


def split_to_cp(x: torch.Tensor | None, cp: Group, dim: int = SEQ_DIM) -> torch.Tensor | None:
    """This rank's tokens (chunks r and 2·cp − 1 − r along ``dim``) of a whole-sequence tensor,
    such as the micro-batch's token ids and targets; no communication, None stays None."""
    if x is None or cp.size == 1:
        return x
    _chunks(x.shape[dim], cp.size)
    parts = x.chunk(2 * cp.size, dim=dim)
    return torch.cat([parts[cp.rank], parts[2 * cp.size - 1 - cp.rank]], dim=dim)  # (b, s/cp, ...)


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: torch.Tensor | None = None,
                k_doc: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Which keys each query may attend to: those at its global position or before (and, given
    ``q_doc`` (b, s_q) / ``k_doc`` (b, s_k), of its own document; given a ``window``, fewer than
    ``window`` positions before it). Positions: (s_q,) and (s_k,). Returns (1, 1, s_q, s_k) bool,
    or (b, 1, s_q, s_k) with documents."""
    behind = q_pos.unsqueeze(1) - k_pos.unsqueeze(0)  # (s_q, s_k): how far back each key is
    allowed = (behind >= 0) & (behind < window) if window else behind >= 0
    if q_doc is None:
        return allowed[None, None]  # (1, 1, s_q, s_k): the same for every sample and head
    same_doc = q_doc.unsqueeze(2) == k_doc.unsqueeze(1)  # (b, s_q, s_k)
    return (same_doc & allowed).unsqueeze(1)  # (b, 1, s_q, s_k)


class _GatherKVFromCP(torch.autograd.Function):
    """K and V of every cp rank, in one all-gather of both (their heads side by side), returned in
    global order (position 0 first).

    Forward: all-gather along seq, then reorder. Backward: every rank's queries used every key, so
    each key's gradient is the sum of the ranks' contributions: back in rank order, a
    reduce-scatter along seq returns to each rank the summed gradients of its own keys and
    values."""

    @staticmethod
    def forward(ctx, k, v, group):
        ctx.group, ctx.k_heads = group, k.shape[1]
        kv = torch.cat([k, v], dim=1)  # (b, 2·k, s/cp, d)
        gathered = group.all_gather(kv, HEAD_SEQ_DIM)  # (b, 2·k, s, d), in rank order
        ctx.ranked, in_order = _rank_order(gathered.shape[HEAD_SEQ_DIM], group, kv.device)
        full = gathered.index_select(HEAD_SEQ_DIM, in_order)  # (b, 2·k, s, d), in global order
        return full[:, :ctx.k_heads], full[:, ctx.k_heads:]  # (b, k, s, d) each

    @staticmethod
    def backward(ctx, grad_k, grad_v):
        # (b, 2·k, s, d), rank order
        grad = torch.cat([grad_k, grad_v], dim=1).index_select(HEAD_SEQ_DIM, ctx.ranked)
        local = ctx.group.reduce_scatter(grad, HEAD_SEQ_DIM)  # (b, 2·k, s/cp, d), summed over cp
        return local[:, :ctx.k_heads], local[:, ctx.k_heads:], None


def gather_kv_from_cp(k: torch.Tensor, v: torch.Tensor, cp: Group) -> tuple[torch.Tensor,
                                                                            torch.Tensor]:
    """(b, k, s/cp, d) keys and values of this rank -> (b, k, s, d) of all ranks, in global order
    (see the class)."""
    if cp.size == 1:
        return k, v
    return _GatherKVFromCP.apply(k, v, cp)


def check_cp_comm(cp_comm: str, cp: int, tp: int, num_heads: int, num_kv_heads: int,
                  attention_dropout: float) -> None:
    """``parallel.cp_comm`` against the model: all-to-all gives each cp rank whole heads (of those
    its tp rank holds), ring attention computes its blocks without dropout. ConfigError
    otherwise."""
    if cp == 1 or cp_comm == "allgather":
        return
    if cp_comm == "a2a":
        for field, heads in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if heads % (tp * cp):
                raise ConfigError(f"parallel.cp_comm=a2a splits the heads over tp × cp = {tp} × "
                                  f"{cp} = {tp * cp}, which must divide model.{field}={heads}; use "
                                  "parallel.cp_comm ring or allgather, or a cp dividing "
                                  f"{heads // tp if heads % tp == 0 else heads} / tp")
    elif attention_dropout:
        raise ConfigError("parallel.cp_comm=ring has no attention dropout "
                          f"(model.attention_dropout={attention_dropout}): set "
                          "model.attention_dropout 0, or parallel.cp_comm allgather or a2a")


def _rank_order(seq: int, cp: Group, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(global position of each slot of a rank-order sequence, rank-order slot of each global
    position)."""
    ranked = gathered_positions(seq, cp, device)  # rank order -> global
    in_order = torch.empty_like(ranked)
    in_order[ranked] = torch.arange(len(ranked), device=device)  # global -> rank order
    return ranked, in_order


def _seq_to_heads(x: torch.Tensor, cp: Group) -> torch.Tensor:
    """(b, H, s/cp, d) of this rank's tokens -> (b, H/cp, s, d): head group ``cp.rank`` of every
    token, in global order."""
    b, heads, local, d = x.shape
    # (cp, b, H/cp, s/cp, d): to rank j
    parts = x.view(b, cp.size, heads // cp.size, local, d).transpose(0, 1)
    got = cp.all_to_all(parts)  # (cp, b, H/cp, s/cp, d): [j] = rank j's tokens
    # (b, H/cp, s, d)
    ranked = got.permute(1, 2, 0, 3, 4).reshape(b, heads // cp.size, cp.size * local, d)
    # global order
    return ranked.index_select(HEAD_SEQ_DIM, _rank_order(cp.size * local, cp, x.device)[1])


def _heads_to_seq(y: torch.Tensor, cp: Group) -> torch.Tensor:
    """(b, H/cp, s, d) of every token in global order -> (b, H, s/cp, d): every head of this rank's
    tokens."""
    b, heads, seq, d = y.shape
    # (b, H/cp, s, d), rank order
    ranked = y.index_select(HEAD_SEQ_DIM, _rank_order(seq, cp, y.device)[0])
    # (cp, b, H/cp, s/cp, d)
    parts = ranked.view(b, heads, cp.size, seq // cp.size, d).permute(2, 0, 1, 3, 4)
    got = cp.all_to_all(parts)  # [j] = this rank's tokens of rank j's heads
    return got.transpose(0, 1).reshape(b, heads * cp.size, seq // cp.size, d)  # (b, H, s/cp, d)


class _SeqToHeads(torch.autograd.Function):
    """Forward: all-to-all from sequence shards to head shards. Backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    """Forward: all-to-all from head shards back to sequence shards. Backward: the reverse."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _heads_to_seq(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


def heads_from_cp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: Group):
    """All-to-all attention's first exchange, one all-to-all for q, k and v together: (b, n, s/cp,
    d) queries and (b, k, s/cp, d) keys and values of this rank's tokens -> (b, n/cp, s, d) and
    (b, k/cp, s, d) of the whole sequence in global order, for head group ``cp.rank`` (query head
    group g pairs with kv head group g, as grouped-query attention pairs them)."""
    if cp.size == 1:
        return q, k, v
    b, n, local, d = q.shape
    kv = k.shape[1]
    grouped = [t.reshape(b, cp.size, t.shape[1] // cp.size, local, d) for t in (q, k, v)]
    # (b, n + 2k, s/cp, d): per group [q, k, v]
    qkv = torch.cat(grouped, dim=2).view(b, -1, local, d)
    full = _SeqToHeads.apply(qkv, cp)  # (b, (n + 2k)/cp, s, d)
    return full.split([n // cp.size, kv // cp.size, kv // cp.size], dim=1)


def heads_to_cp(y: torch.Tensor, cp: Group) -> torch.Tensor:
    """All-to-all attention's second exchange: (b, n/cp, s, d) over the whole sequence -> (b, n,
    s/cp, d) of every head for this rank's tokens."""
    if cp.size == 1:
        return y
    return _HeadsToSeq.apply(y, cp)
