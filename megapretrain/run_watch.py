"""What a run tells about itself as it goes and at its end: the steps' values read from the
device, its alerts (the health conditions of ``monitor/alerts.py`` and the stragglers, each
announced on the console, in metrics.jsonl, in TensorBoard and to ``recovery.alert_command``), the
loss-spike detector's verdicts, and its closing summary. A part of
:class:`megapretrain.trainer.Trainer`, kept apart so that the training loop reads on its own; it
works on the trainer's own fields (the config, the parallel state, the writers, the progress).

**Read points.** A training step reads nothing back from the device (on a GPU each read waits for
every kernel queued before it, and the host stops running ahead). Its loss, grad norm and skip
flag stay device tensors until a read point — a logging step (``logging.interval``), an
evaluation, a checkpoint save, the last step; with fp16 every step, whose loss scale the next
step needs — where every unread step's values come back in one copy. Then each step, in order,
settles the optimizer (a skipped step is not counted) and goes through the alerts and the spike
detector as it would have at once. What waits for the read point, and why that keeps behaviour:

- a non-finite step is skipped on the device when it happens (``MixedPrecisionAdamW.step_on_device``);
- a verdict of the detector rolls back to the checkpoint from before the trouble began, skipping
  the batches up to the step that completed the verdict (as at once): the steps trained since then
  are dropped with the rollback, and no checkpoint is saved in between (a save is a read point);
- a stop signal (SIGTERM, SIGUSR1, Ctrl-C) and ``checkpoint.interval_minutes``: one process acts
  on them at the next step boundary as before; several processes must agree on them (a
  collective and a read), which they do at the read points only, so the save comes up to
  ``logging.interval - 1`` steps later.
"""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist

from .monitor.alerts import describe_alert, describe_straggler
from .monitor.metrics import read_metrics
from .recovery import run_alert_command


class RunWatch:
    """The trainer's alerts and summary (a base class of ``Trainer``)."""

    def _read_now(self, last_save: float) -> bool:
        """Whether the step just taken must be read although nothing scheduled asks for it: every
        step with fp16 (the next one's loss scale depends on it); with one process, a stop signal
        or a save the clock asks for (acted on at once: there is no other rank to agree with)."""
        if self.optimizer.scaler.dynamic:
            return True
        minutes = self.cfg.checkpoint.interval_minutes
        return self.ps.world_size == 1 and (self._stop_requested is not None or
                                            (minutes > 0 and time.monotonic() - last_save > 60 * minutes))

    def _read_steps(self, logged: bool) -> bool:
        """Read the unread steps' values in one copy and act on each in order: the optimizer's
        settling, the logged line (the last step, when ``logged``), the alerts and the spike
        detector. Returns True when a verdict rolled training back (the steps after it dropped)."""
        steps, self._unread = self._unread, []
        checks, self.optimizer.buffers.grad_scale_checks = self.optimizer.buffers.grad_scale_checks, []
        # the mean loss divided on the device: the token count is a device value under data.eod_mask_loss
        values = [v.double() for s in steps
                  for v in (s["loss_sum"].double() / s["tokens"], s["grad_norm"], s["skipped"])]
        flag = torch.stack(checks).any().double() if checks else torch.zeros((), dtype=torch.float64,
                                                                                   device=self.device)
        *read, differs = torch.stack(values + [flag.to(self.device)]).tolist()  # the one host read
        if differs:
            raise RuntimeError("a backward brought the fused loss another gradient than the one its forward "
                               "was told (loss_grad_scale): the trainer's forward and backward disagree")
        now = time.perf_counter()
        for i, s in enumerate(steps):
            loss, norm, skipped = read[3 * i:3 * i + 3]
            self.optimizer.settle(bool(skipped))
            s.update(loss=loss, grad_norm=norm, skipped=bool(skipped))
        last = steps[-1]  # its times run to now: on a GPU the read waited for every step queued
        last.update(step_time=now - last["started"], optimizer_time=now - last["optimizer_started"])
        self.last_loss = last["loss"]
        tokens = sum(s["global_batch_size"] for s in steps) * self.cfg.train.seq_length
        for s in steps:
            if logged and s is last:
                self._log_step(s, tokens / (now - steps[0]["started"]))
            self._report_alerts(s, stragglers=logged and s is last)
            alert = self.detector and self.detector.observe(s["iter"], s["loss"], s["skipped"], s["grad_norm"])
            if alert and self._on_alert(alert, s["iter"], s["consumed_samples"]):
                return True
        return False

    def _report_alerts(self, stats: dict, stragglers: bool) -> None:
        """A step's alerts (start and clear), and every logging interval the stragglers."""
        tokens_per_sec = stats["global_batch_size"] * self.cfg.train.seq_length / stats["step_time"]
        for alert in self.alerts.observe(stats["iter"], stats["loss"], stats["grad_norm"], tokens_per_sec,
                                         stats["data_time"]):
            self._announce(alert, describe_alert(alert), stats["iter"])
        if self.ps.world_size == 1:
            return
        self.stragglers.observe(stats["step_time"] - stats["grad_sync_time"], stats["data_time"])  # not the wait
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
