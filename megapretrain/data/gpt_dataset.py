"""GPT pretraining samples: documents packed into ``seq_length + 1`` token windows, blended by weight.

Three index arrays, built with vectorized numpy and deterministic in ``seed``, turn an
``IndexedDataset`` into samples (the scheme of Megatron-LM's GPTDataset):

- ``doc_index``: the document stream, one independently shuffled copy of ``document_ids`` per epoch.
- ``sample_index[k] = (position in doc_index, token offset)`` where sample ``k`` starts, i.e. token
  ``k * seq_length`` of the stream. Sample ``k`` is the ``seq_length + 1`` tokens from there, so it
  ends on the first token of sample ``k + 1`` (inputs ``s[:-1]``, targets ``s[1:]``): every token
  after the first is a prediction target exactly once. No padding; the EOS that preprocessing
  appends to each document separates documents inside a sample.
- ``shuffle_index``: the order samples are served in, a permutation within each epoch so that
  training finishes epoch ``e`` before it sees epoch ``e + 1``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from array import array
from typing import Sequence

import numpy as np

from megapretrain.data.indexed_dataset import IndexedDataset, data_file_path, dataset_exists

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
_INDEX_FORMAT = "megapretrain-gpt-indices-v2"  # bump when the index algorithm changes: invalidates caches
_BLEND_OVERSAMPLE = 1.005  # each blended component builds this much more than its share, as Megatron does


class GPTDataset:
    """Fixed-length training samples cut from a shuffled stream of whole documents (see module docstring).

    ``document_ids`` index the sequences of ``indexed`` (preprocessing writes one per document);
    ``__getitem__(i)`` returns the i-th sample in training order as ``seq_length + 1`` int64 ids.
    """

    def __init__(self, indexed: IndexedDataset, document_ids: np.ndarray, seq_length: int, num_samples: int,
                 seed: int, cache_dir: str | None = None, name: str = "train"):
        self.indexed = indexed
        self.document_ids = np.asarray(document_ids, dtype=np.int64)
        self.seq_length, self.num_samples, self.seed, self.name = seq_length, num_samples, seed, name
        self._validate()
        self.cache_key = self._cache_key()
        indices = _load_cached(cache_dir, self._cache_stem(), ("doc_index", "sample_index", "shuffle_index"))
        if indices is None:
            start = time.perf_counter()
            indices = self._build_indices()
            logger.info("built %s indices for %s (%d samples) in %.2fs", name, indexed.prefix, num_samples,
                        time.perf_counter() - start)
            _save_cached(cache_dir, self._cache_stem(), indices)
        self.doc_index, self.sample_index, self.shuffle_index = (
            indices["doc_index"], indices["sample_index"], indices["shuffle_index"])

    def _validate(self) -> None:
        """Check the arguments and derive tokens_per_epoch and num_epochs from them."""
        where = f"GPTDataset {self.name!r} of {self.indexed.prefix}"
        if int(self.seq_length) < 1 or int(self.num_samples) < 0:
            raise ValueError(f"{where}: seq_length={self.seq_length} must be >= 1 and "
                             f"num_samples={self.num_samples} >= 0")
        if self.document_ids.size == 0:
            raise ValueError(f"{where}: no documents in this split; raise its share in data.split or add data")
        if self.document_ids.min() < 0 or self.document_ids.max() >= len(self.indexed):
            raise ValueError(f"{where}: document ids must lie in [0, {len(self.indexed)})")
        self.tokens_per_epoch = int(self.indexed.sequence_lengths[self.document_ids].sum(dtype=np.int64))
        if self.tokens_per_epoch == 0:
            raise ValueError(f"{where}: the {self.document_ids.size} documents hold zero tokens")
        # Epoch e owns the samples whose first token lies in it: k with k·seq_length in [e·T, (e+1)·T).
        # Build whole epochs, so that sample i never depends on how many samples were asked for.
        self.num_epochs = 1
        while self._epoch_start(self.num_epochs) < self.num_samples:
            self.num_epochs += 1

    def _epoch_start(self, epoch: int) -> int:
        """Index of the first sample of ``epoch`` (= number of samples in the epochs before it)."""
        return -(-epoch * self.tokens_per_epoch // self.seq_length)

    def _build_indices(self) -> dict[str, np.ndarray]:
        """Build doc_index, sample_index and shuffle_index; no Python loop over samples or documents.

        Every index depends on (seed, documents, seq_length) and the epoch count only, and each
        epoch's part depends on its own epoch number: sample i is the same whatever num_samples is.
        One extra epoch of documents lets the last epoch's final samples run past its end."""
        epochs = [np.random.default_rng([self.seed, epoch]).permutation(self.document_ids)
                  for epoch in range(self.num_epochs + 1)]
        doc_index = np.concatenate(epochs).astype(_index_dtype(len(self.indexed)))
        # Stream offset of each document in doc_index: doc j covers tokens [starts[j], starts[j + 1]).
        starts = np.zeros(doc_index.size + 1, dtype=np.int64)
        np.cumsum(self.indexed.sequence_lengths[doc_index], dtype=np.int64, out=starts[1:])
        # Sample k starts at token k * seq_length; entry k + 1 marks sample k's final token.
        total = self._epoch_start(self.num_epochs)
        positions = np.arange(total + 1, dtype=np.int64) * self.seq_length
        # side="right" skips empty documents: a position is placed in the document that contains it.
        doc_positions = np.searchsorted(starts, positions, side="right") - 1
        offsets = positions - starts[doc_positions]
        sample_index = np.stack([doc_positions, offsets], axis=1).astype(_index_dtype(doc_index.size))
        # Serve epoch by epoch, each epoch's samples in an order seeded by (seed, epoch).
        shuffle_index = np.concatenate([
            self._epoch_start(e) + np.random.default_rng([self.seed, e, 1 << 31]).permutation(
                self._epoch_start(e + 1) - self._epoch_start(e))
            for e in range(self.num_epochs)])[: self.num_samples]
        return {"doc_index": doc_index, "sample_index": sample_index,
                "shuffle_index": shuffle_index.astype(_index_dtype(total))}

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample ``i`` in training order: ``seq_length + 1`` int64 token ids."""
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.name} dataset of {self.num_samples} samples")
        k = int(self.shuffle_index[i])
        first_doc, first_offset = (int(v) for v in self.sample_index[k])
        last_doc, last_offset = (int(v) for v in self.sample_index[k + 1])  # position of the final token
        if first_doc == last_doc:
            return self._doc(first_doc, first_offset, last_offset - first_offset + 1).astype(np.int64)
        parts = [self._doc(first_doc, first_offset)]
        parts += [self._doc(j) for j in range(first_doc + 1, last_doc)]
        parts.append(self._doc(last_doc, 0, last_offset + 1))
        return np.concatenate(parts).astype(np.int64)

    def _doc(self, position: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        return self.indexed.get(int(self.doc_index[position]), offset, length)

    def _cache_key(self) -> str:
        """sha256 of everything the indices depend on, including the .bin file's size and mtime."""
        stat = os.stat(data_file_path(self.indexed.prefix))
        description = {
            "format": _INDEX_FORMAT, "prefix": os.path.realpath(self.indexed.prefix),
            "bin_size": stat.st_size, "bin_mtime_ns": stat.st_mtime_ns,
            "document_ids": hashlib.sha256(self.document_ids.tobytes()).hexdigest(),
            "seq_length": int(self.seq_length), "num_samples": int(self.num_samples), "seed": int(self.seed),
        }
        return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()

    def _cache_stem(self) -> str:
        return f"{os.path.basename(self.indexed.prefix)}_{self.name}_{self.cache_key[:24]}"


