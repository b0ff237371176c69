"""Pre-flight check of a config before a long run: train a little, checkpoint, resume, and report.

    python tools/preflight.py --config configs/tiny.yaml                         # 100 iterations
    python tools/preflight.py --config configs/llama3_8b.yaml --nproc-per-node 8 --iters 50 \\
        --min-tokens-per-sec 60000 --max-memory-gb 75 --layouts
    python tools/preflight.py --config configs/tiny.yaml --train.precision bf16   # any config override
    python tools/preflight.py --config configs/llama3_8b.yaml --nproc-per-node 8 --world-size 64  # + 64 simulated

It trains the config (with its overrides) for ``--iters`` steps through the real entry point
(``python -m megapretrain.train``, or torchrun with ``--nproc-per-node`` > 1) in
``RUN_DIR/preflight/full``, saving a checkpoint at the midpoint; then a second run in
``RUN_DIR/preflight/resume`` starts from that checkpoint and trains the second half again. The
learning-rate schedule is the config's own (``schedule.decay_iters`` stays that of the full run), so
these are the first steps of the real run. Then it checks:

    training runs      the full run exits 0 and logs every step
    loss falls         the loss drops by more than 3σ of its noise, with no spike and no rollback
    grad norm          every step's grad norm (before clipping) is within [0.1, 10]
    lr schedule        the logged lr equals LRSchedule (megapretrain.optim.lr_schedule) at every step
    checkpoint         the midpoint checkpoint was saved, complete and with valid checksums
    resume             the resumed run's losses equal the uninterrupted ones (bitwise or within 1e-6)
    throughput         median tokens/s ≥ --min-tokens-per-sec (reported, not checked, without it)
    memory             peak memory ≤ the device's (or --max-memory-gb)
    layouts            (--layouts) tools/smoke_test.py: every parallel layout (cp ones included)
                       matches one process
    production layout  (--world-size N) the config's layout on N GPUs, one rank of every role simulated
                       with the trainer's own program (tools/simulate.py): each peak plus the planner's
                       allowance fits the GPU (--gpu, or --max-memory-gb); the planner within 5%

and writes ``RUN_DIR/preflight/report.md`` — the checks with measured values, pass/fail and what to
do on failure — with loss.png, grad_norm.png, lr.png and throughput.png beside it. The exit status
is 0 when every check passes, 1 when one fails (stderr names each), 2 on bad input. An existing
``RUN_DIR/preflight`` is never overwritten without ``--overwrite``; RUN_DIR itself is not touched.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from megapretrain.cli import non_negative_float, positive_float, positive_int, progress_bar, user_errors
from megapretrain.config import Config, ConfigError, check_output_dirs, load_config
from megapretrain.errors import UserError
from megapretrain.monitor.flops import DEVICES
from megapretrain.monitor.metrics import read_metrics, training_records
from megapretrain.optim.lr_schedule import LRSchedule
from megapretrain.resolve import resolve

# the directory holding the megapretrain package (a checkout's root): the PYTHONPATH of the runs it starts
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GRAD_NORM_RANGE = (0.1, 10.0)
NOISE_SIGMAS = 3.0  # the loss must fall by more than this many standard deviations of its noise
SPIKE_RATIO = 1.5  # a loss above this × the mean of the previous steps is a spike
LR_RTOL = 1e-6


@dataclass
class Check:
    name: str
    ok: bool | None  # None: not checked (nothing to compare with, or an earlier step failed)
    measured: str
    required: str
    fix: str

    @property
    def result(self) -> str:
        return {True: "PASS", False: "**FAIL**", None: "not checked"}[self.ok]


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


# ----------------------------------------------------------------------------------------------
# Input


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--config", required=True, help="YAML config; --section.key VALUE overrides follow")
    ap.add_argument("--iters", type=positive_int, default=100, help="iterations of the full run (default 100)")
    ap.add_argument("--nproc-per-node", type=positive_int, default=1, help="ranks (torchrun when > 1)")
    ap.add_argument("--min-tokens-per-sec", type=positive_float, help="required median throughput")
    ap.add_argument("--max-memory-gb", type=positive_float, help="peak memory allowed (default: the device's)")
    ap.add_argument("--layouts", nargs="?", const="auto", metavar="SPEC",
                    help="also run tools/smoke_test.py's layout checks (optionally its --layouts SPEC, "
                         "e.g. 'tp=2,cp=2,sp=1; cp=2,pp=2')")
    ap.add_argument("--resume-tolerance", type=non_negative_float, default=1e-6, help="largest |Δloss| after resuming")
    ap.add_argument("--timeout-s", type=positive_float, help="stop a training run that takes longer")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing RUN_DIR/preflight")
    ap.add_argument("--world-size", type=positive_int, metavar="N",
                    help="also simulate the layout on N GPUs, as the run will be launched (tools/simulate.py)")
    ap.add_argument("--gpu", default="h100", choices=sorted(DEVICES), help="the GPUs of --world-size (default h100)")
    args, overrides = ap.parse_known_args(argv)
    if args.iters < 4:
        raise UserError(f"--iters {args.iters}: a pre-flight needs at least 4 iterations (default 100)")
    return args, overrides


def load(args: argparse.Namespace, overrides: list[str]) -> tuple[Config, int, int]:
    """The validated config (vocabulary filled from the tokenizer), its schedule's decay_iters and
    the tokenizer's vocabulary size."""
    from megapretrain.data.checks import resolve_vocab

    cfg = load_config(args.config, overrides)
    tokenizer_vocab = resolve_vocab(cfg)
    sizes = resolve(cfg, args.nproc_per_node).sizes
    check_output_dirs(cfg)
    if not cfg.data.paths:
        raise ConfigError("data.paths is empty: set it to a prefix written by tools/preprocess_data.py")
    return cfg, sizes.decay_iters, tokenizer_vocab


