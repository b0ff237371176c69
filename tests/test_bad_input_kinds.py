"""Inputs whose sizes are right and whose meaning is wrong, or that change or grow past what the
machine holds: token files whose dtype says floats, weights stored as integers (a quantized export),
a data file rewritten under a running job, a model too large for memory, and the shipped tiny config
through the dry run, the planner and the simulator (its vocabulary is its tokenizer's)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from megapretrain.checkpoint.format import read_metadata, read_rank_state, write_metadata, write_rank_state
from megapretrain.commands import convert_checkpoint
from megapretrain.data.indexed_dataset import IndexedDatasetBuilder
from megapretrain.faults import Faults
from megapretrain.train import main as train_main

from conftest import assert_one_line, write_corpus
from helpers import TWO_STEPS, load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("data") / "c_text_document"), num_docs=40)


def _train(run, corpus, *args) -> int:
    return train_main([*TWO_STEPS, "--data.paths", f"[{corpus}]", "--run.dir", str(run), *args])


# -- token ids are integers, wherever a token file is read ----------------------------------------

# (dtype code the .idx claims, the integer dtype of the same width its .bin really holds)
FLOAT_CODES = {"float32": (7, np.int32), "float64": (6, np.int64)}


def _dataset(prefix: str, dtype) -> str:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for doc in range(30):
        builder.add_document(np.arange(doc, doc + 40) % 256)
    builder.finalize(prefix + ".idx")
    return prefix


def _float_labelled(directory, code: int, dtype) -> str:
    """A dataset of valid ids whose .idx header says a float dtype of the same width: every size
    matches, only the kind is wrong."""
    prefix = _dataset(str(directory / "f_text_document"), dtype)
    with open(prefix + ".idx", "r+b") as fh:
        fh.seek(9 + 8)  # magic, version, then the dtype code
        fh.write(bytes([code]))
    return prefix


TOKEN_READERS = {  # reader: argv of the call that opens the dataset
    "train": lambda p, tmp: ["train", *TWO_STEPS, "--data.paths", f"[{p}]", "--run.dir", str(tmp / "run")],
    "train --check": lambda p, tmp: ["train", *TWO_STEPS, "--data.paths", f"[{p}]", "--run.dir",
                                     str(tmp / "run"), "--check"],
    "inspect_data": lambda p, tmp: ["inspect_data", p],
    "merge_datasets": lambda p, tmp: ["merge_datasets", "--input", _dataset(str(tmp / "g"), np.int32), p,
                                      "--output-prefix", str(tmp / "m")],
}


def _run_reader(argv) -> int:
    name, *args = argv
    return train_main(args) if name == "train" else load_tool(name).main(args)


@pytest.mark.parametrize("kind", list(FLOAT_CODES))
@pytest.mark.parametrize("reader", list(TOKEN_READERS))
def test_every_token_reader_refuses_a_float_dtype(reader, kind, tmp_path, capsys):
    code, dtype = FLOAT_CODES[kind]
    prefix = _float_labelled(tmp_path, code, dtype)
    status = _run_reader(TOKEN_READERS[reader](prefix, tmp_path))
    err = capsys.readouterr().err
    assert status != 0, err
    assert "Traceback" not in err, err
    assert f"{prefix}.idx" in err and kind in err and "integers" in err and "preprocess_data" in err, err
    assert not (tmp_path / "m.bin").exists()


# -- weights are floating point, wherever a checkpoint is read -------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("run") / "run"
    assert _train(path, data, "--checkpoint.interval", "1") == 0
    return path


@pytest.fixture(scope="module")
def hf_dir(run, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf") / "hf")
    assert convert_checkpoint.main(["to-hf", "--checkpoint", str(run), "--output", out]) == 0
    return out


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    """The same bytes read as int32 (as a quantized export stores its codes): size unchanged."""
    return t.float().contiguous().view(torch.int32)


def _int_hf(hf_dir, tmp_path) -> tuple[list[str], str]:
    from safetensors.torch import load_file, save_file

    out = str(tmp_path / "hf")
    shutil.copytree(hf_dir, out)
    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.mlp.up_proj.weight"] = _as_int32(tensors["model.layers.0.mlp.up_proj.weight"])
    save_file(tensors, path, metadata={"format": "pt"})
    return ["from-hf", "--hf", out, "--output", str(tmp_path / "out")], "model.layers.0.mlp.up_proj.weight"


def _int_checkpoint(run, tmp_path) -> tuple[list[str], str]:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    directory = str(copy / "checkpoints" / "iter_0000002")
    meta, state = read_metadata(directory), read_rank_state(directory, 0)
    state["model"]["lm_head.weight"] = _as_int32(state["model"]["lm_head.weight"])
    path = os.path.join(directory, "rank_00000.safetensors")
    meta["files"]["rank_00000.safetensors"] = dict(zip(("bytes", "crc32"), write_rank_state(path, state)))
    write_metadata(directory, meta)  # size and CRC-32 match: only the dtype tells
    return ["to-hf", "--checkpoint", str(copy), "--output", str(tmp_path / "out")], "lm_head.weight"


TITAN = dict(vocab=64, dim=32, heads=4, kv=2, ffn=64, layers=1)


def _int_torchtitan(run, tmp_path) -> tuple[list[str], str]:
    from megapretrain.checkpoint.torchtitan import save_dcp

    v, d, f, kv = TITAN["vocab"], TITAN["dim"], TITAN["ffn"], TITAN["kv"] * TITAN["dim"] // TITAN["heads"]
    shapes = {"tok_embeddings.weight": (v, d), "norm.weight": (d,), "output.weight": (v, d),
              "layers.0.attention.wq.weight": (d, d), "layers.0.attention.wk.weight": (kv, d),
              "layers.0.attention.wv.weight": (kv, d), "layers.0.attention.wo.weight": (d, d),
              "layers.0.attention_norm.weight": (d,), "layers.0.ffn_norm.weight": (d,),
              "layers.0.feed_forward.w1.weight": (f, d), "layers.0.feed_forward.w2.weight": (d, f),
              "layers.0.feed_forward.w3.weight": (f, d)}
    bad = "layers.0.feed_forward.w2.weight"
    dtypes = {k: torch.int8 if k == bad else torch.float32 for k in shapes}
    step = str(tmp_path / "step-1")
    save_dcp(step, {k: (s, dtypes[k]) for k, s in shapes.items()},
             lambda k: torch.ones(shapes[k], dtype=dtypes[k]))
    flags = ["--model.num_layers", "1", "--model.hidden_size", str(d), "--model.num_heads", str(TITAN["heads"]),
             "--model.num_kv_heads", str(TITAN["kv"]), "--model.ffn_hidden_size", str(f), "--model.vocab_size",
             str(v)]
    return ["from-torchtitan", "--dcp", step, "--output", str(tmp_path / "out"), *flags], bad


WEIGHT_READERS = {"from-hf": lambda run, hf, tmp: _int_hf(hf, tmp),
                  "to-hf (megapretrain checkpoint)": lambda run, hf, tmp: _int_checkpoint(run, tmp),
                  "from-torchtitan": lambda run, hf, tmp: _int_torchtitan(run, tmp)}


@pytest.mark.parametrize("reader", list(WEIGHT_READERS))
def test_every_weight_reader_refuses_integer_weights(reader, run, hf_dir, tmp_path, capsys):
    argv, tensor = WEIGHT_READERS[reader](run, hf_dir, tmp_path)
    capsys.readouterr()
    err = assert_one_line(capsys, convert_checkpoint.main(argv), 2, tensor, "floating point")
    assert "int32" in err or "int8" in err, err
    assert not (tmp_path / "out").exists()


# -- a data file changed under a running job --------------------------------------------------------


def test_a_data_file_overwritten_in_place_stops_the_run_naming_it(data, tmp_path, capsys, monkeypatch):
    prefix = str(tmp_path / "c_text_document")
    for suffix in (".bin", ".idx"):
        shutil.copy(data + suffix, prefix + suffix)
    bin_path = prefix + ".bin"
    before = os.stat(bin_path)
    original = Faults.before_step

    def overwrite_before_step_3(self, iteration):
        """As another job rewriting the corpus in place: same size, same inode, other ids."""
        if iteration == 3:
            with open(bin_path, "r+b") as fh:
                ids = np.frombuffer(fh.read(), dtype=np.uint16)
                fh.seek(0)
                fh.write(((ids + 1) % 256).astype(np.uint16).tobytes())
            # a write's time is the clock's: set it past the original explicitly (no clock granularity)
            os.utime(bin_path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
        return original(self, iteration)

    monkeypatch.setattr(Faults, "before_step", overwrite_before_step_3)
    capsys.readouterr()
    status = _train(tmp_path / "run", prefix, "--train.iters", "6", "--logging.interval", "1")
    after = os.stat(bin_path)
    assert (after.st_size, after.st_ino) == (before.st_size, before.st_ino)
    err = assert_one_line(capsys, status, 2, bin_path, "written in place", "iteration 3", "resume")
    assert "Traceback" not in err
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "iter_0000003"  # saved as a stop signal saves
    assert not (checkpoints / "iter_0000004").exists()


# -- a model too large for memory, refused before it is built ---------------------------------------

# each alone needs terabytes a rank (no host holds them), and is checked without building anything
SIZES = {"num_layers": 10**7, "hidden_size": 10**6, "ffn_hidden_size": 10**10, "vocab_size": 10**10}


@pytest.mark.parametrize("field", list(SIZES))
def test_a_model_larger_than_memory_is_refused_at_resolve_time(field, data, tmp_path, capsys):
    status = _train(tmp_path / "run", data, f"--model.{field}", str(SIZES[field]))
    err = assert_one_line(capsys, status, 2, f"model.{field}={SIZES[field]:,}", "needs", "a rank",
                          "parallel.tp")
    assert "parameters" in err
    assert not (tmp_path / "run" / "checkpoints").exists()
    # a dry run on a CPU machine sizes the model against it only when the run trains on the CPU
    status = _train(tmp_path / "run", data, f"--model.{field}", str(SIZES[field]), "--check", "--train.device",
                    "cpu")
    assert_one_line(capsys, status, 2, f"model.{field}={SIZES[field]:,}", "needs")


# -- the shipped tiny config: its vocabulary is its tokenizer's ------------------------------------


def test_the_tiny_config_dry_runs_plans_and_simulates(data, tmp_path):
    tiny = os.path.join(ROOT, "configs", "tiny.yaml")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in (
        "NNODES", "NODE_RANK", "MASTER_ADDR", "NPROC_PER_NODE", "DEFAULT_NNODES", "DEFAULT_NPROC_PER_NODE")}
    env.update(PYTHON=sys.executable, PYTHONPATH=ROOT)
    data_flags = ["--data.paths", f"[{data}]", "--run.dir", str(tmp_path / "run")]
    commands = {
        "dry-run": ["bash", os.path.join(ROOT, "run_scripts", "launch.sh"), tiny, "--dry-run", *data_flags],
        "plan": [sys.executable, os.path.join(ROOT, "tools", "plan.py"), "--config", tiny, "--gpus", "1",
                 "--check", "--json"],
        "simulate": [sys.executable, os.path.join(ROOT, "tools", "simulate.py"), "--config", tiny,
                     "--world-size", "1", "--json"],
    }
    procs = {name: subprocess.Popen(argv, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name, argv in commands.items()}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, (name, err)
        assert "vocab_size" not in err and "128256" not in err, (name, err)
        if name != "dry-run":
            assert json.loads(out), name
    # a tokenizer that cannot be read here: asked for, with no other model's vocabulary suggested
    proc = subprocess.run(commands["plan"] + ["--data.tokenizer.type", "HuggingFaceTokenizer",
                                              "--data.tokenizer.model", str(tmp_path / "none")],
                          env=env, cwd=str(tmp_path), capture_output=True, text=True)
    assert proc.returncode == 2 and "--model.vocab_size" in proc.stderr and "128256" not in proc.stderr, proc.stderr
