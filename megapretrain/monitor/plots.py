"""Pictures of a run, drawn from metrics.jsonl records: the dashboard of ``tools/plot_run.py``, the
single panels beside the pre-flight report, the schedule curves and the pipeline timelines of
``tools/plot_schedule.py``.

Three rules keep the pictures honest:

- a series logged across a rollback or a resume is drawn as the line the run kept plus, dashed and
  faded, the steps it trained again (:func:`trajectory`) — never one line running back in time;
- data lines and event marks never share a colour (``DATA_COLOURS`` and ``EVENT_STYLES`` are
  disjoint), and an alert's start and its clearing are drawn differently;
- quantities whose zero means something (memory, throughput, MFU, times) are drawn from zero, with
  their range stated in the panel's title, so a 1.5% dip does not look like a crash.

matplotlib is imported only when a picture is drawn, with the Agg backend (files, no display), so
training never pays for it and it works on headless nodes.
"""

from __future__ import annotations

import math
import os
import textwrap
from typing import NamedTuple

# line colours of the data, in the order a panel's series take them
DATA_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:brown", "tab:olive", "tab:cyan", "navy",
                "darkgoldenrod")
# event name -> (colour, line style, line width) of its vertical mark; none of these colours is a
# data colour
EVENT_STYLES = {"checkpoint_saved": ("0.6", ":", 1.0), "resumed": ("black", "-.", 1.3),
                "rollback": ("tab:red", "-", 1.6), "alert start": ("magenta", "-", 1.1),
                "alert clear": ("magenta", ":", 1.4), "skipped_step": ("tab:purple", "--", 1.0),
                "straggler": ("tab:pink", ":", 1.2), "hang": ("black", "-", 2.2),
                "oom": ("darkred", "-", 2.2), "restart": ("chocolate", "-", 2.0)}
OTHER_EVENT = ("0.35", "--", 1.0)
NOT_MARKED = {"memory"}  # the start-up memory report, not something that happened during the run
# steps a rollback or resume trained again
SUPERSEDED = {"linestyle": "--", "alpha": 0.45, "linewidth": 1.0}
# a reference line drawn wide and pale under the line compared with it (preflight: the full run
# under the resumed one, the expected LR under the logged one), so that where they are equal both
# stay visible
UNDER = {"linewidth": 5.0, "alpha": 0.3}
OVER = {"linewidth": 1.2, "marker": "o", "markersize": 2.5}


