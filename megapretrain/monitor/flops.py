"""Peak throughput of known accelerators, for MFU (model FLOPs utilization)."""

from __future__ import annotations

import torch

# Dense bf16/fp16 tensor-core peak TFLOP/s per device (vendor datasheets, no sparsity).
_PEAK_BF16 = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "A100": 312.0, "A10G": 125.0,
              "L40S": 362.0, "L4": 121.0, "B200": 2250.0, "MI300X": 1307.0, "MI250X": 383.0}


def device_peak_tflops(device: torch.device, precision: str) -> float | None:
    """Datasheet peak for this device at ``precision``, or None when unknown (e.g. CPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    for key, peak in sorted(_PEAK_BF16.items(), key=lambda kv: -len(kv[0])):
        if key in name:
            return peak if precision in ("bf16", "fp16") else peak / 2  # tf32 is half of bf16
    return None
