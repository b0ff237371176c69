"""A run's length and learning rate across resumes: a token budget from the command line over any
shipped config, a resumed run that keeps the schedule it was trained with (an extension continues at
min_lr or re-warms by request, any change of rate is one warning), and a resume with nothing left to
train refused in one line."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest

from megapretrain.config import load_config
from megapretrain.resolve import resolve
from megapretrain.train import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
TINY = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_heads", "4", "--model.num_kv_heads", "2",
        "--model.ffn_hidden_size", "128", "--train.seq_length", "32", "--train.micro_batch_size", "2",
        "--train.global_batch_size", "4", "--logging.tensorboard", "false", "--optim.lr", "3e-3",
        "--optim.min_lr", "3e-4", "--train.eval_interval", "0", "--checkpoint.interval", "0"]


def _train(run_dir, corpus, *extra) -> int:
    return main(["--run.dir", str(run_dir), "--data.paths", f"[{corpus}]", *TINY, *extra])


def _steps(run_dir) -> dict[int, dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    return {r["iter"]: r for r in rows if "loss" in r and "event" not in r}  # the later one of each iteration


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p)[:-5] for p in CONFIGS])
def test_a_token_budget_from_the_command_line_over_every_shipped_config(path):
    with open(path) as fh:
        found = re.search(r"for (\d+) GPUs", fh.readline())
    world = int(found.group(1)) if found else 1
    vocab = ["--model.vocab_size", "257"]  # where the config reads it from its tokenizer (tiny: ByteTokenizer's)
    shipped = resolve(load_config(path, vocab), world).sizes
    budget = shipped.total_tokens + 1  # one token more than the config's train.iters steps train
    flags = [*vocab, "--train.iters", "null", "--train.train_tokens", str(budget)]
    sizes = resolve(load_config(path, flags), world).sizes
    assert sizes.iters == shipped.iters + 1 and sizes.total_tokens == shipped.total_tokens + sizes.tokens_per_batch


def test_a_token_budget_over_a_config_that_sets_iters_says_how(tmp_path, corpus, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  iters: 50\n")
    assert main(["--config", str(config), "--run.dir", str(tmp_path / "r"), "--data.paths", f"[{corpus}]", *TINY,
                 "--train.train_tokens", "2000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--train.iters null --train.train_tokens 2000" in err
    assert main(["--config", str(config), "--run.dir", str(tmp_path / "r"), "--data.paths", f"[{corpus}]", *TINY,
                 "--train.iters", "null"]) == 2
    assert "train.iters and train.train_tokens are both null" in capsys.readouterr().err
    assert main(["--config", str(config), "--run.dir", str(tmp_path / "r"), "--data.paths", f"[{corpus}]", *TINY,
                 "--train.iters", "null", "--train.train_tokens", "600"]) == 0
    assert sorted(_steps(tmp_path / "r")) == [1, 2, 3, 4, 5]  # 4 × 32 = 128 tokens a step: 5 steps reach 640


def test_extending_a_finished_run_continues_at_min_lr_and_a_rewarm_is_asked_for(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    assert _train(run, corpus, "--train.iters", "8") == 0
    assert _steps(run)[8]["lr"] == pytest.approx(3e-4)
    capsys.readouterr()
    assert _train(run, corpus, "--train.iters", "12") == 0  # the quickstart's "train further"
    out, err = capsys.readouterr()
    assert all(_steps(run)[i]["lr"] == pytest.approx(3e-4) for i in range(9, 13))  # no jump back up
    assert "continues at 0.0003" in out and "warning: the learning rate" not in err
    assert _train(run, corpus, "--train.iters", "20", "--schedule.rewarm_iters", "4") == 0
    lrs = [_steps(run)[i]["lr"] for i in range(13, 21)]
    assert lrs[:4] == pytest.approx([3e-4 + (3e-3 - 3e-4) * k / 4 for k in (1, 2, 3, 4)])
    assert lrs[-1] == pytest.approx(3e-4) and lrs[4:] == sorted(lrs[4:], reverse=True)
    assert "re-warming from iteration 12" in capsys.readouterr().out


def test_a_changed_rate_at_a_resume_is_one_warning_with_the_rate_before_and_after(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    assert _train(run, corpus, "--train.iters", "4", "--schedule.decay_iters", "8") == 0
    capsys.readouterr()
    assert _train(run, corpus, "--train.iters", "8", "--schedule.decay_iters", "8", "--optim.lr", "1e-3") == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "learning rate changes" in line]
    assert len(warnings) == 1
    expected = _steps(run)[5]["lr"]
    assert f"iteration 5 trains at {expected:.4g} instead of" in warnings[0]
    assert "cosine 0.003 → 0.0003 at 8" in warnings[0]


def test_resuming_with_nothing_left_to_train_is_refused(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    assert _train(run, corpus, "--train.iters", "4") == 0
    lines = len(open(run / "metrics.jsonl").readlines())
    capsys.readouterr()
    assert _train(run, corpus, "--train.iters", "2") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing to do: train.iters=2 is below iteration 4" in err
    assert _train(run, corpus, "--train.iters", "4") == 2
    assert "has finished its train.iters=4" in capsys.readouterr().err
    assert len(open(run / "metrics.jsonl").readlines()) == lines  # nothing written
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_0000004", "latest"]
