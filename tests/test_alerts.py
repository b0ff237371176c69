"""Alerts that mean something: none on a healthy run (two ranks: no straggler; the quickstart's run:
tests/test_quickstart.py), none for the gradient before the first update, stragglers judged on a
median over many steps, the spike drill caught early in a run and refused in one line where it
cannot be, drills that fire once per run directory, and what an alert tells a shared webhook and
TensorBoard."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import types

import pytest
import torch

from megapretrain.config import AlertsConfig
from megapretrain.monitor.alerts import AlertMonitor, Stragglers
from megapretrain.train import main

from distributed import run_distributed
from helpers import records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_heads", "4", "--model.num_kv_heads", "2",
        "--model.ffn_hidden_size", "128", "--train.seq_length", "32", "--train.micro_batch_size", "2",
        "--train.global_batch_size", "4", "--logging.tensorboard", "false", "--optim.lr", "3e-3",
        "--train.eval_interval", "0"]


def alerts(run_dir) -> list[dict]:
    return [r for r in records(run_dir) if r.get("event") in ("alert", "straggler", "rollback")]


def _train(run_dir, corpus, *extra) -> int:
    return main(["--run.dir", str(run_dir), "--data.paths", f"[{corpus}]", *TINY, *extra])


def test_the_first_steps_gradient_is_not_an_alert():
    monitor = AlertMonitor(AlertsConfig(grad_norm_max=10.0))
    assert monitor.observe(1, 5.5, 41.0, 1000.0, 0.0) == []  # before any update: the initialization's gradient
    assert [a["kind"] for a in monitor.observe(2, 5.0, 41.0, 1000.0, 0.0)] == ["grad_norm"]


def _stragglers(rank: int, world: int, slow_steps: list[int]) -> list[dict]:
    ps = types.SimpleNamespace(device=torch.device("cpu"), world_size=world)  # what the check reads of it
    watch, out = Stragglers(ratio=1.2, steps=5), []
    for it in range(1, 31):
        watch.observe(1.0 if rank == 1 and it in slow_steps else 0.5, 0.0)
        out += watch.check(ps, ["a", "b", "c"][:world], it)
    return out


def test_a_straggler_is_a_rank_slow_over_many_steps_not_one_slow_step():
    one_slow_step = run_distributed(_stragglers, 3, [10])
    assert one_slow_step == [[], [], []]
    slow_stretch = run_distributed(_stragglers, 3, list(range(10, 20)))
    assert slow_stretch[0] == slow_stretch[2]  # every rank reaches the same verdict
    start, clear = slow_stretch[0]
    assert (start["state"], start["rank"], start["host"], start["iter"]) == ("start", 1, "b", 12)  # 3 of its last 5
    assert start["ratio"] == pytest.approx(2.0) and start["steps"] == 5
    assert (clear["state"], clear["since"], clear["iter"]) == ("clear", 12, 22)


@pytest.mark.slow
def test_a_healthy_two_rank_run_names_no_straggler(tmp_path, corpus):
    run = tmp_path / "run"
    # steps long enough (about 0.1 s) that the work, not the scheduler's noise, sets each rank's time
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "megapretrain.train",
           "--run.dir", str(run), "--data.paths", f"[{corpus}]", *TINY, "--train.iters", "40",
           "--train.seq_length", "128", "--train.micro_batch_size", "4", "--train.global_batch_size", "8"]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [a for a in alerts(run) if a["event"] == "straggler"] == [] and "straggler" not in done.stdout


def test_the_spike_drill_early_in_a_run_rolls_back(tmp_path, corpus):
    run = tmp_path / "run"
    assert _train(run, corpus, "--train.iters", "12", "--faults.spike_at", "10", "--checkpoint.interval", "5") == 0
    found = alerts(run)
    spike = [a for a in found if a.get("kind") == "loss_spike"]
    rollback = [a for a in found if a["event"] == "rollback"]
    assert [(s["iter"], s["since"]) for s in spike] == [(10, 10)]
    assert [(r["from_iter"], r["iter"]) for r in rollback] == [(10, 5)]


def test_a_spike_drill_that_cannot_be_caught_is_refused_in_one_line(tmp_path, corpus, capsys):
    assert _train(tmp_path / "run", corpus, "--train.iters", "12", "--faults.spike_at", "6",
                  "--checkpoint.interval", "2") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning:")]
    assert err == ["error: faults.spike_at=6 comes before the spike detector judges (from iteration 9: it needs 8 "
                   "healthy steps first): use --faults.spike_at 9 or later"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_spike_drill_with_no_checkpoint_to_roll_back_to_is_warned(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    assert _train(run, corpus, "--train.iters", "12", "--faults.spike_at", "10", "--checkpoint.interval", "0") == 0
    warning, = [line for line in capsys.readouterr().err.splitlines() if "faults.spike_at=10" in line]
    assert "no checkpoint is saved before it (checkpoint.interval=0)" in warning
    assert "--checkpoint.interval 4" in warning
    assert [(a["kind"], a["iter"]) for a in alerts(run) if a["event"] == "alert" and "state" not in a] == \
        [("loss_spike", 10)]  # caught all the same


def test_a_drill_fires_once_per_run_directory(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    flags = ["--train.iters", "6", "--checkpoint.interval", "2", "--faults.nan_at", "3", "--recovery.action", "alert"]
    assert _train(run, corpus, *flags, "--train.iters", "4") == 0
    assert [r["iter"] for r in records(run) if r.get("event") == "skipped_step"] == [3]
    assert json.loads((run / "faults" / "nan_at.rank0.json").read_text())["iter"] == 3
    (run / "checkpoints" / "latest").write_text("iter_0000002\n")  # a restart from before the drill
    capsys.readouterr()
    assert _train(run, corpus, *flags) == 0
    assert "faults.nan_at=3 (rank 0): fired already in this run directory" in capsys.readouterr().out
    assert [r["iter"] for r in records(run) if r.get("event") == "skipped_step"] == [3]  # not again


def test_an_alert_tells_the_webhook_which_run_and_tensorboard_gets_its_line(tmp_path, corpus):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, sink = tmp_path / "run", tmp_path / "alerts.jsonl"
    assert _train(run, corpus, "--train.iters", "4", "--run.name", "exp-7", "--logging.tensorboard", "true",
                  "--faults.slow_data_at", "2", "--faults.slow_data_s", "1.2",
                  "--recovery.alert_command", f'echo "$MEGAPRETRAIN_ALERT" >> {sink}') == 0
    deadline = time.monotonic() + 120  # the command runs in the background
    while time.monotonic() < deadline and len(sink.read_text().splitlines() if sink.exists() else []) < 2:
        time.sleep(0.2)
    sent = [json.loads(line) for line in sink.read_text().splitlines()]
    assert sorted((a["kind"], a["state"]) for a in sent) == [("data_wait", "clear"), ("data_wait", "start")]
    assert all(a["run"] == "exp-7" and a["run_dir"] == str(run) and a["host"] == socket.gethostname() for a in sent)
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = [e.tensor_proto.string_val[0].decode() for e in events.Tensors("alerts/text_summary")]
    assert any(t.startswith("alert at iteration 2: data_wait: waited 1.2") for t in texts), texts
    assert any(t.startswith("alert cleared at iteration 3: data_wait") for t in texts), texts