def prepare_dir(cfg: Config, overwrite: bool, tokenizer_vocab: int) -> str:
    """A new RUN_DIR/preflight (the old one removed only with ``overwrite``), once the data is
    known to fit the model (the check's index cache goes inside, where the runs find it)."""
    from megapretrain.data.checks import check_data_matches_model

    out = os.path.join(cfg.run.dir, "preflight")
    if os.path.exists(out):
        if not overwrite:
            raise UserError(f"{out} exists (an earlier pre-flight); pass --overwrite to replace it, "
                            "or another --run.dir")
        shutil.rmtree(out)
    made_run_dir = not os.path.exists(cfg.run.dir)
    os.makedirs(out)
    try:
        check_data_matches_model(cfg.data.paths, cfg.data.tokenizer.type, tokenizer_vocab, cfg.model.vocab_size,
                                 data_cache(cfg, out))
    except UserError:
        shutil.rmtree(cfg.run.dir if made_run_dir else out)  # ours, just made: nothing blocks the next try
        raise
    return out


def data_cache(cfg: Config, out: str) -> str:
    """Where both runs keep their sample indices (built once): data.cache_dir, or inside ``out``."""
    return cfg.data.cache_dir or os.path.join(out, "data_cache")


# ----------------------------------------------------------------------------------------------
# The two training runs


def train_command(args, overrides: list[str], cfg: Config, decay_iters: int, run_dir: str, extra: list[str]):
    launcher = [sys.executable, "-m", "megapretrain.train"]
    if args.nproc_per_node > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node", str(args.nproc_per_node), "-m", "megapretrain.train"]
    cache = data_cache(cfg, os.path.dirname(run_dir))
    ours = ["--run.dir", run_dir, "--train.iters", str(args.iters), "--schedule.decay_iters", str(decay_iters),
            "--logging.interval", "1", "--logging.tensorboard", "false", "--logging.wandb", "false",
            "--checkpoint.keep_last", "0", "--checkpoint.keep_every", "0", "--checkpoint.interval_minutes", "0",
            "--checkpoint.milestone_fraction", "0", "--data.cache_dir", cache]
    if cfg.train.train_tokens is not None:
        ours += ["--train.train_tokens", "null"]  # the run's length is --iters here
    return [*launcher, "--config", args.config, *overrides, *ours, *extra]


