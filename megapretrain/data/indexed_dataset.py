"""Megatron-LM's memory-mapped indexed dataset (MMIDIDX), byte for byte.

A dataset is two files sharing a prefix:

- ``PREFIX.bin``: every sequence's tokens, concatenated, in one dtype.
- ``PREFIX.idx``: little-endian header then three arrays::

      b"MMIDIDX\\x00\\x00"     9-byte magic
      <Q version = 1
      <B dtype code          (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
      <Q sequence_count
      <Q document_count      (= len(document_indices))
      int32 sequence_lengths[sequence_count]
      int64 sequence_pointers[sequence_count]   byte offset of each sequence in .bin
      int64 document_indices[document_count]    0, then each document's end sequence index

Preprocessing writes one sequence per document, so ``document_indices`` is ``0, 1, ..., n``.
Files written here load in Megatron-LM and vice versa.
"""

from __future__ import annotations

import mmap
import os
import struct
from array import array
from typing import Sequence

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count

DTYPE_CODES = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16),
}
_CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}
_FIX = "re-create it with tools/preprocess_data.py"


def best_dtype(vocab_size: int) -> np.dtype:
    """The smallest token dtype Megatron uses for a vocabulary: uint16 below 65500 ids, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def dataset_exists(prefix: str) -> bool:
    """True when both ``PREFIX.bin`` and ``PREFIX.idx`` exist."""
    return os.path.isfile(data_file_path(prefix)) and os.path.isfile(index_file_path(prefix))


class IndexedDatasetBuilder:
    """Streams sequences to a .bin file and writes the matching .idx on ``finalize``.

    Tokens go to disk through a buffered file as they arrive; only the per-sequence lengths
    (8 bytes each) stay in memory, so any corpus size fits.
    """

    def __init__(self, bin_path: str, dtype=np.uint16):
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF_DTYPE:
            raise ValueError(f"unsupported token dtype {self.dtype}; use one of "
                             f"{', '.join(str(d) for d in DTYPE_CODES.values())}")
        self.bin_path = bin_path
        self._file = open(bin_path, "wb", buffering=1 << 22)
        self._lengths = array("q")
        self._document_indices = array("q", [0])

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one sequence (it joins the current document until ``end_document``)."""
        arr = self._as_dtype(tokens)
        self._file.write(memoryview(arr).cast("B"))
        self._lengths.append(arr.size)

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last call form one document."""
        self._document_indices.append(len(self._lengths))

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document made of one sequence (what preprocessing writes)."""
        self.add_item(tokens)
        self.end_document()

    def add_documents(self, tokens: np.ndarray, lengths: Sequence[int] | np.ndarray) -> None:
        """Append many one-sequence documents at once: ``tokens`` is their concatenation."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != np.asarray(tokens).size:
            raise ValueError(f"add_documents: lengths sum to {int(lengths.sum())} but {np.asarray(tokens).size} "
                             "tokens were given")
        arr = self._as_dtype(tokens)
        self._file.write(memoryview(arr).cast("B"))
        start = len(self._lengths)
        self._lengths.extend(lengths.tolist())
        self._document_indices.extend(range(start + 1, len(self._lengths) + 1))

    def finalize(self, idx_path: str) -> None:
        """Flush and close the .bin file, then write the .idx file describing it."""
        self._file.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError(f"{self.bin_path}: a sequence of {lengths.max()} tokens exceeds the format's "
                             "int32 length field")
        pointers = np.zeros(lengths.size, dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        documents = np.frombuffer(self._document_indices, dtype=np.int64)
        with open(idx_path, "wb") as f:
            f.write(_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, _CODE_OF_DTYPE[self.dtype], lengths.size, documents.size))
            f.write(lengths.astype(np.int32).tobytes())
            f.write(pointers.tobytes())
            f.write(documents.tobytes())

    def close(self) -> None:
        """Close the .bin file without writing an index (used when giving up on a partial build)."""
        self._file.close()

    def _as_dtype(self, tokens) -> np.ndarray:
        """Tokens as a contiguous array of the file's dtype, refusing ids the dtype cannot hold."""
        arr = np.asarray(tokens)
        if arr.dtype != self.dtype:
            if arr.size and arr.dtype.kind in "iu" and self.dtype.kind in "iu":
                info = np.iinfo(self.dtype)
                low, high = int(arr.min()), int(arr.max())
                if low < info.min or high > info.max:
                    raise ValueError(f"token id {high if high > info.max else low} does not fit the dataset dtype "
                                     f"{self.dtype}; choose the dtype with best_dtype(tokenizer.vocab_size)")
            arr = arr.astype(self.dtype)
        return np.ascontiguousarray(arr).reshape(-1)


