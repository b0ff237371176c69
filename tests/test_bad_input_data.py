"""Bad data, in process: corpora that hold nothing or cannot be read, datasets whose files do not
belong together, summaries that are damaged or stale, merges that would duplicate documents or
find no room. Each is one line naming the file (or a warning naming what it drops), and nothing the
user has is changed; the trainer checks what tools/inspect_data.py checks, once per file."""

from __future__ import annotations

import errno
import gzip
import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from megapretrain.commands import merge_datasets, preprocess_data
from megapretrain.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from conftest import assert_one_line
from helpers import TWO_STEPS, write_jsonl


def preprocess(*argv) -> int:
    return preprocess_data.main([*argv, "--tokenizer-type", "ByteTokenizer", "--no-progress"])


def shard(directory, name: str, docs: int = 30, seed: int = 0) -> str:
    """A preprocessed ByteTokenizer shard (with its summary) of ``docs`` documents; its prefix."""
    rng = np.random.default_rng(seed)
    texts = [" ".join(f"w{int(x)}" for x in rng.integers(0, 50, size=int(rng.integers(5, 40)))) for _ in range(docs)]
    source = write_jsonl(os.path.join(directory, f"{name}.jsonl"), texts)
    assert preprocess("--input", source, "--output-prefix", os.path.join(directory, name), "--append-eod") == 0
    return os.path.join(directory, f"{name}_text_document")


def train(prefix: str, *args) -> int:
    from megapretrain.train import main

    return main([*TWO_STEPS, "--data.paths", f"[{prefix}]", *args])


def summary_of(prefix: str) -> dict:
    with open(prefix + ".summary.json") as fh:
        return json.load(fh)


def write_summary(prefix: str, summary: dict) -> None:
    with open(prefix + ".summary.json", "w") as fh:
        json.dump(summary, fh)


# -- raw corpora ------------------------------------------------------------------------------------


