"""Output layer + per-token cross entropy over chunks of tokens: the (b·s, v/tp) logits never exist.

The model's head returns per-token losses (b, s), so the loss weights are not known in the
forward, which :func:`megapretrain.kernels.linear_cross_entropy` needs (it folds the gradient in
during the forward). The trainer, though, backpropagates ``losses.sum() * scale`` (targets it
leaves out are ``ignore_index``): the incoming gradient is the same for every token. So with
``grads_in_forward`` the forward runs the chunks once — each chunk's logits computed into one
chunk-sized buffer, turned in place into their gradient for an incoming gradient of ones, and
folded into d loss / d x and d loss / d weight — and the backward multiplies those by the incoming
gradient: three matmuls, as for the unfused loss, and what is kept from forward to backward is the
size of the gradients, not of the logits. An incoming gradient that differs between the tokens
kept (any other use of the losses) is still exact: the backward then runs the chunks again with
it, from the log-sum-exp the forward kept, and the gradients from the forward are dropped.

Without ``grads_in_forward`` (the default off CPU, where checking that the incoming gradient is
uniform would wait for the device, and where the chunks' recomputation is cheap next to holding a
weight-sized gradient across the pipeline's in-flight micro-batches) the forward computes only the
loss and the backward always recomputes: one more matmul.

The phases are those of :mod:`megapretrain.kernels.cross_entropy` (Triton on CUDA, or under the
interpreter) or, with ``reference``, their torch twins; the statistics are all-reduced over tp
between them. d loss / d x is this rank's partial sum, completed by the caller's tp mapping (as
for ``F.linear`` on a vocab shard).
"""

from __future__ import annotations

import torch

from ..kernels.linear_cross_entropy import chunked_loss_and_grads, default_chunk_rows
from ..parallel.state import Group


def _uniform(scale: torch.Tensor, keep: torch.Tensor) -> float | None:
    """The incoming gradient shared by every kept token, or None if they differ (0 if none is kept)."""
    kept = scale[keep]
    if kept.numel() == 0:
        return 0.0
    first = kept[0]
    return float(first) if bool((kept == first).all()) else None


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, group, vocab_start, real_vocab, ignore_index, z_loss, rows, reference,
                grads_in_forward):
        x2d, t1d = x.reshape(-1, x.shape[-1]), targets.reshape(-1)  # (b·s, h), (b·s,)
        need_x, need_w = grads_in_forward and ctx.needs_input_grad[0], grads_in_forward and ctx.needs_input_grad[1]
        ones = x2d.new_ones(t1d.shape, dtype=torch.float32)  # the gradient made here: for a unit incoming one
        loss, lse, grad_x, grad_w = chunked_loss_and_grads(x2d, weight, t1d, ones, group, vocab_start, real_vocab,
                                                           ignore_index, z_loss, rows, need_x, need_w, reference)
        ctx.save_for_backward(x2d, weight, t1d, lse)
        ctx.grads = grad_x, grad_w  # not saved tensors: the backward drops them before it returns
        ctx.args = (group, vocab_start, real_vocab, ignore_index, z_loss, rows, reference, x.shape)
        return loss.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        x2d, weight, t1d, lse = ctx.saved_tensors
        (grad_x, grad_w), ctx.grads = ctx.grads, None  # the only references left are these
        group, vocab_start, real_vocab, ignore_index, z_loss, rows, reference, x_shape = ctx.args
        need_x, need_w = ctx.needs_input_grad[:2]
        scale = grad_loss.reshape(-1).float()  # (b·s,)
        ready = (grad_x is not None or not need_x) and (grad_w is not None or not need_w)
        shared = _uniform(scale, t1d != ignore_index) if ready else None
        if shared is None:  # recompute the chunks with this gradient
            grad_x = grad_w = None  # frees the forward's before the new ones are made
            _, _, grad_x, grad_w = chunked_loss_and_grads(x2d, weight, t1d, scale, group, vocab_start, real_vocab,
                                                          ignore_index, z_loss, rows, need_x, need_w, reference,
                                                          lse=lse)
        else:
            grad_x = grad_x.mul_(shared) if need_x else None
            grad_w = grad_w.mul_(shared) if need_w else None
        grad_x = grad_x.view(x_shape) if need_x else None
        return grad_x, grad_w, None, None, None, None, None, None, None, None, None


def linear_cross_entropy_per_token(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, group: Group,
                                   vocab_start: int, real_vocab: int, *, ignore_index: int = -100,
                                   z_loss: float = 0.0, reference: bool = False, chunk_rows: int | None = None,
                                   grads_in_forward: bool | None = None) -> torch.Tensor:
    """Per-token loss (b, s) fp32 of ``F.linear(x, weight)`` against global ``targets`` (b, s).

    ``x`` (b, s, h) is replicated over tp, ``weight`` (v/tp, h) this rank's output rows starting at
    vocabulary id ``vocab_start``; ids at or beyond ``real_vocab`` are padding. Ignored targets get
    loss 0 and no gradient. ``reference``: the torch phases instead of the kernels.
    ``grads_in_forward`` (default: on CPU) computes the gradients in the forward (see the module
    docstring); it only applies when gradients are being recorded.
    """
    rows = chunk_rows or default_chunk_rows(targets.numel(), weight.shape[0], x.dtype, x.device)
    if grads_in_forward is None:
        grads_in_forward = x.device.type == "cpu"
    grads_in_forward = grads_in_forward and torch.is_grad_enabled()
    return _ChunkedLinearCrossEntropy.apply(x, weight, targets, group, vocab_start, real_vocab, ignore_index,
                                            z_loss, rows, reference, grads_in_forward)
