"""The pre-flight's training subprocesses (``tools/preflight.py``): the command of each run, and
running it with its output in a log beside its directory and a progress bar of its iterations."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from megapretrain.cli import progress_bar
from megapretrain.config import Config
from megapretrain.monitor.metrics import read_metrics, training_records

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Run:
    """One training subprocess of the pre-flight: where it ran, how it ended, what it logged."""
    name: str
    directory: str
    command: list[str]
    returncode: int | None = None
    seconds: float = 0.0
    records: list[dict] = field(default_factory=list)

    @property
    def log(self) -> str:
        return self.directory + ".log"

    def steps(self) -> dict[int, dict]:
        """The last training line of each iteration (a rollback trains some twice)."""
        return {r["iter"]: r for r in training_records(self.records)}

    def last_error(self) -> str:
        if not os.path.exists(self.log):
            return "no log"
        with open(self.log, errors="replace") as fh:
            lines = [line.strip() for line in fh if line.strip()]
        errors = [line for line in lines if line.startswith("error:")]
        return (errors or lines or ["(empty log)"])[-1][:300]


def rank_count(n: int) -> str:
    return f"{n} rank" + ("s" if n > 1 else "")


def data_cache(cfg: Config, out: str) -> str:
    """Where both runs keep their sample indices (built once): data.cache_dir, or inside ``out``."""
    return cfg.data.cache_dir or os.path.join(out, "data_cache")


def train_command(args, overrides: list[str], cfg: Config, decay_iters: int, run_dir: str,
                  extra: list[str]):
    launcher = [sys.executable, "-m", "megapretrain.train"]
    if args.nproc_per_node > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node", str(args.nproc_per_node), "-m", "megapretrain.train"]
    cache = data_cache(cfg, os.path.dirname(run_dir))
    ours = ["--run.dir", run_dir, "--train.iters", str(args.iters), "--schedule.decay_iters",
            str(decay_iters), "--logging.interval", "1", "--logging.tensorboard", "false",
            "--logging.wandb", "false", "--checkpoint.keep_last", "0", "--checkpoint.keep_every",
            "0", "--checkpoint.interval_minutes", "0", "--checkpoint.milestone_fraction", "0",
            "--data.cache_dir", cache]
    if cfg.train.train_tokens is not None:
        ours += ["--train.train_tokens", "null"]  # the run's length is --iters here
    return [*launcher, "--config", args.config, *overrides, *ours, *extra]


def run_training(run: Run, timeout_s: float | None, iters: int | None = None) -> Run:
    """Run ``run.command`` (its output to ``run.log``), showing its logged iterations out of
    ``iters`` on a terminal; stopped after ``timeout_s``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    print(f"preflight: {run.name} run -> {run.directory} (log {run.log})", flush=True)
    start = time.monotonic()
    with open(run.log, "w") as log:
        # its own process group, so a timeout stops torchrun's workers too
        proc = subprocess.Popen(run.command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            run.returncode = _wait(proc, run, timeout_s, iters)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.write(f"error: preflight stopped this run after --timeout-s {timeout_s:g}\n")
        except BaseException:  # Ctrl-C: take the run down with us
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    run.seconds = time.monotonic() - start
    if os.path.exists(os.path.join(run.directory, "metrics.jsonl")):
        run.records = read_metrics(run.directory)
    return run


def _wait(proc: subprocess.Popen, run: Run, timeout_s: float | None, iters: int | None) -> int:
    """``proc``'s exit status; meanwhile a progress bar follows the iterations its metrics.jsonl
    logs."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    metrics, seen = os.path.join(run.directory, "metrics.jsonl"), 0
    with progress_bar(iters, f"preflight {run.name}", unit="it") as bar:
        while (status := proc.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(run.command, timeout_s)
            if iters and os.path.exists(metrics):
                with open(metrics, "rb") as fh:
                    fh.seek(seen)
                    new = fh.read()
                # a line still being written waits for the next look
                complete = new[:new.rfind(b"\n") + 1]
                seen += len(complete)
                logged = [r.get("iter", 0) for r in map(json.loads, complete.splitlines())
                          if "loss" in r]
                bar.update(max([bar.n, *logged]) - bar.n)
            time.sleep(0.5)
    return status
