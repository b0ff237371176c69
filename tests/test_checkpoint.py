"""Checkpoints that survive crashes and damage: the safetensors format (no pickle on any load path),
sizes and checksums checked before loading, fallback past a damaged ``latest``, one-line errors for
another model's checkpoint, leftovers of interrupted saves cleaned, kill -9 in the middle of a
synchronous and of an asynchronous save, and async saves published as soon as they are written."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time

import pytest
import torch

from megapretrain.checkpoint import tensorfile
from megapretrain.checkpoint.format import (
    FORMAT,
    LEGACY_FORMAT,
    problem,
    read_metadata,
    read_rank_state,
    write_metadata,
)
from megapretrain.errors import CheckpointError
from megapretrain.train import main, setup

from helpers import ckpt_dir, records, run_argv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _losses(run):
    return {r["iter"]: r["loss"] for r in records(run, "loss")}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus):
    """A run of 6 steps straight through, checkpoints at 2, 4, 6."""
    run = tmp_path_factory.mktemp("straight") / "run"
    assert main(run_argv(run, corpus, 6)) == 0
    return run


# -- the file format -------------------------------------------------------------------------------


def test_tensor_files_are_safetensors_read_by_byte_range(tmp_path):
    from safetensors import safe_open

    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(5, 7, generator=gen), "b": torch.randn(3, 4, generator=gen).bfloat16(),
               "c": torch.arange(10, dtype=torch.int64), "d": torch.tensor([True, False, True]),
               "e": torch.zeros(0, 3), "f": torch.tensor(2.5)}
    path = str(tmp_path / "x.safetensors")
    size, crc = tensorfile.write(path, [(k, v.dtype, tuple(v.shape), v) for k, v in tensors.items()], {"k": "v"})
    assert size == os.path.getsize(path) and crc == tensorfile.file_crc32(path)
    with safe_open(path, framework="pt") as fh:  # the reference reader agrees
        assert fh.metadata() == {"k": "v"}
        for k, v in tensors.items():
            assert torch.equal(fh.get_tensor(k), v), k
    f = tensorfile.TensorFile(path)
    for k, v in tensors.items():
        assert torch.equal(f.get(k), v), k
    assert torch.equal(f.flat("a", 9, 20), tensors["a"].reshape(-1)[9:20])
    assert torch.equal(f.narrow("a", 1, 2, 3), tensors["a"][:, 2:5])
    assert torch.equal(f.narrow("b", 0, 1, 2), tensors["b"][1:3])
    f.close()
    with open(path, "r+b") as fh:
        fh.truncate(size - 8)
    with pytest.raises(CheckpointError, match="truncated or damaged"):
        tensorfile.TensorFile(path)


def test_no_pickle_on_any_load_path(straight, corpus, tmp_path, monkeypatch):
    """Resume, resume under another vocabulary padding (the reshard path), the tools: with
    torch.load and pickle patched to fail."""
    def refuse(*args, **kwargs):
        raise AssertionError("unpickling on a load path")

    monkeypatch.setattr(torch, "load", refuse)
    for name in ("load", "loads"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    state = read_rank_state(ckpt_dir(straight, 6), 0)
    assert state["iteration"] == 6 and torch.is_tensor(state["rng"]["cpu"])
    for i, extra in enumerate(([], ["--model.make_vocab_size_divisible_by", "64"])):
        trainer = setup(run_argv(tmp_path / f"r{i}", corpus, 7, "--checkpoint.load", str(straight), *extra))
        assert trainer.iteration == 6 and (trainer.run.resharded_from is None) == (not extra)
        trainer.lock.release()
    from megapretrain.commands import inspect_checkpoint
    assert inspect_checkpoint.main([str(straight)]) == 0


def test_version_1_checkpoints_still_load(straight, corpus, tmp_path):
    """A checkpoint in the old format (torch files, no sizes or checksums) resumes the same run."""
    old = tmp_path / "old" / "checkpoints" / "iter_0000004"
    old.mkdir(parents=True)
    torch.save(read_rank_state(ckpt_dir(straight, 4), 0), old / "rank_00000.pt")
    meta = {k: v for k, v in read_metadata(ckpt_dir(straight, 4)).items() if k not in ("files", "tensors")}
    old_meta = {**meta, "format": LEGACY_FORMAT, "format_version": 1}
    (old / "metadata.json").write_text(json.dumps(old_meta))
    (old.parent / "latest").write_text("iter_0000004\n")
    run = tmp_path / "old"
    assert main(run_argv(run, corpus, 6)) == 0
    assert _losses(run) == {i: _losses(straight)[i] for i in (5, 6)}  # bitwise the same continuation
    assert read_metadata(ckpt_dir(run, 6))["format_version"] == 2


def test_version_2_checkpoints_under_the_old_format_name_still_load(straight, corpus, tmp_path):
    """Version 2 was written as ``megapretrain-per-rank-v1`` before the name carried the version:
    such a checkpoint resumes the same run, bit for bit, and the next one is written under the
    name that matches its version."""
    run = tmp_path / "old"
    os.makedirs(run / "checkpoints")
    shutil.copytree(ckpt_dir(straight, 4), ckpt_dir(run, 4))
    meta = read_metadata(ckpt_dir(run, 4))
    assert (meta["format"], meta["format_version"]) == (FORMAT, 2)
    assert FORMAT == "megapretrain-per-rank-v2"
    write_metadata(ckpt_dir(run, 4), {**meta, "format": LEGACY_FORMAT})
    (run / "checkpoints" / "latest").write_text("iter_0000004\n")
    assert read_metadata(ckpt_dir(run, 4))["format"] == LEGACY_FORMAT
    assert main(run_argv(run, corpus, 6)) == 0
    assert _losses(run) == {i: _losses(straight)[i] for i in (5, 6)}  # bit for bit
    assert read_metadata(ckpt_dir(run, 6))["format"] == FORMAT


# -- integrity and fallback ------------------------------------------------------------------------


def _copy_run(src, dst):
    import shutil
    shutil.copytree(src, dst)
    os.remove(os.path.join(dst, "metrics.jsonl"))


@pytest.mark.parametrize("damage", ["truncate", "flip", "metadata", "pointer"])
def test_a_damaged_latest_falls_back_to_the_previous_checkpoint(damage, straight, corpus, tmp_path, capsys):
    run = tmp_path / "run"
    _copy_run(straight, run)
    file = os.path.join(ckpt_dir(run, 6), "rank_00000.safetensors")
    if damage == "truncate":
        with open(file, "r+b") as fh:
            fh.truncate(os.path.getsize(file) // 2)
        expect = "truncated or damaged"
    elif damage == "flip":  # same size, one byte changed: only the checksum sees it
        with open(file, "r+b") as fh:
            fh.seek(os.path.getsize(file) - 3)
            byte = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([byte[0] ^ 0xFF]))
        expect = "fails its checksum"
    elif damage == "metadata":
        with open(os.path.join(ckpt_dir(run, 6), "metadata.json"), "w") as fh:
            fh.write('{"format": "megapretrain-per-rank-v1", "iter')
        expect = "cannot be read as JSON"
    else:
        (run / "checkpoints" / "latest").write_text("iter_0000099\n")
        os.remove(os.path.join(ckpt_dir(run, 6), "metadata.json"))
        expect = "names 'iter_0000099', which is missing or incomplete"
    assert main(run_argv(run, corpus, 6)) == 0
    err = capsys.readouterr().err
    assert expect in err and "warning: checkpoint:" in err
    resumed = [r for r in records(run, "event") if r["event"] == "resumed"]
    assert resumed[0]["iter"] == 4 and resumed[0]["checkpoint"].endswith("iter_0000004")
    assert _losses(run) == {i: _losses(straight)[i] for i in (5, 6)}


def test_explicit_load_works_when_its_latest_is_damaged(straight, corpus, tmp_path, capsys):
    src = tmp_path / "src"
    _copy_run(straight, src)
    with open(os.path.join(ckpt_dir(src, 6), "rank_00000.safetensors"), "r+b") as fh:
        fh.truncate(100)
    run = tmp_path / "new"
    trainer = setup(run_argv(run, corpus, 8, "--checkpoint.load", str(src)))  # a run directory: its newest usable
    assert trainer.iteration == 4
    trainer.lock.release()
    assert "skipped" in capsys.readouterr().err
    assert main(run_argv(tmp_path / "other", corpus, 8, "--checkpoint.load", ckpt_dir(src, 6))) == 2  # named: refused
    errors = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning:")]
    assert len(errors) == 1 and "iter_0000006 cannot be used" in errors[0] and "truncated" in errors[0]


def test_every_rank_file_is_checked(tmp_path):
    """A missing rank file, or one not listed in the metadata, makes the checkpoint unusable."""
    from megapretrain.checkpoint.format import metadata, write_metadata, write_rank_state
    from megapretrain.checkpoint.format import rank_file as rf

    d = str(tmp_path)
    files = {}
    for rank in range(2):
        files[os.path.basename(rf(d, rank))] = write_rank_state(rf(d, rank), {"x": torch.ones(3) * rank})
    write_metadata(d, metadata(iteration=1, world_size=2, layout={"tp": 2, "pp": 1, "dp": 1}, vocab_size=1,
                               padded_vocab=1, files=files))
    assert problem(d) is None
    os.remove(rf(d, 1))
    assert "rank_00001.safetensors is missing" in problem(d)


@pytest.mark.parametrize("flags, message", [
    (["--model.ffn_hidden_size", "256"], r"'layers\.0\.mlp\.gate_proj\.weight' has shape \(128, 64\), the model "
                                         r"expects \(256, 64\)"),
    (["--model.num_layers", "1"], r"holds 'layers\.1\.[\w.]+' of shape \(\d+(, \d+)?,?\), which this "
                                  "model has no place for"),
    (["--model.tie_embeddings", "true"], r"saved with model\.tie_embeddings false \(its own 'lm_head\.weight'\), "
                                         r"the config says true: set model\.tie_embeddings: false"),
])
def test_a_checkpoint_of_another_shape_is_one_line_naming_the_tensor(flags, message, straight, corpus, tmp_path,
                                                                     capsys):
    import re
    assert main(run_argv(tmp_path / "r", corpus, 8, "--checkpoint.load", str(straight), *flags)) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning:")]
    assert len(errors) == 1 and re.search(message, errors[0]), errors


def test_leftovers_of_interrupted_saves_are_removed_at_start(straight, corpus, tmp_path):
    run = tmp_path / "run"
    _copy_run(straight, run)
    ck = run / "checkpoints"
    (ck / ".iter_0000008").mkdir()
    (ck / ".iter_0000008" / "rank_00000.safetensors.part").write_bytes(b"half")
    (ck / ".latest.part").write_text("iter_0000008")
    trainer = setup(run_argv(run, corpus, 8))  # (a resume with steps left: one with none is refused)
    trainer.lock.release()
    assert not (ck / ".iter_0000008").exists() and not (ck / ".latest.part").exists()
    assert (ck / "iter_0000006" / "metadata.json").exists()


# -- durability ------------------------------------------------------------------------------------

KILLER = """
import os, signal, sys
from megapretrain.checkpoint import tensorfile
original, calls = tensorfile.write, []

