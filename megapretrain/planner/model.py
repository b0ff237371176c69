"""Memory and time of a run under a parallel layout, before any GPU hour is spent.

The model behind ``tools/plan.py``. For one layout it estimates, per GPU of the busiest pipeline
stage, the bytes of weights, gradients, optimizer state and activations, and the time of one
optimizer step; :func:`search` ranks every layout of a config on a GPU count.

Memory follows the implementation, not a rule of thumb: ``planner/memory.py`` estimates every
stage's peak by part — weights, gradients and optimizer state of the ZeRO stage, what autograd
keeps of the micro-batch chunk computing and of those the real schedule holds in flight, ZeRO-3's
gathered layers, the peak moment's buffers — and is held to the trainer's own program simulated on
fake tensors (``tools/check_planner.py``: within 5% on a sweep of 8B, 70B and 405B layouts). The
busiest stage, plus a fixed allowance for the CUDA context, NCCL buffers and allocator slack, is
the layout's figure; a layout fits when that leaves 5% of the device's memory free.

Time is built from the kernels of one layer, not from one efficiency figure:

- every matmul of the layer (forward, and the data- and weight-gradient matmuls of the backward)
  at its own shape on one tp rank: ``max(FLOPs / (peak · efficiency), bytes / HBM bandwidth)``
  plus a fixed per-kernel overhead, so narrow or short matmuls fall below the device's large-GEMM
  ``efficiency`` by themselves;
- attention: a fused (flash) kernel on its causal FLOPs (under sliding windows the pairs inside
  them, averaged over the layers) at ``attention_efficiency``, its backward 2.5× its forward;
  or, as Megatron ran before flash attention (``attention="unfused"``), two batched matmuls per
  head plus the softmax (and dropout) passes over the ``s × s`` scores in memory;
- memory-bound kernels (norms, residual adds, dropout, activation function, RoPE, the loss) as bytes
  moved over 80% of the HBM bandwidth; the backward moves twice the forward's;
- recomputation re-runs the forward (full) or the attention core (selective) before the backward;
- tensor-parallel collectives on the critical path, ring passes of the ``(b, s, h)`` activation at
  the NCCL bus bandwidth plus a latency each; with ``tp_comm_overlap`` only what a ring step takes
  beyond the GEMM chunk it runs under (``_overlapped``);
- context parallelism: a rank's matmuls, memory-bound kernels and loss run on its s/cp tokens, its
  causal attention on 1/cp of the (query, key) pairs (the load-balanced split), and every layer
  reaches the other ranks' keys as ``parallel.cp_comm`` says (``planner/comm.py``): all-gathers K
  and V (``2·b·s·kv·d/tp`` values) and reduce-scatters their gradients, exposed; passes them
  around a ring under each block's attention, exposed only beyond it; or two all-to-alls each
  way, exposed (full recompute repeats the forward's);
- FP8 linears (``model.fp8``): their GEMMs at the device's FP8 peak, their casts as memory-bound
  kernels, FP8 input all-gathers, FP8 copies in memory (``planner/fp8.py``, applied by
  :func:`estimate`);
- the pipeline bubble from replaying the real schedule with the busiest stage's forward and
  backward times, the point-to-point transfers, the exposed part of the data-parallel
  reduce-scatter / all-gather (they overlap the last backward and the next forward), and the
  optimizer step (memory-bound over its shard).

MFU counts the model's FLOPs (``model/decoder.py``'s ``flops_per_token``, PaLM's convention); HFU
also counts what recomputation runs again, as Megatron's papers report "achieved TFLOP/s". Parameter
counts come from the model's own spec table (``model/build.py``), devices from ``monitor/flops.py``.
``tests/test_planner.py`` checks the estimates against published runs (Megatron-LM on A100s, Llama 3
on H100s); they are estimates to choose a layout with, to be checked with ``tools/bench_train.py``.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..errors import ConfigError, UserError
from ..model.args import ModelArgs, model_args
from ..model.attention import dense_document_mask
from ..model.build import one_layer_specs
from ..model.decoder import flops_per_token, num_parameters
from ..monitor.flops import Device
from ..parallel.layout import Layout, split_layers
from ..parallel.pipeline import Schedule, resolve_schedule
from .comm import context_comm_s, context_modes, kv_copies
from .fp8 import check_fp8_peak, fp8_delta, fp8_memory
from .memory import stage_memory, stage_params
from .optimizer import ADAMW, OptimizerSpec, muon_step_seconds
from .pipeline import (
    deferred_bytes_per_token,
    head_stage,
    layers_per_stage,
    pipeline_model,
    schedules,
)

if TYPE_CHECKING:
    from ..config import Config

GIB = 2**30
KERNEL_S = 2e-6        # fixed cost of every kernel (launch gap, ramp-up and tail of its waves)
GEMM_S = 6e-6          # a matmul's: its first and last waves of tiles run part-empty (A100: a 1024³
#                        bf16 matmul reaches about half of what a 4096³ one does)
HBM_EFFICIENCY = 0.8   # fraction of the HBM bandwidth memory-bound kernels reach
LATENCY_INTRA_S = 10e-6  # per collective, NVLink
LATENCY_INTER_S = 30e-6  # per collective, between nodes
ATTENTION = ("flash", "unfused")


@functools.cache
def layer_params(args: ModelArgs) -> tuple[int, int, int]:
    """(tp-split, replicated) parameters of one decoder layer and the head's replicated ones (the
    final norm), from the model's spec table (the family's own layers, GELU MLP included)."""
    specs = one_layer_specs(args).values()
    split = sum(s.numel for s in specs if s.layer == 0 and s.tp_dim is not None)
    replicated = sum(s.numel for s in specs if s.layer == 0 and s.tp_dim is None)
    head = sum(s.numel for s in specs if s.layer is None and not s.vocab)
    return split, replicated, head


def activation_bytes_per_token(args: ModelArgs, tp: int, sequence_parallel: bool,
                               recompute: str = "none", seq: int = 0, attention: str = "flash",
                               cp: int = 1) -> float:
    """What autograd keeps per token of one decoder layer in bf16 (see the module docstring); with
    ``cp`` per token of a rank's share, its attention keeping the gathered K/V of all ``seq``."""
    h, kvd, f = args.hidden_size, args.num_kv_heads * args.head_dim, args.ffn_hidden_size
    if recompute == "full":
        return 2.0 * h / (tp if sequence_parallel else 1)
    if args.mlp == "gelu":
        # the activation saves one f-wide input instead of SwiGLU's two (8·f = 2 bytes × 4)
        f = f * 3 / 4
    full = 12 * h + 4 * kvd * cp + 8 * f
    # softmax output (+ dropout mask, output)
    if attention == "unfused" and recompute != "selective":
        full += (2 + 3 * (args.attention_dropout > 0)) * args.num_heads * seq
    if sequence_parallel or tp == 1:
        return full / tp
    return 8 * h + (full - 8 * h) / tp  # norm and column-parallel inputs whole on every tp rank


