"""Bad input, entry point by entry point: one clear line, no traceback, nothing the user has changed.

Each case runs the real command in a subprocess on files it makes, then checks the exit status, that
stderr is one ``error:`` line naming the field or file, and that every file that was there before
is byte for byte the same afterwards (and no partial output is left behind).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from conftest import assert_one_line, snapshot, write_corpus
from helpers import TWO_STEPS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "WORLD_SIZE": "1", "RANK": "0"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def train(*args) -> list[str]:
    return ["-m", "megapretrain.train", *TWO_STEPS, *args]


def tool(name: str, *args) -> list[str]:
    return [os.path.join(ROOT, "tools", f"{name}.py"), *args]


def _big_ids(d):
    """A dataset whose ids go up to 299: tokenized with something bigger than the 257-token ByteTokenizer."""
    from megapretrain.data.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(os.path.join(d, "big_text_document.bin"), np.uint16)
    for i in range(50):
        b.add_document((np.arange(40) * 7 + i) % 300)
    b.finalize(os.path.join(d, "big_text_document.idx"))


def _gpt2_summary(d):
    write_corpus(os.path.join(d, "gpt2_text_document"), num_docs=20)
    json.dump({"format": "megapretrain-preprocess-summary-v1", "tokenizer": {"type": "GPT2BPETokenizer",
               "vocab_size": 50257}}, open(os.path.join(d, "gpt2_text_document.summary.json"), "w"))


def _held_lock(d):
    _corpus(d)
    os.makedirs(os.path.join(d, "run"))
    json.dump({"pid": os.getppid(), "host": socket.gethostname(), "started": 0},  # pytest's parent: alive
              open(os.path.join(d, "run", ".lock"), "w"))


def _two_tokenizers(d):
    for name, kind, vocab in (("a", "ByteTokenizer", 257), ("b", "GPT2BPETokenizer", 50257)):
        write_corpus(os.path.join(d, name), num_docs=10)
        json.dump({"format": "megapretrain-preprocess-summary-v1", "tokenizer": {"type": kind, "vocab_size": vocab}},
                  open(os.path.join(d, f"{name}.summary.json"), "w"))


def _corpus(d):
    write_corpus(os.path.join(d, "c_text_document"), num_docs=20)


def _bad_tokenizer(d):
    _corpus(d)
    open(os.path.join(d, "tokenizer.json"), "w").write("{not json")


def _existing_output(d):
    _corpus(d)
    open(os.path.join(d, "in.jsonl"), "w").write('{"text": "hello"}\n')
    open(os.path.join(d, "out_text_document.summary.json"), "w").write("{}")  # from an earlier run


CASES = {
    # name: (setup, command, exit status, words the one line must hold)
    "train: a zero size": (_corpus, train("--data.paths", "[c_text_document]", "--model.ffn_hidden_size", "0"), 2,
                           ["model.ffn_hidden_size=0", "at least 1"]),
    "train: a negative count": (_corpus, train("--data.paths", "[c_text_document]", "--model.num_kv_heads", "-1"), 2,
                                ["model.num_kv_heads=-1"]),
    "train: a config that is a directory": (_corpus, train("--config", "."), 2, ["config file '.'"]),
    "train: ids beyond the vocabulary": (_big_ids, train("--data.paths", "[big_text_document]"), 2,
                                         ["big_text_document.bin", "token id 299", "model.vocab_size=257"]),
    "train: data from another tokenizer": (_gpt2_summary, train("--data.paths", "[gpt2_text_document]"), 2,
                                           ["gpt2_text_document.summary.json", "GPT2BPETokenizer", "data.tokenizer"]),
    "train: a run directory in use": (_held_lock, train("--run.dir", "run", "--data.paths", "[c_text_document]"), 2,
                                      ["run.dir run is in use", "PID"]),
    "train: a damaged tokenizer file": (_bad_tokenizer, train("--data.paths", "[c_text_document]",
                                        "--data.tokenizer.type", "HuggingFaceTokenizer",
                                        "--data.tokenizer.model", "tokenizer.json"), 2,
                                        ["HuggingFaceTokenizer cannot load tokenizer.json", "data.tokenizer.model"]),
    "train: a missing dataset": (_corpus, train("--data.paths", "[nowhere_text_document]"), 2,
                                 ["nowhere_text_document", "not found"]),
    "preprocess: an output that exists": (_existing_output, tool("preprocess_data", "--input", "in.jsonl",
                                          "--output-prefix", "out", "--tokenizer-type", "ByteTokenizer"), 1,
                                          ["out_text_document.summary.json", "--overwrite"]),
    "merge: inputs from two tokenizers": (_two_tokenizers, tool("merge_datasets", "--input", "a", "b",
                                          "--output-prefix", "ab"), 1, ["tokenized differently", "a:", "b:"]),
    "inspect: a missing dataset": (_corpus, tool("inspect_data", "nowhere"), 1, ["nowhere.idx not found"]),
    "reshard: no ranks": (_corpus, tool("reshard_checkpoint", "--checkpoint", "x", "--output", "y",
                                        "--world-size", "0"), 2, ["--world-size"]),
    "convert: not a Hugging Face directory": (_corpus, tool("convert_checkpoint", "from-hf", "--hf", ".",
                                              "--output", "out"), 2, ["config.json"]),
    "plan: no GPUs": (_corpus, tool("plan", "--config", os.path.join(ROOT, "configs", "llama3_8b.yaml"),
                                    "--gpus", "0"), 2, ["--gpus"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gets_one_line_and_changes_nothing(name, tmp_path):
    setup, command, status, words = CASES[name]
    setup(str(tmp_path))
    before = snapshot(tmp_path)
    done = run(command, tmp_path)
    assert done.returncode == status, (done.returncode, done.stderr[-2000:])
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("warning:")]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    # argparse writes its usage, then "tool.py: error: ..."
    assert lines and (name.startswith("inspect") or "error: " in lines[-1]), done.stderr
    assert all(w in done.stderr for w in words), (words, done.stderr)
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before  # nothing there before changed
    left = sorted(set(after) - set(before))
    assert not [f for f in left if ".tmp" in f or f.endswith(".part")], left


def test_a_full_disk_while_preprocessing_leaves_nothing(tmp_path, monkeypatch, capsys):
    """ENOSPC in the middle of writing: one line naming the directory, the partial files removed."""
    from megapretrain.commands import preprocess_data as preprocess
    from megapretrain.data.indexed_dataset import IndexedDatasetBuilder
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * 50}) + "\n" for i in range(200)))

    def full(self, arr):
        raise OSError(errno.ENOSPC, "No space left on device", self.bin_path)

    monkeypatch.setattr(IndexedDatasetBuilder, "_write_tokens", full)
    status = preprocess.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "out"),
                              "--tokenizer-type", "ByteTokenizer", "--workers", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert status == 1 and f"no space left on {tmp_path}" in err and err.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_resuming_with_a_changed_batch_warns(tmp_path, corpus, capsys):
    from megapretrain.train import main

    run_dir = str(tmp_path / "run")
    base = ["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *TWO_STEPS, "--checkpoint.interval", "1"]
    assert main(base) == 0
    capsys.readouterr()
    assert main([*base, "--train.iters", "3", "--train.global_batch_size", "4"]) == 0
    err = capsys.readouterr().err
    assert "warning: resuming at iteration 2 with train.global_batch_size changed from 2 to 4" in err
    assert os.path.exists(os.path.join(run_dir, "config.before-iter2.yaml"))


def test_a_stale_lock_is_taken_over(tmp_path, corpus, capsys):
    from megapretrain.train import main

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (run_dir / ".lock").write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    assert main(["--run.dir", str(run_dir), "--data.paths", f"[{corpus}]", *TWO_STEPS]) == 0
    assert "taking over the stale lock" in capsys.readouterr().err
    assert not (run_dir / ".lock").exists()


# -- in-process cases: one line, no traceback, every file as it was ------------------------------


def _train_main(*args) -> int:
    from megapretrain.train import main

    return main([*TWO_STEPS, "--data.paths", "[c_text_document]", *args])


CONFIG_FILES = {  # name: (bytes of the config file, words the line must hold)
    "UTF-16": ("train:\n  iters: 5\n".encode("utf-16"), ["cfg.yaml", "UTF-16", "UTF-8"]),
    "UTF-32": ("train:\n  iters: 5\n".encode("utf-32"), ["cfg.yaml", "UTF-32"]),
    "binary": (bytes(range(256)), ["cfg.yaml", "not a text file"]),
    "Latin-1": ("run:\n  name: café\n".encode("latin-1"), ["cfg.yaml", "not UTF-8", "line 2"]),
    "a section twice": (b"train:\n  iters: 5\nmodel:\n  num_layers: 3\ntrain:\n  seed: 3\n",
                        ["cfg.yaml", "line 5", "'train' appears twice", "line 1"]),
    "a key twice": (b"train:\n  iters: 5\n  iters: 6\n", ["cfg.yaml", "'iters' appears twice"]),
    "a control character": (b"train:\n  iters: \x07\n", ["cfg.yaml", "not valid YAML"]),
}


@pytest.mark.parametrize("name", list(CONFIG_FILES))
def test_a_config_file_that_is_not_utf8_yaml_is_one_line(name, tmp_path, unchanged, capsys):
    data, words = CONFIG_FILES[name]
    (tmp_path / "cfg.yaml").write_bytes(data)
    _corpus(str(tmp_path))
    unchanged()
    assert_one_line(capsys, _train_main("--config", "cfg.yaml"), 2, *words)


def test_a_utf8_config_with_a_byte_order_mark_and_yaml_merges_loads(tmp_path):
    from megapretrain.config import load_config

    (tmp_path / "bom.yaml").write_bytes("\ufefftrain:\n  iters: 7\n".encode("utf-8"))
    assert load_config(str(tmp_path / "bom.yaml")).train.iters == 7
    (tmp_path / "merge.yaml").write_text("train: &t {iters: 7, seed: 1}\noptim: {lr: 0.01}\n")
    assert load_config(str(tmp_path / "merge.yaml")).train.seed == 1


def test_a_key_twice_in_an_override_is_one_line():
    from megapretrain.config import load_config
    from megapretrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--model.rope_scaling.*'factor' appears twice"):
        load_config(None, ["--model.rope_scaling", "{factor: 8, factor: 4}"])


NUMBERS = {  # override: words
    ("--optim.lr", "nan"): ["optim.lr=nan", "finite"],
    ("--optim.min_lr", ".nan"): ["optim.min_lr=nan", "finite"],  # a field with no declared range
    ("--alerts.grad_norm_max", "1e999"): ["alerts.grad_norm_max=inf", "finite"],
    ("--optim.betas", "[.nan, 0.95]"): ["optim.betas", "finite"],
    ("--model.rope_scaling", "{rope_type: llama3, factor: .inf}"): ["model.rope_scaling", "finite"],
    ("--train.iters", str(2 ** 63)): ["train.iters", "2**63"],
    ("--watchdog.timeout_s", "-.inf"): ["watchdog.timeout_s", "finite"],
}


@pytest.mark.parametrize("override", list(NUMBERS), ids=[" ".join(k) for k in NUMBERS])
def test_every_number_is_finite_and_in_range(override, tmp_path, unchanged, capsys):
    _corpus(str(tmp_path))
    unchanged()
    assert_one_line(capsys, _train_main(*override), 2, *NUMBERS[override])


def test_nan_fails_every_declared_range():
    """The general rule: ``nan < low`` is false, so every range check refuses NaN explicitly."""
    import dataclasses
    import typing

    from megapretrain.config import Config, check_fields
    from megapretrain.errors import ConfigError

    checked = 0
    for section in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[section.name]
        for f in dataclasses.fields(cls):
            if typing.get_type_hints(cls)[f.name] not in (float, typing.Optional[float]):
                continue
            cfg = Config()
            setattr(getattr(cfg, section.name), f.name, float("nan"))
            with pytest.raises(ConfigError, match="finite"):
                check_fields(cfg)
            checked += 1
    assert checked > 20


def _read_only(tmp_path):
    """A directory that cannot be written: a read-only tmpfs where mounting one is allowed, else
    one whose writes the test makes fail with EROFS at the lowest level (os.mkdir, mkstemp)."""
    target = tmp_path / "ro"
    target.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(target)],
                             capture_output=True).returncode == 0
    return target, mounted


@pytest.mark.parametrize("field,value,words", [
    ("--run.dir", "", ["run.dir=''", "empty path"]),
    ("--run.dir", "afile", ["run.dir='afile'", "is a file"]),
    ("--run.dir", "afile/run", ["run.dir='afile/run'", "afile is a file"]),
    ("--data.cache_dir", "afile", ["data.cache_dir='afile'", "is a file"]),
])
def test_an_output_directory_that_cannot_be_one_is_one_line(field, value, words, tmp_path, unchanged, capsys):
    _corpus(str(tmp_path))
    (tmp_path / "afile").write_text("mine")
    unchanged()
    assert_one_line(capsys, _train_main("--run.dir", "run", field, value), 2, *words)
    assert not (tmp_path / "run").exists()


def test_a_run_dir_on_a_read_only_file_system_is_one_line(tmp_path, unchanged, capsys, monkeypatch):
    import errno

    _corpus(str(tmp_path))
    target, mounted = _read_only(tmp_path)
    try:
        if not mounted:
            import tempfile

            def refuse(*args, **kwargs):
                raise OSError(errno.EROFS, "Read-only file system")
            monkeypatch.setattr(os, "mkdir", refuse)
            monkeypatch.setattr(tempfile, "mkstemp", refuse)
        unchanged()
        assert_one_line(capsys, _train_main("--run.dir", str(target / "run")), 2, "run.dir=", "Read-only file system")
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(target)], check=True)  # lazily: a failed run may hold files


def _probe_many(parent: str, name: str, times: int) -> list[str]:
    from megapretrain.user_files import not_writable_dir

    return [why for _ in range(times) if (why := not_writable_dir(os.path.join(parent, "runs", name))) is not None]


def test_runs_probing_one_missing_parent_at_once_all_pass_and_leave_nothing(tmp_path):
    """Several dry runs at once check run dirs under one missing parent (runs/A, runs/B, ...): each
    makes and removes that parent, and none may see it vanish under its own probe."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(4) as pool:
        found = pool.starmap(_probe_many, [(str(tmp_path), f"model{i}", 150) for i in range(4)])
    assert found == [[]] * 4
    assert os.listdir(tmp_path) == []  # every probe took back what it made


