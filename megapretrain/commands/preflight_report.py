"""The pre-flight's report (``tools/preflight.py``): ``report.md`` with every check's measured
value and verdict, the plots beside it, the events of the runs and their commands."""

from __future__ import annotations

import os
import shlex
import time

from megapretrain.config import Config
from megapretrain.monitor.metrics import training_records
from megapretrain.optim.lr_schedule import LRSchedule

from .preflight_checks import GRAD_NORM_RANGE, Check
from .preflight_runs import Run, rank_count


def write_plots(out: str, full: Run, resumed: Run, schedule: LRSchedule,
                minimum: float | None) -> list[str]:
    """loss.png, grad_norm.png, lr.png and throughput.png in ``out``; returns their file names."""
    from megapretrain.monitor.plots import OVER, UNDER, events, plot_lines, series

    a, b = training_records(full.records), training_records(resumed.records)
    # the resumed run's losses equal the full run's: the full run is drawn wide and pale under them
    marks = events(full.records) + [m for m in events(resumed.records) if m.name == "resumed"]
    its = sorted(full.steps())
    plots = {
        "loss.png": ("loss", [("full run", *series(a, "loss"), UNDER),
                              ("resumed at the midpoint", *series(b, "loss"), OVER)],
                     {"ylabel": "loss"}),
        "grad_norm.png": ("grad norm (before clipping)", [("grad norm", *series(a, "grad_norm"))],
                          {"log": True, "band": GRAD_NORM_RANGE}),
        "lr.png": ("learning rate",
                   [("expected (LRSchedule)", its, [schedule(it) for it in its], UNDER),
                    ("logged", *series(a, "lr"), OVER)], {}),
        "throughput.png": ("throughput", [("tokens/s", *series(a, "tokens_per_sec"))],
                           {"ylabel": "tokens/s", "hline": minimum}), }
    written = []
    for name, (title, lines, options) in plots.items():
        lines = [line for line in lines if line[1]]
        if lines:
            plot_lines(os.path.join(out, name), title, lines, marks=marks, **options)
            written.append(name)
    return written


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def write_report(out: str, args, overrides: list[str], cfg: Config, checks: list[Check],
                 runs: list[Run], plots: list[str]) -> str:
    failed = [c for c in checks if c.ok is False]
    unchecked = [c.name for c in checks if c.ok is None]
    verdict = (f"**FAILED** — {len(failed)} of {len(checks)} checks: "
               f"{', '.join(c.name for c in failed)}"
               if failed else f"**PASSED** — all {len(checks) - len(unchecked)} checks"
                              + (f" ({', '.join(unchecked)} not checked)" if unchecked else ""))
    mid = args.iters // 2
    lines = [f"# Pre-flight report: `{args.config}`", "", verdict, "",
             f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')} · {args.iters} iterations on "
             f"{rank_count(args.nproc_per_node)}, a checkpoint at {mid} and a resume from it · "
             f"model {cfg.model.num_layers} layers × {cfg.model.hidden_size} · layout tp "
             f"{cfg.parallel.tp} cp {cfg.parallel.cp} pp {cfg.parallel.pp} zero "
             f"{cfg.parallel.zero} · {cfg.train.precision} · {cfg.train.global_batch_size} × "
             f"{cfg.train.seq_length} tokens per step", "",
             "| check | result | measured | required | if it fails |", "|---|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c.name} | {c.result} | {_cell(c.measured)} | {_cell(c.required)} | "
                     f"{_cell(c.fix) if c.ok is False else ''} |")
    if plots:
        lines += ["", "## Plots", "", " ".join(f"![{p[:-4]}]({p})" for p in plots)]
    noted = [r for run in runs for r in run.records
             if r.get("event") in ("alert", "rollback", "skipped_step")]
    if noted:
        lines += ["", "## Events during the runs", ""] + [f"- {_event(r)}" for r in noted[:30]]
    lines += ["", "## Runs", ""]
    for run in runs:
        lines += [f"- **{run.name}**: `{os.path.basename(run.directory)}/` (metrics.jsonl, "
                  f"checkpoints), log `{os.path.basename(run.log)}`, exit {run.returncode}, "
                  f"{run.seconds:.0f} s", "", "  <details><summary>command</summary>", "",
                  f"  `{' '.join(shlex.quote(a) for a in run.command)}`", "", "  </details>", ""]
    path = os.path.join(out, "report.md")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return path


def _event(record: dict) -> str:
    """``iter 10: alert throughput (state start, drop 0.265)``: an event line of the report."""
    fields = {k: v for k, v in record.items() if k not in ("iter", "event", "time", "kind")}
    detail = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k,
                       v in fields.items()
                       if not isinstance(v, (dict, list)))
    return (f"iter {record.get('iter')}: {record['event']}"
            + (f" {record['kind']}" if "kind" in record else "")
            + (f" ({detail})" if detail else ""))
