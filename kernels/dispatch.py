"""Where the fused kernels run: the device type the program makes its choices for.

``kernels/`` is installed as ``megapretrain.kernels``, a namespace package: it has no
``__init__.py``, so a regular package named ``kernels`` installed elsewhere (the hub's, which
transformers imports) wins over this directory when the repository root is on ``sys.path``. Each
module holds Triton kernels beside a plain-torch reference with the same signature:

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
it has a gradient), so ``torch.compile`` traces it. Dispatch (:func:`._triton.use_triton`): the
Triton kernel on CUDA, the reference on CPU, and Triton's interpreter (``TRITON_INTERPRET=1``, set
before Triton is imported) to run the real kernels on CPU in tests.

Where the program's choices depend on the device — which kernels, the output layer's loss path,
chunk sizes — it asks :func:`device_type`: the tensors' own device type, or inside
:func:`simulated_device` the one a simulation stands in for (``megapretrain.simulate`` runs a
GPU rank's program on fake CPU tensors: torch builds without CUDA cannot differentiate fake CUDA
tensors, so the tensors stay on the CPU and the choices are the GPU's).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_SIMULATED: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "megapretrain_simulated_device", default=None)


@contextlib.contextmanager
def simulated_device(device_type: str):
    """Inside: :func:`device_type` answers ``device_type`` (e.g. "cuda") for every device."""
    token = _SIMULATED.set(device_type)
    try:
        yield
    finally:
        _SIMULATED.reset(token)


def device_type(device: torch.device | str) -> str:
    """The device type the program makes its choices for: ``device``'s, or the simulated one."""
    return _SIMULATED.get() or torch.device(device).type

