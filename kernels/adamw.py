"""Fused AdamW over a flat fp32 shard, and the sum of squares of its gradients, in one pass each.

The distributed optimizer owns each parameter's fp32 master, both Adam moments and its gradient as
slices of flat shards. Unfused, a step reads and writes them in several passes and copies the
masters into the bf16/fp16 model parameters in one more. :func:`fused_adamw_` reads grad, master,
exp_avg and exp_avg_sq once and writes master, moments and (optionally) the low-precision parameter
copy in the same pass: 16 bytes read and 12 + 2 written per element, the minimum for AdamW (with
bf16 moments, ``optim.moments_dtype`` bf16: 12 read and 8 + 2 written; each moment is widened to
fp32 as it is read, stepped in fp32 and rounded to nearest even as it is written). Inside
it apply the grad scale factor (grad-clip coefficient × 1 / loss scale, a device tensor, so no host
sync), the skip of a step whose gradients were not finite (``found_inf``, a device flag),
decoupled weight decay per element through a bit mask (:func:`decay_mask`; 1-D parameters such as
norm weights get none) and bias correction. :func:`grad_sq_sum` is the companion for the
grad norm: each grad read once, partial sums per block in fp32 (scaled by the block's largest
grad, so that no square overflows), summed in fp64.

The update is torch's (``torch.optim.AdamW`` / ``torch._fused_adamw_``):
``p -= lr·wd·p; m = lerp(m, g, 1-β1); v = β2·v + (1-β2)·g²; p -= lr/bc1 · m / (√v/√bc2 + eps)``.
:func:`fused_adamw_reference` is the same in plain torch ops.
"""

from __future__ import annotations

import math

import torch

from ._triton import cdiv, jit, tl, to_dtype, use_triton

BLOCK = 1024  # 8 elements per thread: the five streams fit in registers with room for occupancy
SQ_BLOCK = 4096


