"""What a run tells about itself as it goes and at its end: the steps' values read from the
device, its alerts (the health conditions of ``monitor/alerts.py`` and the stragglers, each
announced on the console, in metrics.jsonl, in TensorBoard and to ``recovery.alert_command``), the
loss-spike detector's verdicts, and its closing summary. :class:`RunWatch` is the trainer's
collaborator for them and owns their state (the health conditions, the stragglers' timings, the
detector's history); the trainer's read points hand it each step's values.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch.distributed as dist

from .monitor.alerts import AlertMonitor, Stragglers, describe_alert, describe_straggler
from .monitor.metrics import MetricsLogger, read_metrics
from .recovery import Detector, describe, run_alert_command


class RunWatch:
    """A run's alerts, the loss-spike detector and the closing summary. ``metrics``: the run's
    writer; ``log``: the trainer's console line (rank 0's)."""

    def __init__(self, cfg, ps, metrics: MetricsLogger, log: Callable[[str], None]):
        self.cfg, self.ps, self.metrics, self.log = cfg, ps, metrics, log
        self.is_logger = ps.rank == 0
        r = cfg.recovery
        self.detector = None if r.action == "none" else Detector.from_config(r, cfg.train.precision)
        self.alerts = AlertMonitor(cfg.alerts)
        self.stragglers = Stragglers(cfg.alerts.straggler_ratio, cfg.alerts.straggler_steps)
        # every rank's host name, gathered for straggler reports
        self.hosts: list[str] | None = None

    def observe(self, step: dict, stragglers: bool) -> dict | None:
        """A read step's alerts, and every logging interval (``stragglers``) the stragglers; returns
        the spike detector's verdict on it, already announced, when the run should roll back."""
        self._report_alerts(step, stragglers)
        alert = self.detector and self.detector.observe(step["iter"], step["loss"], step["skipped"],
                                                        step["grad_norm"])
        if not alert:
            return None
        self.log(f"alert: {describe(alert)}")
        self.metrics.event("alert", step["iter"], **{k: v for k, v in alert.items() if k != "iter"})
        if self.is_logger:
            run_alert_command(self.cfg.recovery.alert_command, self.alert_payload(alert))
        return alert if self.cfg.recovery.action == "rollback" else None

    def rewound(self, iteration: int) -> None:
        """Training went back to ``iteration`` (a rollback): the detector forgets what came
        after."""
        self.detector.rewind(iteration)

    def _report_alerts(self, stats: dict, stragglers: bool) -> None:
        """A step's alerts (start and clear), and every logging interval the stragglers."""
        tokens_per_sec = stats["global_batch_size"] * self.cfg.train.seq_length / stats["step_time"]
        for alert in self.alerts.observe(stats["iter"], stats["loss"], stats["grad_norm"],
                                         tokens_per_sec, stats["data_time"]):
            self._announce(alert, describe_alert(alert), stats["iter"])
        if self.ps.world_size == 1:
            return
        # not the wait
        self.stragglers.observe(stats["step_time"] - stats["grad_sync_time"], stats["data_time"])
        if stragglers:
            if self.hosts is None:
                self.hosts = [None] * self.ps.world_size
                dist.all_gather_object(self.hosts, socket.gethostname())
            for alert in self.stragglers.check(self.ps, self.hosts, stats["iter"]):
                self._announce(alert, describe_straggler(alert), stats["iter"])

    def _announce(self, alert: dict, line: str, iteration: int) -> None:
        """One alert: a console warning, an ``alert`` event in metrics.jsonl (a TensorBoard text
        entry too), and recovery.alert_command."""
        self.log(f"warning: {line}")
        self.metrics.event("straggler" if alert["kind"] == "straggler" else "alert", iteration,
                           **{k: v for k, v in alert.items() if k != "iter"})
        if self.is_logger:
            self.metrics.text("alerts", line, iteration)
            run_alert_command(self.cfg.recovery.alert_command, self.alert_payload(alert))

    def alert_payload(self, alert: dict) -> dict:
        """What recovery.alert_command receives: the alert and which run it is about (a webhook that
        several runs share tells them apart by it)."""
        return {**alert, "run": self.metrics.run_name, "run_dir": os.path.abspath(self.cfg.run.dir),
                "host": alert.get("host", socket.gethostname())}

    def summary(self, first_iter: int, first_samples: int, consumed_samples: int, seconds: float,
                saved: list[int]) -> dict:
        """What this launch did (from iteration ``first_iter`` and ``first_samples`` consumed to
        ``consumed_samples`` in ``seconds``, saving checkpoints at the iterations ``saved``), the
        run's latest and best validation loss, and where its files are (tensorboard: only when it is
        on)."""
        run, seq = self.cfg.run.dir, self.cfg.train.seq_length
        valid = [(r["iter"], r["valid_loss"]) for r in read_metrics(run)
                 if r.get("valid_loss") is not None] if self.is_logger else []
        best = min(valid, key=lambda v: v[1]) if valid else (None, None)
        # (no key of a training or an eval line: a reader that picks lines by their keys keeps away)
        return {"first_iter": first_iter,
                "trained_tokens": (consumed_samples - first_samples) * seq,
                "run_tokens": consumed_samples * seq, "seconds": round(seconds, 3),
                "last_valid_iter": valid[-1][0] if valid else None, "last_valid_loss": valid[-1][1]
                if valid else None, "best_valid_iter": best[0], "best_valid_loss": best[1],
                "checkpoints_written": [os.path.join(run, "checkpoints", f"iter_{i:07d}")
                                        for i in saved], "run_dir": run,
                "metrics": os.path.join(run, "metrics.jsonl"),
                "tensorboard": os.path.join(run, "tensorboard") if self.cfg.logging.tensorboard
                else None, "checkpoints": os.path.join(run, "checkpoints"),
                "config": os.path.join(run, "config.yaml")}
