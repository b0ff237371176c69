"""No host sync in a training step: the trainer's loop, from the first step to the read point of
the first logging step, reads no tensor's value on the host (``aten._local_scalar_dense``: every
``.item()``, ``float(t)``, ``bool(t)``) and copies nothing from a device to the host — under one
process and tp 2, pp 2 and dp 2 with ZeRO 3 on gloo, and with ``data.eod_mask_loss`` and document
masking (a dense mask). The read point itself then brings back every step's loss and grad norm,
and the run behaves as it did reading each step: the same losses and grad norms as a run logging
every step. Blockwise attention, document masking's kernel off CUDA, reads its tile plan on the
host once per micro-batch (which tiles to run is a Python loop's decision): counted exactly."""

from __future__ import annotations

import json
import os

import pytest

from megapretrain.monitor.anatomy import DispatchCounter
from megapretrain.train import setup

from distributed import run_distributed

STEPS = 11  # 10 steps that log nothing, then the logging step whose read point ends the count
BASE = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_heads", "4",
        "--model.num_kv_heads", "2", "--model.ffn_hidden_size", "128", "--train.seq_length", "32",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "4", "--train.iters", str(STEPS),
        "--train.eval_interval", "0", "--logging.tensorboard", "false", "--checkpoint.interval", "0",
        "--optim.lr", "3e-3", "--train.seed", "5", "--recovery.action", "rollback"]


def _count(rank, world, run_dir, corpus, layout, interval):
    """Train with the counter on from the first step until the first read point."""
    trainer = setup(["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *BASE, *layout,
                     "--logging.interval", str(interval)])
    counter, counting = DispatchCounter(where=True), []
    step, read = trainer._guarded_step, trainer._read_steps

    def first_step():
        if trainer.iteration == 0 and not counting:
            counter.__enter__()
            counting.append(True)
        return step()

    def first_read(logged):
        if counting == [True]:  # the first read point: stop counting
            counter.__exit__(None, None, None)
            counting.append(False)
        return read(logged)

    trainer._guarded_step, trainer._read_steps = first_step, first_read
    trainer.fit()
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [r for r in map(json.loads, fh) if "loss" in r]
    return {"syncs": counter.syncs, "sites": dict(counter.sync_sites), "ops": counter.ops,
            "rows": [(r["iter"], r["loss"], r["grad_norm"]) for r in rows]}


DOCUMENTS = ["--data.reset_attention_mask", "true", "--data.reset_position_ids", "true"]
LAYOUTS = {"one process": (1, []), "tp2": (2, ["--parallel.tp", "2"]), "pp2": (2, ["--parallel.pp", "2"]),
           "dp2_zero3": (2, ["--parallel.zero", "3"]),
           # the count of the tokens kept stays on the device, summed over dp and pp there
           "eod_mask_loss_dp2": (2, ["--data.eod_mask_loss", "true"]),
           "eod_mask_loss_pp2": (2, ["--data.eod_mask_loss", "true", "--parallel.pp", "2"]),
           # document masking with a dense mask (sdpa) reads nothing
           "documents_sdpa": (1, [*DOCUMENTS, "--data.eod_mask_loss", "true", "--model.attention", "sdpa"])}
MICRO_BATCHES = 2  # global batch 4 of micro-batches of 2, one process


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_no_host_sync_outside_logging_steps(name, corpus, tmp_path):
    world, layout = LAYOUTS[name]
    results = run_distributed(_count, world, str(tmp_path / "run"), corpus, layout, STEPS, timeout=300)
    for rank, r in enumerate(results):
        assert r["ops"] > 1000, rank  # the counter saw the steps
        assert r["syncs"] == 0, (rank, r["sites"])
    assert [it for it, _, _ in results[0]["rows"]] == [STEPS]


def test_blockwise_attention_reads_its_tile_plan_once_per_micro_batch(corpus, tmp_path):
    """Blockwise attention (document masking off CUDA) decides on the host which tiles to run: one
    read of the micro-batch's tile maps, shared by every layer, and nothing else."""
    results = run_distributed(_count, 1, str(tmp_path / "run"), corpus, [*DOCUMENTS, "--model.attention", "blockwise"],
                              STEPS, timeout=300)
    r = results[0]
    assert r["syncs"] == STEPS * MICRO_BATCHES, r["sites"]
    assert all(site.startswith("attention.py") and "tolist" in site for site in r["sites"]), r["sites"]


@pytest.mark.parametrize("flags", [[], ["--data.eod_mask_loss", "true"]], ids=["every_token", "eod_mask_loss"])
def test_reading_late_logs_what_reading_each_step_logs(flags, corpus, tmp_path):
    """The values read at a logging step are those a run logging (reading) every step logs; with
    end-of-document targets left out of the loss too (the count of the tokens kept, a device
    value, scales the reduced grads before their clipping)."""
    late = run_distributed(_count, 1, str(tmp_path / "late"), corpus, flags, STEPS, timeout=300)
    every = run_distributed(_count, 1, str(tmp_path / "every"), corpus, flags, 1, timeout=300)
    assert len(every[0]["rows"]) == STEPS
    assert late[0]["rows"][-1] == pytest.approx(every[0]["rows"][-1], rel=1e-12)


def _count_during_async_save(rank, world, run_dir, corpus):
    """Train with an async save at iteration 3 whose write is held back until step 6 starts; count
    the syncs of steps 4 to 6 (the save in flight: every step boundary agrees on it), up to the
    read point at 6."""
    import threading

    from megapretrain.checkpoint import manager

    release, write = threading.Event(), manager.write_rank_state

    def held_write(*args, **kwargs):
        release.wait(timeout=120)
        return write(*args, **kwargs)

    manager.write_rank_state = held_write
    trainer = setup(["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *BASE,
                     "--checkpoint.async", "true", "--checkpoint.interval", "3",
                     "--logging.interval", str(STEPS)])
    counter, seen = DispatchCounter(where=True), {"steps": 0, "in_flight": 0}
    step, read = trainer._guarded_step, trainer._read_steps

    def counted_step():
        if trainer.iteration == 3:  # the save at 3 is in flight from here on
            counter.__enter__()
            seen["counting"] = True
        if seen.get("counting"):
            seen["steps"] += 1
            seen["in_flight"] += trainer.run.checkpoints._pending is not None
        if trainer.iteration == 5:
            release.set()
        return step()

    def stop_counting(logged):
        if seen.pop("counting", False):
            counter.__exit__(None, None, None)
        return read(logged)

    trainer._guarded_step, trainer._read_steps = counted_step, stop_counting
    try:
        trainer.fit()
    finally:
        release.set()
        manager.write_rank_state = write
    return {"syncs": counter.syncs, "sites": dict(counter.sync_sites), "steps": seen["steps"],
            "in_flight": seen["in_flight"], "saved": trainer.run.saved}


def test_no_host_sync_per_step_while_an_async_save_is_in_flight(corpus, tmp_path):
    """While an async save is being written, each step boundary's agreement on it (and its
    finishing) reads nothing from a device: it is a vote on a host value over the checkpoint
    group."""
    results = run_distributed(_count_during_async_save, 2, str(tmp_path / "run"), corpus,
                              timeout=300)
    for rank, r in enumerate(results):
        assert r["steps"] == 3 and r["in_flight"] == 3, (rank, r)  # steps 4 to 6, save pending
        assert r["syncs"] == 0, (rank, r["sites"])
        assert r["saved"] == [3, 6, 9, STEPS], (rank, r)
