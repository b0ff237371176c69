"""Which checkpoints are kept (keep_last, keep_every, milestones, rollbacks), and what a load takes
(checkpoint.load_optimizer, load_rng, and a continued-pretraining start from weights only)."""

from __future__ import annotations

import os

import torch

from megapretrain.checkpoint.format import rank_state, read_rank_state
from megapretrain.checkpoint.manager import CheckpointManager, milestone_iterations, retained
from megapretrain.train import main, setup

from helpers import ckpt_dir, optimizer_checkpoint, records, run_argv


def _kept(root):
    return sorted(int(d[5:]) for d in os.listdir(root) if d.startswith("iter_") and d[5:].isdigit())


def test_retention_rule():
    assert milestone_iterations(0.25, 60) == [15.0, 30.0, 45.0, 60.0]
    assert milestone_iterations(0.0, 60) == []
    assert retained(list(range(1, 61)), 3, 20, [15, 30, 45, 60]) == {15, 20, 30, 40, 45, 58, 59, 60}
    assert retained([4, 8, 12, 16], 1, 0, [10]) == {8, 16}  # the newest at or before 10
    assert retained([1, 2, 3], 0) == {1, 2, 3}  # keep_last 0: everything


def test_retention_over_a_long_run_of_small_intervals_with_a_rollback(tmp_path):
    manager = CheckpointManager(str(tmp_path), rank=0, world_size=1, layout={"tp": 1, "pp": 1, "dp": 1},
                                vocab_size=8, padded_vocab=8, keep_last=3, keep_every=20,
                                milestones=milestone_iterations(0.25, 60), tensors={"w": (2,)})
    root = manager.root

    def save(i):
        manager.save(i, rank_state(iteration=i, consumed_samples=i, model={"w": torch.full((2,), float(i))},
                                   optimizer_step=i, moments={"w": {}}, scaler=None))

    for i in range(1, 41):
        save(i)
        expect = sorted(retained(list(range(1, i + 1)), 3, 20, [15, 30, 45, 60]))
        assert _kept(root) == expect, i  # after every save, exactly the rule's set
    moved = manager.set_aside_from(37, keep=os.path.join(root, "iter_0000036"))
    assert moved == ["iter_0000038", "iter_0000039", "iter_0000040"]  # 37 was already dropped
    assert open(os.path.join(root, "latest")).read().strip() == "iter_0000036"
    for i in range(37, 61):
        save(i)
    assert _kept(root) == [15, 20, 30, 40, 45, 58, 59, 60]
    aside = [d for d in os.listdir(root) if ".rolled-back-" in d]
    assert len(aside) == 3  # keep_last of them
    assert open(os.path.join(root, "latest")).read().strip() == "iter_0000060"
    assert not [d for d in os.listdir(root) if d.startswith(".")]  # no temporary left


def test_the_trainer_keeps_last_every_and_milestones(corpus, tmp_path):
    run = tmp_path / "run"
    assert main(run_argv(run, corpus, 12, "--checkpoint.interval", "1", "--checkpoint.keep_last", "2",
                      "--checkpoint.keep_every", "5", "--checkpoint.milestone_fraction", "0.25")) == 0
    assert _kept(run / "checkpoints") == [3, 5, 6, 9, 10, 11, 12]


def test_load_optimizer_load_rng_and_finetune(corpus, tmp_path):
    def args(*a):  # dropout: training draws random numbers, so the saved streams are not the seed's
        return run_argv(*a, "--model.hidden_dropout", "0.1")

    src = tmp_path / "src"
    assert main(args(src, corpus, 3, "--checkpoint.interval", "0")) == 0
    saved = read_rank_state(ckpt_dir(src, 3), 0)

    t = setup(args(tmp_path / "a", corpus, 6, "--checkpoint.load", str(src), "--checkpoint.load_optimizer", "false"))
    assert (t.iteration, t.consumed_samples, t.optimizer.step_count) == (3, 24, 0)
    assert all(float(s.exp_avg.abs().sum()) == 0 for s in t.optimizer.shards)
    t.lock.release()

    t = setup(args(tmp_path / "b", corpus, 6, "--checkpoint.load", str(src), "--checkpoint.load_rng", "false"))
    assert t.optimizer.step_count == 3 and not torch.equal(torch.get_rng_state(), saved["rng"]["cpu"])
    t.lock.release()
    t = setup(args(tmp_path / "c", corpus, 6, "--checkpoint.load", str(src)))
    assert torch.equal(torch.get_rng_state(), saved["rng"]["cpu"])
    t.lock.release()

    run = tmp_path / "continued"  # weights only: a new run with a fresh schedule and data position
    argv = args(run, corpus, 2, "--checkpoint.load", str(src), "--checkpoint.finetune", "true")
    t = setup(argv)
    assert (t.iteration, t.consumed_samples, t.optimizer.step_count) == (0, 0, 0)
    weights = optimizer_checkpoint(t.optimizer)["model"]
    assert all(torch.equal(weights[k], saved["model"][k]) for k in saved["model"])
    t.fit()
    assert [r["iter"] for r in records(run, "loss")] == [1, 2]
    assert records(run, "lr")[0]["lr"] == records(src, "lr")[0]["lr"]  # the schedule starts over
    argv[argv.index("--train.iters") + 1] = "4"
    t = setup(argv)  # the same command again: resumes the new run's own checkpoint, not the source
    assert t.iteration == 2 and t.optimizer.step_count == 2
    t.lock.release()
