"""Where metrics go: metrics.jsonl (the contract), TensorBoard, optionally Weights & Biases.

Only one rank writes (the trainer passes ``enabled`` for it); every record is one JSON line.
"""

from __future__ import annotations

import json
import math
import os
import time


class MetricsLogger:
    def __init__(self, run_dir: str, *, enabled: bool, tensorboard: bool, wandb: bool = False,
                 config: dict | None = None, run_name: str = ""):
        self.enabled = enabled
        self._jsonl = self._tb = self._wandb = None
        if not enabled:
            return
        self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        if wandb:
            try:
                import wandb as wandb_mod
            except ImportError:
                raise RuntimeError("logging.wandb=true needs wandb: pip install 'megapretrain[wandb]'") from None
            self._wandb = wandb_mod.init(project="megapretrain", name=run_name or None, config=config,
                                         dir=run_dir, resume="allow")

    def log(self, record: dict) -> None:
        """Write one record; numeric fields other than ``iter`` also go to TensorBoard/wandb."""
        if not self.enabled:
            return
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._jsonl.write(json.dumps(record) + "\n")
        step = record.get("iter")
        scalars = {k: v for k, v in record.items()
                   if k != "iter" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None and step is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None and step is not None:
            self._wandb.log(scalars, step=step)

    def event(self, name: str, iteration: int, **fields) -> None:
        self.log({"iter": iteration, "event": name, "time": round(time.time(), 3), **fields})

    def flush(self) -> None:
        if self._jsonl is not None:
            self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
