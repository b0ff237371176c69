"""Memory and time of a run under a parallel layout, before any GPU hour is spent.

The model behind ``tools/plan.py``. For one layout it estimates, per GPU of the busiest pipeline
stage, the bytes of weights, gradients, optimizer state and activations, and the time of one
optimizer step; :func:`search` ranks every layout of a config on a GPU count.

Memory follows the implementation, not a rule of thumb:

- weights, gradients and optimizer state: the bytes per parameter of the ZeRO stage
  (``parallel/data.py``): bf16 weights 2, fp32 gradients 4, fp32 master 4, Adam moments 8, the last
  two (and under zero 2 the gradients) divided by dp;
- activations per token and layer: ``12·h + 4·kv·d + 8·f`` bytes in bf16 (``tests`` measure it from
  what autograd saves), divided by tp with sequence parallelism; without it the two norm inputs and
  the two column-parallel inputs stay whole. Full recompute keeps only the layer input (``2·h``).
  A stage holds them for its peak number of in-flight micro-batch chunks, read off the real
  schedule (``parallel/pipeline.py``);
- a fixed allowance for the CUDA context, NCCL buffers and allocator slack; a layout fits
  when that total leaves 5% of the device's memory free.

Parameter counts come from the model's own spec table (``model/build.py``), FLOPs from the
trainer's ``flops_per_token``, devices from ``monitor/flops.py``'s table.

Time: model FLOPs at a kernel efficiency (``efficiency`` of the device's dense bf16 peak), plus
tensor-parallel collectives (not overlapped), the pipeline bubble from replaying the schedule with a
backward costing 2 forwards (3 with full recompute), the exposed part of the data-parallel
reduce-scatter / all-gather (they overlap the last backward and the next forward), and the
point-to-point transfers. Bandwidths are NCCL bus bandwidths typical of each device; all figures are
estimates to choose a layout with, to be checked with ``tools/bench_train.py`` on the real machines.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .config import resolve_schedule
from .errors import ConfigError, PipelineError, UserError
from .model.build import one_layer_specs
from .model.llama import ModelArgs, flops_per_token
from .monitor.flops import Device
from .parallel.pipeline import peak_in_flight, schedule_order, simulate

GIB = 2**30


@functools.cache
def layer_params(args: ModelArgs) -> tuple[int, int, int]:
    """(tp-split, replicated) parameters of one decoder layer and the head's replicated ones (the
    final norm), from the model's spec table."""
    specs = one_layer_specs(args).values()
    split = sum(s.numel for s in specs if s.layer == 0 and s.tp_dim is not None)
    replicated = sum(s.numel for s in specs if s.layer == 0 and s.tp_dim is None)
    head = sum(s.numel for s in specs if s.layer is None and not s.vocab)
    return split, replicated, head


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    vpp: int = 1
    micro_batch: int = 1
    zero: int = 1
    recompute: str = "none"  # none | selective | full
    pipeline_layers: tuple | None = None  # layers per chunk (pp × vpp) when they do not split evenly

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1

    def flags(self) -> str:
        uneven = (f" --parallel.pipeline_layers '[{', '.join(map(str, self.pipeline_layers))}]'"
                  if self.pipeline_layers else "")
        return (f"--parallel.tp {self.tp} --parallel.pp {self.pp} --parallel.vpp {self.vpp}{uneven} "
                f"--parallel.sequence_parallel {str(self.sequence_parallel).lower()} --parallel.zero {self.zero} "
                f"--parallel.recompute {self.recompute} --train.micro_batch_size {self.micro_batch}")


def split_layers(layers: int, chunks: int) -> tuple | None:
    """Layers per pipeline chunk when ``chunks`` does not divide ``layers``: as even as possible,
    the first and last chunk (which also hold the embedding and the output layer) the lighter ones."""
    if layers % chunks == 0:
        return None
    base, extra = divmod(layers, chunks)
    order = list(range(1, chunks - 1)) + [0, chunks - 1]  # middle chunks take the extra layers first
    counts = [base] * chunks
    for i in order[:extra]:
        counts[i] += 1
    return tuple(counts)