class BlendedDataset:
    """Interleaves datasets so that every stretch of samples mixes them in proportion to ``weights``.

    Sample ``i`` comes from the dataset whose count lags its target ``weight * (i + 1)`` the most
    (ties go to the lower index), Megatron-LM's greedy blending. For two datasets every prefix's
    count is within half a sample of its target, so every window is within one; for more datasets
    the deviation stays near one. No count ever exceeds ``weight * n + 1`` (the chosen dataset
    lags by a positive amount before it is picked), which is why components sized
    ``ceil(weight * n * 1.005 + 1)`` always suffice. The assignment is deterministic and does not
    use ``seed``; it is accepted so that callers pass one.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], num_samples: int, seed: int,
                 cache_dir: str | None = None):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"BlendedDataset needs one weight per dataset, got {len(datasets)} datasets and "
                             f"{len(weights)} weights")
        self.datasets, self.weights = list(datasets), _normalize_weights(weights, "BlendedDataset weights")
        self.num_samples, self.seed = int(num_samples), seed
        keys = [getattr(d, "cache_key", None) for d in self.datasets]
        stem = None
        if all(keys):
            blob = json.dumps({"components": keys, "weights": self.weights.tolist(), "n": self.num_samples})
            stem = "blend_" + hashlib.sha256(blob.encode()).hexdigest()[:24]
        indices = _load_cached(cache_dir, stem, ("dataset_index", "dataset_sample_index"))
        if indices is None:
            indices = dict(zip(("dataset_index", "dataset_sample_index"),
                               blending_indices(self.weights, self.num_samples)))
            _save_cached(cache_dir, stem, indices)
        self.dataset_index, self.dataset_sample_index = indices["dataset_index"], indices["dataset_sample_index"]
        self._check_component_sizes()

    def _check_component_sizes(self) -> None:
        needed = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for dataset, count in zip(self.datasets, needed):
            if count > len(dataset):
                raise ValueError(f"BlendedDataset: component {getattr(dataset, 'name', dataset)!r} has "
                                 f"{len(dataset)} samples but the blend draws {count} from it")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


def blending_indices(weights: np.ndarray, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy error-minimizing assignment of ``num_samples`` samples to datasets with ``weights``.

    Returns (dataset_index, dataset_sample_index): which dataset serves sample ``i``, and which of
    that dataset's samples it is. The choice at step ``i`` depends on all earlier choices, so it is a
    tight loop on Python floats (10M samples of 2-3 datasets take about 3 s, more with more datasets;
    with a cache directory it is a one-time cost); the rest is vectorized.
    """
    weights = [float(w) for w in weights]
    if len(weights) == 1:
        return np.zeros(num_samples, dtype=np.int16), np.arange(num_samples, dtype=np.int64)
    counts = [0] * len(weights)
    chosen = array("H", bytes(2 * num_samples))
    rest = range(1, len(weights))
    w0 = weights[0]
    for i in range(num_samples):
        target = i + 1.0
        best, best_lag = 0, w0 * target - counts[0]
        for d in rest:
            lag = weights[d] * target - counts[d]
            if lag > best_lag:
                best, best_lag = d, lag
        chosen[i] = best
        counts[best] += 1
    dataset_index = np.frombuffer(chosen, dtype=np.uint16).astype(np.int16)
    # The j-th time dataset d is chosen it serves its sample j: a per-dataset running count.
    order = np.argsort(dataset_index, kind="stable")
    group_starts = np.concatenate([[0], np.cumsum(np.bincount(dataset_index, minlength=len(weights)))[:-1]])
    dataset_sample_index = np.empty(num_samples, dtype=np.int64)
    dataset_sample_index[order] = np.arange(num_samples) - np.repeat(group_starts, counts)
    return dataset_index, dataset_sample_index