def state_bytes_per_param(precision: str, zero: int, dp: int) -> float:
    """Weights + gradients + master + Adam moments per parameter on one rank."""
    weights = 2.0 if precision in ("bf16", "fp16") else 4.0
    master = 4.0 if weights == 2.0 else 0.0  # fp32 weights are their own master
    if zero == 0:
        return weights + 4.0 + master + 8.0
    if zero == 1:
        return weights + 4.0 + (master + 8.0) / dp
    if zero == 2:
        return weights + (4.0 + master + 8.0) / dp
    return (weights + 4.0 + master + 8.0) / dp


# ----------------------------------------------------------------------------------------------
# Kernels: seconds of one layer's work for one micro-batch on one tp rank


def gemm_s(device: Device, m: int, n: int, k: int, batch: int = 1) -> float:
    """An (m × k) @ (k × n) matmul, ``batch`` times, in bf16: compute- or memory-bound, plus the
    per-kernel overhead."""
    flops = 2.0 * m * n * k * batch
    moved = 2.0 * (m * k + k * n + m * n) * batch
    return max(flops / (device.peak_tflops * 1e12 * device.efficiency),
               moved / (device.hbm_gbs * 1e9)) + GEMM_S


def gemm_fwd_bwd_s(device: Device, m: int, n: int, k: int, batch: int = 1) -> tuple[float, float]:
    """Forward, and backward (data gradient (m × n)·(n × k), weight gradient (k × m)·(m × n))."""
    return gemm_s(device, m, n, k, batch), gemm_s(device, m, k, n, batch) + gemm_s(device, k, n, m,
                                                                                   batch)


def memory_s(device: Device, moved: float, kernels: int) -> float:
    return moved / (device.hbm_gbs * 1e9 * HBM_EFFICIENCY) + kernels * KERNEL_S


