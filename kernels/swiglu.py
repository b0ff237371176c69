"""SwiGLU, y = silu(gate) · up, forward and backward each in one elementwise Triton kernel.

Unfused, the forward writes silu(gate) and reads it back for the product, and autograd saves it
too; the backward takes four more passes. Here the forward reads gate and up once and writes y; the
backward saves only gate and up (the activation is recomputed in registers, which costs nothing in
a memory-bound kernel) and writes d gate and d up in one pass.

Rounding follows the unfused torch ops (:func:`swiglu_reference`): silu(gate) is rounded to the
input dtype before the product, and so is ``grad · up`` before it meets silu's derivative.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import cdiv, jit, tl, to_dtype, use_triton

BLOCK = 1024


@jit
def _swiglu_fwd(gate_ptr, up_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dtype = y_ptr.dtype.element_ty
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act = to_dtype(g * tl.sigmoid(g), dtype).to(tl.float32)  # silu(gate), rounded as torch does
    tl.store(y_ptr + offs, to_dtype(act * u, dtype), mask=mask)


@jit
def _swiglu_bwd(dy_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dtype = dgate_ptr.dtype.element_ty
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    act = to_dtype(g * sig, dtype).to(tl.float32)  # recomputed, not saved
    d_act = to_dtype(dy * u, dtype).to(tl.float32)
    tl.store(dgate_ptr + offs, to_dtype(d_act * sig * (1.0 + g * (1.0 - sig)), dtype), mask=mask)
    tl.store(dup_ptr + offs, to_dtype(dy * act, dtype), mask=mask)


def _triton_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    if gate.numel():
        _swiglu_fwd[(cdiv(gate.numel(), BLOCK),)](gate, up, y, gate.numel(), BLOCK=BLOCK)
    return y


def _triton_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    grad, gate, up = grad.contiguous(), gate.contiguous(), up.contiguous()
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    if gate.numel():
        _swiglu_bwd[(cdiv(gate.numel(), BLOCK),)](grad, gate, up, dgate, dup, gate.numel(),
                                                  BLOCK=BLOCK)
    return dgate, dup


def _torch_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    d_act = grad * up  # rounded to the dtype, as autograd's product backward is
    sig = torch.sigmoid(gate.float())
    dgate = (d_act.float() * sig * (1.0 + gate.float() * (1.0 - sig))).to(gate.dtype)
    return dgate, grad * F.silu(gate)


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError("swiglu needs gate and up of one shape and dtype, got "
                         f"{tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}")


@torch.library.custom_op("megapretrain::swiglu", mutates_args=())
def _swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    _check(gate, up)
    return _triton_forward(gate, up) if use_triton(gate.device.type) else F.silu(gate) * up


@_swiglu_op.register_fake
def _(gate, up):
    _check(gate, up)
    return torch.empty_like(gate)


@torch.library.custom_op("megapretrain::swiglu_backward", mutates_args=())
def _swiglu_backward_op(grad: torch.Tensor, gate: torch.Tensor,
                        up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (_triton_backward if use_triton(gate.device.type) else _torch_backward)(grad, gate, up)


@_swiglu_backward_op.register_fake
def _(grad, gate, up):
    return torch.empty_like(gate), torch.empty_like(up)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    return _swiglu_backward_op(grad, *ctx.saved_tensors)


_swiglu_op.register_autograd(_backward, setup_context=_setup_context)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up for gate, up (..., f/tp): the Triton kernels on CUDA (or under the
    interpreter)."""
    return _swiglu_op(gate, up)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """:func:`swiglu` in plain torch (the model's MLP activation)."""
    return F.silu(gate) * up
