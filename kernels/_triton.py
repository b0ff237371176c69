"""Triton, when installed, behind the few helpers every kernel module uses.

Triton decides when it is imported whether its functions are compiled for a GPU or run by its
interpreter on CPU tensors (``TRITON_INTERPRET=1``): its own library (``tl.sum`` and the like) is
decorated then. :func:`jit` decorates the kernels here the same way as that library, so the two
always agree, and :func:`use_triton` refuses, with the fix, the one combination that cannot work
(the variable set after Triton was imported). Without Triton the kernel modules still import (their
torch references need nothing else); launching a kernel then raises.
"""

from __future__ import annotations

import contextlib
import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    INTERPRETED = isinstance(tl.sum, InterpretedFunction)  # how Triton itself was imported
except ImportError:  # the CPU path: torch references only
    triton = None
    INTERPRETED = False

    class _NoTriton:
        """Stands in for ``triton.language`` so kernel signatures (``BLOCK: tl.constexpr``)
        parse."""

        constexpr = None

    tl = _NoTriton()


class _Missing:
    """A kernel that cannot run: Triton is not installed."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        raise RuntimeError(f"{self.fn.__name__} needs Triton: pip install 'megapretrain[triton]'")


def jit(fn):
    """``triton.jit``, compiled or interpreted as Triton's own library is (see the module
    docstring)."""
    if triton is None:
        return _Missing(fn)
    return InterpretedFunction(fn) if INTERPRETED else JITFunction(fn)


_capture = None  # (on_launch, sm_count) while capture_launches() runs, else None


@contextlib.contextmanager
def capture_launches(on_launch, sm_count: int):
    """Run the ops' Triton path on tensors of any device (meta ones: no memory, no work) and launch
    nothing: each ``kernel[grid](*args, **kwargs)`` inside calls ``on_launch(kernel, args, kwargs)``
    instead (kwargs hold the constexprs and ``num_warps``), and grids are sized for a GPU of
    ``sm_count`` multiprocessors. What ``tools/check_kernels.py`` compiles ahead of time."""
    global _capture
    if triton is None or INTERPRETED:
        raise RuntimeError("capturing launches needs Triton imported without TRITON_INTERPRET")
    saved_run = JITFunction.run
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: on_launch(self, args, kwargs)
    _capture = (on_launch, sm_count)
    try:
        yield
    finally:
        JITFunction.run, _capture = saved_run, None


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` that persistent grids are sized for (on CPU 2: few
    programs)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _capture[1] if _capture is not None else 2


def use_triton(kind: str) -> bool:
    """Whether the ops run their Triton kernels on tensors of device type ``kind``, else the torch
    reference: the one rule the ops dispatch by (with their tensors' type) and ``model.kernels`` /
    ``optim.impl`` auto resolve by (with :func:`.dispatch.device_type`'s). Triton on CUDA; on other
    devices only under its interpreter (``TRITON_INTERPRET=1``, which must be set before Triton is
    imported: set after, this raises with the fix); always while :func:`capture_launches` runs;
    never without Triton."""
    if triton is None:
        return False
    if _capture is not None or kind == "cuda":
        return True
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    if not INTERPRETED:
        raise RuntimeError("TRITON_INTERPRET=1 was set after triton was imported; set it before "
                           "the first `import triton` (or start a fresh process with it set)")
    return True


@jit
def to_dtype(x, dtype: tl.constexpr):
    """``x.to(dtype)`` rounding to nearest even. Triton's interpreter truncates fp32 -> bf16 (the
    GPU rounds), so round explicitly first: the cast that follows is then exact on both."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


def next_pow2(n: int) -> int:
    """Smallest power of two ≥ n (block sizes must be powers of two)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
