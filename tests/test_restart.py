"""A run that restarts itself: a rank that hangs under run_scripts/launch.sh is stopped by the
watchdog, torchrun restarts the job, the drill does not fire again, and the run ends on the losses of
an uninterrupted run (2 CPU ranks); the same crash on every attempt stops the third (a crash
loop)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "run_scripts", "launch.sh")
TINY = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_heads", "4", "--model.num_kv_heads", "2",
        "--model.ffn_hidden_size", "128", "--train.seq_length", "32", "--train.micro_batch_size", "2",
        "--train.global_batch_size", "4", "--logging.tensorboard", "false", "--optim.lr", "3e-3",
        "--train.eval_interval", "0", "--train.iters", "8", "--checkpoint.interval", "2",
        "--schedule.warmup_iters", "2", "--logging.interval", "1", "--watchdog.timeout_s", "25"]


def _launch(run_dir, corpus, *extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in ("NNODES", "NODE_RANK")}
    env.update(PYTHON=sys.executable, PYTHONPATH=ROOT, NPROC_PER_NODE="2", MAX_RESTARTS="3", OMP_NUM_THREADS="1")
    return subprocess.Popen(["bash", LAUNCH, os.path.join(ROOT, "configs", "tiny.yaml"), "--run.dir", str(run_dir),
                             "--data.paths", f"[{corpus}]", *TINY, *extra], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _losses(run_dir) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    return {r["iter"]: r["loss"] for r in rows if "loss" in r and "event" not in r}  # the later value of each


@pytest.mark.slow  # a 25 s hang, a restart and a second run: about 90 s
def test_a_hang_under_launch_sh_restarts_and_ends_on_the_uninterrupted_losses(tmp_path, corpus):
    hung, straight = tmp_path / "hung", tmp_path / "straight"
    procs = [_launch(hung, corpus, "--faults.hang_at", "5", "--faults.rank", "1"), _launch(straight, corpus)]
    (out, err), (_, straight_err) = (p.communicate(timeout=900) for p in procs)
    (tmp_path / "hung.log").write_text(out + err)
    assert procs[1].returncode == 0, straight_err[-3000:]
    assert procs[0].returncode == 0, err[-3000:]
    assert json.loads((hung / "hang" / "rank1.txt").read_text().splitlines()[0])["iter"] == 5
    assert "faults.hang_at=5 (rank 1): fired already in this run directory" in out  # the restarted job goes on past it
    with open(hung / "metrics.jsonl") as fh:
        resumed = [json.loads(line)["iter"] for line in fh if '"event": "resumed"' in line]
    assert resumed == [4]
    with open(hung / "metrics.jsonl") as fh:
        rows = [r for r in map(json.loads, fh) if r.get("event") in ("restart", "summary")]
    (restart,), (summary,) = ([r for r in rows if r["event"] == name]
                              for name in ("restart", "summary"))
    # rank 0 hung too (its watchdog's report) or saw its peer's exit (an error it caught)
    assert restart["attempt"] == 2 and restart["after"] in ("hang", "exception"), restart
    assert restart["resumed_iter"] == 4
    assert restart["recomputed_iters"] == restart["previous_last_iter"] - 4
    assert restart["same_launch"]
    assert min(restart[k] for k in ("detection_s", "restart_s", "reload_s")) >= 0
    assert summary["restarts"] == 1 and 0 < summary["effective_training"] < 1
    assert sorted(_losses(hung)) == list(range(1, 9)) and _losses(hung) == _losses(straight)


@pytest.mark.slow  # three attempts under torchrun: about 40 s
def test_the_same_crash_on_every_attempt_stops_the_third_with_status_6(tmp_path, corpus):
    run = tmp_path / "loop"
    proc = _launch(run, corpus, "--faults.exit_at", "5", "--faults.rank", "1",
                   "--faults.every_attempt", "true")
    out, err = proc.communicate(timeout=900)
    (tmp_path / "loop.log").write_text(out + err)
    assert proc.returncode != 0
    assert "error: crash loop: attempts 1 and 2 both failed after iteration 4" in out + err
    with open(run / "attempts.jsonl") as fh:
        ledger = [json.loads(line) for line in fh]
    ends = {r["attempt"]: r["reason"] for r in ledger if r["record"] == "end"}
    assert not [r for r in ledger if r["attempt"] >= 3 and r["record"] not in ("start", "end")]
    # rank 0 sees its peer's exit as an error it catches, or is stopped by torchrun first
    assert ends[1] in ("exception", "crash") and ends[2] in ("exception", "crash")
    assert ends[3] == "crash_loop"