@dataclass(frozen=True)
class LayerTime:
    """One decoder layer (or the head), one micro-batch, one tp rank: seconds by kind."""
    matmul_f: float
    matmul_b: float
    memory_f: float
    memory_b: float
    attn_f: float = 0.0  # the attention core, recomputed under selective recompute
    attn_b: float = 0.0
    # the weight-gradient matmuls (part of matmul_b): a zero-bubble schedule's W
    weight_b: float = 0.0

    @property
    def forward(self) -> float:
        return self.matmul_f + self.memory_f + self.attn_f

    @property
    def backward(self) -> float:
        return self.matmul_b + self.memory_b + self.attn_b


def layer_time(args: ModelArgs, device: Device, micro: int, seq: int, tp: int,
               sequence_parallel: bool, attention: str, cp: int = 1) -> LayerTime:
    """One decoder layer's kernels (see the module docstring); ``cp``: the rank's queries are
    s/cp of each sample's ``seq``, against all ``seq`` keys."""
    h, d, f = args.hidden_size, args.head_dim, args.ffn_hidden_size
    n, kv = args.num_heads // tp, args.num_kv_heads // tp  # heads on this rank
    tokens, queries = micro * seq // cp, seq // cp
    fc1 = f if args.mlp == "gelu" else 2 * f  # GELU's fc1, or SwiGLU's gate and up fused
    # (out, in) on this rank
    shapes = [((n + 2 * kv) * d, h), (h, n * d), (fc1 // tp, h), (h, f // tp)]
    mm = [gemm_fwd_bwd_s(device, tokens, out, inp) for out, inp in shapes]
    matmul_f, matmul_b = sum(a for a, _ in mm), sum(b for _, b in mm)
    # (in × tokens)·(tokens × out)
    weight_b = sum(gemm_s(device, inp, out, tokens) for out, inp in shapes)

    # memory-bound kernels: norms and residual adds (+ dropout) run on s/tp tokens under SP, on
    # all of them otherwise; activation function, q/k/v layout copies and RoPE on h/tp features
    whole = 8 * h + 2 * (6 * h + (5 * h if args.hidden_dropout > 0 else 0))
    split = (4 if args.mlp == "gelu" else 6) * f / tp + 4 * (n + 2 * kv) * d + 4 * (n + kv) * d
    # bytes: reads + writes of bf16 values
    moved = tokens * (whole / (tp if sequence_parallel else 1) + split)
    memory_f, memory_b = memory_s(device, moved, 8), memory_s(device, 2 * moved, 14)

    # causal: half the score matrix is computed, 1/cp of it on each cp rank; sliding windows keep
    # a share of it (the layers' mean: this is an average layer)
    if attention == "flash":
        # fwd FLOPs: (QKᵀ, PV) × 2·s·s·d / 2
        causal = 2.0 * micro * n * seq * seq * d / cp * args.attention_fraction(seq)
        attn_f = causal / (device.peak_tflops * 1e12 * device.attention_efficiency) + KERNEL_S
        attn_b = 2.5 * attn_f
    else:  # batched matmuls per head + softmax / dropout over the whole (s/cp) × s scores in memory
        qk = gemm_fwd_bwd_s(device, queries, seq, d, micro * n)
        pv = gemm_fwd_bwd_s(device, queries, d, seq, micro * n)
        dropout = args.attention_dropout > 0
        scores = micro * n * queries * seq
        attn_f = qk[0] + pv[0] + memory_s(device, scores * (4 + 5 * dropout), 1 + dropout)
        attn_b = qk[1] + pv[1] + memory_s(device, scores * (6 + 5 * dropout), 1 + dropout)
    return LayerTime(matmul_f, matmul_b, memory_f, memory_b, attn_f, attn_b, weight_b)


def head_time(args: ModelArgs, device: Device, micro: int, seq: int, tp: int) -> LayerTime:
    """The output layer and the vocab-parallel loss (fp32 logits written, read, their gradient)."""
    tokens, rows = micro * seq, args.padded_vocab(tp) // tp
    f, b = gemm_fwd_bwd_s(device, tokens, rows, args.hidden_size)
    return LayerTime(f, b, memory_s(device, tokens * rows * 8.0, 3),
                     memory_s(device, tokens * rows * 8.0, 2),
                     weight_b=gemm_s(device, args.hidden_size, rows, tokens))


# ----------------------------------------------------------------------------------------------
# The estimate


@dataclass
class Estimate:
    layout: Layout
    memory: dict          # bytes on the busiest stage: params, state, activations, overhead, total,
    #                       capacity
    # seconds per step: compute, memory, tensor, bubble, p2p, data, optimizer, total
    time: dict
    mfu: float
    tokens_per_gpu_s: float
    hfu: float = 0.0      # hardware FLOPs (recomputation counted) over the peak
    peak_tflops: float = 0.0

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.memory["capacity"]

    @property
    def tflops_per_gpu(self) -> float:
        """Model FLOPs per second per GPU, in TFLOP/s (what MFU is a fraction of the peak of)."""
        return self.mfu * self.peak_tflops

    @property
    def hw_tflops_per_gpu(self) -> float:
        """Hardware FLOPs per second per GPU: recomputation counted (Megatron's "achieved
        TFLOP/s")."""
        return self.hfu * self.peak_tflops


def _bandwidth(device: Device, size: int, stride: int) -> tuple[float, float]:
    """(bus bandwidth in bytes/s, latency in s) of a ring over ``size`` ranks ``stride`` apart in
    the rank grid: NVLink when they share a node, else the node's NICs, one per GPU the group has
    on each node."""
    per_node = max(1, min(size, device.gpus_per_node // stride))
    if size * stride <= device.gpus_per_node:
        return device.intra_gbs * 1e9, LATENCY_INTRA_S
    return min(device.intra_gbs, device.inter_gbs * per_node) * 1e9, LATENCY_INTER_S


def _ring_s(device: Device, size: int, stride: int, nbytes: float, passes: float = 1.0) -> float:
    """``passes`` ring passes (all-gather or reduce-scatter: 1, all-reduce: 2) of ``nbytes``."""
    if size == 1:
        return 0.0
    bw, latency = _bandwidth(device, size, stride)
    return passes * ((size - 1) / size * nbytes / bw + latency)


def _a2a_s(device: Device, size: int, stride: int, nbytes: float) -> float:
    """An all-to-all over ``size`` ranks ``stride`` apart in which no rank sends or receives more
    than ``nbytes``: NVLink when they share a node, else each rank's own NIC (a rank's traffic
    crosses it, unlike a ring's, which the node's NICs share)."""
    if size == 1:
        return 0.0
    if size * stride <= device.gpus_per_node:
        return nbytes / (device.intra_gbs * 1e9) + LATENCY_INTRA_S
    return nbytes / (min(device.intra_gbs, device.inter_gbs) * 1e9) + LATENCY_INTER_S


def _memory(model: ModelArgs, seq: int, layout: Layout, device: Device, precision: str,
            micro_batches: int, schedule: Schedule, attention: str,
            optimizer: OptimizerSpec = ADAMW) -> tuple[dict, float]:
    """Bytes per GPU of the busiest stage by part (``planner/memory.py``, the parts a simulation
    measures, as ``params``, ``state`` and ``activations``) with the device's allowance, and that
    stage's parameters."""
    layer = layer_params(model)
    stages = [stage_memory(model, seq, layout, r, micro_batches, layer=layer, precision=precision,
                           schedule=schedule, attention=attention, optimizer=optimizer)
              for r in range(layout.pp)]
    busiest = max(range(layout.pp), key=lambda r: stages[r]["total"])
    parts = stages[busiest]
    weights = parts["parameters"] + parts["zero3_gathered"]
    memory = {"params": weights, "state": weights + parts["gradients"] + parts["optimizer"],
              "activations": sum(parts[k] for k in ("activations", "pipeline_in_flight",
                                                    "comm_buffers", "temporary")),
              "overhead": device.overhead_gb * GIB, "stage": busiest, "parts": parts,
              "host_optimizer": parts.get("host_optimizer", 0.0)}
    memory["total"] = parts["total"] + memory["overhead"]
    memory["capacity"] = device.memory_gb * GIB * (1 - device.spare)
    return memory, stage_params(model, layout, busiest, layer, schedule)


def _check(seq: int, L: Layout, global_batch: int, attention: str) -> None:
    """What makes a layout impossible before any estimate: the attention kind, the batch's split
    over dp, the sequence's into 2·cp chunks (each split again over tp with sequence
    parallelism)."""
    if attention not in ATTENTION:
        raise ConfigError(f"attention={attention!r} is not one of: {', '.join(ATTENTION)}")
    if global_batch % (L.micro_batch * L.dp):
        raise ConfigError(f"global batch {global_batch} is not a multiple of micro batch "
                          f"{L.micro_batch} × dp {L.dp}")
    if seq % (2 * L.cp * (L.tp if L.sequence_parallel else 1)):
        raise ConfigError(f"seq {seq} does not cut into 2 × cp {L.cp} chunks"
                          + (f" × tp {L.tp}" if L.sequence_parallel else ""))


def context_gather_bytes(model: ModelArgs, layout: Layout, seq: int) -> float:
    """Bytes of K and V (bf16) one layer all-gathers over the cp ranks for one micro-batch: all
    ``seq`` positions of the rank's kv heads (each rank contributes its 1/cp)."""
    kv_heads = model.num_kv_heads // layout.tp
    return 0.0 if layout.cp == 1 \
        else 2.0 * layout.micro_batch * seq * kv_heads * model.head_dim * 2.0


def _overlapped(comm: float, gemm: float, tp: int) -> float:
    """The exposed part of a sequence-parallel collective of ``comm`` seconds run as tp − 1 ring
    steps, each under one of the tp chunks of a ``gemm``-second GEMM
    (``parallel/tp_overlap.py``)."""
    return (tp - 1) * max(0.0, comm / (tp - 1) - gemm / tp)


def estimate(model: ModelArgs, seq: int, layout: Layout, global_batch: int, device: Device,
             precision: str = "bf16", schedule: str = "auto", attention: str = "flash",
             fp8: str = "none", fp8_skip: tuple[str, ...] = (),
             optimizer: OptimizerSpec = ADAMW) -> Estimate:
    """Memory and step time of ``model`` at sequence length ``seq`` under ``layout``; raises
    a UserError if it cannot run. ``fp8``, ``fp8_skip``: ``model.fp8``'s recipe and the linears
    it leaves out (planner/fp8.py); ``optimizer``: ``optim``'s optimizer, moments' dtype,
    Newton–Schulz steps and offload (planner/optimizer.py: the state, where it lives, Muon's
    iterations and traffic)."""
    L, tp, pp, dp, vpp, mb, cp = \
        layout, layout.tp, layout.pp, layout.dp, layout.vpp, layout.micro_batch, layout.cp
    _check(seq, layout, global_batch, attention)
    m = global_batch // (mb * dp)
    kind = resolve_schedule(schedule, pp, vpp, m, default=L.pp_schedule)
    layers_on, per_chunk = layers_per_stage(model, L, kind)
    last = head_stage(L, kind)
    sp, hidden, world = L.sequence_parallel, model.hidden_size, L.world_size
    slow = 1.0 if precision in ("bf16", "fp16") else 2.0  # fp32 matmuls run on tf32 units

    # one micro-batch: a layer, the head, and the tensor-parallel collectives of each
    lt, ht = layer_time(model, device, mb, seq, tp, sp, attention, cp), head_time(model, device, mb,
                                                                                  seq // cp, tp)
    delta = None if fp8 == "none" else fp8_delta(model, device, fp8, mb, seq, tp, cp, sp, gemm_s,
                                                 memory_s, tuple(fp8_skip))
    if delta is not None:  # the linears' GEMMs in FP8, their casts memory-bound
        lt = replace(lt, matmul_f=delta.matmul_f, matmul_b=delta.matmul_b,
                     memory_f=lt.memory_f + delta.cast_f, memory_b=lt.memory_b + delta.cast_b)
    act_bytes = mb * seq // cp * hidden * 2.0  # this rank's (b, s/cp, h)
    ring = _ring_s(device, tp, 1, act_bytes)  # one all-gather or reduce-scatter of (b, s, h)
    # SP forward 2 all-gathers + 2 reduce-scatters, backward the reverse plus 2 re-gathers; without
    # SP 2 all-reduces each way (2 passes each); a full recompute repeats the forward's
    tp_f, tp_b = 4 * ring, (6 if sp else 4) * ring
    if L.tp_comm_overlap:  # each collective in tp − 1 ring steps, each under 1/tp of its GEMMs
        tp_f, tp_b = 4 * _overlapped(ring, lt.matmul_f / 4,
                                     tp), 6 * _overlapped(ring, lt.matmul_b / 6, tp)
    if delta is not None:  # the input all-gathers send FP8
        tp_f, tp_b = tp_f * delta.tp_fraction_f, tp_b * delta.tp_fraction_b
    # K/V all-gathered (grads reduce-scattered back), passed around a ring under attention, or
    # all-to-all
    cp_f, cp_b = context_comm_s(model, L, seq, lt.attn_f, lt.attn_b, _bandwidth(device, cp, tp))
    # what recomputation runs again before each backward: (matmul + attention, memory-bound, tensor,
    # context)
    redo = {"none": (0.0, 0.0, 0.0, 0.0), "selective": (lt.attn_f, 0.0, 0.0, 0.0),
            "full": (lt.matmul_f + lt.attn_f, lt.memory_f, tp_f, cp_f)}[L.recompute]

    # a zero-bubble schedule's W makes the output layer's chunks of logits again
    # (model/fused_loss.py)
    head_redo = ht.matmul_f if kind.split_backward else 0.0

    def stage(r: int) -> tuple[float, float]:
        head = r == last
        f = layers_on[r] * (lt.forward + tp_f + cp_f) + head * (ht.forward + 2 * ring)
        b = layers_on[r] * (lt.backward + tp_b + cp_b + sum(redo)) + head * (ht.backward + head_redo
                                                                             + 2 * ring)
        return f * slow, b * slow

    busiest = max(range(pp), key=lambda r: sum(stage(r)))
    f, b = stage(busiest)
    n, head = layers_on[busiest], busiest == last
    # what a zero-bubble schedule's W ops run
    w = (n * lt.weight_b + head * (ht.weight_b + head_redo)) * slow
    per_token = activation_bytes_per_token(model, tp, sp, L.recompute, seq, attention, kv_copies(L))
    deferred = deferred_bytes_per_token(model, tp) / per_token  # what waits for a W, in activations
    # ratios to 1/4 (deferred to 1/8): the replay is cached
    stretch, in_flight = pipeline_model(kind, pp, vpp, m, round(4 * b / f) / 4,
                                        round(4 * w / f) / 4, round(8 * deferred) / 8)
    compute = n * (lt.matmul_f + lt.matmul_b + lt.attn_f + lt.attn_b + redo[0]) \
        + head * (ht.matmul_f + ht.matmul_b + head_redo)
    memory_bound = n * (lt.memory_f + lt.memory_b + redo[1]) + head * (ht.memory_f + ht.memory_b)
    tensor = n * (tp_f + tp_b + redo[2]) + head * 4 * ring
    context = n * (cp_f + cp_b + redo[3])
    busy = m * (f + b)
    bubble = busy * (stretch - 1.0)

    muon_layer = optimizer.muon_layer(model)
    mem, params = _memory(model, seq, L, device, precision, m, kind, attention, optimizer)
    if delta is not None:
        split, replicated, _ = layer_params(model)
        mem = fp8_memory(delta, mem, tokens=mb * seq // cp, in_flight=in_flight,
                         per_chunk=per_chunk, zero=L.zero,
                         gathered_bytes=min(3, max(layers_on)) * (split / tp + replicated) * 2)
    data, step_s = _data_parallel_s(device, L, params, m, f, b, n,
                                    params - n * muon_layer / tp
                                    if optimizer.moments_dtype == "bf16" else 0)
    muon_ns, muon_comm = _muon_s(model, device, L, n, optimizer) if muon_layer else (0.0, 0.0)
    step = step_s + muon_ns + muon_comm
    bw_pp, lat_pp = _bandwidth(device, pp, tp * cp * dp)
    p2p = 2 * m * vpp * (act_bytes / (tp if sp else 1) / bw_pp + lat_pp) if pp > 1 else 0.0
    total = busy + bubble + p2p + data + step
    time = {"compute": m * compute * slow, "memory": m * memory_bound * slow,
            "tensor": m * tensor * slow, "context": m * context * slow, "bubble": bubble,
            "p2p": p2p, "data": data, "optimizer": step,
            # (part of optimizer: Muon's Newton–Schulz iterations and its collectives)
            "optimizer_ns": muon_ns, "optimizer_comm": muon_comm,
            # (part of compute, memory, tensor, context)
            "total": total, "recompute": m * n * sum(redo) * slow}

    tokens = global_batch * seq
    model_flops = flops_per_token(model, seq) * tokens
    hw_flops = model_flops + tokens * model.num_layers * recompute_flops_per_token(model, seq,
                                                                                   L.recompute)
    peak = device.peak_tflops * 1e12
    return Estimate(L, mem, time, model_flops / (total * world * peak), tokens / total / world,
                    hw_flops / (total * world * peak), device.peak_tflops)


def estimate_run(cfg: Config, layout: Layout, device: Device, attention: str = "flash") -> Estimate:
    """:func:`estimate` of ``cfg``'s model, sequence, batch, precision and pipeline schedule under
    ``layout``: what ``tools/plan.py --check`` reports and the OOM advice quotes, from one call.
    Document masking through a dense mask (``model/attention.py``: sdpa) runs SDPA's math kernel
    on a GPU, with its (b, heads, s, s) scores in memory: estimated as unfused attention."""
    t = cfg.train
    if dense_document_mask(cfg):
        attention = "unfused"
    return estimate(model_args(cfg), t.seq_length, layout, t.global_batch_size, device, t.precision,
                    cfg.parallel.pp_schedule, attention, cfg.model.fp8, tuple(cfg.model.fp8_skip),
                    OptimizerSpec.of(cfg.optim))


def _data_parallel_s(device: Device, L: Layout, params: float, m: int, f: float, b: float,
                     layers: int = 1, bf16_moments: float = 0.0) -> tuple[float, float]:
    """(exposed data-parallel communication, optimizer step) in seconds: gradients reduced under
    the last micro-batch's backward (zero 2: under every one, bucket by bucket with one bucket in
    flight, as ``parallel/data.py`` bounds the full gradients kept: what a micro-batch's reduction
    takes beyond its backward is exposed, its last bucket runs under the next forward), parameters
    gathered under the next forward; zero 3 gathers every micro-batch's parameters twice
    (forward, prefetched; backward) and reduce-scatters its gradients under the backward, one
    collective per layer (``layers``) each with its own latency; hybrid sharding then all-reduces
    each shard over the replicas. The optimizer reads and writes its shard's fp32 state (34 bytes a
    parameter; ``bf16_moments`` of them read and write their two moments in bf16: 8 bytes fewer;
    Muon's elementwise work on its momentum and update is counted as AdamW's) and every rank
    zeroes its gradient buffer. Parameters are replicated over dp × cp: both reduce."""
    dp, tp, grad_bytes, n = L.dp * L.cp, L.tp, params * 4.0, L.shard_ranks
    if L.zero == 0:
        data = max(0.0, _ring_s(device, dp, tp, grad_bytes, 2) - b)
    else:  # reduce-scatter and all-gather inside the shard group (consecutive ranks, tp apart)
        reduce, gather = _ring_s(device, n, tp, grad_bytes), _ring_s(device, n, tp, params * 2.0)
        # every micro-batch, per layer: gather under the forward, gather + reduce under backward
        if L.zero == 3:
            units = max(1, layers)
            reduce, gather = (units * _ring_s(device, n, tp, x / units)
                              for x in (grad_bytes, params * 2.0))
            data = m * (max(0.0, gather - f) + max(0.0, gather + reduce - b))
        else:
            data = max(0.0, reduce - b) if L.zero == 1 else m * max(0.0, reduce - b)
            data += max(0.0, gather - f)
        # hybrid: each shard's sum over the replicas (n·tp apart), after the last backward
        if n < dp:
            data += _ring_s(device, dp // n, n * tp, grad_bytes / n, 2)
    state = (params * 34.0 - max(0.0, bf16_moments) * 8.0) / n
    return data, memory_s(device, params * 4.0 / (n if L.zero >= 2 else 1) + state, 4)


def _muon_s(model: ModelArgs, device: Device, L: Layout, layers: int,
            optimizer: OptimizerSpec) -> tuple[float, float]:
    """(Newton–Schulz, exposed collectives) seconds of Muon's step on a stage with ``layers``
    decoder layers (:func:`~.optimizer.muon_step_seconds`): the iterations of the busiest rank's
    matrices, bf16 GEMMs as :func:`gemm_s` times them (every tp rank of the owner on the whole
    matrix), then what of the shard group's all-to-alls of the updates and results (in
    ``optim.muon_ns_precision``) and of the owners' tp all-gathers the iterations leave
    exposed, as the dp gradient reductions count only what the backward does not hide."""
    sharded = L.zero >= 1 and L.shard_ranks > 1
    ns, total = muon_step_seconds(
        model, layers, L.shard_ranks if sharded else 1, L.tp, L.zero == 3, optimizer.ns_steps,
        optimizer.wire_bytes, lambda m, n, k: gemm_s(device, m, n, k),
        lambda nbytes: _a2a_s(device, L.shard_ranks, L.tp, nbytes),
        lambda nbytes: _ring_s(device, L.tp, 1, nbytes))
    return ns, total - ns


def recompute_flops_per_token(args: ModelArgs, seq: int, recompute: str) -> float:
    """FLOPs one layer runs again per token: its whole forward (full) or the attention core's
    (selective), in ``flops_per_token``'s convention (attention without the causal halving)."""
    if recompute == "none":
        return 0.0
    attention = 4.0 * args.hidden_size * seq * args.attention_fraction(seq)
    if recompute == "selective":
        return attention
    matmul = num_parameters(args, embeddings=False) - args.hidden_size  # without the final norm
    return 2.0 * matmul / args.num_layers + attention


MIN_CP_TOKENS = 8192  # cp > 1 only while each rank keeps this many tokens of a sample


def context_sizes(seq: int, tp: int, world: int) -> list[int]:
    """cp sizes worth trying: 1, and for long sequences the powers of two that leave each rank at
    least ``MIN_CP_TOKENS`` tokens of a sample (shorter shares make narrow matmuls for little
    memory) and cut it into 2·cp·tp equal pieces (sequence parallelism splits a share over tp)."""
    sizes, cp = [1], 2
    while seq // cp >= MIN_CP_TOKENS and world % (tp * cp) == 0:
        if seq % (2 * cp * tp) == 0:
            sizes.append(cp)
        cp *= 2
    return sizes


def layouts(model: ModelArgs, world: int, global_batch: int, device: Device,
            seq: int = 0) -> list[Layout]:
    """Every layout worth estimating: tp within a node dividing the heads, cp for sequences of
    ``seq`` long enough (:func:`context_sizes`), any pp (layers split as evenly as they go),
    interleaving where it applies, micro batches 1-4, ZeRO 0-3 (sharded over all of dp × cp, or
    hybrid: over a node's ranks), recompute none, selective or full."""
    out = []
    for tp in (1, 2, 4, 8):
        if tp > device.gpus_per_node or world % tp or model.num_heads % tp \
                or model.num_kv_heads % tp:
            continue
        for cp in context_sizes(seq, tp, world):
            for pp in range(1, min(world // (tp * cp), model.num_layers) + 1):
                if (world // (tp * cp)) % pp:
                    continue
                out += _stage_layouts(model, global_batch, tp, cp, pp, world // (tp * cp * pp),
                                      device.gpus_per_node)
    return out


def _shard_sizes(zero: int, tp: int, dp: int, gpus_per_node: int) -> list[int | None]:
    """ZeRO shard groups worth trying: all of ``dp`` (None), and for zero ≥ 1 the node's ranks
    (hybrid sharding) when the dp ranks span several nodes."""
    node = gpus_per_node // tp
    return [None, node] if zero and 1 < node < dp and dp % node == 0 else [None]


def _stage_layouts(model: ModelArgs, global_batch: int, tp: int, cp: int, pp: int, dp: int,
                   gpus_per_node: int = 8) -> list[Layout]:
    """The layouts of one (tp, cp, pp, dp): virtual chunks, micro batches, ZeRO stages (and shard
    groups), recompute."""
    out = []
    for vpp in (1, 2, 4, 5, 8):
        if vpp > 1 and (pp == 1 or pp * vpp > model.num_layers):
            continue
        uneven = split_layers(model.num_layers, pp * vpp)
        for mb in (1, 2, 4):
            if global_batch % (mb * dp) or (vpp > 1 and (global_batch // (mb * dp)) % pp):
                continue
            for zero in ((0, 1, 2, 3) if dp * cp > 1 else (0,)):
                for recompute, shard, cp_comm, schedule, overlap in itertools.product(
                        ("none", "selective", "full"),
                        _shard_sizes(zero, tp, dp * cp, gpus_per_node),
                        context_modes(model, tp, cp), schedules(pp, vpp), (False, True) if tp > 1
                        else (False,)):
                    out.append(Layout(tp, pp, dp, vpp, mb, zero, recompute, uneven, cp=cp,
                                      shard=shard, cp_comm=cp_comm, pp_schedule=schedule,
                                      tp_comm_overlap=overlap))
    return out


def search(model: ModelArgs, seq: int, world: int, global_batch: int, device: Device,
           precision: str = "bf16", attention: str = "flash", fp8: str = "none",
           fp8_skip: tuple[str, ...] = (), optimizer: OptimizerSpec = ADAMW) -> list[Estimate]:
    """Every layout's estimate, those that fit first, fastest first (under ``fp8``: those whose
    FP8 GEMMs the run takes; ``optimizer``: as :func:`estimate`'s)."""
    check_fp8_peak(device, fp8)  # before the search, which drops the layouts that raise
    found = []
    for layout in layouts(model, world, global_batch, device, seq):
        try:
            found.append(estimate(model, seq, layout, global_batch, device, precision,
                                  attention=attention, fp8=fp8, fp8_skip=fp8_skip,
                                  optimizer=optimizer))
        except UserError:
            continue
    return sorted(found, key=lambda e: (not e.fits, e.time["total"] if e.fits
                                        else e.memory["total"]))
