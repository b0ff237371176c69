"""Exact attention one tile of scores at a time, with its own backward: document masking (and
causal context parallelism) on any device, without an s × s mask or s × s scores.

Queries are cut into tiles of rows and keys into tiles of columns. A :class:`TilePlan`, built once
per micro-batch from the documents' O(s) description (``model/attention.py``), lists for each
query tile the key tiles it must visit — those holding some allowed (query, key) pair — and for
each whether every pair is allowed (no mask) or which are (a small boolean tile mask). Tiles that
no query may see are never computed: with many short documents a query tile visits the one or
two key tiles around the diagonal, with one long document the causal half.

Forward (per query tile): the scores of each listed key tile, masked, folded into a running
maximum, sum and weighted sum of the values (the online softmax of FlashAttention); the tile's
output and the log-sum-exp of its rows are kept. Backward: each tile's probabilities recomputed
from that log-sum-exp, and the gradients of q, k and v accumulated tile by tile (FlashAttention-2's
backward, ``D = rowsum(dO · O)``). Memory: the inputs, the output and one fp32 value per query
row, plus a few ``(b, heads, tile, tile)`` temporaries — linear in s.

Grouped-query heads stay unexpanded: the ``n/k`` query heads of a kv head are stacked as extra rows
of one matmul against that kv head's keys, as SDPA's ``enable_gqa`` pairs them (query head ``h``
with kv head ``h // (n/k)``). Arithmetic is fp32 whatever the input dtype (scores and their
softmax, as fused kernels keep them); results are cast back.

Shapes: b batch, n query heads, k kv heads, g = n/k, s_q queries, s_k keys, d head size, t a tile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TilePlan:
    """Which key tiles each query tile visits. ``rows[i] = (q0, q1, keys)``: query rows q0..q1-1
    and their key tiles ``(k0, k1, blocked)``, ``blocked`` a (b, 1, 1, q1-q0, k1-k0) bool tensor of
    the pairs *not* allowed, or None when all are."""
    rows: tuple[tuple[int, int, tuple[tuple[int, int, torch.Tensor | None], ...]], ...]
    num_keys: int

    def tiles(self) -> int:
        """(query tile, key tile) pairs visited (the tests count the tiles a window skips)."""
        return sum(len(keys) for _, _, keys in self.rows)

    def empty(self) -> bool:
        """Whether no query sees any key (a ring step wholly outside a sliding window)."""
        return not any(keys for _, _, keys in self.rows)

    def pairs(self) -> int:
        """(query, key) pairs computed, per sample and head (the work, for benches and tests)."""
        return sum((q1 - q0) * (k1 - k0) for q0, q1, keys in self.rows for k0, k1, _ in keys)


def _grouped(x: torch.Tensor, k_heads: int, rows: slice) -> torch.Tensor:
    """(b, n, s, d) query-shaped -> rows ``rows`` as (b, k, g·t, d) fp32: a kv head's g query heads
    stacked."""
    b, n, _, d = x.shape
    part = x.view(b, k_heads, n // k_heads, x.shape[2], d)[:, :, :, rows]  # (b, k, g, t, d)
    return part.reshape(b, k_heads, -1, d).float()  # (b, k, g·t, d)


def _scores(qt: torch.Tensor, k: torch.Tensor, k0: int, k1: int, blocked, scale: float,
            g: int) -> torch.Tensor:
    """Masked scores of a query tile against keys k0..k1-1: (b, k, g·t, t_k) fp32."""
    s = torch.matmul(qt, k[:, :, k0:k1].float().transpose(-1, -2)).mul_(scale)  # (b, k, g·t, t_k)
    if blocked is not None:
        b, heads, rows, cols = s.shape
        # the same mask for every head
        s.view(b, heads, g, rows // g, cols).masked_fill_(blocked, -math.inf)
    return s


def tile_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 plan: TilePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ / √d, masked by ``plan``) v of (b, n, s_q, d) queries against (b, k, s_k, d)
    keys and values, tile by tile: the output (b, n, s_q, d) and the log-sum-exp of each query's
    scores (b, n, s_q), both fp32. A query none of whose keys is allowed gets 0 and -inf: the
    neutral element of :func:`merge_partial`, which combines attention over several key blocks."""
    b, n, s_q, d = q.shape
    heads, g, scale = k.shape[1], n // k.shape[1], 1.0 / math.sqrt(d)
    out = torch.zeros(b, heads, g, s_q, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, heads, g, s_q), -math.inf, dtype=torch.float32, device=q.device)
    for q0, q1, keys in plan.rows:
        if not keys:
            continue
        qt = _grouped(q, heads, slice(q0, q1))  # (b, k, g·t, d)
        run_max = torch.full((*qt.shape[:3], 1), -math.inf, device=q.device)  # (b, k, g·t, 1)
        run_sum = torch.zeros_like(run_max)
        acc = torch.zeros_like(qt)  # (b, k, g·t, d)
        for k0, k1, blocked in keys:
            s = _scores(qt, k, k0, k1, blocked, scale, g)  # (b, k, g·t, t_k)
            new_max = torch.maximum(run_max, s.amax(-1, keepdim=True))
            # a row none of whose keys so far is allowed keeps max -inf: subtract 0 there, not inf -
            # inf
            shift = new_max.masked_fill(new_max == -math.inf, 0.0)
            p = s.sub_(shift).exp_()  # (b, k, g·t, t_k) unnormalized probabilities
            rescale = (run_max - shift).exp_()
            run_sum = run_sum.mul_(rescale).add_(p.sum(-1, keepdim=True))
            acc = acc.mul_(rescale).add_(torch.matmul(p, v[:, :, k0:k1].float()))
            run_max = new_max
        t = q1 - q0
        out[:, :, :,
            q0:q1] = acc.div_(run_sum.clamp_min(torch.finfo(torch.float32).tiny)).view(b, heads, g,
                                                                                       t, d)
        # -inf where nothing is allowed
        lse[:, :, :, q0:q1] = run_max.add_(run_sum.log_()).view(b, heads, g, t)
    return out.view(b, n, s_q, d), lse.view(b, n, s_q)


