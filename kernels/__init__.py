"""Fused kernels, installed as ``megapretrain.kernels``.

Each kernel sits beside a plain-torch reference with the same signature. Dispatch: the Triton kernel
on CUDA, the reference on CPU, and Triton's interpreter (``TRITON_INTERPRET=1``) to run the real
kernels on CPU in tests.
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
