"""Accelerators: one table of peak FLOP/s, memory and bandwidth, for MFU logging and the planner.

Peaks are dense bf16/fp16 tensor-core figures from the vendors' datasheets (no sparsity); fp32
training runs on tf32 units at half of that (``train.tf32``, on by default), or at the plain fp32
figure (``fp32_tflops``) with TF32 off. ``fp8_tflops`` is the dense FP8 figure (twice bf16's on
Ada, Hopper and Blackwell; 0: no FP8 tensor cores that ``model.fp8``'s e4m3fn/e5m2 run on — MI300
has them for its fnuz formats only): the planner runs ``model.fp8``'s GEMMs
at it, while a run's logged MFU stays a fraction of the bf16 peak, as NVIDIA and torchtitan report
FP8 runs (so FP8 and bf16 runs compare on one scale). Memory bandwidths are the datasheets' HBM
figures. Bandwidths between GPUs are NCCL bus bandwidths typical of each device's usual node (within
a node) and of its usual fabric per GPU (between nodes: 200 Gb/s HDR InfiniBand per A100, 400 Gb/s
NDR per H100), for estimates.

The planner's kernel figures: ``efficiency`` is the fraction of the peak that large bf16 GEMMs
sustain in training (cuBLAS on an A100 ~250 of 312 TFLOP/s, on an H100 SXM ~650 of 989 at
training clocks); ``attention_efficiency`` the fraction a fused (flash) attention kernel sustains
on its causal FLOPs. Smaller matmuls fall below ``efficiency`` by the planner's roofline and
per-kernel overhead, not by a figure in this table.
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
    efficiency: float = 0.75  # fraction of peak large matmuls sustain (planner)
    hbm_gbs: float = 2000.0  # memory bandwidth, GB/s (planner: memory-bound kernels)
    # fraction of peak a flash-attention kernel sustains (planner)
    attention_efficiency: float = 0.5
    overhead_gb: float = 4.0  # CUDA context, NCCL buffers, allocator slack (planner)
    spare: float = 0.05  # fraction of memory a layout must leave free (planner)
    fp32_tflops: float = 0.0  # plain fp32 (no tensor cores: train.tf32 false); 0: unknown
    fp8_tflops: float = 0.0   # dense FP8 (e4m3/e5m2) tensor cores; 0: none that model.fp8 runs on


# key: the lower-case short name (``tools/plan.py --device``), matched against CUDA's device name
# (longest key first, so "a100-40gb" is tried before "a100")
_HOPPER = dict(efficiency=0.66, attention_efficiency=0.35)
DEVICES = {
    "h200": Device("H200 141GB", 989.0, 141.0, 360.0, 45.0, hbm_gbs=4800.0, **_HOPPER,
                   fp32_tflops=67.0, fp8_tflops=1979.0),
    "h100": Device("H100 SXM 80GB", 989.0, 80.0, 360.0, 45.0, hbm_gbs=3350.0, **_HOPPER,
                   fp32_tflops=67.0, fp8_tflops=1979.0),
    "h100-pcie": Device("H100 PCIe 80GB", 756.0, 80.0, 200.0, 45.0, hbm_gbs=2000.0, **_HOPPER,
                        fp32_tflops=51.0, fp8_tflops=1513.0),
    "gh200": Device("GH200 96GB", 989.0, 96.0, 360.0, 45.0, hbm_gbs=4000.0, **_HOPPER,
                    fp32_tflops=67.0, fp8_tflops=1979.0),
    "a100": Device("A100 SXM 80GB", 312.0, 80.0, 230.0, 22.0, efficiency=0.8, hbm_gbs=2039.0,
                   attention_efficiency=0.45, fp32_tflops=19.5),
    "a100-40gb": Device("A100 SXM 40GB", 312.0, 40.0, 230.0, 22.0, efficiency=0.8, hbm_gbs=1555.0,
                        attention_efficiency=0.45, fp32_tflops=19.5),
    "b200": Device("B200 180GB", 2250.0, 180.0, 720.0, 45.0, efficiency=0.6, hbm_gbs=8000.0,
                   attention_efficiency=0.35, fp32_tflops=80.0, fp8_tflops=4500.0),
    "mi300x": Device("MI300X 192GB", 1307.0, 192.0, 300.0, 45.0, efficiency=0.5, hbm_gbs=5300.0,
                     # FP8 2615 dense, in fnuz formats only
                     attention_efficiency=0.3, fp32_tflops=163.4),
    "mi250x": Device("MI250X 128GB", 383.0, 128.0, 150.0, 22.0, efficiency=0.6, hbm_gbs=3277.0,
                     attention_efficiency=0.35, fp32_tflops=47.9),
    "l40s": Device("L40S 48GB", 362.0, 48.0, 20.0, 12.0, efficiency=0.7, hbm_gbs=864.0,
                   fp32_tflops=91.6, fp8_tflops=733.0),
    "a10g": Device("A10G 24GB", 125.0, 24.0, 12.0, 6.0, gpus_per_node=4, efficiency=0.7,
                   hbm_gbs=600.0, fp32_tflops=31.2),
    "l4": Device("L4 24GB", 121.0, 24.0, 12.0, 6.0, efficiency=0.7, hbm_gbs=300.0, fp32_tflops=30.3,
                 fp8_tflops=242.5),
}


def find_device(cuda_name: str) -> Device | None:
    """The table's entry for a CUDA device name (``torch.cuda.get_device_name``), or None."""
    name = cuda_name.upper()
    # "GH200" before "H200", "A100-40GB" before "A100"
    for key in sorted(DEVICES, key=len, reverse=True):
        if all(part in name for part in key.upper().split("-")):
            return DEVICES[key]
    return None


