"""RMSNorm, y = weight · x / rms(x), forward and backward each in one Triton kernel.

Unfused, the norm reads and writes x several times (upcast, square, mean, scale, downcast, weight).
The forward kernel reads a block of rows once, keeps them in registers in fp32, and writes y plus
one 1/rms per row; the backward reads x, dy and 1/rms once and writes dx, with the weight gradient
reduced in two stages (each program sums its own rows, then the per-program partials are summed),
so no (rows, h) fp32 product is ever stored. Rows wider than ``BWD_CHUNK`` are split by columns
over programs, each of which reads the whole row a second time (from L2) for the row's dot product.
Divisions and the square root are correctly rounded (``tl.div_rn``, ``tl.sqrt_rn``), as torch's.

Semantics are those of the model's norm: statistics in fp32, ``x_hat`` rounded to x's dtype before
the weight multiplies it (as HF's Llama does), or with ``weight_in_fp32`` the product taken in fp32
and rounded once (as HF's OLMo 2/3 do); dx in x's dtype, the weight gradient in the weight's dtype.
:func:`rms_norm_reference` is the same computation in plain torch.
"""

from __future__ import annotations

import torch

from ._triton import cdiv, jit, next_pow2, sm_count, tl, to_dtype, use_triton

# elements per program tile (rows × padded hidden size) of narrow rows: 16 a thread forward, 8
# backward (it holds more arrays per element), so no registers spill on sm_80-sm_100
# (tools/check_kernels.py: twice that spilled 8 B a thread on sm_100)
FWD_TILE, BWD_TILE = 2048, 1024
# columns of a backward program at most: it keeps its chunk of d weight in registers across its
# rows, beside that chunk of x, dy and w. A whole 16384 row (405B) spilled 48 B a thread at 128
# registers, and 8192 columns still reach 128 in fp16 (tools/check_kernels.py)
BWD_CHUNK = 4096


