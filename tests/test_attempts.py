"""The attempts on one run directory: a training that crashes and is started again records a
``restart`` event with its lost time, the closing summary gives the effective training time over
every attempt, and the same failure at the same iteration on consecutive restarts stops the next
attempt (exit 6) — while failures at different iterations, and a new launch, go on. Each attempt
is a process of its own (``faults.exit_at`` ends it with ``os._exit``); a launcher's restart is one
with ``TORCHELASTIC_RESTART_COUNT`` set, started by the same parent process (this one), as
torchrun's agent starts them."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from megapretrain.attempts import Attempt, crash_loop, end_reason, goodput, read_ledger, same_launch
from megapretrain.attempts import restart_lost as lost_between
from megapretrain.cli import CRASH_LOOP_EXIT

from helpers import TINY, records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--train.iters", "8", "--checkpoint.interval", "3", "--train.eval_interval", "0"]


def _attempt(run_dir, corpus, restart: int | None, *extra) -> subprocess.CompletedProcess:
    """One attempt of the training on ``run_dir``: ``restart`` is its launcher's restart count
    (None: started by hand, no launcher)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    if restart is not None:
        env["TORCHELASTIC_RESTART_COUNT"] = str(restart)
    return subprocess.run([sys.executable, "-m", "megapretrain.train", "--run.dir", str(run_dir),
                           "--data.paths", f"[{corpus}]", *TINY, *RUN, *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def _restarts(run_dir) -> list[dict]:
    return [r for r in records(run_dir) if r.get("event") == "restart"]


def _check_restart(event: dict) -> None:
    """A restart event's parts are consistent: none negative, they add up to the lost time, and
    the recomputed iterations are those the previous attempt completed past the checkpoint."""
    parts = ("detection_s", "restart_s", "reload_s", "recomputed_s")
    assert all(event[k] >= 0 for k in parts), event
    assert abs(sum(event[k] for k in parts) - event["lost_s"]) < 0.01, event
    assert event["recomputed_iters"] == event["previous_last_iter"] - event["resumed_iter"], event
    assert event["checkpoint_load_s"] <= event["reload_s"] + 0.01, event
    assert (event["recomputed_s"] > 0) == (event["recomputed_iters"] > 0), event


def test_failures_at_different_iterations_restart_and_the_lost_time_is_recorded(tmp_path, corpus):
    run = tmp_path / "run"
    first = _attempt(run, corpus, 0, "--faults.exit_at", "3")  # before any checkpoint
    assert first.returncode == 1, first.stderr[-2000:]
    os.remove(run / "faults" / "exit_at.rank0.json")  # a second, unrelated crash
    second = _attempt(run, corpus, 1, "--faults.exit_at", "6")
    assert second.returncode == 1, second.stderr[-2000:]
    third = _attempt(run, corpus, 2)
    assert third.returncode == 0, third.stderr[-2000:]

    restarts = _restarts(run)
    assert [(r["attempt"], r["resumed_iter"], r["previous_last_iter"], r["recomputed_iters"])
            for r in restarts] == [(2, 0, 2, 2), (3, 3, 5, 2)]
    for event in restarts:
        _check_restart(event)
        assert event["after"] == "crash" and event["detected_by"] == "next_start"
        assert event["same_launch"] is True
    summary, = [r for r in records(run) if r.get("event") == "summary"]
    assert summary["attempts"] == 3 and summary["restarts"] == 2
    assert 0 < summary["effective_training"] < 1
    assert summary["productive_s"] < summary["wall_s"]
    assert summary["restart_lost_s"] >= sum(r["lost_s"] for r in restarts) - 0.01
    assert "effective training time" in third.stdout and "2 restarts lost" in third.stdout

    ledger = read_ledger(str(run))
    assert [(a.reason, a.resumed_iter, a.reached) for a in ledger] == \
        [("crash", 0, 2), ("crash", 0, 5), ("finished", 3, 8)]
    ends = [json.loads(line) for line in open(run / "attempts.jsonl")
            if '"record": "end"' in line]
    assert [e.get("inferred", False) for e in ends] == [True, True, False]


def test_the_same_failure_twice_stops_the_next_attempt_until_a_new_launch(tmp_path, corpus):
    run = tmp_path / "loop"
    loop = ("--faults.exit_at", "5", "--faults.every_attempt", "true")
    for restart in (0, 1):
        crashed = _attempt(run, corpus, restart, *loop)
        assert crashed.returncode == 1, crashed.stderr[-2000:]
        assert "faults.exit_at=5: exiting" in crashed.stderr
    stopped = _attempt(run, corpus, 2, *loop)
    assert stopped.returncode == CRASH_LOOP_EXIT, stopped.stderr[-2000:]
    line, = [x for x in stopped.stderr.splitlines() if "crash loop" in x]
    assert "attempts 1 and 2 both failed after iteration 4" in line and "relaunch" in line
    assert "attempt 3 does not start" in line
    assert "| loss" not in stopped.stdout  # no step trained
    again = _attempt(run, corpus, 3, *loop)  # its launcher restarts it again: stopped again
    assert again.returncode == CRASH_LOOP_EXIT, again.stderr[-2000:]
    assert "attempts 1 and 2 both failed after iteration 4" in again.stderr

    relaunched = _attempt(run, corpus, None)  # fixed, and started anew
    assert relaunched.returncode == 0, relaunched.stderr[-2000:]
    assert [a.reason for a in read_ledger(str(run))] == \
        ["crash", "crash", "crash_loop", "crash_loop", "finished"]
    restart = _restarts(run)[-1]
    assert restart["after"] == "crash_loop" and restart["same_launch"] is False


def test_the_crash_loop_rule():
    def failed(number, resumed, reached, reason="crash", launch="agent", restart=1, training=1.0):
        return Attempt(number, launch=launch, restart_count=restart, resumed_iter=resumed,
                       last_iter=reached, reason=reason, training=training)

    now = Attempt(3, launch="agent", restart_count=2)
    assert crash_loop([failed(1, 0, 4, restart=0), failed(2, 3, 4)], now)  # same iteration, way
    assert crash_loop([failed(1, 3, 4, "hang"), failed(2, 3, 4)], now)  # same checkpoint
    assert not crash_loop([failed(1, 0, 4, "hang"), failed(2, 3, 4)], now)
    assert not crash_loop([failed(1, 0, 2), failed(2, 0, 5)], now)  # different iterations
    assert not crash_loop([failed(1, 0, 4), failed(2, 0, 4, "finished")], now)
    # a step failed after the checkpoint at 4, then the restart failed in its start-up
    assert not crash_loop([failed(1, 0, 4), failed(2, 4, None, training=None)], now)
    assert "starting at iteration 4" in crash_loop([failed(1, 4, None, training=None),
                                                    failed(2, 4, None, training=None)], now)
    assert not crash_loop([failed(1, 0, 4), failed(2, 0, 4)], Attempt(3, launch=""))  # by hand
    relaunch = Attempt(3, launch="other", restart_count=0)
    assert not crash_loop([failed(1, 0, 4), failed(2, 0, 4)], relaunch)
    assert same_launch(failed(1, 0, 4, launch="a"), Attempt(2, launch="b", restart_count=1))


def test_how_an_attempt_ended():
    from megapretrain.oom import OOM_EXIT
    from megapretrain.recovery import RecoveryError

    assert end_reason(None, None) == ("finished", None)
    assert end_reason(None, "SIGTERM") == ("stopped", "SIGTERM")
    assert end_reason(SystemExit(OOM_EXIT), None)[0] == "oom"
    assert end_reason(RecoveryError("too many rollbacks"), None)[0] == "recovery"
    assert end_reason(KeyboardInterrupt(), None)[0] == "interrupted"
    assert end_reason(RuntimeError("Connection closed by peer"), None) == \
        ("exception", "RuntimeError: Connection closed by peer")


def test_lost_time_and_goodput_from_the_ledger():
    # a step a second from iteration 0 to 10, a crash noticed 5 s later, back up 3 s after that,
    # training again 2 s later from the checkpoint at 6
    prev = Attempt(1, launch="a", process_start=0, group_up=1, resumed_iter=0, training=2,
                   last_iter=10, last_alive=12, end=17, reason="crash", noticed_by="next_start")
    cur = Attempt(2, launch="a", restart_count=1, process_start=17, group_up=20, resumed_iter=6,
                  training=22, last_iter=20, last_alive=36, end=36, reason="finished",
                  noticed_by="end_record")
    lost = lost_between(prev, cur)
    assert lost == {"detection_s": 5, "restart_s": 3, "reload_s": 2, "recomputed_s": 4,
                    "recomputed_iters": 4, "lost_s": 14}
    g = goodput([prev, cur])
    # productive: 6 kept steps of the first (6 s) and 14 of the second (14 s); wall 0 → 36
    assert (g["productive_s"], g["wall_s"], g["restarts"]) == (20, 36, 1)
    assert g["effective_training"] == round(20 / 36, 4) and g["restart_lost_s"] == 14
    # a rollback in the second attempt: 16 steps in its 16 s loop, 2 of them trained again, 14 kept
    rolled = dataclasses.replace(cur, training=20, trained=16)
    assert goodput([prev, rolled])["productive_s"] == 6 + 14
