"""Packing, epochs, determinism, caching, splits and blending of GPT samples."""

import os

import numpy as np
import pytest

from megapretrain.data import gpt_dataset
from megapretrain.data.gpt_dataset import (
    BlendedDataset,
    GPTDataset,
    blending_indices,
    build_gpt_datasets,
    parse_data_paths,
    split_document_ids,
)
from megapretrain.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

EOD = 0


def make_corpus(prefix, num_docs=60, seed=0, first_token=1):
    """Documents of 0-40 distinct tokens, each ending with EOD (as preprocessing writes them).
    Every non-EOD token is unique, so a token identifies its place in the corpus."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    docs, next_token = [], first_token
    for _ in range(num_docs):
        n = int(rng.integers(0, 40))
        doc = np.append(np.arange(next_token, next_token + n), EOD)
        next_token += n
        if rng.random() < 0.1:
            doc = doc[:0]  # a few empty sequences: packing must step over them
        docs.append(doc)
        builder.add_document(doc)
    builder.finalize(prefix + ".idx")
    return IndexedDataset(prefix), docs


def reference_stream(ds, docs):
    """The document stream the indices describe, built the slow, obvious way."""
    return np.concatenate([docs[int(d)] for d in ds.doc_index])


def check_windows(ds, docs):
    """Sample i is the (seq_length+1)-token window at stream position shuffle_index[i] * seq_length."""
    stream, s = reference_stream(ds, docs), ds.seq_length
    served = ds.shuffle_index.tolist()
    assert len(set(served)) == len(served) == len(ds)  # no sample twice
    for i in range(len(ds)):
        k = int(ds.shuffle_index[i])
        sample = ds[i]
        assert sample.dtype == np.int64 and sample.shape == (s + 1,)
        np.testing.assert_array_equal(sample, stream[k * s: k * s + s + 1])


@pytest.mark.parametrize("seq_length", [1, 7, 32, 100])
def test_one_epoch_packs_every_token_once(tmp_path, seq_length):
    indexed, docs = make_corpus(str(tmp_path / "c"))
    total = sum(len(d) for d in docs)
    num_samples = -(-total // seq_length)  # the samples that start in epoch 0
    ds = GPTDataset(indexed, np.arange(len(docs)), seq_length, num_samples, seed=3)
    assert ds.num_epochs == 1 and len(ds) == num_samples
    first_epoch = np.asarray(ds.doc_index)[: len(docs)]
    assert sorted(first_epoch.tolist()) == list(range(len(docs)))
    check_windows(ds, docs)
    stream = reference_stream(ds, docs)
    starts = np.asarray(ds.shuffle_index, dtype=np.int64) * seq_length
    assert sorted(starts.tolist()) == list(range(0, num_samples * seq_length, seq_length))
    # every token of the epoch after its first is a prediction target exactly once
    target_positions = np.concatenate([np.arange(k + 1, k + seq_length + 1) for k in starts])
    in_epoch = np.sort(target_positions[target_positions < total])
    np.testing.assert_array_equal(in_epoch, np.arange(1, total))
    assert (stream[:total] == EOD).sum() == sum(1 for d in docs if len(d))  # EOD between documents, no padding


def test_sample_i_does_not_depend_on_num_samples(tmp_path):
    """Asking for more samples (a longer run, a resumed run) never changes the earlier ones."""
    indexed, docs = make_corpus(str(tmp_path / "c"), num_docs=20)
    small = GPTDataset(indexed, np.arange(len(docs)), 16, 10, seed=4)
    large = GPTDataset(indexed, np.arange(len(docs)), 16, 500, seed=4)
    assert large.num_epochs > 1
    for i in range(10):
        np.testing.assert_array_equal(small[i], large[i])


def test_multi_epoch_shuffles_each_epoch_and_serves_epochs_in_order(tmp_path):
    indexed, docs = make_corpus(str(tmp_path / "c"), num_docs=20)
    total = sum(len(d) for d in docs)
    ds = GPTDataset(indexed, np.arange(len(docs)), 16, num_samples=(total * 7) // (2 * 16), seed=1)
    assert ds.num_epochs == 4
    epochs = np.asarray(ds.doc_index).reshape(5, -1)  # one more epoch of documents than of samples
    assert all(sorted(e.tolist()) == list(range(20)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 5  # each epoch has its own order
    check_windows(ds, docs)
    epoch_of_served = np.asarray(ds.shuffle_index) * 16 // total
    assert (np.diff(epoch_of_served) >= 0).all()


def test_document_subset_uses_only_those_documents(tmp_path):
    indexed, docs = make_corpus(str(tmp_path / "c"))
    subset = np.arange(10, 30)
    ds = GPTDataset(indexed, subset, 8, 30, seed=0)
    assert set(np.asarray(ds.doc_index).tolist()) == set(subset.tolist())
    check_windows(ds, docs)


def test_deterministic_per_seed(tmp_path):
    indexed, docs = make_corpus(str(tmp_path / "c"))
    a, b, c = (GPTDataset(indexed, np.arange(len(docs)), 16, 50, seed=s) for s in (5, 5, 6))
    assert all((a[i] == b[i]).all() for i in range(50))
    assert any((a[i] != c[i]).any() for i in range(50))


def test_cache_is_written_reused_and_keyed(tmp_path, monkeypatch):
    indexed, docs = make_corpus(str(tmp_path / "c"))
    cache = tmp_path / "cache"
    first = GPTDataset(indexed, np.arange(len(docs)), 16, 40, seed=2, cache_dir=str(cache))
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == 3 and all(f.endswith(".npy") for f in files)

    def no_rebuild(self):
        raise AssertionError("indices rebuilt although cached")

    monkeypatch.setattr(GPTDataset, "_build_indices", no_rebuild)
    again = GPTDataset(indexed, np.arange(len(docs)), 16, 40, seed=2, cache_dir=str(cache))
    assert all((first[i] == again[i]).all() for i in range(40))
    monkeypatch.undo()
    GPTDataset(indexed, np.arange(len(docs)), 16, 40, seed=3, cache_dir=str(cache))
    assert len(list(cache.iterdir())) == 6  # another seed, other files


def test_empty_inputs_are_clear_errors(tmp_path):
    indexed, docs = make_corpus(str(tmp_path / "c"))
    with pytest.raises(ValueError, match="no documents"):
        GPTDataset(indexed, np.array([], dtype=np.int64), 8, 10, seed=0)
    empty_ids = np.array([i for i, d in enumerate(docs) if len(d) == 0])
    with pytest.raises(ValueError, match="zero tokens"):
        GPTDataset(indexed, empty_ids, 8, 10, seed=0)


def test_split_document_ids():
    parts = split_document_ids(100, [98, 2, 0])
    assert [len(p) for p in parts] == [98, 2, 0]
    assert np.concatenate(parts).tolist() == list(range(100))
    assert [len(p) for p in split_document_ids(10, "1,1,1")] == [3, 4, 3]
    assert [len(p) for p in split_document_ids(7, [1])] == [7, 0, 0]
    for bad in ([0, 0, 0], [-1, 2], [1, 1, 1, 1]):
        with pytest.raises(ValueError, match="data.split"):
            split_document_ids(10, bad)


def window_deviation(dataset_index, weights, window):
    worst = 0.0
    for d, w in enumerate(weights):
        counts = np.concatenate([[0], np.cumsum(np.asarray(dataset_index) == d)])
        worst = max(worst, np.abs(counts[window:] - counts[:-window] - w * window).max())
    return worst


def test_blending_matches_weights_in_every_window():
    index, sample_index = blending_indices(np.array([0.3, 0.7]), 10_000)
    assert window_deviation(index, [0.3, 0.7], 100) <= 1  # within ±1 of 30/70 in every window of 100
    for d in range(2):
        assert sample_index[index == d].tolist() == list(range((index == d).sum()))
    index3, _ = blending_indices(np.array([0.2, 0.3, 0.5]), 10_000)
    assert window_deviation(index3, [0.2, 0.3, 0.5], 100) < 2


def test_blended_dataset_draws_from_components(tmp_path):
    a, _ = make_corpus(str(tmp_path / "a"), seed=1)
    b, _ = make_corpus(str(tmp_path / "b"), seed=2, first_token=10_000)
    parts = [GPTDataset(ds, np.arange(len(ds)), 8, 40, seed=0) for ds in (a, b)]
    blend = BlendedDataset(parts, [1, 3], 50, seed=0)
    for i in range(50):
        d, j = int(blend.dataset_index[i]), int(blend.dataset_sample_index[i])
        np.testing.assert_array_equal(blend[i], parts[d][j])
    assert abs(np.bincount(blend.dataset_index)[0] - 12.5) <= 0.5
    with pytest.raises(ValueError, match="has 40 samples"):
        BlendedDataset(parts, [1, 3], 100, seed=0)


def test_parse_data_paths():
    assert parse_data_paths(["a", "b"]) == [(None, "a"), (None, "b")]
    assert parse_data_paths([0.3, "a", 0.7, "b"]) == [(0.3, "a"), (0.7, "b")]
    assert parse_data_paths("0.3 a 0.7 b") == [(0.3, "a"), (0.7, "b")]
    for bad in (["a", 0.3], [0.3, "a", "b"], [-1, "a"], [0, "a"], []):
        with pytest.raises(ValueError, match="data.paths"):
            parse_data_paths(bad)


def test_build_gpt_datasets(tmp_path, monkeypatch):
    a, _ = make_corpus(str(tmp_path / "a"), num_docs=100, seed=1)
    make_corpus(str(tmp_path / "b"), num_docs=100, seed=2, first_token=10_000)
    pa, pb = str(tmp_path / "a"), str(tmp_path / "b")
    counts = {"train": 60, "valid": 5, "test": 0}
    single = build_gpt_datasets([pa], [90, 10, 0], 8, 0, counts, None)
    assert isinstance(single["train"], GPTDataset) and single["test"] is None
    assert len(single["train"]) == 60 and len(single["valid"]) == 5
    assert set(np.asarray(single["valid"].doc_index).tolist()) <= set(range(90, 100))
    blended = build_gpt_datasets(f"0.25 {pa} 0.75 {pb}", [90, 10, 0], 8, 0, counts, str(tmp_path / "cache"))
    train = blended["train"]
    assert isinstance(train, BlendedDataset) and len(train) == 60
    assert np.bincount(train.dataset_index).tolist() == [15, 45]
    assert [len(p) for p in train.datasets] == [int(np.ceil(w * 60 * 1.005 + 1)) for w in (0.25, 0.75)]
    assert any(name.startswith("blend_") for name in os.listdir(tmp_path / "cache"))
    monkeypatch.setattr(gpt_dataset, "blending_indices", None)  # a second build must come from the cache
    again = build_gpt_datasets(f"0.25 {pa} 0.75 {pb}", [90, 10, 0], 8, 0, counts, str(tmp_path / "cache"))["train"]
    assert all((again[i] == train[i]).all() for i in range(60))
    monkeypatch.undo()
    by_tokens = build_gpt_datasets([pa, pb], [90, 10, 0], 8, 0, counts, None)["train"]
    train_tokens = [int(ds.sequence_lengths[:90].sum()) for ds in (a, IndexedDataset(pb))]
    np.testing.assert_allclose(by_tokens.weights, np.array(train_tokens) / sum(train_tokens))


def test_missing_prefix_names_it_and_the_tool(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        build_gpt_datasets([str(tmp_path / "missing")], [1], 8, 0, {"train": 1}, None)
    assert "missing" in str(info.value) and "tools/preprocess_data.py" in str(info.value)


def test_blending_counts_are_exact_when_weights_divide():
    index, _ = blending_indices(np.array([0.5, 0.25, 0.25]), 100_000)
    assert np.bincount(index).tolist() == [50_000, 25_000, 25_000]
