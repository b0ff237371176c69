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

Memory, beyond the gradients themselves: one chunk of logits, and with the torch phases a few MB
of fp32 rows. d loss / d weight is summed in place in the weight's dtype (each chunk's product is
added by one ``addmm_``, which rounds once per chunk: over 8 chunks of bf16 the relative error is
1.1e-3 against 1.0e-3 for one unchunked matmul), or in ``accum_dtype``. Chunks are as large as
``CHUNK_BYTES`` of logits allows but on CPU at least ``MIN_ROWS`` tokens, below which each matmul
spends more time re-packing the weight than multiplying (2048 × 512 × 50304 in bf16 on 2 cores:
64-token chunks take 3× as long as 256-token ones), and of equal size.

:func:`chunked_loss_and_grads` can instead add d loss / d weight into a wider buffer it is given
(the weight's fp32 main grad in training, ``model/fused_loss.py``): each chunk's product is made a
tile of ``ACCUM_TILE_ROWS`` vocabulary rows at a time and added, so no weight-sized gradient exists
(on 2 CPU cores as fast as summing in bf16 and folding the sum into the main grad afterwards).

:func:`linear_cross_entropy_reference` is the same chunked algorithm with the torch phases (on one
rank, fused into one pass per row block), so the CPU path gets the same memory saving.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._triton import cdiv
from .cross_entropy import _phases, _valid, combine_stats, torch_loss_grad_
from .dispatch import device_type

if TYPE_CHECKING:
    from ..parallel.state import Group

CHUNK_BYTES = {"cpu": 16 << 20, "default": 512 << 20}  # bytes of one chunk's logits, by device type
MIN_ROWS = {"cpu": 256, "default": 1}  # tokens per chunk at least, by device type
ACCUM_TILE_ROWS = 2048  # vocabulary rows per product folded into a wider weight gradient


def default_chunk_rows(tokens: int, vocab_local: int, dtype: torch.dtype,
                       device: torch.device) -> int:
    """Tokens per chunk for ``tokens`` tokens: the chunk's logits fill about CHUNK_BYTES (but hold
    at least MIN_ROWS tokens), and the chunks are of equal size."""
    kind = device_type(device) if device_type(device) in CHUNK_BYTES else "default"
    row_bytes = max(vocab_local, 1) * torch.finfo(dtype).bits // 8
    rows = max(1, MIN_ROWS[kind], CHUNK_BYTES[kind] // row_bytes)
    return cdiv(tokens, cdiv(tokens, rows)) if tokens else 1


def _chunk_loss_(logits, targets, scale, group, vocab_start, valid, ignore_index, z_loss, reference,
                 grad: bool, lse=None):
    """One chunk's loss and log-sum-exp (chunk,); with ``grad`` the (chunk, v/tp) logits become
    scale · d loss / d logits. Given ``lse`` (a recomputation), only the gradient is made."""
    single = group is None or group.size == 1
    if lse is None and grad and reference and single and valid:
        return torch_loss_grad_(logits, targets, scale, z_loss, vocab_start, valid, ignore_index)
    stats_phase, grad_phase = _phases(reference)
    loss = None
    if lse is None:
        stats = stats_phase(logits, targets, vocab_start, valid, ignore_index)
        loss, lse = combine_stats(stats, targets, group, vocab_start, valid, ignore_index, z_loss)
    if grad:
        grad_phase(logits, targets, lse, scale, z_loss, vocab_start, valid)
    return loss, lse


def _add_product(acc, a, b, accum_dtype, tmp):
    """acc + a @ b, summed in ``accum_dtype`` (acc None: the first chunk's product)."""
    if acc is None and a.dtype == accum_dtype:
        return torch.mm(a, b)  # (v/tp, h)
    if acc is None:
        acc = a.new_zeros(a.shape[0], b.shape[1], dtype=accum_dtype)  # (v/tp, h)
    _accumulate_product(acc, a, b, tmp)
    return acc


def _accumulate_product(out, a, b, tmp):
    """out += a @ b. For a wider ``out`` than the operands (an fp32 sum or main grad) tile by tile
    of ``tmp``'s rows, so the low-precision product never exists whole."""
    if out.dtype == a.dtype:
        out.addmm_(a, b)
        return
    step = tmp.shape[0]
    for i in range(0, out.shape[0], step):
        j = min(i + step, out.shape[0])
        out[i:j].add_(torch.mm(a[i:j], b, out=tmp[: j - i]))


def chunked_loss_and_grads(x2d, weight, targets, scale, group, vocab_start, real_vocab,
                           ignore_index, z_loss, rows, need_x: bool, need_w: bool, reference: bool,
                           accum_dtype=None, lse=None, grad_w_out=None):
    """Per-token loss and log-sum-exp (n,) fp32 and, when asked, the gradients of Σ_t scale_t ·
    loss_t: d/dx (n, h), this rank's partial sum over tp, and d/dweight (v/tp, h) in ``accum_dtype``
    (default the weight's). Given ``lse`` (n,) from an earlier pass, only the gradients are made
    (the loss returned is None). Given ``grad_w_out`` (v/tp, h), typically the weight's fp32 main
    grad, d/dweight is added into it chunk by chunk instead (and None returned): no weight-sized
    gradient is allocated."""
    n, vocab_local = x2d.shape[0], weight.shape[0]
    valid = _valid(vocab_local, vocab_start, real_vocab)
    accum_dtype = accum_dtype or weight.dtype
    grad = need_x or need_w
    scale = scale.masked_fill(targets == ignore_index, 0.0)  # (n,) ignored rows: no gradient
    buf = x2d.new_empty(min(rows, n), vocab_local)  # the only logits-shaped buffer
    loss_out = None if lse is not None else x2d.new_empty(n, dtype=torch.float32)
    lse_out = lse if lse is not None else x2d.new_empty(n, dtype=torch.float32)
    grad_x = torch.empty_like(x2d) if need_x else None
    grad_w = None
    sum_dtype = grad_w_out.dtype if grad_w_out is not None else accum_dtype
    wider = need_w and x2d.dtype != sum_dtype  # each product is made a tile at a time, then added
    # (tile, h)
    tmp_w = x2d.new_empty(min(ACCUM_TILE_ROWS, vocab_local), weight.shape[1]) if wider else None
    for i in range(0, n, rows):
        x_c, t_c, s_c = x2d[i:i + rows], targets[i:i + rows], scale[i:i + rows]
        logits = torch.mm(x_c, weight.t(), out=buf[: x_c.shape[0]])  # (chunk, v/tp)
        loss, lse_c = _chunk_loss_(logits, t_c, s_c, group, vocab_start, valid, ignore_index,
                                   z_loss, reference, grad, None if lse is None
                                   else lse[i:i + rows])
        if loss is not None:
            loss_out[i:i + rows], lse_out[i:i + rows] = loss, lse_c
        if need_x:
            torch.mm(logits, weight, out=grad_x[i:i + rows])  # (chunk, h), partial over tp
        if need_w and grad_w_out is not None:
            _accumulate_product(grad_w_out, logits.t(), x_c, tmp_w)  # (v/tp, h) += this chunk's
        elif need_w:
            grad_w = _add_product(grad_w, logits.t(), x_c, accum_dtype, tmp_w)  # (v/tp, h)
    if need_w and grad_w_out is not None:
        return loss_out, lse_out, grad_x, None
    if need_w and grad_w is None:  # no tokens
        grad_w = torch.zeros(weight.shape, dtype=accum_dtype, device=weight.device)
    return loss_out, lse_out, grad_x, grad_w


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, loss_weight, group, vocab_start, real_vocab, ignore_index,
                z_loss, rows, accum_dtype, reference, grad_enabled):
        x2d, t1d = x.reshape(-1, x.shape[-1]), targets.reshape(-1)  # (b·s, h), (b·s,)
        need_x, need_w = grad_enabled and ctx.needs_input_grad[0], grad_enabled \
            and ctx.needs_input_grad[1]
        loss, _, grad_x, grad_w = chunked_loss_and_grads(x2d, weight, t1d, loss_weight, group,
                                                         vocab_start, real_vocab, ignore_index,
                                                         z_loss, rows, need_x, need_w, reference,
                                                         accum_dtype)
        ctx.save_for_backward(grad_x.view(x.shape) if need_x else None, grad_w)  # no logits
        ctx.weight_dtype = weight.dtype
        return (loss * loss_weight).sum()  # ignored rows have loss 0

    @staticmethod
    def backward(ctx, grad_total):
        grad_x, grad_w = ctx.saved_tensors
        if grad_x is not None:
            grad_x = grad_x.mul_(grad_total.to(grad_x.dtype))
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_total).to(ctx.weight_dtype)
        return grad_x, grad_w, None, None, None, None, None, None, None, None, None, None, None


