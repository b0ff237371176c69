"""Rotary position embedding, y = x·cos + rotate_half(x)·sin, forward and backward in one kernel.

rotate_half(x) = (-x2, x1) for the halves x1, x2 of each head vector (the Llama / HF layout). The
torch version makes three passes (a product, then two in-place multiply-adds); the kernel reads x
and the tables once and writes y once. The backward is the transposed rotation, the same kernel
with the signs of the sine terms exchanged, and needs nothing saved but the tables. Strided x (a
transposed view of the projection) is read in place; only the last dimension must be contiguous.

Rounding follows the torch version (:func:`rope_reference`): x·cos is rounded to the output dtype,
then each sine term is added in fp32 and the sum rounded once.
"""

from __future__ import annotations

import torch

from ._triton import cdiv, jit, next_pow2, tl, to_dtype, use_triton

# elements per program tile (rows × padded half head dimension): six loads each, no spills
TILE = 1024


@jit
def _rope_kernel(x_ptr, y_ptr, cos_ptr, sin_ptr, rows, n, s, half,
                 x_sb, x_sn, x_ss, y_sb, y_sn, y_ss, BACKWARD: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # (BR,) over (b, n, s)
    c = tl.arange(0, BLOCK_D)[None, :]  # (1, BD) within one half
    pos, head, batch = r % s, (r // s) % n, r // (s * n)
    mask = (r[:, None] < rows) & (c < half)
    x_row = (batch * x_sb + head * x_sn + pos * x_ss)[:, None]
    y_row = (batch * y_sb + head * y_sn + pos * y_ss)[:, None]
    t_row = (pos * 2 * half)[:, None]  # tables are (s, d) contiguous
    dtype = y_ptr.dtype.element_ty
    x1 = tl.load(x_ptr + x_row + c, mask=mask, other=0.0).to(tl.float32)  # (BR, BD)
    x2 = tl.load(x_ptr + x_row + half + c, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t_row + c, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t_row + half + c, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t_row + c, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t_row + half + c, mask=mask, other=0.0).to(tl.float32)
    a1 = to_dtype(x1 * c1, dtype).to(tl.float32)
    a2 = to_dtype(x2 * c2, dtype).to(tl.float32)
    if BACKWARD:  # dx1 = g1 c1 + g2 s2, dx2 = g2 c2 - g1 s1
        y1, y2 = a1 + x2 * s2, a2 - x1 * s1
    else:  # y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2
        y1, y2 = a1 - x2 * s1, a2 + x1 * s2
    tl.store(y_ptr + y_row + c, to_dtype(y1, dtype), mask=mask)
    tl.store(y_ptr + y_row + half + c, to_dtype(y2, dtype), mask=mask)


def blocks(half: int) -> tuple[int, int]:
    """(rows per block, padded half head dimension) of a program."""
    block_d = next_pow2(half)
    return max(1, min(64, TILE // block_d)), block_d


def _triton_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   backward: bool) -> torch.Tensor:
    b, n, s, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    dtype = torch.promote_types(x.dtype, cos.dtype)
    y = torch.empty_like(x, dtype=dtype)  # keeps x's layout when x is dense
    if y.stride(-1) != 1:
        y = torch.empty(x.shape, dtype=dtype, device=x.device)
    half, rows = d // 2, b * n * s
    block_r, block_d = blocks(half)
    if not rows:
        return y
    _rope_kernel[(cdiv(rows, block_r),)](x, y, cos.contiguous(), sin.contiguous(), rows, n, s, half,
                                         *x.stride()[:3], *y.stride()[:3], BACKWARD=backward,
                                         BLOCK_R=block_r, BLOCK_D=block_d)
    return y


def _torch_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  backward: bool) -> torch.Tensor:
    half = x.shape[-1] // 2
    y = x * cos
    if backward:
        y[..., :half].addcmul_(x[..., half:], sin[..., half:])  # dx1 = g1 c1 + g2 s2
        y[..., half:].addcmul_(x[..., :half], sin[..., :half], value=-1.0)  # dx2 = g2 c2 - g1 s1
    else:
        y[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1.0)  # y1 = x1 c1 - x2 s1
        y[..., half:].addcmul_(x[..., :half], sin[..., half:])  # y2 = x2 c2 + x1 s2
    return y


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 4 or x.shape[-1] % 2 or cos.shape != (x.shape[2], x.shape[3]) \
            or sin.shape != cos.shape:
        raise ValueError(f"rope needs x (b, n, s, d) with d even and cos, sin (s, d); got x "
                         f"{tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")


@torch.library.custom_op("megapretrain::rope", mutates_args=())
def _rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    _check(x, cos, sin)
    return (_triton_rotate if use_triton(x.device.type) else _torch_rotate)(x, cos, sin, backward)


@_rope_op.register_fake
def _(x, cos, sin, backward):
    _check(x, cos, sin)
    return torch.empty_like(x, dtype=torch.promote_types(x.dtype, cos.dtype))


def _setup_context(ctx, inputs, output):
    x, cos, sin, backward = inputs
    ctx.save_for_backward(cos, sin)
    ctx.backward, ctx.x_dtype = backward, x.dtype


def _backward(ctx, grad):
    cos, sin = ctx.saved_tensors
    return _rope_op(grad, cos, sin, not ctx.backward).to(ctx.x_dtype), None, None, None


_rope_op.register_autograd(_backward, setup_context=_setup_context)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (b, n, s, d) query/key vectors by their position's angle; cos, sin: (s, d)."""
    return _rope_op(x, cos, sin, False)


class _RoPEReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _torch_rotate(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, grad):
        return _torch_rotate(grad, *ctx.saved_tensors, backward=True), None, None


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`rope` in plain torch (the model's formulas), for any device."""
    return _RoPEReference.apply(x, cos, sin)
