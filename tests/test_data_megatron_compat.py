"""Byte-for-byte compatibility with megatron-core's IndexedDataset, in both directions."""

import warnings

import numpy as np
import pytest

from megapretrain.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

with warnings.catch_warnings():  # megatron.core warns about Transformer Engine / Apex on import
    warnings.simplefilter("ignore")
    megatron_indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
torch = pytest.importorskip("torch")


def documents(seed, dtype):
    """Documents of 0-3 sequences of 0-30 ids: multi-sequence and empty ones included."""
    rng = np.random.default_rng(seed)
    high = 60000 if dtype == np.uint16 else 200_000
    return [[rng.integers(0, high, int(rng.integers(0, 30))).astype(dtype) for _ in range(int(rng.integers(0, 4)))]
            for _ in range(40)]


def write_ours(prefix, docs, dtype):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for doc in docs:
        for seq in doc:
            builder.add_item(seq)
        builder.end_document()
    builder.finalize(prefix + ".idx")


def write_megatron(prefix, docs, dtype):
    builder = megatron_indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        for seq in doc:
            builder.add_item(torch.from_numpy(seq.astype(np.int64)))
        builder.end_document()
    builder.finalize(prefix + ".idx")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_identical_bytes_from_both_builders(tmp_path, dtype):
    docs = documents(0, dtype)
    write_ours(str(tmp_path / "ours"), docs, dtype)
    write_megatron(str(tmp_path / "theirs"), docs, dtype)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"theirs{suffix}").read_bytes(), suffix


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_reads_ours(tmp_path, dtype):
    docs = documents(1, dtype)
    write_ours(str(tmp_path / "ours"), docs, dtype)
    theirs = megatron_indexed.IndexedDataset(str(tmp_path / "ours"))
    sequences = [seq for doc in docs for seq in doc]
    assert len(theirs) == len(sequences)
    assert theirs.index.dtype == dtype
    np.testing.assert_array_equal(theirs.document_indices, np.cumsum([0] + [len(d) for d in docs]))
    np.testing.assert_array_equal(theirs.sequence_lengths, [len(s) for s in sequences])
    for i, seq in enumerate(sequences):
        np.testing.assert_array_equal(theirs[i], seq)
    if len(sequences[3]) > 4:
        np.testing.assert_array_equal(theirs.get(3, offset=2, length=2), sequences[3][2:4])


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_we_read_megatrons(tmp_path, dtype):
    docs = documents(2, dtype)
    write_megatron(str(tmp_path / "theirs"), docs, dtype)
    ours = IndexedDataset(str(tmp_path / "theirs"))
    sequences = [seq for doc in docs for seq in doc]
    assert ours.dtype == np.dtype(dtype) and len(ours) == len(sequences)
    np.testing.assert_array_equal(ours.document_indices, np.cumsum([0] + [len(d) for d in docs]))
    for i, seq in enumerate(sequences):
        np.testing.assert_array_equal(ours[i], seq)


def test_preprocessed_output_loads_in_megatron(tmp_path):
    """The whole path: preprocess_data.py output opened by megatron-core."""
    from megapretrain.commands import preprocess_data as preprocess

    from helpers import write_jsonl

    texts = ["first document", "", "second — ünïcode", "third"]
    source = write_jsonl(tmp_path / "in.jsonl", texts)
    assert preprocess.main(["--input", source, "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
                            "ByteTokenizer", "--append-eod", "--no-progress"]) == 0
    theirs = megatron_indexed.IndexedDataset(str(tmp_path / "out_text_document"))
    assert [theirs[i].tolist() for i in range(len(theirs))] == [list(t.encode()) + [256] for t in texts if t]
