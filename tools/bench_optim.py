"""One optimizer step of AdamW and of Muon, timed side by side over dp ranks and ZeRO stages.

    python tools/bench_optim.py                               # dp 1 2 4, zero 1 3, a small model
    python tools/bench_optim.py --dp 2 4 --zero 0 1 2 3 --hidden 256 --layers 4 --steps 5

For each ``--dp`` it spawns that many gloo ranks on this machine (one CPU thread each); for each
ZeRO stage (dp 1: zero 0 only — nothing to shard) every rank builds the model twice, once with
``optim.optimizer adamw`` and once with ``muon``, and per timed step runs one forward and backward
and the grad reduction (untimed), then times ``optimizer.step`` alone: AdamW's update, or Muon's
momentum, the all-gather of its updates over the shard group, Newton–Schulz on the matrices the
rank owns and the reduce-scatter back, plus AdamW on the rest — and (zero ≥ 1) the parameter
all-gather both share. The two optimizers' steps alternate so that load from elsewhere on the
machine hits both alike; the median over ranks' slowest of ``--steps`` steps after ``--warmup`` is
reported, with Muon's time over AdamW's.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist
from _tool import bench_model_args, interleaved, join_gloo, run_ranks

from megapretrain.cli import ToolParser, non_negative_int, positive_int, user_errors
from megapretrain.config import OptimConfig
from megapretrain.model.decoder import DecoderModel
from megapretrain.optim.optimizer import MixedPrecisionAdamW
from megapretrain.parallel.state import ParallelState

OPTIMIZERS = ("adamw", "muon")


def parse_args(argv=None):
    ap = ToolParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", type=positive_int, nargs="+", default=[1, 2, 4],
                    help="data-parallel rank counts to time (default 1 2 4)")
    ap.add_argument("--zero", type=non_negative_int, nargs="+", default=[1, 3], choices=[0, 1, 2, 3],
                    help="ZeRO stages to time where dp > 1 (default 1 3)")
    ap.add_argument("--layers", type=positive_int, default=2)
    ap.add_argument("--hidden", type=positive_int, default=128)
    ap.add_argument("--vocab", type=positive_int, default=512)
    ap.add_argument("--seq", type=positive_int, default=32)
    ap.add_argument("--ns-steps", type=positive_int, default=5, help="Muon's Newton–Schulz steps")
    ap.add_argument("--steps", type=positive_int, default=3)
    ap.add_argument("--warmup", type=non_negative_int, default=1)
    return ap.parse_args(argv)


def build(ps: ParallelState, a, zero: int, optimizer: str):
    model = DecoderModel(bench_model_args(a.layers, a.hidden, a.vocab), ps.tp, dtype=torch.bfloat16)
    model.init_weights(1234)
    cfg = OptimConfig(lr=1e-4, optimizer=optimizer, muon_ns_steps=a.ns_steps)
    opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(), cfg, "bf16",
                              ps, zero=zero)
    opt.hook_models([model])
    return model, opt


def timed_step(model, opt, tokens, n_tokens: int) -> float:
    """Seconds of ``opt.step`` after an untimed forward, backward and grad reduction; the slowest
    rank's."""
    opt.zero_grad()
    loss = model(tokens[:, :-1], tokens[:, 1:]).sum() / n_tokens
    with opt.grad_sync(last=True):
        loss.backward()
    opt.reduce_grads()
    dist.barrier()
    start = time.perf_counter()
    opt.step(1e-4)
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def worker(rank: int, world: int, store_path: str, a, queue) -> None:
    join_gloo(rank, world, store_path)
    ps = ParallelState()
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, a.vocab, (1, a.seq + 1), generator=g)
    out = {}
    for zero in (a.zero if world > 1 else [0]):
        runs = {o: build(ps, a, zero, o) for o in OPTIMIZERS}
        times = interleaved(runs, lambda run: timed_step(*run, tokens, a.seq * world), a.warmup,
                            a.steps)
        out[zero] = {o: statistics.median(ts) for o, ts in times.items()}
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


@user_errors
def main(argv=None) -> int:
    a = parse_args(argv)
    args = bench_model_args(a.layers, a.hidden, a.vocab)
    n = sum(p.numel() for p in DecoderModel(args, ParallelState().tp, device="meta").parameters())
    print(f"one optimizer step, gloo CPU (one thread a rank), bf16 weights, {n / 1e6:.2f}M params "
          f"({a.layers} layers, hidden {a.hidden}), Muon with {a.ns_steps} Newton–Schulz steps; "
          f"median of {a.steps}")
    print(f"{'dp':>3} {'zero':>5} {'adamw ms':>10} {'muon ms':>10} {'muon/adamw':>11}")
    for dp in a.dp:
        for zero, t in run_ranks(worker, dp, a).items():
            print(f"{dp:>3} {zero:>5} {1e3 * t['adamw']:>10.2f} {1e3 * t['muon']:>10.2f} "
                  f"{t['muon'] / t['adamw']:>11.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