@jit
def _adamw_kernel(grad_ptr, master_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, mask_ptr, scale_ptr,
                  skip_ptr, n, beta1, beta2, eps, lr_wd, step_size, bc2_sqrt, HAS_OUT: tl.constexpr,
                  HAS_MASK: tl.constexpr, HAS_SKIP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    if HAS_SKIP:  # a skipped step writes nothing
        live = live & (offs * 0 + tl.load(skip_ptr) == 0)  # the flag broadcast over the block
    g = tl.load(grad_ptr + offs, mask=live, other=0.0).to(tl.float32) * tl.load(scale_ptr)
    p = tl.load(master_ptr + offs, mask=live, other=0.0)
    # fp32 or bf16 moments: the math in fp32 either way
    m = tl.load(exp_avg_ptr + offs, mask=live, other=0.0).to(tl.float32)
    v = tl.load(exp_avg_sq_ptr + offs, mask=live, other=0.0).to(tl.float32)
    if HAS_MASK:  # bit (i % 32) of word i // 32 says whether element i decays
        word = tl.load(mask_ptr + offs // 32, mask=live, other=0)
        p = tl.where(((word >> (offs % 32).to(tl.int32)) & 1) != 0, p - lr_wd * p, p)
    else:
        p = p - lr_wd * p
    m = m + (1.0 - beta1) * (g - m)  # lerp(m, g, 1 - beta1)
    v = beta2 * v + (1.0 - beta2) * g * g
    # correctly rounded square root and divisions, as torch's (the GPU's defaults are approximate)
    p = p - step_size * tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)
    tl.store(master_ptr + offs, p, mask=live)
    tl.store(exp_avg_ptr + offs, to_dtype(m, exp_avg_ptr.dtype.element_ty), mask=live)
    tl.store(exp_avg_sq_ptr + offs, to_dtype(v, exp_avg_sq_ptr.dtype.element_ty), mask=live)
    if HAS_OUT:
        tl.store(out_ptr + offs, to_dtype(p, out_ptr.dtype.element_ty), mask=live)


@jit
def _sq_sum_kernel(grad_ptr, partial_ptr, top_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    g = tl.abs(tl.load(grad_ptr + offs, mask=offs < n, other=0.0).to(tl.float32))  # (BLOCK,)
    top = tl.maximum(tl.max(g, axis=0), 1.1754944e-38)  # at least the smallest normal: no 0 / 0
    # in [0, 1]: no square overflows or underflows; correctly rounded (the bound needs it)
    r = tl.div_rn(g, top)
    tl.store(partial_ptr + tl.program_id(0), tl.sum(r * r, axis=0))  # a tree of fp32 adds
    tl.store(top_ptr + tl.program_id(0), top)


def decay_mask(numel: int, ranges, device=None) -> torch.Tensor:
    """Bit mask (ceil(numel / 32),) int32 from ``ranges`` of (start, end, decay): element i decays
    iff the last range covering it says so; uncovered elements (shard padding) do not."""
    flags = torch.zeros(cdiv(numel, 32) * 32, dtype=torch.bool)
    for start, end, decay in ranges:
        flags[start:end] = bool(decay)
    # (numel/32,) in [0, 2^32)
    words = (flags.view(-1, 32).to(torch.int64) << torch.arange(32)).sum(1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # as int32 bit patterns
    return words.to(torch.int32).to(device)


def _unpack(mask: torch.Tensor, numel: int) -> torch.Tensor:
    # (words, 32)
    bits = (mask.to(torch.int64)[:, None] >> torch.arange(32, device=mask.device)) & 1
    return bits.flatten()[:numel].bool()


def _check(grad, master, exp_avg, exp_avg_sq, param_out, mask) -> None:
    flat = [t for t in (grad, master, exp_avg, exp_avg_sq, param_out) if t is not None]
    if any(t.dim() != 1 or not t.is_contiguous() or t.numel() != master.numel() for t in flat):
        raise ValueError(f"fused_adamw_ needs contiguous 1-D tensors of one length, got shapes "
                         f"{[tuple(t.shape) for t in flat]}")
    if master.dtype != torch.float32 or exp_avg.dtype != exp_avg_sq.dtype \
            or exp_avg.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"fused_adamw_ keeps the master in float32 and both moments in float32 or "
                         f"both in bfloat16, got {master.dtype}, {exp_avg.dtype}, "
                         f"{exp_avg_sq.dtype}")
    if mask is not None and (mask.dtype != torch.int32 or mask.numel() != cdiv(master.numel(), 32)):
        raise ValueError(f"decay mask must be int32 of {cdiv(master.numel(), 32)} words "
                         f"(kernels.adamw.decay_mask), got {mask.dtype} of {mask.numel()}")


def _scalars(lr: float, beta1: float, beta2: float, weight_decay: float, step: int):
    """(lr·wd, lr / bias correction 1, √bias correction 2), in double as torch computes them."""
    return lr * weight_decay, lr / (1.0 - beta1 ** step), math.sqrt(1.0 - beta2 ** step)


def _triton_adamw_(grad, master, exp_avg, exp_avg_sq, param_out, mask, scale, skip, lr, beta1,
                   beta2, eps, weight_decay, step) -> None:
    lr_wd, step_size, bc2_sqrt = _scalars(lr, beta1, beta2, weight_decay, step)
    n = master.numel()
    if not n:
        return
    _adamw_kernel[(cdiv(n, BLOCK),)](grad, master, exp_avg, exp_avg_sq,
                                     param_out if param_out is not None else master,
                                     mask if mask is not None else master, scale,
                                     skip if skip is not None else scale, n, beta1, beta2, eps,
                                     lr_wd, step_size, bc2_sqrt, HAS_OUT=param_out is not None,
                                     HAS_MASK=mask is not None, HAS_SKIP=skip is not None,
                                     BLOCK=BLOCK)


def _torch_adamw_(grad, master, exp_avg, exp_avg_sq, param_out, mask, scale, skip, lr, beta1, beta2,
                  eps, weight_decay, step) -> None:
    if skip is not None and bool(skip.reshape(-1)[0]):  # the reference reads the flag on the host
        return
    lr_wd, step_size, bc2_sqrt = _scalars(lr, beta1, beta2, weight_decay, step)
    g = grad.float() * scale  # (n,) fp32
    if weight_decay:
        decayed = master * lr_wd
        master.sub_(decayed if mask is None else decayed * _unpack(mask, master.numel()))
    m, v = exp_avg.float(), exp_avg_sq.float()  # bf16 moments: stepped in fp32 copies
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    master.addcdiv_(m, v.sqrt().div_(bc2_sqrt).add_(eps), value=-step_size)
    if m is not exp_avg:  # rounded back to bf16 (to nearest even)
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
    if param_out is not None:
        param_out.copy_(master)


@torch.library.custom_op("megapretrain::fused_adamw_",
                         mutates_args=("master", "exp_avg", "exp_avg_sq", "param_out"))
def _fused_adamw_op(grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, param_out: torch.Tensor | None,
                    mask: torch.Tensor | None, scale: torch.Tensor, skip: torch.Tensor | None,
                    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                    step: int) -> None:
    _check(grad, master, exp_avg, exp_avg_sq, param_out, mask)
    impl = _triton_adamw_ if use_triton(grad.device.type) else _torch_adamw_
    impl(grad, master, exp_avg, exp_avg_sq, param_out, mask, scale, skip, lr, beta1, beta2, eps,
         weight_decay, step)


@_fused_adamw_op.register_fake
def _(grad, master, exp_avg, exp_avg_sq, param_out, mask, scale, skip, lr, beta1, beta2, eps,
      weight_decay, step):
    return None


def _skip_tensor(found_inf, like: torch.Tensor) -> torch.Tensor | None:
    return None if found_inf is None else found_inf.reshape(1).to(device=like.device,
                                                                  dtype=torch.int32)


def _scale_tensor(scale, like: torch.Tensor) -> torch.Tensor:
    if isinstance(scale, torch.Tensor):
        return scale.reshape(1).to(device=like.device, dtype=torch.float32)
    return torch.full((1,), float(scale), dtype=torch.float32, device=like.device)


def fused_adamw_(grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, step: int, param_out: torch.Tensor | None = None,
                 decay: torch.Tensor | None = None, grad_scale: float | torch.Tensor = 1.0,
                 found_inf: torch.Tensor | None = None) -> None:
    """One AdamW step, in place, over flat (n,) shards: ``master`` (fp32), ``exp_avg``,
    ``exp_avg_sq`` (both fp32, or both bf16: stepped in fp32 and rounded back) from ``grad`` (fp32
    or low precision) times ``grad_scale``; ``step`` counts from 1.

    ``decay`` is a :func:`decay_mask` (None: every element decays); ``param_out`` (n,) bf16/fp16,
    if given, receives the new master rounded to its dtype. ``found_inf``: a one-element device
    flag; when it is nonzero nothing is written (the step is skipped without a host sync).
    """
    _fused_adamw_op(grad, master, exp_avg, exp_avg_sq, param_out, decay,
                    _scale_tensor(grad_scale, master), _skip_tensor(found_inf, master), lr, beta1,
                    beta2, eps, weight_decay, step)


def fused_adamw_reference(grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor,
                          exp_avg_sq: torch.Tensor, *, lr: float, beta1: float, beta2: float,
                          eps: float, weight_decay: float, step: int,
                          param_out: torch.Tensor | None = None, decay: torch.Tensor | None = None,
                          grad_scale: float | torch.Tensor = 1.0,
                          found_inf: torch.Tensor | None = None) -> None:
    """:func:`fused_adamw_` in plain torch ops, on any device."""
    _check(grad, master, exp_avg, exp_avg_sq, param_out, decay)
    _torch_adamw_(grad, master, exp_avg, exp_avg_sq, param_out, decay,
                  _scale_tensor(grad_scale, master), _skip_tensor(found_inf, master), lr, beta1,
                  beta2, eps, weight_decay, step)


@torch.library.custom_op("megapretrain::grad_sq_sum", mutates_args=())
def _grad_sq_sum_op(grad: torch.Tensor) -> torch.Tensor:
    if not use_triton(grad.device.type):
        return grad.double().square().sum()
    n = grad.numel()
    blocks = max(cdiv(n, SQ_BLOCK), 1)
    partial, top = (torch.zeros(blocks, dtype=torch.float32, device=grad.device) for _ in range(2))
    if n:
        _sq_sum_kernel[(blocks,)](grad.contiguous(), partial, top, n, BLOCK=SQ_BLOCK)
    return (top.double().square() * partial.double()).sum()  # (blocks,) -> 0-d, in fp64


@_grad_sq_sum_op.register_fake
def _(grad):
    return grad.new_empty((), dtype=torch.float64)


def grad_sq_sum(grad: torch.Tensor) -> torch.Tensor:
    """Σ grad² of a flat shard as a 0-d float64 tensor (no host sync), reading each grad once.

    Each block of SQ_BLOCK elements gives its max |g| and Σ (g / max)² in fp32 (the division
    correctly rounded, ``tl.div_rn``: the GPU's default division is not), a tree of adds over values
    in [0, 1]; the blocks are combined in fp64 as Σ max² · partial. Relative error at most
    (log2(SQ_BLOCK) + 3) · 2⁻²⁴ ≈ 9e-7 against the exact sum, for any finite grads: no square
    overflows (plain fp32 squares do above 1.8e19) or underflows (below about 1e-19 where the GPU
    flushes denormals). A NaN or infinite grad gives a non-finite sum."""
    return _grad_sq_sum_op(grad.reshape(-1))


def grad_sq_sum_reference(grad: torch.Tensor) -> torch.Tensor:
    """:func:`grad_sq_sum` in plain torch."""
    return grad.reshape(-1).double().square().sum()
