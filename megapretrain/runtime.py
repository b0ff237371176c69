"""The process's device and numerics, set once at start-up, before any tensor or process group.

- :func:`resolve_device`: the device ``train.device`` names for this process.
- :func:`bind_device`: every CUDA process makes its GPU the current device — one process with
  ``LOCAL_RANK`` > 0 too (torchrun sets it; so do schedulers that hand a process one GPU of
  several) — so that Triton launches, the CUDA seed and the allocator all use the GPU the model
  lives on, not device 0.
- :func:`set_numerics`: ``train.tf32`` (fp32 matmuls on TF32 tensor cores, on by default on CUDA,
  as the MFU peak assumes) and ``train.deterministic`` (deterministic algorithms, a fixed cuBLAS
  workspace); returns the words the start-up plan prints.
- :func:`pinned_host_warning`: an asynchronous save copies the fp32 masters and Adam moments to
  pinned host memory; without ZeRO every rank pins the whole of its tensor/pipeline shard.
"""

from __future__ import annotations

import os

import torch

from .errors import ConfigError

# cuBLAS picks reduction orders per stream unless its workspace is fixed (NVIDIA's documented
# setting for reproducible results); read when cuBLAS starts, so it is set before any matmul
CUBLAS_WORKSPACE = ":4096:8"


def resolve_device(cfg) -> torch.device:
    """The device ``train.device`` names for this process: its ``LOCAL_RANK``'s GPU, or the CPU."""
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible (use --train.device "
                          "cpu)")
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def bind_device(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device (nothing on CPU)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def set_numerics(tf32: bool, deterministic: bool, precision: str, device: torch.device) -> str:
    """Apply ``train.tf32`` and ``train.deterministic``; the plan's words for what is in force."""
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    words = []
    if device.type == "cuda" and precision == "fp32":
        words.append("matmul=tf32" if tf32 else "matmul=fp32 (train.tf32 false: about 15x below "
                                                "the tf32 peak)")
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        # an op with no deterministic form warns
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        words.append("deterministic=on"
                     + (" (slower kernels: atomics-free reductions and attention backward)"
                        if device.type == "cuda" else ""))
    return " ".join(words)


def pinned_host_warning(device: torch.device, async_save: bool, zero: int,
                        params_per_rank: int) -> str | None:
    """The warning an asynchronous save deserves on CUDA without ZeRO: the host memory it pins."""
    if device.type != "cuda" or not async_save or zero >= 1:
        return None
    pinned = 12 * params_per_rank  # fp32 master + two Adam moments, copied to pinned host memory
    return (f"checkpoint.async with parallel.zero 0 pins {pinned / 2**30:.1f} GiB of host memory "
            f"per rank (12 B × {params_per_rank:,} parameters of this rank's shard); parallel.zero "
            "1 shards it over dp")
