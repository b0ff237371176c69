"""GPT pretraining samples: documents packed into ``seq_length + 1`` token windows, blended by
weight.

Three index arrays, built with vectorized numpy and deterministic in ``seed``, turn an
``IndexedDataset`` into samples (the scheme of Megatron-LM's GPTDataset, made epoch-local):

- ``doc_index``: the document stream. Epoch ``e`` is its own shuffle of ``document_ids`` (seeded by
  ``(seed, e)``) followed by a short *wrap*: the first documents of that same order again, just
  enough to finish the epoch's last sample.
- ``sample_index``: rows of ``(position in doc_index, token offset)``. Epoch ``e`` owns the samples
  whose first token is in it: sample ``k`` starts at token ``k * seq_length`` of the concatenated
  epochs, for ``k`` in ``[ceil(e*T/s), ceil((e+1)*T/s))`` (``T`` tokens per epoch). Each epoch has
  one row per sample start plus a final row: the last token of its last sample. Sample ``k`` is the
  ``seq_length + 1`` tokens from its row to the next row inclusive, so it ends on the first token of
  sample ``k + 1`` (inputs ``s[:-1]``, targets ``s[1:]``): every token of an epoch after its first
  is a prediction target exactly once. No padding; the EOS that preprocessing appends to each
  document separates documents inside a sample.
- ``shuffle_index``: the rows served, in training order: a permutation within each epoch (seeded by
  ``(seed, e)``), epochs in order, cut at ``num_samples``.

Everything about epoch ``e`` depends on ``(seed, e, documents, seq_length)`` only, so sample ``i``
never depends on ``num_samples``: a longer or resumed run sees the same samples first.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Iterator, Sequence

import numpy as np

from megapretrain.data.blending import greedy_blend_chunks
from megapretrain.data.index_cache import cached_or_built
from megapretrain.data.indexed_dataset import (
    IndexedDataset,
    data_file_path,
    dataset_exists,
    index_file_path,
)

from ..errors import DataError, MissingFileError, WrongKindError, size_text
from ..host_memory import available_bytes
from ..user_files import not_the_kind

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
# bump when the index algorithm changes: invalidates caches
_INDEX_FORMAT = "megapretrain-gpt-indices-v4"
_BLEND_FORMAT = "megapretrain-blend-v2"
# each blended component builds this much more than its share, as Megatron does
_BLEND_OVERSAMPLE = 1.005
BLEND_CHUNK = 1 << 22  # samples of the blend index built and written at a time (40 MiB)
INDEX_CHUNK = 1 << 20  # documents or samples of an epoch's index built at a time (about 60 MiB)
EPOCH_GROUP_SAMPLES = 1 << 16  # a sample index cache entry holds whole epochs, at least this many
BLEND_SEGMENT = 1 << 22  # samples of the blend index per cache entry, built as the run reads them
CACHE_WAIT_S = 600.0  # how long build_indices=False waits for the builder's cache entry


class GPTDataset:
    """Fixed-length training samples cut from a shuffled stream of whole documents (see module
    docstring).

    ``document_ids`` index the sequences of ``indexed`` (preprocessing writes one per document;
    kept as a ``range`` when they are one, so that a thousand prefixes hold no id arrays);
    ``__getitem__(i)`` returns the i-th sample in training order as ``seq_length + 1`` int64 ids.
    ``build_indices=False`` loads the indices from ``cache_dir`` (waiting up to ``cache_wait_s`` for
    another process to write them) instead of building them; see ``build_gpt_datasets``.
    """

    def __init__(self, indexed: IndexedDataset, document_ids: np.ndarray, seq_length: int,
                 num_samples: int, seed: int, cache_dir: str | None = None, name: str = "train",
                 build_indices: bool = True, cache_wait_s: float = CACHE_WAIT_S):
        self.indexed = indexed
        # a range when consecutive (a split's usual form: no array of ids, for 1,000 prefixes)
        self.document_ids = _as_ids(document_ids)
        self.seq_length, self.num_samples, self.seed, self.name = int(seq_length), int(
            num_samples), seed, name
        self._validate()
        self.cache_key, self.cache_dir = self._cache_key(), cache_dir
        self._build_indices, self._cache_wait_s = build_indices, cache_wait_s
        # An index entry holds whole epochs, as few as make EPOCH_GROUP_SAMPLES samples: built as
        # the run reads them (the first at construction, the builder one entry ahead).
        self.group_epochs = max(1, -(-EPOCH_GROUP_SAMPLES * self.seq_length
                                     // self.tokens_per_epoch))
        self.num_groups = -(-self.num_epochs // self.group_epochs)
        self.num_documents = len(self.document_ids)
        self._groups: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        if build_indices:
            self._fits(self.num_samples, self.num_epochs, whole_run=True)
        self._extend(0)
        # What __getitem__ reads, as plain arrays: .item() on them is the cheapest scalar access
        # numpy has.
        self._tokens = indexed.tokens
        self._lengths = indexed.sequence_lengths
        self._token_starts = indexed.sequence_pointers
        self._shift = int(indexed.dtype.itemsize).bit_length() - 1  # byte pointer -> token index

    def __getstate__(self):
        # The token view into the mapped .bin would pickle as a copy of the whole file: re-derive
        # it.
        return {k: v for k, v in vars(self).items()
                if k not in ("_tokens", "_lengths", "_token_starts")}

    def __setstate__(self, state):
        vars(self).update(state)
        self._tokens = self.indexed.tokens
        self._lengths = self.indexed.sequence_lengths
        self._token_starts = self.indexed.sequence_pointers

    def _validate(self) -> None:
        """Check the arguments and derive tokens_per_epoch and num_epochs from them."""
        where = f"GPTDataset {self.name!r} of {self.indexed.prefix}"
        if self.seq_length < 1 or self.num_samples < 0:
            raise DataError(f"{where}: seq_length={self.seq_length} must be >= 1 and "
                             f"num_samples={self.num_samples} >= 0")
        ids = self.document_ids
        if len(ids) == 0:
            raise DataError(f"{where}: no documents in this split; raise its share in data.split "
                            "or add data")
        if (ids.start if isinstance(ids, range) else ids.min()) < 0 \
                or _max_id(ids) >= len(self.indexed):
            raise DataError(f"{where}: document ids must lie in [0, {len(self.indexed)})")
        self.tokens_per_epoch = _tokens_of(self.indexed.sequence_lengths, self.document_ids)
        if self.tokens_per_epoch == 0:
            raise DataError(f"{where}: the {len(ids)} documents hold zero tokens")
        self.num_epochs = max(1, epochs_for(self.num_samples, self.tokens_per_epoch,
                                            self.seq_length))

    def _first_sample(self, epoch: int) -> int:
        """The first sample (in training order) of ``epoch``: its epochs are served in order."""
        return -(-epoch * self.tokens_per_epoch // self.seq_length)

    def _group_epochs(self, group: int) -> tuple[int, int]:
        return group * self.group_epochs, min((group + 1) * self.group_epochs, self.num_epochs)

    def _extend(self, group: int) -> None:
        """Build or load the index entries up to ``group`` (never past the last), in order."""
        while len(self._groups) <= min(group, self.num_groups - 1):
            g = len(self._groups)
            first, last = self._group_epochs(g)
            start = time.perf_counter()
            samples = self._first_sample(last) - self._first_sample(first)
            indices, built = cached_or_built(
                self.cache_dir, self._cache_stem(g), self._group_key(g),
                ("doc_index", "sample_index", "shuffle_index"),
                functools.partial(self._build, first_epoch=first, last_epoch=last),
                self._build_indices, self._cache_wait_s, needed_bytes=index_bytes(
                    self.num_documents, self.seq_length, samples, last - first)[0])
            logger.info("%s %s indices for %s (epochs %d to %d of %d) in %.2fs", "built" if built
                        else "loaded", self.name, self.indexed.prefix, first, last - 1,
                        self.num_epochs, time.perf_counter() - start)
            self._groups.append((indices["doc_index"], indices["sample_index"].reshape(-1),
                                 indices["shuffle_index"]))

    def reserve(self, num_samples: int) -> None:
        """Have the index entries of samples ``[0, num_samples)`` built (or waited for): what a
        blend calls as its own index grows, so that the node's builder writes every entry the
        node's ranks will read before they read it."""
        if num_samples > 0:
            self._extend(self._group_of(min(num_samples, self.num_samples) - 1))

    def _group_of(self, i: int) -> int:
        return i * self.seq_length // self.tokens_per_epoch // self.group_epochs

    def _fits(self, samples: int, epochs: int, whole_run: bool = False) -> None:
        """Refuse, before building, indices that do not fit: on the cache's disk (the run's, when
        its first entry is not there yet), and in host memory (an epoch's orders and a chunk when
        they go to a cache directory; the run's, held then joined, when they are kept in
        memory)."""
        kept, epoch = index_bytes(self.num_documents, self.seq_length, samples, epochs)
        what = (f"GPTDataset {self.name!r} of {self.indexed.prefix}: its sample indices "
                f"({samples:,} samples of train.seq_length={self.seq_length:,}, "
                f"{epochs:,} epochs of {self.num_documents:,} documents)")
        if self.cache_dir:
            if not whole_run or not os.path.exists(os.path.join(self.cache_dir,
                                                                f"{self._cache_stem(0)}.json")):
                _fits_on_disk(self.cache_dir, kept, what)
            _fits_in_host_memory(epoch, what)
        elif whole_run:  # the pieces held, then joined
            _fits_in_host_memory(epoch + 2 * kept, what)

    def _build(self, open_array, report, first_epoch: int, last_epoch: int) -> None:
        """Stream epochs ``[first_epoch, last_epoch)`` of the index arrays to ``open_array``'s
        sinks (positions counted from the entry's first epoch)."""
        self._fits(self._first_sample(last_epoch) - self._first_sample(first_epoch),
                   last_epoch - first_epoch)
        write_gpt_indices(open_array, report, self.indexed.sequence_lengths, self.document_ids,
                          self.seq_length, last_epoch, self.seed, first_epoch)

    @property
    def doc_index(self) -> np.ndarray:
        """The whole run's document stream (builds every entry; joined when there are several)."""
        return self._whole(0)

    @property
    def sample_index(self) -> np.ndarray:
        """The whole run's sample rows, positions in :attr:`doc_index`."""
        return self._whole(1)

    @property
    def shuffle_index(self) -> np.ndarray:
        """The whole run's rows in training order, cut at ``num_samples``."""
        return self._whole(2)

    def _whole(self, part: int) -> np.ndarray:
        self._extend(self.num_groups - 1)
        if len(self._groups) == 1:
            arrays = self._groups[0]
            return (arrays[0], arrays[1].reshape(-1, 2), arrays[2][: self.num_samples])[part]
        docs = rows = 0
        pieces = []
        for doc_index, sample_rows, shuffle in self._groups:  # positions from the run's start
            if part == 0:
                pieces.append(doc_index)
            elif part == 1:
                pieces.append(sample_rows.reshape(-1, 2) + np.array([docs, 0]))
            else:
                pieces.append(shuffle.astype(np.int64) + rows)
            docs, rows = docs + doc_index.size, rows + sample_rows.size // 2
        whole = np.concatenate(pieces)
        return whole[: self.num_samples] if part == 2 else whole

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample ``i`` in training order: ``seq_length + 1`` int64 token ids."""
        n = self.num_samples
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range for {self.name} dataset of {n} samples")
        g = self._group_of(i)
        if g + self._build_indices >= len(self._groups):
            self._extend(g + self._build_indices)  # the builder stays an entry ahead
        doc_index, rows, shuffle = self._groups[g]
        r = 2 * shuffle.item(i - self._first_sample(g * self.group_epochs))
        first, offset, last, end = rows.item(r), rows.item(r + 1), rows.item(r + 2), rows.item(r
                                                                                               + 3)
        doc = doc_index.item(first)
        start = (self._token_starts.item(doc) >> self._shift) + offset
        if first == last:  # the common case when documents are longer than samples: one slice
            return self._tokens[start: start + self.seq_length + 1].astype(np.int64)
        out = np.empty(self.seq_length + 1, dtype=np.int64)
        filled = self._lengths.item(doc) - offset
        out[:filled] = self._tokens[start: start + filled]
        for position in range(first + 1, last):
            doc = doc_index.item(position)
            size = self._lengths.item(doc)
            start = self._token_starts.item(doc) >> self._shift
            out[filled: filled + size] = self._tokens[start: start + size]
            filled += size
        start = self._token_starts.item(doc_index.item(last)) >> self._shift
        out[filled:] = self._tokens[start: start + end + 1]
        return out

    def describe(self) -> list[dict]:
        """One row for this dataset: prefix, split, documents, tokens (per epoch), weight, samples,
        epochs."""
        return [{"prefix": self.indexed.prefix, "split": self.name,
                 "documents": self.num_documents, "tokens": self.tokens_per_epoch,
                 "weight": 1.0, "samples": self.num_samples,
                 "epochs": round(self.num_samples * self.seq_length / self.tokens_per_epoch, 4)}]

    def _cache_key(self) -> str:
        """sha256 of everything the indices depend on, including the files' sizes and mtimes."""
        files = {}
        for path in (data_file_path(self.indexed.prefix), index_file_path(self.indexed.prefix)):
            stat = os.stat(path)
            files[os.path.basename(path)] = [stat.st_size, stat.st_mtime_ns]
        description = {
            "format": _INDEX_FORMAT, "prefix": os.path.realpath(self.indexed.prefix),
            "files": files, "document_ids": [int(self.document_ids[0]), int(self.document_ids[-1])]
            if isinstance(self.document_ids, range)
            else hashlib.sha256(self.document_ids.tobytes()).hexdigest(),
            "seq_length": self.seq_length, "seed": int(self.seed),
        }
        return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()

    def _group_key(self, group: int) -> str:
        """The key of the entry of ``group``: the dataset's, and the epochs it holds."""
        first, last = self._group_epochs(group)
        return hashlib.sha256(f"{self.cache_key} epochs [{first}, {last})".encode()).hexdigest()

    def _cache_stem(self, group: int = 0) -> str | None:
        if self.cache_dir is None:
            return None
        return f"{os.path.basename(self.indexed.prefix)}_{self.name}_{self._group_key(group)[:24]}"


