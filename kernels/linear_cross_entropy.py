"""Output layer + cross entropy over chunks of tokens, so the (tokens, v/tp) logits never exist.

For a 128k vocabulary the logits (and their gradient) are the largest activation of the whole
model. Here the tokens are processed a chunk at a time: the chunk's logits are computed into one
chunk-sized buffer, the cross entropy phases of :mod:`.cross_entropy` (Triton on CUDA) turn them
into the loss and, in place, into their gradient, and two matmuls fold that gradient into
d loss / d x for the chunk and the running d loss / d weight. The forward
therefore leaves the gradients ready, as Liger-Kernel's and Apple's Cut Cross-Entropy's do, and
the backward only scales them by the incoming gradient: no logits are kept.

That requires the per-token weights of the loss up front: the result is the scalar
Σ_t loss_weight_t · loss_t (pass loss_mask / num_tokens for a masked mean). Vocab-parallel: each tp
rank holds its rows (v/tp, h) of the output layer and the replicated x; the per-chunk statistics
are all-reduced over tp as in the unchunked loss, so every rank gets the same loss. The gradient
for x is this rank's partial sum, as from ``F.linear`` on a vocab shard: the caller's mapping into
the tp region (all-reduce, or reduce-scatter with sequence parallelism) completes it.

:func:`linear_cross_entropy_reference` is the same chunked algorithm with the torch phases, so the
CPU path gets the same memory saving.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .cross_entropy import _phases, _valid, combine_stats

if TYPE_CHECKING:
    from ..parallel.state import Group

CHUNK_BYTES = {"cpu": 16 << 20, "default": 512 << 20}  # bytes of one chunk's logits, by device type


def default_chunk_rows(vocab_local: int, dtype: torch.dtype, device: torch.device) -> int:
    """Tokens per chunk: the chunk's logits fill about CHUNK_BYTES."""
    size = CHUNK_BYTES.get(device.type, CHUNK_BYTES["default"])
    return max(1, size // (max(vocab_local, 1) * torch.finfo(dtype).bits // 8))


def _chunked(x2d, weight, targets, loss_weight, group, vocab_start, real_vocab, ignore_index, z_loss,
             rows_per_chunk, accum_dtype, need_x: bool, need_w: bool, reference: bool):
    """Loss (0-d fp32) and, when asked, d loss / d x (n, h) and d loss / d weight (v/tp, h)."""
    stats_phase, grad_phase = _phases(reference)
    n, vocab_local = x2d.shape[0], weight.shape[0]
    valid = _valid(vocab_local, vocab_start, real_vocab)
    buf = x2d.new_empty(min(rows_per_chunk, n), vocab_local)  # the only logits-shaped buffer
    grad_x = torch.empty_like(x2d) if need_x else None
    grad_w = torch.zeros(weight.shape, dtype=accum_dtype, device=weight.device) if need_w else None
    tmp_w = torch.empty_like(weight) if need_w and weight.dtype != accum_dtype else None
    total = x2d.new_zeros((), dtype=torch.float32)
    for i in range(0, n, rows_per_chunk):
        x_c, t_c, w_c = x2d[i:i + rows_per_chunk], targets[i:i + rows_per_chunk], loss_weight[i:i + rows_per_chunk]
        logits = buf[: x_c.shape[0]]
        torch.mm(x_c, weight.t(), out=logits)  # (chunk, v/tp)
        stats = stats_phase(logits, t_c, vocab_start, valid, ignore_index)
        loss, lse = combine_stats(stats, t_c, group, vocab_start, valid, ignore_index, z_loss)  # (chunk,)
        total += (loss * w_c).sum()
        if not (need_x or need_w):
            continue
        grad_phase(logits, t_c, lse, w_c.masked_fill(t_c == ignore_index, 0.0), z_loss, vocab_start, valid)
        if need_x:
            torch.mm(logits, weight, out=grad_x[i:i + rows_per_chunk])  # (chunk, h), partial over tp
        if tmp_w is None and need_w:
            grad_w.addmm_(logits.t(), x_c)  # (v/tp, h)
        elif need_w:
            grad_w.add_(torch.mm(logits.t(), x_c, out=tmp_w))  # low-precision product, wider sum
    return total, grad_x, grad_w


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, loss_weight, group, vocab_start, real_vocab, ignore_index, z_loss,
                rows_per_chunk, accum_dtype, reference):
        x2d = x.reshape(-1, x.shape[-1])  # (b·s, h)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total, grad_x, grad_w = _chunked(x2d, weight, targets.reshape(-1), loss_weight, group, vocab_start,
                                         real_vocab, ignore_index, z_loss, rows_per_chunk, accum_dtype, need_x,
                                         need_w, reference)
        ctx.save_for_backward(grad_x.view(x.shape) if need_x else None, grad_w)  # no logits
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_x, grad_w = ctx.saved_tensors
        if grad_x is not None:
            grad_x = grad_x.mul_(grad_total.to(grad_x.dtype))
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_total).to(ctx.weight_dtype)
        return grad_x, grad_w, None, None, None, None, None, None, None, None, None, None


def _apply(x, weight, targets, group, vocab_start, real_vocab, ignore_index, z_loss, loss_weight, rows,
           accum_dtype, reference):
    if real_vocab is None:
        real_vocab = weight.shape[0] * (group.size if group is not None else 1)
    if loss_weight is None:
        loss_weight = torch.ones(targets.numel(), dtype=torch.float32, device=x.device)
    if loss_weight.numel() != targets.numel():
        raise ValueError(f"loss_weight {tuple(loss_weight.shape)} must match targets {tuple(targets.shape)}")
    rows = rows or default_chunk_rows(weight.shape[0], x.dtype, x.device)
    return _LinearCrossEntropy.apply(x, weight, targets, loss_weight.reshape(-1).float(), group, vocab_start,
                                     real_vocab, ignore_index, z_loss, rows, accum_dtype or weight.dtype,
                                     reference)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         group: Group | None = None, vocab_start: int = 0, real_vocab: int | None = None,
                         ignore_index: int = -100, z_loss: float = 0.0, loss_weight: torch.Tensor | None = None,
                         chunk_rows: int | None = None, accum_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Σ_t loss_weight_t · cross_entropy(x_t · weightᵀ, target_t), a 0-d fp32 tensor.

    ``x`` (b, s, h) replicated over tp, ``weight`` (v/tp, h) this rank's output rows, ``targets``
    (b, s) global ids; ``loss_weight`` (b, s) defaults to ones. Ignored targets add nothing.
    d loss / d weight is summed over the chunks in ``accum_dtype`` (default the weight's dtype, as
    Liger-Kernel does; float32 costs an fp32 copy of the weight and rounds once instead of per chunk).
    """
    return _apply(x, weight, targets, group, vocab_start, real_vocab, ignore_index, z_loss, loss_weight,
                  chunk_rows, accum_dtype, False)


def linear_cross_entropy_reference(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                   group: Group | None = None, vocab_start: int = 0,
                                   real_vocab: int | None = None, ignore_index: int = -100,
                                   z_loss: float = 0.0, loss_weight: torch.Tensor | None = None,
                                   chunk_rows: int | None = None,
                                   accum_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`linear_cross_entropy` with the torch cross entropy phases, on any device."""
    return _apply(x, weight, targets, group, vocab_start, real_vocab, ignore_index, z_loss, loss_weight,
                  chunk_rows, accum_dtype, True)