def run_training(run: Run, timeout_s: float | None, iters: int | None = None) -> Run:
    """Run ``run.command`` (its output to ``run.log``), showing its logged iterations out of
    ``iters`` on a terminal; stopped after ``timeout_s``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    print(f"preflight: {run.name} run -> {run.directory} (log {run.log})", flush=True)
    start = time.monotonic()
    with open(run.log, "w") as log:
        # its own process group, so a timeout stops torchrun's workers too
        proc = subprocess.Popen(run.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
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
    """``proc``'s exit status; meanwhile a progress bar follows the iterations its metrics.jsonl logs."""
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
                complete = new[:new.rfind(b"\n") + 1]  # a line still being written waits for the next look
                seen += len(complete)
                logged = [r.get("iter", 0) for r in map(json.loads, complete.splitlines()) if "loss" in r]
                bar.update(max([bar.n, *logged]) - bar.n)
            time.sleep(0.5)
    return status


# ----------------------------------------------------------------------------------------------
# Checks


def check_ran(run: Run, iters: int) -> Check:
    missing = [it for it in range(1, iters + 1) if it not in run.steps()]
    ok = run.returncode == 0 and not missing
    measured = (f"exit {run.returncode}, {iters - len(missing)} of {iters} steps logged in {run.seconds:.0f} s"
                if run.returncode is not None else f"stopped after {run.seconds:.0f} s (--timeout-s)")
    if not ok:
        measured += f"; {run.last_error()}"
    return Check("training runs", ok, measured, f"exit 0, all {iters} steps in metrics.jsonl",
                 f"read {os.path.basename(run.log)}: its last lines name the error")


