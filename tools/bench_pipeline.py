"""Pipeline schedules timed on real stages: step time and idle fraction of 1F1B, ZB-H1 and ZB-V.

    python tools/bench_pipeline.py                          # pp 4 on CPU gloo: 1f1b, zb_h1, zbv
    python tools/bench_pipeline.py --micro-batches 16 --layers 16 --hidden 256 --plot pipeline.png
    python tools/bench_pipeline.py --schedules 1f1b interleaved zbv --steps 5

Spawns ``--pp`` gloo ranks on this machine (``--threads`` CPU threads each), one pipeline stage
each, and runs full training steps of the real model chunks, placed as each schedule places them
(``model/build.py``): the executor's forwards, backwards — split into input-gradient B and
weight-gradient W ops under zb_h1 and zbv — and transfers, then the data-parallel grad reduction
and AdamW. Every op's start and end is recorded on its stage.

Per schedule it prints the median step time, the pipeline's part of it (first op to last, over
all stages) and each stage's idle fraction of that part (time not computing: waiting for a
neighbour, or the bubble), next to what :func:`simulate` predicts from the measured mean op
times, and the activations a stage holds at its peak (micro-batch chunks in flight × layers per
chunk: equal for the three at equal layers). ``--plot`` draws the measured timelines of the last
step, one panel per schedule (W ops in green, filling what 1F1B leaves idle).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
import weakref

import torch
import torch.distributed as dist
from _tool import run_ranks

from megapretrain.cli import ToolParser, non_negative_int, positive_int, print_error, user_errors
from megapretrain.config import load_config
from megapretrain.errors import ConfigError, PipelineError
from megapretrain.model.build import build_model_chunks
from megapretrain.optim.optimizer import MixedPrecisionAdamW
from megapretrain.parallel.pipeline import (
    P2P,
    SCHEDULES,
    PipelineExecutor,
    peak_in_flight,
    simulate,
)
from megapretrain.parallel.state import ParallelState
from megapretrain.parallel.tensor import DeferredGrads, defer_weight_grads

VPP = {s.name: s.shown_vpp for s in SCHEDULES.values() if s.pipelines}  # the chunks each runs with


def parse_args(argv=None):
    ap = ToolParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=positive_int, default=4, help="pipeline stages, one process each (default 4)")
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "zb_h1", "zbv"], choices=list(VPP),
                    help="schedules to time (default 1f1b zb_h1 zbv; interleaved and zbv run vpp 2)")
    ap.add_argument("--micro-batches", type=positive_int, default=8, help="micro-batches per step (default 8)")
    ap.add_argument("--micro-batch", type=positive_int, default=1, help="samples per micro-batch (default 1)")
    ap.add_argument("--layers", type=positive_int, default=8, help="decoder layers (default 8)")
    ap.add_argument("--hidden", type=positive_int, default=256, help="hidden size (default 256)")
    ap.add_argument("--seq", type=positive_int, default=256, help="tokens per sample (default 256)")
    ap.add_argument("--vocab", type=positive_int, default=2048, help="vocabulary (default 2048)")
    ap.add_argument("--steps", type=positive_int, default=4, help="timed steps per schedule (default 4)")
    ap.add_argument("--warmup", type=non_negative_int, default=1, help="untimed steps first (default 1)")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads per rank (default 1)")
    ap.add_argument("--plot", default=None, help="PNG of the measured timelines of each schedule's last step")
    return ap.parse_args(argv)


def config(a, schedule: str):
    """The config of one schedule's run (the checks a training run makes, at world size ``pp``)."""
    heads = max(1, a.hidden // 64)
    flags = ["--model.num_layers", a.layers, "--model.hidden_size", a.hidden, "--model.num_heads", heads,
             "--model.num_kv_heads", heads, "--model.ffn_hidden_size", 4 * a.hidden, "--model.vocab_size", a.vocab,
             "--train.seq_length", a.seq, "--train.micro_batch_size", a.micro_batch,
             "--train.global_batch_size", a.micro_batch * a.micro_batches, "--parallel.pp", a.pp,
             "--parallel.vpp", VPP[schedule], "--parallel.pp_schedule", schedule, "--model.attention", "sdpa"]
    return load_config(None, [str(f) for f in flags])


def check(a) -> None:
    """Refuse, in one line, a layout some schedule cannot run, before any process starts."""
    from megapretrain.resolve import resolve
    for schedule in a.schedules:
        resolve(config(a, schedule), a.pp)  # the schedule's rules at this pp, vpp and micro-batches


class Timeline:
    """Each op's (start, end) on this stage, seconds from the step's start, in the order they ran."""

    def __init__(self):
        self.t0, self.spans = 0.0, []

    def start(self) -> None:
        self.t0, self.spans = time.perf_counter(), []

    @contextlib.contextmanager
    def timed(self):
        start = time.perf_counter() - self.t0
        yield
        self.spans.append((start, time.perf_counter() - self.t0))


def run_schedule(ps: ParallelState, a, schedule: str) -> dict:
    cfg = config(a, schedule)
    vpp, m, kind = VPP[schedule], a.micro_batches, SCHEDULES[schedule]
    torch.manual_seed(0)
    chunks, specs = build_model_chunks(cfg, ps)
    opt = MixedPrecisionAdamW([np for c in chunks for np in c.named_parameters()], specs, cfg.optim, "fp32", ps)
    opt.hook_models(chunks)
    deferred = DeferredGrads(weakref.ref(opt.buffers)) if kind.split_backward else None
    defer_weight_grads(chunks, deferred)
    line = Timeline()

    @contextlib.contextmanager
    def grad_sync(last: bool, split=None):  # wraps every B (whole or input-gradient) and W op
        with opt.grad_sync(last, split), line.timed():
            yield

    p2p = P2P(ps.pp, (a.micro_batch, a.seq, a.hidden), torch.float32, torch.device("cpu"))
    executor = PipelineExecutor(ps.pp_rank, a.pp, vpp, p2p, grad_sync, kind, record=True,
                                deferred=deferred)
    orders = kind.orders(a.pp, vpp, m)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, a.vocab, (m, a.micro_batch, a.seq + 1), generator=g)
    scale = 1.0 / (m * a.micro_batch * a.seq)

    def forward(chunk: int, micro: int, hidden):
        model = chunks[chunk]
        with line.timed():
            out = model(tokens[micro, :, :-1] if model.pre_process else hidden,
                        tokens[micro, :, 1:] if model.post_process else None)
        return out.sum() * scale if model.post_process else out

    steps, pipes = [], []
    for i in range(a.warmup + a.steps):
        dist.barrier()
        line.start()
        opt.zero_grad()
        executor.run(orders, m, forward)
        pipe_end = time.perf_counter() - line.t0
        opt.reduce_grads()
        opt.step(1e-4)
        if i >= a.warmup:
            steps.append(time.perf_counter() - line.t0)
            pipes.append(pipe_end)
    layers_per_chunk = a.layers // (a.pp * vpp)
    order = orders[ps.pp_rank]  # the executor ran the ops in this order: label the spans with them
    ops = [(b, e, op.kind, f"{op.kind if op.kind == 'F' else op.kind.lower()}{op.micro}")
           for (b, e), op in zip(line.spans, order, strict=True)]
    return {"step": statistics.median(steps), "ops": ops, "pipe": pipes[-1],
            "peak": max(peak_in_flight(o) for o in orders) * layers_per_chunk, "orders": orders}


