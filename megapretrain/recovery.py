"""Loss spikes and non-finite steps: detection, alerts and the rollback policy's bookkeeping.

Every rank sees the same loss (it is all-reduced), so every rank reaches the same verdict without
talking to the others. A step is:

- a **loss spike** when its loss exceeds what the previous ``window`` healthy losses expect — a line
  fitted to them, since early in a run the loss falls fast — by ``spike_zscore`` standard
  deviations of their residuals (floored at ``min_std_fraction`` of their mean, so a flat curve is
  not infinitely sensitive), or exceeds ``spike_ratio`` × their mean; either test triggers, from
  :data:`JUDGE_FROM` healthy steps on (a spike early in a run is caught too). Spikes do not enter
  the history.
- a **gradient explosion** when its grad norm (before clipping) exceeds ``grad_norm_rollback`` for
  ``max_bad_steps`` steps in a row: treated like a spike that began at the first of them.
- **non-finite** when its loss is NaN/Inf, or its grad norm was and the step skipped — except
  under fp16, where skipped steps are the loss scaler's normal business. ``max_bad_steps`` of
  them in a row make a verdict.

The trainer acts on a verdict (``recovery.action``): ``alert`` reports it (console, a
``metrics.jsonl`` event, ``alert_command``); ``rollback`` also reloads the newest checkpoint from
before the trouble began, moves the checkpoints saved since then aside, and skips the global batches
that led to it (plus ``skip_batches``), as large runs do by hand.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import deque

from .errors import ConfigError

ACTIONS = ("rollback", "alert", "none")
JUDGE_FROM = 8  # healthy steps of history the spike test needs (or recovery.window, when smaller)


def check_recovery(action: str) -> None:
    """``recovery.action`` is one this module carries out."""
    if action not in ACTIONS:
        raise ConfigError(f"recovery.action={action!r} must be one of: {', '.join(ACTIONS)}"
                          + (" (YAML reads off/on/yes/no as booleans)"
                             if action in ("False", "True") else ""))


class RecoveryError(RuntimeError):
    """The run keeps failing after the allowed rollbacks; the message says what to do."""


class Detector:
    def __init__(self, spike_zscore: float = 6.0, window: int = 50, min_std_fraction: float = 0.02,
                 max_bad_steps: int = 3, fp16: bool = False, spike_ratio: float = float("inf"),
                 grad_norm_rollback: float = float("inf")):
        self.zscore, self.window, self.min_std_fraction = spike_zscore, window, min_std_fraction
        self.max_bad_steps, self.fp16 = max_bad_steps, fp16
        self.spike_ratio, self.grad_norm_rollback = spike_ratio, grad_norm_rollback
        # (iteration, loss) of healthy steps
        self.history: deque[tuple[int, float]] = deque(maxlen=window)
        self.bad_run: list[int] = []  # iterations of the current run of non-finite steps
        self.exploding: list[int] = []  # iterations of the current run of exploding grad norms

    @classmethod
    def from_config(cls, r, precision: str) -> Detector:
        """From the ``recovery`` config section."""
        return cls(r.spike_zscore, r.window, r.min_std_fraction, r.max_bad_steps,
                   fp16=precision == "fp16", spike_ratio=r.spike_ratio,
                   grad_norm_rollback=r.grad_norm_rollback)

    def baseline(self, iteration: int | None = None) -> tuple[float, float] | None:
        """The loss the history expects at ``iteration`` and its (floored) standard deviation, once
        the history holds enough steps: a straight line fitted to it (early in a run the loss falls
        fast, and its mean lags far above the step at hand), its residuals' deviation; without an
        iteration, the history's mean and deviation."""
        if len(self.history) < min(self.window, JUDGE_FROM):
            return None
        its, losses = [float(i) for i, _ in self.history], [loss for _, loss in self.history]
        n, mean = len(losses), sum(losses) / len(losses)
        mean_it = sum(its) / n
        spread = sum((x - mean_it) ** 2 for x in its)
        slope = sum((x - mean_it) * (y - mean) for x, y in zip(its, losses)) / spread \
            if iteration and spread else 0.0
        fitted = [mean + slope * (x - mean_it) for x in its]
        dof = n - (2 if slope else 1)
        std = math.sqrt(sum((y - f) ** 2 for y, f in zip(losses, fitted)) / max(1, dof))
        expected = mean + slope * (iteration - mean_it) if slope else mean
        return expected, max(std, self.min_std_fraction * abs(mean))

    def observe(self, iteration: int, loss: float, skipped: bool,
                grad_norm: float = 0.0) -> dict | None:
        """Take one step's outcome; returns an alert (a dict) when it completes a verdict."""
        if not math.isfinite(loss) or (skipped and not self.fp16):
            self.bad_run.append(iteration)
            if len(self.bad_run) >= self.max_bad_steps:
                return {"kind": "non_finite", "since": self.bad_run[0], "iter": iteration,
                        "loss": loss, "steps": len(self.bad_run)}
            return None
        self.bad_run = []
        if grad_norm > self.grad_norm_rollback:
            self.exploding.append(iteration)
            if len(self.exploding) >= self.max_bad_steps:
                return {"kind": "grad_explosion", "since": self.exploding[0], "iter": iteration,
                        "loss": loss, "grad_norm": grad_norm, "threshold": self.grad_norm_rollback,
                        "steps": len(self.exploding)}
        else:
            self.exploding = []
        base, flat = self.baseline(iteration), self.baseline()
        if base is not None and (loss > base[0] + self.zscore * base[1] or
                                 loss > self.spike_ratio * flat[0]):
            expected, std = base
            return {"kind": "loss_spike", "since": iteration, "iter": iteration, "loss": loss,
                    "baseline": round(expected, 6), "std": round(std, 6),
                    "zscore": round((loss - expected) / std, 2),
                    "ratio": round(loss / flat[0], 3) if flat[0] else None}
        if not self.exploding:
            self.history.append((iteration, loss))
        return None

    def rewind(self, iteration: int) -> None:
        """Forget the steps after ``iteration`` (they are about to be trained again)."""
        kept = [(i, loss) for i, loss in self.history if i <= iteration]
        self.history = deque(kept, maxlen=self.window)
        self.bad_run, self.exploding = [], []


