"""Data-parallel step time with the bucket reductions overlapped with backward or not (zero 3:
with the next layer's gather prefetched or not), and the per-rank memory table of each ZeRO stage.

    python tools/bench_dp.py                       # dp=2 on CPU gloo, fp32, zero 0 and 1
    python tools/bench_dp.py --zero 0 1 2 3 --hidden 512 --layers 8 --steps 10
    python tools/bench_dp.py --dp 4 --zero 1 3 --shard-size 2     # hybrid sharding

Spawns ``--dp`` gloo ranks on this machine (one CPU thread each, so ranks do not fight over
cores); each times full optimizer steps — every micro-batch forward and backward, the bucketed
grad reduction, AdamW and (zero ≥ 1) the parameter all-gather — on random tokens. "overlap on"
launches each bucket's reduction as soon as its grads are complete during the last micro-batch's
backward; "off" launches them all after backward. ``exposed`` is the time spent waiting for the
reductions after backward returned; under zero 3 ``gather wait`` is the time forward and backward
spent waiting for parameter all-gathers to arrive. The median of ``--steps`` steps after
``--warmup`` is reported.

The memory table is measured from the optimizer's tensors (``memory_report``) on rank 0, next to
the analytic bytes per parameter of each stage (plus alignment padding).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist
from _tool import bench_model_args, interleaved, join_gloo, run_ranks

from megapretrain.cli import ToolParser, non_negative_float, non_negative_int, positive_int, print_error, user_errors
from megapretrain.config import OptimConfig
from megapretrain.model.decoder import DecoderModel
from megapretrain.optim.optimizer import MixedPrecisionAdamW
from megapretrain.parallel.state import ParallelState

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None):
    ap = ToolParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", type=positive_int, default=2, help="data-parallel ranks (default 2)")
    ap.add_argument("--zero", type=non_negative_int, nargs="+", default=[0, 1], choices=[0, 1, 2, 3],
                    help="ZeRO stages to time (default 0 1)")
    ap.add_argument("--shard-size", type=positive_int, default=None,
                    help="hybrid sharding: shard over groups of this many dp ranks (must divide --dp)")
    ap.add_argument("--precision", choices=list(DTYPES), default="fp32")
    ap.add_argument("--layers", type=positive_int, default=4)
    ap.add_argument("--hidden", type=positive_int, default=256)
    ap.add_argument("--vocab", type=positive_int, default=8192)
    ap.add_argument("--seq", type=positive_int, default=128)
    ap.add_argument("--micro-batch", type=positive_int, default=2)
    ap.add_argument("--accum", type=positive_int, default=2, help="micro-batches per rank and step")
    ap.add_argument("--bucket-mb", type=non_negative_float, default=2.0, help="bucket size (MB of fp32 grads)")
    ap.add_argument("--steps", type=positive_int, default=8)
    ap.add_argument("--warmup", type=non_negative_int, default=2)
    return ap.parse_args(argv)


def build(ps: ParallelState, a, zero: int, precision: str, overlap: bool = True, offload: bool = False,
          prefetch: bool = True):
    model = DecoderModel(bench_model_args(a.layers, a.hidden, a.vocab), ps.tp, dtype=DTYPES[precision])
    model.init_weights(1234)
    opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(),
                              OptimConfig(lr=1e-4, offload=offload), precision, ps, zero=zero,
                              bucket_size_mb=a.bucket_mb, overlap_grad_reduce=overlap)
    opt.hook_models([model], prefetch=prefetch)
    return model, opt


def one_step(model, opt, batches, n_tokens: int) -> tuple[float, float, float]:
    """(step seconds, seconds spent waiting for the reductions after backward, for gathers)."""
    dist.barrier()
    gathers = opt.units.wait_s if opt.units is not None else 0.0
    start = time.perf_counter()
    opt.zero_grad()
    for j, tokens in enumerate(batches):
        loss = model(tokens[:, :-1], tokens[:, 1:]).sum() / n_tokens
        with opt.grad_sync(last=j == len(batches) - 1):
            loss.backward()
    backward_end = time.perf_counter()
    opt.reduce_grads()
    reduced = time.perf_counter()
    opt.step(1e-4)
    gathers = (opt.units.wait_s if opt.units is not None else 0.0) - gathers
    return time.perf_counter() - start, reduced - backward_end, gathers


def time_overlap(ps: ParallelState, a, zero: int) -> dict:
    """Median step and exposed-communication times with overlap (zero 3: prefetch) on and off,
    their steps interleaved so that load from elsewhere on the machine hits both alike."""
    runs = {on: build(ps, a, zero, a.precision, overlap=on or zero == 3, prefetch=on) for on in (True, False)}
    g = torch.Generator().manual_seed(ps.dp_rank)
    batches = [torch.randint(0, a.vocab, (a.micro_batch, a.seq + 1), generator=g) for _ in range(a.accum)]
    n_tokens = a.micro_batch * a.seq * a.accum * ps.dp.size
    times = interleaved(runs, lambda run: one_step(*run, batches, n_tokens), a.warmup, a.steps)
    return {(zero, overlap): {"step": statistics.median(t[0] for t in ts),
                              "exposed": statistics.median(t[1] for t in ts),
                              "gather_wait": statistics.median(t[2] for t in ts),
                              "buckets": len(runs[overlap][1].buffers.buckets)}
            for overlap, ts in times.items()}


def memory_table(ps: ParallelState, a) -> list:
    return [(zero, precision, offload, build(ps, a, zero, precision, offload=offload)[1].memory_report())
            for zero in (0, 1, 2, 3) for precision in DTYPES for offload in (False, True)]


def analytic(zero: int, precision: str, offload: bool, shard: int) -> tuple[str, float]:
    """Bytes per parameter: params + grads + master + moments (see optim/optimizer.py), sharded
    over ``shard`` ranks (dp, or the hybrid shard group)."""
    p = 4 if precision == "fp32" else 2
    m = 0 if precision == "fp32" and not offload else 4
    over = shard if zero >= 1 else 1
    g = 4 / shard if zero >= 2 else 4
    text = (f"{p}{'/dp' if zero == 3 else ''} + {'4/dp' if zero >= 2 else '4'} + "
            f"{m + 8}{'/dp' if zero >= 1 else ''}")
    return text, (p / shard if zero == 3 else p) + g + (m + 8) / over


def worker(rank: int, world: int, store_path: str, a, queue) -> None:
    join_gloo(rank, world, store_path)
    ps = ParallelState(zero_shard_size=a.shard_size)
    out = {"times": {k: v for z in a.zero for k, v in time_overlap(ps, a, z).items()}}
    if rank == 0:
        out["memory"] = memory_table(ps, a)
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


@user_errors
def main(argv=None) -> int:
    a = parse_args(argv)
    if a.shard_size and a.dp % a.shard_size:
        print_error(f"--shard-size {a.shard_size} must divide --dp {a.dp}")
        return 2
    out = run_ranks(worker, a.dp, a)
    args = bench_model_args(a.layers, a.hidden, a.vocab)
    n = sum(p.numel() for p in DecoderModel(args, ParallelState().tp, device="meta").parameters())
    print(f"dp={a.dp} gloo CPU, {a.precision}, {n / 1e6:.1f}M params, {a.accum} micro-batches of "
          f"{a.micro_batch}×{a.seq} per rank, buckets of {a.bucket_mb} MB")
    shard = a.shard_size or a.dp
    if a.shard_size:
        print(f"hybrid sharding: shard groups of {shard} dp ranks, {a.dp // shard} replicas of each shard")
    print(f"{'zero':>4} {'overlap':>12} {'buckets':>8} {'step ms':>9} {'exposed ms':>11} {'gather wait ms':>15}")
    for (zero, overlap), t in sorted(out["times"].items(), key=lambda kv: (kv[0][0], not kv[0][1])):
        what = ("prefetch " if zero == 3 else "") + ("on" if overlap else "off")
        print(f"{zero:>4} {what:>12} {t['buckets']:>8} {1e3 * t['step']:>9.1f} "
              f"{1e3 * t['exposed']:>11.1f} {1e3 * t['gather_wait']:>15.1f}")
    print(f"\nper-rank memory (rank 0 of dp={a.dp}, shards of {shard}; MiB, measured from the tensors; "
          "zero 3 also gathers up to the 'gathered' MiB at once)")
    print(f"{'zero':>4} {'prec':>5} {'offload':>8} {'params':>8} {'grads':>8} {'master':>8} {'moments':>8} "
          f"{'total':>8} {'B/param':>8}  analytic B/param")
    for zero, precision, offload, mem in out["memory"]:
        text, per_param = analytic(zero, precision, offload, shard)
        mib = {k: mem[k] / 2**20 for k in ("params", "grads", "master", "moments", "total")}
        print(f"{zero:>4} {precision:>5} {str(offload).lower():>8} {mib['params']:>8.2f} {mib['grads']:>8.2f} "
              f"{mib['master']:>8.2f} {mib['moments']:>8.2f} {mib['total']:>8.2f} "
              f"{mem['total'] / mem['padded_numel']:>8.2f}  {text} = {per_param:.2f}"
              + (f"   gathered {mem['gathered_peak'] / 2**20:.2f}" if "gathered_peak" in mem else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