@pytest.mark.parametrize("flags,words", [
    (["--train.seq_length", "1000000000"], ["train.seq_length=1,000,000,000", "needs at least", "GiB"]),
    (["--train.micro_batch_size", "100000000", "--train.global_batch_size", "100000000"],
     ["train.micro_batch_size=100000000", "needs at least", "TiB"]),
])
def test_a_micro_batch_beyond_memory_is_refused_naming_what_it_needs(flags, words, tmp_path, unchanged, capsys,
                                                                      monkeypatch):
    monkeypatch.setattr("megapretrain.oom.available_bytes", lambda: 64 << 30)  # a 64 GiB machine, whatever runs it
    _corpus(str(tmp_path))
    unchanged()
    assert_one_line(capsys, _train_main("--run.dir", "run", *flags), 2, *words)
    assert not (tmp_path / "run" / "data_cache").exists()  # refused before any index was built


def test_indices_beyond_the_cache_disk_are_refused_before_they_are_built(tmp_path, unchanged, capsys,
                                                                         monkeypatch):
    free = shutil.disk_usage(tmp_path).free
    monkeypatch.setattr("megapretrain.data.gpt_dataset.shutil.disk_usage",
                        lambda path: shutil._ntuple_diskusage(2 * free, free, 64 << 30))
    _corpus(str(tmp_path))
    unchanged()
    assert_one_line(capsys, _train_main("--run.dir", "run", "--train.iters", "100000000000"), 2,
                    "GPTDataset 'train'", "sample indices", "need about", "TiB of disk", "64.0 GiB")
    cache = tmp_path / "run" / "data_cache"
    assert not [f for f in os.listdir(cache) if f.endswith(".npy")]