def _apply(x, weight, targets, group, vocab_start, real_vocab, ignore_index, z_loss, loss_weight,
           rows, accum_dtype, reference):
    if real_vocab is None:
        real_vocab = weight.shape[0] * (group.size if group is not None else 1)
    if loss_weight is None:
        loss_weight = torch.ones(targets.numel(), dtype=torch.float32, device=x.device)
    if loss_weight.numel() != targets.numel():
        raise ValueError(f"loss_weight {tuple(loss_weight.shape)} must match targets "
                         f"{tuple(targets.shape)}")
    rows = rows or default_chunk_rows(targets.numel(), weight.shape[0], x.dtype, x.device)
    return _LinearCrossEntropy.apply(x, weight, targets, loss_weight.reshape(-1).float(), group,
                                     vocab_start, real_vocab, ignore_index, z_loss, rows,
                                     accum_dtype or weight.dtype, reference,
                                     torch.is_grad_enabled())


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         group: Group | None = None, vocab_start: int = 0,
                         real_vocab: int | None = None, ignore_index: int = -100,
                         z_loss: float = 0.0, loss_weight: torch.Tensor | None = None,
                         chunk_rows: int | None = None,
                         accum_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Σ_t loss_weight_t · cross_entropy(x_t · weightᵀ, target_t), a 0-d fp32 tensor.

    ``x`` (b, s, h) replicated over tp, ``weight`` (v/tp, h) this rank's output rows, ``targets``
    (b, s) global ids; ``loss_weight`` (b, s) defaults to ones. Ignored targets add nothing.
    d loss / d weight is summed over the chunks in ``accum_dtype`` (default the weight's dtype, as
    Liger-Kernel does; float32 costs an fp32 copy of the weight and rounds once instead of per
    chunk).
    """
    return _apply(x, weight, targets, group, vocab_start, real_vocab, ignore_index, z_loss,
                  loss_weight, chunk_rows, accum_dtype, False)


def linear_cross_entropy_reference(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                   group: Group | None = None, vocab_start: int = 0,
                                   real_vocab: int | None = None, ignore_index: int = -100,
                                   z_loss: float = 0.0, loss_weight: torch.Tensor | None = None,
                                   chunk_rows: int | None = None,
                                   accum_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`linear_cross_entropy` with the torch cross entropy phases, on any device."""
    return _apply(x, weight, targets, group, vocab_start, real_vocab, ignore_index, z_loss,
                  loss_weight, chunk_rows, accum_dtype, True)
