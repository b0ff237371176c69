"""Where metrics go: metrics.jsonl (the contract), TensorBoard, optionally Weights & Biases.

Only one rank writes (the trainer passes ``enabled`` for it); every record is one JSON line.
:func:`read_metrics` is the one reader of that file (the plotting tools and the pre-flight check
use it). TensorBoard gets a custom-scalars layout that groups the same panels as
``tools/plot_run.py``'s dashboard; wandb keeps its run id in ``RUN_DIR/wandb_id`` so a resumed run
continues the same wandb run instead of opening a new one.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time

from ..errors import DataError, MissingFileError, MissingPackageError
from ..user_files import check_kind

# TensorBoard's custom-scalars page: the dashboard's panels, each a list of tag regexes
TENSORBOARD_LAYOUT = {
    "training": {
        "loss": ["Multiline", [r"^loss$", r"^valid_loss$"]],
        "grad norm": ["Multiline", [r"^grad_norm$"]],
        "learning rate": ["Multiline", [r"^lr$"]],
        "loss scale (fp16)": ["Multiline", [r"^loss_scale$"]],
        # eval.tasks: "<task>/acc", "<task>/acc_norm"
        "downstream accuracy": ["Multiline", [r"/acc$", r"/acc_norm$"]],
    },
    "speed": {
        "tokens/s": ["Multiline", [r"^tokens_per_sec$"]],
        "MFU": ["Multiline", [r"^mfu$"]],
        "memory (MB)": ["Multiline", [r"^memory_mb$"]],
        "time breakdown (s)": ["Multiline",
                               [r"^[a-z_.]*_time$", r"^(?!elapsed_s$|eta_s$)[a-z_.]*_s$"]],
        "elapsed and left (s)": ["Multiline", [r"^elapsed_s$", r"^eta_s$"]], },
}


class MetricsLogger:
    def __init__(self, run_dir: str, *, enabled: bool, tensorboard: bool, wandb: bool = False,
                 config: dict | None = None, run_name: str = ""):
        self.enabled, self.run_name = enabled, run_name
        self._jsonl = self._tb = self._wandb = None
        if not enabled:
            return
        self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
            self._tb.add_custom_scalars(TENSORBOARD_LAYOUT)
        if wandb:
            self._wandb = _init_wandb(run_dir, run_name, config)

    def log(self, record: dict) -> None:
        """Write one record; numeric fields other than ``iter`` also go to TensorBoard/wandb."""
        if not self.enabled:
            return
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k,
                  v in record.items()}
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

    def text(self, tag: str, text: str, step: int) -> None:
        """A text entry (an alert line) for TensorBoard; metrics.jsonl has the event already."""
        if self._tb is not None:
            self._tb.add_text(tag, text, step)

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


def _init_wandb(run_dir: str, run_name: str, config: dict | None):
    """A wandb run whose id is kept in ``RUN_DIR/wandb_id``: the first start writes it, every
    resume of the same run directory continues that wandb run (``resume="allow"``)."""
    try:
        import wandb
    except ImportError:
        raise MissingPackageError("logging.wandb=true needs wandb: pip install "
                                  "'megapretrain[wandb]'") from None
    id_path = os.path.join(run_dir, "wandb_id")
    if os.path.exists(id_path):
        with open(id_path) as fh:
            run_id = fh.read().strip()
    else:
        # any letters and digits do (wandb's own helper moved between releases)
        run_id = secrets.token_hex(4)
        with open(id_path, "w") as fh:
            fh.write(run_id + "\n")
    return wandb.init(project="megapretrain", name=run_name or None, config=config, dir=run_dir,
                      id=run_id, resume="allow")


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics.jsonl (a run directory or the file), in the order written. A
    truncated last line — a run killed mid-write — is dropped; damage elsewhere is an error."""
    check_kind("", path, "a run's metrics", "give a run directory that a training run wrote (it "
               "holds metrics.jsonl)",
               also=("a megapretrain run directory", "a run's metrics.jsonl"))
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.exists(path):
        raise MissingFileError(f"{path} not found; give a run directory that a training run wrote "
                               "(it holds metrics.jsonl)")
    with open(path, encoding="utf-8", errors="replace") as fh:  # a binary file: not JSON below
        lines = fh.read().split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number >= len(lines) - 1:  # the last line: cut short by a crash
                break
            raise DataError(f"{path} line {number} is not JSON; metrics.jsonl holds one JSON "
                            "object per line") from None
        if isinstance(record, dict):
            records.append(record)
    return records


def training_records(records: list[dict]) -> list[dict]:
    """The per-step training lines (``iter`` and ``loss``, no ``event``)."""
    return [r for r in records if "loss" in r and "iter" in r and "event" not in r]
