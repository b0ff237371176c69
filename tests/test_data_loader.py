"""Data order as a pure function of (seed, consumed samples), and the prefetching BatchLoader."""

import numpy as np
import pytest
import torch

from megapretrain.data.gpt_dataset import build_gpt_datasets, describe_datasets, format_description
from megapretrain.data.sampler import BatchLoader, collate, micro_batch_ranges

SEQ = 16


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from conftest import write_corpus

    prefix = write_corpus(str(tmp_path_factory.mktemp("loader") / "c"), num_docs=200)
    return build_gpt_datasets([prefix], [1], SEQ, 7, {"train": 400}, None)["train"]


def global_batch(loaders, consumed, gbs):
    """The step's samples as the union of every dp rank's micro-batches, in rank order: (gbs, s + 1)."""
    rows = []
    for loader in loaders:
        for tokens, targets in loader.get(consumed, gbs):
            assert tokens.dtype == targets.dtype == torch.int64 and tokens.shape == (loader.micro_batch_size, SEQ)
            assert torch.equal(tokens[:, 1:], targets[:, :-1])
            rows.append(torch.cat([tokens, targets[:, -1:]], dim=1))
    return torch.cat(rows)


def reference(dataset, start, count):
    return torch.from_numpy(np.stack([dataset[i] for i in range(start, start + count)]))


@pytest.mark.parametrize("dp,micro", [(1, 1), (1, 8), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2)])
def test_same_global_batches_for_any_dp_and_micro_batch(dataset, dp, micro):
    loaders = [BatchLoader(dataset, r, dp, micro, "cpu") for r in range(dp)]
    for step in range(6):
        assert torch.equal(global_batch(loaders, step * 8, 8), reference(dataset, step * 8, 8))
    for loader in loaders:
        loader.close()


def test_resume_at_any_iteration_continues_the_sequence(dataset):
    with BatchLoader(dataset, 0, 1, 4, "cpu") as straight:
        full = [global_batch([straight], step * 8, 8) for step in range(10)]
    for resume_at in (1, 3, 7):
        with BatchLoader(dataset, 1, 2, 2, "cpu") as a, BatchLoader(dataset, 0, 2, 2, "cpu") as b:
            for step in range(resume_at, 10):
                assert torch.equal(global_batch([b, a], step * 8, 8), full[step])


def test_global_batch_size_can_change_mid_run(dataset):
    """A ramp 4, 4, 8, 8, 16: each step takes the next gbs samples; the concatenation is the stream."""
    ramp, consumed, seen = [4, 4, 8, 8, 16], 0, []
    loaders = [BatchLoader(dataset, r, 2, 2, "cpu") for r in range(2)]
    for gbs in ramp:
        seen.append(global_batch(loaders, consumed, gbs))
        consumed += gbs
    assert torch.equal(torch.cat(seen), reference(dataset, 0, consumed))
    for loader in loaders:
        loader.close()
    # resuming in the middle of the ramp with another layout gives the same later batches
    with BatchLoader(dataset, 0, 1, 8, "cpu") as single:
        assert torch.equal(global_batch([single], 8, 8), seen[2])
        assert torch.equal(global_batch([single], 16, 8), seen[3])
        assert torch.equal(global_batch([single], 24, 16), seen[4])


def test_prefetch_serves_the_next_step_and_measures_waiting(dataset, monkeypatch):
    with BatchLoader(dataset, 0, 1, 2, "cpu") as loader:
        loader.get(0, 4)
        assert loader._pending[0] == (4, 4)
        loader._pending[1].result()  # let the prefetch finish
        reads = []
        monkeypatch.setattr(loader, "_read", lambda *key: reads.append(key))
        batches = loader.get(4, 4)  # served from the prefetch: no read in the caller
        assert reads == [] or reads == [(8, 4)]  # only the next prefetch may have been scheduled
        assert len(batches) == 2 and loader.wait_s >= 0 and loader.total_wait_s >= loader.wait_s
    with BatchLoader(dataset, 0, 1, 2, "cpu", prefetch=False) as plain:
        assert torch.equal(plain.get(4, 4)[1][0], batches[1][0])


def test_loader_matches_collate_and_micro_batch_ranges(dataset):
    with BatchLoader(dataset, 1, 2, 2, "cpu") as loader:
        batches = loader.get(8, 8)
    ranges = micro_batch_ranges(8, 8, 2, 1, 2)
    assert [list(r) for r in ranges] == [[12, 13], [14, 15]]
    for (tokens, targets), ids in zip(batches, ranges):
        ref_tokens, ref_targets = collate(dataset, ids, "cpu")
        assert torch.equal(tokens, ref_tokens) and torch.equal(targets, ref_targets)


def test_bad_sizes_and_the_end_of_the_data_are_clear_errors(dataset):
    with BatchLoader(dataset, 0, 2, 3, "cpu") as loader:
        with pytest.raises(ValueError, match="multiple of micro_batch_size=3 x dp=2"):
            loader.get(0, 8)
        with pytest.raises(IndexError, match="dataset has 400"):
            loader.get(396, 12)
    with pytest.raises(ValueError, match="dp_rank=2"):
        BatchLoader(dataset, 2, 2, 1, "cpu")


def test_describe_reports_tokens_per_prefix(tmp_path):
    from megapretrain.data.indexed_dataset import IndexedDataset

    from conftest import write_corpus

    a = write_corpus(str(tmp_path / "a"), num_docs=100, seed=1)
    b = write_corpus(str(tmp_path / "b"), num_docs=50, seed=2)
    datasets = build_gpt_datasets(f"0.3 {a} 0.7 {b}", [90, 10, 0], SEQ, 0, {"train": 100, "valid": 10}, None)
    rows = describe_datasets(datasets)
    assert [(r["split"], r["prefix"]) for r in rows] == [("train", a), ("train", b), ("valid", a), ("valid", b)]
    for row in rows:
        ds = IndexedDataset(row["prefix"])
        docs = {"train": np.arange(int(round(0.9 * len(ds)))), "valid": np.arange(int(round(0.9 * len(ds))), len(ds))}
        assert row["documents"] == docs[row["split"]].size
        assert row["tokens"] == int(ds.sequence_lengths[docs[row["split"]]].sum())
    assert [r["weight"] for r in rows[:2]] == [0.3, 0.7]
    assert sum(r["samples"] for r in rows[:2]) == 100 and sum(r["samples"] for r in rows[2:]) == 10
    text = format_description(rows)
    assert len(text.splitlines()) == 4 and "weight 0.3000" in text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batches_are_pinned_and_equal_to_cpu(dataset):
    with BatchLoader(dataset, 0, 2, 2, "cuda") as gpu, BatchLoader(dataset, 0, 2, 2, "cpu") as cpu:
        assert gpu.pin and all(b.is_pinned() for b in gpu._read(0, 8))
        for step in range(3):
            for (gt, gy), (ct, cy) in zip(gpu.get(step * 8, 8), cpu.get(step * 8, 8)):
                assert gt.is_cuda and torch.equal(gt.cpu(), ct) and torch.equal(gy.cpu(), cy)


def test_datasets_pickle_without_copying_the_tokens(dataset):
    import pickle

    blob = pickle.dumps(dataset)
    clone = pickle.loads(blob)
    assert all((clone[i] == dataset[i]).all() for i in range(0, 400, 37))
    assert len(blob) < dataset.indexed.tokens.nbytes  # the .bin is re-mapped, not copied

