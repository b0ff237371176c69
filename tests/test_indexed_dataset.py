"""MMIDIDX round trips, the exact byte layout Megatron-LM reads, and clear errors for bad files."""

import pickle
import struct

import numpy as np
import pytest

from megapretrain.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    best_dtype,
    data_file_path,
    dataset_exists,
    index_file_path,
)


def write_dataset(prefix, documents, dtype):
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype)
    for doc in documents:
        builder.add_document(doc)
    builder.finalize(index_file_path(prefix))
    return prefix


def random_documents(rng, count, high):
    return [rng.integers(0, high, size=rng.integers(0, 50)) for _ in range(count)]


@pytest.mark.parametrize("dtype,high", [(np.uint16, 65000), (np.int32, 200_000)])
def test_round_trip_tokens_and_boundaries(tmp_path, dtype, high):
    docs = random_documents(np.random.default_rng(0), 40, high)
    ds = IndexedDataset(write_dataset(str(tmp_path / "ds"), docs, dtype))
    assert len(ds) == 40 and ds.num_documents == 40 and ds.dtype == np.dtype(dtype)
    assert ds.document_indices.tolist() == list(range(41))
    assert ds.sequence_lengths.dtype == np.int32
    assert ds.sequence_lengths.tolist() == [len(d) for d in docs]
    itemsize = np.dtype(dtype).itemsize
    assert ds.sequence_pointers.tolist() == (np.cumsum([0] + [len(d) for d in docs[:-1]]) * itemsize).tolist()
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
    assert ds.num_tokens == sum(len(d) for d in docs)


def test_get_slices_without_copying(tmp_path):
    ds = IndexedDataset(write_dataset(str(tmp_path / "ds"), [np.arange(10), np.arange(100, 120)], np.uint16))
    part = ds.get(1, offset=5, length=3)
    assert part.tolist() == [105, 106, 107]
    assert not part.flags.owndata  # a view into the memory-mapped .bin
    assert ds.get(1, offset=15).tolist() == list(range(115, 120))
    assert ds[-1].tolist() == list(range(100, 120))
    with pytest.raises(IndexError):
        ds.get(0, offset=8, length=5)
    with pytest.raises(IndexError):
        ds[2]


def test_exact_bytes_of_megatron_format(tmp_path):
    prefix = write_dataset(str(tmp_path / "ds"), [[1, 2, 3], [4]], np.uint16)
    idx = open(index_file_path(prefix), "rb").read()
    expected = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8) + struct.pack("<QQ", 2, 3)
                + np.array([3, 1], np.int32).tobytes() + np.array([0, 6], np.int64).tobytes()
                + np.array([0, 1, 2], np.int64).tobytes())
    assert idx == expected
    assert open(data_file_path(prefix), "rb").read() == np.array([1, 2, 3, 4], np.uint16).tobytes()


def test_multi_sequence_documents(tmp_path):
    prefix = str(tmp_path / "ds")
    builder = IndexedDatasetBuilder(data_file_path(prefix), np.int32)
    builder.add_item([1, 2])
    builder.add_item([3])
    builder.end_document()
    builder.add_documents(np.array([5, 6, 7, 8]), [1, 3])
    builder.finalize(index_file_path(prefix))
    ds = IndexedDataset(prefix)
    assert ds.document_indices.tolist() == [0, 2, 3, 4]
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3], [5], [6, 7, 8]]


def test_empty_dataset_and_empty_documents(tmp_path):
    empty = IndexedDataset(write_dataset(str(tmp_path / "empty"), [], np.uint16))
    assert len(empty) == 0 and empty.document_indices.tolist() == [0]
    ds = IndexedDataset(write_dataset(str(tmp_path / "ds"), [[], [7], []], np.uint16))
    assert [ds[i].tolist() for i in range(3)] == [[], [7], []]


def test_best_dtype_and_range_check(tmp_path):
    assert best_dtype(257) == np.uint16 and best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32 and best_dtype(128256) == np.int32
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint16)
    with pytest.raises(ValueError, match="does not fit"):
        builder.add_document(np.array([70000]))
    builder.close()


def test_exists_and_missing_files(tmp_path):
    prefix = write_dataset(str(tmp_path / "ds"), [[1]], np.uint16)
    assert dataset_exists(prefix) and not dataset_exists(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="preprocess_data.py"):
        IndexedDataset(str(tmp_path / "nope"))


def corrupt(path, offset, data):
    raw = bytearray(open(path, "rb").read())
    raw[offset:offset + len(data)] = data
    open(path, "wb").write(bytes(raw))


@pytest.mark.parametrize("offset,data,message", [
    (0, b"XXXXXXX", "not an MMIDIDX index"),
    (9, struct.pack("<Q", 2), "version 2"),
    (17, b"\x09", "unknown dtype code 9"),
    (18, struct.pack("<Q", 5), "truncated or corrupt"),
])
def test_corrupt_header_is_a_clear_error(tmp_path, offset, data, message):
    prefix = write_dataset(str(tmp_path / "ds"), [[1, 2], [3]], np.uint16)
    corrupt(index_file_path(prefix), offset, data)
    with pytest.raises(ValueError, match=message) as info:
        IndexedDataset(prefix)
    assert "ds.idx" in str(info.value) and "preprocess_data.py" in str(info.value)
    assert "\n" not in str(info.value)


def test_truncated_files_are_clear_errors(tmp_path):
    prefix = write_dataset(str(tmp_path / "ds"), [[1, 2], [3]], np.uint16)
    raw = open(data_file_path(prefix), "rb").read()
    open(data_file_path(prefix), "wb").write(raw[:-2])
    with pytest.raises(ValueError, match=r"ds\.bin: size 4 bytes .* describes 6 bytes"):
        IndexedDataset(prefix)
    idx = open(index_file_path(prefix), "rb").read()
    open(index_file_path(prefix), "wb").write(idx[:20])
    with pytest.raises(ValueError, match="too short"):
        IndexedDataset(prefix)


def test_pickles_by_prefix(tmp_path):
    ds = IndexedDataset(write_dataset(str(tmp_path / "ds"), [[1, 2], [3]], np.uint16))
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.prefix == ds.prefix and clone[0].tolist() == [1, 2]
