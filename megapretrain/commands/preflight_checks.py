"""The pre-flight's checks (``tools/preflight.py``): each reads what the runs logged (or runs what
it checks: the layouts' smoke test, the production layout's simulation) and returns a :class:`Check`
— the measured value, what is required, and what to do when it fails."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

from megapretrain.config import Config
from megapretrain.errors import UserError
from megapretrain.monitor.flops import DEVICES
from megapretrain.monitor.metrics import training_records
from megapretrain.optim.lr_schedule import LRSchedule

from .preflight_runs import Run, rank_count, run_training

GRAD_NORM_RANGE = (0.1, 10.0)
GRAD_NORM_SPIKES = 20  # one step in this many may leave the range (a clipped spike)
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



def check_ran(run: Run, iters: int) -> Check:
    missing = [it for it in range(1, iters + 1) if it not in run.steps()]
    ok = run.returncode == 0 and not missing
    measured = (f"exit {run.returncode}, {iters - len(missing)} of {iters} steps logged in "
                f"{run.seconds:.0f} s"
                if run.returncode is not None else f"stopped after {run.seconds:.0f} s "
                                                   "(--timeout-s)")
    if not ok:
        measured += f"; {run.last_error()}"
    return Check("training runs", ok, measured, f"exit 0, all {iters} steps in metrics.jsonl",
                 f"read {os.path.basename(run.log)}: its last lines name the error")


def check_loss(run: Run) -> Check:
    # in the order trained, steps redone after a rollback included
    trained = training_records(run.records)
    losses = [r["loss"] for r in trained]
    finite_steps = [r for r in trained if isinstance(r["loss"], (int, float)) and
                    math.isfinite(r["loss"])]
    finite = [r["loss"] for r in finite_steps]
    required = (f"drop > {NOISE_SIGMAS:g}σ of the noise, no step above {SPIKE_RATIO:g}× the mean "
                "of the 10 before it, no rollback")
    fix = ("no fall: raise optim.lr or shorten schedule.warmup_iters, check the data "
           "(tools/inspect_data.py on data.paths)")
    spike_fix = ("a spike or rollback: look at the batch of that iteration "
                 "(tools/inspect_data.py), lower optim.lr or lengthen schedule.warmup_iters, check "
                 "optim.clip_grad")
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
    measured = f"{first:.4f} → {last:.4f} (mean of first/last {k} steps): drop {drop:.4f}, noise " \
               f"σ {noise:.4f}"
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
    """Every grad norm finite, and within GRAD_NORM_RANGE but for at most one step in
    GRAD_NORM_SPIKES: a lone spike early in training (a small model at its peak lr) is what
    ``optim.clip_grad`` is for and the loss check sees its effect; a run of them is not."""
    low, high = GRAD_NORM_RANGE
    norms = [(it, r["grad_norm"]) for it, r in sorted(run.steps().items())]
    finite = [isinstance(g, (int, float)) and math.isfinite(g) for _, g in norms]
    outside = [(it, g) for (it, g), ok in zip(norms, finite) if not ok or not low <= g <= high]
    allowed = len(norms) // GRAD_NORM_SPIKES
    values = [g for (_, g), ok in zip(norms, finite) if ok]
    measured = f"min {min(values):.3g}, max {max(values):.3g}" if values else "none logged"
    measured += f"; {len(outside)} of {len(norms)} steps outside ({allowed} allowed)"
    if outside:
        measured += " (" + ", ".join(f"iter {it}: {g if g is None else f'{g:.3g}'}" for it,
                                     g in outside[:4]) + ")"
    ok = bool(norms) and all(finite) and len(outside) <= allowed
    return Check("grad norm", ok, measured,
                 f"finite, and within [{low:g}, {high:g}] at all but 1 step in "
                 f"{GRAD_NORM_SPIKES}", "above 10: lower optim.lr, lengthen "
                                                              "schedule.warmup_iters, check "
                                                              "optim.clip_grad and the init "
                                                              "(model.init_std); below 0.1: the "
                                                              "model barely learns — check the lr "
                                                              "and that the data varies")


def check_lr(runs: list[Run], schedule: LRSchedule) -> Check:
    compared, wrong, counts = 0, [], []
    for run in runs:
        counts.append(f"{len(run.steps())} {run.name}")
        for it, r in sorted(run.steps().items()):
            expected = schedule(it)
            compared += 1
            lr = r.get("lr")
            if not isinstance(lr, (int, float)) or not abs(lr - expected) <= LR_RTOL * max(expected,
                                                                                           1e-12):
                wrong.append(f"{run.name} iter {it}: {r.get('lr')} ≠ {expected:.6g}")
    measured = (f"{compared - len(wrong)} of {compared} steps match ({' + '.join(counts)})"
                + (f"; {'; '.join(wrong[:3])}" if wrong else ""))
    required = (f"{schedule.decay}: warmup {schedule.warmup_iters}, {schedule.lr:g} → "
                f"{schedule.min_lr:g} at {schedule.decay_iters} (relative error ≤ {LR_RTOL:g})")
    return Check("lr schedule", bool(compared) and not wrong, measured, required,
                 "the trainer's lr differs from the config's schedule: a rollback's "
                 "recovery.lr_factor, or a bug in the schedule; plot the intended one with "
                 "tools/plot_schedule.py")


def check_checkpoint(run: Run, mid: int) -> tuple[Check, str]:
    from megapretrain.checkpoint.format import problem

    path = os.path.join(run.directory, "checkpoints", f"iter_{mid:07d}")
    saved = [r for r in run.records if r.get("event") == "checkpoint_saved" and
             r.get("iter") == mid]
    issue = problem(path) if os.path.isdir(path) else f"{path} does not exist"
    stall = saved[0].get("checkpoint_stall_s") if saved else None
    measured = (f"iter_{mid:07d} complete, checksums valid" if issue is None else issue)
    measured += f"; training blocked {stall:.2f} s" if isinstance(stall, (int, float)) else ""
    return Check("checkpoint", issue is None and bool(saved), measured,
                 f"saved at iteration {mid}, complete, CRC-32 valid",
                 "check free space and permissions under run.dir; read full.log for the save's "
                 "error"), path


def check_resume(full: Run, resumed: Run, mid: int, iters: int, tol: float) -> Check:
    a, b = full.steps(), resumed.steps()
    required = f"iterations {mid + 1}–{iters}: losses equal (bitwise or |Δ| ≤ {tol:g}), a " \
               f"`resumed` event at {mid}"
    fix = ("the checkpoint misses some state (optimizer, RNG, data position): compare full/ and "
           "resume/ metrics.jsonl step by step; nondeterministic kernels also break this "
           "(train.compile, atomics)")
    if resumed.returncode != 0:
        return Check("resume", False, f"resumed run exit {resumed.returncode}: "
                                      f"{resumed.last_error()}", required,
                     f"read {os.path.basename(resumed.log)}: its last lines name the error")
    started = [r for r in resumed.records if r.get("event") == "resumed"]
    steps = range(mid + 1, iters + 1)
    missing = [it for it in steps if it not in a or it not in b]
    diffs = [(it, _diff(a[it].get("loss"), b[it].get("loss"))) for it in steps if it in a and
             it in b]
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
    valid = [(r.get("valid_loss"), s.get("valid_loss")) for r,
             s in zip(_evals(full, mid), _evals(resumed, mid))]
    if valid:
        measured += "; valid loss " + ("equal" if all(x == y for x, y in valid) else "differs")
    return Check("resume", ok, measured, required, fix)


def _diff(x, y) -> float:
    """|x - y|; infinite when either is missing, or NaN (which would pass no comparison, nor fail
    one)."""
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
    measured = (f"median {median:,.0f} tokens/s (steps {timed[0][0]}–{timed[-1][0]}; range "
                f"{min(rates):,.0f}–{max(rates):,.0f})")
    mfus = [r["mfu"] for it, r in run.steps().items() if it > warm and
            isinstance(r.get("mfu"), (int, float))]
    measured += f", MFU {100 * statistics.median(mfus):.1f}%" if mfus else ""
    if minimum is None:
        return Check("throughput", None, measured, "— (give --min-tokens-per-sec)", "")
    return Check("throughput", median >= minimum, measured, f"median ≥ {minimum:,.0f} tokens/s",
                 "tools/plan.py for the expected speed of this layout; check data_time (slow "
                 "storage), parallel.recompute, micro_batch_size, model.kernels/optim.impl, and "
                 "the interconnect")


def device_memory_gb(cfg: Config, nproc: int) -> tuple[float, str]:
    """What one rank may use: the GPU's memory, or on CPU the host's RAM shared by the ranks."""
    import torch

    if cfg.train.device != "cpu" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory / 2**30, f"{props.name} memory"
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return pages / 2**30 / nproc, f"host RAM / {rank_count(nproc)}"


def check_memory(runs: list[Run], cfg: Config, args) -> Check:
    peaks = [r["memory_mb"] for run in runs for r in training_records(run.records)
             if isinstance(r.get("memory_mb"), (int, float))]
    if args.max_memory_gb:
        limit, what = args.max_memory_gb, "--max-memory-gb"
    else:
        limit, what = device_memory_gb(cfg, args.nproc_per_node)
    if not peaks:
        return Check("memory", False, "no memory_mb logged", f"≤ {limit:.1f} GB ({what})",
                     "read full.log")
    peak = max(peaks) / 1024
    return Check("memory", peak <= limit, f"peak {peak:.2f} GB on rank 0 "
                                          f"({100 * peak / limit:.0f}% of the limit)",
                 f"≤ {limit:.1f} GB ({what})", "in this order: parallel.recompute selective/full, "
                                               "halve train.micro_batch_size, raise parallel.zero "
                                               "or optim.offload, more parallel.tp/pp, parallel.cp "
                                               "for long sequences (tools/plan.py estimates each)")


def check_layouts(args, cfg: Config, out: str) -> Check:
    """tools/smoke_test.py on ``--nproc-per-node`` ranks: each layout's losses against one
    process."""
    workdir = os.path.join(out, "layouts")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(args.nproc_per_node), "-m", "megapretrain.commands.smoke_test", "--workdir", workdir,
           "--layouts", args.layouts, "--precision", "bf16" if cfg.train.precision == "bf16"
           else "fp32"]
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
                 f"every layout of {args.nproc_per_node} ranks: losses within the smoke test's "
                 "tolerance", "layouts.log and layouts/smoke_test.json name the layout; rerun "
                              "tools/smoke_test.py on it")


def check_production(args, overrides: list[str], cfg: Config, out: str) -> Check:
    """One rank of every role of the layout on ``--world-size`` GPUs, simulated on this machine
    (report in ``out/simulate``): each peak plus the planner's allowance within the GPU's memory."""
    from megapretrain.simulate.report import markdown

    from .simulate import simulate

    gpu = DEVICES[args.gpu]
    limit = args.max_memory_gb or gpu.memory_gb * (1 - gpu.spare)
    sim_args = argparse.Namespace(config=args.config, world_size=args.world_size, roles=True,
                                  rank=None, steps=1, device="cuda")
    vocab = ["--model.vocab_size", str(cfg.model.vocab_size)]  # as the tokenizer gave it
    start = time.perf_counter()
    try:
        doc = simulate(sim_args, overrides + vocab)
    except UserError as exc:
        return Check("production layout", False, f"{args.world_size} GPUs: {exc}",
                     "the layout resolves", "fix the config for that world size (tools/plan.py "
                                            "--layout config shows the layout)")
    if doc["warnings"]:  # the launch itself would be refused (a ramp-up's batch at this size)
        return Check("production layout", False, f"{args.world_size} GPUs: {doc['warnings'][0]}",
                     "the layout resolves", "fix the config for that world size (tools/plan.py "
                                            "--layout config shows the layout)")
    os.makedirs(os.path.join(out, "simulate"), exist_ok=True)
    with open(os.path.join(out, "simulate", "report.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    with open(os.path.join(out, "simulate", "report.md"), "w") as fh:
        fh.write(markdown(doc))
    worst = max(doc["ranks"], key=lambda r: r["peak_bytes"])
    need = worst["peak_bytes"] / 2**30 + gpu.overhead_gb
    off = [r["rank"] for r in doc["ranks"]
           if abs(r["planned_peak_bytes"] - r["peak_bytes"]) > 0.05 * r["peak_bytes"]]
    measured = (f"{args.world_size} GPUs, {len(doc['ranks'])} roles in "
                f"{time.perf_counter() - start:.0f} s: peak {worst['peak_bytes'] / 2**30:.1f} GiB "
                f"on rank {worst['rank']} ({worst['role']}) + {gpu.overhead_gb:g} GiB "
                "allowance" + (f"; planner off by > 5% on ranks {off}" if off else ""))
    return Check("production layout", need <= limit and not off, measured,
                 f"≤ {limit:.1f} GB ({'--max-memory-gb' if args.max_memory_gb else gpu.name})",
                 "simulate/report.md breaks each peak down; tools/plan.py --layout config "
                 "--simulate 1 compares with the planner; lower the peak as for the memory check")