def test_the_index_estimate_follows_what_building_takes():
    """index_bytes is within a factor 2.5 of the peak numpy allocates building the indices, from one
    epoch of long documents to many epochs of a few (the shapes a refusal is about)."""
    import tracemalloc

    from megapretrain.data.gpt_dataset import build_gpt_indices, epochs_for, index_bytes

    for docs, seq, samples in ((200_000, 2048, 400_000), (20, 100_000, 50), (100_000, 256, 3_000_000)):
        lengths = np.random.default_rng(0).integers(1, 2000, size=docs)
        epochs = epochs_for(samples, int(lengths.sum()), seq)
        tracemalloc.start()
        build_gpt_indices(lengths, np.arange(docs), seq, epochs, 0)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        kept, epoch = index_bytes(docs, seq, samples, epochs)
        in_memory = 2 * kept + epoch  # the pieces held, then joined
        assert peak / 2.5 < in_memory < 2.5 * peak, (docs, seq, samples)


def test_every_numeric_flag_of_every_tool_goes_through_the_shared_parser():
    """No tool declares a number flag with a bare int/float (which take nan, inf and negatives)."""
    import re

    commands = os.path.join(ROOT, "megapretrain", "commands")
    bare = [f"{name}:{i}" for name in os.listdir(commands) if name.endswith(".py")
            for i, line in enumerate(open(os.path.join(commands, name)), 1)
            if re.search(r"type=(int|float)\b", line)]
    assert not bare


