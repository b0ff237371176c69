"""Bad input, entry point by entry point: one clear line, no traceback, nothing the user has changed.

Each case runs the real command in a subprocess on files it makes, then checks the exit status, that
stderr is one ``error:`` line naming the field or file, and that every file that was there before
is byte for byte the same afterwards (and no partial output is left behind).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from conftest import write_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_heads", "4", "--train.iters", "2",
        "--train.seq_length", "32", "--train.micro_batch_size", "2", "--train.global_batch_size", "2",
        "--logging.tensorboard", "false"]


def snapshot(folder) -> dict:
    out = {}
    for base, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(base, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, folder)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def run(args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "WORLD_SIZE": "1", "RANK": "0"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def train(*args) -> list[str]:
    return ["-m", "megapretrain.train", *TINY, *args]


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
    base = ["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *TINY, "--checkpoint.interval", "1"]
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
    assert main(["--run.dir", str(run_dir), "--data.paths", f"[{corpus}]", *TINY]) == 0
    assert "taking over the stale lock" in capsys.readouterr().err
    assert not (run_dir / ".lock").exists()