def split_document_ids(num_documents: int, split: Sequence[float] | str) -> list[np.ndarray]:
    """Split document ids ``0..num_documents-1`` into contiguous train/valid/test ranges by weight.

    ``split`` is up to three non-negative weights (``[98, 2, 0]``, or Megatron's string ``"98,2,0"``),
    normalized; missing entries are 0. Boundaries are rounded cumulative fractions, so the ranges
    always cover every document exactly once.
    """
    if isinstance(split, str):
        split = [float(s) for s in split.replace(",", " ").split()]
    weights = [float(w) for w in split]
    if not 1 <= len(weights) <= 3 or any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"data.split={list(split)} must be 1-3 non-negative weights with a positive sum, "
                         "e.g. [98, 2, 0]")
    weights += [0.0] * (3 - len(weights))
    fractions = np.cumsum(weights) / sum(weights)
    bounds = np.concatenate([[0], np.round(fractions * num_documents)]).astype(np.int64)
    bounds[-1] = num_documents
    return [np.arange(bounds[i], bounds[i + 1], dtype=np.int64) for i in range(3)]


def parse_data_paths(paths: Sequence | str) -> list[tuple[float | None, str]]:
    """``[prefixA, prefixB]``, ``[0.3, prefixA, 0.7, prefixB]`` or ``"0.3 prefixA 0.7 prefixB"`` as
    (weight or None, prefix) pairs."""
    items = paths.split() if isinstance(paths, str) else list(paths)
    weights = [_as_number(item) for item in items]
    if not items:
        raise ValueError("data.paths is empty; give at least one dataset prefix")
    if all(w is None for w in weights):
        return [(None, str(item)) for item in items]
    pairs_ok = len(items) % 2 == 0 and all(w is not None for w in weights[0::2]) and \
        all(w is None for w in weights[1::2])
    if not pairs_ok:
        raise ValueError(f"data.paths={items} must be prefixes [A, B] or weight/prefix pairs [0.3, A, 0.7, B]")
    _normalize_weights(weights[0::2], "data.paths weights")
    return [(weights[i], str(items[i + 1])) for i in range(0, len(items), 2)]