def activation_bytes_per_token(args: ModelArgs, tp: int, sequence_parallel: bool, recompute: str = "none") -> float:
    """What autograd keeps per token of one decoder layer in bf16 (see the module docstring)."""
    h, kvd, f = args.hidden_size, args.num_kv_heads * args.head_dim, args.ffn_hidden_size
    if recompute == "full":
        return 2.0 * h / (tp if sequence_parallel else 1)
    full = 12 * h + 4 * kvd + 8 * f
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
    return weights + (4.0 + master + 8.0) / dp


@dataclass
class Estimate:
    layout: Layout
    memory: dict          # bytes on the busiest stage: params, grads+optimizer, activations, overhead, total
    time: dict            # seconds per step: compute, tensor, bubble, data, p2p, total
    mfu: float
    tokens_per_gpu_s: float

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.memory["capacity"]


def estimate(model: ModelArgs, seq: int, layout: Layout, global_batch: int, device: Device,
             precision: str = "bf16", schedule: str = "auto") -> Estimate:
    """Memory and step time of ``model`` at sequence length ``seq`` under ``layout``; raises
    a UserError if it cannot run."""
    L, tp, pp, dp, vpp, mb = layout, layout.tp, layout.pp, layout.dp, layout.vpp, layout.micro_batch
    if global_batch % (mb * dp):
        raise ConfigError(f"global batch {global_batch} is not a multiple of micro batch {mb} × dp {dp}")
    m = global_batch // (mb * dp)
    kind = resolve_schedule(schedule, pp, vpp, m)
    n_layers, hidden, tied = model.num_layers, model.hidden_size, model.tie_embeddings
    chunks = L.pipeline_layers or [n_layers // (pp * vpp)] * (pp * vpp)
    if len(chunks) != pp * vpp or sum(chunks) != n_layers or min(chunks) < 1:
        raise PipelineError(f"{n_layers} layers do not split into pp {pp} × vpp {vpp} chunks "
                            f"(give pipeline_layers)")
    per_chunk = max(chunks)
    layers = max(sum(chunks[v * pp + r] for v in range(vpp)) for r in range(pp))  # the busiest stage
    split, replicated, head = layer_params(model)
    vocab_rows = model.padded_vocab(tp) // tp  # per tp rank
    first = layers * (split / tp + replicated) + vocab_rows * hidden
    last = layers * (split / tp + replicated) + head + (vocab_rows * hidden if not tied or pp > 1 else 0)
    params = max(first, last if pp > 1 else first + head + (0 if tied else vocab_rows * hidden))
    state = params * state_bytes_per_param(precision, L.zero, dp)
    scale = 1.0 if precision in ("bf16", "fp16") else 2.0
    tokens = mb * seq
    per_layer = activation_bytes_per_token(model, tp, L.sequence_parallel, L.recompute) * scale
    b_cost = 3.0 if L.recompute == "full" else 2.0
    stretch, in_flight = _pipeline(kind, pp, vpp, m, b_cost)
    acts = in_flight * per_chunk * tokens * per_layer
    if L.recompute == "full":  # one layer's full activations while it is recomputed
        acts += tokens * activation_bytes_per_token(model, tp, L.sequence_parallel) * scale
    logits = 2 * min(tokens * vocab_rows * 4, 512 << 20)  # chunked cross entropy: a bounded fp32 block
    overhead = device.overhead_gb * GIB
    memory = {"params": params * (2 if scale == 1 else 4), "state": state, "activations": acts + logits,
              "overhead": overhead}
    memory["total"] = state + acts + logits + overhead
    memory["capacity"] = device.memory_gb * GIB * (1 - device.spare)

    # time
    world = tp * pp * dp
    model_flops = flops_per_token(model, seq) * global_batch * seq
    extra = {"none": 0.0, "selective": 0.02, "full": 1.0 / 3.0}[L.recompute]
    peak = device.peak_tflops * 1e12 * device.efficiency
    imbalance = layers * pp / n_layers  # the busiest stage sets the pace
    compute = model_flops * (1 + extra) * imbalance / (world * peak)  # per GPU, all its micro-batches
    act_bytes = tokens * hidden * 2.0
    bw_tp = (device.intra_gbs if tp <= device.gpus_per_node else device.inter_gbs) * 1e9
    ring = (tp - 1) / tp * act_bytes / bw_tp  # one all-gather or reduce-scatter
    # per layer and micro-batch, in ring passes: SP forward 2 all-gathers + 2 reduce-scatters,
    # backward the reverse plus 2 re-gathers; without SP 4 all-reduces of 2 passes; a full
    # recompute repeats the forward's
    passes = (10 + (4 if L.recompute == "full" else 0)) if L.sequence_parallel else \
        (8 + (4 if L.recompute == "full" else 0))
    tensor = passes * ring * layers * m if tp > 1 else 0.0
    bubble = (compute + tensor) * (stretch - 1.0)
    grad_bytes = params * 4.0
    bw_dp = (device.intra_gbs if tp * dp <= device.gpus_per_node else device.inter_gbs) * 1e9
    frac = (dp - 1) / dp
    per_micro = (compute + tensor) / m
    backward = per_micro * b_cost / (1 + b_cost)  # one micro-batch's backward on this stage
    if L.zero == 0:  # all-reduce under the last micro-batch's backward
        data = max(0.0, 2 * frac * grad_bytes / bw_dp - backward)
    else:  # reduce-scatter under the last backward (zero 2: under every one), all-gather under the next forward
        reduce = frac * grad_bytes / bw_dp
        data = max(0.0, reduce - backward) if L.zero == 1 else m * max(0.0, reduce - backward)
        data += max(0.0, frac * params * 2.0 / bw_dp - per_micro / (1 + b_cost))
    bw_pp = (device.inter_gbs if tp * dp >= device.gpus_per_node else device.intra_gbs) * 1e9
    p2p = 2 * m * vpp * act_bytes / (tp if L.sequence_parallel else 1) / bw_pp if pp > 1 else 0.0
    total = compute + tensor + bubble + data + p2p
    time = {"compute": compute, "tensor": tensor, "bubble": bubble, "data": data, "p2p": p2p, "total": total}
    mfu = model_flops / (total * world * device.peak_tflops * 1e12)
    return Estimate(layout, memory, time, mfu, global_batch * seq / total / world)


@functools.cache
def _pipeline(kind: str, pp: int, vpp: int, m: int, b_cost: float) -> tuple[float, int]:
    """(step time over busy time, peak in-flight micro-batch chunks on stage 0) of a schedule,
    replayed with a forward costing 1 and a backward ``b_cost``."""
    sim = simulate([schedule_order(kind, r, pp, vpp, m) for r in range(pp)], pp, vpp, 1.0, b_cost)
    return sim["makespan"] / (m * vpp * (1.0 + b_cost)), peak_in_flight(schedule_order(kind, 0, pp, vpp, m))


def layouts(model: ModelArgs, world: int, global_batch: int, device: Device) -> list[Layout]:
    """Every layout worth estimating: tp within a node dividing the heads, any pp (layers split as
    evenly as they go), interleaving where it applies, micro batches 1-4, ZeRO 0-2, recompute none
    or full."""
    out = []
    for tp in (1, 2, 4, 8):
        if tp > device.gpus_per_node or world % tp or model.num_heads % tp or model.num_kv_heads % tp:
            continue
        for pp in range(1, min(world // tp, model.num_layers) + 1):
            if (world // tp) % pp:
                continue
            dp = world // (tp * pp)
            for vpp in (1, 2, 4, 5, 8):
                if vpp > 1 and (pp == 1 or pp * vpp > model.num_layers):
                    continue
                uneven = split_layers(model.num_layers, pp * vpp)
                for mb in (1, 2, 4):
                    if global_batch % (mb * dp) or (vpp > 1 and (global_batch // (mb * dp)) % pp):
                        continue
                    for zero in ((0, 1, 2) if dp > 1 else (0,)):
                        for recompute in ("none", "full"):
                            out.append(Layout(tp, pp, dp, vpp, mb, zero, recompute, uneven))
    return out


def search(model: ModelArgs, seq: int, world: int, global_batch: int, device: Device,
           precision: str = "bf16") -> list[Estimate]:
    """Every layout's estimate, those that fit first, fastest first."""
    found = []
    for layout in layouts(model, world, global_batch, device):
        try:
            found.append(estimate(model, seq, layout, global_batch, device, precision))
        except UserError:
            continue
    return sorted(found, key=lambda e: (not e.fits, e.time["total"] if e.fits else e.memory["total"]))
