"""Megatron-LM's memory-mapped indexed dataset (MMIDIDX), byte for byte.

A dataset is two files sharing a prefix:

- ``PREFIX.bin``: every sequence's tokens, concatenated, in one dtype.
- ``PREFIX.idx``: little-endian header then three arrays::

      b"MMIDIDX\\x00\\x00"     9-byte magic
      <Q version = 1
      <B dtype code          (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8
                             uint16)
      <Q sequence_count
      <Q document_count      (= len(document_indices))
      int32 sequence_lengths[sequence_count]
      int64 sequence_pointers[sequence_count]   byte offset of each sequence in .bin
      int64 document_indices[document_count]    0, then each document's end sequence index

Preprocessing writes one sequence per document, so ``document_indices`` is ``0, 1, ..., n``.
Files written here load in Megatron-LM and vice versa.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from collections.abc import Sequence

import numpy as np

from ..errors import DataError, MissingFileError
from ..user_files import DATASET, check_kind

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count

DTYPE_CODES = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16),
}
_CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}
TOKEN_KINDS = "iu"  # numpy kinds a token id may be stored as: signed or unsigned integers
_FIX = "re-create it with tools/preprocess_data.py"


def best_dtype(vocab_size: int) -> np.dtype:
    """The smallest token dtype Megatron uses for a vocabulary: uint16 below 65500 ids, else
    int32."""
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

    Memory stays flat whatever the corpus size: tokens go straight to the .bin file, and the
    per-sequence lengths and document ends go to two small spill files beside it (``.lengths.tmp``,
    ``.docs.tmp``) that ``finalize`` streams into the .idx. ``checksum`` hashes the .bin bytes as
    they are written (sha256 hex digest, recorded in the preprocessing summary).
    """

    def __init__(self, bin_path: str, dtype=np.uint16):
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF_DTYPE or self.dtype.kind not in TOKEN_KINDS:
            ids = [str(d) for d in DTYPE_CODES.values() if d.kind in TOKEN_KINDS]
            raise ValueError(f"unsupported token dtype {self.dtype}; use one of {', '.join(ids)}")
        self.bin_path = bin_path
        self._file = open(bin_path, "wb", buffering=1 << 22)
        self._lengths_file = open(bin_path + ".lengths.tmp", "w+b", buffering=1 << 20)
        self._docs_file = open(bin_path + ".docs.tmp", "w+b", buffering=1 << 20)
        self._hash = hashlib.sha256()
        self.sequence_count = 0
        self.document_count = 0  # documents closed so far (document_indices has one more entry)
        self.token_count = 0
        # the largest id written (recorded in summaries: data and model must agree)
        self.max_token = -1
        self._open_document = False

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one sequence (it joins the current document until ``end_document``)."""
        arr = self._as_dtype(tokens)
        self._write_tokens(arr)
        self._write_lengths(np.array([arr.size], dtype=np.int64))
        self._open_document = True

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last call form one document."""
        self._docs_file.write(np.int64(self.sequence_count).tobytes())
        self.document_count += 1
        self._open_document = False

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document made of one sequence (what preprocessing writes)."""
        self.add_item(tokens)
        self.end_document()

    def add_documents(self, tokens: np.ndarray, lengths: Sequence[int] | np.ndarray) -> None:
        """Append many one-sequence documents at once: ``tokens`` is their concatenation."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != np.asarray(tokens).size:
            raise ValueError(f"add_documents: lengths sum to {int(lengths.sum())} but "
                             f"{np.asarray(tokens).size} tokens were given")
        if self._open_document:
            raise ValueError("add_documents: call end_document() first; a document is still open")
        self._write_tokens(self._as_dtype(tokens))
        ends = self.sequence_count + 1 + np.arange(lengths.size, dtype=np.int64)
        self._write_lengths(lengths)
        self._docs_file.write(ends.tobytes())
        self.document_count += lengths.size

    def add_index(self, prefix: str, chunk: int = 1 << 22, progress=None) -> None:
        """Append a whole dataset (its documents, in order) by streaming its files: no full load.
        ``progress(nbytes)`` is called as its .bin's bytes are copied."""
        source = IndexedDataset(prefix)
        if source.dtype != self.dtype:
            raise DataError(f"{prefix}: token dtype {source.dtype} differs from the output's "
                            f"{self.dtype}; merge only datasets made with the same tokenizer")
        if self._open_document:
            raise ValueError("add_index: call end_document() first; a document is still open")
        first = self.sequence_count
        for i in range(0, len(source), chunk):
            self._write_lengths(source.sequence_lengths[i:i + chunk].astype(np.int64))
        for i in range(1, source.document_indices.size, chunk):
            self._docs_file.write((source.document_indices[i:i + chunk]
                                   + first).astype(np.int64).tobytes())
        self.document_count += source.num_documents
        with open(data_file_path(prefix), "rb") as f:
            while block := f.read(16 << 20):
                self._file.write(block)
                self._hash.update(block)
                if block:
                    self.max_token = max(self.max_token,
                                         int(np.frombuffer(block, dtype=self.dtype).max()))
                if progress is not None:
                    progress(len(block))
        self.token_count += source.num_tokens

    @property
    def checksum(self) -> str:
        """sha256 hex digest of the .bin bytes written so far."""
        return self._hash.hexdigest()

    def finalize(self, idx_path: str, chunk: int = 1 << 22) -> None:
        """Flush and close the .bin file, then stream the .idx file describing it."""
        if self._open_document:
            self.end_document()
        self._file.close()
        with open(idx_path, "wb") as f:
            f.write(_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, _CODE_OF_DTYPE[self.dtype],
                                 self.sequence_count, self.document_count + 1))
            for block in _read_blocks(self._lengths_file, np.int32, chunk):
                f.write(block.tobytes())
            pointer = 0  # byte offset of the next sequence
            for block in _read_blocks(self._lengths_file, np.int32, chunk):
                offsets = np.cumsum(block, dtype=np.int64) * self.dtype.itemsize
                f.write((pointer + np.concatenate([[0], offsets[:-1]])).astype(np.int64).tobytes())
                pointer += int(offsets[-1])
            f.write(np.int64(0).tobytes())
            for block in _read_blocks(self._docs_file, np.int64, chunk):
                f.write(block.tobytes())
        self._remove_spill_files()

    def close(self) -> None:
        """Close the .bin file without writing an index (used when giving up on a partial build).
        A failing flush (a full disk) does not stop it: the caller is discarding the file anyway."""
        try:
            self._file.close()
        except OSError:
            pass
        self._remove_spill_files()

    def _write_tokens(self, arr: np.ndarray) -> None:
        data = memoryview(arr).cast("B")
        self._file.write(data)
        self._hash.update(data)
        self.token_count += arr.size
        if arr.size:
            self.max_token = max(self.max_token, int(arr.max()))

    def _write_lengths(self, lengths: np.ndarray) -> None:
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise DataError(f"{self.bin_path}: a sequence of {lengths.max()} tokens exceeds the "
                            "format's int32 length field")
        self._lengths_file.write(lengths.astype(np.int32).tobytes())
        self.sequence_count += lengths.size

    def _remove_spill_files(self) -> None:
        for f in (self._lengths_file, self._docs_file):
            try:
                f.close()
            except OSError:  # a full disk: the file goes anyway
                pass
            if os.path.exists(f.name):
                os.remove(f.name)

    def _as_dtype(self, tokens) -> np.ndarray:
        """Tokens as a contiguous array of the file's dtype, refusing ids the dtype cannot hold."""
        arr = np.asarray(tokens)
        if arr.dtype != self.dtype:
            if arr.size and arr.dtype.kind in "iu" and self.dtype.kind in "iu":
                info = np.iinfo(self.dtype)
                low, high = int(arr.min()), int(arr.max())
                if low < info.min or high > info.max:
                    raise DataError(f"token id {high if high > info.max else low} does not fit the "
                                    f"dataset dtype {self.dtype}; choose the dtype with "
                                    "best_dtype(tokenizer.vocab_size)")
            arr = arr.astype(self.dtype)
        return np.ascontiguousarray(arr).reshape(-1)


