"""Time in a run: durations in a person's units, the elapsed time and the estimate on every training
line (console and metrics.jsonl), and the closing summary (tokens, time, validation loss, checkpoints,
where everything is; no TensorBoard directory when TensorBoard is off)."""

from __future__ import annotations

import json
import os
import re

import pytest

from megapretrain.monitor.progress import Progress, human_duration
from megapretrain.train import main

TINY = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_heads", "4", "--model.num_kv_heads", "2",
        "--model.ffn_hidden_size", "128", "--train.seq_length", "32", "--train.micro_batch_size", "2",
        "--train.global_batch_size", "4", "--optim.lr", "3e-3"]


@pytest.mark.parametrize("seconds, words", [(0.4, "0 s"), (45, "45 s"), (14 * 60, "14 min"), (89 * 60, "89 min"),
                                            (3.2 * 3600, "3.2 h"), (2.5 * 86400, "2.5 days"),
                                            (float("nan"), "unknown")])
def test_durations_read_as_a_person_says_them(seconds, words):
    assert human_duration(seconds) == words


def test_the_estimate_follows_the_recent_pace_and_restarts_after_a_rollback():
    now = [100.0]
    progress = Progress(iters=100, clock=lambda: now[0])
    progress.start(0)
    assert progress.eta_s is None and progress.elapsed_s == 0
    for it in range(1, 11):  # 2 s a step
        now[0] += 2.0
        progress.step(it)
    assert progress.elapsed_s == 20.0 and progress.eta_s == pytest.approx(90 * 2.0)
    for it in range(11, 71):  # then 1 s a step: the window (the last 50 steps) forgets the slow start
        now[0] += 1.0
        progress.step(it)
    assert progress.eta_s == pytest.approx(30 * 1.0)
    now[0] += 1.0
    progress.step(60)  # rolled back: the pace restarts from here
    assert progress.eta_s is None and progress.elapsed_s == 81.0


def test_every_training_line_has_the_time_and_the_run_ends_with_a_summary(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    assert main(["--run.dir", str(run), "--data.paths", f"[{corpus}]", *TINY, "--train.iters", "6",
                 "--train.eval_interval", "3", "--train.eval_iters", "1", "--checkpoint.interval", "3",
                 "--logging.tensorboard", "false"]) == 0
    out = capsys.readouterr().out
    with open(run / "metrics.jsonl") as fh:
        records = [json.loads(line) for line in fh]
    steps = [r for r in records if "loss" in r and "event" not in r]
    assert len(steps) == 6 and all(r["elapsed_s"] >= 0 and r["eta_s"] >= 0 for r in steps)
    assert [r["elapsed_s"] for r in steps] == sorted(r["elapsed_s"] for r in steps) and steps[-1]["eta_s"] == 0
    lines = [line for line in out.splitlines() if re.match(r"iter +\d+/6 \|", line)]
    assert len(lines) == 6 and all(re.search(r"\| elapsed \d+ s \| ETA \d+ s \(\d\d:\d\d\)$", line) for line in lines)

    summary, = [r for r in records if r.get("event") == "summary"]
    valid = {r["iter"]: r["valid_loss"] for r in records if "valid_loss" in r}
    assert sorted(valid) == [3, 6]  # the eval lines only: the summary holds no eval line's key
    assert summary["trained_tokens"] == summary["run_tokens"] == 6 * 4 * 32 and summary["seconds"] > 0
    assert summary["last_valid_iter"] == 6 and summary["last_valid_loss"] == valid[6]
    assert summary["best_valid_loss"] == min(valid.values())
    assert summary["checkpoints_written"] == [str(run / "checkpoints" / f"iter_000000{i}") for i in (3, 6)]
    assert summary["tensorboard"] is None and "tensorboard" not in out.split("done:")[1]
    closing = out.split("done:")[1]
    assert closing.startswith(" 6 steps (iterations 1-6), 768 tokens in ")
    assert f"validation loss {valid[6]:.4f}" in closing
    assert "2 checkpoints written" in closing and str(run / "metrics.jsonl") in closing

    assert main(["--run.dir", str(run), "--data.paths", f"[{corpus}]", *TINY, "--train.iters", "8",
                 "--train.eval_interval", "0", "--checkpoint.interval", "0", "--logging.tensorboard", "true"]) == 0
    closing = capsys.readouterr().out.split("done:")[1]
    assert closing.startswith(" 2 steps (iterations 7-8), 256 tokens in ") and "1,024 tokens in all" in closing
    assert re.search(r"tensorboard +" + re.escape(str(run / "tensorboard")), closing)
    assert os.path.isdir(run / "tensorboard")
