"""Bad checkpoints and conversions, in process: which checkpoint a run loads, rank files and
metadata that are not what they claim, a disk that fills up during a save, a conversion or a
reshard, a Hugging Face directory that contradicts itself, a config of another model, and
``inspect_checkpoint --diff`` with a tolerance. One line each (or a warning naming the choice made);
nothing the user has is changed and no partial file is left."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess

import pytest
import torch

from megapretrain.checkpoint import tensorfile
from megapretrain.checkpoint.format import (
    STATE_KEY,
    read_metadata,
    read_rank_state,
    write_metadata,
    write_rank_state,
)
from megapretrain.commands import convert_checkpoint, inspect_checkpoint, reshard_checkpoint
from megapretrain.errors import CheckpointError
from megapretrain.train import main as train_main

from conftest import assert_one_line, write_corpus
from helpers import TWO_STEPS


def ckpt(run, iteration: int) -> str:
    return os.path.join(str(run), "checkpoints", f"iter_{iteration:07d}")


def train(run, corpus, *args) -> int:
    return train_main([*TWO_STEPS, "--data.paths", f"[{corpus}]", "--run.dir", str(run), "--checkpoint.interval", "1",
                       *args])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("data") / "c_text_document"), num_docs=40)


@pytest.fixture(scope="module")
def run(tmp_path_factory, data):
    """A run of 2 steps, a checkpoint after each."""
    path = tmp_path_factory.mktemp("run") / "run"
    assert train(path, data) == 0
    return path


def copy_run(src, dst):
    shutil.copytree(src, dst)
    return dst


def rewrite_rank_file(directory: str, change) -> None:
    """Rewrite rank 0's file with ``change(state)`` applied, and its size and CRC-32 in the metadata
    (so only the content, not the integrity check, tells)."""
    meta = read_metadata(directory)
    state = read_rank_state(directory, 0)
    change(state)
    path = os.path.join(directory, "rank_00000.safetensors")
    meta["files"]["rank_00000.safetensors"] = dict(zip(("bytes", "crc32"), write_rank_state(path, state)))
    write_metadata(directory, meta)


# -- which checkpoint, and files that are not what they claim -----------------------------------------


def test_an_explicit_load_passed_over_for_the_run_s_own_is_named(run, data, tmp_path, capsys):
    other = copy_run(run, tmp_path / "other")
    assert train(other, data, "--train.iters", "3", "--checkpoint.load", ckpt(run, 1)) == 0
    err = capsys.readouterr().err
    assert f"resuming from {ckpt(other, 2)}, this run's own newest checkpoint" in err
    assert f"checkpoint.load={ckpt(run, 1)} is read only while run.dir has none" in err


def test_a_tensor_missing_from_a_rank_file_whose_crc_matches_is_one_line(run, data, tmp_path, unchanged, capsys):
    bad = copy_run(run, tmp_path / "bad")
    directory = ckpt(bad, 2)
    path = os.path.join(directory, "rank_00000.safetensors")
    with tensorfile.TensorFile(path) as f:  # the same state, one tensor's bytes left out
        skeleton = f.metadata[STATE_KEY]
        entries = [(k, f.dtype(k), f.shape(k), f.get(k)) for k in f.keys() if k != "model/norm.weight"]
    size, crc = tensorfile.write(path, entries, {STATE_KEY: skeleton})
    meta = read_metadata(directory)
    meta["files"]["rank_00000.safetensors"] = {"bytes": size, "crc32": crc}
    write_metadata(directory, meta)
    unchanged()
    assert_one_line(capsys, inspect_checkpoint.main([directory]), 2, "rank_00000.safetensors",
                    "names tensor 'model/norm.weight'", "does not hold")
    assert_one_line(capsys, train(bad, data, "--train.iters", "3"), 2, "'model/norm.weight'", "does not hold")


@pytest.mark.parametrize("field,value", [
    ("iteration", "2"), ("world_size", 0), ("layout", {"tp": "1", "pp": 1, "dp": 1}), ("files", []),
    ("vocab_size", "257"), ("padded_vocab", -1), ("tensors", {"norm.weight": "64"}), ("format_version", "2"),
    ("layout", {"tp": 2, "pp": 1, "dp": 1}),
])
def test_a_metadata_field_of_the_wrong_type_is_named(field, value, run, tmp_path, capsys):
    bad = copy_run(run, tmp_path / "bad")
    meta = read_metadata(ckpt(bad, 2))
    meta[field] = value
    write_metadata(ckpt(bad, 2), meta)
    with pytest.raises(CheckpointError, match=f"{field}.*the file is damaged"):
        read_metadata(ckpt(bad, 2))
    assert_one_line(capsys, inspect_checkpoint.main([ckpt(bad, 2)]), 2, field, "damaged")


def test_metadata_with_every_field_mistyped_is_damaged_not_newer(run, tmp_path):
    bad = copy_run(run, tmp_path / "bad")
    meta = read_metadata(ckpt(bad, 2))
    write_metadata(ckpt(bad, 2), {k: "x" if k != "format" else v for k, v in meta.items()})
    with pytest.raises(CheckpointError) as err:
        read_metadata(ckpt(bad, 2))
    assert "damaged" in str(err.value) and "upgrade" not in str(err.value)
    meta["format_version"] = 99
    write_metadata(ckpt(bad, 2), meta)
    with pytest.raises(CheckpointError, match="newer than this megapretrain reads.*upgrade"):
        read_metadata(ckpt(bad, 2))


def test_inspect_with_another_model_s_config_is_refused(run, tmp_path, unchanged, capsys):
    from megapretrain.config import load_config, save_config

    cfg = load_config(os.path.join(str(run), "config.yaml"))
    cfg.model.hidden_size = 32
    save_config(cfg, str(tmp_path / "other.yaml"))
    unchanged()
    assert_one_line(capsys, inspect_checkpoint.main([ckpt(run, 2), "--config", "other.yaml"]), 2,
                    "other.yaml does not describe the model of", "embed_tokens.weight")


# -- a full disk ------------------------------------------------------------------------------------


def _full_after(calls: int):
    """tensorfile.write that fails with ENOSPC from its ``calls``-th call on, after writing part of
    the file (a disk that fills up in the middle of a write)."""
    real, count = tensorfile.write, [0]

    def write(path, entries, metadata=None):
        count[0] += 1
        if count[0] < calls:
            return real(path, entries, metadata)
        with open(path, "wb") as fh:
            fh.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", path)
    return write


def _leftovers(root) -> list[str]:
    return [os.path.join(base, f) for base, dirs, files in os.walk(root) for f in files + dirs
            if f.endswith((".part", ".done.json", ".failed")) or f.startswith(".iter_") or ".tmp-" in f]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_last_checkpoint(mode, data, tmp_path, capsys,
                                                                              monkeypatch):
    monkeypatch.setattr(tensorfile, "write", _full_after(2))  # the first save fits, the second does not
    path = tmp_path / "run"
    status = train(path, data, "--checkpoint.async", str(mode == "async").lower())
    err = assert_one_line(capsys, status, 2, "no space left writing", "checkpoints", "needs about",
                          "checkpoint 2 was not saved", "the newest complete checkpoint is kept")
    assert "Traceback" not in err
    assert sorted(os.listdir(path / "checkpoints")) == ["iter_0000001", "latest"]
    assert (path / "checkpoints" / "latest").read_text().strip() == "iter_0000001"
    assert not _leftovers(path)


def _tmpfs(target, size: int) -> bool:
    target.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)],
                          capture_output=True).returncode == 0


def test_a_save_that_fills_a_real_disk_is_one_line(run, data, tmp_path, capsys):
    """Where a tmpfs can be mounted: a run directory with room for one checkpoint and a half."""
    one = sum(os.path.getsize(os.path.join(ckpt(run, 2), f)) for f in os.listdir(ckpt(run, 2)))
    disk = tmp_path / "disk"
    if not _tmpfs(disk, one * 3 // 2 + 256 * 1024):
        pytest.skip("no tmpfs can be mounted here (the ENOSPC test above covers the same path)")
    try:
        status = train(disk / "run", data, "--data.cache_dir", str(tmp_path / "cache"), "--checkpoint.keep_last", "0")
        assert_one_line(capsys, status, 2, "no space left writing", "was not saved")
        assert (disk / "run" / "checkpoints" / "latest").read_text().strip() == "iter_0000001"
        assert not _leftovers(disk)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)  # lazily: a failed run may hold files


@pytest.fixture(scope="module")
def hf_dir(run, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf") / "hf")
    assert convert_checkpoint.main(["to-hf", "--checkpoint", str(run), "--output", out]) == 0
    return out


COMMANDS = {
    "to-hf": lambda run, hf: ["to-hf", "--checkpoint", str(run), "--output", "out"],
    "from-hf": lambda run, hf: ["from-hf", "--hf", hf, "--output", "out"],
    "reshard": lambda run, hf: ["--checkpoint", str(run), "--output", "out", "--world-size", "2",
                                "--parallel.tp", "2"],
}


def _tool(name):
    return reshard_checkpoint.main if name == "reshard" else convert_checkpoint.main


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_conversion_that_fills_the_disk_is_one_line_and_leaves_nothing(name, run, hf_dir, tmp_path, unchanged,
                                                                          capsys, monkeypatch):
    monkeypatch.setattr(tensorfile, "write", _full_after(1))
    unchanged()
    assert_one_line(capsys, _tool(name)(COMMANDS[name](run, hf_dir)), 2, "no space left writing", "needs about",
                    "free", "--output")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_conversion_that_cannot_fit_is_refused_before_writing(name, run, hf_dir, tmp_path, unchanged, capsys,
                                                                monkeypatch):
    monkeypatch.setattr("megapretrain.errors.free_bytes", lambda path: 4096)
    if name == "reshard":  # refused before the input is read: its checksums are not even verified
        monkeypatch.setattr("megapretrain.checkpoint.directories.problem",
                            lambda *a, **k: pytest.fail("the input was read before the space check"))
    unchanged()
    err = assert_one_line(capsys, _tool(name)(COMMANDS[name](run, hf_dir)), 2, "--output out would need about",
                          "4.0 KiB free", "checked before writing", "nothing was written")
    assert "no space left" not in err
    assert os.listdir(tmp_path) == []


def test_conversions_say_what_they_wrote(run, hf_dir, tmp_path, capsys):
    assert reshard_checkpoint.main(COMMANDS["reshard"](run, hf_dir)[:3] + [str(tmp_path / "r"), "--world-size", "2",
                                                                          "--parallel.tp", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"wrote {tmp_path / 'r'}: iteration 2") and "distinct files" in out[0]


# -- Hugging Face directories that contradict themselves ----------------------------------------------


def _hf_copy(hf_dir, tmp_path, config_change=None, tensors_change=None) -> str:
    out = str(tmp_path / "hf")
    shutil.copytree(hf_dir, out)
    if config_change:
        with open(os.path.join(out, "config.json")) as fh:
            config = json.load(fh)
        config_change(config)
        with open(os.path.join(out, "config.json"), "w") as fh:
            json.dump(config, fh)
    if tensors_change:
        from safetensors.torch import load_file, save_file
        tensors = load_file(os.path.join(out, "model.safetensors"))
        tensors_change(tensors)
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def test_tied_embeddings_beside_a_distinct_head_are_refused_or_both_kept(hf_dir, tmp_path, capsys):
    hf = _hf_copy(hf_dir, tmp_path, lambda c: c.update(tie_word_embeddings=True))
    assert_one_line(capsys, convert_checkpoint.main(["from-hf", "--hf", hf, "--output", str(tmp_path / "a")]), 2,
                    "tie_word_embeddings: true", "'lm_head.weight' differs from 'model.embed_tokens.weight'",
                    "--model.tie_embeddings false")
    assert not (tmp_path / "a").exists()
    assert convert_checkpoint.main(["from-hf", "--hf", hf, "--output", str(tmp_path / "b"),
                                    "--model.tie_embeddings", "false"]) == 0
    assert "lm_head.weight" in read_metadata(str(tmp_path / "b"))["tensors"]  # both kept


def test_tied_embeddings_beside_an_equal_head_convert(hf_dir, tmp_path, capsys):
    def same_head(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    hf = _hf_copy(hf_dir, tmp_path, lambda c: c.update(tie_word_embeddings=True), same_head)
    assert convert_checkpoint.main(["from-hf", "--hf", hf, "--output", str(tmp_path / "a")]) == 0
    assert "lm_head.weight" not in read_metadata(str(tmp_path / "a"))["tensors"]


@pytest.mark.parametrize("change,words", [
    (lambda c: c.pop("num_attention_heads"), ["num_attention_heads missing"]),
    (lambda c: c.update(hidden_size="64"), ["hidden_size='64'", "wrong type"]),
    (lambda c: c.update(num_key_value_heads=0), ["num_key_value_heads=0"]),
    (lambda c: c.update(rms_norm_eps=float("nan")), ["rms_norm_eps=nan"]),
    (lambda c: c.update(tie_word_embeddings="yes"), ["tie_word_embeddings='yes'"]),
    (lambda c: c.update(architectures="LlamaForCausalLM"), ["architectures='LlamaForCausalLM'"]),
])
def test_a_config_json_field_missing_or_of_the_wrong_type_is_named(change, words, hf_dir, tmp_path, capsys):
    hf = _hf_copy(hf_dir, tmp_path, change)
    assert_one_line(capsys, convert_checkpoint.main(["from-hf", "--hf", hf, "--output", str(tmp_path / "a")]), 2,
                    "config.json", *words)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("value,words", [(1e6, ["holds values up to 1e+06", "float16"]),
                                         (float("nan"), ["NaN or infinite", "diverged"])])
def test_an_export_that_would_lose_values_is_refused(value, words, run, tmp_path, capsys):
    bad = copy_run(run, tmp_path / "bad")

    def poison(state):
        state["model"]["norm.weight"][0] = value
    rewrite_rank_file(ckpt(bad, 2), poison)
    assert_one_line(capsys, convert_checkpoint.main(["to-hf", "--checkpoint", ckpt(bad, 2), "--output",
                                                     str(tmp_path / "out"), "--dtype", "fp16"]), 2,
                    "'norm.weight'", *words)
    assert not (tmp_path / "out").exists()


# -- inspect_checkpoint --diff ----------------------------------------------------------------------


def test_diff_tolerates_fp32_noise_names_iterations_and_never_passes_nan(run, tmp_path, capsys):
    noisy = copy_run(run, tmp_path / "noisy")

    def noise(state):
        w = state["model"]["layers.0.mlp.up_proj.weight"]
        w += 1e-5 * w.abs().max() * torch.randn(w.shape, generator=torch.Generator().manual_seed(0))
    rewrite_rank_file(ckpt(noisy, 2), noise)
    assert inspect_checkpoint.main([ckpt(run, 2), "--diff", ckpt(noisy, 2)]) == 0
    out = capsys.readouterr().out
    assert f"{ckpt(run, 2)} (iteration 2) vs {ckpt(noisy, 2)} (iteration 2): 0 of" in out
    assert "1 within it" in out and "layers.0.mlp.up_proj.weight" in out
    assert inspect_checkpoint.main([ckpt(run, 2), "--diff", ckpt(noisy, 2), "--exact"]) == 1
    assert "1 of" in capsys.readouterr().out
    assert inspect_checkpoint.main([ckpt(run, 2), "--diff", ckpt(run, 1)]) == 1  # a step of training is no noise
    assert f"{ckpt(run, 2)} (iteration 2) vs {ckpt(run, 1)} (iteration 1)" in capsys.readouterr().out

    def nan(state):
        state["model"]["norm.weight"][0] = float("nan")
    rewrite_rank_file(ckpt(noisy, 2), nan)
    assert inspect_checkpoint.main([ckpt(run, 2), "--diff", ckpt(noisy, 2), "--rtol", "1e9"]) == 1
    assert "norm.weight: max |diff| nan" in capsys.readouterr().out