@jit
def _rmsnorm_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, rows, h, eps,
                 BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, WEIGHT_IN_FP32: tl.constexpr):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # (BR,)
    c = tl.arange(0, BLOCK_H)  # (BH,)
    mask = (r[:, None] < rows) & (c[None, :] < h)
    offs = r[:, None] * h + c[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # (BR, BH)
    # correctly rounded divisions and square root (the GPU's defaults are approximate), as torch's
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(x * x, axis=1), h * 1.0) + eps))  # (BR,)
    x_hat = x * rstd[:, None]
    if not WEIGHT_IN_FP32:  # rounded to x's dtype before the weight multiplies it
        x_hat = to_dtype(x_hat, x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + c, mask=c < h, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, to_dtype(x_hat * w[None, :], y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + r, rstd, mask=r < rows)


@jit
def _rmsnorm_bwd(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, rows, h, rows_per_prog,
                 BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, CHUNKS: tl.constexpr):
    # program (p, k) owns columns [k·BH, (k+1)·BH) of rows [p·rows_per_prog, ...): it writes dx
    # there and sums that chunk of d weight in registers (acc); wide rows (h > BH) read the whole
    # row once more for its dot product, from L2, where the row's other CHUNKS - 1 programs read it
    # at the same time
    pid = tl.program_id(0) // CHUNKS
    # (BH,) this program's columns
    c = (tl.program_id(0) % CHUNKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)  # this program's share of d weight
    start = pid * rows_per_prog
    end = tl.minimum(start + rows_per_prog, rows)
    for r0 in range(start, end, BLOCK_R):
        r = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
        rstd = tl.load(rstd_ptr + r, mask=r < end, other=0.0)  # (BR,)
        dot = tl.zeros((BLOCK_R,), dtype=tl.float32)  # Σ over the row of d loss / d x_hat · x_hat
        for k0 in range(0, h, BLOCK_H):  # a loop, not unrolled: one chunk's loads in flight
            ck = k0 + tl.arange(0, BLOCK_H)
            mk = (r[:, None] < end) & (ck[None, :] < h)
            # (BR, BH)
            xk = tl.load(x_ptr + r[:, None] * h + ck[None, :], mask=mk, other=0.0).to(tl.float32)
            gk = tl.load(dy_ptr + r[:, None] * h + ck[None, :], mask=mk, other=0.0).to(tl.float32)
            wk = tl.load(w_ptr + ck, mask=ck < h, other=0.0).to(tl.float32)
            dot += tl.sum((gk * wk[None, :]) * (xk * rstd[:, None]), axis=1)
        dot = tl.div_rn(dot, h * 1.0)  # correctly rounded, as torch's
        mask = (r[:, None] < end) & (c[None, :] < h)
        offs = r[:, None] * h + c[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # (BR, BH)
        g = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # reloaded: not held beside acc
        w = tl.load(w_ptr + c, mask=c < h, other=0.0).to(tl.float32)
        x_hat = x * rstd[:, None]
        acc += g * x_hat
        gw = g * w[None, :]  # d loss / d x_hat
        dx = (gw - x_hat * dot[:, None]) * rstd[:, None]
        tl.store(dx_ptr + offs, to_dtype(dx, dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_part_ptr + pid * h + c, tl.sum(acc, axis=0), mask=c < h)


def blocks(h: int, tile: int) -> tuple[int, int, int]:
    """(rows per block, padded hidden size, warps) of a program for hidden size ``h``."""
    block_h = next_pow2(h)
    # wide rows: more threads per row
    warps = 16 if block_h >= 16384 else 8 if block_h >= 4096 else 4
    return max(1, min(16, tile // block_h)), block_h, warps


def _num_programs(device: torch.device, row_blocks: int) -> int:
    return max(1, min(row_blocks, 2 * sm_count(device)))  # two programs per multiprocessor


def _triton_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool):
    h = x.shape[-1]
    x2d = x.reshape(-1, h).contiguous()  # (rows, h)
    rows = x2d.shape[0]
    y = torch.empty(x2d.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    block_r, block_h, warps = blocks(h, FWD_TILE)
    if rows:
        _rmsnorm_fwd[(cdiv(rows, block_r),)](x2d, weight.contiguous(), y, rstd, rows, h, eps,
                                             BLOCK_R=block_r, BLOCK_H=block_h,
                                             WEIGHT_IN_FP32=weight_in_fp32, num_warps=warps)
    return y.view(x.shape), rstd.view(x.shape[:-1])


def _triton_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor):
    h = x.shape[-1]
    x2d, g2d = x.reshape(-1, h).contiguous(), grad.reshape(-1, h).contiguous()  # (rows, h)
    rows = x2d.shape[0]
    if not rows:
        return torch.empty_like(x), torch.zeros_like(weight)
    chunks = cdiv(next_pow2(h), BWD_CHUNK)  # column chunks of a row, each its own program
    block_r, block_h, warps = blocks(cdiv(h, chunks), BWD_TILE)
    programs = _num_programs(x.device, cdiv(rows, block_r))
    rows_per_prog = cdiv(cdiv(rows, programs), block_r) * block_r
    programs = max(1, cdiv(rows, rows_per_prog))
    dx = torch.empty_like(x2d)
    dw_part = torch.empty(programs, h, dtype=torch.float32, device=x.device)  # (programs, h)
    _rmsnorm_bwd[(programs * chunks,)](g2d, x2d, weight.contiguous(), rstd.reshape(-1).contiguous(),
                                       dx, dw_part, rows, h, rows_per_prog, BLOCK_R=block_r,
                                       BLOCK_H=block_h, CHUNKS=chunks, num_warps=warps)
    # second stage of the d weight reduction
    return dx.view(x.shape), dw_part.sum(0).to(weight.dtype)


def _torch_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool):
    xf = x.to(torch.float32, copy=True)  # (..., h)
    rstd = xf.square().mean(-1).add_(eps).rsqrt_()  # (...,)
    x_hat = xf.mul_(rstd.unsqueeze(-1))
    if weight_in_fp32:
        return (x_hat * weight.float()).to(torch.promote_types(x.dtype, weight.dtype)), rstd
    return x_hat.to(x.dtype) * weight, rstd


def _torch_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor):
    rstd = rstd.unsqueeze(-1)  # (..., 1)
    x_hat = x.to(torch.float32, copy=True).mul_(rstd)  # (..., h)
    g = grad.to(torch.float32, copy=True)
    grad_weight = (g * x_hat).flatten(0, -2).sum(0).to(weight.dtype)  # (h,)
    g.mul_(weight.to(torch.float32))  # d loss / d x_hat
    dot = torch.linalg.vecdot(g, x_hat).unsqueeze(-1).div_(x.shape[-1])  # (..., 1)
    return g.sub_(x_hat.mul_(dot)).mul_(rstd).to(x.dtype), grad_weight


@torch.library.custom_op("megapretrain::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 weight_in_fp32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    impl = _triton_forward if use_triton(x.device.type) else _torch_forward
    return impl(x, weight, eps, weight_in_fp32)


@_rms_norm_op.register_fake
def _(x, weight, eps, weight_in_fp32):
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return y, x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("megapretrain::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                          rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    impl = _triton_backward if use_triton(x.device.type) else _torch_backward
    return impl(grad, x, weight, rstd)


@_rms_norm_backward_op.register_fake
def _(grad, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight = inputs[:2]
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, grad_y, grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_backward_op(grad_y.contiguous(), x, weight, rstd)
    return dx, dw, None, None


_rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             weight_in_fp32: bool = False) -> torch.Tensor:
    """x (..., h) / rms(x) · weight (h,): the Triton kernels on CUDA (or under the interpreter).
    ``weight_in_fp32``: the weight multiplies x / rms(x) in fp32, one rounding after."""
    return _rms_norm_op(x, weight, eps, weight_in_fp32)[0]


class _RMSNormReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, weight_in_fp32: bool):
        y, rstd = _torch_forward(x, weight, eps, weight_in_fp32)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):
        dx, dw = _torch_backward(grad, *ctx.saved_tensors)
        return dx, dw, None, None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       weight_in_fp32: bool = False) -> torch.Tensor:
    """:func:`rms_norm` in plain torch (the model's formulas), for any device."""
    return _RMSNormReference.apply(x, weight, eps, weight_in_fp32)
