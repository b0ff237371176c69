"""Alerts on a run's health, with the recipe's thresholds (``alerts.*``).

Every step the trainer hands over its loss, grad norm (before clipping), tokens/s and data wait.
A condition raises an alert when it starts and another when it clears — never one per step while
it lasts — so a long stall or a bad stretch is two lines, not thousands:

    non_finite    loss or grad norm NaN/Inf
    grad_norm     grad norm above alerts.grad_norm_max (not judged at iteration 1: the gradient of
                  the random initialization, before any update, is large by nature)
    loss_ratio    loss above alerts.loss_ratio × its rolling average (alerts.window healthy steps)
    throughput    tokens/s (the median of the last few steps, so one slow step is not a drop) more
                  than alerts.throughput_drop below the rolling median of the steps before them,
                  for SUSTAIN judged steps in a row; it clears after SUSTAIN healthy ones in a row
                  (a busy shared machine's brief dips neither raise it nor make it flap)
    data_wait     the step waited longer than alerts.data_wait_s for its data

The rolling baselines take only healthy steps, and need a few before they judge (the first steps
of a run — compilation, cold caches — are not a throughput drop, nor are the steps right after an
evaluation or a checkpoint save, whose writer may still be busy: see :meth:`AlertMonitor.settle`).

A **straggler** (:class:`Stragglers`) is a rank whose own step time (without the wait for the
gradient reduction), as the median of its last ``alerts.straggler_steps`` steps, is at least
``alerts.straggler_ratio`` × the median over ranks of the same: a median, so one slow step (a
garbage collection, a busy core) is not a straggler, and over many steps, so a rank must stay slow.
It too is announced when it starts and when it clears.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import torch
import torch.distributed as dist

MIN_HISTORY = 5     # healthy steps a rolling baseline needs before it judges
WARMUP_STEPS = 3    # the first steps' throughput is not a baseline
RECENT = 5          # steps whose median throughput is compared with the baseline
SUSTAIN = 10        # judged steps in a row a throughput drop (or its recovery) must last


class AlertMonitor:
    def __init__(self, cfg):
        """``cfg``: the ``alerts`` config section."""
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.window)
        self.throughput: deque[float] = deque(maxlen=cfg.window)  # the baseline's steps
        self.recent: deque[float] = deque(maxlen=RECENT)
        self.active: dict[str, dict] = {}  # kind -> the alert that started it
        self.steps = 0
        self.quiet_until = WARMUP_STEPS  # throughput is not judged before this step
        self.run = 0  # judged steps in a row on the other side of the threshold from the state

    def observe(self, iteration: int, loss: float, grad_norm: float, tokens_per_sec: float,
                data_wait_s: float) -> list[dict]:
        """This step's alerts: conditions that started (``state: start``) or cleared (``clear``)."""
        self.steps += 1
        c, found = self.cfg, {}
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if not finite:
            found["non_finite"] = {"loss": loss, "grad_norm": grad_norm}
        elif iteration > 1 and grad_norm > c.grad_norm_max:
            found["grad_norm"] = {"grad_norm": grad_norm, "threshold": c.grad_norm_max}
        if finite and len(self.losses) >= MIN_HISTORY:
            mean = sum(self.losses) / len(self.losses)
            if loss > c.loss_ratio * mean:
                found["loss_ratio"] = {"loss": loss, "rolling_mean": round(mean, 6),
                                       "ratio": round(loss / mean, 3)}
        if self.steps > self.quiet_until:
            if len(self.recent) == RECENT and "throughput" not in self.active and not self.run:
                self.throughput.append(self.recent[0])  # the oldest recent step joins the baseline
            self.recent.append(tokens_per_sec)
        dropped = "throughput" in self.active  # the state, kept while a step is not judged
        if len(self.recent) == RECENT and len(self.throughput) >= MIN_HISTORY:
            median, now = statistics.median(self.throughput), statistics.median(self.recent)
            low = now < (1.0 - c.throughput_drop) * median
            self.run = self.run + 1 if low != dropped else 0
            if self.run >= SUSTAIN:
                dropped, self.run = low, 0
            if dropped and "throughput" not in self.active:
                found["throughput"] = {"tokens_per_sec": round(now, 1),
                                       "rolling_median": round(median, 1),
                                       "drop": round(1.0 - now / median, 3)}
        if dropped and "throughput" not in found:
            found["throughput"] = self.active.get("throughput", {})
        if data_wait_s > c.data_wait_s:
            found["data_wait"] = {"data_wait_s": round(data_wait_s, 3), "threshold": c.data_wait_s}
        if finite and "loss_ratio" not in found:
            self.losses.append(loss)
        return self._transitions(iteration, found)

    def settle(self, steps: int = 2 * RECENT) -> None:
        """An evaluation or a save just ran: leave the next ``steps`` steps' throughput unjudged."""
        self.quiet_until = self.steps + steps
        self.recent.clear()
        self.run = 0

    def _transitions(self, iteration: int, found: dict) -> list[dict]:
        out = []
        for kind, values in found.items():
            if kind not in self.active:
                self.active[kind] = {"kind": kind, "state": "start", "iter": iteration, **values}
                out.append(self.active[kind])
        for kind in [k for k in self.active if k not in found]:
            started = self.active.pop(kind)
            out.append({"kind": kind, "state": "clear", "iter": iteration,
                        "since": started["iter"]})
        return out


