"""Cross entropy over (rows, v/tp) logits in two Triton kernels, gradient written over the logits.

Phase one reads each row of this rank's vocabulary slice once and leaves three numbers per row: its
max, the sum of exp(logit - max) (an online softmax over column blocks) and the target's logit.
Between the phases the vocab-parallel form all-reduces those over tp, exactly as
``megapretrain/parallel/cross_entropy.py`` does: the max, the sums rescaled to it, the target logit.
Phase two, in the backward, reads each logit once more and writes
d loss / d logit = grad · (softmax · (1 + 2·z·lse) - onehot(target)) over it, so no second
vocabulary-sized buffer exists (the optional z-loss adds z · lse² per row). Columns at or beyond
``real_vocab`` (vocabulary padding) are outside the softmax and get a zero gradient; rows whose
target is ``ignore_index`` get loss 0 and no gradient.

Each phase has a torch twin with the same signature (row chunks of a few MB of fp32, so no fp32
copy of the logits exists on CPU either); :func:`cross_entropy_reference` is the whole loss built
from them. The phases are also what :mod:`.linear_cross_entropy` runs on each chunk of tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ._triton import jit, next_pow2, tl, to_dtype, use_triton

if TYPE_CHECKING:
    from ..parallel.state import Group

CHUNK_BYTES = 8 << 20  # fp32 bytes per row chunk of the torch phases (stays in a CPU's cache)


@jit
def _ce_stats_kernel(logits_ptr, targets_ptr, max_ptr, sum_exp_ptr, target_logit_ptr, stride, width,
                     valid, vocab_start, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    row_max = tl.full([], float("-inf"), tl.float32)
    sum_exp = tl.zeros([], tl.float32)
    for v0 in range(0, valid, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        # loaded up to the (padded, 16-divisible) width so the loads stay 128-bit, then masked to
        # valid
        x = tl.load(base + cols, mask=cols < width, other=float("-inf")).to(tl.float32)  # (BV,)
        x = tl.where(cols < valid, x, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(x, axis=0))  # finite: every block has a valid column
        sum_exp = sum_exp * tl.exp(row_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        row_max = new_max
    target = tl.load(targets_ptr + row)
    local = target - vocab_start
    mine = (target != ignore_index) & (local >= 0) & (local < valid)
    target_logit = tl.load(base + local, mask=mine, other=0.0).to(tl.float32)
    tl.store(max_ptr + row, row_max)
    tl.store(sum_exp_ptr + row, sum_exp)
    tl.store(target_logit_ptr + row, target_logit)


@jit
def _ce_grad_kernel(logits_ptr, targets_ptr, lse_ptr, scale_ptr, stride, width, valid, vocab_start,
                    z_loss, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row)  # incoming grad; 0 for ignored rows
    coef = 1.0 + 2.0 * z_loss * lse  # the z-loss scales the softmax term
    local = tl.load(targets_ptr + row) - vocab_start
    for v0 in range(0, width, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        # (BV,) 128-bit loads, as above
        x = tl.load(base + cols, mask=cols < width, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) * coef - tl.where(cols == local, 1.0, 0.0)
        g = tl.where(cols < valid, g * scale, 0.0)  # padding columns: 0
        tl.store(base + cols, to_dtype(g, logits_ptr.dtype.element_ty), mask=cols < width)


def _block_v(width: int) -> int:
    return max(16, min(4096, next_pow2(width)))


def _triton_stats(logits, targets, vocab_start: int, valid: int, ignore_index: int):
    rows = logits.shape[0]
    stats = [torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3)]
    if rows:
        _ce_stats_kernel[(rows,)](logits, targets, *stats, logits.stride(0), logits.shape[1], valid,
                                  vocab_start, ignore_index, BLOCK_V=_block_v(valid), num_warps=8)
    return tuple(stats)


def _triton_grad_(logits, targets, lse, scale, z_loss: float, vocab_start: int, valid: int) -> None:
    rows, width = logits.shape
    if rows:
        _ce_grad_kernel[(rows,)](logits, targets, lse, scale, logits.stride(0), width, valid,
                                 vocab_start, z_loss, BLOCK_V=_block_v(width), num_warps=8)


def _row_blocks(logits, valid: int):
    """(start, end, fp32 copy of those rows' first ``valid`` columns) over the rows of ``logits``,
    the copies made in one reused buffer of about CHUNK_BYTES."""
    rows = logits.shape[0]
    step = max(1, CHUNK_BYTES // (4 * max(valid, 1)))
    work = logits.new_empty(min(step, rows), valid, dtype=torch.float32)
    for i in range(0, rows, step):
        j = min(i + step, rows)
        yield i, j, work[: j - i].copy_(logits[i:j, :valid])  # (block, valid)


def _torch_stats(logits, targets, vocab_start: int, valid: int, ignore_index: int):
    rows = logits.shape[0]
    row_max = logits.new_full((rows,), float("-inf"), dtype=torch.float32)
    sum_exp = logits.new_zeros((rows,), dtype=torch.float32)
    for i, j, w in _row_blocks(logits, valid) if valid else ():
        row_max[i:j] = w.amax(-1)
        sum_exp[i:j] = w.sub_(row_max[i:j, None]).exp_().sum(-1)
    local = targets - vocab_start
    mine = (targets != ignore_index) & (local >= 0) & (local < valid)
    target_logit = logits.gather(-1, local.masked_fill(~mine, 0)[:, None]).squeeze(-1).float()
    return row_max, sum_exp, target_logit.masked_fill(~mine, 0.0)


def _torch_grad_(logits, targets, lse, scale, z_loss: float, vocab_start: int, valid: int) -> None:
    local = targets - vocab_start
    coef = 1.0 + 2.0 * z_loss * lse  # (rows,)
    # a rank of padding columns alone: none
    for i, j, w in _row_blocks(logits, valid) if valid else ():
        w.sub_(lse[i:j, None]).exp_().mul_(coef[i:j, None])  # softmax, scaled for the z-loss
        hit = (local[i:j] >= 0) & (local[i:j] < valid)
        # minus one at the target of each row that has it here (others add -0: no data-dependent
        # shapes)
        w.scatter_add_(1, local[i:j].masked_fill(~hit, 0)[:, None], -hit.to(w.dtype)[:, None])
        logits[i:j, :valid] = w.mul_(scale[i:j, None])
    logits[:, valid:] = 0.0  # padding columns: no gradient


def torch_loss_grad_(logits, targets, scale, z_loss: float, vocab_start: int, valid: int,
                     ignore_index: int):
    """Both torch phases and :func:`combine_stats` in one pass, for logits not split over tp: the
    per-row loss and log-sum-exp (rows,) fp32, and ``scale`` · d loss / d logits written over the
    (rows, v) ``logits``. The same numbers as the phases (to rounding); each row block is read,
    exponentiated and written once, where the two phases do it twice. Ignored rows get loss 0 and
    no gradient; ``valid`` ≥ 1."""
    rows = logits.shape[0]
    local = targets - vocab_start
    ignored = targets == ignore_index
    scale = scale.masked_fill(ignored, 0.0)  # (rows,)
    mine = ~ignored & (local >= 0) & (local < valid)
    local = local.masked_fill(~mine, 0)
    # (rows,), before it is overwritten
    target_logit = logits.gather(-1, local[:, None]).squeeze(-1).float()
    row_max, log_sum = (logits.new_empty(rows, dtype=torch.float32) for _ in range(2))
    for i, j, w in _row_blocks(logits, valid):
        row_max[i:j] = w.amax(-1)
        sum_exp = w.sub_(row_max[i:j, None]).exp_().sum(-1)  # (chunk,)
        log_sum[i:j] = sum_exp.log()
        # the z-loss scales the softmax term
        coef = 1.0 + 2.0 * z_loss * (row_max[i:j] + log_sum[i:j])
        w.mul_((scale[i:j] * coef / sum_exp)[:, None])  # scale · softmax · coef
        # minus the scale at each row's target (rows without one here add -0: no data-dependent
        # shapes)
        w.scatter_add_(1, local[i:j, None],
                       -scale[i:j].masked_fill(~mine[i:j], 0.0).to(w.dtype)[:, None])
        logits[i:j, :valid] = w
    logits[:, valid:] = 0.0  # padding columns: no gradient
    lse = row_max + log_sum
    loss = log_sum - (target_logit - row_max).masked_fill(~mine, 0.0)
    if z_loss:
        loss = loss + z_loss * lse.square()
    return loss.masked_fill(ignored, 0.0), lse


@torch.library.custom_op("megapretrain::cross_entropy_stats", mutates_args=())
def cross_entropy_stats(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, valid: int,
                        ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Phase one for (rows, v/tp) logits: per-row max, Σ exp(logit - max), target logit (0 if the
    target is not in this rank's first ``valid`` columns or is ignored), all fp32 (rows,)."""
    impl = _triton_stats if use_triton(logits.device.type) else _torch_stats
    return impl(logits, targets, vocab_start, valid, ignore_index)


@cross_entropy_stats.register_fake
def _(logits, targets, vocab_start, valid, ignore_index):
    return tuple(logits.new_empty(logits.shape[0], dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("megapretrain::cross_entropy_grad_", mutates_args=("logits",))
def cross_entropy_grad_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                        scale: torch.Tensor, z_loss: float, vocab_start: int, valid: int) -> None:
    """Phase two: overwrite (rows, v/tp) ``logits`` with scale · (softmax · (1 + 2·z·lse) - onehot),
    given the global log-sum-exp ``lse`` and per-row ``scale`` (0 for ignored rows), both
    (rows,)."""
    impl = _triton_grad_ if use_triton(logits.device.type) else _torch_grad_
    impl(logits, targets, lse, scale, z_loss, vocab_start, valid)


@cross_entropy_grad_.register_fake
def _(logits, targets, lse, scale, z_loss, vocab_start, valid):
    return None


def combine_stats(stats, targets: torch.Tensor, group: Group | None, vocab_start: int, valid: int,
                  ignore_index: int, z_loss: float):
    """All-reduce phase one's per-rank statistics over tp; return the per-row loss and global
    log-sum-exp (rows,) fp32. Ignored rows get loss 0."""
    row_max, sum_exp, target_logit = stats
    local = targets - vocab_start
    not_mine = (targets == ignore_index) | (local < 0) | (local >= valid)
    global_max = row_max
    if group is not None and group.size > 1:
        global_max = group.all_reduce(row_max.clone(), op=dist.ReduceOp.MAX)
        # rescaled to the global max
        sum_exp = group.all_reduce(sum_exp * torch.exp(row_max - global_max))
    target_logit = (target_logit - global_max).masked_fill(not_mine, 0.0)
    if group is not None and group.size > 1:
        group.all_reduce(target_logit)
    log_sum = torch.log(sum_exp)
    lse = global_max + log_sum
    loss = log_sum - target_logit
    if z_loss:
        loss = loss + z_loss * lse.square()
    return loss.masked_fill(targets == ignore_index, 0.0), lse


def _valid(width: int, vocab_start: int, real_vocab: int) -> int:
    return min(width, max(real_vocab - vocab_start, 0))  # this rank's non-padding columns


def _phases(reference: bool):
    if reference:
        return _torch_stats, _torch_grad_
    return cross_entropy_stats, cross_entropy_grad_


def _forward(logits2d, targets1d, group, vocab_start, real_vocab, ignore_index, z_loss, reference):
    valid = _valid(logits2d.shape[1], vocab_start, real_vocab)
    stats = _phases(reference)[0](logits2d, targets1d, vocab_start, valid, ignore_index)
    return combine_stats(stats, targets1d, group, vocab_start, valid, ignore_index, z_loss)


def _backward(grad_loss, logits2d, targets1d, lse, vocab_start, real_vocab, ignore_index, z_loss,
              inplace: bool, reference: bool):
    """d loss / d logits (rows, v/tp): written over ``logits2d`` when ``inplace``."""
    buf = logits2d if inplace and logits2d.stride(-1) == 1 else logits2d.contiguous().clone()
    scale = grad_loss.reshape(-1).float().masked_fill(targets1d == ignore_index, 0.0)  # (rows,)
    valid = _valid(buf.shape[1], vocab_start, real_vocab)
    _phases(reference)[1](buf, targets1d, lse, scale, z_loss, vocab_start, valid)
    return buf


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """The loss over tp ranks' vocabulary slices (a group cannot pass through a custom op)."""

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, real_vocab, ignore_index, z_loss, inplace,
                reference):
        # (b·s, v/tp)
        logits2d, targets1d = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        loss, lse = _forward(logits2d, targets1d, group, vocab_start, real_vocab, ignore_index,
                             z_loss, reference)
        # inputs, not views made here (autograd forbids those)
        ctx.save_for_backward(logits, targets, lse)
        ctx.args = (vocab_start, real_vocab, ignore_index, z_loss, inplace, reference)
        return loss.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, targets, lse = ctx.saved_tensors
        grad = _backward(grad_loss, logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), lse,
                         *ctx.args)
        return grad.view(logits.shape), None, None, None, None, None, None, None, None


