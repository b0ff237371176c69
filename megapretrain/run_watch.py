"""What a run tells about itself as it goes and at its end: its alerts (the health conditions of
``monitor/alerts.py`` and the stragglers, each announced on the console, in metrics.jsonl, in
TensorBoard and to ``recovery.alert_command``) and its closing summary. A part of
:class:`megapretrain.trainer.Trainer`, kept apart so that the training loop reads on its own; it
works on the trainer's own fields (the config, the parallel state, the writers, the progress)."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from .monitor.alerts import describe_alert, describe_straggler
from .monitor.metrics import read_metrics
from .recovery import run_alert_command


class RunWatch:
    """The trainer's alerts and summary (a base class of ``Trainer``)."""

    def _report_alerts(self, stats: dict, stragglers: bool) -> None:
        """This step's alerts (start and clear), and every logging interval the stragglers."""
        tokens_per_sec = stats["global_batch_size"] * self.cfg.train.seq_length / stats["step_time"]
        for alert in self.alerts.observe(self.iteration, stats["loss"], stats["grad_norm"], tokens_per_sec,
                                         stats["data_time"]):
            self._announce(alert, describe_alert(alert))
        if self.ps.world_size == 1:
            return
        self.stragglers.observe(stats["step_time"] - stats["grad_sync_time"], stats["data_time"])  # not the wait
        if stragglers:
            if self.hosts is None:
                self.hosts = [None] * self.ps.world_size
                dist.all_gather_object(self.hosts, socket.gethostname())
            for alert in self.stragglers.check(self.ps, self.hosts, self.iteration):
                self._announce(alert, describe_straggler(alert))

    def _announce(self, alert: dict, line: str) -> None:
        """One alert: a console warning, an ``alert`` event in metrics.jsonl (a TensorBoard text
        entry too), and recovery.alert_command."""
        self.log(f"warning: {line}")
        self.metrics.event("straggler" if alert["kind"] == "straggler" else "alert", self.iteration,
                           **{k: v for k, v in alert.items() if k != "iter"})
        if self.is_logger:
            self.metrics.text("alerts", line, self.iteration)
            run_alert_command(self.cfg.recovery.alert_command, self.alert_payload(alert))

    def alert_payload(self, alert: dict) -> dict:
        """What recovery.alert_command receives: the alert and which run it is about (a webhook that
        several runs share tells them apart by it)."""
        return {**alert, "run": self.metrics.run_name, "run_dir": os.path.abspath(self.cfg.run.dir),
                "host": alert.get("host", socket.gethostname())}

    def _summary(self, first_iter: int, first_samples: int) -> dict:
        """What this launch did (steps, tokens, time, checkpoints), the run's latest and best
        validation loss, and where its files are (tensorboard: only when it is on)."""
        run, seq = self.cfg.run.dir, self.cfg.train.seq_length
        valid = [(r["iter"], r["valid_loss"]) for r in read_metrics(run)
                 if r.get("valid_loss") is not None] if self.is_logger else []
        best = min(valid, key=lambda v: v[1]) if valid else (None, None)
        # (no key of a training or an eval line: a reader that picks lines by their keys keeps away)
        return {"first_iter": first_iter, "trained_tokens": (self.consumed_samples - first_samples) * seq,
                "run_tokens": self.consumed_samples * seq, "seconds": round(self.progress.elapsed_s, 3),
                "last_valid_iter": valid[-1][0] if valid else None,
                "last_valid_loss": valid[-1][1] if valid else None,
                "best_valid_iter": best[0], "best_valid_loss": best[1],
                "checkpoints_written": [os.path.join(run, "checkpoints", f"iter_{i:07d}") for i in self.saved],
                "run_dir": run, "metrics": os.path.join(run, "metrics.jsonl"),
                "tensorboard": os.path.join(run, "tensorboard") if self.cfg.logging.tensorboard else None,
                "checkpoints": os.path.join(run, "checkpoints"), "config": os.path.join(run, "config.yaml")}
