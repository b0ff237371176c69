"""End to end in one process: the loss falls, resume is bitwise exact, bad input fails cleanly."""

from __future__ import annotations

import os

import pytest
import torch

from megapretrain.train import main

from helpers import TINY, records, train_tiny


def test_loss_falls_and_run_dir_is_complete(tmp_path, corpus):
    run = tmp_path / "run"
    assert train_tiny(run, corpus, "--train.iters", "40", "--train.eval_interval", "20",
                 "--train.eval_iters", "2", "--checkpoint.interval", "20", "--logging.tensorboard", "true") == 0
    losses = [r["loss"] for r in records(run, "loss")]
    assert len(losses) == 40 and losses[-1] < losses[0] - 1.0
    first = records(run, "loss")[0]
    for key in ("iter", "loss", "grad_norm", "lr", "tokens_per_sec", "consumed_tokens"):
        assert key in first
    assert first["iter"] == 1 and first["consumed_tokens"] == 8 * 64
    evals = records(run, "valid_loss")
    assert [r["iter"] for r in evals] == [20, 40] and evals[1]["valid_loss"] < evals[0]["valid_loss"]
    assert (run / "config.yaml").exists() and any((run / "tensorboard").iterdir())
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "iter_0000040"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("iter_")) == ["iter_0000020", "iter_0000040"]
    saved = [r for r in records(run, "event") if r["event"] == "checkpoint_saved"]
    assert [r["iter"] for r in saved] == [20, 40]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_is_bitwise_exact(tmp_path, corpus, precision):
    common = ["--train.precision", precision, "--schedule.decay_iters", "20", "--checkpoint.interval", "0",
              "--train.eval_interval", "0"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train_tiny(straight, corpus, "--train.iters", "20", *common) == 0
    assert train_tiny(split, corpus, "--train.iters", "10", *common) == 0
    assert train_tiny(split, corpus, "--train.iters", "20", *common) == 0  # resumes at 10
    a, b = records(straight, "loss"), records(split, "loss")
    assert [r["iter"] for r in b] == list(range(1, 21))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]            # bitwise, not approximately
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    resumed = [r for r in records(split, "event") if r["event"] == "resumed"]
    assert len(resumed) == 1 and resumed[0]["iter"] == 10
    from megapretrain.checkpoint.format import read_rank_state
    wa = read_rank_state(str(straight / "checkpoints/iter_0000020"), 0)["model"]
    wb = read_rank_state(str(split / "checkpoints/iter_0000020"), 0)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_layout_and_option_errors_are_one_line(tmp_path, corpus, capsys):
    assert train_tiny(tmp_path / "r", corpus, "--parallel.tp", "3") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "parallel.tp=3 × parallel.pp=1 = 3 must divide the world size 1" in err
    assert train_tiny(tmp_path / "r", corpus, "--trian.iters", "5") == 2
    assert "did you mean '--train.iters'" in capsys.readouterr().err
    assert main(["--run.dir", str(tmp_path / "r"), "--data.paths", "[nowhere/missing]", *TINY]) == 2
    err = capsys.readouterr().err
    assert "nowhere/missing" in err and err.count("\n") == 1
    assert not (tmp_path / "r" / "checkpoints").exists()


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGUSR1", "SIGINT"])
def test_a_stop_signal_saves_and_exits(tmp_path, corpus, monkeypatch, signame):
    """SIGTERM, SIGUSR1 (SLURM's pre-emption warning) and a first Ctrl-C save at the next step
    boundary and exit 0; nothing is lost."""
    import signal

    from megapretrain import trainer as trainer_mod

    original = trainer_mod.Trainer.train_step

    def step_then_signal(self):
        out = original(self)
        if self.iteration == 2:  # the signal arrives during the third step
            os.kill(os.getpid(), getattr(signal, signame))
        return out

    monkeypatch.setattr(trainer_mod.Trainer, "train_step", step_then_signal)
    run = tmp_path / "run"
    assert train_tiny(run, corpus, "--train.iters", "50", "--checkpoint.interval", "0") == 0
    assert (run / "checkpoints" / "latest").read_text().strip() == "iter_0000003"
    assert records(run, "loss")[-1]["iter"] == 3
    assert not (run / ".lock").exists()  # the run directory is free again


def test_a_second_ctrl_c_stops_at_once(tmp_path, corpus, monkeypatch, capsys):
    import signal

    from megapretrain import trainer as trainer_mod

    original = trainer_mod.Trainer.train_step

    def step_then_two_signals(self):
        out = original(self)
        if self.iteration == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(trainer_mod.Trainer, "train_step", step_then_two_signals)
    run = tmp_path / "run"
    assert train_tiny(run, corpus, "--train.iters", "50", "--checkpoint.interval", "0") == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err
    assert not (run / "checkpoints" / "latest").exists() and not (run / ".lock").exists()


def test_sigterm_is_handled_only_while_fit_runs(tmp_path, corpus):
    """The trainer takes SIGTERM for the duration of fit() (save at the next step boundary) and
    gives the previous handler back afterwards, also when fit() ends in an error."""
    import dataclasses
    import signal

    from megapretrain.train import setup

    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        trainer = setup(["--run.dir", str(tmp_path / "run"), "--data.paths", f"[{corpus}]", *TINY,
                         "--train.iters", "2"])
        assert signal.getsignal(signal.SIGTERM) is mine  # building the trainer installs nothing
        seen = []
        step = trainer.train_step

        def watched_step():
            seen.append(signal.getsignal(signal.SIGTERM))
            return step()

        trainer.train_step = watched_step
        trainer.fit()
        assert seen and all(h == trainer._on_stop_signal for h in seen)
        assert signal.getsignal(signal.SIGTERM) is mine

        def failing_step():
            raise RuntimeError("a failure inside the loop")

        trainer.train_step = failing_step
        trainer.sizes = dataclasses.replace(trainer.sizes, iters=4)
        with pytest.raises(RuntimeError, match="inside the loop"):
            trainer.fit()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)