def describe_alert(alert: dict) -> str:
    """One console line for an alert of :class:`AlertMonitor`."""
    kind, it = alert["kind"], alert["iter"]
    if alert["state"] == "clear":
        return f"alert cleared at iteration {it}: {kind} (since iteration {alert['since']})"
    detail = {
        "non_finite": lambda a: f"loss {a['loss']}, grad norm {a['grad_norm']}",
        "grad_norm": lambda a: f"grad norm {a['grad_norm']:.3g} above {a['threshold']:g}",
        "loss_ratio": lambda a: f"loss {a['loss']:.4f} is {a['ratio']}× its rolling mean "
                                f"{a['rolling_mean']:.4f}",
        "throughput": lambda a: f"{a['tokens_per_sec']:,.0f} tokens/s, {a['drop']:.0%} below the "
                                f"rolling median {a['rolling_median']:,.0f}",
        "data_wait": lambda a: f"waited {a['data_wait_s']:.2f} s for data (threshold "
                               f"{a['threshold']:g} s)", }[kind](alert)
    return f"alert at iteration {it}: {kind}: {detail}"


class Stragglers:
    """Each rank's recent own step and data times; at each check (a collective: every rank calls
    it), the ranks that have been slow, as start and clear transitions."""

    def __init__(self, ratio: float, steps: int):
        self.ratio = ratio
        self.own: deque[float] = deque(maxlen=steps)   # this rank's step time without the gradient
        #                                                wait
        self.data: deque[float] = deque(maxlen=steps)  # and its data wait
        self.active: dict[int, dict] = {}  # rank -> the alert that started it

    def observe(self, own_step_time: float, data_time: float) -> None:
        self.own.append(own_step_time)
        self.data.append(data_time)

    def check(self, ps, hosts: list[str], iteration: int) -> list[dict]:
        """All-gather every rank's median times over the window (once it is full on every rank:
        all ranks step together) and return the stragglers that started or cleared."""
        if len(self.own) < self.own.maxlen:
            return []
        mine = torch.tensor([statistics.median(self.own), statistics.median(self.data)],
                            dtype=torch.float64, device=ps.device)
        times = [torch.zeros_like(mine) for _ in range(ps.world_size)]
        dist.all_gather(times, mine)
        steps = [float(t[0]) for t in times]
        median = statistics.median(steps)
        slow = {rank for rank in range(ps.world_size) if median > 0 and
                steps[rank] >= self.ratio * median}
        out = []
        for rank in sorted(slow - set(self.active)):
            self.active[rank] = {"kind": "straggler", "state": "start", "iter": iteration,
                                 "rank": rank, "host": hosts[rank], "step_time": steps[rank],
                                 "data_time": float(times[rank][1]), "median_step_time": median,
                                 "ratio": steps[rank] / median, "steps": self.own.maxlen}
            out.append(self.active[rank])
        for rank in sorted(set(self.active) - slow):
            started = self.active.pop(rank)
            out.append({"kind": "straggler", "state": "clear", "iter": iteration, "rank": rank,
                        "host": hosts[rank], "since": started["iter"], "step_time": steps[rank],
                        "median_step_time": median, "ratio": steps[rank] / median if median > 0
                        else None})
        return out


def describe_straggler(alert: dict) -> str:
    """One console line for a straggler's start or clear."""
    who = f"rank {alert['rank']} on {alert['host']}"
    if alert["state"] == "clear":
        return (f"straggler cleared at iteration {alert['iter']}: {who} (since iteration "
                f"{alert['since']}) is back to {alert['step_time']:.3f} s per step")
    return (f"straggler: {who} took {alert['step_time']:.3f} s per step (the median of its last "
            f"{alert['steps']}), {alert['ratio']:.2f}× the median rank's "
            f"{alert['median_step_time']:.3f} s (data wait {alert['data_time']:.3f} s)")
