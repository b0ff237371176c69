"""tools/inspect_data.py: integrity failures are caught and named; the report's numbers are right."""

import json
import os
import struct

import numpy as np
import pytest

from megapretrain.commands import inspect_data
from megapretrain.commands import preprocess_data as preprocess
from megapretrain.data.indexed_dataset import IndexedDatasetBuilder

from helpers import write_jsonl


@pytest.fixture
def shard(tmp_path):
    texts = [f"doc {i} " * (i % 7 + 1) for i in range(40)]
    source = write_jsonl(tmp_path / "in.jsonl", texts)
    assert preprocess.main(["--input", source, "--output-prefix", str(tmp_path / "s"), "--tokenizer-type",
                            "ByteTokenizer", "--append-eod", "--no-progress"]) == 0
    return str(tmp_path / "s_text_document"), texts


def check(prefix, *flags):
    return inspect_data.main([prefix, *flags])


def test_a_good_shard_passes_and_is_described(shard, capsys):
    prefix, texts = shard
    assert check(prefix, "--seq-length", "8") == 0
    out = capsys.readouterr().out
    tokens = sum(len(t.encode()) + 1 for t in texts)
    assert f"tokens: {tokens:,} (summary: {tokens:,})" in out and "checksum: sha256 matches" in out
    assert "eod (256): 40 tokens" in out and "sequences ending with eod (256): 40 of 40" in out
    assert "histogram of document lengths" in out and out.rstrip().endswith("OK")


def test_json_facts_and_packed_view_match_brute_force(shard, capsys):
    prefix, texts = shard
    assert check(prefix, "--seq-length", "8", "--json") == 0
    facts = json.loads(capsys.readouterr().out)
    lengths = [len(t.encode()) + 1 for t in texts]
    assert facts["documents"] == 40 and facts["tokens"] == sum(lengths) and facts["failures"] == []
    assert facts["max_id"] == 256 and facts["eod_count"] == 40
    starts = set(np.cumsum(lengths)[:-1].tolist())
    total, s = sum(lengths), 8
    samples = -(-total // s)
    crossing = sum(any(k * s < b <= k * s + s for b in starts) for k in range(samples))
    assert facts["packed_samples"] == samples and facts["crossing_fraction"] == pytest.approx(crossing / samples)
    assert facts["length_percentiles"]["50"] == pytest.approx(np.percentile(lengths, 50))


def test_truncated_bin(shard, capsys):
    prefix, _ = shard
    data = open(prefix + ".bin", "rb").read()
    open(prefix + ".bin", "wb").write(data[:-6])
    assert check(prefix) == 1
    err = capsys.readouterr().err
    assert "FAIL bin size" in err and "truncated" in err and "integrity failure" in err


def test_bad_header(shard, capsys):
    prefix, _ = shard
    raw = bytearray(open(prefix + ".idx", "rb").read())
    raw[:7] = b"NOTMMID"
    open(prefix + ".idx", "wb").write(bytes(raw))
    assert check(prefix) == 1
    err = capsys.readouterr().err
    assert "FAIL header" in err and "not an MMIDIDX index" in err
    raw[:7] = b"MMIDIDX"
    raw[17] = 42  # dtype code
    open(prefix + ".idx", "wb").write(bytes(raw))
    assert check(prefix) == 1
    assert "unknown dtype code 42" in capsys.readouterr().err


def test_out_of_range_token_ids(tmp_path, capsys):
    prefix = str(tmp_path / "ids")
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    builder.add_document([1, 2, 3])
    builder.add_document([4, 300, 5])
    builder.finalize(prefix + ".idx")
    assert check(prefix, "--vocab-size", "301") == 0
    capsys.readouterr()
    assert check(prefix, "--vocab-size", "257") == 1
    assert "FAIL token ids: token id 300 >= vocab size 257" in capsys.readouterr().err


def test_checksum_and_counts_against_the_summary(shard, capsys):
    prefix, _ = shard
    data = bytearray(open(prefix + ".bin", "rb").read())
    data[2] ^= 1  # same size, different content (a low byte: the id stays in range)
    open(prefix + ".bin", "wb").write(bytes(data))
    assert check(prefix) == 1
    assert "FAIL checksum" in capsys.readouterr().err
    assert check(prefix, "--no-checksum") == 0
    summary = json.load(open(prefix + ".summary.json"))
    summary["tokens"] += 1
    json.dump(summary, open(prefix + ".summary.json", "w"))
    assert check(prefix, "--no-checksum") == 1
    assert "FAIL summary: tokens" in capsys.readouterr().err


def test_broken_pointers_and_document_indices(shard, capsys):
    prefix, _ = shard
    raw = bytearray(open(prefix + ".idx", "rb").read())
    count = struct.unpack_from("<Q", raw, 18)[0]
    pointers_at = 34 + 4 * count
    struct.pack_into("<q", raw, pointers_at + 8 * 5, 1)  # sequence 5's pointer
    documents_at = pointers_at + 8 * count
    struct.pack_into("<q", raw, documents_at + 8 * 10, 3)  # document indices going back
    open(prefix + ".idx", "wb").write(bytes(raw))
    assert check(prefix) == 1
    err = capsys.readouterr().err
    assert "FAIL pointers: sequence 5 starts at byte 1" in err and "FAIL document indices: entry 10 (3)" in err


def test_missing_files_and_png(shard, tmp_path, capsys):
    prefix, _ = shard
    assert check(str(tmp_path / "nothing")) == 1
    assert "FAIL files" in capsys.readouterr().err
    png = tmp_path / "png"
    assert check(prefix, "--png", str(png)) == 0
    captured = capsys.readouterr()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "--png needs matplotlib" in captured.err
    else:
        assert os.listdir(png) == ["s_text_document_lengths.png"]
