"""The planner's model of FP8 training (``model.fp8``): what changes against the bf16 estimate.

- Every decoder linear's three GEMMs run at the device's FP8 peak (``Device.fp8_tflops``, twice
  bf16's) with 1-byte operands; the output layer and attention stay in bf16.
- Each GEMM operand is cast first, a memory-bound kernel per cast: one read for the amax and one
  for the cast (bf16, 2 bytes each), one write (e4m3, 1 byte) — 5 bytes an element, plus the
  transposed copy some backward operands need (2 bytes: read and write FP8). Forward: each linear's
  input and weight; backward: the output gradient (rowwise: twice, per row and per column), the
  weight again, the input again (tensorwise: from the saved scale; rowwise: per column).
- Sequence parallelism's input all-gathers (forward, and tensorwise's backward re-gathers) send
  FP8: half the bytes of two of the forward's four tp collectives and of the backward's re-gathers.
- Memory: the FP8 operands of the largest linear exist while its GEMMs run (the weight, its
  transposed copy and the input in FP8, and the fp32 product a cast computes of the input);
  tensorwise with sequence parallelism keeps the two column-parallel inputs of a layer as FP8
  shards (1 byte instead of 2); ZeRO-3 gathers tensorwise weights as FP8 (1 byte instead of 2).

Casts of a torch.compile'd layer fuse their reads: these are the eager figures, an upper bound.
A layout whose FP8 GEMMs the run would refuse (``model/fp8.py``: a linear's shard on a tp rank, or
a micro-batch's tokens on a rank, not a multiple of 16) is not a layout of the search; the linears
``model.fp8_skip`` names pass that rule, but the time and memory here count every linear in FP8.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ConfigError
from ..model.args import ModelArgs
from ..model.families import layer_spec
from ..model.fp8 import GEMM_MULTIPLE, unfit_linears
from ..monitor.flops import Device

CAST_BYTES = 5.0       # per element cast: amax read (2) + cast read (2) + FP8 write (1)
TRANSPOSE_BYTES = 2.0  # per element of an FP8 operand copied to the other layout


@dataclass(frozen=True)
class FP8Delta:
    """What FP8 changes in one layer's estimate for one micro-batch on one tp rank."""
    matmul_f: float    # seconds of the FP8 GEMMs (replacing the bf16 ones)
    matmul_b: float
    cast_f: float      # seconds of the casts (added to the memory-bound kernels)
    cast_b: float
    tp_fraction_f: float  # fraction of the forward's tp collective bytes that remain
    tp_fraction_b: float
    transient_bytes: float  # the largest linear's FP8 operands while its GEMMs run
    saved_bytes_per_token: float  # activation bytes per token and layer saved (kept as FP8)
    gathered_fraction: float  # ZeRO-3: fraction of a layer's gathered bytes that remain


