"""A run that watches itself: alerts, the recovery policy's extensions, every injected fault and the
reaction to it, the hang watchdog, stragglers, out-of-memory guidance and the time breakdown."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch

from megapretrain.config import AlertsConfig
from megapretrain.monitor.alerts import RECENT, SUSTAIN, AlertMonitor
from megapretrain.recovery import Detector
from megapretrain.train import main

from helpers import records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_heads", "4", "--model.num_kv_heads", "2",
        "--model.ffn_hidden_size", "128", "--train.seq_length", "32", "--train.micro_batch_size", "2",
        "--train.global_batch_size", "4", "--logging.tensorboard", "false", "--optim.lr", "3e-3",
        "--train.eval_interval", "0"]


def steps(run_dir) -> list[dict]:
    return [r for r in records(run_dir) if "loss" in r and "event" not in r]


# -- alerts on synthetic streams ------------------------------------------------------------------

def _stream(monitor, n, loss=lambda i: 3.0, grad=lambda i: 1.0, tps=lambda i: 1000.0, wait=lambda i: 0.01):
    out = []
    for i in range(1, n + 1):
        out += monitor.observe(i, loss(i), grad(i), tps(i), wait(i))
    return out


def test_a_noisy_healthy_run_raises_no_alert():
    rng = random.Random(0)
    monitor = AlertMonitor(AlertsConfig())
    alerts = _stream(monitor, 500, loss=lambda i: 6.0 * math.exp(-i / 200) + 2 + rng.gauss(0, 0.1),
                     grad=lambda i: abs(rng.gauss(1.0, 0.5)), tps=lambda i: rng.gauss(1000, 80),
                     wait=lambda i: abs(rng.gauss(0.01, 0.01)))
    assert alerts == []


@pytest.mark.parametrize("kind, bad", [
    ("grad_norm", dict(grad=lambda i: 50.0 if 100 <= i < 110 else 1.0)),
    ("loss_ratio", dict(loss=lambda i: 9.0 if 100 <= i < 110 else 3.0)),
    ("throughput", dict(tps=lambda i: 500.0 if 100 <= i < 140 else 1000.0)),
    ("data_wait", dict(wait=lambda i: 2.5 if 100 <= i < 110 else 0.01)),
    ("non_finite", dict(loss=lambda i: float("nan") if 100 <= i < 110 else 3.0)),
])
def test_each_alert_starts_once_and_clears(kind, bad):
    alerts = _stream(AlertMonitor(AlertsConfig()), 200, **bad)
    assert [(a["kind"], a["state"]) for a in alerts] == [(kind, "start"), (kind, "clear")], alerts
    start, clear = alerts
    latest = 105 + (SUSTAIN if kind == "throughput" else 0)  # a throughput drop must last
    assert 100 <= start["iter"] <= latest and clear["since"] == start["iter"] and clear["iter"] > start["iter"]


def test_throughput_dips_on_a_busy_machine_neither_alert_nor_flap():
    """A shared machine's load comes and goes: dips of 40% lasting 3 to 8 steps each, with
    recoveries between them, raise no alert (before, each dip started and cleared one); a dip that
    lasts raises one alert, and a recovery that does not last does not clear it."""
    rng = random.Random(1)
    busy = {i for start in range(60, 400, 25) for i in range(start, start + rng.randint(3, 8))}
    alerts = _stream(AlertMonitor(AlertsConfig()), 420, tps=lambda i: 600.0 if i in busy else 1000.0)
    assert alerts == [], alerts
    # sustained from 100 to 200, with one short recovery inside it (150-155)
    slow = lambda i: 500.0 if 100 <= i < 200 and not 150 <= i < 156 else 1000.0
    alerts = _stream(AlertMonitor(AlertsConfig()), 300, tps=slow)
    assert [(a["kind"], a["state"]) for a in alerts] == [("throughput", "start"), ("throughput", "clear")], alerts
    assert 100 < alerts[0]["iter"] <= 100 + RECENT + SUSTAIN and 200 < alerts[1]["iter"] <= 200 + RECENT + SUSTAIN


def test_the_steps_after_an_evaluation_or_a_save_are_not_a_throughput_drop():
    monitor = AlertMonitor(AlertsConfig())
    alerts = _stream(monitor, 100)
    monitor.settle()  # a save ran: the next steps are slow while its writer finishes
    for i in range(101, 110):
        alerts += monitor.observe(i, 3.0, 1.0, 600.0, 0.01)
    alerts += _stream(monitor, 30)
    assert alerts == []


def test_the_spike_ratio_and_gradient_explosions_trigger_recovery():
    ratio = Detector(spike_zscore=1e9, window=10, spike_ratio=3.0)
    verdicts = [ratio.observe(i, 10.0 if i == 15 else 3.0, False) for i in range(1, 20)]
    assert [(v["kind"], v["iter"]) for v in verdicts if v] == [("loss_spike", 15)]
    explosion = Detector(window=10, max_bad_steps=3, grad_norm_rollback=100.0)
    verdicts = [explosion.observe(i, 3.0, False, 500.0 if 8 <= i <= 12 else 1.0) for i in range(1, 20)]
    found = [v for v in verdicts if v]
    assert [(v["kind"], v["since"], v["iter"]) for v in found][0] == ("grad_explosion", 8, 10)


# -- faults through the real trainer ---------------------------------------------------------------

def _train(run_dir, corpus, *extra) -> int:
    return main(["--run.dir", str(run_dir), "--data.paths", f"[{corpus}]", *TINY, *extra])


def test_injected_nan_skips_the_step_and_leaves_the_parameters(tmp_path, corpus):
    from megapretrain.checkpoint.format import read_rank_state

    run = tmp_path / "run"
    assert _train(run, corpus, "--train.iters", "3", "--checkpoint.interval", "1", "--faults.nan_at", "3",
                  "--recovery.action", "alert") == 0
    assert [r["iter"] for r in records(run) if r.get("event") == "skipped_step"] == [3]
    second, third = (read_rank_state(str(run / "checkpoints" / f"iter_000000{i}"), 0)["model"] for i in (2, 3))
    assert all(torch.equal(second[n], third[n]) for n in second)
    assert [(a["kind"], a["state"]) for a in records(run) if a.get("event") == "alert" and "state" in a] == \
        [("non_finite", "start")]


def test_an_injected_spike_rolls_back_and_halves_the_learning_rate(tmp_path, corpus):
    run = tmp_path / "run"
    assert _train(run, corpus, "--train.iters", "16", "--checkpoint.interval", "4", "--recovery.window", "6",
                  "--faults.spike_at", "11", "--schedule.decay", "constant") == 0
    rollbacks = [r for r in records(run) if r.get("event") == "rollback"]
    assert [(r["iter"], r["from_iter"], r["lr_scale"]) for r in rollbacks] == [(8, 11, 0.5)]
    lrs = {r["iter"]: r["lr"] for r in steps(run)}  # the later value of each iteration
    assert lrs[8] == pytest.approx(3e-3) and all(lrs[i] == pytest.approx(1.5e-3) for i in range(9, 17))
    from megapretrain.checkpoint.format import read_rank_state

    assert read_rank_state(str(run / "checkpoints" / "iter_0000016"), 0)["lr_scale"] == 0.5  # saved ...
    assert _train(run, corpus, "--train.iters", "18", "--checkpoint.interval", "4", "--recovery.window", "6",
                  "--faults.spike_at", "11", "--schedule.decay", "constant") == 0
    lrs = {r["iter"]: r["lr"] for r in steps(run)}
    assert lrs[17] == pytest.approx(1.5e-3) and lrs[18] == pytest.approx(1.5e-3)  # ... and resumed


def test_after_a_rollback_the_run_is_the_one_started_from_that_checkpoint_with_the_lower_rate(tmp_path, corpus):
    """The rolled-back run (spike at 11: back to the checkpoint of 8, data skipped, LR × 0.5) ends
    in the state of a fresh run started from that checkpoint at the same data position with the
    learning rate halved: the same losses from iteration 9 on and bitwise the same final weights
    and moments."""
    import shutil

    from megapretrain.checkpoint.format import (
        metadata,
        read_metadata,
        read_rank_state,
        write_metadata,
        write_rank_state,
    )

    flags = ["--train.iters", "16", "--checkpoint.interval", "4", "--recovery.window", "6",
             "--schedule.decay", "constant"]
    rolled = tmp_path / "rolled"
    assert _train(rolled, corpus, *flags, "--faults.spike_at", "11") == 0
    rollback, = [r for r in records(rolled) if r.get("event") == "rollback"]
    assert rollback["iter"] == 8 and rollback["lr_scale"] == 0.5

    # the reference: that checkpoint, at the data position the rollback moved to, LR halved
    fresh = tmp_path / "fresh" / "checkpoints" / "iter_0000008"
    shutil.copytree(rolled / "checkpoints" / "iter_0000008", fresh)
    state = read_rank_state(str(fresh), 0)
    state["consumed_samples"] = rollback["consumed_samples"]
    size, crc = write_rank_state(str(fresh / "rank_00000.safetensors"), state)
    meta = read_metadata(str(fresh))
    write_metadata(str(fresh), metadata(**{**meta, "files": {"rank_00000.safetensors": (size, crc)}}))
    assert _train(tmp_path / "fresh", corpus, *flags, "--checkpoint.load", str(fresh), "--optim.lr", "1.5e-3") == 0

    after = {r["iter"]: r["loss"] for r in steps(rolled) if r["iter"] > 8}  # the later value of each iteration
    assert after == {r["iter"]: r["loss"] for r in steps(tmp_path / "fresh") if r["iter"] > 8}
    a, b = (read_rank_state(str(d / "checkpoints" / "iter_0000016"), 0) for d in (rolled, tmp_path / "fresh"))
    assert a["lr_scale"] == 0.5 and b["lr_scale"] == 1.0  # (the same rate: 3e-3 × 0.5 and 1.5e-3)
    assert set(a["model"]) == set(b["model"])
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a["optimizer"]["params"][name][key], b["optimizer"]["params"][name][key]), name


def test_an_injected_oom_prints_the_remedies_with_estimates(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        _train(run, corpus, "--train.iters", "5", "--faults.oom_at", "3", "--train.micro_batch_size", "2")
    assert exit_info.value.code == 4
    err = capsys.readouterr().err
    assert "out of memory on rank 0 at iteration 3" in err and (run / "oom_rank0.txt").exists()
    lines = [line for line in err.splitlines() if line.strip()[:2] in ("1.", "2.", "3.", "4.")]
    assert lines[0].strip().startswith("1. --parallel.recompute full (planner:")
    assert lines[1].strip().startswith("2. --train.micro_batch_size 1 (planner:")
    assert [r["event"] for r in records(run) if r.get("event") == "oom"] == ["oom"]


def test_the_time_breakdown_is_logged(tmp_path, corpus):
    run = tmp_path / "run"
    assert _train(run, corpus, "--train.iters", "3", "--faults.slow_data_at", "2", "--faults.slow_data_s", "1.2") == 0
    rows = steps(run)
    for key in ("data_time", "forward_backward_time", "grad_sync_time", "optimizer_time", "global_batch_size",
                "checkpoint_stall_s"):
        assert all(key in r for r in rows), key
    assert rows[1]["data_time"] >= 1.2 > rows[0]["data_time"]
    parts = sum(rows[2][k] for k in ("data_time", "forward_backward_time", "grad_sync_time", "optimizer_time"))
    assert parts <= rows[2]["step_time"] * 1.01
    assert [a["kind"] for a in records(run) if a.get("event") == "alert"] == ["data_wait", "data_wait"]  # start, clear


def _torchrun(run_dir, corpus, *extra, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "megapretrain.train",
           "--run.dir", str(run_dir), "--data.paths", f"[{corpus}]", *TINY, *extra]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_a_hang_on_one_rank_is_caught_and_both_stacks_written(tmp_path, corpus):
    run = tmp_path / "run"
    done = _torchrun(run, corpus, "--train.iters", "20", "--faults.hang_at", "4", "--faults.rank", "1",
                     "--watchdog.timeout_s", "6", "--watchdog.startup_s", "6")
    assert done.returncode != 0
    reports = {}
    for rank in (0, 1):
        with open(run / "hang" / f"rank{rank}.txt") as fh:
            reports[rank] = json.loads(fh.readline())
            text = fh.read()
        assert "Thread" in text or "File" in text  # the Python stacks
    assert reports[1]["iter"] == 4 and reports[1]["phase"] == "step"
    assert reports[0]["last_collective"]  # rank 0 waits in a collective for rank 1
    assert "exitcode: 5" in done.stderr or "exit code 5" in done.stderr or "(exitcode: 5)" in done.stderr


@pytest.mark.slow
def test_a_straggler_with_slow_data_is_named(tmp_path, corpus):
    run = tmp_path / "run"
    done = _torchrun(run, corpus, "--train.iters", "12", "--faults.slow_data_at", "3", "--faults.slow_data_s", "0.5",
                     "--faults.slow_data_steps", "5", "--faults.rank", "1", "--alerts.straggler_steps", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    # rank 1's events only: on a loaded shared machine rank 0 can be slow for real for a few steps
    stragglers = [r for r in records(run) if r.get("event") == "straggler" and r["rank"] == 1]
    assert [s["state"] for s in stragglers] == ["start", "clear"]  # once, not every step
    start, clear = stragglers
    # slow at steps 3-7: named once the median of its last 4 steps is slow, cleared once it is not
    assert 4 <= start["iter"] <= 7 and start["host"] and start["ratio"] >= 1.2
    assert start["data_time"] >= 0.25  # the median data wait of its last 4 steps: at least half of them slow
    assert clear["since"] == start["iter"] and clear["iter"] >= 8
    assert "straggler: rank 1" in done.stdout and "straggler cleared" in done.stdout


def test_an_injected_exit_stops_the_rank_and_a_restart_resumes(tmp_path, corpus):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megapretrain.train", "--run.dir", str(run), "--data.paths", f"[{corpus}]", *TINY,
           "--train.iters", "6", "--checkpoint.interval", "2"]
    env = {**os.environ, "PYTHONPATH": ROOT, "WORLD_SIZE": "1"}
    first = subprocess.run([*cmd, "--faults.exit_at", "5"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert first.returncode == 1 and "faults.exit_at=5" in first.stderr
    assert (run / "checkpoints" / "latest").read_text().strip() == "iter_0000004"
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert "taking over the stale lock" in again.stderr  # the crashed run's lock
    assert [r["iter"] for r in records(run) if r.get("event") == "resumed"] == [4]


# -- the recipe: batch-size ramp-up and token budgets -------------------------------------------

RAMP = ["--train.global_batch_size", "8", "--train.rampup_batch_size", "[2, 2, 24]", "--checkpoint.interval", "3",
        "--schedule.decay_iters", "12"]


def test_the_batch_ramps_up_and_resume_in_the_middle_is_exact(tmp_path, corpus):
    from megapretrain.data.sampler import batch_size_at

    straight, split = tmp_path / "straight", tmp_path / "split"
    assert _train(straight, corpus, *RAMP, "--train.iters", "12") == 0
    rows = steps(straight)
    batches = [r["global_batch_size"] for r in rows]
    assert batches[:4] == [2, 2, 2, 2] and batches[-1] == 8 and batches == sorted(batches)
    consumed = 0
    for r in rows:  # consumed tokens follow the ramp, step by step
        consumed += batch_size_at(consumed, 8, [2, 2, 24])
        assert r["consumed_tokens"] == consumed * 32
    assert _train(split, corpus, *RAMP, "--train.iters", "6") == 0  # stops inside the ramp
    assert steps(split)[-1]["global_batch_size"] < 8
    assert _train(split, corpus, *RAMP, "--train.iters", "12") == 0
    again = {r["iter"]: (r["loss"], r["grad_norm"], r["global_batch_size"]) for r in steps(split)}
    assert again == {r["iter"]: (r["loss"], r["grad_norm"], r["global_batch_size"]) for r in rows}


def test_a_token_budget_sets_the_steps(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    assert _train(run, corpus, "--train.train_tokens", "2000", "--train.iters", "50") == 2
    assert "set one of train.iters=50 and train.train_tokens=2000" in capsys.readouterr().err
    # 4 × 32 = 128 tokens a step: 16 steps reach 2,048 ≥ 2,000 tokens
    assert _train(run, corpus, "--train.train_tokens", "2000") == 0
    rows = steps(run)
    assert len(rows) == 16 and rows[-1]["consumed_tokens"] == 2048
    assert "steps=16" in capsys.readouterr().out


def test_a_spiked_batch_keeps_the_targets_left_out_of_the_loss_left_out(tmp_path):
    """faults.spike_at shifts every target id (valid ids still), except those excluded from the loss
    (data.eod_mask_loss marks them -100), and only the batch it first read."""
    from megapretrain.config import FaultsConfig
    from megapretrain.faults import Faults

    faults = Faults(FaultsConfig(spike_at=2), rank=0, run_dir=str(tmp_path))
    targets = torch.tensor([[0, 5, -100, 300]])
    clean = faults.corrupt(1, 0, [(None, targets)], vocab_size=301)
    assert clean[0][1] is targets
    (_, spiked), = faults.corrupt(2, 8, [(None, targets)], vocab_size=301)
    assert spiked.tolist() == [[150, 155, -100, 149]]
    assert faults.corrupt(3, 16, [(None, targets)], vocab_size=301)[0][1] is targets
    assert faults.corrupt(4, 8, [(None, targets)], vocab_size=301)[0][1].tolist() == spiked.tolist()  # replayed


def test_the_flight_recorder_is_turned_on_for_nccl_only_and_keeps_a_users_settings():
    from megapretrain.parallel import flight_recorder

    env = flight_recorder.environment("nccl", "/runs/a", {})
    assert env == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_FR_DUMP_TEMP_FILE": "/runs/a/flight_recorder/rank_"}
    assert flight_recorder.environment("gloo", "/runs/a", {}) == {}
    # a user's own settings, under either name, are kept
    mine = {"TORCH_FR_BUFFER_SIZE": "100", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr_"}
    assert flight_recorder.environment("nccl", "/runs/a", mine) == {}
    assert flight_recorder.read_hint(mine).startswith("NCCL flight recorder: each rank's last "
                                                      "collectives are in /scratch/fr_<rank>")
    assert flight_recorder.read_hint({}) is None  # off
    assert flight_recorder.read_hint({**env, "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}) is None


def test_the_flight_recorder_is_set_before_the_group_on_cuda(tmp_path, monkeypatch):
    from megapretrain.parallel import flight_recorder

    for name in (*flight_recorder.BUFFER_VARS, *flight_recorder.PREFIX_VARS,
                 "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    assert flight_recorder.enable("auto", "cpu", str(tmp_path)) == {}  # gloo
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in os.environ
    added = flight_recorder.enable("auto", "cuda", str(tmp_path))
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and len(added) == 3
    assert os.path.isdir(tmp_path / "flight_recorder")


def test_the_hang_report_names_the_flight_recorder_files(tmp_path, monkeypatch):
    """With the recorder on, the watchdog writes this rank's buffer (NCCL's dump of it) beside the
    others' and its report says where they are and how to read them."""
    from megapretrain.config import WatchdogConfig
    from megapretrain.monitor.watchdog import Watchdog

    prefix = str(tmp_path / "flight_recorder" / "rank_")
    os.makedirs(os.path.dirname(prefix))
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", prefix)
    monkeypatch.setattr(torch._C._distributed_c10d, "_dump_nccl_trace", lambda: b"trace",
                        raising=False)
    dog = Watchdog(WatchdogConfig(), str(tmp_path), rank=1)
    dog.report("step", 7, 400.0, 300.0)
    with open(tmp_path / "hang" / "rank1.txt") as fh:
        facts, text = json.loads(fh.readline()), fh.read()
    assert facts["flight_recorder"] == prefix + "1"
    assert open(prefix + "1", "rb").read() == b"trace"
    assert f"{prefix}<rank>" in text
    reader = "python -m torch.distributed.flight_recorder.fr_trace"
    assert f"{reader} {tmp_path}/flight_recorder" in text
