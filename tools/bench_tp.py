"""Tensor-parallel communication overlapped or not: step time and exposed communication of the
sequence-parallel linears with ``parallel.tp_comm_overlap`` off and on.

    python tools/bench_tp.py                          # tp 2 on CPU gloo, fp32
    python tools/bench_tp.py --tp 4 --hidden 512 --seq 512 --steps 8

Spawns ``--tp`` gloo ranks on this machine (``--threads`` CPU threads each). Each times forward
and backward of the same sequence-parallel decoder, first with the synchronous collectives, then
with the all-gathers and reduce-scatters of its linears run in ring steps under their GEMMs
(``parallel/tp_overlap.py``); the two runs' steps alternate so that load from elsewhere on the
machine hits both alike. ``exposed`` is the time a rank spent blocked in tp communication
(``CommStats``: a synchronous collective's whole time, an asynchronous one's wait), ``MiB`` what it
sent; medians over ``--steps`` after ``--warmup``, the slowest rank's.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist
from _tool import bench_model_args, interleaved, join_gloo, run_ranks

from megapretrain.cli import ToolParser, non_negative_int, positive_int, print_error, user_errors
from megapretrain.model.args import ModelArgs
from megapretrain.model.decoder import DecoderModel
from megapretrain.parallel.state import ParallelState
from megapretrain.parallel.tensor import overlap_tp_comm


def parse_args(argv=None):
    ap = ToolParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=positive_int, default=2, help="tensor-parallel ranks (default 2)")
    ap.add_argument("--layers", type=positive_int, default=4, help="decoder layers (default 4)")
    ap.add_argument("--hidden", type=positive_int, default=256, help="hidden size (default 256)")
    ap.add_argument("--seq", type=positive_int, default=512, help="tokens per sample (default 512)")
    ap.add_argument("--micro-batch", type=positive_int, default=2, help="samples per step (default 2)")
    ap.add_argument("--vocab", type=positive_int, default=2048, help="vocabulary (default 2048)")
    ap.add_argument("--steps", type=positive_int, default=6, help="timed steps (default 6)")
    ap.add_argument("--warmup", type=non_negative_int, default=1, help="untimed steps first (default 1)")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads per rank (default 1)")
    return ap.parse_args(argv)


def model_args(a) -> ModelArgs:
    return bench_model_args(a.layers, a.hidden, a.vocab, min_heads=a.tp)


def check(a) -> str | None:
    """What makes the layout impossible, in one line, or None."""
    if a.tp < 2:
        return f"--tp {a.tp}: overlap needs at least 2 tensor-parallel ranks"
    if a.seq % a.tp:
        return f"--seq {a.seq} must divide by --tp {a.tp} (sequence parallelism splits it)"
    args = model_args(a)
    if args.num_heads % a.tp or (4 * a.hidden) % a.tp:
        return f"--hidden {a.hidden}: its heads ({args.num_heads}) and FFN width must divide by --tp {a.tp}"
    return None


def worker(rank: int, world: int, store_path: str, a, queue) -> None:
    join_gloo(rank, world, store_path, a.threads)
    ps = ParallelState(tp=world, comm_stats=True)
    models = {}
    for overlap in (False, True):
        model = DecoderModel(model_args(a), ps.tp, sequence_parallel=True)
        model.init_weights(1234)
        overlap_tp_comm([model], overlap)
        models[overlap] = model
    tokens = torch.randint(0, a.vocab, (a.micro_batch, a.seq + 1), generator=torch.Generator().manual_seed(0))

    def one_step(model):
        """(step seconds, exposed tp seconds, tp bytes, the tp collectives' stats)."""
        model.zero_grad(set_to_none=True)
        dist.barrier()
        ps.stats.reset()
        start = time.perf_counter()
        model(tokens[:, :-1], tokens[:, 1:]).sum().backward()
        step = time.perf_counter() - start
        tp = {k: v for k, v in ps.stats.summary().items() if k.startswith("tp.")}
        return step, sum(v["exposed_s"] for v in tp.values()), sum(v["bytes"] for v in tp.values()), tp

    times = interleaved(models, one_step, a.warmup, a.steps)
    out = {overlap: {"step": statistics.median(t[0] for t in ts), "exposed": statistics.median(t[1] for t in ts),
                     "bytes": ts[-1][2], "kinds": {k: v["exposed_s"] for k, v in ts[-1][3].items()}}
           for overlap, ts in times.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        queue.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


@user_errors
def main(argv=None) -> int:
    a = parse_args(argv)
    problem = check(a)
    if problem:
        print_error(problem)
        return 2
    ranks = run_ranks(worker, a.tp, a)
    print(f"tp={a.tp} with sequence parallelism, gloo CPU ({a.threads} thread(s) per rank), fp32, {a.layers} layers "
          f"of hidden {a.hidden}, {a.micro_batch}×{a.seq} tokens; forward + backward, medians of {a.steps} steps")
    print(f"{'tp_comm_overlap':>15} {'step ms':>8} {'exposed tp ms':>14} {'tp MiB sent':>12}  exposed by kind (ms)")
    for overlap in (False, True):
        slowest = max(ranks, key=lambda r: r[overlap]["step"])[overlap]
        kinds = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in sorted(slowest["kinds"].items()))
        print(f"{str(overlap).lower():>15} {1e3 * slowest['step']:>8.1f} {1e3 * slowest['exposed']:>14.1f} "
              f"{slowest['bytes'] / 2**20:>12.1f}  {kinds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