def _read_blocks(f, dtype, count: int):
    """Yield a spill file's contents as arrays of up to ``count`` items, from the start."""
    f.flush()
    f.seek(0)
    itemsize = np.dtype(dtype).itemsize
    while block := f.read(count * itemsize):
        yield np.frombuffer(block, dtype=dtype)


class IndexedDataset:
    """Read-only, memory-mapped view of ``PREFIX.bin`` / ``PREFIX.idx``.

    ``ds[i]`` and ``ds.get(i, offset, length)`` return numpy views into the mapped .bin file (no
    copy). The header and the file sizes are checked on open, so a truncated or foreign file fails
    at once with a message that names it, instead of producing garbage tokens later.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                check_kind("dataset", prefix, DATASET, "give the prefix of a dataset that "
                           "tools/preprocess_data.py wrote (PREFIX.bin/.idx)")
                raise MissingFileError(f"{path} not found; create the dataset with "
                                       "tools/preprocess_data.py")
        self._idx_map = _map_file(idx_path)
        self.dtype, count, documents = _read_header(idx_path, self._idx_map)
        offset = _HEADER.size
        self.sequence_lengths = np.frombuffer(self._idx_map, dtype=np.int32, count=count,
                                              offset=offset)
        offset += 4 * count
        self.sequence_pointers = np.frombuffer(self._idx_map, dtype=np.int64, count=count,
                                               offset=offset)
        offset += 8 * count
        self.document_indices = np.frombuffer(self._idx_map, dtype=np.int64, count=documents,
                                              offset=offset)
        _check_documents(idx_path, self.document_indices, count)
        self._bin_map = _map_file(bin_path)
        self._bin_size = os.path.getsize(bin_path)
        self._check_data_size(bin_path)
        # every token of the .bin, no copy
        self.tokens = np.frombuffer(self._bin_map, dtype=self.dtype)

    def _check_data_size(self, bin_path: str) -> None:
        """The .bin must end exactly where the last sequence does (catches truncation and mismatched
        pairs)."""
        expected = 0
        if len(self):
            expected = int(self.sequence_pointers[-1]) + int(
                self.sequence_lengths[-1]) * self.dtype.itemsize
        if self._bin_size != expected:
            raise DataError(f"{bin_path}: size {self._bin_size} bytes but "
                            f"{index_file_path(self.prefix)} describes {expected} bytes "
                            f"(truncated, or .bin/.idx from different runs); {_FIX}")

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
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {i} "
                             f"of {size} tokens")
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
        raise DataError(f"{idx_path}: {len(buf)} bytes is too short for an MMIDIDX index header; "
                        f"{_FIX}")
    magic, version, code, count, documents = _HEADER.unpack_from(buf, 0)
    if magic != INDEX_MAGIC:
        raise DataError(f"{idx_path}: not an MMIDIDX index (magic {magic!r}, expected "
                        f"{INDEX_MAGIC!r}); {_FIX}")
    if version != INDEX_VERSION:
        raise DataError(f"{idx_path}: index version {version}, only version {INDEX_VERSION} is "
                        f"supported; {_FIX}")
    if code not in DTYPE_CODES:
        raise DataError(f"{idx_path}: unknown dtype code {code} (valid: {sorted(DTYPE_CODES)}); "
                        f"{_FIX}")
    dtype = DTYPE_CODES[code]
    if dtype.kind not in TOKEN_KINDS:  # float codes exist in the format, but ids are integers
        raise DataError(f"{idx_path}: dtype code {code} says {dtype}, but token ids must be "
                        f"integers (uint16/int32 as preprocess_data.py writes); {_FIX}")
    expected = _HEADER.size + 12 * count + 8 * documents
    # Megatron's multimodal variant appends one int8 mode per sequence; those files are readable
    # too.
    if len(buf) not in (expected, expected + count):
        raise DataError(f"{idx_path}: size {len(buf)} bytes, but its header ({count} sequences, "
                        f"{documents} documents) needs {expected}; the file is truncated or "
                        f"corrupt; {_FIX}")
    return dtype, count, documents


def index_problems(bin_size: int, dtype: np.dtype, lengths: np.ndarray, pointers: np.ndarray,
                   documents: np.ndarray, block: int = 1 << 24) -> list[tuple[str, str]]:
    """What is inconsistent in an index, as (check, what) pairs: negative lengths, pointers that do
    not start at 0 and follow the lengths, a .bin of another size than they describe, document
    indices that do not run from 0 to the sequence count or go back. One streamed pass over the
    index (``block`` entries at a time): memory stays flat, and no byte of the .bin is read."""
    found = []
    count = lengths.size
    if count and lengths.min() < 0:
        found.append(("lengths", f"negative sequence length {int(lengths.min())}"))
    end = 0  # byte where the next sequence must start
    for i in range(0, count, block):
        sizes = lengths[i: i + block].astype(np.int64) * dtype.itemsize
        starts = end + np.concatenate([[0], np.cumsum(sizes[:-1])])
        bad = np.flatnonzero(pointers[i: i + block] != starts)
        if bad.size:
            j = i + int(bad[0])
            found.append(("pointers", f"sequence {j} starts at byte {int(pointers[j])}, expected "
                          f"{int(starts[bad[0]])} (pointers must start at 0 and follow the "
                          "lengths)"))
            break
        end = int(starts[-1] + sizes[-1])
    else:
        if bin_size != end:
            found.append(("bin size",
                          f"the .bin has {bin_size:,} bytes, the index describes {end:,} "
                          f"({'truncated' if bin_size < end else 'trailing bytes'})"))
    if documents.size == 0 or documents[0] != 0 or documents[-1] != count:
        ends = (int(documents[0]), int(documents[-1])) if documents.size else "none"
        found.append(("document indices", f"must run from 0 to {count}, got ends {ends}"))
    elif documents.size > 1:
        for i in range(0, documents.size - 1, block):
            back = np.flatnonzero(np.diff(documents[i: i + block + 1]) < 0)
            if back.size:
                j = i + int(back[0])
                found.append(("document indices", f"entry {j + 1} ({int(documents[j + 1])}) is "
                                                  f"below entry {j} ({int(documents[j])})"))
                break
    return found


def scan_tokens(bin_path: str, dtype: np.dtype, digest: bool, eod: int | None = None,
                block: int = 1 << 24) -> dict:
    """One streamed pass over a .bin: its smallest and largest id (None when empty), the count of
    ``eod`` ids, and (``digest``) the sha256 of its bytes."""
    sha = hashlib.sha256() if digest else None
    low = high = None
    eods = 0
    with open(bin_path, "rb") as f:
        while chunk := f.read(block * dtype.itemsize):
            if sha is not None:
                sha.update(chunk)
            ids = np.frombuffer(chunk, dtype=dtype)
            if ids.size:
                low = int(ids.min()) if low is None else min(low, int(ids.min()))
                high = int(ids.max()) if high is None else max(high, int(ids.max()))
                if eod is not None:
                    eods += int(np.count_nonzero(ids == eod))
    return {"min_token_id": low, "max_token_id": high, "eod_count": eods,
            "sha256": sha.hexdigest() if sha is not None else None}


def _check_documents(idx_path: str, document_indices: np.ndarray, count: int) -> None:
    """document_indices must run from 0 to the sequence count (checked at the ends: O(1) on
    open)."""
    if document_indices.size == 0 or document_indices[0] != 0 or document_indices[-1] != count:
        ends = (document_indices[0], document_indices[-1]) if document_indices.size else "none"
        raise DataError(f"{idx_path}: document indices must run from 0 to {count} sequences, got "
                        f"ends {ends}; {_FIX}")
