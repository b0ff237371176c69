"""A run's ``checkpoints/latest`` names only an ``iter_*`` directory inside that run's own
``checkpoints/``: pointed anywhere else (an absolute path to another run, ``../other/...``, a symlink
leading out), training, ``to-hf`` and ``inspect`` all pass it over with one warning naming the
pointer, where it leads and the run's own newest checkpoint used instead; never the other run.
Tools given a checkpoint say whose it is."""

from __future__ import annotations

import os
import shutil

import pytest

from megapretrain.commands import convert_checkpoint, inspect_checkpoint
from megapretrain.train import main, setup

from helpers import ckpt_dir, run_argv


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    """``other``: a run with checkpoints 2, 4, 6; ``own``: a copy holding only 2 and 4."""
    base = tmp_path_factory.mktemp("pointers")
    other = base / "other"
    assert main(run_argv(other, corpus, 6)) == 0
    own = base / "own"
    shutil.copytree(other, own)
    shutil.rmtree(ckpt_dir(own, 6))
    return base


def _point(run, other, how):
    """Make ``run``'s ``latest`` lead to ``other``'s checkpoint 6, as ``how`` says."""
    ck, target = run / "checkpoints", ckpt_dir(other, 6)
    if how == "absolute":
        (ck / "latest").write_text(target + "\n")
    elif how == "relative":
        (ck / "latest").write_text(os.path.relpath(target, ck) + "\n")
    else:  # an iter_* entry of this run that is a symlink to another run's checkpoint
        os.symlink(target, ck / "iter_0000008")
        (ck / "latest").write_text("iter_0000008\n")
    return str(ck / "latest")


def _warned(err, pointer, run):
    lines = [line for line in err.splitlines() if pointer in line]
    assert len(lines) == 1, err
    assert "other" in lines[0] and lines[0].endswith(f"using {ckpt_dir(run, 4)}"), lines[0]


@pytest.mark.parametrize("how", ["absolute", "relative", "symlink"])
def test_a_latest_pointing_out_of_the_run_falls_back_to_the_runs_own(how, runs, corpus, tmp_path,
                                                                     capsys):
    run = tmp_path / "own"
    shutil.copytree(runs / "own", run)
    pointer = _point(run, runs / "other", how)
    capsys.readouterr()

    trainer = setup(run_argv(run, corpus, 8))  # training resume
    assert trainer.iteration == 4  # its own newest, not the other run's 6
    trainer.lock.release()
    _warned(capsys.readouterr().err, pointer, run)

    assert inspect_checkpoint.main([str(run)]) == 0
    out, err = capsys.readouterr()
    _warned(err, pointer, run)
    assert out.startswith(f"{ckpt_dir(run, 4)}, saved by run {run} (run.dir={run}")

    out_dir = str(tmp_path / "hf")
    assert convert_checkpoint.main(["to-hf", "--checkpoint", str(run), "--output", out_dir]) == 0
    out, err = capsys.readouterr()
    _warned(err, pointer, run)
    assert f"iteration 4 of {ckpt_dir(run, 4)}, saved by run {run} (run.dir=" in out
    assert "model.family=llama" in out


def test_a_checkpoint_named_explicitly_says_whose_it_is(runs, capsys):
    """Another run's checkpoint given by hand is used, with its run named in the output."""
    assert inspect_checkpoint.main([ckpt_dir(runs / "other", 6)]) == 0
    out = capsys.readouterr().out
    assert f", saved by run {runs / 'other'} (run.dir={runs / 'other'}" in out