@pytest.mark.parametrize("lines,words", [
    ([], ["no documents to write", "no records"]),
    ([json.dumps({"text": ""})] * 3, ["no documents to write", "3 empty"]),
])
def test_a_corpus_with_no_document_writes_nothing_and_says_so(lines, words, tmp_path, unchanged, capsys):
    (tmp_path / "in.jsonl").write_text("".join(line + "\n" for line in lines))
    unchanged()
    assert_one_line(capsys, preprocess("--input", "in.jsonl", "--output-prefix", "out"), 1, *words)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_a_truncated_or_fake_gzip_is_named(tmp_path, unchanged, capsys):
    data = "".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(2000)).encode()
    packed = gzip.compress(data)
    (tmp_path / "cut.jsonl.gz").write_bytes(packed[:len(packed) // 2])
    (tmp_path / "fake.jsonl.gz").write_bytes(data[:4000])
    unchanged()
    assert_one_line(capsys, preprocess("--input", "cut.jsonl.gz", "--output-prefix", "a"), 1,
                    "cut.jsonl.gz: cannot be read after line", "truncated")
    assert_one_line(capsys, preprocess("--input", "fake.jsonl.gz", "--output-prefix", "b"), 1,
                    "fake.jsonl.gz: cannot be read at its start", "Not a gzipped file")


@pytest.mark.parametrize("argv,words", [
    (["--input", "in.jsonl", "--json-keys", "text", "text"], ["--json-keys", "'text' more than once"]),
    (["--input", "in.jsonl", "in.jsonl"], ["in.jsonl is given twice"]),
    (["--input", "in.jsonl", "./sub/../in.jsonl"], ["given twice", "also as in.jsonl"]),
    (["--input", "in.jsonl", "--tokenizer-model", "in.jsonl"], ["ByteTokenizer reads no tokenizer file"]),
])
def test_inputs_that_would_duplicate_or_be_ignored_are_refused(argv, words, tmp_path, unchanged, capsys):
    write_jsonl(tmp_path / "in.jsonl", ["one document", "another"])
    (tmp_path / "sub").mkdir()
    unchanged()
    assert_one_line(capsys, preprocess(*argv, "--output-prefix", "out"), 1, *words)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("out")]


def test_training_refuses_a_tokenizer_file_byte_tokenizer_would_ignore(tmp_path, unchanged, capsys):
    prefix = shard(str(tmp_path), "c")
    unchanged()
    assert_one_line(capsys, train(prefix, "--data.tokenizer.model", "c.jsonl"), 2,
                    "ByteTokenizer reads no tokenizer file", "data.tokenizer.model")


# -- datasets the trainer checks as inspect_data does -------------------------------------------------


def test_a_same_size_bin_of_another_dataset_is_named(tmp_path, unchanged, capsys):
    a, b = shard(str(tmp_path), "a", seed=1), shard(str(tmp_path), "b", seed=2)
    size = os.path.getsize(a + ".bin")
    with open(b + ".bin", "rb") as fh:  # b's tokens, cut to a's size: the sizes agree, the content does not
        other = fh.read()[:size].ljust(size, b"\0")
    with open(a + ".bin", "wb") as fh:
        fh.write(other)
    unchanged()
    assert_one_line(capsys, train(a, "--run.dir", "run"), 2, "a_text_document.bin: its sha256",
                    "a_text_document.summary.json records", "not the one preprocessing wrote")


def test_an_index_with_a_wrong_document_length_is_named(tmp_path, unchanged, capsys):
    prefix = shard(str(tmp_path), "a")
    os.remove(prefix + ".summary.json")  # no checksum to lean on: the index's own consistency tells
    ds = IndexedDataset(prefix)
    offset = 9 + 8 + 1 + 8 + 8 + 4 * 3  # header, then the 4th sequence length
    length = int(ds.sequence_lengths[3])
    del ds
    with open(prefix + ".idx", "r+b") as fh:
        fh.seek(offset)
        fh.write(np.int32(length + 2).tobytes())
        fh.seek(offset + 4)
        fh.write(np.int32(int(np.frombuffer(fh.read(4), np.int32)[0]) - 2).tobytes())
    unchanged()
    assert_one_line(capsys, train(prefix, "--run.dir", "run"), 2, "a_text_document.idx: pointers: sequence 4",
                    "do not belong together")


@pytest.mark.parametrize("change,words", [
    ({"max_token_id": 100}, ["max_token_id=100", "stale"]),
    ({"documents": 29}, ["documents=29", "the files hold 30", "stale"]),
    ({"tokenizer": "ByteTokenizer"}, ["tokenizer='ByteTokenizer'", "not an object", "damaged"]),
    ({"tokenizer": {"type": "ByteTokenizer", "vocab_size": "257"}}, ["tokenizer.vocab_size='257'", "damaged"]),
    ({"checksum": "abc"}, ["checksum='abc'", "damaged"]),
    ({"tokens": True}, ["tokens=True", "damaged"]),
])
def test_a_damaged_or_stale_summary_is_named(change, words, tmp_path, unchanged, capsys):
    prefix = shard(str(tmp_path), "a")
    write_summary(prefix, {**summary_of(prefix), **change})
    unchanged()
    assert_one_line(capsys, train(prefix, "--run.dir", "run"), 2, "a_text_document.summary.json", *words)


def test_inspect_data_names_a_damaged_summary_without_a_traceback(tmp_path, capsys):
    from megapretrain.commands import inspect_data

    prefix = shard(str(tmp_path), "a")
    write_summary(prefix, {**summary_of(prefix), "tokenizer": "ByteTokenizer"})
    assert inspect_data.main([prefix]) == 1
    err = capsys.readouterr().err
    assert "FAIL summary:" in err and "tokenizer='ByteTokenizer'" in err and "Traceback" not in err


def test_the_data_is_read_through_once_per_file_and_again_when_it_changes(tmp_path, monkeypatch):
    from megapretrain.data import checks

    prefix = shard(str(tmp_path), "a")
    scans = []
    real = checks.scan_tokens
    monkeypatch.setattr(checks, "scan_tokens", lambda *a, **k: scans.append(k["digest"]) or real(*a, **k))

    def check(cache="cache", verify=True):
        return checks.check_data_matches_model([prefix], "ByteTokenizer", 257, 257, str(tmp_path / cache), verify)

    facts = check()[prefix]
    assert facts["sha256"] == summary_of(prefix)["checksum"]["bin"] and facts["documents"] == 30
    assert check()[prefix] == facts and scans == [True]  # the second start found the cached pass
    assert check(verify=False) == {} and len(scans) == 1  # another rank of the node: headers only
    os.utime(prefix + ".bin", ns=(1, 1))  # the file changed, as far as anyone can tell: read again
    check()
    assert len(scans) == 2
    check("other_cache")  # another run's cache: read again (once per file and run)
    assert len(scans) == 3


def test_resuming_after_the_dataset_was_rebuilt_warns(tmp_path, capsys):
    prefix = shard(str(tmp_path), "a", seed=1)
    run = str(tmp_path / "run")
    assert train(prefix, "--run.dir", run, "--checkpoint.interval", "1") == 0
    capsys.readouterr()
    write_jsonl(tmp_path / "a.jsonl", ["another corpus, rebuilt at the same path"] * 40)
    assert preprocess("--input", str(tmp_path / "a.jsonl"), "--output-prefix", str(tmp_path / "a"),
                      "--append-eod", "--overwrite") == 0
    capsys.readouterr()
    assert train(prefix, "--run.dir", run, "--train.iters", "3") == 0
    err = capsys.readouterr().err
    assert f"warning: data.paths {prefix}: 30 documents" in err and "now 40 documents" in err
    assert "no longer continues the run's data order" in err


# -- merging ----------------------------------------------------------------------------------------


def merge(*argv) -> int:
    return merge_datasets.main(list(argv))


@pytest.mark.parametrize("damage,words", [
    ("{not json", ["b_text_document.summary.json cannot be read as JSON"]),
    ('{"tokenizer": "GPT2BPETokenizer"}', ["b_text_document.summary.json", "tokenizer='GPT2BPETokenizer'"]),
])
def test_a_shard_with_a_damaged_summary_is_not_merged(damage, words, tmp_path, unchanged, capsys):
    shard(str(tmp_path), "a")
    b = shard(str(tmp_path), "b", seed=1)
    (tmp_path / "b_text_document.summary.json").write_text(damage)
    unchanged()
    assert_one_line(capsys, merge("--input", "a_text_document", b, "--output-prefix", "ab"), 1, *words)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("ab")]


