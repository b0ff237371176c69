"""Shared fixtures: a small byte-level corpus written in the indexed format, and the bad-input checks
(one error line naming what is wrong; every file the user had left as it was)."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

WORDS = ("def return import class self value index tensor rank batch layer model data token "
         "loss grad step seed shard group split merge print while for if else").split()


def write_corpus(prefix: str, num_docs: int = 300, seed: int = 0) -> str:
    """Documents of pseudo-code lines (learnable structure), byte-tokenized with EOS=256."""
    from megapretrain.data.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for _ in range(num_docs):
        lines = []
        for _ in range(int(rng.integers(2, 12))):
            words = rng.choice(WORDS, size=int(rng.integers(2, 7)))
            lines.append("    " * int(rng.integers(0, 3)) + " ".join(words) + "(x)")
        tokens = list("\n".join(lines).encode()) + [256]
        builder.add_document(tokens)
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    """Prefix of a ~30k-token byte-level corpus (ByteTokenizer ids, EOS 256)."""
    return write_corpus(str(tmp_path_factory.mktemp("corpus") / "code_text_document"))


# -- bad input: one line, and nothing the user has changed --------------------------------------


def snapshot(folder) -> dict:
    out = {}
    for base, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(base, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, folder)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def assert_one_line(capsys, status: int, expected: int, *words: str) -> str:
    """The command returned ``expected`` and wrote one error line (argparse: its usage, then one)
    naming every one of ``words``; returns that stderr."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning:")]
    assert status == expected, err
    assert "Traceback" not in err, err
    errors = [line for line in lines if "error: " in line]
    assert len(errors) == 1 and errors[0] == lines[-1], err
    assert all(w in err for w in words), (words, err)
    return err


@pytest.fixture
def unchanged(tmp_path, monkeypatch):
    """Work in tmp_path; afterwards every file that was there is byte for byte the same and no
    temporary or partial file is left."""
    monkeypatch.chdir(tmp_path)
    before: dict = {}

    def start():
        before.update(snapshot(tmp_path))

    yield start
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before
    assert not [f for f in after if ".tmp" in f or f.endswith(".part") or "/.iter_" in f], sorted(after)