def _linears(args: ModelArgs, tp: int) -> list[tuple[int, int, int]]:
    """(out, in, how many read the same input) of each linear group of a layer on one tp rank:
    q/k/v (or fused qkv), o, gate/up (or GELU's up), down."""
    h, d, f = args.hidden_size, args.head_dim, args.ffn_hidden_size
    n, kv = args.num_heads // tp, args.num_kv_heads // tp
    mlp_in = 1 if args.mlp == "gelu" else 2
    fused = layer_spec(args).fused_qkv  # one q/k/v linear reading the input once
    return [((n + 2 * kv) * d, h, 1 if fused else 3), (h, n * d, 1), (mlp_in * f // tp, h, mlp_in),
            (h, f // tp, 1)]


def check_fp8_peak(device: Device, recipe: str) -> None:
    """A device of the table without FP8 tensor cores cannot plan ``recipe``: one line."""
    if recipe != "none" and device.fp8_tflops <= 0:
        raise ConfigError(f"model.fp8={recipe}: the {device.name} has no FP8 tensor cores (set "
                          "--model.fp8 none, or plan for H100/H200/B200/L40S/L4)")


def fp8_delta(args: ModelArgs, device: Device, recipe: str, micro: int, seq: int, tp: int, cp: int,
              sequence_parallel: bool, gemm_s, memory_s, skip: tuple[str, ...] = ()) -> FP8Delta:
    """``recipe``'s effect on one layer (see the module docstring); ``gemm_s(device, m, n, k)``
    and ``memory_s(device, bytes, kernels)`` are the planner's kernel models (bf16 GEMMs);
    ``skip``: ``model.fp8_skip``. A ConfigError where the run would refuse the layout's shapes."""
    check_fp8_peak(device, recipe)
    unfit = unfit_linears(args, tp, list(skip))
    if unfit or micro * seq // cp % GEMM_MULTIPLE:
        sizes = ", ".join(f"{name} {out}×{inp}" for name, (out, inp) in unfit.items()) or \
            f"{micro * seq // cp} tokens a micro-batch"
        raise ConfigError(f"model.fp8={recipe} at tp {tp}, cp {cp}: {sizes} on a rank, not "
                          f"multiples of {GEMM_MULTIPLE} (FP8 GEMMs' rule)")
    # gemm_s counts 2 bytes an operand element: twice the bandwidth stands for FP8's 1
    fp8_device = replace(device, peak_tflops=device.fp8_tflops, hbm_gbs=device.hbm_gbs * 2)
    tokens = micro * seq // cp
    rowwise, sp = recipe == "rowwise", sequence_parallel and tp > 1
    matmul_f = matmul_b = cast_f = cast_b = 0.0
    for i, (out, inp, readers) in enumerate(_linears(args, tp)):
        matmul_f += gemm_s(fp8_device, tokens, out, inp)
        matmul_b += gemm_s(fp8_device, tokens, inp, out) + gemm_s(fp8_device, out, inp, tokens)
        # q/k/v and gate/up: under SP their input is cast once, as a shard, and gathered
        column = i in (0, 2)
        x = tokens * inp / tp if column and sp else readers * tokens * inp
        w, g = out * inp, tokens * out
        cast_f += (x + w) * CAST_BYTES
        cast_b += ((2 if rowwise else 1) * g * CAST_BYTES + w * (CAST_BYTES + TRANSPOSE_BYTES)
                   + readers * tokens * inp * (CAST_BYTES + TRANSPOSE_BYTES) + g * TRANSPOSE_BYTES)
    largest_w = max(out * inp / readers for out, inp, readers in _linears(args, tp))
    largest_x = max(tokens * inp for _, inp, _ in _linears(args, tp))
    transient = 2 * largest_w + largest_x * (1 + 4)  # W and its copy, x and its fp32 product
    # forward: two of the four tp collectives are the input all-gathers; backward (SP): of the
    # six, the two re-gathers (tensorwise: FP8, rowwise: bf16, as the weight gradient needs x)
    tp_f = 1.0 - 0.5 * 2 / 4 if sp else 1.0
    tp_b = 1.0 - (0.0 if rowwise else 0.5 * 2 / 6) if sp else 1.0
    # two inputs: 2 → 1 byte each
    saved = 2.0 * args.hidden_size / tp if sp and not rowwise else 0.0
    split = sum(out * inp for out, inp, _ in _linears(args, tp))
    # the layer's parameters on a tp rank (norms: a rounding error)
    layer = split + 4 * args.hidden_size
    gathered = 1.0 - (0.0 if rowwise else 0.5 * split / layer)
    return FP8Delta(matmul_f, matmul_b, memory_s(device, cast_f, 14), memory_s(device, cast_b, 24),
                    tp_f, tp_b, transient, saved, gathered)


def fp8_memory(delta: FP8Delta, memory: dict, *, tokens: int, in_flight: int, per_chunk: int,
               zero: int, gathered_bytes: float) -> dict:
    """The bf16 estimate's ``memory`` with FP8's copies (see the module docstring): ``tokens`` of
    a micro-batch on a rank, ``in_flight`` micro-batch chunks of ``per_chunk`` layers each holding
    activations, ``gathered_bytes`` of layers ZeRO-3 holds gathered at once."""
    out = dict(memory)
    change = delta.transient_bytes - in_flight * per_chunk * tokens * delta.saved_bytes_per_token
    out["activations"] += change
    if zero == 3:  # never more than the estimate holds gathered
        saved = min(gathered_bytes,
                    memory["parts"]["zero3_gathered"]) * (1.0 - delta.gathered_fraction)
        out["params"] -= saved
        out["state"] -= saved
        change -= saved
    out["total"] += change
    return out