def write_then_die(path, entries, metadata=None):
    calls.append(path)
    if len(calls) == 2:  # the second save: half a file, then kill -9
        with open(path, "wb") as fh:
            fh.write(b"x" * 1000)
            fh.flush()
            os.fsync(fh.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
    return original(path, entries, metadata)

tensorfile.write = write_then_die
from megapretrain.train import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_9_during_a_save_resumes_from_the_previous_checkpoint(mode, straight, corpus, tmp_path):
    run = tmp_path / "run"
    argv = run_argv(run, corpus, 6, "--checkpoint.async", str(mode == "async").lower())
    proc = subprocess.run([sys.executable, "-c", KILLER, *argv], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -9, proc.stderr
    ck = run / "checkpoints"
    assert (ck / "latest").read_text().strip() == "iter_0000002"  # never the partial one
    assert (ck / ".iter_0000004").exists() and not (ck / "iter_0000004").exists()
    assert main(argv) == 0  # the same command again
    resumed = [r for r in records(run, "event") if r["event"] == "resumed"]
    assert [r["iter"] for r in resumed] == [2]
    assert not (ck / ".iter_0000004").exists() and (ck / "latest").read_text().strip() == "iter_0000006"
    losses = {r["iter"]: r["loss"] for r in records(run, "loss") if r["iter"] > 2}
    assert losses == {i: _losses(straight)[i] for i in range(3, 7)}


def test_an_async_save_is_published_once_written_not_at_the_next_save(corpus, tmp_path, monkeypatch):
    from megapretrain.trainer import Trainer

    run = tmp_path / "run"
    seen = {}
    step = Trainer.train_step

    def watch(self):
        if self.iteration == 3:  # the save at 2 is in flight or done; the next is due at 4
            # the writer renames the directory into place, then moves ``latest``: wait for the
            # pointer itself (nothing on the training thread touches the manager meanwhile)
            pointer, deadline = run / "checkpoints" / "latest", time.monotonic() + 120
            while not pointer.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            seen["latest"] = pointer.read_text().strip() if pointer.exists() else None
        return step(self)

    monkeypatch.setattr(Trainer, "train_step", watch)
    assert main(run_argv(run, corpus, 4, "--checkpoint.async", "true")) == 0
    assert seen["latest"] == "iter_0000002"
    saved = [r for r in records(run, "event") if r["event"] == "checkpoint_saved"]
    assert [r["iter"] for r in saved] == [2, 4]
    assert all(r["async_save"] and r["checkpoint_stall_s"] >= 0 for r in saved)
    assert problem(ckpt_dir(run, 4)) is None


def _two_rank_async(rank, world, run, corpus):
    trainer = setup(run_argv(run, corpus, 4, "--checkpoint.async", "true", "--parallel.zero", "1"))
    trainer.fit()
    return trainer.iteration


def test_two_ranks_agree_on_an_async_save_through_their_done_records(corpus, tmp_path):
    from distributed import run_distributed

    run = str(tmp_path / "run")
    assert run_distributed(_two_rank_async, 2, run, corpus, timeout=300) == [4, 4]
    meta = read_metadata(ckpt_dir(run, 4))
    assert sorted(meta["files"]) == ["rank_00000.safetensors", "rank_00001.safetensors"]
    assert problem(ckpt_dir(run, 2)) is None and problem(ckpt_dir(run, 4)) is None
    assert not [n for n in os.listdir(ckpt_dir(run, 4)) if n.endswith(".done.json")]


def _boundary_agreement(rank, world, run, corpus):
    from megapretrain.trainer import Trainer

    seen = {}
    step = Trainer.train_step

    def watch(self):
        if self.iteration == 4:  # the save at 3 is in flight: let every rank's writer finish
            deadline = time.monotonic() + 120
            while not self.run.checkpoints.poll() and time.monotonic() < deadline:
                time.sleep(0.01)
        if self.iteration == 5:  # the boundary after step 5 agreed on it, and finished it
            seen["pending"] = self.run.checkpoints._pending is not None
            seen["latest"] = open(os.path.join(run, "checkpoints", "latest")).read().strip()
        return step(self)

    Trainer.train_step = watch
    try:
        setup(run_argv(run, corpus, 6, "--checkpoint.async", "true", "--checkpoint.interval", "3")).fit()
    finally:
        Trainer.train_step = step
    return seen


def test_ranks_agree_on_a_finished_async_save_at_the_next_step_boundary(corpus, tmp_path):
    from distributed import run_distributed

    run = str(tmp_path / "run")
    assert run_distributed(_boundary_agreement, 2, run, corpus, timeout=300) == \
        [{"pending": False, "latest": "iter_0000003"}] * 2


def test_inspect_reports_and_checks(straight, tmp_path, capsys):
    from megapretrain.commands import inspect_checkpoint as tool

    assert tool.main([ckpt_dir(straight, 6)]) == 0
    out = capsys.readouterr().out
    assert "iteration 6" in out and "layers.0.mlp.up_proj.weight" in out and "(128, 64)" in out
    assert tool.main([ckpt_dir(straight, 6), "--diff", ckpt_dir(straight, 4)]) == 1  # weights differ
    out = capsys.readouterr().out
    assert "layers.0.mlp.up_proj.weight" in out and "max |diff|" in out
    assert tool.main([ckpt_dir(straight, 6), "--diff", ckpt_dir(straight, 6)]) == 0
    bad = tmp_path / "bad"
    _copy_run(straight, bad)
    with open(os.path.join(ckpt_dir(bad, 6), "rank_00000.safetensors"), "r+b") as fh:
        fh.truncate(50)
    assert tool.main([ckpt_dir(bad, 6)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "truncated" in err


def _rank_1_dies_in_its_second_save(rank, world, run, corpus, argv):
    if rank == 1:
        original, calls = tensorfile.write, []

        def write_then_die(path, entries, metadata=None):
            calls.append(path)
            if len(calls) == 2:
                with open(path, "wb") as fh:
                    fh.write(b"x" * 1000)
                os.kill(os.getpid(), 9)
            return original(path, entries, metadata)

        tensorfile.write = write_then_die
    setup(argv).fit()


def _resume(rank, world, run, corpus, argv):
    trainer = setup(argv)
    first = trainer.iteration
    trainer.fit()
    return first, trainer.iteration


@pytest.mark.parametrize("async_save", ["true", "false"])
def test_kill_9_of_one_rank_during_a_save(corpus, tmp_path, async_save):
    """Two ranks, rank 1 killed while writing its part of the save at 4: rank 0 never publishes it
    and fails at its next collective — a synchronous save's agreement before publishing, not a wait
    for rank 1's done record that never ends (a lost node left its survivor hanging so); the
    restart resumes at 2."""
    from distributed import run_distributed

    run = str(tmp_path / "run")
    argv = run_argv(run, corpus, 6, "--checkpoint.async", async_save, "--parallel.zero", "1")
    # rank 0 itself fails (rank 1 is gone and reports nothing), well before the harness's timeout
    with pytest.raises(RuntimeError, match="rank 0 of 2 failed"):
        run_distributed(_rank_1_dies_in_its_second_save, 2, run, corpus, argv, timeout=240)
    ck = os.path.join(run, "checkpoints")
    assert open(os.path.join(ck, "latest")).read().strip() == "iter_0000002"
    assert not os.path.exists(os.path.join(ck, "iter_0000004"))
    assert run_distributed(_resume, 2, run, corpus, argv, timeout=300) == [(2, 6), (2, 6)]
    assert not os.path.exists(os.path.join(ck, ".iter_0000004")) and problem(ckpt_dir(run, 6)) is None


def _side_group_save_and_load(rank, world, run):
    """Save and load under 2 ranks, recording the group of every collective the checkpoint code
    calls and the options of every group created."""
    import torch.distributed as dist

    from megapretrain.checkpoint import manager as manager_module
    from megapretrain.checkpoint.format import rank_state
    from megapretrain.parallel.state import ParallelState

    created, used = [], []
    new_group = dist.new_group

    def recording_new_group(*args, **kwargs):
        pg = new_group(*args, **kwargs)
        created.append((pg, kwargs.get("backend"), kwargs.get("timeout")))
        return pg

    def recording(fn):
        def call(*args, group=None, **kwargs):
            used.append(group)
            return fn(*args, group=group, **kwargs)
        return call

    dist.new_group = recording_new_group
    ps = ParallelState(checkpoint_timeout_s=1234.0)
    dist.new_group = new_group
    originals = {name: getattr(dist, name) for name in ("barrier", "all_reduce", "broadcast")}
    for name, fn in originals.items():
        setattr(manager_module.dist, name, recording(fn))
    try:
        manager = manager_module.CheckpointManager(run, rank=rank, world_size=world,
                                                   layout={"tp": 1, "pp": 1, "dp": world},
                                                   vocab_size=8, padded_vocab=8,
                                                   group=ps.checkpoint)
        manager.save(3, rank_state(iteration=3, consumed_samples=10 + rank, model={},
                                   optimizer_step=3, moments={}, scaler=None))
        path, warnings = manager.choose()
        loaded = manager.load(path)["consumed_samples"]
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    side = [(backend, timeout) for pg, backend, timeout in created if pg is ps.checkpoint.pg]
    return {"side": side, "used": {g is ps.checkpoint.pg for g in used}, "calls": len(used),
            "loaded": loaded, "path": os.path.basename(path), "warnings": warnings}


def test_checkpoint_agreement_runs_on_a_gloo_group_of_its_own(tmp_path):
    """Every barrier and vote of a save and a load goes through ParallelState.checkpoint, a gloo
    group created with checkpoint.timeout_s — never the default group."""
    import datetime

    from distributed import run_distributed

    results = run_distributed(_side_group_save_and_load, 2, str(tmp_path / "run"), timeout=300)
    for rank, r in enumerate(results):
        assert r["side"] == [("gloo", datetime.timedelta(seconds=1234.0))], r
        assert r["used"] == {True} and r["calls"] >= 4, r  # all on the side group
        assert r["loaded"] == 10 + rank and r["path"] == "iter_0000003"
        assert r["warnings"] == []
