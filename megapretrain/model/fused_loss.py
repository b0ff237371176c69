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

Held by the trainer's data-parallel buffers (``grad_sink``), d loss / d weight is not returned to
autograd at all: each chunk's product is added straight into the weight's fp32 main grad, a tile
of vocabulary rows at a time (Megatron-LM's gradient-accumulation fusion, for the output layer),
and the buffers are told, as their gradient hook would have been. No weight-sized gradient ever
exists, the sum over chunks and micro-batches is fp32's, and the separate fold of a bf16 gradient
into the main grad is gone. When the gradients are made in the forward, the forward adds them for
the incoming gradient the trainer announces (``grad_scale``); a backward that brings another adds
the difference, recomputed from the log-sum-exp, so it stays exact. Knowing whether it brought
another means reading a flag on the host; a caller whose backward always brings the announced
gradient (the trainer) sets the buffers' ``grad_scale_checks`` to a list, and each backward appends
its flag there, a device tensor, for the caller to read with the step's other values (the trainer
raises if one is ever set). A tied weight whose chunk also embeds with it keeps autograd's path
(the embedding's gradient comes later, through autograd).

The phases are those of :mod:`megapretrain.kernels.cross_entropy` (Triton on CUDA, or under the
interpreter) or, with ``reference``, their torch twins; the statistics are all-reduced over tp
between them. d loss / d x is this rank's partial sum, completed by the caller's tp mapping (as
for ``F.linear`` on a vocab shard).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from ..kernels.dispatch import device_type
from ..kernels.linear_cross_entropy import chunked_loss_and_grads, default_chunk_rows
from ..parallel.state import Group


def _differs(scale: torch.Tensor, keep: torch.Tensor, made: float) -> torch.Tensor:
    """Whether some kept token's incoming gradient is not ``made``: a 0-d bool device tensor (a NaN
    announced and brought is the same: an injected fault, whose step is skipped)."""
    same = scale.isnan() if math.isnan(made) else scale == made
    return (~same & keep).any()


def _uniform(scale: torch.Tensor, keep: torch.Tensor) -> torch.Tensor | None:
    """The incoming gradient shared by every kept token, as a 0-d tensor (0 if none is kept), or
    None if they differ. One host read — whether they agree — and no shape that depends on the
    values (so it also runs on the fake tensors of a simulation)."""
    # the first kept token's
    first = torch.where(keep.any(), scale[keep.to(torch.int8).argmax()], 0.0)
    return first if bool(((scale == first) | ~keep).all()) else None


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, group, vocab_start, real_vocab, ignore_index, z_loss, rows,
                reference, grads_in_forward, sink, grad_scale, deferred):
        x2d, t1d = x.reshape(-1, x.shape[-1]), targets.reshape(-1)  # (b·s, h), (b·s,)
        need_x = grads_in_forward and ctx.needs_input_grad[0]
        # with ``deferred`` (a zero-bubble schedule) the weight gradient is made on its own, after
        # the backward
        need_w = grads_in_forward and ctx.needs_input_grad[1] and deferred is None
        # the gradient made here: for the incoming one announced, or else for a unit one
        scale = x2d.new_full(t1d.shape, 1.0 if grad_scale is None else grad_scale,
                             dtype=torch.float32)
        main = sink.main_grad_for(weight) if need_w and sink is not None else None
        loss, lse, grad_x, grad_w = chunked_loss_and_grads(x2d, weight, t1d, scale, group,
                                                           vocab_start, real_vocab, ignore_index,
                                                           z_loss, rows, need_x, need_w, reference,
                                                           grad_w_out=main)
        ctx.save_for_backward(x2d, weight, t1d, lse)
        ctx.grads = grad_x, grad_w  # not saved tensors: the backward drops them before it returns
        ctx.args = (group, vocab_start, real_vocab, ignore_index, z_loss, rows, reference, x.shape)
        # its scale
        ctx.made = (1.0 if grad_scale is None else grad_scale) if grads_in_forward else None
        ctx.sink, ctx.deferred = sink, deferred
        # the parameter itself: saved tensors come back as other tensors
        ctx.param = weight if sink is not None or deferred is not None else None
        return loss.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        x2d, weight, t1d, lse = ctx.saved_tensors
        (grad_x, grad_w), ctx.grads = ctx.grads, None  # the only references left are these
        group, vocab_start, real_vocab, ignore_index, z_loss, rows, reference, x_shape = ctx.args
        need_x, need_w = ctx.needs_input_grad[:2]
        # d/dweight made on its own, below (a W op, or now)
        later = need_w and ctx.deferred is not None
        need_w = need_w and not later
        # d/dweight goes into the main grad, not through autograd
        fused = need_w and ctx.sink is not None
        scale = grad_loss.reshape(-1).float()  # (b·s,)
        args = (group, vocab_start, real_vocab, ignore_index, z_loss, rows)
        if ctx.made is None:  # nothing made in the forward: the chunks once, with this gradient
            main = ctx.sink.main_grad_for(ctx.param) if fused else None
            _, _, grad_x, grad_w = chunked_loss_and_grads(x2d, weight, t1d, scale, *args, need_x,
                                                          need_w, reference, lse=lse,
                                                          grad_w_out=main)
        elif fused:  # the forward added made · G to the main grad: add (incoming - made) · G
            differs = _differs(scale, t1d != ignore_index, ctx.made)
            checks = ctx.sink.grad_scale_checks
            if checks is not None:  # the caller brings what it announced, and reads the check later
                checks.append(differs)
            elif bool(differs):
                main = ctx.sink.main_grad_for(ctx.param)
                _, _, fix_x, _ = chunked_loss_and_grads(x2d, weight, t1d, scale - ctx.made, *args,
                                                        need_x, True, reference, lse=lse,
                                                        grad_w_out=main)
                grad_x = grad_x.add_(fix_x) if need_x else None
        else:
            shared = _uniform(scale, t1d != ignore_index)
            ready = (grad_x is not None or not need_x) and (grad_w is not None or not need_w)
            # recompute the chunks with this gradient
            if shared is None or not ready or not ctx.made:
                grad_x = grad_w = None  # frees the forward's before the new ones are made
                _, _, grad_x, grad_w = chunked_loss_and_grads(x2d, weight, t1d, scale, *args,
                                                              need_x, need_w, reference, lse=lse)
            else:
                factor = shared.double() / ctx.made  # on the device: no read of the value
                grad_x = grad_x.mul_(factor) if need_x else None
                grad_w = grad_w.mul_(factor) if need_w else None
        if fused:
            ctx.sink.grad_added(ctx.param)
            grad_w = None
        if later:
            make = functools.partial(_weight_grad, x2d, weight, t1d, lse, scale, args, reference)
            grad_w = None if ctx.deferred.defer_call(ctx.param, make) \
                else _weight_grad_now(ctx.sink, ctx.param, make)
        grad_x = grad_x.view(x_shape) if need_x else None
        return grad_x, grad_w, None, None, None, None, None, None, \
            None, None, None, None, None, None