def worker(rank: int, world: int, store_path: str, a, queue) -> None:
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    ps = ParallelState(pp=world)
    out = {s: run_schedule(ps, a, s) for s in a.schedules}
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        queue.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


def summarise(schedule: str, stages: list[dict], pp: int) -> dict:
    """Measured and predicted makespan and idle fractions of one schedule's last step."""
    ops = [s[schedule]["ops"] for s in stages]
    start = min(o[0] for stage in ops for o in stage)
    end = max(o[1] for stage in ops for o in stage)
    span = end - start
    busy = [sum(e - b for b, e, _, _ in stage) for stage in ops]
    mean = {k: statistics.mean([e - b for stage in ops for b, e, kind, _ in stage if kind == k] or [0.0])
            for k in "FBW"}
    vpp, orders, kind = VPP[schedule], stages[0][schedule]["orders"], SCHEDULES[schedule]
    split = kind.split_backward
    sim = simulate(orders, pp, vpp, mean["F"], mean["B"] + mean["W"] if split else mean["B"],
                   mean["W"] if split else 0.0, v_shape=kind.v_shape)
    return {"step": statistics.median(s[schedule]["step"] for s in stages), "span": span,
            "idle": [1 - b / span for b in busy], "predicted": sim["makespan"], "predicted_idle": sim["idle_fraction"],
            "mean": mean, "peak": max(s[schedule]["peak"] for s in stages), "start": start}


@user_errors
def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        check(a)
    except (ConfigError, PipelineError) as exc:
        print_error(str(exc))
        return 2
    stages = run_ranks(worker, a.pp, a)
    print(f"pp={a.pp} gloo CPU ({a.threads} thread(s) per rank), fp32, {a.layers} layers of hidden {a.hidden}, "
          f"{a.micro_batches} micro-batches of {a.micro_batch}×{a.seq} per step; medians of {a.steps} steps")
    print(f"{'schedule':>11} {'step ms':>8} {'pipeline ms':>12} {'predicted':>10} {'idle (per stage)':>26} "
          f"{'predicted idle':>26} {'F/B/W ms':>16} {'peak act':>9}")
    panels = []
    for schedule in a.schedules:
        s = summarise(schedule, stages, a.pp)
        idle = " ".join(f"{x:.0%}" for x in s["idle"])
        predicted = " ".join(f"{x:.0%}" for x in s["predicted_idle"])
        costs = "/".join(f"{1e3 * s['mean'][k]:.1f}" for k in "FBW")
        print(f"{schedule:>11} {1e3 * s['step']:>8.1f} {1e3 * s['span']:>12.1f} {1e3 * s['predicted']:>10.1f} "
              f"{idle:>26} {predicted:>26} {costs:>16} {s['peak']:>9}")
        unit = s["mean"]["F"] or 1.0  # the picture's time unit: one forward
        panels.append((f"{schedule}: {1e3 * s['span']:.0f} ms, idle {statistics.mean(s['idle']):.0%} on average",
                       [[((b - s["start"]) / unit, (e - s["start"]) / unit, k, label)
                         for b, e, k, label in stage[schedule]["ops"]] for stage in stages]))
    print("peak act: the layers' activations of micro-batches a stage holds at its peak (layer × micro-batches)")
    if a.plot:
        from megapretrain.monitor.plots import plot_pipeline
        plot_pipeline(a.plot, f"measured pipeline timelines, pp={a.pp}, {a.micro_batches} micro-batches", panels)
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