def tile_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                  lse: torch.Tensor, delta: torch.Tensor,
                  plan: TilePlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (fp32) of q (b, n, s_q, d), k and v (b, k, s_k, d) for the keys ``plan`` lists,
    given ``grad_out`` (b, n, s_q, d) and the log-sum-exp ``lse`` (b, n, s_q) and ``delta`` =
    rowsum(dO · O) (b, n, s_q, 1) of the *whole* attention the output came from: the key blocks
    of a merged attention (:func:`merge_partial`) each give their share of the gradients this way
    (FlashAttention-2's backward)."""
    b, n, s_q, d = q.shape
    heads, g, scale = k.shape[1], n // k.shape[1], 1.0 / math.sqrt(d)
    lse = lse.view(b, n, s_q, 1)
    grad_q = torch.zeros(b, heads, g, s_q, d, dtype=torch.float32, device=q.device)
    grad_k = torch.zeros(k.shape, dtype=torch.float32, device=k.device)  # (b, k, s_k, d)
    grad_v = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for q0, q1, keys in plan.rows:
        if not keys:
            continue
        rows = slice(q0, q1)
        qt, dot = _grouped(q, heads, rows), _grouped(grad_out, heads, rows)  # (b, k, g·t, d)
        lse_t, delta_t = _grouped(lse, heads, rows), _grouped(delta, heads, rows)  # (b, k, g·t, 1)
        dq = torch.zeros_like(qt)
        for k0, k1, blocked in keys:
            # (b, k, g·t, t_k) probabilities
            p = _scores(qt, k, k0, k1, blocked, scale, g).sub_(lse_t).exp_()
            # (b, k, t_k, d): summed over g·t
            grad_v[:, :, k0:k1] += torch.matmul(p.transpose(-1, -2), dot)
            dp = torch.matmul(dot, v[:, :, k0:k1].float().transpose(-1, -2))  # (b, k, g·t, t_k)
            ds = p.mul_(dp.sub_(delta_t)).mul_(scale)  # d loss / d scores
            dq += torch.matmul(ds, k[:, :, k0:k1].float())
            grad_k[:, :, k0:k1] += torch.matmul(ds.transpose(-1, -2), qt)
        grad_q[:, :, :, rows] = dq.view(b, heads, g, q1 - q0, d)
    return grad_q.view(b, n, s_q, d), grad_k, grad_v


def merge_partial(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor,
                  part_lse: torch.Tensor) -> None:
    """Fold the attention ``part`` (b, n, s_q, d) over another block of keys, with its log-sum-exp
    ``part_lse`` (b, n, s_q), into ``out`` and ``lse`` in place (fp32): the online softmax across
    blocks. -inf log-sum-exps (no key allowed yet) weigh nothing."""
    merged = torch.logaddexp(lse, part_lse)  # (b, n, s_q)
    base = merged.masked_fill(merged == -math.inf, 0.0)
    out.mul_((lse - base).exp_().unsqueeze(-1)).add_(part * (part_lse - base).exp_().unsqueeze(-1))
    lse.copy_(merged)


class BlockwiseAttention(torch.autograd.Function):
    """softmax(q kᵀ / √d, masked by ``plan``) v, tile by tile (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: TilePlan):
        out, lse = tile_forward(q, k, v, plan)
        out = out.to(q.dtype)  # (b, n, s_q, d)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        # (b, n, s_q, 1): rowsum(dO · O)
        delta = (grad_out.float() * out.float()).sum(-1, keepdim=True)
        grad_q, grad_k, grad_v = tile_backward(q, k, v, grad_out, lse, delta, ctx.plan)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        plan: TilePlan) -> torch.Tensor:
    """(b, n, s_q, d) queries against (b, k, s_k, d) keys and values under ``plan``'s mask ->
    (b, n, s_q, d)."""
    if k.shape[2] != plan.num_keys:
        raise ValueError(f"a plan for {plan.num_keys} keys got {k.shape[2]}")
    return BlockwiseAttention.apply(q, k, v, plan)