def peak_for(found: Device, precision: str, tf32: bool = True) -> float | None:
    """``found``'s datasheet peak at ``precision``: the bf16/fp16 tensor-core figure, half of it for
    fp32 on TF32 tensor cores, or the plain fp32 figure with TF32 off (None when not in the
    table)."""
    if precision in ("bf16", "fp16"):
        return found.peak_tflops
    return found.peak_tflops / 2 if tf32 else (found.fp32_tflops or None)


def device_peak_tflops(device: torch.device, precision: str, tf32: bool = True) -> float | None:
    """Datasheet peak for this device at ``precision`` (``tf32``: fp32 matmuls on TF32 units), or
    None when unknown (e.g. CPUs)."""
    if device.type != "cuda":
        return None
    found = find_device(torch.cuda.get_device_name(device))
    return None if found is None else peak_for(found, precision, tf32)


def cpu_matmul_gflops(dtype: torch.dtype, n: int = 256, repeats: int = 3) -> float:
    """GFLOP/s of an n×n matmul on this CPU in ``dtype`` (a few milliseconds; best of
    ``repeats``)."""
    import time

    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / max(best, 1e-9) / 1e9


# CPU features (``torch.cpu.get_capabilities``' names) whose instructions run a precision's matmuls
NATIVE_HALF = {"bf16": ("avx512_bf16", "amx_bf16", "bf16"), "fp16": ("avx512_fp16", "amx_fp16")}


def native_half_precision(precision: str) -> bool:
    """Whether this CPU has instructions for ``precision`` (bf16/fp16) matmuls: AVX-512 BF16/FP16,
    AMX, Arm's BF16. Read off the CPU's feature flags, so the answer is the same under any load
    (a timing on a busy machine is not). False where this torch cannot tell (no
    ``torch.cpu.get_capabilities``, older releases): the timing decides there."""
    if not hasattr(torch.cpu, "get_capabilities"):
        return False
    found = torch.cpu.get_capabilities()
    return any(found.get(feature, False) for feature in NATIVE_HALF[precision])


def slow_half_precision_warning(precision: str) -> str | None:
    """A warning when ``precision`` (bf16/fp16) matmuls run far slower than fp32 on this CPU (no
    AVX-512 BF16 / AMX: the half-precision path is emulated), with the measured figures and the fix.
    A CPU with the instructions gets none without timing: under load a few-millisecond timing of
    each precision can land on either side of a busy moment and warn wrongly."""
    if native_half_precision(precision):
        return None
    half = cpu_matmul_gflops(torch.bfloat16 if precision == "bf16" else torch.float16)
    full = cpu_matmul_gflops(torch.float32)
    if half >= full / 4:
        return None
    return (f"train.precision={precision} on this CPU: a {precision} matmul runs at {half:.1f} "
            f"GFLOP/s against {full:.1f} in fp32 ({full / half:.0f}x slower; no native {precision} "
            "instructions); use --train.precision fp32 on this machine")


def with_device(device: Device, **changes) -> Device:
    """``device`` with the given figures replaced (None: keep the table's)."""
    return replace(device, **{k: v for k, v in changes.items() if v is not None})
