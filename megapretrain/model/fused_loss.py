"""Output layer + per-token cross entropy over chunks of tokens: the (b·s, v/tp) logits never exist.

The model's head returns per-token losses (b, s), which the trainer masks and sums, so the loss
weights are not known in the forward. :func:`megapretrain.kernels.linear_cross_entropy` needs them
up front (it folds the gradient in during the forward); this is its per-token form: the forward
runs the chunks for the loss and keeps one log-sum-exp per token, the backward runs them again —
each chunk's logits recomputed into one chunk-sized buffer, turned in place into their gradient
(scaled by each token's incoming gradient) and folded into d loss / d x and d loss / d weight. One
more matmul than the unfused loss, and no logits-sized buffer.

The phases are those of :mod:`megapretrain.kernels.cross_entropy` (Triton on CUDA, or under the
interpreter) or, with ``reference``, their torch twins; the statistics are all-reduced over tp
between them. d loss / d x is this rank's partial sum, completed by the caller's tp mapping (as
for ``F.linear`` on a vocab shard).
"""

from __future__ import annotations

import torch

from ..kernels.cross_entropy import _phases, _valid, combine_stats
from ..kernels.linear_cross_entropy import default_chunk_rows
from ..parallel.state import Group


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, group, vocab_start, real_vocab, ignore_index, z_loss, rows, reference):
        x2d, t1d = x.reshape(-1, x.shape[-1]), targets.reshape(-1)  # (b·s, h), (b·s,)
        stats_phase, _ = _phases(reference)
        valid = _valid(weight.shape[0], vocab_start, real_vocab)
        loss = torch.empty(t1d.shape, dtype=torch.float32, device=x.device)
        lse = torch.empty_like(loss)
        buf = x2d.new_empty(min(rows, x2d.shape[0]), weight.shape[0])  # the only logits-shaped buffer
        for i in range(0, x2d.shape[0], rows):
            t_c = t1d[i:i + rows]
            logits = torch.mm(x2d[i:i + rows], weight.t(), out=buf[: t_c.shape[0]])  # (chunk, v/tp)
            stats = stats_phase(logits, t_c, vocab_start, valid, ignore_index)
            loss[i:i + rows], lse[i:i + rows] = combine_stats(stats, t_c, group, vocab_start, valid,
                                                              ignore_index, z_loss)
        ctx.save_for_backward(x2d, weight, t1d, lse)
        ctx.args = (vocab_start, valid, ignore_index, z_loss, rows, reference, x.shape)
        return loss.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        x2d, weight, t1d, lse = ctx.saved_tensors
        vocab_start, valid, ignore_index, z_loss, rows, reference, x_shape = ctx.args
        _, grad_phase = _phases(reference)
        need_x, need_w = ctx.needs_input_grad[:2]
        scale = grad_loss.reshape(-1).float().masked_fill(t1d == ignore_index, 0.0)  # (b·s,)
        n = x2d.shape[0]
        grad_x = torch.empty_like(x2d) if need_x else None
        one_chunk = n <= rows  # else d weight is summed over the chunks in fp32, rounded once
        grad_w = None if one_chunk or not need_w else torch.zeros(weight.shape, dtype=torch.float32,
                                                                   device=weight.device)
        buf = x2d.new_empty(min(rows, n), weight.shape[0])
        for i in range(0, n, rows):
            x_c, t_c = x2d[i:i + rows], t1d[i:i + rows]
            logits = torch.mm(x_c, weight.t(), out=buf[: t_c.shape[0]])  # recomputed (chunk, v/tp)
            grad_phase(logits, t_c, lse[i:i + rows], scale[i:i + rows], z_loss, vocab_start, valid)
            if need_x:
                torch.mm(logits, weight, out=grad_x[i:i + rows])  # (chunk, h), partial over tp
            if need_w and one_chunk:
                grad_w = logits.t().mm(x_c)  # (v/tp, h)
            elif need_w:
                grad_w.addmm_(logits.t().float(), x_c.float())
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        grad_x = grad_x.view(x_shape) if need_x else None
        return grad_x, grad_w, None, None, None, None, None, None, None, None


def linear_cross_entropy_per_token(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, group: Group,
                                   vocab_start: int, real_vocab: int, *, ignore_index: int = -100,
                                   z_loss: float = 0.0, reference: bool = False,
                                   chunk_rows: int | None = None) -> torch.Tensor:
    """Per-token loss (b, s) fp32 of ``F.linear(x, weight)`` against global ``targets`` (b, s).

    ``x`` (b, s, h) is replicated over tp, ``weight`` (v/tp, h) this rank's output rows starting at
    vocabulary id ``vocab_start``; ids at or beyond ``real_vocab`` are padding. Ignored targets get
    loss 0 and no gradient. ``reference``: the torch phases instead of the kernels.
    """
    rows = chunk_rows or default_chunk_rows(weight.shape[0], x.dtype, x.device)
    return _ChunkedLinearCrossEntropy.apply(x, weight, targets, group, vocab_start, real_vocab, ignore_index,
                                            z_loss, rows, reference)
