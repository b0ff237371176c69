"""Vocab-parallel cross entropy: each tp rank holds logits for a slice of the vocabulary.

The full logits are never gathered. Three small all-reduces over tp combine the slices: the max
(for stability), the sum of exponentials, and the target's logit. Columns at or beyond
``real_vocab`` (vocabulary padding) are excluded from the softmax and get no gradient.

The logits are (b·s) × v/tp — for a 50k vocabulary the largest activation of the model. They are
processed in row chunks of a few MB of fp32 (``CHUNK_BYTES``): each chunk is upcast into one reused
buffer that stays in cache, so no fp32 copy of the logits ever exists (on CPU, allocating and
page-faulting one costs more than the arithmetic on it; on GPUs larger chunks keep launches few).
The forward leaves exp(logit - row max) in a logits-shaped buffer of the logits' dtype plus a few
per-row numbers; the backward scales each row by its softmax normalization and incoming grad (one
fp32 multiply) and sets the target's entry, computed from its fp32 logit — so the exponentials are
computed once.

:func:`vocab_parallel_cross_entropy` takes logits; :func:`vocab_parallel_linear_cross_entropy` also
applies the output layer, so the logits are private to it: their buffer holds the exponentials and
then the gradient, and can come from a :class:`BufferPool` that keeps it from one step to the next.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels.dispatch import device_type
from .state import Group

# fp32 bytes per chunk by device type. CPU: fits the L3 cache, and large enough that per-op
# overhead (and OpenMP synchronization when the cores are shared) stays small.
CHUNK_BYTES = {"cpu": 8 << 20, "default": 512 << 20}


def _chunk_rows(cols: int, device: torch.device) -> int:
    size = CHUNK_BYTES.get(device_type(device), CHUNK_BYTES["default"])
    return max(1, size // (4 * max(cols, 1)))


class BufferPool:
    """Freed tensors kept for reuse. For the CPU: there, a freed allocation above the C library's
    mmap threshold (at most 32 MB) goes back to the OS, and the next one page-faults again on every
    4 KB page — for the logits of a 50k vocabulary that adds about a third to the output layer's
    matmul. GPU caching allocators make this unnecessary there."""

    def __init__(self, max_free: int = 1):
        self.max_free = max_free
        self._free: list[torch.Tensor] = []

    def take(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        for i, t in enumerate(self._free):
            if t.shape == shape and t.dtype == dtype and t.device == device:
                return self._free.pop(i)
        return torch.empty(shape, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> None:
        self._free = ([t] + self._free)[: self.max_free]


def _softmax_forward(logits: torch.Tensor, exps: torch.Tensor, targets: torch.Tensor, group: Group,
                     vocab_start: int, real_vocab: int, ignore_index: int):
    """Per-row loss from (rows, v/tp) logits and (rows,) targets. Writes exp(logit - row max) into
    ``exps`` (may be ``logits`` itself) for the backward; returns the loss and per-row
    statistics."""
    rows, width = logits.shape
    valid = min(width, max(real_vocab - vocab_start, 0))  # this rank's non-padding columns
    local = targets - vocab_start
    ignored = targets == ignore_index
    not_mine = (local < 0) | (local >= valid) | ignored
    local = local.masked_fill(not_mine, 0)
    # before exps overwrites
    target_logit = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).float()

    row_max = logits.new_full((rows,), float("-inf"), dtype=torch.float32)
    sum_exp = logits.new_zeros((rows,), dtype=torch.float32)
    if valid:
        step = _chunk_rows(valid, logits.device)
        work = torch.empty(min(step, rows), valid, dtype=torch.float32, device=logits.device)
        for i in range(0, rows, step):
            w = work[: min(step, rows - i)]
            w.copy_(logits[i:i + step, :valid])  # fp32, in cache
            torch.amax(w, dim=-1, out=row_max[i:i + step])
            w.sub_(row_max[i:i + step].unsqueeze(-1)).exp_()
            torch.sum(w, dim=-1, out=sum_exp[i:i + step])
            exps[i:i + step, :valid].copy_(w)
    exps[:, valid:].zero_()  # padding columns: no probability, no gradient

    global_max = group.all_reduce(row_max.clone(), op=dist.ReduceOp.MAX)
    sum_exp.mul_(torch.exp(row_max - global_max))  # rescale the local sums to the global max
    group.all_reduce(sum_exp)
    target_logit = group.all_reduce((target_logit - global_max).masked_fill(not_mine, 0.0))
    loss = (torch.log(sum_exp) - target_logit).masked_fill(ignored, 0.0)  # (rows,)
    return loss, (row_max, global_max, sum_exp, target_logit, local, not_mine, ignored, valid)


def _softmax_backward(exps: torch.Tensor, grad_loss: torch.Tensor, stats) -> torch.Tensor:
    """Turn ``exps`` in place into d loss / d logits = grad_loss · (softmax - onehot(target))."""
    row_max, global_max, sum_exp, target_logit, local, not_mine, ignored, valid = stats
    rows = exps.shape[0]
    grad_loss = grad_loss.float().masked_fill(ignored, 0.0)  # (rows,)
    # softmax = exps · exp(row max - global max) / sum_exp: one fp32 factor per row, with the grad
    scale = (grad_loss * torch.exp(row_max - global_max) / sum_exp).unsqueeze(-1)
    if valid:
        step = _chunk_rows(valid, exps.device)
        work = torch.empty(min(step, rows), valid, dtype=torch.float32, device=exps.device)
        for i in range(0, rows, step):
            w = work[: min(step, rows - i)]
            # fp32 (mixed-dtype ops are slow)
            w.copy_(exps[i:i + step, :valid]).mul_(scale[i:i + step])
            exps[i:i + step, :valid].copy_(w)
    # the target's entry grad_loss · (p - 1), from its fp32 logit (no cancellation in low precision)
    mine = (~not_mine).nonzero().squeeze(-1)
    p_target = torch.exp(target_logit[mine]) / sum_exp[mine]
    exps[mine, local[mine]] = (grad_loss[mine] * (p_target - 1.0)).to(exps.dtype)
    return exps


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group: Group, vocab_start: int, real_vocab: int,
                ignore_index: int):
        logits2d = logits.reshape(-1, logits.shape[-1])  # (b·s, v/tp)
        exps = torch.empty_like(logits2d)  # becomes the gradient
        loss, ctx.stats = _softmax_forward(logits2d, exps, targets.reshape(-1), group, vocab_start,
                                           real_vocab, ignore_index)
        ctx.exps, ctx.shape = exps, logits.shape
        return loss.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        grad = _softmax_backward(ctx.exps, grad_loss.reshape(-1), ctx.stats)
        del ctx.exps
        return grad.view(ctx.shape), None, None, None, None, None


class _VocabParallelLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, group: Group, vocab_start: int, real_vocab: int,
                ignore_index: int, pool: BufferPool | None, deferred):
        x2d = x.reshape(-1, x.shape[-1])  # (b·s, h)
        shape = (x2d.shape[0], weight.shape[0])
        logits = pool.take(shape, x.dtype, x.device) if pool else x.new_empty(shape)
        torch.mm(x2d, weight.t(), out=logits)  # (b·s, v/tp)
        loss, stats = _softmax_forward(logits, logits, targets.reshape(-1), group, vocab_start,
                                       real_vocab,
                                       ignore_index)  # logits -> exps, in place
        if any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(x2d, weight)
            ctx.exps, ctx.pool, ctx.stats, ctx.x_shape = logits, pool, stats, x.shape
            ctx.deferred, ctx.param = deferred, weight  # the parameter itself, for a W op
        elif pool:
            pool.give(logits)
        return loss.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        x2d, weight = ctx.saved_tensors
        grad_logits = _softmax_backward(ctx.exps, grad_loss.reshape(-1), ctx.stats)  # in place
        del ctx.exps
        grad_x = grad_logits.mm(weight).view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        grad_w = None
        # a zero-bubble schedule's W makes d/dweight later: it keeps the gradient of the logits
        # until then
        later = ctx.needs_input_grad[1] and ctx.deferred is not None \
            and ctx.deferred.defer(ctx.param, x2d, grad_logits)
        if ctx.needs_input_grad[1] and not later:
            grad_w = grad_logits.t().mm(x2d)  # (v/tp, h)
        if ctx.pool and not later:
            ctx.pool.give(grad_logits)
        return grad_x, grad_w, None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: Group,
                                 vocab_start: int = 0, real_vocab: int | None = None,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss (b, s) in fp32 from vocab-sharded ``logits`` (b, s, v/tp) and global
    ``targets``.

    Targets equal to ``ignore_index`` get loss 0 and no gradient.
    """
    if real_vocab is None:
        real_vocab = logits.shape[-1] * group.size
    return _VocabParallelCrossEntropy.apply(logits, targets, group, vocab_start, real_vocab,
                                            ignore_index)


def vocab_parallel_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor,
                                        targets: torch.Tensor, group: Group, vocab_start: int = 0,
                                        real_vocab: int | None = None, ignore_index: int = -100,
                                        pool: BufferPool | None = None,
                                        deferred=None) -> torch.Tensor:
    """``vocab_parallel_cross_entropy(F.linear(x, weight), ...)`` with the logits kept private.

    ``x`` (b, s, h) is the replicated input, ``weight`` (v/tp, h) this rank's rows of the output
    layer. Same result, one logits-sized buffer instead of two; taken from ``pool`` if given, and
    returned to it after the backward (or at once when no gradient is needed). ``deferred`` (a
    zero-bubble schedule's ``DeferredGrads``): a backward run while it captures queues d loss /
    d weight, and the gradient of the logits it is made from, for the W op.
    """
    if real_vocab is None:
        real_vocab = weight.shape[0] * group.size
    return _VocabParallelLinearCrossEntropy.apply(x, weight, targets, group, vocab_start,
                                                  real_vocab, ignore_index, pool, deferred)
