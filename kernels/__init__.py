"""Fused kernels, installed as ``megapretrain.kernels``.

Each module holds Triton kernels beside a plain-torch reference with the same signature:

- :mod:`.rmsnorm`: RMSNorm forward and backward (weight grad reduced in two stages).
- :mod:`.swiglu`: silu(gate) · up, the backward recomputing the activation.
- :mod:`.rope`: rotary embedding (rotate-half), forward and backward in one kernel.
- :mod:`.cross_entropy`: cross entropy with the gradient written over the logits, vocabulary
  padding, ignore-index, z-loss and a vocab-parallel form (statistics all-reduced over tp).
- :mod:`.linear_cross_entropy`: output layer + cross entropy over chunks of tokens, so the
  logits never exist; the torch form gives the CPU the same memory saving.
- :mod:`.adamw`: AdamW in one pass over a flat fp32 shard writing the bf16/fp16 parameter copy,
  and the sum of squares of the grads for the grad norm.

Each op is a ``torch.library.custom_op`` with a fake implementation (and an autograd formula where
it has a gradient), so ``torch.compile`` traces it. Dispatch: the Triton kernel on CUDA, the
reference on CPU, and Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is imported)
to run the real kernels on CPU in tests.
"""

from __future__ import annotations

import importlib.util
import os


def triton_available() -> bool:
    """Whether Triton is importable (the kernels' GPU path; optional on CPU)."""
    return importlib.util.find_spec("triton") is not None


def use_triton(device_type: str) -> bool:
    """Run Triton kernels on CUDA, or on CPU under the interpreter; else use the torch reference."""
    if not triton_available():
        return False
    return device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