def test_a_shard_without_a_tokenizer_record_makes_an_output_that_records_none(tmp_path, capsys):
    a = shard(str(tmp_path), "a")
    b = shard(str(tmp_path), "b", seed=1)
    os.remove(b + ".summary.json")
    assert merge("--input", a, b, "--output-prefix", str(tmp_path / "ab")) == 0
    captured = capsys.readouterr()
    assert "warning: no tokenizer recorded for " + b in captured.err and "records no tokenizer" in captured.err
    assert "tokenizer" not in summary_of(str(tmp_path / "ab"))
    assert "merged 2 inputs, 60 documents" in captured.out


@pytest.mark.parametrize("inputs,words", [
    (["a_text_document", "a_text_document"], ["a_text_document is given twice", "merged twice"]),
    (["a_text_document", "link_text_document"], ["link_text_document and a_text_document are the same files"]),
    (["shards"], ["shards/all_text_document is a merge of", "merged twice"]),
    (["a_text_document", "copy_text_document"], ["hold the same tokens", "equal sha256"]),
])
def test_inputs_that_would_duplicate_every_document_are_refused(inputs, words, tmp_path, unchanged, capsys):
    a = shard(str(tmp_path), "a")
    for suffix in (".bin", ".idx"):
        os.link(a + suffix, str(tmp_path / "link_text_document") + suffix)
        shutil.copyfile(a + suffix, str(tmp_path / "copy_text_document") + suffix)
    shutil.copyfile(a + ".summary.json", str(tmp_path / "copy_text_document.summary.json"))
    (tmp_path / "shards").mkdir()
    for name, seed in (("x", 1), ("y", 2)):
        shard(str(tmp_path / "shards"), name, seed=seed)
    assert merge("--input", "shards", "--output-prefix", "shards/all_text_document") == 0  # an earlier merge
    capsys.readouterr()
    unchanged()
    assert_one_line(capsys, merge("--input", *inputs, "--output-prefix", "out"), 1, *words)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("out")]


def test_inputs_with_no_document_are_not_merged(tmp_path, unchanged, capsys):
    for name in ("e", "f"):
        builder = IndexedDatasetBuilder(str(tmp_path / name) + ".bin")
        builder.finalize(str(tmp_path / name) + ".idx")
    unchanged()
    assert_one_line(capsys, merge("--input", "e", "f", "--output-prefix", "out"), 1, "hold no documents",
                    "nothing was written")


def _small_disk(tmp_path):
    """A 64 KiB tmpfs where mounting one is allowed (None where not)."""
    target = tmp_path / "small"
    target.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(target)], capture_output=True)
    return target if done.returncode == 0 else None


def test_a_merge_that_fills_the_disk_is_one_line_and_leaves_nothing(tmp_path, unchanged, capsys, monkeypatch):
    """On a real 64 KiB file system where one can be mounted (else the writes fail with ENOSPC where
    the merge writes through): the line names the output, the bytes needed and free."""
    a, b = shard(str(tmp_path), "a", docs=300), shard(str(tmp_path), "b", docs=300, seed=1)
    small = _small_disk(tmp_path)
    try:
        out = str((small or tmp_path) / "ab")
        if small is None:
            def full(self, prefix, chunk=0, progress=None):
                raise OSError(errno.ENOSPC, "No space left on device")
            monkeypatch.setattr(IndexedDatasetBuilder, "add_index", full)
        else:  # the free-space check is what refuses first: pass it, so the writes themselves fill the disk
            monkeypatch.setattr("megapretrain.commands.merge_datasets.check_free_space", lambda *a: None)
        unchanged()
        assert_one_line(capsys, merge("--input", a, b, "--output-prefix", out), 1, "no space left writing",
                        "ab.bin", "needs about", "free")
        assert not [f for f in os.listdir(os.path.dirname(out)) if f.startswith("ab")]
    finally:
        if small is not None:
            subprocess.run(["umount", "-l", str(small)], check=True)  # lazily: a failed run may hold files


def test_a_merge_that_cannot_fit_is_refused_before_writing(tmp_path, unchanged, capsys, monkeypatch):
    a, b = shard(str(tmp_path), "a"), shard(str(tmp_path), "b", seed=1)
    monkeypatch.setattr("megapretrain.errors.free_bytes", lambda path: 1000)
    unchanged()
    assert_one_line(capsys, merge("--input", a, b, "--output-prefix", "ab"), 1, "no space left writing ab.bin",
                    "needs about", "1000 B free", "nothing was written")
    assert not [f for f in os.listdir(tmp_path) if f.startswith("ab")]