class IndexedDataset:
    """Read-only, memory-mapped view of ``PREFIX.bin`` / ``PREFIX.idx``.

    ``ds[i]`` and ``ds.get(i, offset, length)`` return numpy views into the mapped .bin file (no copy).
    The header and the file sizes are checked on open, so a truncated or foreign file fails at once
    with a message that names it, instead of producing garbage tokens later.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} not found; create the dataset with tools/preprocess_data.py")
        self._idx_map = _map_file(idx_path)
        self.dtype, count, documents = _read_header(idx_path, self._idx_map)
        offset = _HEADER.size
        self.sequence_lengths = np.frombuffer(self._idx_map, dtype=np.int32, count=count, offset=offset)
        offset += 4 * count
        self.sequence_pointers = np.frombuffer(self._idx_map, dtype=np.int64, count=count, offset=offset)
        offset += 8 * count
        self.document_indices = np.frombuffer(self._idx_map, dtype=np.int64, count=documents, offset=offset)
        _check_documents(idx_path, self.document_indices, count)
        self._bin_map = _map_file(bin_path)
        self._bin_size = os.path.getsize(bin_path)
        self._check_data_size(bin_path)

    def _check_data_size(self, bin_path: str) -> None:
        """The .bin must end exactly where the last sequence does (catches truncation and mismatched pairs)."""
        expected = 0
        if len(self):
            expected = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
        if self._bin_size != expected:
            raise ValueError(f"{bin_path}: size {self._bin_size} bytes but {index_file_path(self.prefix)} describes "
                             f"{expected} bytes (truncated, or .bin/.idx from different runs); {_FIX}")

    def __len__(self) -> int:
        return self.sequence_lengths.size

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``i`` as a view into the mapped file."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {self.prefix} ({n} sequences)")
        i = i % n
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {i} of {size} tokens")
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_map, dtype=self.dtype, count=length, offset=start)

    @property
    def num_documents(self) -> int:
        return self.document_indices.size - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def __getstate__(self):
        # Memory maps do not pickle; a DataLoader worker re-opens the files from the prefix.
        return {"prefix": self.prefix}

    def __setstate__(self, state):
        self.__init__(state["prefix"])

    def __repr__(self) -> str:
        return f"IndexedDataset({self.prefix!r}, sequences={len(self)}, dtype={self.dtype})"


def _map_file(path: str):
    """Map a file read-only; an empty file (a dataset with no tokens) maps to empty bytes."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _read_header(idx_path: str, buf) -> tuple[np.dtype, int, int]:
    """Validate the .idx header and its size; return (dtype, sequence count, document count)."""
    if len(buf) < _HEADER.size:
        raise ValueError(f"{idx_path}: {len(buf)} bytes is too short for an MMIDIDX index header; {_FIX}")
    magic, version, code, count, documents = _HEADER.unpack_from(buf, 0)
    if magic != INDEX_MAGIC:
        raise ValueError(f"{idx_path}: not an MMIDIDX index (magic {magic!r}, expected {INDEX_MAGIC!r}); {_FIX}")
    if version != INDEX_VERSION:
        raise ValueError(f"{idx_path}: index version {version}, only version {INDEX_VERSION} is supported; {_FIX}")
    if code not in DTYPE_CODES:
        raise ValueError(f"{idx_path}: unknown dtype code {code} (valid: {sorted(DTYPE_CODES)}); {_FIX}")
    expected = _HEADER.size + 12 * count + 8 * documents
    # Megatron's multimodal variant appends one int8 mode per sequence; those files are readable too.
    if len(buf) not in (expected, expected + count):
        raise ValueError(f"{idx_path}: size {len(buf)} bytes, but its header ({count} sequences, {documents} "
                         f"documents) needs {expected}; the file is truncated or corrupt; {_FIX}")
    return DTYPE_CODES[code], count, documents


def _check_documents(idx_path: str, document_indices: np.ndarray, count: int) -> None:
    """document_indices must run from 0 to the sequence count (checked at the ends: O(1) on open)."""
    if document_indices.size == 0 or document_indices[0] != 0 or document_indices[-1] != count:
        ends = (document_indices[0], document_indices[-1]) if document_indices.size else "none"
        raise ValueError(f"{idx_path}: document indices must run from 0 to {count} sequences, got ends {ends}; {_FIX}")
