"""Spawn a benchmark's gloo ranks on this machine and collect what they report."""

from __future__ import annotations

import os
import tempfile

import torch.multiprocessing as mp


def run_ranks(worker, world: int, args):
    """Run ``worker(rank, world, store_path, args, queue)`` in ``world`` fresh processes that meet
    through a FileStore in a scratch directory; the first object a rank puts on the queue."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, world, os.path.join(tmp, "store"), args, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        out = queue.get(timeout=3600)
        for p in procs:
            p.join()
    return out