@torch.library.custom_op("megapretrain::cross_entropy", mutates_args=())
def _cross_entropy_op(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                      real_vocab: int, ignore_index: int, z_loss: float,
                      inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits2d, targets1d = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    loss, lse = _forward(logits2d, targets1d, None, vocab_start, real_vocab, ignore_index, z_loss,
                         False)
    return loss.view(targets.shape), lse


@_cross_entropy_op.register_fake
def _(logits, targets, vocab_start, real_vocab, ignore_index, z_loss, inplace):
    rows = targets.numel()
    return targets.new_empty(targets.shape,
                             dtype=torch.float32), logits.new_empty(rows, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    logits, targets, *args = inputs
    ctx.save_for_backward(logits, targets, output[1])
    ctx.args = tuple(args)


def _op_backward(ctx, grad_loss, grad_lse):
    logits, targets, lse = ctx.saved_tensors
    vocab_start, real_vocab, ignore_index, z_loss, inplace = ctx.args
    grad = _backward(grad_loss, logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), lse,
                     vocab_start, real_vocab, ignore_index, z_loss, inplace, False)
    return grad.view(logits.shape), None, None, None, None, None, None


_cross_entropy_op.register_autograd(_op_backward, setup_context=_setup_context)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: Group | None = None,
                  vocab_start: int = 0, real_vocab: int | None = None, ignore_index: int = -100,
                  z_loss: float = 0.0, inplace_grad: bool = True) -> torch.Tensor:
    """Per-token loss (b, s) fp32 from this rank's logits (b, s, v/tp) and global ``targets`` (b,
    s).

    ``vocab_start`` is this rank's first vocabulary id, ``real_vocab`` the unpadded vocabulary size
    (default: every column is real). With ``inplace_grad`` the backward writes the gradient over the
    logits (whose values are gone after it); autograd's version check stops any other user of the
    logits that would read them later. One rank (``group`` None or of size 1) is one custom op.
    """
    if real_vocab is None:
        real_vocab = logits.shape[-1] * (group.size if group is not None else 1)
    if group is None or group.size == 1:
        return _cross_entropy_op(logits, targets, vocab_start, real_vocab, ignore_index, z_loss,
                                 inplace_grad)[0]
    return _VocabParallelCrossEntropy.apply(logits, targets, group, vocab_start, real_vocab,
                                            ignore_index, z_loss, inplace_grad, False)


def cross_entropy_reference(logits: torch.Tensor, targets: torch.Tensor, group: Group | None = None,
                            vocab_start: int = 0, real_vocab: int | None = None,
                            ignore_index: int = -100, z_loss: float = 0.0,
                            inplace_grad: bool = True) -> torch.Tensor:
    """:func:`cross_entropy` with the torch phases, on any device."""
    if real_vocab is None:
        real_vocab = logits.shape[-1] * (group.size if group is not None else 1)
    return _VocabParallelCrossEntropy.apply(logits, targets, group, vocab_start, real_vocab,
                                            ignore_index, z_loss, inplace_grad, True)