def build_gpt_datasets(paths: Sequence | str, split: Sequence[float] | str, seq_length: int, seed: int,
                       num_samples: dict[str, int], cache_dir: str | None
                       ) -> dict[str, GPTDataset | BlendedDataset | None]:
    """Train/valid/test datasets over one or more weighted prefixes (None where num_samples is 0).

    Unweighted prefixes are weighted by their token count in each split. With several prefixes each
    split is a ``BlendedDataset`` whose components build slightly more samples than their share.
    """
    unknown = set(num_samples) - set(SPLIT_NAMES)
    if unknown:
        raise ValueError(f"num_samples has unknown splits {sorted(unknown)}; use {', '.join(SPLIT_NAMES)}")
    pairs = parse_data_paths(paths)
    for _, prefix in pairs:
        if not dataset_exists(prefix):
            raise FileNotFoundError(f"data prefix {prefix}: {prefix}.bin/.idx not found; create it with "
                                    "tools/preprocess_data.py --output-prefix ... (it appends _text_document)")
    indexed = [IndexedDataset(prefix) for _, prefix in pairs]
    doc_splits = [split_document_ids(len(ds), split) for ds in indexed]
    result: dict[str, GPTDataset | BlendedDataset | None] = {}
    for s, name in enumerate(SPLIT_NAMES):
        n = int(num_samples.get(name, 0) or 0)
        if n <= 0:
            result[name] = None
            continue
        members = [(w, ds, docs[s]) for (w, _), ds, docs in zip(pairs, indexed, doc_splits)]
        if all(w is None for w, _, _ in members):  # weight by tokens; drop prefixes empty in this split
            members = [(float(ds.sequence_lengths[docs].sum(dtype=np.int64)), ds, docs) for _, ds, docs in members]
            members = [m for m in members if m[0] > 0] or members[:1]
        if len(members) == 1:
            result[name] = GPTDataset(members[0][1], members[0][2], seq_length, n, seed, cache_dir, name)
            continue
        weights = _normalize_weights([w for w, _, _ in members], "data.paths weights")
        parts = [GPTDataset(ds, docs, seq_length, math.ceil(w * n * _BLEND_OVERSAMPLE + 1), seed, cache_dir, name)
                 for w, (_, ds, docs) in zip(weights, members)]
        result[name] = BlendedDataset(parts, weights, n, seed, cache_dir)
    return result


def _normalize_weights(weights: Sequence[float], what: str) -> np.ndarray:
    """Positive finite weights scaled to sum to 1, or one clear error."""
    values = np.asarray([float(w) for w in weights], dtype=np.float64)
    if values.size == 0 or not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise ValueError(f"{what} must be positive numbers, got {list(weights)}")
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


def _load_cached(cache_dir: str | None, stem: str | None, names: Sequence[str]) -> dict[str, np.ndarray] | None:
    """Memory-map previously saved index arrays, or None when caching is off or any file is missing."""
    if cache_dir is None or stem is None:
        return None
    paths = {name: os.path.join(cache_dir, f"{stem}_{name}.npy") for name in names}
    if not all(os.path.isfile(p) for p in paths.values()):
        return None
    return {name: np.load(path, mmap_mode="r", allow_pickle=False) for name, path in paths.items()}


def _save_cached(cache_dir: str | None, stem: str | None, arrays: dict[str, np.ndarray]) -> None:
    """Save each array under a temporary name, then rename: concurrent ranks never see a partial file."""
    if cache_dir is None or stem is None:
        return
    os.makedirs(cache_dir, exist_ok=True)
    for name, arr in arrays.items():
        path = os.path.join(cache_dir, f"{stem}_{name}.npy")
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            np.save(f, arr, allow_pickle=False)
        os.replace(tmp, path)
