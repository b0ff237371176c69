"""Run a function on N gloo ranks in spawned processes, for tests on one CPU machine.

Ranks rendezvous through a ``FileStore`` in a temporary directory (no port to pick or collide on),
use one CPU thread each (ranks that share cores must not oversubscribe them), and are killed after a
hard timeout, which fails the test and names the ranks that hung instead of stalling CI.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback

import torch


def _worker(fn, rank: int, world_size: int, store_path: str, args: tuple, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(out, buf)  # plain bytes: tensors in shared memory die with this process
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0) -> list:
    """Call ``fn(rank, world_size, *args)`` on every rank; return the ranks' results in rank order.

    ``fn`` must be a module-level function (spawn pickles it by name); its return value must be
    picklable (tensors, numbers, dicts of them).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, store_path, args, results), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        outputs, deadline = {}, time.monotonic() + timeout
        try:
            while len(outputs) < world_size:
                try:
                    rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    hung = sorted(set(range(world_size)) - set(outputs))
                    raise TimeoutError(f"ranks {hung} of {world_size} did not finish within {timeout:.0f} s") from None
                if status == "error":
                    raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
                outputs[rank] = torch.load(io.BytesIO(value), weights_only=False)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():  # SIGKILL: a rank running the trainer handles SIGTERM as a stop
                    p.kill()
                    p.join(timeout=5)
    return [outputs[r] for r in range(world_size)]
