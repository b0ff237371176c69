"""Loss spikes and non-finite steps: detection, alerts and the rollback policy's bookkeeping.

Every rank sees the same loss (it is all-reduced), so every rank reaches the same verdict without
talking to the others. A step is:

- a **loss spike** when its loss exceeds the mean of the previous ``window`` healthy losses by
  ``spike_zscore`` standard deviations (the deviation floored at ``min_std_fraction`` of the mean,
  so a flat curve is not infinitely sensitive), or exceeds ``spike_ratio`` × that mean; either
  test triggers. Spikes do not enter the history.
- a **gradient explosion** when its grad norm (before clipping) exceeds ``grad_norm_rollback`` for
  ``max_bad_steps`` steps in a row: treated like a spike that began at the first of them.
- **non-finite** when its loss is NaN/Inf, or its grad norm was and the step skipped — except
  under fp16, where skipped steps are the loss scaler's normal business. ``max_bad_steps`` of
  them in a row make a verdict.

The trainer acts on a verdict (``recovery.action``): ``alert`` reports it (console, a ``metrics.jsonl``
event, ``alert_command``); ``rollback`` also reloads the newest checkpoint from before the trouble
began, moves the checkpoints saved since then aside, and skips the global batches that led to it
(plus ``skip_batches``), as large runs do by hand.
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


def check_recovery(action: str) -> None:
    """``recovery.action`` is one this module carries out."""
    if action not in ACTIONS:
        raise ConfigError(f"recovery.action={action!r} must be one of: {', '.join(ACTIONS)}"
                          + (" (YAML reads off/on/yes/no as booleans)" if action in ("False", "True") else ""))


class RecoveryError(RuntimeError):
    """The run keeps failing after the allowed rollbacks; the message says what to do."""


class Detector:
    def __init__(self, spike_zscore: float = 6.0, window: int = 50, min_std_fraction: float = 0.01,
                 max_bad_steps: int = 3, fp16: bool = False, spike_ratio: float = float("inf"),
                 grad_norm_rollback: float = float("inf")):
        self.zscore, self.window, self.min_std_fraction = spike_zscore, window, min_std_fraction
        self.max_bad_steps, self.fp16 = max_bad_steps, fp16
        self.spike_ratio, self.grad_norm_rollback = spike_ratio, grad_norm_rollback
        self.history: deque[tuple[int, float]] = deque(maxlen=window)  # (iteration, loss) of healthy steps
        self.bad_run: list[int] = []  # iterations of the current run of non-finite steps
        self.exploding: list[int] = []  # iterations of the current run of exploding grad norms

    @classmethod
    def from_config(cls, r, precision: str) -> Detector:
        """From the ``recovery`` config section."""
        return cls(r.spike_zscore, r.window, r.min_std_fraction, r.max_bad_steps, fp16=precision == "fp16",
                   spike_ratio=r.spike_ratio, grad_norm_rollback=r.grad_norm_rollback)

    def baseline(self) -> tuple[float, float] | None:
        """Mean and (floored) standard deviation of the history, once it is full."""
        if len(self.history) < self.window:
            return None
        losses = [loss for _, loss in self.history]
        mean = sum(losses) / len(losses)
        std = math.sqrt(sum((x - mean) ** 2 for x in losses) / (len(losses) - 1))
        return mean, max(std, self.min_std_fraction * abs(mean))

    def observe(self, iteration: int, loss: float, skipped: bool, grad_norm: float = 0.0) -> dict | None:
        """Take one step's outcome; returns an alert (a dict) when it completes a verdict."""
        if not math.isfinite(loss) or (skipped and not self.fp16):
            self.bad_run.append(iteration)
            if len(self.bad_run) >= self.max_bad_steps:
                return {"kind": "non_finite", "since": self.bad_run[0], "iter": iteration, "loss": loss,
                        "steps": len(self.bad_run)}
            return None
        self.bad_run = []
        if grad_norm > self.grad_norm_rollback:
            self.exploding.append(iteration)
            if len(self.exploding) >= self.max_bad_steps:
                return {"kind": "grad_explosion", "since": self.exploding[0], "iter": iteration, "loss": loss,
                        "grad_norm": grad_norm, "threshold": self.grad_norm_rollback, "steps": len(self.exploding)}
        else:
            self.exploding = []
        base = self.baseline()
        if base is not None and (loss > base[0] + self.zscore * base[1] or loss > self.spike_ratio * base[0]):
            mean, std = base
            return {"kind": "loss_spike", "since": iteration, "iter": iteration, "loss": loss,
                    "baseline": round(mean, 6), "std": round(std, 6), "zscore": round((loss - mean) / std, 2),
                    "ratio": round(loss / mean, 3) if mean else None}
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
        return (f"loss spike at iteration {alert['iter']}: {alert['loss']:.4f} against {alert['baseline']:.4f} "
                f"± {alert['std']:.4f} over the last steps ({alert['zscore']} standard deviations, "
                f"{alert['ratio']}× the mean)")
    if alert["kind"] == "grad_explosion":
        return (f"gradient explosion: grad norm above {alert['threshold']:g} for {alert['steps']} steps "
                f"(iterations {alert['since']}–{alert['iter']}, last {alert['grad_norm']:.3g})")
    return (f"{alert['steps']} non-finite steps in a row (iterations {alert['since']}–{alert['iter']}, "
            f"loss {alert['loss']})")


def run_alert_command(command: str | None, alert: dict) -> None:
    """Start ``command`` with the alert as JSON in $MEGAPRETRAIN_ALERT; training does not wait."""
    if not command:
        return
    env = dict(os.environ, MEGAPRETRAIN_ALERT=json.dumps(alert))
    try:
        subprocess.Popen(command, shell=True, env=env, stdin=subprocess.DEVNULL)
    except OSError as exc:
        print(f"warning: recovery.alert_command failed to start: {exc}", file=sys.stderr)
