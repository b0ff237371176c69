"""Where a run stands in time: the seconds since it started, an estimate of the seconds left, and
durations as a person reads them ("14 min", "3.2 h", "2.5 days"; never "0.0 days").

The estimate divides the steps left by the recent pace: the wall-clock time of the last
:data:`PACE_STEPS` steps, evaluations and checkpoint saves among them included (they recur, so they
belong in the pace), the first steps' compilation and cold caches soon out of the window.
"""

from __future__ import annotations

import time
from collections import deque

PACE_STEPS = 50  # the steps whose wall-clock time sets the pace of the estimate


def human_duration(seconds: float) -> str:
    """``seconds`` in the unit a person would use: 45 s, 14 min, 3.2 h, 2.5 days."""
    if seconds != seconds or seconds < 0:  # NaN or negative: nothing sensible to say
        return "unknown"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


class Progress:
    """The elapsed time since :meth:`start` and the estimated time to ``iters`` steps."""

    def __init__(self, iters: int, clock=time.monotonic):
        self.iters, self.clock = iters, clock
        self.started = clock()
        self.marks: deque[tuple[int, float]] = deque(maxlen=PACE_STEPS + 1)  # (iteration, time)

    def start(self, iteration: int) -> None:
        """Training starts (or resumes) at ``iteration``: the clock and the pace start here."""
        self.started = self.clock()
        self.marks.clear()
        self.marks.append((iteration, self.started))

    def step(self, iteration: int) -> None:
        """Step ``iteration`` finished; a lower one than the last (a rollback) restarts the pace."""
        if self.marks and iteration <= self.marks[-1][0]:
            self.marks.clear()
        self.marks.append((iteration, self.clock()))

    @property
    def elapsed_s(self) -> float:
        return self.clock() - self.started

    @property
    def eta_s(self) -> float | None:
        """Seconds to the last step at the recent pace (None until one step was timed)."""
        if len(self.marks) < 2:
            return None
        (first, t0), (last, t1) = self.marks[0], self.marks[-1]
        return (self.iters - last) * (t1 - t0) / (last - first)

    def describe(self) -> str:
        """``elapsed 3 min | ETA 14 min (15:32)`` for a training line."""
        eta = self.eta_s
        if eta is None:
            return f"elapsed {human_duration(self.elapsed_s)}"
        finish = time.strftime("%a %H:%M" if eta > 20 * 3600 else "%H:%M",
                               time.localtime(time.time() + eta))
        return f"elapsed {human_duration(self.elapsed_s)} | ETA {human_duration(eta)} ({finish})"


def describe_goodput(g: dict) -> str:
    """The effective training time of a run over its attempts (``attempts.goodput``'s fields),
    for the closing lines and the dashboard."""
    if g.get("effective_training") is None:
        return "effective training time: not measured (no step timed)"
    line = (f"effective training time {100 * g['effective_training']:.1f}% (productive steps "
            f"{human_duration(g['productive_s'])} of {human_duration(g['wall_s'])} over "
            f"{g['attempts']} attempt{'s' * (g['attempts'] != 1)})")
    if g["restarts"]:
        line += (f"; {g['restarts']} restart{'s' * (g['restarts'] != 1)} lost "
                 f"{human_duration(g['restart_lost_s'])}")
    return line


def describe_summary(s: dict) -> str:
    """The closing lines of a run from its ``summary`` event: what it trained, how long it took,
    its validation loss, its checkpoints, and where everything it wrote is."""
    trained = s["iter"] - s["first_iter"]
    if not trained:
        line = f"done: no step trained (iteration {s['iter']})"
    else:
        line = (f"done: {trained:,} steps (iterations {s['first_iter'] + 1}-{s['iter']}), "
                f"{s['trained_tokens']:,} tokens in {human_duration(s['seconds'])}")
    if trained and s["seconds"] > 0:
        line += f" ({s['trained_tokens'] / s['seconds']:,.0f} tokens/s)"
    if s["first_iter"]:  # resumed: what the whole run has trained
        line += f"; {s['run_tokens']:,} tokens in all"
    if s["last_valid_loss"] is not None:
        line += f"; validation loss {s['last_valid_loss']:.4f} at iteration {s['last_valid_iter']}"
        if s["best_valid_iter"] != s["last_valid_iter"]:
            line += f" (best {s['best_valid_loss']:.4f} at iteration {s['best_valid_iter']})"
    saved = s["checkpoints_written"]
    line += f"; {len(saved)} checkpoint{'s' * (len(saved) != 1)} written" + (", the last "
                                                                             f"{saved[-1]}" if saved
                                                                             else "")
    if "effective_training" in s:  # over every attempt on the run directory
        line += "\n" + describe_goodput(s)
    where = [("run directory", s["run_dir"]), ("metrics", s["metrics"]),
             ("tensorboard", s["tensorboard"]), ("checkpoints", s["checkpoints"]),
             ("config", s["config"])]
    return "\n".join([line] + [f"  {name:<14} {path}" for name, path in where if path])
