"""Loss spikes and non-finite steps: the detector, alerts, and the rollback that reloads the newest
checkpoint from before the trouble and skips the data that caused it."""

from __future__ import annotations

import json
import math
import os
import random
import time

import pytest
import torch

from megapretrain.recovery import Detector, RecoveryError
from megapretrain.train import setup
from megapretrain.trainer import Trainer

from distributed import run_distributed
from helpers import BASE, records

GBS = 8  # BASE's global batch


# -- the detector -------------------------------------------------------------------------------


def test_a_noisy_falling_curve_raises_nothing():
    rng = random.Random(0)
    detector = Detector(spike_zscore=6.0, window=50)
    for i in range(1, 2001):
        loss = 2.0 + 4.0 * math.exp(-i / 300) + rng.gauss(0, 0.03)
        assert detector.observe(i, loss, skipped=False) is None, i


def test_a_spike_is_reported_and_kept_out_of_the_history():
    detector = Detector(spike_zscore=6.0, window=20)
    for i in range(1, 21):
        assert detector.observe(i, 3.0 + 0.01 * (-1) ** i, False) is None
    assert detector.observe(21, 3.02, False) is None  # within the floor of 2% of the mean
    alert = detector.observe(22, 4.0, False)
    assert alert["kind"] == "loss_spike" and alert["since"] == 22 and alert["zscore"] > 6
    assert all(loss < 3.1 for _, loss in detector.history)
    assert detector.observe(23, 3.0, False) is None
    assert detector.observe(24, 4.0, False)["kind"] == "loss_spike"  # the baseline was not dragged up


def test_non_finite_steps_count_in_a_row_and_fp16_skips_are_normal():
    detector = Detector(max_bad_steps=3)
    assert detector.observe(1, float("nan"), True) is None
    assert detector.observe(2, float("inf"), True) is None
    assert detector.observe(3, 3.0, False) is None  # the run is broken: start again
    assert detector.observe(4, 3.0, True) is None  # bf16 / fp32: a skipped step is non-finite grads
    assert detector.observe(5, float("nan"), False) is None
    alert = detector.observe(6, float("nan"), False)
    assert alert["kind"] == "non_finite" and alert["since"] == 4 and alert["steps"] == 3
    fp16 = Detector(max_bad_steps=2, fp16=True)
    assert all(fp16.observe(i, 3.0, True) is None for i in range(1, 20))  # loss scaling at work


def test_rewind_forgets_the_steps_to_be_trained_again():
    detector = Detector(window=10)
    for i in range(1, 11):
        detector.observe(i, 3.0, False)
    detector.rewind(6)
    assert [i for i, _ in detector.history] == [1, 2, 3, 4, 5, 6] and detector.baseline() is None


# -- the trainer --------------------------------------------------------------------------------


RECOVERY = ["--checkpoint.interval", "4", "--recovery.window", "4", "--recovery.spike_zscore", "4",
            "--recovery.min_std_fraction", "0.02", "--logging.interval", "1", "--schedule.decay_iters", "14"]


def _inject(bad: callable, seen: list):
    """Patch Trainer._load so that the training batches where ``bad(consumed_samples, trainer)`` is
    true hold random tokens (a corrupt shard: the loss jumps to about ln(vocab) and beyond)."""
    original = Trainer._load

    def load(self, split, consumed_samples):
        batches, wait = original(self, split, consumed_samples)
        if split == "train" and bad(consumed_samples, self):
            seen.append(consumed_samples)
            gen = torch.Generator().manual_seed(consumed_samples)
            batches = [(None if tok is None else torch.randint(0, 257, tok.shape, generator=gen),
                        None if tgt is None else torch.randint(0, 257, tgt.shape, generator=gen))
                       for tok, tgt in batches]
        return batches, wait
    return load


def _fit(run_dir, corpus, flags, bad, monkeypatch):
    seen: list = []
    monkeypatch.setattr(Trainer, "_load", _inject(bad, seen))
    trainer = setup(["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *BASE, "--train.iters", "14",
                     *RECOVERY, *flags])
    trainer.fit()
    return trainer, records(run_dir), seen