@pytest.mark.parametrize("tool_argv,words", [
    (("preflight", "--config", "x.yaml", "--max-memory-gb", "nan"), ["--max-memory-gb", "nan"]),
    (("preflight", "--config", "x.yaml", "--min-tokens-per-sec", "inf"), ["--min-tokens-per-sec"]),
    (("preflight", "--config", "x.yaml", "--resume-tolerance", "nan"), ["--resume-tolerance"]),
    (("smoke_test", "--rtol", "nan"), ["--rtol"]),
    (("convert_checkpoint", "to-hf", "--checkpoint", "c", "--output", "o", "--tolerance", "-1"), ["--tolerance"]),
    (("convert_checkpoint", "to-hf", "--checkpoint", "c", "--output", "o", "--tolerance", "nan"), ["--tolerance"]),
    (("convert_checkpoint", "to-hf", "--checkpoint", "c", "--output", "o", "--max-shard-gb", "-1"),
     ["--max-shard-gb"]),
    (("convert_checkpoint", "from-hf", "--hf", "h", "--output", "o", "--world-size", "0"), ["--world-size"]),
    (("reshard_checkpoint", "--checkpoint", "c", "--output", "o", "--world-size", "0"), ["--world-size"]),
    (("merge_checkpoints", "--checkpoints", "a", "b", "--output", "o", "--world-size", "0"), ["--world-size"]),
    (("merge_checkpoints", "--checkpoints", "a", "b", "--output", "o", "--weights", "x", "1"), ["--weights", "'x'"]),
    (("inspect_checkpoint", "c", "--diff", "d", "--rtol", "nan"), ["--rtol"]),
    (("build_demo_corpus", "--output", "o", "--max-mb", "-inf"), ["--max-mb"]),
])
def test_a_bad_number_is_refused_by_the_flag_parser_before_any_work(tool_argv, words, tmp_path, unchanged,
                                                                     capsys):
    import importlib

    unchanged()
    main = importlib.import_module(f"megapretrain.commands.{tool_argv[0]}").main
    with pytest.raises(SystemExit) as exit_:
        main(list(tool_argv[1:]))
    assert_one_line(capsys, exit_.value.code, 2, *words)