def check_loss(run: Run) -> Check:
    trained = training_records(run.records)  # in the order trained, steps redone after a rollback included
    losses = [r["loss"] for r in trained]
    finite_steps = [r for r in trained if isinstance(r["loss"], (int, float)) and math.isfinite(r["loss"])]
    finite = [r["loss"] for r in finite_steps]
    required = (f"drop > {NOISE_SIGMAS:g}σ of the noise, no step above {SPIKE_RATIO:g}× the mean of the "
                "10 before it, no rollback")
    fix = ("no fall: raise optim.lr or shorten schedule.warmup_iters, check the data (tools/inspect_data.py "
           "on data.paths)")
    spike_fix = ("a spike or rollback: look at the batch of that iteration (tools/inspect_data.py), lower "
                 "optim.lr or lengthen schedule.warmup_iters, check optim.clip_grad")
    if len(finite) < 4:
        return Check("loss falls", False, f"{len(finite)} finite losses", required, fix)
    k = max(2, len(finite) // 10)
    first, last = statistics.fmean(finite[:k]), statistics.fmean(finite[-k:])
    noise = _noise(finite[len(finite) // 2:])
    spikes = [finite_steps[i]["iter"] for i in range(3, len(finite))
              if finite[i] > SPIKE_RATIO * statistics.fmean(finite[max(0, i - 10):i])]
    rollbacks = [r["iter"] for r in run.records if r.get("event") == "rollback"]
    drop = first - last
    fell = drop > NOISE_SIGMAS * noise and drop > 0
    unstable = bool(spikes or rollbacks or len(finite) < len(losses))
    measured = f"{first:.4f} → {last:.4f} (mean of first/last {k} steps): drop {drop:.4f}, noise σ {noise:.4f}"
    if spikes:
        measured += f"; spike at iteration {', '.join(map(str, spikes[:5]))}"
    if rollbacks:
        measured += f"; rolled back at iteration {', '.join(map(str, rollbacks))}"
    if len(finite) < len(losses):
        measured += f"; {len(losses) - len(finite)} non-finite losses"
    fix = "; ".join(([] if fell else [fix]) + ([spike_fix] if unstable else []))
    return Check("loss falls", fell and not unstable, measured, required, fix)


def _noise(values: list[float]) -> float:
    """Standard deviation of ``values`` around their least-squares line (the trend removed)."""
    n = len(values)
    if n < 3:
        return 0.0
    xs = range(n)
    mx, my = (n - 1) / 2, statistics.fmean(values)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, values)) / sum((x - mx) ** 2 for x in xs)
    residuals = [y - (my + slope * (x - mx)) for x, y in zip(xs, values)]
    return statistics.pstdev(residuals)


def check_grad_norm(run: Run) -> Check:
    low, high = GRAD_NORM_RANGE
    norms = [(it, r["grad_norm"]) for it, r in sorted(run.steps().items())]
    outside = [(it, g) for it, g in norms if not isinstance(g, (int, float)) or not low <= g <= high]
    values = [g for _, g in norms if isinstance(g, (int, float))]
    measured = f"min {min(values):.3g}, max {max(values):.3g}" if values else "none logged"
    measured += f"; {len(outside)} of {len(norms)} steps outside"
    if outside:
        measured += " (" + ", ".join(f"iter {it}: {g if g is None else f'{g:.3g}'}" for it, g in outside[:4]) + ")"
    return Check("grad norm", bool(norms) and not outside, measured, f"within [{low:g}, {high:g}] at every step",
                 "above 10: lower optim.lr, lengthen schedule.warmup_iters, check optim.clip_grad and the init "
                 "(model.init_std); below 0.1: the model barely learns — check the lr and that the data varies")


def check_lr(runs: list[Run], schedule: LRSchedule) -> Check:
    compared, wrong, counts = 0, [], []
    for run in runs:
        counts.append(f"{len(run.steps())} {run.name}")
        for it, r in sorted(run.steps().items()):
            expected = schedule(it)
            compared += 1
            lr = r.get("lr")
            if not isinstance(lr, (int, float)) or not abs(lr - expected) <= LR_RTOL * max(expected, 1e-12):
                wrong.append(f"{run.name} iter {it}: {r.get('lr')} ≠ {expected:.6g}")
    measured = (f"{compared - len(wrong)} of {compared} steps match ({' + '.join(counts)})"
                + (f"; {'; '.join(wrong[:3])}" if wrong else ""))
    required = (f"{schedule.decay}: warmup {schedule.warmup_iters}, {schedule.lr:g} → {schedule.min_lr:g} at "
                f"{schedule.decay_iters} (relative error ≤ {LR_RTOL:g})")
    return Check("lr schedule", bool(compared) and not wrong, measured, required,
                 "the trainer's lr differs from the config's schedule: a rollback's recovery.lr_factor, or a bug "
                 "in the schedule; plot the intended one with tools/plot_schedule.py")


def check_checkpoint(run: Run, mid: int) -> tuple[Check, str]:
    from megapretrain.checkpoint.format import problem

    path = os.path.join(run.directory, "checkpoints", f"iter_{mid:07d}")
    saved = [r for r in run.records if r.get("event") == "checkpoint_saved" and r.get("iter") == mid]
    issue = problem(path) if os.path.isdir(path) else f"{path} does not exist"
    stall = saved[0].get("checkpoint_stall_s") if saved else None
    measured = (f"iter_{mid:07d} complete, checksums valid" if issue is None else issue)
    measured += f"; training blocked {stall:.2f} s" if isinstance(stall, (int, float)) else ""
    return Check("checkpoint", issue is None and bool(saved), measured,
                 f"saved at iteration {mid}, complete, CRC-32 valid",
                 "check free space and permissions under run.dir; read full.log for the save's error"), path


def check_resume(full: Run, resumed: Run, mid: int, iters: int, tol: float) -> Check:
    a, b = full.steps(), resumed.steps()
    required = f"iterations {mid + 1}–{iters}: losses equal (bitwise or |Δ| ≤ {tol:g}), a `resumed` event at {mid}"
    fix = ("the checkpoint misses some state (optimizer, RNG, data position): compare full/ and resume/ "
           "metrics.jsonl step by step; nondeterministic kernels also break this (train.compile, atomics)")
    if resumed.returncode != 0:
        return Check("resume", False, f"resumed run exit {resumed.returncode}: {resumed.last_error()}", required,
                     f"read {os.path.basename(resumed.log)}: its last lines name the error")
    started = [r for r in resumed.records if r.get("event") == "resumed"]
    steps = range(mid + 1, iters + 1)
    missing = [it for it in steps if it not in a or it not in b]
    diffs = [(it, _diff(a[it].get("loss"), b[it].get("loss"))) for it in steps if it in a and it in b]
    worst = max((d for _, d in diffs), default=float("inf"))
    bitwise = all(a[it].get(k) == b[it].get(k) for it, _ in diffs for k in ("loss", "grad_norm"))
    ok = not missing and bool(started) and started[0].get("iter") == mid and worst <= tol
    if bitwise and diffs:
        measured = f"{len(diffs)} steps bitwise equal (losses and grad norms)"
    else:
        first_off = next((it for it, d in diffs if d > tol), None)
        measured = f"max |Δloss| {worst:.3g} over {len(diffs)} steps"
        measured += f", first beyond {tol:g} at iteration {first_off}" if first_off else ""
    if missing:
        measured += f"; iterations {missing[0]}…{missing[-1]} missing"
    if not started or started[0].get("iter") != mid:
        measured += f"; resumed at {started[0].get('iter') if started else 'no'} `resumed` event"
    valid = [(r.get("valid_loss"), s.get("valid_loss")) for r, s in zip(_evals(full, mid), _evals(resumed, mid))]
    if valid:
        measured += "; valid loss " + ("equal" if all(x == y for x, y in valid) else "differs")
    return Check("resume", ok, measured, required, fix)


def _diff(x, y) -> float:
    """|x - y|; infinite when either is missing, or NaN (which would pass no comparison, nor fail one)."""
    if not isinstance(x, (int, float)) or not isinstance(y, (int, float)):
        return 0.0 if x == y else float("inf")
    d = abs(x - y)
    return d if math.isfinite(d) or (x == y) else float("inf")


def _evals(run: Run, after: int) -> list[dict]:
    return [r for r in run.records if "valid_loss" in r and r.get("iter", 0) > after]


def check_throughput(run: Run, minimum: float | None, iters: int) -> Check:
    warm = max(1, iters // 10)  # the first steps include start-up and compilation
    timed = [(it, r["tokens_per_sec"]) for it, r in sorted(run.steps().items())
             if it > warm and isinstance(r.get("tokens_per_sec"), (int, float))]
    rates = [rate for _, rate in timed]
    if not rates:
        return Check("throughput", False if minimum else None, "no tokens_per_sec logged",
                     f"median ≥ {minimum:,.0f} tokens/s" if minimum else "—", "read full.log")
    median = statistics.median(rates)
    measured = (f"median {median:,.0f} tokens/s (steps {timed[0][0]}–{timed[-1][0]}; range {min(rates):,.0f}–"
                f"{max(rates):,.0f})")
    mfus = [r["mfu"] for it, r in run.steps().items() if it > warm and isinstance(r.get("mfu"), (int, float))]
    measured += f", MFU {100 * statistics.median(mfus):.1f}%" if mfus else ""
    if minimum is None:
        return Check("throughput", None, measured, "— (give --min-tokens-per-sec)", "")
    return Check("throughput", median >= minimum, measured, f"median ≥ {minimum:,.0f} tokens/s",
                 "tools/plan.py for the expected speed of this layout; check data_time (slow storage), "
                 "parallel.recompute, micro_batch_size, model.kernels/optim.impl, and the interconnect")


def device_memory_gb(cfg: Config, nproc: int) -> tuple[float, str]:
    """What one rank may use: the GPU's memory, or on CPU the host's RAM shared by the ranks."""
    import torch

    if cfg.train.device != "cpu" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory / 2**30, f"{props.name} memory"
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return pages / 2**30 / nproc, f"host RAM / {_ranks(nproc)}"


def check_memory(runs: list[Run], cfg: Config, args) -> Check:
    peaks = [r["memory_mb"] for run in runs for r in training_records(run.records)
             if isinstance(r.get("memory_mb"), (int, float))]
    if args.max_memory_gb:
        limit, what = args.max_memory_gb, "--max-memory-gb"
    else:
        limit, what = device_memory_gb(cfg, args.nproc_per_node)
    if not peaks:
        return Check("memory", False, "no memory_mb logged", f"≤ {limit:.1f} GB ({what})", "read full.log")
    peak = max(peaks) / 1024
    return Check("memory", peak <= limit, f"peak {peak:.2f} GB on rank 0 ({100 * peak / limit:.0f}% of the limit)",
                 f"≤ {limit:.1f} GB ({what})",
                 "in this order: parallel.recompute selective/full, halve train.micro_batch_size, raise "
                 "parallel.zero or optim.offload, more parallel.tp/pp, parallel.cp for long sequences "
                 "(tools/plan.py estimates each)")


def check_layouts(args, cfg: Config, out: str) -> Check:
    """tools/smoke_test.py on ``--nproc-per-node`` ranks: each layout's losses against one process."""
    workdir = os.path.join(out, "layouts")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(args.nproc_per_node), "-m", "megapretrain.commands.smoke_test", "--workdir", workdir,
           "--layouts", args.layouts, "--precision", "bf16" if cfg.train.precision == "bf16" else "fp32"]
    run = run_training(Run("layouts", workdir, cmd), args.timeout_s)
    rows = []
    if os.path.exists(os.path.join(workdir, "smoke_test.json")):
        with open(os.path.join(workdir, "smoke_test.json")) as fh:
            rows = json.load(fh)["rows"]
    checked = [r for r in rows if r[1] != "skipped"]
    bad = [r[0] for r in checked if r[1] != "ok"]
    measured = (f"{len(checked) - len(bad)} of {len(checked)} layouts match one process"
                + (f"; differ: {', '.join(bad)}" if bad else "")
                + (f"; {len(rows) - len(checked)} skipped" if len(rows) > len(checked) else ""))
    if run.returncode != 0 and not rows:
        measured = f"smoke test exit {run.returncode}: {run.last_error()}"
    return Check("layouts", run.returncode == 0 and bool(checked), measured,
                 f"every layout of {args.nproc_per_node} ranks: losses within the smoke test's tolerance",
                 "layouts.log and layouts/smoke_test.json name the layout; rerun tools/smoke_test.py on it")


def check_production(args, overrides: list[str], cfg: Config, out: str) -> Check:
    """One rank of every role of the layout on ``--world-size`` GPUs, simulated on this machine
    (report in ``out/simulate``): each peak plus the planner's allowance within the GPU's memory."""
    import json

    from megapretrain.simulate.report import markdown

    from .simulate import simulate

    gpu = DEVICES[args.gpu]
    limit = args.max_memory_gb or gpu.memory_gb * (1 - gpu.spare)
    sim_args = argparse.Namespace(config=args.config, world_size=args.world_size, roles=True, rank=None, steps=1,
                                  device="cuda")
    vocab = ["--model.vocab_size", str(cfg.model.vocab_size)]  # as the tokenizer gave it
    start = time.perf_counter()
    try:
        doc = simulate(sim_args, overrides + vocab)
    except UserError as exc:
        return Check("production layout", False, f"{args.world_size} GPUs: {exc}", "the layout resolves",
                     "fix the config for that world size (tools/plan.py --layout config shows the layout)")
    if doc["warnings"]:  # the launch itself would be refused (a ramp-up's batch at this size)
        return Check("production layout", False, f"{args.world_size} GPUs: {doc['warnings'][0]}",
                     "the layout resolves", "fix the config for that world size (tools/plan.py --layout config "
                     "shows the layout)")
    os.makedirs(os.path.join(out, "simulate"), exist_ok=True)
    with open(os.path.join(out, "simulate", "report.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    with open(os.path.join(out, "simulate", "report.md"), "w") as fh:
        fh.write(markdown(doc))
    worst = max(doc["ranks"], key=lambda r: r["peak_bytes"])
    need = worst["peak_bytes"] / 2**30 + gpu.overhead_gb
    off = [r["rank"] for r in doc["ranks"]
           if abs(r["planned_peak_bytes"] - r["peak_bytes"]) > 0.05 * r["peak_bytes"]]
    measured = (f"{args.world_size} GPUs, {len(doc['ranks'])} roles in {time.perf_counter() - start:.0f} s: "
                f"peak {worst['peak_bytes'] / 2**30:.1f} GiB on rank {worst['rank']} ({worst['role']}) + "
                f"{gpu.overhead_gb:g} GiB allowance" + (f"; planner off by > 5% on ranks {off}" if off else ""))
    return Check("production layout", need <= limit and not off, measured,
                 f"≤ {limit:.1f} GB ({'--max-memory-gb' if args.max_memory_gb else gpu.name})",
                 "simulate/report.md breaks each peak down; tools/plan.py --layout config --simulate 1 compares "
                 "with the planner; lower the peak as for the memory check")


# ----------------------------------------------------------------------------------------------
# Report


def write_plots(out: str, full: Run, resumed: Run, schedule: LRSchedule, minimum: float | None) -> list[str]:
    """loss.png, grad_norm.png, lr.png and throughput.png in ``out``; returns their file names."""
    from megapretrain.monitor.plots import OVER, UNDER, events, plot_lines, series

    a, b = training_records(full.records), training_records(resumed.records)
    # the resumed run's losses equal the full run's: the full run is drawn wide and pale under them
    marks = events(full.records) + [m for m in events(resumed.records) if m.name == "resumed"]
    its = sorted(full.steps())
    plots = {
        "loss.png": ("loss", [("full run", *series(a, "loss"), UNDER),
                              ("resumed at the midpoint", *series(b, "loss"), OVER)], {"ylabel": "loss"}),
        "grad_norm.png": ("grad norm (before clipping)", [("grad norm", *series(a, "grad_norm"))],
                          {"log": True, "band": GRAD_NORM_RANGE}),
        "lr.png": ("learning rate", [("expected (LRSchedule)", its, [schedule(it) for it in its], UNDER),
                                     ("logged", *series(a, "lr"), OVER)], {}),
        "throughput.png": ("throughput", [("tokens/s", *series(a, "tokens_per_sec"))],
                           {"ylabel": "tokens/s", "hline": minimum}),
    }
    written = []
    for name, (title, lines, options) in plots.items():
        lines = [line for line in lines if line[1]]
        if lines:
            plot_lines(os.path.join(out, name), title, lines, marks=marks, **options)
            written.append(name)
    return written


def _ranks(n: int) -> str:
    return f"{n} rank" + ("s" if n > 1 else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def write_report(out: str, args, overrides: list[str], cfg: Config, checks: list[Check], runs: list[Run],
                 plots: list[str]) -> str:
    failed = [c for c in checks if c.ok is False]
    unchecked = [c.name for c in checks if c.ok is None]
    verdict = (f"**FAILED** — {len(failed)} of {len(checks)} checks: {', '.join(c.name for c in failed)}"
               if failed else f"**PASSED** — all {len(checks) - len(unchecked)} checks"
                              + (f" ({', '.join(unchecked)} not checked)" if unchecked else ""))
    mid = args.iters // 2
    lines = [f"# Pre-flight report: `{args.config}`", "", verdict, "",
             f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')} · {args.iters} iterations on {_ranks(args.nproc_per_node)}, "
             f"a checkpoint at {mid} and a resume from it · model {cfg.model.num_layers} layers × "
             f"{cfg.model.hidden_size} · layout tp {cfg.parallel.tp} cp {cfg.parallel.cp} pp {cfg.parallel.pp} "
             f"zero {cfg.parallel.zero} "
             f"· {cfg.train.precision} · {cfg.train.global_batch_size} × {cfg.train.seq_length} tokens per step",
             "", "| check | result | measured | required | if it fails |", "|---|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c.name} | {c.result} | {_cell(c.measured)} | {_cell(c.required)} | "
                     f"{_cell(c.fix) if c.ok is False else ''} |")
    if plots:
        lines += ["", "## Plots", "", " ".join(f"![{p[:-4]}]({p})" for p in plots)]
    noted = [r for run in runs for r in run.records if r.get("event") in ("alert", "rollback", "skipped_step")]
    if noted:
        lines += ["", "## Events during the runs", ""] + [f"- {_event(r)}" for r in noted[:30]]
    lines += ["", "## Runs", ""]
    for run in runs:
        lines += [f"- **{run.name}**: `{os.path.basename(run.directory)}/` (metrics.jsonl, checkpoints), log "
                  f"`{os.path.basename(run.log)}`, exit {run.returncode}, {run.seconds:.0f} s",
                  "", "  <details><summary>command</summary>", "",
                  f"  `{' '.join(shlex.quote(a) for a in run.command)}`", "", "  </details>", ""]
    path = os.path.join(out, "report.md")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return path


def _event(record: dict) -> str:
    """``iter 10: alert throughput (state start, drop 0.265)``: an event line of the report."""
    fields = {k: v for k, v in record.items() if k not in ("iter", "event", "time", "kind")}
    detail = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items()
                       if not isinstance(v, (dict, list)))
    return (f"iter {record.get('iter')}: {record['event']}" + (f" {record['kind']}" if "kind" in record else "")
            + (f" ({detail})" if detail else ""))


# ----------------------------------------------------------------------------------------------
# Main


def run_checks(args, overrides: list[str], cfg: Config, decay_iters: int, out: str) -> tuple[list[Check], list]:
    mid = args.iters // 2
    schedule = LRSchedule.from_config(cfg, decay_iters)
    full_dir, resume_dir = os.path.join(out, "full"), os.path.join(out, "resume")
    full = run_training(Run("full", full_dir, train_command(args, overrides, cfg, decay_iters, full_dir,
                                                            ["--checkpoint.interval", str(mid)])), args.timeout_s,
                        args.iters)
    checks = [check_ran(full, args.iters)]
    runs = [full]
    if not full.steps():
        later = ("loss falls", "grad norm", "lr schedule", "checkpoint", "resume", "throughput", "memory")
        checks += [Check(name, None, "the full run logged no steps", "", "") for name in later]
        return checks, runs
    checks += [check_loss(full), check_grad_norm(full)]
    ckpt_check, ckpt = check_checkpoint(full, mid)
    resumed = Run("resume", resume_dir, [])
    if ckpt_check.ok:
        resumed.command = train_command(args, overrides, cfg, decay_iters, resume_dir,
                                        ["--checkpoint.load", ckpt, "--checkpoint.finetune", "false",
                                         "--checkpoint.load_optimizer", "true", "--checkpoint.load_rng", "true",
                                         "--checkpoint.interval", "0"])
        run_training(resumed, args.timeout_s, args.iters)
        runs.append(resumed)
    checks += [check_lr(runs, schedule), ckpt_check]
    checks.append(check_resume(full, resumed, mid, args.iters, args.resume_tolerance) if ckpt_check.ok
                  else Check("resume", None, "no checkpoint to resume from", "", ""))
    checks += [check_throughput(full, args.min_tokens_per_sec, args.iters), check_memory(runs, cfg, args)]
    if args.layouts:
        checks.append(check_layouts(args, cfg, out))
    if args.world_size:
        checks.append(check_production(args, overrides, cfg, out))
    return checks, runs


@user_errors
def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    if args.layouts and args.nproc_per_node < 2:
        raise UserError("--layouts compares parallel layouts with one process: it needs --nproc-per-node ≥ 2")
    cfg, decay_iters, tokenizer_vocab = load(args, overrides)
    out = prepare_dir(cfg, args.overwrite, tokenizer_vocab)
    checks, runs = run_checks(args, overrides, cfg, decay_iters, out)
    full = runs[0]
    resumed = runs[1] if len(runs) > 1 else Run("resume", "", [])
    plots = write_plots(out, full, resumed, LRSchedule.from_config(cfg, decay_iters), args.min_tokens_per_sec)
    report = write_report(out, args, overrides, cfg, checks, runs, plots)
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"  {c.name:<{width}}  {c.result.strip('*'):<11}  {c.measured}")
    failed = [c for c in checks if c.ok is False]
    for c in failed:
        print(f"preflight: FAILED {c.name}: {c.measured} (required: {c.required})", file=sys.stderr)
    checked = [c for c in checks if c.ok is not None]
    print(f"preflight: {'FAILED' if failed else 'PASSED'} {len(checked) - len(failed)} of {len(checked)} checks "
          f"({len(checks) - len(checked)} not checked) in {time.monotonic() - started:.0f} s; report: {report}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