def epochs_for(num_samples: int, tokens_per_epoch: int, seq_length: int) -> int:
    """The fewest whole epochs whose samples number at least ``num_samples``."""
    # Epochs 0..E-1 own the samples k with k * seq_length < E * tokens_per_epoch; sample n-1 must be
    # one.
    return (num_samples - 1) * seq_length // tokens_per_epoch + 1 if num_samples > 0 else 0


def index_bytes(num_documents: int, seq_length: int, num_samples: int,
                num_epochs: int) -> tuple[int, int]:
    """(size of the index, memory of building it epoch by epoch), about, in bytes (Python
    integers: no overflow, whatever the sizes). The index is each epoch's document stream with its
    wrap, the sample rows and the order served. Building holds the epoch's two orders (its
    documents' and its samples', shuffled whole: mapped from the cache files, where they must stay
    resident while shuffled) and ``INDEX_CHUNK`` documents and samples of int64 temporaries.
    Streamed to a cache directory, building needs the second only; in memory, the first twice
    (the pieces, then joined) plus the temporaries."""
    rows = num_samples + num_epochs
    # one epoch's doc_index: its documents and the wrap, the documents that hold a sample
    tokens = max(1, num_samples * seq_length // max(num_epochs, 1))  # in an epoch, about
    stream = num_documents + min(seq_length + 2,
                                 num_documents * -(-(seq_length + 1) // tokens) + 1)
    item = 4 if max(num_epochs * stream, rows) < np.iinfo(np.int32).max else 8
    epoch_rows = -(-rows // max(num_epochs, 1)) + 1
    kept = item * (num_epochs * stream + 2 * rows + rows)
    chunk_docs, chunk_rows = min(INDEX_CHUNK, stream), min(INDEX_CHUNK, epoch_rows)
    return kept, item * (num_documents + epoch_rows) + 24 * chunk_docs + 48 * chunk_rows


def gpt_index_dtypes(sequence_lengths: np.ndarray, document_ids: np.ndarray | range,
                     seq_length: int, num_epochs: int) -> dict[str, np.dtype]:
    """The dtypes of doc_index, sample_index and shuffle_index, known before building (so that
    they can be streamed): int32 where the largest value they can hold fits, else int64."""
    tokens_per_epoch = _tokens_of(sequence_lengths, document_ids)
    s, n = int(seq_length), len(document_ids)
    rows = -(-num_epochs * tokens_per_epoch // s) + num_epochs
    # An epoch's wrap repeats the order when the epoch is shorter than a sample.
    wrap = max(s + 2, -(-(s + 1) // tokens_per_epoch) * n + 1)
    return {"doc_index": _index_dtype(_max_id(document_ids)),
            "sample_index": _index_dtype(max(num_epochs * (n + wrap),
                                             int(sequence_lengths.max(initial=0)))),
            "shuffle_index": _index_dtype(rows)}


def build_gpt_indices(sequence_lengths: np.ndarray, document_ids: np.ndarray | range,
                      seq_length: int, num_epochs: int, seed: int,
                      chunk: int | None = None) -> dict[str, np.ndarray]:
    """doc_index, sample_index and shuffle_index (module docstring), in memory."""
    names = ("doc_index", "sample_index", "shuffle_index")
    arrays, _ = cached_or_built(None, None, "", names, lambda open_array, report: write_gpt_indices(
        open_array, report, sequence_lengths, document_ids, seq_length, num_epochs, seed,
        chunk=chunk), True, 0.0)
    return arrays


def write_gpt_indices(open_array, report, sequence_lengths: np.ndarray,
                      document_ids: np.ndarray | range, seq_length: int, num_epochs: int,
                      seed: int, first_epoch: int = 0, chunk: int | None = None) -> None:
    """Epochs ``[first_epoch, num_epochs)`` of the three arrays appended to ``open_array``'s sinks
    (``index_cache``), ``chunk`` (``INDEX_CHUNK``) documents or samples at a time. Positions (in
    doc_index and in sample_index) count from ``first_epoch``'s start: each epoch is the same as
    in a build from 0, less those offsets. No loop over samples or documents in Python, only over
    epochs and chunks; int32 where values fit: half the memory traffic, which bounds this code.

    An epoch's two orders (its documents' and its samples') are numpy's in-place shuffle of the
    whole epoch (Fisher-Yates: step i swaps element i with one drawn from all of ``[0, i]``, so
    until the last draw any element may still move, and keeping these orders, which existing
    caches and resumed runs hold, means holding each whole while it is shuffled). They are
    shuffled where they lie in the sinks (in a cache file: mapped, page cache the kernel can
    write back, 4 bytes per document and per sample); everything else (document starts, sample
    rows, the wrap) takes ``chunk`` rows of memory at a time, whatever the epoch's size."""
    chunk = int(chunk or INDEX_CHUNK)
    document_ids = _as_ids(document_ids)
    names = ("doc_index", "sample_index", "shuffle_index")
    dtypes = gpt_index_dtypes(sequence_lengths, document_ids, seq_length, num_epochs - first_epoch)
    sinks = {name: open_array(name, dtypes[name], (2,) if name == "sample_index" else ())
             for name in names}
    tokens_per_epoch, s = _tokens_of(sequence_lengths, document_ids), int(seq_length)
    doc_base = row_base = 0
    for e in range(first_epoch, num_epochs):
        first = -(-e * tokens_per_epoch // s)  # first sample of epoch e
        count = -(-(e + 1) * tokens_per_epoch // s) - first
        order = _shuffled_documents(sinks["doc_index"], document_ids,
                                    np.random.default_rng([seed, e]), chunk)
        # Token positions (in this epoch's stream) of each sample start, plus the last sample's
        # final token.
        positions_first = first * s - e * tokens_per_epoch
        wrap = _wrap(order, sequence_lengths, positions_first + count * s + 1 - tokens_per_epoch,
                     tokens_per_epoch, chunk)
        sinks["doc_index"].append(wrap)
        done = e - first_epoch

        def progress(fraction, done=done):
            report((done + fraction) / (num_epochs - first_epoch))

        _write_sample_rows(sinks["sample_index"], sequence_lengths, order, wrap, positions_first,
                           s, count + 1, doc_base, chunk, progress)
        samples = sinks["shuffle_index"].reserve(count)
        _fill_range(samples, row_base, chunk)
        np.random.default_rng([seed, e, 1 << 31]).shuffle(samples)
        del order, samples  # a file's map closes with its last view
        report((done + 1) / (num_epochs - first_epoch))
        doc_base += len(document_ids) + wrap.size
        row_base += count + 1


def _shuffled_documents(sink, document_ids: np.ndarray | range, rng: np.random.Generator,
                        chunk: int) -> np.ndarray:
    """An epoch's document order, in place in ``sink``: ``document_ids`` shuffled by ``rng``
    (positions shuffled then looked up, as ``document_ids[rng.permutation(n)]``: the same
    draws)."""
    n = len(document_ids)
    order = sink.reserve(n)
    contiguous = isinstance(document_ids, range)
    if not contiguous and n - 1 > np.iinfo(order.dtype).max:  # repeated ids: positions overflow
        order[:] = document_ids[rng.permutation(n)]
        return order
    _fill_range(order, document_ids.start if contiguous else 0, chunk)
    rng.shuffle(order)
    if not contiguous:
        for i in range(0, n, chunk):
            order[i: i + chunk] = document_ids[order[i: i + chunk]]
    return order


def _fill_range(out: np.ndarray, first: int, chunk: int) -> None:
    """``out[:] = first, first + 1, ...``, ``chunk`` at a time (no whole-size temporary)."""
    for i in range(0, out.shape[0], chunk):
        out[i: i + chunk] = np.arange(first + i, first + min(i + chunk, out.shape[0]),
                                      dtype=np.int64)


def _write_sample_rows(sink, sequence_lengths: np.ndarray, order: np.ndarray, wrap: np.ndarray,
                       first_position: int, s: int, num_rows: int, doc_base: int, chunk: int,
                       progress) -> None:
    """An epoch's sample rows, appended ``chunk`` at a time: for the token positions
    ``first_position + j * s`` (j < num_rows) of the stream ``order`` + ``wrap``, the document
    holding each (counted from ``doc_base``) and the offset in it. Walks the stream ``chunk``
    documents at a time, their starts by a running cumulative sum."""
    size = order.size + wrap.size
    doc, doc_start, j = 0, 0, 0  # the document holding row j is doc or later; doc_start: its start
    while j < num_rows:
        stop = min(doc + chunk, size)
        docs = order[doc:stop] if stop <= order.size else np.concatenate(
            [order[doc:], wrap[max(doc - order.size, 0): stop - order.size]])
        starts = np.empty(stop - doc + 1, dtype=np.int64)  # token positions of docs doc..stop
        starts[0] = doc_start
        np.cumsum(sequence_lengths[docs], dtype=np.int64, out=starts[1:])
        starts[1:] += doc_start
        # the rows that start before this chunk's end (at the stream's end, all that remain)
        end = num_rows if stop == size else -(-(int(starts[-1]) - first_position) // s)
        end = min(end, num_rows, j + chunk)
        if end <= j:
            doc, doc_start = stop, int(starts[-1])
            continue
        where = _documents_holding(starts, first_position + j * s, s, end - j)
        rows = np.empty((end - j, 2), dtype=sink.dtype)
        np.add(where, doc + doc_base, out=rows[:, 0], casting="unsafe")
        rows[:, 1] = first_position + np.arange(j, end, dtype=np.int64) * s - starts[where]
        sink.append(rows)
        doc, doc_start, j = doc + int(where[-1]), int(starts[where[-1]]), end
        progress(j / num_rows)


def _as_ids(document_ids: np.ndarray | range) -> np.ndarray | range:
    """Document ids as a ``range`` when they are consecutive (no array held), else int64."""
    if isinstance(document_ids, range) and document_ids.step == 1:
        return document_ids
    ids = np.asarray(document_ids, dtype=np.int64)
    return range(int(ids[0]), int(ids[-1]) + 1) if _is_range(ids) else ids


def _max_id(ids: np.ndarray | range) -> int:
    return (ids[-1] if isinstance(ids, range) else int(ids.max())) if len(ids) else 0


def _is_range(ids: np.ndarray, block: int = 1 << 20) -> bool:
    """True when ``ids`` is ``first, first + 1, ..., last`` (checked blockwise: no large
    temporaries)."""
    if ids.size == 0 or ids[-1] - ids[0] + 1 != ids.size:
        return False
    first = int(ids[0])
    return all(np.array_equal(ids[i: i + block],
                              np.arange(first + i, first + min(i + block, ids.size)))
               for i in range(0, ids.size, block))


def _tokens_of(sequence_lengths: np.ndarray, ids: np.ndarray | range) -> int:
    if isinstance(ids, range):
        return int(sequence_lengths[ids.start: ids.stop].sum(dtype=np.int64))
    if _is_range(ids):
        return int(sequence_lengths[ids[0]: ids[-1] + 1].sum(dtype=np.int64))
    return int(sequence_lengths[ids].sum(dtype=np.int64))


def _documents_holding(starts: np.ndarray, first: int, step: int, count: int) -> np.ndarray:
    """For positions ``first + j * step`` (j < count), the document holding each: the i with
    ``starts[i] <= position < starts[i + 1]`` (empty documents hold none). Equal to
    ``searchsorted(starts, positions, "right") - 1`` but linear and 3x faster: document i holds the
    positions before ``ends[i] = ceil((starts[i + 1] - first) / step)``, so the document holding
    position j is the number of documents with ``ends[i] <= j``, a cumulative histogram of ends."""
    ends = starts[1:] - (first - step + 1)
    ends //= step
    np.clip(ends, 0, count, out=ends)
    return np.cumsum(np.bincount(ends, minlength=count + 1)[:count])


def _wrap(order: np.ndarray, sequence_lengths: np.ndarray, needed: int, tokens_per_epoch: int,
          chunk: int) -> np.ndarray:
    """The first documents of ``order`` (cyclically) that hold at least ``needed`` tokens: read
    in pieces from ``needed + 1`` documents (what it takes without empty documents) up to
    ``chunk``."""
    pieces, total, first, size = [], 0, 0, max(needed + 1, 1)
    while needed > 0:
        piece = order[first: first + size]
        cumulative = total + np.cumsum(sequence_lengths[piece], dtype=np.int64)
        if cumulative.size and cumulative[-1] >= needed:
            pieces.append(piece[: int(np.searchsorted(cumulative, needed, side="left")) + 1])
            break
        pieces.append(piece.copy())
        total = int(cumulative[-1]) if cumulative.size else total
        first, size = (first + piece.size) % order.size, min(2 * size, chunk)
    return np.concatenate(pieces) if pieces else order[:0].copy()


class BlendedDataset:
    """Interleaves datasets so that every stretch of samples mixes them in proportion to
    ``weights``.

    Sample ``i`` comes from the dataset whose count lags its target ``weight * (i + 1)`` the most
    (ties go to the lower index), Megatron-LM's greedy blending. For two datasets every prefix's
    count is within half a sample of its target, so every window is within one; for more datasets
    the deviation stays near one. No count ever exceeds ``weight * n + 1`` (the chosen dataset
    lags by a positive amount before it is picked), which is why components sized
    ``ceil(weight * n * 1.005 + 1)`` always suffice. The assignment is deterministic and does not
    use ``seed``; it is accepted so that callers pass one.

    The index is built as the run reads it, in segments of ``BLEND_SEGMENT`` samples (one cache
    entry each, with each dataset's count after it, from which the next segment continues):
    the first two at construction, segment ``k + 1`` when a sample of segment ``k`` is first read,
    so that a rank waiting for the node's builder never waits for a segment the builder has not
    begun (a step's samples span far less than a segment). Each segment has its components build
    (``reserve``) the index entries of the samples it draws. The samples equal a build of the
    whole index at once; start-up costs two segments and their components' entries, not the
    run's index.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], num_samples: int, seed: int,
                 cache_dir: str | None = None, build_indices: bool = True,
                 cache_wait_s: float = CACHE_WAIT_S):
        if len(datasets) != len(weights) or not datasets:
            raise DataError(f"BlendedDataset needs one weight per dataset, got {len(datasets)} "
                            f"datasets and {len(weights)} weights")
        self.datasets, self.weights = list(datasets), _normalize_weights(weights,
                                                                         "BlendedDataset weights")
        self.num_samples, self.seed, self.segment = int(num_samples), seed, BLEND_SEGMENT
        # The assignment depends on the weights only (sample i never on num_samples): a longer
        # run, or another blend with these weights, reuses every entry but a cut last segment.
        blob = json.dumps({"format": _BLEND_FORMAT, "weights": self.weights.tolist(),
                           "segment": self.segment})
        self._key = hashlib.sha256(blob.encode()).hexdigest()
        cached = all(getattr(d, "cache_key", None) for d in self.datasets)
        self.cache_dir = cache_dir if cached else None
        self.in_memory = self.cache_dir is None
        self._build_indices, self._cache_wait_s = build_indices, cache_wait_s
        # (dataset_index, dataset_sample_index, each dataset's count after the segment)
        self._segments: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._extend(min(1, self._last_segment()) if build_indices else 0)

    def _last_segment(self) -> int:
        return max(self.num_samples - 1, 0) // self.segment

    def _extend(self, k: int) -> None:
        """Build or load segments up to ``k`` (never past the last), in order: each continues from
        the counts of the one before."""
        while len(self._segments) <= min(k, self._last_segment()) and self.num_samples:
            j = len(self._segments)
            start, stop = j * self.segment, min((j + 1) * self.segment, self.num_samples)
            before = self._segments[-1][2] if j else np.zeros(len(self.datasets), dtype=np.int64)
            arrays, _ = cached_or_built(
                self.cache_dir, f"blend_{self._key[:24]}_{start}_{stop}" if self.cache_dir
                else None, f"{self._key} [{start}, {stop})",
                ("dataset_index", "dataset_sample_index", "counts"),
                functools.partial(self._build, start=start, stop=stop, before=before),
                self._build_indices, self._cache_wait_s, needed_bytes=10 * (stop - start))
            self._check_component_sizes(arrays["counts"])
            self._segments.append((arrays["dataset_index"], arrays["dataset_sample_index"],
                                   arrays["counts"]))
            for dataset, count in zip(self.datasets, arrays["counts"].tolist()):
                dataset.reserve(count)  # the components' entries this segment reads

    def reserve(self, num_samples: int) -> None:
        """Have the segments of samples ``[0, num_samples)`` built (or waited for)."""
        if num_samples > 0:
            self._extend((min(num_samples, self.num_samples) - 1) // self.segment)

    def _build(self, open_array, report, start: int, stop: int, before: np.ndarray) -> None:
        """Stream samples ``[start, stop)`` of the assignment to ``open_array``'s sinks in chunks
        of ``BLEND_CHUNK`` samples, then each dataset's count after them. In memory the run
        comes to hold an int16 and an int64 per sample; streamed, a chunk of them."""
        _fits_in_host_memory(10 * (self.num_samples if self.in_memory else BLEND_CHUNK),
                             f"the blend of {len(self.datasets)} datasets ({self.num_samples:,} "
                             "samples)")
        datasets = open_array("dataset_index", np.int16)
        samples = open_array("dataset_sample_index", np.int64)
        counts = np.array(before, dtype=np.int64)
        for dataset_index, dataset_sample_index in blending_index_chunks(
                self.weights, stop, BLEND_CHUNK, start, before):
            datasets.append(dataset_index)
            samples.append(dataset_sample_index)
            counts += np.bincount(dataset_index, minlength=counts.size)
            report(datasets.rows / max(stop - start, 1))
        open_array("counts", np.int64).append(counts)

    @property
    def dataset_index(self) -> np.ndarray:
        """Which dataset serves each sample, for the whole run (builds every segment)."""
        return self._whole(0)

    @property
    def dataset_sample_index(self) -> np.ndarray:
        """Which of its dataset's samples each sample is, for the whole run (builds every
        segment)."""
        return self._whole(1)

    def _whole(self, part: int) -> np.ndarray:
        self._extend(self._last_segment())
        arrays = [segment[part] for segment in self._segments]
        if len(arrays) == 1:
            return arrays[0]
        if not arrays:
            return np.empty(0, dtype=np.int16 if part == 0 else np.int64)
        return np.concatenate(arrays)

    def _draws(self) -> np.ndarray:
        """How many samples the blend draws from each dataset: exact once the last segment is
        built; before, ``weight * num_samples`` rounded (the greedy rule keeps every count
        within about one sample of it)."""
        if len(self._segments) > self._last_segment():
            return np.asarray(self._segments[-1][2], dtype=np.int64)
        return np.rint(self.weights * self.num_samples).astype(np.int64)

    def _check_component_sizes(self, drawn: np.ndarray) -> None:
        for dataset, count in zip(self.datasets, drawn):
            if count > len(dataset):
                raise DataError(f"BlendedDataset: component {getattr(dataset, 'name', dataset)!r} "
                                f"has {len(dataset)} samples but the blend draws {count} from it")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if i < 0:
            i += self.num_samples
        k, j = divmod(i, self.segment)
        if k + self._build_indices >= len(self._segments):
            self._extend(k + self._build_indices)  # the builder stays a segment ahead
        datasets, samples, _ = self._segments[k]
        return self.datasets[datasets.item(j)][samples.item(j)]

    def describe(self) -> list[dict]:
        """One row per component: its prefix, documents and tokens, blend weight and samples
        drawn."""
        drawn = self._draws()
        rows = []
        for dataset, weight, count in zip(self.datasets, self.weights, drawn):
            for row in dataset.describe():
                row = dict(row, weight=round(float(weight), 6), samples=int(count))
                row["epochs"] = round(int(count) * dataset.seq_length / max(row["tokens"], 1), 4)
                rows.append(row)
        return rows


def blending_indices(weights: np.ndarray, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy error-minimizing assignment of ``num_samples`` samples to datasets with ``weights``.

    Returns (dataset_index, dataset_sample_index): which dataset serves sample ``i``, and which of
    that dataset's samples it is. See :func:`blending_index_chunks`.
    """
    parts = list(zip(*blending_index_chunks(weights, num_samples, max(num_samples, 1))))
    if not parts:
        return np.empty(0, dtype=np.int16), np.empty(0, dtype=np.int64)
    return parts[0][0], parts[1][0]


def blending_index_chunks(weights: np.ndarray, num_samples: int, chunk: int, start: int = 0,
                          counts: np.ndarray | None = None
                          ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """:func:`blending_indices` in pieces of ``chunk`` samples, in order; from sample ``start``
    on, given ``counts`` (each dataset's samples among the first ``start``), samples ``[start,
    num_samples)``: equal to the same samples of a build from 0.

    For two datasets the choices have a closed form (vectorized: 1B samples in seconds). With
    more, the choice at step ``i`` depends on all earlier choices: a compiled loop
    (``blending.greedy_blend_chunks``); cached, and built once per node.
    """
    weights = [float(w) for w in weights]
    if len(weights) > 2:
        yield from greedy_blend_chunks(np.asarray(weights), num_samples, chunk, start=start,
                                       counts=counts)
        return
    for first in range(start, num_samples, chunk):
        steps = np.arange(first, min(first + chunk, num_samples), dtype=np.int64)
        if len(weights) == 1:
            yield np.zeros(steps.size, dtype=np.int16), steps
            continue
        # Two datasets: the lags sum to 1, so dataset 0 is chosen iff its lag is >= 1/2, which
        # makes its count after t samples floor(w0 * t + 1/2) (by induction): the same choices,
        # vectorized.
        counts0 = np.floor(weights[0] * np.arange(steps[0], steps[-1] + 2, dtype=np.float64)
                           + 0.5).astype(np.int64)
        dataset_index = (1 - np.diff(counts0)).astype(np.int16)
        taken0 = counts0[:-1]  # dataset 0's samples before sample i
        yield dataset_index, np.where(dataset_index == 0, taken0, steps - taken0)


def split_document_ids(num_documents: int, split: Sequence[float] | str) -> list[range]:
    """Split document ids ``0..num_documents-1`` into contiguous train/valid/test ranges by weight.

    ``split`` is up to three non-negative weights (``[98, 2, 0]``, or Megatron's string
    ``"98,2,0"``), normalized; missing entries are 0. Boundaries are rounded cumulative fractions,
    so the ranges always cover every document exactly once.
    """
    if isinstance(split, str):
        split = [float(s) for s in split.replace(",", " ").split()]
    weights = [float(w) for w in split]
    if not 1 <= len(weights) <= 3 or any(not math.isfinite(w) or w < 0 for w in weights) \
            or sum(weights) <= 0:
        raise DataError(f"data.split={list(split)} must be 1-3 non-negative weights with a "
                        "positive sum, e.g. [98, 2, 0]")
    weights += [0.0] * (3 - len(weights))
    fractions = np.cumsum(weights) / sum(weights)
    bounds = np.concatenate([[0], np.round(fractions * num_documents)]).astype(np.int64)
    bounds[-1] = num_documents
    # ranges, not arrays: 1,000 prefixes of 10M documents would hold 240 GB of ids
    return [range(int(bounds[i]), int(bounds[i + 1])) for i in range(3)]


def parse_data_paths(paths: Sequence | str) -> list[tuple[float | None, str]]:
    """``[prefixA, prefixB]``, ``[0.3, prefixA, 0.7, prefixB]`` or ``"0.3 prefixA 0.7 prefixB"`` as
    (weight or None, prefix) pairs."""
    items = paths.split() if isinstance(paths, str) else list(paths)
    weights = [_as_number(item) for item in items]
    if not items:
        raise DataError("data.paths is empty; give at least one dataset prefix")
    if all(w is None for w in weights):
        return [(None, data_prefix(str(item))) for item in items]
    pairs_ok = len(items) % 2 == 0 and all(w is not None for w in weights[0::2]) and \
        all(w is None for w in weights[1::2])
    if not pairs_ok:
        raise DataError(f"data.paths={items} must be prefixes [A, B] or weight/prefix pairs [0.3, "
                        "A, 0.7, B]")
    _normalize_weights(weights[0::2], "data.paths weights")
    return [(weights[i], data_prefix(str(items[i + 1]))) for i in range(0, len(items), 2)]


def data_prefix(path: str) -> str:
    """The dataset prefix ``path`` names: itself, or, given one file of the pair
    (``PREFIX.bin`` or ``PREFIX.idx``), its prefix: the form a shell's tab completion gives."""
    stem, suffix = os.path.splitext(path)
    if suffix in (".bin", ".idx") and not dataset_exists(path) and dataset_exists(stem):
        return stem
    return path


def missing_prefix(prefix: str) -> DataError:
    """The one line for a data prefix with no ``.bin``/``.idx``: naming the prefix to use when
    ``tools/preprocess_data.py``'s ``PREFIX_KEY_document`` files are there."""
    made = sorted(f[len(os.path.basename(prefix)):-4] for f in _listdir(os.path.dirname(prefix))
                  if f.startswith(os.path.basename(prefix) + "_") and f.endswith("_document.bin")
                  and dataset_exists(os.path.join(os.path.dirname(prefix), f[:-4])))
    other = not_the_kind(prefix, "a tokenized dataset prefix")
    if other:
        return WrongKindError(f"data prefix {other}: give the prefix of a dataset that "
                              "tools/preprocess_data.py wrote (PREFIX.bin/.idx)")
    if made:
        names = " or ".join(f"{prefix}{m}" for m in made)
        return MissingFileError(f"data prefix {prefix}: {prefix}.bin/.idx not found, but {names} "
                                f"exists: did you mean data.paths [{prefix}{made[0]}]? "
                                "(preprocess_data.py appends _text_document to --output-prefix)")
    return MissingFileError(f"data prefix {prefix}: {prefix}.bin/.idx not found; create it with "
                            "tools/preprocess_data.py --output-prefix ... (it appends "
                            "_text_document)")


def _listdir(folder: str) -> list[str]:
    try:
        return os.listdir(folder or ".")
    except OSError:
        return []


def build_gpt_datasets(paths: Sequence | str, split: Sequence[float] | str, seq_length: int,
                       seed: int, num_samples: dict[str, int], cache_dir: str | None,
                       build_indices: bool = True, cache_wait_s: float = CACHE_WAIT_S) -> dict[
                           str, GPTDataset | BlendedDataset | None]:
    """Train/valid/test datasets over one or more weighted prefixes (None where num_samples is 0).

    Each prefix is split into train/valid/test documents by ``split`` on its own. Unweighted
    prefixes are weighted by their token count in each split. With several prefixes each split is a
    ``BlendedDataset`` whose components build slightly more samples than their share. Call
    ``describe_datasets`` on the result for per-prefix documents, tokens, weights and samples.

    Index arrays are cached in ``cache_dir`` under a hash of everything they depend on (a changed
    .bin/.idx, split, seed, sequence length or epoch count gives a new entry; a partial entry is
    never read). To build them once per node and share them among its ranks:

    1. local rank 0 calls ``build_gpt_datasets(..., build_indices=True)``: it loads the entries that
       are complete and builds and saves the others;
    2. all ranks of the node pass a barrier (``torch.distributed.barrier()``);
    3. the other local ranks call ``build_gpt_datasets(..., build_indices=False)`` with the same
       arguments: they never build, they memory-map local rank 0's files (waiting up to
       ``cache_wait_s`` seconds for them to appear, then TimeoutError).

    ``cache_dir`` must be the same directory for the ranks of a node (node-local or shared disk;
    on a shared file system, nodes writing the same entry is harmless: files are renamed into
    place whole). Without ``cache_dir`` every rank builds its own indices in memory.
    """
    unknown = set(num_samples) - set(SPLIT_NAMES)
    if unknown:
        raise ValueError(f"num_samples has unknown splits {sorted(unknown)}; use "
                         f"{', '.join(SPLIT_NAMES)}")
    pairs = parse_data_paths(paths)
    for _, prefix in pairs:
        if not dataset_exists(prefix):
            raise missing_prefix(prefix)
    indexed = [IndexedDataset(prefix) for _, prefix in pairs]
    doc_splits = [split_document_ids(len(ds), split) for ds in indexed]
    options = {"cache_dir": cache_dir, "build_indices": build_indices, "cache_wait_s": cache_wait_s}
    result: dict[str, GPTDataset | BlendedDataset | None] = {}
    for s, name in enumerate(SPLIT_NAMES):
        n = int(num_samples.get(name, 0) or 0)
        if n <= 0:
            result[name] = None
            continue
        members = [(w, ds, docs[s]) for (w, _), ds, docs in zip(pairs, indexed, doc_splits)]
        # weight by tokens; drop prefixes empty in this split
        if all(w is None for w, _, _ in members):
            members = [(float(ds.sequence_lengths[docs.start: docs.stop].sum(dtype=np.int64)), ds,
                        docs) for _, ds, docs in members]
            members = [m for m in members if m[0] > 0] or members[:1]
        if len(members) == 1:
            result[name] = GPTDataset(members[0][1], members[0][2], seq_length, n, seed, name=name,
                                      **options)
            continue
        weights = _normalize_weights([w for w, _, _ in members], "data.paths weights")
        parts = [GPTDataset(ds, docs, seq_length, math.ceil(w * n * _BLEND_OVERSAMPLE + 1), seed,
                            name=name, **options) for w, (_, ds, docs) in zip(weights, members)]
        result[name] = BlendedDataset(parts, weights, n, seed, **options)
    return result


def describe_datasets(datasets: dict[str, GPTDataset | BlendedDataset | None]) -> list[dict]:
    """Per split and prefix: documents, tokens (one epoch of that split), weight, samples, epochs.

    What a trainer logs at start-up, e.g. ``for row in describe_datasets(ds):
    log(format_row(row))``.
    """
    return [row for name in SPLIT_NAMES if datasets.get(name) is not None
            for row in datasets[name].describe()]


def format_description(rows: list[dict]) -> str:
    """``describe_datasets`` rows as aligned text lines, one per split and prefix."""
    return "\n".join(f"data {r['split']:<5} {r['prefix']}: {r['documents']:,} docs, "
                     f"{r['tokens']:,} tokens, weight {r['weight']:.4f}, {r['samples']:,} samples "
                     f"({r['epochs']:.3f} epochs)" for r in rows)


def _fits_in_host_memory(needed: int, what: str) -> None:
    """Refuse, before allocating anything, index arrays larger than the host memory available."""
    free = available_bytes()
    if free is not None and needed > free:
        raise DataError(f"{what} need about {size_text(needed)} of host memory to build, "
                        f"{size_text(free)} is available; lower train.seq_length, train.iters or "
                        "train.global_batch_size, or add data")


def _fits_on_disk(cache_dir: str, needed: int, what: str) -> None:
    """Refuse, before writing anything, index files larger than the cache directory's free
    space."""
    folder = cache_dir
    while folder and not os.path.isdir(folder):  # the nearest existing parent: it may be made
        folder = os.path.dirname(folder.rstrip(os.sep))
    try:
        free = shutil.disk_usage(folder or ".").free
    except OSError:
        return
    if needed > free:
        raise DataError(f"{what} need about {size_text(needed)} of disk in data.cache_dir="
                        f"{cache_dir}, {size_text(free)} is free there; free space, set "
                        "data.cache_dir to a disk with room, or lower train.seq_length, "
                        "train.iters or train.global_batch_size")


def _normalize_weights(weights: Sequence[float], what: str) -> np.ndarray:
    """Positive finite weights scaled to sum to 1, or one clear error."""
    values = np.asarray([float(w) for w in weights], dtype=np.float64)
    if values.size == 0 or not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise DataError(f"{what} must be positive numbers, got {list(weights)}")
    return values / values.sum()


def _as_number(item) -> float | None:
    """A weight if ``item`` is (or spells) a number, else None (it is a prefix)."""
    if isinstance(item, bool):
        return None
    if isinstance(item, (int, float)):
        return float(item)
    try:
        return float(item)
    except (TypeError, ValueError):
        return None


def _index_dtype(max_value: int) -> np.dtype:
    """int32 where values fit (halves index memory), else int64."""
    return np.dtype(np.int32) if max_value < np.iinfo(np.int32).max else np.dtype(np.int64)