@pytest.mark.parametrize("flags,words", [
    (["--model.num_heads", "0"], ["model.num_heads=0"]),
    (["--model.hidden_size", "0"], ["model.hidden_size=0"]),
    (["--train.global_batch_size", "0"], ["train.global_batch_size=0"]),
    (["--model.num_heads", "3"], ["model.num_heads=3", "must divide"]),
    (["--optim.lr", "nan"], ["optim.lr=nan"]),
])
def test_plan_checks_the_config_before_searching(flags, words, capsys):
    from megapretrain.commands import plan

    config = os.path.join(ROOT, "configs", "llama3_8b.yaml")
    assert_one_line(capsys, plan.main(["--config", config, "--gpus", "8", *flags]), 2, *words)


def test_a_smoke_test_with_no_layout_to_compare_says_so(tmp_path, capsys):
    from megapretrain.commands import smoke_test

    assert_one_line(capsys, smoke_test.main(["--workdir", str(tmp_path / "w")]), 2, "no layout to check")
    assert not (tmp_path / "w").exists()


# -- a file or directory of another kind, given to every tool input --------------------------------


@pytest.fixture(scope="module")
def kinds(tmp_path_factory, corpus):
    """One path of every kind the project knows: name -> path."""
    from megapretrain.commands import convert_checkpoint
    from megapretrain.train import main as train_main

    d = tmp_path_factory.mktemp("kinds")
    run = d / "run"
    assert train_main([*TWO_STEPS, "--data.paths", f"[{corpus}]", "--run.dir", str(run),
                       "--checkpoint.interval", "1"]) == 0
    assert convert_checkpoint.main(["to-hf", "--checkpoint", str(run), "--output", str(d / "hf")]) == 0
    (d / "config.yaml").write_text(open(os.path.join(ROOT, "configs", "tiny.yaml")).read())
    (d / "corpus.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    (d / "tasks.jsonl").write_text(json.dumps({"context": "a", "choices": [" b", " c"], "label": 0}) + "\n")
    (d / "notes.txt").write_text("some words\n")
    (d / "empty").write_bytes(b"")
    (d / "adir").mkdir()
    iteration = run / "checkpoints" / "iter_0000002"
    return {"dataset prefix": corpus, "dataset .bin": corpus + ".bin", "run directory": str(run),
            "iter_* directory": str(iteration), "rank file": str(iteration / "rank_00000.safetensors"),
            "HF directory": str(d / "hf"), "config": str(d / "config.yaml"), "JSONL corpus": str(d / "corpus.jsonl"),
            "task file": str(d / "tasks.jsonl"), "metrics.jsonl": str(run / "metrics.jsonl"),
            "text file": str(d / "notes.txt"), "empty file": str(d / "empty"), "directory": str(d / "adir")}


CHECKPOINTS = {"run directory", "iter_* directory"}
# input: (command, argv with X for the input and O for a new output, the kinds it takes)
TOOL_INPUTS = {
    "to-hf --checkpoint": ("convert_checkpoint", ["to-hf", "--checkpoint", "X", "--output", "O"], CHECKPOINTS),
    "to-hf --config": ("convert_checkpoint", ["to-hf", "--checkpoint", "R", "--config", "X", "--output", "O"],
                       {"config"}),
    "from-hf --hf": ("convert_checkpoint", ["from-hf", "--hf", "X", "--output", "O"], {"HF directory"}),
    "to-megatron --checkpoint": ("convert_checkpoint", ["to-megatron", "--checkpoint", "X", "--output", "O"],
                                 CHECKPOINTS),
    "from-megatron --megatron": ("convert_checkpoint", ["from-megatron", "--megatron", "X", "--output", "O"],
                                 set()),
    "to-dcp --checkpoint": ("convert_checkpoint", ["to-dcp", "--checkpoint", "X", "--output", "O"], CHECKPOINTS),
    "from-dcp --dcp": ("convert_checkpoint", ["from-dcp", "--dcp", "X", "--output", "O"], set()),
    "reshard --checkpoint": ("reshard_checkpoint", ["--checkpoint", "X", "--output", "O", "--world-size", "1"],
                             CHECKPOINTS),
    "merge_checkpoints --checkpoints": ("merge_checkpoints", ["--checkpoints", "X", "R", "--output", "O"],
                                        CHECKPOINTS),
    "inspect_checkpoint": ("inspect_checkpoint", ["X"], CHECKPOINTS),
    "evaluate --checkpoint": ("evaluate", ["--checkpoint", "X", "--tasks", "T"], CHECKPOINTS),
    "evaluate --tasks": ("evaluate", ["--checkpoint", "R", "--tasks", "X"], {"task file"}),
    "inspect_data": ("inspect_data", ["X"], {"dataset prefix"}),
    "make_tasks --data": ("make_tasks", ["--data", "X", "--output", "O"], {"dataset prefix"}),
    "merge_datasets --input": ("merge_datasets", ["--input", "X", "--output-prefix", "O"], {"dataset prefix"}),
    "plan --config": ("plan", ["--config", "X", "--gpus", "8"], {"config"}),
    "simulate --config": ("simulate", ["--config", "X", "--world-size", "1"], {"config"}),
    "pipeline_schedule --config": ("pipeline_schedule", ["--config", "X"], {"config"}),
    "plot_run": ("plot_run", ["X", "--output", "O"], {"run directory", "metrics.jsonl"}),
    "preprocess_data --input": ("preprocess_data", ["--input", "X", "--output-prefix", "O", "--tokenizer-type",
                                                    "ByteTokenizer", "--no-progress"],
                                # (an empty file has a line of its own: no documents)
                                {"JSONL corpus", "text file", "config", "task file", "metrics.jsonl",
                                 "empty file"}),
    "train --config": ("train", ["--config", "X", "--data.paths", "[D]", "--run.dir", "O", "--check"], {"config"}),
    "train data.paths": ("train", ["--data.paths", "[X]", "--run.dir", "O", "--check"],
                         {"dataset prefix", "dataset .bin"}),
    "train checkpoint.load": ("train", ["--data.paths", "[D]", "--run.dir", "O", "--checkpoint.load", "X",
                                        "--check"], CHECKPOINTS),
    "train eval.tasks": ("train", ["--data.paths", "[D]", "--run.dir", "O", "--eval.tasks", "[X]", "--check"],
                         {"task file"}),
}
KINDS = ["dataset prefix", "dataset .bin", "run directory", "iter_* directory", "rank file", "HF directory",
         "config", "JSONL corpus", "task file", "metrics.jsonl", "text file", "empty file", "directory"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tool_input", list(TOOL_INPUTS))
def test_every_tool_input_refuses_a_path_of_another_kind_naming_it(tool_input, kind, kinds, tmp_path, capsys):
    """A path of a kind the project knows, given where another belongs, is one line (exit 2) that
    says what the path is; a path of no known kind (a text file, a bare directory) is still one
    line, from the reader. Nothing is written."""
    import importlib

    from megapretrain.train import main as train_main
    from megapretrain.user_files import UNKNOWN_KINDS, describe_path

    command, template, takes = TOOL_INPUTS[tool_input]
    if kind in takes:
        pytest.skip("the kind this input takes")
    path, out = kinds[kind], str(tmp_path / "out")
    given = {"X": path, "[X]": f"[{path}]", "O": out, "R": kinds["run directory"], "T": kinds["task file"],
             "[D]": f"[{kinds['dataset prefix']}]"}
    argv = [given.get(a, a) for a in template]
    if command == "train":
        argv = [*TWO_STEPS, *argv]
    main = train_main if command == "train" else importlib.import_module(f"megapretrain.commands.{command}").main
    capsys.readouterr()
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse
        status = exc.code
    what = describe_path(path)
    if what in UNKNOWN_KINDS:  # the reader's own line (inspect_data's report: its FAIL lines)
        err = capsys.readouterr().err
        assert status in (1, 2) and "Traceback" not in err, (status, err)
    else:
        assert_one_line(capsys, status, 2, what)
    # (the dry run of training checks its data first, into the data checks' cache)
    assert not os.path.exists(out) or os.listdir(out) in ([], ["data_cache"]), os.listdir(out)
