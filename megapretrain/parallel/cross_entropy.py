"""Vocab-parallel cross entropy: each tp rank holds logits for a slice of the vocabulary.

The full logits are never gathered. Three small all-reduces over tp combine the slices: the max
(for stability), the sum of exponentials, and the target's logit. Columns at or beyond
``real_vocab`` (vocabulary padding) are excluded from the softmax and get no gradient.

The logits are (b·s) × v/tp — for a 50k vocabulary the largest activation of the model. They are
processed in row chunks of about ``CHUNK_BYTES`` of fp32: each chunk is upcast into one small reused
buffer that stays in cache, so no fp32 copy of the logits ever exists (allocating and page-faulting
one costs more than the arithmetic on CPU). The forward keeps only per-row statistics; the backward
recomputes the softmax chunk by chunk from the saved logits, already scaled by the incoming grad.

:func:`vocab_parallel_cross_entropy` takes logits; :func:`vocab_parallel_linear_cross_entropy` also
applies the output layer, so the logits are private to it and their buffer is reused for their
gradient (saving a second logits-sized allocation).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .state import Group

CHUNK_BYTES = 2 << 20  # fp32 bytes per chunk: fits L2/L3 on CPUs, amortizes per-op overhead


def _chunk_rows(cols: int) -> int:
    return max(1, CHUNK_BYTES // (4 * max(cols, 1)))


def _softmax_stats(logits: torch.Tensor, targets: torch.Tensor, group: Group, vocab_start: int,
                   real_vocab: int, ignore_index: int):
    """Per-row loss and what the backward needs, from (rows, v/tp) logits and (rows,) targets."""
    rows, width = logits.shape
    valid = min(width, max(real_vocab - vocab_start, 0))  # this rank's non-padding columns
    row_max = logits.new_full((rows,), float("-inf"), dtype=torch.float32)
    sum_exp = logits.new_zeros((rows,), dtype=torch.float32)
    if valid:
        step = _chunk_rows(valid)
        work = torch.empty(min(step, rows), valid, dtype=torch.float32, device=logits.device)
        for i in range(0, rows, step):
            w = work[: min(step, rows - i)]
            w.copy_(logits[i:i + step, :valid])  # fp32, in cache
            torch.amax(w, dim=-1, out=row_max[i:i + step])
            w.sub_(row_max[i:i + step].unsqueeze(-1)).exp_()
            torch.sum(w, dim=-1, out=sum_exp[i:i + step])

    global_max = group.all_reduce(row_max.clone(), op=dist.ReduceOp.MAX)
    sum_exp.mul_(torch.exp(row_max - global_max))  # rescale the local sums to the global max
    group.all_reduce(sum_exp)

    local = targets - vocab_start
    ignored = targets == ignore_index
    not_mine = (local < 0) | (local >= valid) | ignored
    local = local.masked_fill(not_mine, 0)
    target_logit = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).float() - global_max
    target_logit = group.all_reduce(target_logit.masked_fill(not_mine, 0.0))
    loss = (torch.log(sum_exp) - target_logit).masked_fill(ignored, 0.0)  # (rows,)
    return loss, (global_max, sum_exp, local, not_mine, ignored, valid)


def _softmax_grad(out: torch.Tensor, logits: torch.Tensor, grad_loss: torch.Tensor, stats) -> torch.Tensor:
    """Write d loss / d logits = grad_loss · (softmax - onehot(target)) into ``out`` (may be ``logits``)."""
    global_max, sum_exp, local, not_mine, ignored, valid = stats
    rows = logits.shape[0]
    grad_loss = grad_loss.float().masked_fill(ignored, 0.0)  # (rows,)
    scale = (grad_loss / sum_exp).unsqueeze(-1)  # softmax's normalization folded into the grad
    target_grad = (-grad_loss).masked_fill(not_mine, 0.0).unsqueeze(-1)
    out[:, valid:].zero_()
    if valid:
        step = _chunk_rows(valid)
        work = torch.empty(min(step, rows), valid, dtype=torch.float32, device=logits.device)
        for i in range(0, rows, step):
            w = work[: min(step, rows - i)]
            w.copy_(logits[i:i + step, :valid])
            w.sub_(global_max[i:i + step].unsqueeze(-1)).exp_().mul_(scale[i:i + step])
            w.scatter_add_(-1, local[i:i + step].unsqueeze(-1), target_grad[i:i + step])
            out[i:i + step, :valid].copy_(w)
    return out


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group: Group, vocab_start: int, real_vocab: int, ignore_index: int):
        logits2d = logits.reshape(-1, logits.shape[-1])  # (b·s, v/tp)
        loss, stats = _softmax_stats(logits2d, targets.reshape(-1), group, vocab_start, real_vocab, ignore_index)
        ctx.save_for_backward(logits2d)
        ctx.stats, ctx.shape = stats, logits.shape
        return loss.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        (logits2d,) = ctx.saved_tensors
        grad = _softmax_grad(torch.empty_like(logits2d), logits2d, grad_loss.reshape(-1), ctx.stats)
        return grad.view(ctx.shape), None, None, None, None, None


class _VocabParallelLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, group: Group, vocab_start: int, real_vocab: int, ignore_index: int):
        x2d = x.reshape(-1, x.shape[-1])  # (b·s, h)
        logits = torch.mm(x2d, weight.t())  # (b·s, v/tp)
        loss, stats = _softmax_stats(logits, targets.reshape(-1), group, vocab_start, real_vocab, ignore_index)
        ctx.save_for_backward(x2d, weight)
        ctx.logits, ctx.stats, ctx.x_shape = logits, stats, x.shape  # logits: private, reused below
        return loss.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        x2d, weight = ctx.saved_tensors
        grad_logits = _softmax_grad(ctx.logits, ctx.logits, grad_loss.reshape(-1), ctx.stats)  # in place
        del ctx.logits
        grad_x = grad_logits.mm(weight).view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        grad_w = grad_logits.t().mm(x2d) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: Group,
                                 vocab_start: int = 0, real_vocab: int | None = None,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss (b, s) in fp32 from vocab-sharded ``logits`` (b, s, v/tp) and global ``targets``.

    Targets equal to ``ignore_index`` get loss 0 and no gradient.
    """
    if real_vocab is None:
        real_vocab = logits.shape[-1] * group.size
    return _VocabParallelCrossEntropy.apply(logits, targets, group, vocab_start, real_vocab, ignore_index)


def vocab_parallel_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                        group: Group, vocab_start: int = 0, real_vocab: int | None = None,
                                        ignore_index: int = -100) -> torch.Tensor:
    """``vocab_parallel_cross_entropy(F.linear(x, weight), ...)`` with the logits kept private.

    ``x`` (b, s, h) is the replicated input, ``weight`` (v/tp, h) this rank's rows of the output
    layer. Same result, one logits-sized buffer instead of two.
    """
    if real_vocab is None:
        real_vocab = weight.shape[0] * group.size
    return _VocabParallelLinearCrossEntropy.apply(x, weight, targets, group, vocab_start, real_vocab,
                                                  ignore_index)
