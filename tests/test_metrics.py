"""monitor/metrics.py: the metrics.jsonl reader, TensorBoard's custom-scalars layout, and wandb
continuing one run across resumes (a stand-in wandb module, so no account or network is needed)."""

from __future__ import annotations

import re
import sys
import types

import pytest

from megapretrain.errors import DataError, MissingFileError
from megapretrain.monitor.metrics import TENSORBOARD_LAYOUT, MetricsLogger, read_metrics, training_records

from helpers import wandb_history


def test_read_metrics_drops_a_cut_last_line_and_names_other_damage(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iter": 1, "loss": 2.0}\n{"iter": 1, "event": "resumed"}\n{"iter": 2, "lo')
    records = read_metrics(str(tmp_path))
    assert records == [{"iter": 1, "loss": 2.0}, {"iter": 1, "event": "resumed"}]
    assert training_records(records) == [{"iter": 1, "loss": 2.0}]
    path.write_text('{"iter": 1, "loss": 2.0}\ngarbage\n{"iter": 2, "loss": 1.0}\n')
    with pytest.raises(DataError, match="line 2 is not JSON"):
        read_metrics(str(path))
    with pytest.raises(MissingFileError, match="metrics.jsonl"):
        read_metrics(str(tmp_path / "nowhere"))


def test_tensorboard_layout_groups_the_dashboard_panels(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(str(tmp_path), enabled=True, tensorboard=True)
    logger.log({"iter": 1, "loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec": 10.0, "step_time": 0.1,
                "data_time": 0.01})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert "custom_scalars__config__" in events.Tags()["tensors"]
    assert {"loss", "grad_norm", "lr", "tokens_per_sec"} <= set(events.Tags()["scalars"])
    charts = {chart: tags for section in TENSORBOARD_LAYOUT.values() for chart, (_, tags) in section.items()}

    def chart_of(tag):
        return [c for c, regexes in charts.items() if any(re.search(r, tag) for r in regexes)]

    assert chart_of("loss") == ["loss"] and chart_of("valid_loss") == ["loss"]
    assert chart_of("step_time") == chart_of("checkpoint_stall_s") == ["time breakdown (s)"]
    assert chart_of("tokens_per_sec") == ["tokens/s"] and chart_of("mfu") == ["MFU"]


def test_wandb_resumes_the_run_whose_id_the_run_directory_keeps(tmp_path, monkeypatch):
    inits = []

    class FakeRun:
        def log(self, scalars, step):
            pass

        def finish(self):
            pass

    fake = types.SimpleNamespace(init=lambda **kw: inits.append(kw) or FakeRun())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for _ in range(2):  # the first start, then a resume of the same run directory
        logger = MetricsLogger(str(tmp_path), enabled=True, tensorboard=False, wandb=True, run_name="r")
        logger.log({"iter": 1, "loss": 1.0})
        logger.close()
    first = (tmp_path / "wandb_id").read_text().strip()
    assert [kw["id"] for kw in inits] == [first, first] and all(kw["resume"] == "allow" for kw in inits)
    other = tmp_path / "other"
    other.mkdir()
    MetricsLogger(str(other), enabled=True, tensorboard=False, wandb=True).close()
    assert inits[-1]["id"] != first  # another run directory: another wandb run


def test_real_wandb_offline_resumes_one_run_id(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    ids = []
    for _ in range(2):
        logger = MetricsLogger(str(tmp_path), enabled=True, tensorboard=False, wandb=True, run_name="r")
        ids.append(logger._wandb.id)
        logger.log({"iter": len(ids), "loss": 1.0 / len(ids), "lr": 1e-3})
        logger.close()
    assert ids[0] == ids[1] == (tmp_path / "wandb_id").read_text().strip()
    rows = wandb_history(str(tmp_path))  # what wandb recorded, read back from its own files
    assert sorted((row["_step"], row["loss"], row["lr"]) for row in rows) == [(1, 1.0, 1e-3), (2, 0.5, 1e-3)]
