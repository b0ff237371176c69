"""What the benchmarks and developer checks under tools/ share. Imported first by each of them: a
checkout without the package installed gets one line saying how to install it, not a traceback.

The scripts import the installed package (``pip install -e .``) and never the other way round:
nothing in ``megapretrain/`` imports tools/. A script runs as ``python tools/NAME.py``, which puts
tools/ first on ``sys.path``, so the scripts import this module and each other by name.
"""

from __future__ import annotations

import os
import sys
import tempfile

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)  # the checkout: configs/, docs/, tests/, run_scripts/ beside tools/

try:
    import megapretrain  # noqa: F401
except ModuleNotFoundError as exc:  # a checkout that is not installed
    if not (exc.name or "").startswith("megapretrain"):
        raise
    print(f"error: {exc}: install the package, from the repository root: pip install -e .",
          file=sys.stderr)
    sys.exit(2)


def rss_bytes(field: str) -> int:
    """A field of this process's /proc/self/status (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def sync(device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so that a timer reads the work done."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def run_ranks(worker, world: int, args):
    """Run ``worker(rank, world, store_path, args, queue)`` in ``world`` fresh processes that meet
    through a FileStore in a scratch directory; the first object a rank puts on the queue."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=worker, args=(r, world, store, args, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        out = queue.get(timeout=3600)
        for p in procs:
            p.join()
    return out


def join_gloo(rank: int, world: int, store_path: str, threads: int = 1) -> None:
    """Join a :func:`run_ranks` worker's gloo group, with ``threads`` torch CPU threads (one by
    default, so that ranks do not fight over cores)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)


def interleaved(runs: dict, step, warmup: int, steps: int) -> dict[object, list]:
    """``step(run)`` for each of ``runs`` in turn, ``warmup + steps`` rounds, so that load from
    elsewhere on the machine hits each alike: the results of the last ``steps`` rounds, by key."""
    out = {key: [] for key in runs}
    for i in range(warmup + steps):
        for key, run in runs.items():
            result = step(run)
            if i >= warmup:
                out[key].append(result)
    return out


def bench_model_args(layers: int, hidden: int, vocab: int, min_heads: int = 1):
    """The benchmarks' decoder: heads of 64 (at least ``min_heads``), as many kv heads, a 4× FFN."""
    from megapretrain.model.args import ModelArgs

    heads = max(min_heads, hidden // 64)
    return ModelArgs(num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=heads,
                     ffn_hidden_size=4 * hidden, vocab_size=vocab)