def test_a_corrupt_batch_is_rolled_back_and_skipped(corpus, tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    trainer, records, seen = _fit(run, corpus, [], lambda consumed, _: consumed == 10 * GBS, monkeypatch)
    alerts = [r for r in records if r.get("event") == "alert" and "state" not in r]  # recovery's verdicts
    rollbacks = [r for r in records if r.get("event") == "rollback"]
    assert [(a["kind"], a["iter"]) for a in alerts] == [("loss_spike", 11)]
    assert len(rollbacks) == 1
    rb = rollbacks[0]
    assert (rb["iter"], rb["from_iter"], rb["skipped_samples"]) == (8, 11, 3 * GBS)
    assert rb["checkpoint"].endswith("iter_0000008") and rb["set_aside"] == []
    assert seen == [10 * GBS]  # the corrupt batch was trained on once, then skipped
    steps = [r["iter"] for r in records if "loss" in r and "event" not in r]
    assert steps == list(range(1, 12)) + list(range(9, 15))  # 9-11 trained again, on later data
    assert trainer.iteration == 14 and trainer.consumed_samples == 17 * GBS
    losses = {r["iter"]: r["loss"] for r in records if "loss" in r and "event" not in r}  # the later value of each
    assert all(losses[i] < alerts[0]["baseline"] + 0.5 for i in range(9, 15))
    assert open(os.path.join(run, "checkpoints", "latest")).read().strip() == "iter_0000014"


def test_non_finite_steps_roll_back_past_a_checkpoint_that_holds_them(corpus, tmp_path, monkeypatch):
    """Grad norms at steps 12 and 13 are Inf (the optimizer skips them; the checkpoint at 12 is
    saved in between): the rollback goes to 8, sets iteration 12's checkpoint aside, and skips the
    data of steps 9-13 plus one batch. Twice the same way."""
    from megapretrain.optim.optimizer import MixedPrecisionAdamW

    norm, step = MixedPrecisionAdamW._norm, Trainer.train_step
    poisoned = {12, 13}
    state = {"broken": False, "hits": 0}

    def train_step(self):
        state["broken"] = self.iteration + 1 in poisoned and state["hits"] < len(poisoned)
        state["hits"] += state["broken"]
        return step(self)

    monkeypatch.setattr(Trainer, "train_step", train_step)
    monkeypatch.setattr(MixedPrecisionAdamW, "_norm",  # the grad norm as the step sees it (a device tensor)
                        lambda self, *a: torch.tensor(float("inf"), dtype=torch.float64) if state["broken"]
                        else norm(self, *a))
    runs = []
    for name in ("a", "b"):
        state["hits"] = 0
        run = str(tmp_path / name)
        _, records, _ = _fit(run, corpus, ["--recovery.skip_batches", "1", "--recovery.max_bad_steps", "2"],
                             lambda consumed, _: False, monkeypatch)
        runs.append((run, records))
    (run, records), (_, again) = runs
    keys = ("iter", "event", "loss", "grad_norm", "lr", "kind", "from_iter", "skipped_samples", "set_aside")
    timed = ("throughput", "data_wait", "straggler")  # alerts on timings differ from run to run

    def steady(rs):
        return [{k: r.get(k) for k in keys} for r in rs if r.get("kind") not in timed]

    assert steady(records) == steady(again)
    alert = [r for r in records if r.get("event") == "alert" and "state" not in r][0]
    assert (alert["kind"], alert["since"], alert["iter"], alert["steps"]) == ("non_finite", 12, 13, 2)
    assert [r["iter"] for r in records if r.get("event") == "skipped_step"] == [12, 13]
    rb = [r for r in records if r.get("event") == "rollback"][0]
    assert (rb["iter"], rb["from_iter"], rb["skipped_samples"]) == (8, 13, (5 + 1) * GBS)
    assert rb["set_aside"] == ["iter_0000012"]
    kept = os.listdir(os.path.join(run, "checkpoints"))
    assert any(d.startswith("iter_0000012.rolled-back-") for d in kept)  # kept, not deleted
    assert "iter_0000012" in kept and "iter_0000014" in kept  # saved again after the rollback


def test_alert_only_reports_and_goes_on(corpus, tmp_path, monkeypatch):
    out = tmp_path / "alert.json"
    command = f"echo \"$MEGAPRETRAIN_ALERT\" >> {out}"  # every alert is handed over: timing ones too
    _, records, seen = _fit(str(tmp_path / "run"), corpus, ["--recovery.action", "alert",
                                                            "--recovery.alert_command", command],
                            lambda consumed, _: consumed == 10 * GBS, monkeypatch)
    assert [r["kind"] for r in records if r.get("event") == "alert" and "state" not in r] == ["loss_spike"]
    assert not [r for r in records if r.get("event") == "rollback"]
    assert [r["iter"] for r in records if "loss" in r and "event" not in r] == list(range(1, 15)) and seen == [10 * GBS]
    deadline = time.time() + 10

    def handed() -> list[str]:
        return [json.loads(line)["kind"] for line in out.read_text().splitlines() if line.strip()] \
            if out.exists() else []

    while "loss_spike" not in handed() and time.time() < deadline:
        time.sleep(0.05)
    assert "loss_spike" in handed()


def test_trouble_that_persists_stops_after_max_rollbacks(corpus, tmp_path, monkeypatch):
    with pytest.raises(RecoveryError, match="1 rollbacks already"):  # every batch from iteration 11 on
        _fit(str(tmp_path / "run"), corpus, ["--recovery.max_rollbacks", "1"],
             lambda consumed, trainer: trainer.iteration >= 10, monkeypatch)


def _fit_rank(rank, world, run_dir, corpus, layout):
    trainer_load = Trainer._load
    seen: list = []

    Trainer._load = _inject(lambda consumed, _: consumed == 10 * GBS, seen)
    try:
        trainer = setup(["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *BASE, "--train.iters", "14",
                         *RECOVERY, *layout])
        trainer.fit()
    finally:
        Trainer._load = trainer_load
    return trainer.iteration, trainer.last_loss


@pytest.mark.slow
def test_every_rank_rolls_back_together(corpus, tmp_path):
    """pp=2 × dp=2: the verdict comes from the all-reduced loss, so all four ranks roll back at the
    same step and finish with the single-process run's rolled-back losses."""
    results = run_distributed(_fit_rank, 4, str(tmp_path / "run"), corpus,
                              ["--parallel.pp", "2", "--parallel.zero", "1"], timeout=300)
    reference = run_distributed(_fit_rank, 1, str(tmp_path / "single"), corpus, [], timeout=300)[0]
    assert all(it == 14 for it, _ in results)
    assert all(loss == pytest.approx(reference[1], rel=1e-5) for _, loss in results)
    rows = records(str(tmp_path / "run"))
    assert [r["from_iter"] for r in rows if r.get("event") == "rollback"] == [11]