class Mark(NamedTuple):
    """An event drawn on the iteration axis; ``span``: the iterations it concerns, shaded (a
    rollback: the steps trained again; an alert's clearing: the steps it was active)."""
    iter: int
    name: str
    span: tuple[int, int] | None = None


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


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(xs: list, ys: list) -> tuple[list, list]:
    pairs = [(x, y) for x, y in zip(xs, ys) if _is_number(y) and math.isfinite(y)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def series(records: list[dict], key: str) -> tuple[list, list]:
    """(iterations, values) of ``key`` over the records that carry it as a finite number, in the
    order written (a rollback or resume makes the iterations go back: see :func:`trajectory`)."""
    rows = [r for r in records if _is_number(r.get(key))]
    return _finite([r["iter"] for r in rows], [r[key] for r in rows])


def trajectory(xs: list, ys: list) -> tuple[tuple[list, list], list[tuple[list, list]]]:
    """A series in the order written, split into the line the run kept and the pieces it trained
    again. Whenever the iteration goes back (a rollback, or a resume from a checkpoint older than
    the last logged step), the points from the new start on are superseded; each superseded piece
    starts at the kept point it branched from, so it is drawn as a branch, not a jump back."""
    kept: list[tuple] = []
    dropped: list[list[tuple]] = []
    for x, y in zip(xs, ys):
        if kept and x <= kept[-1][0]:
            redone = [p for p in kept if p[0] >= x]
            kept = [p for p in kept if p[0] < x]
            dropped.append(kept[-1:] + redone)
        kept.append((x, y))
    return _unzip(kept), [_unzip(piece) for piece in dropped]


def _unzip(points: list[tuple]) -> tuple[list, list]:
    return [p[0] for p in points], [p[1] for p in points]


def flat_numbers(record: dict) -> dict:
    """The record's numeric fields, nested dicts flattened one level (``breakdown.fwd_s``)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items() if _is_number(v)})
        elif _is_number(value):
            out[key] = value
    return out


# the run's clock, not parts of a step: minutes beside milliseconds
CLOCK_FIELDS = ("elapsed_s", "eta_s")


def time_fields(records: list[dict]) -> list[str]:
    """Time-breakdown fields of the training lines: data_time, step_time and any ``*_s`` /
    ``*_time`` but the run's clock (TensorBoard's layout leaves it out of its breakdown too)."""
    seen: dict[str, None] = {}
    for r in records:
        for key in flat_numbers(r):
            if key.endswith(("_s", "_time")) and key not in CLOCK_FIELDS:
                seen[key] = None
    return list(seen)


def events(records: list[dict]) -> list[Mark]:
    """Every event line worth marking: alerts as ``alert start`` / ``alert clear`` (an alert without
    a state — a recovery verdict — starts; a clearing spans back to its start), a rollback with the
    span from the iteration it restored to the one it left."""
    marks = []
    for r in records:
        name = r.get("event")
        if name is None or name in NOT_MARKED:
            continue
        it, span = int(r.get("iter", 0)), None
        if name == "alert":
            name = "alert clear" if r.get("state") == "clear" else "alert start"
            if name == "alert clear" and _is_number(r.get("since")):
                span = (int(r["since"]), it)
        elif name == "rollback" and _is_number(r.get("from_iter")):
            span = (it, int(r["from_iter"]))
        elif name == "restart" and _is_number(r.get("previous_last_iter")):
            span = (it, int(r["previous_last_iter"]))  # what the attempt before had trained
        marks.append(Mark(it, str(name), span))
    return marks


def _style(name: str) -> tuple:
    return EVENT_STYLES.get(name, OTHER_EVENT)


def mark_events(ax, marks: list[Mark], label: bool = False) -> None:
    """A vertical line at each event (``label``: one legend entry per event name), its span
    shaded."""
    labelled = set()
    for mark in marks:
        colour, style, width = _style(mark.name)
        text = mark.name if label and mark.name not in labelled else None
        labelled.add(mark.name)
        ax.axvline(mark.iter, color=colour, linestyle=style, linewidth=width, alpha=0.85,
                   label=text)
        if mark.span is not None and mark.span[1] > mark.span[0]:
            ax.axvspan(*mark.span, color=colour, alpha=0.08, linewidth=0)


def draw_series(ax, label: str, xs: list, ys: list, colour: str, **style) -> None:
    """One series: the kept line solid, steps trained again (after a rollback or resume) dashed and
    faded."""
    (kx, ky), dropped = trajectory(xs, ys)
    ax.plot(kx, ky, color=colour, label=label, **{"linewidth": 1.2, **style})
    for dx, dy in dropped:
        ax.plot(dx, dy, color=colour, **SUPERSEDED)


def _integer_iterations(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _event_legend(fig, marks: list[Mark], superseded: bool) -> None:
    from matplotlib.lines import Line2D

    handles = []
    for name in dict.fromkeys(m.name for m in marks):
        colour, style, width = _style(name)
        text = {"rollback": "rollback (shaded: steps trained again)",
                "restart": "restart (shaded: steps trained again)",
                "alert clear": "alert clear (shaded: active)"}.get(name, name)
        handles.append(Line2D([], [], color=colour, linestyle=style, linewidth=width, label=text))
    if superseded:
        handles.append(Line2D([], [], color="0.3", label="superseded steps", **SUPERSEDED))
    if handles:
        fig.legend(handles=handles, loc="upper right", ncol=min(len(handles), 4), fontsize=8,
                   title="events", title_fontsize=8, frameon=False)


def _span(ys: list) -> str:
    """The range of a from-zero panel's values, stated in its title."""
    low, high = min(ys), max(ys)
    spread = f", spread {100 * (high - low) / high:.1f}% of the peak" if high > 0 else ""
    return f"{low:,.4g}–{high:,.4g}{spread}"