def _weight_grad(x2d, weight, t1d, lse, scale, args, reference, main):
    """d loss / d weight (v/tp, h) for the incoming gradient ``scale``, from the chunks of logits
    made again (the log-sum-exp kept: one matmul more than making it with d/dx) — a zero-bubble
    schedule's W op for the output layer, which keeps only the layer's input (b·s, h) from its B.
    Added into ``main`` (its fp32 main grad) chunk by chunk, or returned when that is None."""
    return chunked_loss_and_grads(x2d, weight, t1d, scale, *args, False, True, reference, lse=lse,
                                  grad_w_out=main)[3]


def _weight_grad_now(sink, param, make):
    """A deferrable weight gradient when no W waits for it (no capture open): into the main grad
    of ``sink`` (the sink told), or returned to autograd."""
    if sink is None:
        return make(None)
    make(sink.main_grad_for(param))
    sink.grad_added(param)
    return None


def linear_cross_entropy_per_token(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                   group: Group, vocab_start: int, real_vocab: int, *,
                                   ignore_index: int = -100, z_loss: float = 0.0,
                                   reference: bool = False, chunk_rows: int | None = None,
                                   grads_in_forward: bool | None = None, grad_sink=None,
                                   grad_scale: float | None = None, deferred=None) -> torch.Tensor:
    """Per-token loss (b, s) fp32 of ``F.linear(x, weight)`` against global ``targets`` (b, s).

    ``x`` (b, s, h) is replicated over tp, ``weight`` (v/tp, h) this rank's output rows starting at
    vocabulary id ``vocab_start``; ids at or beyond ``real_vocab`` are padding. Ignored targets get
    loss 0 and no gradient. ``reference``: the torch phases instead of the kernels.
    ``grads_in_forward`` (default: on CPU) computes the gradients in the forward (see the module
    docstring); it only applies when gradients are being recorded.

    ``grad_sink`` (the weight's :class:`~megapretrain.parallel.data.DataParallelBuffers`):
    d loss / d weight is added straight into the weight's fp32 main grad, chunk by chunk, and the
    sink told, instead of being returned to autograd: no weight-sized gradient exists. With the
    gradients made in the forward that needs ``grad_scale``, the incoming gradient the backward
    will bring for every kept token (the trainer's loss scale over the token count); a backward
    that brings another is still exact (it adds the difference), but a forward that records
    gradients must then be followed by its backward. Without ``grad_scale`` the forward keeps a
    weight-sized gradient, as without a sink.

    ``deferred`` (a zero-bubble schedule's :class:`~megapretrain.parallel.tensor.DeferredGrads`):
    a backward run while it captures leaves d loss / d weight to its W op, which makes it from the
    saved input and log-sum-exp; the forward then never makes it.
    """
    rows = chunk_rows or default_chunk_rows(targets.numel(), weight.shape[0], x.dtype, x.device)
    if grads_in_forward is None:
        grads_in_forward = device_type(x.device) == "cpu"
    grads_in_forward = grads_in_forward and torch.is_grad_enabled()
    if grads_in_forward and grad_scale is None:
        grad_sink = None
    if grad_scale is not None:  # as the incoming gradient will hold it (rounded on the host: no op)
        grad_scale = float(np.float32(grad_scale))
    return _ChunkedLinearCrossEntropy.apply(x, weight, targets, group, vocab_start, real_vocab,
                                            ignore_index, z_loss, rows, reference, grads_in_forward,
                                            grad_sink, grad_scale, deferred)
