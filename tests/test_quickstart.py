"""run_scripts/quickstart.sh itself, at a tiny size: it builds the demo corpus, tokenizes it, trains
configs/tiny.yaml (its model, optimizer, schedule and alert thresholds; fewer, shorter steps here),
ends with the run's summary, and a healthy run like it raises no alert. It runs in a copy of the
checkout's layout in the test's directory (the scripts, with tools/, configs/, setup.py and .venv
linked), so it writes demo/ and runs/ there, not in the checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = ["--train.iters", "30", "--train.seq_length", "64", "--train.eval_interval", "15", "--train.eval_iters", "2",
         "--checkpoint.interval", "15", "--logging.interval", "1", "--logging.tensorboard", "false"]


def _checkout(tmp_path):
    """A directory laid out like the checkout, where quickstart.sh runs as it would there."""
    work = tmp_path / "checkout"
    (work / "run_scripts").mkdir(parents=True)
    for script in ("quickstart.sh", "env.sh"):
        shutil.copy(os.path.join(ROOT, "run_scripts", script), work / "run_scripts" / script)
    for name in ("tools", "configs", "setup.py", ".venv"):
        (work / name).symlink_to(os.path.join(ROOT, name))
    return work


@pytest.mark.slow  # about 90 s: the corpus, its tokenization and 30 steps of configs/tiny.yaml's model
@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, ".venv", "bin", "python")),
                    reason="quickstart.sh runs in the checkout's .venv (run_scripts/env.sh makes it)")
def test_quickstart_builds_tokenizes_trains_and_a_healthy_run_raises_no_alert(tmp_path):
    work = _checkout(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    done = subprocess.run(["bash", "run_scripts/quickstart.sh", *SHORT], cwd=work, capture_output=True, text=True,
                          env={**env, "DEMO_MB": "1", "OMP_NUM_THREADS": "2"}, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (work / "demo" / "corpus.jsonl").stat().st_size > 500_000
    assert (work / "demo" / "stdlib_text_document.idx").exists()
    with open(work / "runs" / "tiny" / "metrics.jsonl") as fh:
        records = [json.loads(line) for line in fh]
    steps = [r for r in records if "loss" in r and "event" not in r]
    assert len(steps) == 30 and steps[-1]["loss"] < steps[0]["loss"] - 1.0
    assert "done: 30 steps (iterations 1-30)" in done.stdout and "bash run_scripts/quickstart.sh --train.iters 600" \
        in done.stdout
    # the machine's load moves tokens/s: a throughput alert says the machine was busy, not the run unwell
    raised = [r for r in records
              if r.get("event") in ("alert", "straggler", "rollback") and r.get("kind") != "throughput"]
    assert raised == []


def test_env_sh_says_what_it_installs_before_the_long_install_and_only_once(tmp_path):
    """A first run installs torch and the dependencies for minutes: one line says so before it
    starts; a second run (the install stamp present) installs nothing and says nothing. A stand-in
    python in a stand-in .venv records the pip calls, so nothing is installed here."""
    work = tmp_path / "checkout"
    (work / "run_scripts").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "run_scripts", "env.sh"), work / "run_scripts" / "env.sh")
    shutil.copy(os.path.join(ROOT, "setup.py"), work / "setup.py")
    bin_dir = work / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "pip_calls"}\n')
    (bin_dir / "python").chmod(0o755)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    run = ["bash", "-c", f"source {work / 'run_scripts' / 'env.sh'}"]
    first = subprocess.run(run, capture_output=True, text=True, timeout=30)
    assert first.returncode == 0, first.stderr
    assert first.stderr.count("\n") == 1 and "installing torch" in first.stderr and "minutes" in first.stderr
    assert "torch==" in (tmp_path / "pip_calls").read_text()
    second = subprocess.run(run, capture_output=True, text=True, timeout=30)
    assert second.returncode == 0 and second.stderr == ""
    assert (tmp_path / "pip_calls").read_text().count("torch==") == 1