def _panels(train: list[dict], records: list[dict]) -> list[tuple[str, list, dict]]:
    """The dashboard's panels present in the data: (title, [(label, xs, ys)], options). ``zero``:
    the axis starts at zero (a quantity whose zero means something); ``span``: the title states the
    values' range."""
    panels = []
    loss = [("loss", *series(train, "loss"))]
    valid = series(records, "valid_loss")
    if valid[0]:
        loss.append(("valid_loss", *valid))
    panels.append(("loss", loss, {}))
    # eval.tasks' scores (the eval lines' "<task>/acc", "<task>/acc_norm"), beside the loss
    scores = sorted({k for r in records for k in r if k.endswith(("/acc", "/acc_norm"))})
    if scores:
        panels.append(("downstream accuracy", [(k, *series(records, k)) for k in scores],
                       {"unit": True}))
    measured = {"zero": True, "span": True}
    wanted = (("grad norm (before clipping)", "grad_norm", {"log": True}),
              ("learning rate", "lr", {"zero": True}), ("tokens/s", "tokens_per_sec", measured),
              ("MFU", "mfu", measured), ("memory (MB)", "memory_mb", measured),
              ("loss scale", "loss_scale", {"log": True}))
    for title, key, options in wanted:
        xs, ys = series(train, key)
        if xs:
            panels.append((title, [(key, xs, ys)], options))
    times = [(key, *_flat_series(train, key)) for key in time_fields(train)]
    times = [t for t in times if t[1]]
    if times:
        panels.append(("time breakdown (s)", times, {"zero": True}))
    return panels


def _flat_series(records: list[dict], key: str) -> tuple[list, list]:
    rows = [(r["iter"], flat_numbers(r).get(key)) for r in records]
    return _finite([x for x, _ in rows], [y for _, y in rows])


def _draw_panel(ax, name: str, lines: list, options: dict, marks: list[Mark]) -> None:
    for i, (label, xs, ys) in enumerate(lines):
        style = {"marker": "o", "markersize": 3} \
            if label == "valid_loss" or options.get("unit") else {}
        draw_series(ax, label, xs, ys, DATA_COLOURS[i % len(DATA_COLOURS)], **style)
    values = [y for _, _, ys in lines for y in ys]
    if options.get("log") and all(y > 0 for y in values):
        ax.set_yscale("log")
    if options.get("unit"):  # a fraction: the whole 0..1 range
        ax.set_ylim(-0.02, 1.02)
    if options.get("zero") and values and min(values) >= 0:
        ax.set_ylim(bottom=0, top=max(values) * 1.08 or 1)
    mark_events(ax, marks)
    _integer_iterations(ax)
    ax.set_title(f"{name}: {_span(values)}" if options.get("span") and values else name,
                 fontsize=10)
    ax.set_xlabel("iteration", fontsize=8)
    ax.grid(alpha=0.3)
    if len(lines) > 1:
        ax.legend(fontsize=8)


def plot_dashboard(records: list[dict], path: str, title: str, note: str | None = None) -> str:
    """Every panel the run logged, events marked, into one PNG at ``path``; ``note``: a line
    under the title (the effective training time)."""
    return _save(dashboard_figure(records, title, note), path)


def dashboard_figure(records: list[dict], title: str, note: str | None = None):
    """The dashboard as a matplotlib figure (see :func:`plot_dashboard`)."""
    plt = pyplot()
    train = [r for r in records if "loss" in r and "iter" in r and "event" not in r]
    panels = _panels(train, records)
    marks = events(records)
    cols = 2
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(13, 3.4 * rows + 0.6), squeeze=False)
    for ax, (name, lines, options) in zip(axes.flat, panels):
        _draw_panel(ax, name, lines, options, marks)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    superseded = any(trajectory(xs, ys)[1] for _, lines, _ in panels for _, xs, ys in lines)
    _event_legend(fig, marks, superseded)
    fig.suptitle(title if note is None else f"{title}\n{note}", fontsize=12 if note is None
                 else 10, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / (3.4 * rows + 0.6)))
    return fig


