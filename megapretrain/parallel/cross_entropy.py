"""Vocab-parallel cross entropy: each tp rank holds logits for a slice of the vocabulary.

The full logits are never gathered. Three small all-reduces over tp combine the slices: the max
(for stability), the sum of exponentials, and the target's logit. The forward keeps one fp32 buffer,
turned in place into the softmax that the backward needs, so the logits exist in fp32 only once.
Columns at or beyond ``real_vocab`` (vocabulary padding) are excluded from the softmax.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .state import Group


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group: Group, vocab_start: int, real_vocab: int, ignore_index: int):
        rows = logits.shape[-1]
        work = logits.float() if logits.dtype != torch.float32 else logits.clone()  # (b, s, v/tp) fp32
        pad_from = real_vocab - vocab_start
        if pad_from < rows:
            work[..., max(pad_from, 0):] = float("-inf")

        row_max = work.max(dim=-1).values
        group.all_reduce(row_max, op=dist.ReduceOp.MAX)
        work -= row_max.unsqueeze(-1)

        local = targets - vocab_start
        ignored = targets == ignore_index
        not_mine = (local < 0) | (local >= rows) | ignored
        local = local.masked_fill(not_mine, 0)
        target_logit = work.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(not_mine, 0.0)
        group.all_reduce(target_logit)

        torch.exp(work, out=work)
        sum_exp = work.sum(dim=-1)
        group.all_reduce(sum_exp)
        loss = (torch.log(sum_exp) - target_logit).masked_fill(ignored, 0.0)  # (b, s)

        work /= sum_exp.unsqueeze(-1)  # softmax, kept for backward
        ctx.save_for_backward(work, local, not_mine, ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, not_mine, ignored = ctx.saved_tensors
        grad = softmax  # d loss / d logits = softmax - onehot(target), reusing the buffer
        onehot = (~not_mine).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local.unsqueeze(-1), -onehot)
        grad *= grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: Group,
                                 vocab_start: int = 0, real_vocab: int | None = None,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss (b, s) in fp32 from vocab-sharded ``logits`` (b, s, v/tp) and global ``targets``.

    Targets equal to ``ignore_index`` get loss 0 and no gradient.
    """
    if real_vocab is None:
        real_vocab = logits.shape[-1] * group.size
    return _VocabParallelCrossEntropy.apply(logits, targets, group, vocab_start, real_vocab, ignore_index)
