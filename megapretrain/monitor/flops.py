"""Accelerators: one table of peak FLOP/s, memory and bandwidth, for MFU logging and the planner.

Peaks are dense bf16/fp16 tensor-core figures from the vendors' datasheets (no sparsity); fp32
training runs on tf32 units at half of that. Bandwidths are NCCL bus bandwidths typical of each
device's usual node (within a node) and of a 400 Gb/s-per-GPU fabric (between nodes), for estimates.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Device:
    name: str
    peak_tflops: float    # dense bf16
    memory_gb: float
    intra_gbs: float      # NCCL bus bandwidth between GPUs of a node, GB/s
    inter_gbs: float      # per GPU between nodes, GB/s
    gpus_per_node: int = 8
    efficiency: float = 0.55  # fraction of peak the matmul-heavy work reaches (planner)
    overhead_gb: float = 4.0  # CUDA context, NCCL buffers, allocator slack (planner)
    spare: float = 0.05  # fraction of memory a layout must leave free (planner)


# key: the lower-case short name (``tools/plan.py --device``), matched against CUDA's device name
DEVICES = {
    "h200": Device("H200 141GB", 989.0, 141.0, 360.0, 45.0),
    "h100": Device("H100 SXM 80GB", 989.0, 80.0, 360.0, 45.0),
    "gh200": Device("GH200 96GB", 989.0, 96.0, 360.0, 45.0),
    "a100": Device("A100 SXM 80GB", 312.0, 80.0, 230.0, 22.0),
    "b200": Device("B200 180GB", 2250.0, 180.0, 720.0, 45.0),
    "mi300x": Device("MI300X 192GB", 1307.0, 192.0, 300.0, 45.0),
    "mi250x": Device("MI250X 128GB", 383.0, 128.0, 150.0, 22.0),
    "l40s": Device("L40S 48GB", 362.0, 48.0, 20.0, 12.0),
    "a10g": Device("A10G 24GB", 125.0, 24.0, 12.0, 6.0, gpus_per_node=4),
    "l4": Device("L4 24GB", 121.0, 24.0, 12.0, 6.0),
}


def find_device(cuda_name: str) -> Device | None:
    """The table's entry for a CUDA device name (``torch.cuda.get_device_name``), or None."""
    name = cuda_name.upper()
    for key in sorted(DEVICES, key=len, reverse=True):  # "GH200" before "H200"
        if key.upper() in name:
            return DEVICES[key]
    return None


def device_peak_tflops(device: torch.device, precision: str) -> float | None:
    """Datasheet peak for this device at ``precision``, or None when unknown (e.g. CPUs)."""
    if device.type != "cuda":
        return None
    found = find_device(torch.cuda.get_device_name(device))
    if found is None:
        return None
    return found.peak_tflops if precision in ("bf16", "fp16") else found.peak_tflops / 2  # tf32


def with_device(device: Device, **changes) -> Device:
    """``device`` with the given figures replaced (None: keep the table's)."""
    return replace(device, **{k: v for k, v in changes.items() if v is not None})