def plot_lines(path: str, title: str, lines: list[tuple], *, ylabel: str = "",
               log: bool = False, band: tuple[float, float] | None = None,
               hline: float | None = None, marks: list[Mark] = (),
               xlabel: str = "iteration") -> str:
    """One panel of labelled lines ``(label, xs, ys)`` or ``(label, xs, ys, style)`` (matplotlib
    keywords, e.g. :data:`UNDER` / :data:`OVER`), optionally a shaded allowed band, a threshold line
    and event marks; written to ``path`` (PNG)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, (label, xs, ys, *style) in enumerate(lines):
        draw_series(ax, label, xs, ys, DATA_COLOURS[i % len(DATA_COLOURS)],
                    **(style[0] if style else {}))
    if band is not None:
        ax.axhspan(*band, color="tab:green", alpha=0.08,
                   label=f"allowed [{band[0]:g}, {band[1]:g}]")
    if hline is not None:
        ax.axhline(hline, color="tab:red", linestyle="--", linewidth=1,
                   label=f"required {hline:,.4g}")
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
    return _save(fig, path)


def plot_schedule_curves(path: str, title: str, iters: list[int], lrs: list[float],
                         batch: list[int] | None = None, warmup_iters: int = 0,
                         min_lr: float | None = None) -> str:
    """The LR over iterations (and the batch size, when it ramps up) of a config, into ``path``."""
    return _save(schedule_figure(title, iters, lrs, batch, warmup_iters, min_lr), path)


def schedule_figure(title: str, iters: list[int], lrs: list[float], batch: list[int] | None = None,
                    warmup_iters: int = 0, min_lr: float | None = None):
    """The figure of :func:`plot_schedule_curves`; a long title is wrapped, not cut."""
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter

    panels = 2 if batch else 1
    fig, axes = plt.subplots(panels, 1, figsize=(8, 3.4 * panels), squeeze=False)
    ax = axes[0][0]
    ax.plot(iters, lrs, color=DATA_COLOURS[0], linewidth=1.5, label="lr")
    if warmup_iters:
        ax.axvspan(0, warmup_iters, color=DATA_COLOURS[1], alpha=0.12,
                   label=f"warmup ({warmup_iters} iters)")
    if min_lr is not None:
        ax.axhline(min_lr, color="0.5", linestyle=":", label=f"min_lr {min_lr:g}")
    ax.set_ylim(bottom=0)
    # no offset text under the title
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_title("\n".join(textwrap.wrap(title, 80)), fontsize=10)
    ax.set_xlabel("iteration")
    ax.set_ylabel("learning rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if batch:
        bx = axes[1][0]
        bx.step(iters, batch, where="post", color=DATA_COLOURS[2], linewidth=1.5)
        bx.set_ylim(bottom=0, top=max(batch) * 1.08)
        bx.set_title("global batch size (ramp-up)", fontsize=10)
        bx.set_xlabel("iteration")
        bx.set_ylabel("samples per step")
        bx.grid(alpha=0.3)
    fig.tight_layout()
    return fig


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
                ax.barh(r, e - s, left=s, height=0.8, color=OP_COLOURS[kind], edgecolor="white",
                        linewidth=0.5)
                if e - s >= 0.6:
                    ax.text((s + e) / 2, r, label, ha="center", va="center", fontsize=6,
                            color="white")
        ax.set_yticks(range(len(stages)), [f"stage {r}" for r in range(len(stages))], fontsize=8)
        ax.set_ylim(len(stages) - 0.5, -0.5)
        ax.set_xlim(0, end)
        ax.set_title(name, fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in OP_COLOURS.values()]
    fig.legend(handles, ["forward", "backward (input gradient, or whole)", "weight gradient"],
               fontsize=7, loc="upper right", ncol=3)
    axes[-1, 0].set_xlabel("time (one stage's forward = 1)")
    fig.suptitle(title, fontsize=10, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return _save(fig, path)


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path
