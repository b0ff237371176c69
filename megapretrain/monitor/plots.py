"""Pictures of a run, drawn from metrics.jsonl records: the dashboard of ``tools/plot_run.py``, the
single panels beside the pre-flight report, the schedule curves and the pipeline timelines of
``tools/plot_schedule.py``.

matplotlib is imported only when a picture is drawn, with the Agg backend (files, no display), so
training never pays for it and it works on headless nodes.
"""

from __future__ import annotations

import math
import os

# events drawn as vertical lines, with their colours; any other event name gets the last colour
EVENT_COLOURS = {"checkpoint_saved": "tab:green", "resumed": "tab:blue", "alert": "tab:orange",
                 "rollback": "tab:red", "skipped_step": "tab:purple", "hang": "black", "straggler": "tab:brown"}
OTHER_EVENT = "tab:gray"
NOT_MARKED = {"memory"}  # the start-up memory report, not something that happened during the run


def pyplot():
    """matplotlib.pyplot on the Agg backend (imported here, on first use)."""
    try:
        import matplotlib
    except ImportError:
        from ..errors import MissingPackageError
        raise MissingPackageError("plots need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _finite(xs: list, ys: list) -> tuple[list, list]:
    pairs = [(x, y) for x, y in zip(xs, ys) if isinstance(y, (int, float)) and math.isfinite(y)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def series(records: list[dict], key: str) -> tuple[list, list]:
    """(iterations, values) of ``key`` over the records that carry it as a finite number."""
    rows = [r for r in records if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return _finite([r["iter"] for r in rows], [r[key] for r in rows])


def flat_numbers(record: dict) -> dict:
    """The record's numeric fields, nested dicts flattened one level (``breakdown.fwd_s``)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items() if _is_number(v)})
        elif _is_number(value):
            out[key] = value
    return out


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def time_fields(records: list[dict]) -> list[str]:
    """Time-breakdown fields of the training lines: data_time, step_time and any ``*_s`` / ``*_time``."""
    seen: dict[str, None] = {}
    for r in records:
        for key in flat_numbers(r):
            if key.endswith(("_s", "_time")):
                seen[key] = None
    return list(seen)


def events(records: list[dict]) -> list[tuple[int, str]]:
    """(iteration, event name) of every event line worth marking."""
    return [(r.get("iter", 0), str(r["event"])) for r in records
            if "event" in r and r["event"] not in NOT_MARKED]


def mark_events(ax, marks: list[tuple[int, str]], label: bool = False) -> None:
    """Dotted vertical lines at the events' iterations (``label``: one legend entry per event name)."""
    labelled = set()
    for it, name in marks:
        text = name if label and name not in labelled else None
        labelled.add(name)
        ax.axvline(it, color=EVENT_COLOURS.get(name, OTHER_EVENT), linestyle=":", linewidth=1.2, alpha=0.8,
                   label=text)


def _integer_iterations(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _event_legend(fig, marks: list[tuple[int, str]]) -> None:
    from matplotlib.lines import Line2D

    names = list(dict.fromkeys(name for _, name in marks))
    if names:
        handles = [Line2D([], [], color=EVENT_COLOURS.get(n, OTHER_EVENT), linestyle=":", label=n) for n in names]
        fig.legend(handles=handles, loc="upper right", ncol=len(names), fontsize=8, title="events",
                   title_fontsize=8, frameon=False)


def _panels(train: list[dict], records: list[dict]) -> list[tuple[str, list, dict]]:
    """The dashboard's panels present in the data: (title, [(label, xs, ys)], options)."""
    panels = []
    loss = [("loss", *series(train, "loss"))]
    valid = series(records, "valid_loss")
    if valid[0]:
        loss.append(("valid_loss", *valid))
    panels.append(("loss", loss, {}))
    wanted = (("grad norm (before clipping)", "grad_norm", {"log": True}), ("learning rate", "lr", {}),
              ("tokens/s", "tokens_per_sec", {}), ("MFU", "mfu", {}), ("memory (MB)", "memory_mb", {}),
              ("loss scale", "loss_scale", {"log": True}))
    for title, key, options in wanted:
        xs, ys = series(train, key)
        if xs:
            panels.append((title, [(key, xs, ys)], options))
    times = [(key, *_flat_series(train, key)) for key in time_fields(train)]
    times = [t for t in times if t[1]]
    if times:
        panels.append(("time breakdown (s)", times, {}))
    return panels


def _flat_series(records: list[dict], key: str) -> tuple[list, list]:
    rows = [(r["iter"], flat_numbers(r).get(key)) for r in records]
    return _finite([x for x, _ in rows], [y for _, y in rows])


def plot_dashboard(records: list[dict], path: str, title: str) -> str:
    """Every panel the run logged, events marked, into one PNG at ``path``."""
    plt = pyplot()
    train = [r for r in records if "loss" in r and "iter" in r and "event" not in r]
    panels = _panels(train, records)
    marks = events(records)
    cols = 2
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(13, 3.4 * rows), squeeze=False)
    for ax, (name, lines, options) in zip(axes.flat, panels):
        for label, xs, ys in lines:
            style = {"marker": "o", "markersize": 3} if label == "valid_loss" else {}
            ax.plot(xs, ys, label=label, linewidth=1.2, **style)
        if options.get("log") and all(y > 0 for _, _, ys in lines for y in ys):
            ax.set_yscale("log")
        mark_events(ax, marks)
        _integer_iterations(ax)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("iteration", fontsize=8)
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    _event_legend(fig, marks)
    fig.suptitle(title, fontsize=12, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    return _save(fig, plt, path)


def plot_lines(path: str, title: str, lines: list[tuple[str, list, list]], *, ylabel: str = "",
               log: bool = False, band: tuple[float, float] | None = None, hline: float | None = None,
               marks: list[tuple[int, str]] = (), xlabel: str = "iteration") -> str:
    """One panel of labelled (xs, ys) lines, optionally a shaded allowed band, a threshold line and
    event marks; written to ``path`` (PNG)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for label, xs, ys in lines:
        style = {"linestyle": "--"} if label.startswith("expected") else {}
        ax.plot(xs, ys, label=label, linewidth=1.4, **style)
    if band is not None:
        ax.axhspan(*band, color="tab:green", alpha=0.08, label=f"allowed [{band[0]:g}, {band[1]:g}]")
    if hline is not None:
        ax.axhline(hline, color="tab:red", linestyle="--", linewidth=1, label=f"required {hline:,.4g}")
    if log:
        ax.set_yscale("log")
    mark_events(ax, list(marks), label=True)
    _integer_iterations(ax)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_schedule_curves(path: str, title: str, iters: list[int], lrs: list[float],
                         batch: list[int] | None = None, warmup_iters: int = 0, min_lr: float | None = None) -> str:
    """The LR over iterations (and the batch size, when it ramps up) of a config, into ``path``."""
    plt = pyplot()
    panels = 2 if batch else 1
    fig, axes = plt.subplots(panels, 1, figsize=(8, 3.4 * panels), squeeze=False)
    ax = axes[0][0]
    ax.plot(iters, lrs, color="tab:blue", linewidth=1.5, label="lr")
    if warmup_iters:
        ax.axvspan(0, warmup_iters, color="tab:orange", alpha=0.12, label=f"warmup ({warmup_iters} iters)")
    if min_lr is not None:
        ax.axhline(min_lr, color="tab:gray", linestyle=":", label=f"min_lr {min_lr:g}")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("iteration")
    ax.set_ylabel("learning rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if batch:
        bx = axes[1][0]
        bx.step(iters, batch, where="post", color="tab:green", linewidth=1.5)
        bx.set_title("global batch size (ramp-up)", fontsize=10)
        bx.set_xlabel("iteration")
        bx.set_ylabel("samples per step")
        bx.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, plt, path)


OP_COLOURS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}


def plot_pipeline(path: str, title: str, panels: list[tuple[str, list[list[tuple]]]]) -> str:
    """Pipeline timelines, one panel per schedule: each stage a row of its ops as bars, (start,
    end, kind, label) each — forwards, backwards and weight gradients in their own colours, the
    gaps between them the bubble; into ``path`` (PNG)."""
    plt = pyplot()
    end = max((e for _, stages in panels for stage in stages for _, e, _, _ in stage), default=1.0)
    fig, axes = plt.subplots(len(panels), 1, figsize=(min(24.0, 4 + end / 2.5), 0.4 + 1.1 * sum(
        len(stages) * 0.45 + 0.6 for _, stages in panels)), squeeze=False)
    for ax, (name, stages) in zip(axes[:, 0], panels):
        for r, stage in enumerate(stages):
            for s, e, kind, label in stage:
                ax.barh(r, e - s, left=s, height=0.8, color=OP_COLOURS[kind], edgecolor="white", linewidth=0.5)
                if e - s >= 0.6:
                    ax.text((s + e) / 2, r, label, ha="center", va="center", fontsize=6, color="white")
        ax.set_yticks(range(len(stages)), [f"stage {r}" for r in range(len(stages))], fontsize=8)
        ax.set_ylim(len(stages) - 0.5, -0.5)
        ax.set_xlim(0, end)
        ax.set_title(name, fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in OP_COLOURS.values()]
    fig.legend(handles, ["forward", "backward (input gradient, or whole)", "weight gradient"], fontsize=7,
               loc="upper right", ncol=3)
    axes[-1, 0].set_xlabel("time (one stage's forward = 1)")
    fig.suptitle(title, fontsize=10, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return _save(fig, plt, path)


def _save(fig, plt, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
