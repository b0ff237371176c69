"""Packing, epochs, determinism, caching, splits and blending of GPT samples."""

import os
import threading

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
from megapretrain.data.indexed_dataset import IndexedDataset

from helpers import EOD, make_corpus


def expected_by_row(ds, docs, document_ids):
    """Each sample_index row's sample, from the definition: epoch e's shuffled documents as a cyclic
    token stream; its sample k is the seq_length+1 tokens at k*s - e*T of that stream."""
    s, total = ds.seq_length, ds.tokens_per_epoch
    by_row, row = {}, 0
    for e in range(ds.num_epochs):
        order = np.random.default_rng([ds.seed, e]).permutation(document_ids)
        stream = np.concatenate([docs[d] for d in order])
        cyclic = np.tile(stream, 2 + (s + 1) // total)
        for k in range(-(-e * total // s), -(-(e + 1) * total // s)):
            local = k * s - e * total
            by_row[row] = (e, k, cyclic[local: local + s + 1])
            row += 1
        row += 1  # each epoch ends with the row of its last sample's final token
    return by_row


def check_windows(ds, docs, document_ids=None):
    """Every served sample matches the definition; no sample twice; epochs served in order."""
    document_ids = np.arange(len(docs)) if document_ids is None else document_ids
    by_row, s = expected_by_row(ds, docs, document_ids), ds.seq_length
    served = ds.shuffle_index.tolist()
    assert len(set(served)) == len(served) == len(ds)  # no sample twice
    for i in range(len(ds)):
        epoch, k, expected = by_row[served[i]]
        sample = ds[i]
        assert sample.dtype == np.int64 and sample.shape == (s + 1,)
        np.testing.assert_array_equal(sample, expected, err_msg=f"sample {i} (epoch {epoch}, k {k})")
    epochs = [by_row[r][0] for r in served]
    assert epochs == sorted(epochs)
    return [by_row[r][1] for r in served]


@pytest.mark.parametrize("seq_length", [1, 7, 32, 100, 5000])
def test_one_epoch_packs_every_token_once(tmp_path, seq_length):
    indexed, docs = make_corpus(str(tmp_path / "c"))
    total = sum(len(d) for d in docs)
    num_samples = -(-total // seq_length)  # the samples that start in epoch 0
    ds = GPTDataset(indexed, np.arange(len(docs)), seq_length, num_samples, seed=3)
    assert ds.num_epochs == 1 and len(ds) == num_samples
    first_epoch = np.asarray(ds.doc_index)[: len(docs)]
    assert sorted(first_epoch.tolist()) == list(range(len(docs)))
    starts = np.array(check_windows(ds, docs)) * seq_length
    assert sorted(starts.tolist()) == list(range(0, num_samples * seq_length, seq_length))
    # every token of the epoch after its first is a prediction target exactly once
    target_positions = np.concatenate([np.arange(k + 1, k + seq_length + 1) for k in starts])
    in_epoch = np.sort(target_positions[target_positions < total])
    np.testing.assert_array_equal(in_epoch, np.arange(1, total))
    stream = np.concatenate([docs[int(d)] for d in first_epoch])
    assert (stream == EOD).sum() == sum(1 for d in docs if len(d))  # EOD between documents, no padding


def test_sample_i_does_not_depend_on_num_samples(tmp_path):
    """Asking for more samples (a longer run, a resumed run) never changes the earlier ones."""
    indexed, docs = make_corpus(str(tmp_path / "c"), num_docs=20)
    small = GPTDataset(indexed, np.arange(len(docs)), 16, 10, seed=4)
    large = GPTDataset(indexed, np.arange(len(docs)), 16, 500, seed=4)
    assert large.num_epochs > 1
    for i in range(10):
        np.testing.assert_array_equal(small[i], large[i])
    one_epoch = -(-small.tokens_per_epoch // 16)
    exact = GPTDataset(indexed, np.arange(len(docs)), 16, one_epoch, seed=4)
    longer = GPTDataset(indexed, np.arange(len(docs)), 16, one_epoch + 1, seed=4)
    assert exact.num_epochs == 1 and longer.num_epochs == 2
    assert all((exact[i] == longer[i]).all() for i in range(one_epoch))  # the epoch's last samples too


def test_epochs_are_the_fewest_that_hold_the_samples():
    for total, s in [(15, 10), (100, 7), (7, 100), (64, 16)]:
        for n in range(1, 40):
            epochs = gpt_dataset.epochs_for(n, total, s)
            assert -(-epochs * total // s) >= n > -(-(epochs - 1) * total // s), (total, s, n)


def test_multi_epoch_shuffles_each_epoch_and_serves_epochs_in_order(tmp_path):
    indexed, docs = make_corpus(str(tmp_path / "c"), num_docs=20)
    total = sum(len(d) for d in docs)
    ds = GPTDataset(indexed, np.arange(len(docs)), 16, num_samples=(total * 7) // (2 * 16), seed=1)
    assert ds.num_epochs == 4
    doc_index = np.asarray(ds.doc_index)
    orders, position = [], 0
    for e in range(4):  # each epoch: its order of the 20 documents, then a wrap that repeats its start
        order = doc_index[position: position + 20]
        assert sorted(order.tolist()) == list(range(20))
        orders.append(tuple(order))
        rest = doc_index[position + 20:]
        wrap = rest.size if e == 3 else next(w for w in range(1, 21) if sorted(rest[w: w + 20]) == list(range(20)))
        assert (rest[:wrap] == order[:wrap]).all()
        position += 20 + wrap
    assert len(set(orders)) == 4  # each epoch has its own order
    ks = check_windows(ds, docs)
    last_epoch_start = -(-3 * total // 16)
    assert set(range(last_epoch_start)) <= set(ks)  # whole epochs first, then part of the last one
    assert all(k < -(-4 * total // 16) for k in ks)


def test_epoch_shorter_than_a_sample_wraps_around(tmp_path):
    indexed, docs = make_corpus(str(tmp_path / "c"), num_docs=3, seed=5)
    ds = GPTDataset(indexed, np.arange(3), 500, 4, seed=0)
    assert ds.tokens_per_epoch < 500 and ds.num_epochs > 1
    check_windows(ds, docs)


def test_document_subset_uses_only_those_documents(tmp_path):
    indexed, docs = make_corpus(str(tmp_path / "c"))
    subset = np.arange(10, 30)
    ds = GPTDataset(indexed, subset, 8, 30, seed=0)
    assert set(np.asarray(ds.doc_index).tolist()) == set(subset.tolist())
    check_windows(ds, docs, subset)


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
    assert len(files) == 4 and sum(f.endswith(".npy") for f in files) == 3 and files[0].endswith(".json")

    def no_rebuild(*args):
        raise AssertionError("indices rebuilt although cached")

    monkeypatch.setattr(gpt_dataset, "write_gpt_indices", no_rebuild)
    again = GPTDataset(indexed, np.arange(len(docs)), 16, 40, seed=2, cache_dir=str(cache))
    assert all((first[i] == again[i]).all() for i in range(40))
    shorter = GPTDataset(indexed, np.arange(len(docs)), 16, 30, seed=2, cache_dir=str(cache))  # same epochs
    assert all((first[i] == shorter[i]).all() for i in range(30))
    monkeypatch.undo()
    GPTDataset(indexed, np.arange(len(docs)), 16, 40, seed=3, cache_dir=str(cache))
    assert len(list(cache.iterdir())) == 8  # another seed, other files


def test_stale_or_partial_cache_is_rebuilt(tmp_path, monkeypatch):
    prefix = str(tmp_path / "c")
    indexed, docs = make_corpus(prefix)
    cache = str(tmp_path / "cache")
    first = GPTDataset(indexed, np.arange(len(docs)), 16, 40, seed=2, cache_dir=cache)
    calls = []
    real = gpt_dataset.write_gpt_indices
    monkeypatch.setattr(gpt_dataset, "write_gpt_indices", lambda *a: calls.append(1) or real(*a))
    manifest = os.path.join(cache, first._cache_stem() + ".json")
    os.remove(manifest)  # a build that died before its manifest: not used
    GPTDataset(indexed, np.arange(len(docs)), 16, 40, seed=2, cache_dir=cache)
    assert calls == [1] and os.path.exists(manifest)
    shuffle = os.path.join(cache, first._cache_stem() + "_shuffle_index.npy")
    np.save(shuffle, np.zeros(3, dtype=np.int64))  # an array that does not match its manifest
    GPTDataset(indexed, np.arange(len(docs)), 16, 40, seed=2, cache_dir=cache)
    assert calls == [1, 1]
    indexed, docs = make_corpus(prefix, seed=9)  # the data changed: a new key
    changed = GPTDataset(indexed, np.arange(len(docs)), 16, 40, seed=2, cache_dir=cache)
    assert calls == [1, 1, 1] and changed.cache_key != first.cache_key
    check_windows(changed, docs)


def test_build_once_per_node_protocol(tmp_path, monkeypatch):
    """Local rank 0 builds (build_indices=True); the others only load what it wrote, or wait for it."""
    make_corpus(str(tmp_path / "a"), num_docs=80, seed=1)
    make_corpus(str(tmp_path / "b"), num_docs=80, seed=2, first_token=10_000)
    args = (f"0.4 {tmp_path / 'a'} 0.6 {tmp_path / 'b'}", [90, 10, 0], 8, 0, {"train": 50, "valid": 5})
    cache = str(tmp_path / "cache")
    with pytest.raises(TimeoutError, match="local rank 0"):
        build_gpt_datasets(*args, cache, build_indices=False, cache_wait_s=0.2)
    built = build_gpt_datasets(*args, cache, build_indices=True)
    monkeypatch.setattr(gpt_dataset, "write_gpt_indices", None)
    monkeypatch.setattr(gpt_dataset, "blending_index_chunks", None)
    loaded = build_gpt_datasets(*args, cache, build_indices=False, cache_wait_s=0.2)
    for split, n in (("train", 50), ("valid", 5)):
        assert all((built[split][i] == loaded[split][i]).all() for i in range(n))


def test_waiting_rank_sees_the_entry_once_written(tmp_path):
    indexed, docs = make_corpus(str(tmp_path / "c"))
    cache = str(tmp_path / "cache")
    builder = threading.Timer(0.3, lambda: GPTDataset(indexed, np.arange(60), 16, 40, seed=2, cache_dir=cache))
    builder.start()
    waiter = GPTDataset(indexed, np.arange(60), 16, 40, seed=2, cache_dir=cache, build_indices=False,
                        cache_wait_s=30)
    builder.join()
    check_windows(waiter, docs)


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
    monkeypatch.setattr(gpt_dataset, "blending_index_chunks", None)  # a second build must come from the cache
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


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.5, 0.5], [1 / 3, 2 / 3], [0.123, 0.877], [0.9, 0.1]])
def test_two_way_blending_closed_form_equals_the_greedy_loop(weights):
    fast = blending_indices(np.array(weights), 5000)
    three = blending_indices(np.array(weights + [0.0]), 5000)  # the general loop, third dataset never due
    np.testing.assert_array_equal(fast[0], three[0])
    np.testing.assert_array_equal(fast[1], three[1])