def describe(alert: dict) -> str:
    """One console line for an alert."""
    if alert["kind"] == "loss_spike":
        return (f"loss spike at iteration {alert['iter']}: {alert['loss']:.4f} against the "
                f"{alert['baseline']:.4f} ± {alert['std']:.4f} the last steps' trend expects "
                f"({alert['zscore']} standard deviations, {alert['ratio']}× the mean)")
    if alert["kind"] == "grad_explosion":
        return (f"gradient explosion: grad norm above {alert['threshold']:g} for {alert['steps']} "
                f"steps (iterations {alert['since']}–{alert['iter']}, last "
                f"{alert['grad_norm']:.3g})")
    return (f"{alert['steps']} non-finite steps in a row (iterations "
            f"{alert['since']}–{alert['iter']}, loss {alert['loss']})")


def check_spike_drill(cfg, iteration: int) -> str | None:
    """``faults.spike_at`` rehearses detection (and a rollback) in a run starting at ``iteration``:
    refuse one the detector cannot catch (too little history by then); return a warning when the
    rollback it rehearses would find no checkpoint from before it (the spike is still caught)."""
    spike, r, c = cfg.faults.spike_at, cfg.recovery, cfg.checkpoint
    if spike is None or r.action == "none" or spike <= iteration:
        return None
    # the first iteration the spike test can judge
    judged = iteration + min(r.window, JUDGE_FROM) + 1
    if spike < judged:
        raise ConfigError(f"faults.spike_at={spike} comes before the spike detector judges (from "
                          f"iteration {judged}: it needs {judged - iteration - 1} healthy steps "
                          f"first): use --faults.spike_at {judged} or later")
    first_save = (iteration // c.interval + 1) * c.interval if c.interval else None
    if r.action == "rollback" and iteration == 0 and (first_save is None or first_save >= spike):
        return (f"faults.spike_at={spike} rehearses a rollback (recovery.action=rollback) but no "
                f"checkpoint is saved before it (checkpoint.interval={c.interval}): the spike is "
                "caught, the rollback finds nothing to go back to; use --checkpoint.interval "
                f"{max(1, (spike - 1) // 2)} to rehearse it")
    return None


def run_alert_command(command: str | None, alert: dict) -> None:
    """Start ``command`` with the alert as JSON in $MEGAPRETRAIN_ALERT; training does not wait."""
    if not command:
        return
    env = dict(os.environ, MEGAPRETRAIN_ALERT=json.dumps(alert))
    try:
        subprocess.Popen(command, shell=True, env=env, stdin=subprocess.DEVNULL)
    except OSError as exc:
        print(f"warning: recovery.alert_command failed to start: {exc}", file=sys.stderr)
