"""The data path at the sizes of long runs, on small data: the compiled blend index against the
reference loop (and megatron-core's helper), indices streamed to the cache and mapped rather than
held (an epoch built in chunks, bit for bit the whole-epoch build, under a memory cap), and ranks
waiting for the builder with its progress."""

from __future__ import annotations

import glob
import importlib.util
import json
import mmap
import os
import subprocess
import sys
import threading
import tracemalloc

import numpy as np
import pytest

from megapretrain.data import blending, gpt_dataset, index_cache
from megapretrain.data.blending import greedy_blend, greedy_blend_chunks, greedy_blend_reference
from megapretrain.data.gpt_dataset import (
    BlendedDataset,
    GPTDataset,
    build_gpt_indices,
    epochs_for,
    index_bytes,
)

from helpers import ROOT, lengths_only_prefix, make_corpus, whole_epoch_gpt_indices


def blend_weights():
    """Weights with ties (equal and dyadic), a tiny one, and random ones; 3 to 300 datasets (the
    compiled loop scans up to 20 in one pass, up to 128 in two, and bounds blocks of 16 beyond)."""
    rng = np.random.default_rng(0)
    cases = [np.ones(5), np.array([0.5, 0.25, 0.25]), 2.0 ** -rng.integers(0, 4, 37),
             np.concatenate([rng.random(20), [1e-6]]), rng.lognormal(0, 2, 70), rng.random(3),
             np.ones(150), 2.0 ** -rng.integers(0, 4, 200), rng.random(300),
             np.concatenate([rng.lognormal(0, 2, 250), [1e-6]]), 2.0 ** -rng.integers(0, 4, 20),
             rng.random(10)]
    return [w / w.sum() for w in cases]


@pytest.mark.parametrize("weights", blend_weights(), ids=lambda w: f"{w.size}_datasets")
def test_compiled_blend_equals_the_python_loop(weights):
    """The compiled loop (blocks skipped by their bounds) chooses exactly as a full scan in Python,
    whole or in chunks that carry its state over."""
    expected = greedy_blend_reference(weights, 4000)
    whole = greedy_blend(weights, 4000)
    chunks = list(zip(*greedy_blend_chunks(weights, 4000, 777)))
    # From sample 1500 on, given the counts before it: the loop's bounds start over.
    counts = np.bincount(expected[0][:1500], minlength=weights.size)
    later = list(zip(*greedy_blend_chunks(weights, 4000, 777, start=1500, counts=counts)))
    resumed = [np.concatenate([expected[k][:1500], *later[k]]) for k in (0, 1)]
    reference = greedy_blend_reference(weights, 4000, start=1500, counts=counts)
    for got in (whole, (np.concatenate(chunks[0]), np.concatenate(chunks[1])), resumed,
                [np.concatenate([expected[k][:1500], reference[k]]) for k in (0, 1)]):
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])
    assert whole[0].dtype == np.int16 and whole[1].dtype == np.int64


def test_blend_equals_megatron_cores_helper_with_its_targets():
    """Megatron's helper targets weight * max(i, 1) where this project targets weight * (i + 1);
    given its targets, the compiled loop gives its indices bit for bit."""
    helpers = megatron_blend_helper()
    for weights in blend_weights():
        index = np.zeros(5000, dtype=np.int16)
        sample = np.zeros(5000, dtype=np.int64)
        helpers.build_blending_indices(index, sample, weights, weights.size, 5000, False)
        ours = greedy_blend(weights, 5000, offset=0)
        np.testing.assert_array_equal(ours[0], index)
        np.testing.assert_array_equal(ours[1], sample)


def megatron_blend_helper():
    """megatron-core's compiled dataset helpers, loaded from their file alone (importing
    megatron.core takes seconds); skips the test where megatron-core is not installed."""
    spec = importlib.util.find_spec("megatron")
    found = glob.glob(os.path.join(spec.submodule_search_locations[0], "core", "datasets",
                                   "helpers_cpp*.so")) if spec else []
    if not found:
        pytest.skip("megatron-core's compiled helpers are not installed")
    module = importlib.util.module_from_spec(
        importlib.util.spec_from_file_location("helpers_cpp", found[0]))
    module.__spec__.loader.exec_module(module)
    return module


def test_blend_without_a_compiler_says_so_and_gives_the_same_order(monkeypatch, tmp_path, caplog):
    weights = blend_weights()[2]
    compiled = greedy_blend(weights, 2000)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(blending, "_library", False)
    with caplog.at_level("WARNING"):
        fallback = greedy_blend(weights, 2000)
    assert "no working C compiler" in caplog.text
    np.testing.assert_array_equal(fallback[0], compiled[0])
    np.testing.assert_array_equal(fallback[1], compiled[1])


def file_backed(arr: np.ndarray) -> bool:
    """Whether the array's memory is a mapped file (not memory this process allocated)."""
    while arr is not None and not isinstance(arr, mmap.mmap):
        arr = getattr(arr, "base", None)
    return isinstance(arr, mmap.mmap)


def epoch_cases():
    """(lengths, document ids, seq_length, samples): several epochs with a partial last one,
    ids that are not a range, an epoch shorter than a sample, empty documents at the start."""
    rng = np.random.default_rng(5)
    lengths = rng.integers(0, 50, 400).astype(np.int32)
    lengths[rng.random(400) < 0.2] = 0
    empty_first = lengths.copy()
    empty_first[:300] = 0
    return [(lengths, range(400), 16, 3 * int(lengths.sum()) // 16 + 7),
            (lengths, np.sort(rng.choice(400, 150, replace=False)), 8, 900),
            (lengths[:6], range(6), 256, 5),
            (empty_first, range(20, 400), 32, 200)]


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("case", range(4))
def test_an_epoch_built_in_chunks_equals_the_whole_epoch_build(case, chunk):
    """However small the chunk, the three arrays equal (values and dtypes) the build that held
    each epoch whole, which the cache entries of earlier runs were written by."""
    lengths, ids, seq, samples = epoch_cases()[case]
    epochs = epochs_for(samples, int(lengths[np.asarray(ids)].sum()), seq)
    expected = whole_epoch_gpt_indices(lengths, ids, seq, epochs, seed=case)
    built = build_gpt_indices(lengths, ids, seq, epochs, case, chunk=chunk)
    for name, array in expected.items():
        assert built[name].dtype == array.dtype, name
        np.testing.assert_array_equal(built[name], array, err_msg=name)


def test_cache_files_do_not_depend_on_the_chunk(tmp_path, monkeypatch):
    """A blend of three prefixes with cache entries of a few epochs: built seven documents or
    samples at a time, every cache file is byte for byte the one a build of whole epochs writes
    (one chunk each), each prefix's index is the whole-epoch build's, and so are the samples."""
    prefixes = [str(tmp_path / name) for name in "abc"]
    for k, prefix in enumerate(prefixes):
        make_corpus(prefix, num_docs=40 + 15 * k, seed=k, first_token=1 + 1000 * k)
    args = (f"0.5 {prefixes[0]} 0.3 {prefixes[1]} 0.2 {prefixes[2]}", [90, 10, 0], 8, 0,
            {"train": 2000, "valid": 30})
    monkeypatch.setattr(gpt_dataset, "EPOCH_GROUP_SAMPLES", 100)
    files = {}
    for chunk in (7, gpt_dataset.INDEX_CHUNK):
        monkeypatch.setattr(gpt_dataset, "INDEX_CHUNK", chunk)
        cache = str(tmp_path / f"cache_{chunk}")
        datasets = gpt_dataset.build_gpt_datasets(*args, cache)
        samples = [datasets["train"][i] for i in range(2000)]
        files[chunk] = {f: open(os.path.join(cache, f), "rb").read() for f in os.listdir(cache)}
    assert files[7] == files[gpt_dataset.INDEX_CHUNK] and len(files[7]) > 20
    for part in datasets["train"].datasets:
        ids, lengths = part.document_ids, part.indexed.sequence_lengths
        expected = whole_epoch_gpt_indices(lengths, ids, 8, part.num_epochs, 0)
        np.testing.assert_array_equal(part.doc_index, expected["doc_index"])
        np.testing.assert_array_equal(part.sample_index, expected["sample_index"])
        np.testing.assert_array_equal(part.shuffle_index,
                                      expected["shuffle_index"][: part.num_samples])
    whole = gpt_dataset.build_gpt_datasets(*args, None)["train"]
    for i in (0, 1, 999, 1999):
        np.testing.assert_array_equal(samples[i], whole[i])


CAPPED_BUILD = """
import json, resource, sys
from megapretrain.data import gpt_dataset
from megapretrain.data.indexed_dataset import IndexedDataset
from helpers import whole_epoch_gpt_indices

prefix, cache, samples, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
gpt_dataset.INDEX_CHUNK = 1 << 13
indexed = IndexedDataset(prefix)
data = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmData"))
# private memory (heap, anonymous maps: every numpy array) capped; mapped files are not counted
resource.setrlimit(resource.RLIMIT_DATA, (1024 * data + budget, resource.RLIM_INFINITY))
ds = gpt_dataset.GPTDataset(indexed, range(len(indexed)), 32, samples, seed=1, cache_dir=cache)
ds[samples - 1]  # builds the second (last) epoch
try:
    whole_epoch_gpt_indices(indexed.sequence_lengths, range(len(indexed)), 32, 2, 1)
    whole = "built"
except MemoryError:
    whole = "MemoryError"
print(json.dumps({"epochs": ds.num_epochs, "entries": len(ds._groups), "whole": whole}))
"""


def test_an_epoch_is_built_under_a_memory_cap(tmp_path):
    """Two epochs of 1.6M samples over 1M documents built into the cache with 24 MiB of private
    memory (RLIMIT_DATA) allowed beyond the process's start: the whole-epoch build (~100 MiB)
    fails under the same cap, the streamed one succeeds and equals it bit for bit."""
    lengths = np.random.default_rng(0).integers(1, 100, 1_000_000).astype(np.int32)
    prefix, cache = str(tmp_path / "big"), str(tmp_path / "cache")
    lengths_only_prefix(prefix, lengths)
    samples = int(1.5 * lengths.sum(dtype=np.int64)) // 32
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    proc = subprocess.run([sys.executable, "-c", CAPPED_BUILD, prefix, cache, str(samples),
                           str(24 << 20)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"epochs": 2, "entries": 2, "whole": "MemoryError"}, report
    from megapretrain.data.indexed_dataset import IndexedDataset

    mapped = GPTDataset(IndexedDataset(prefix), range(len(lengths)), 32, samples, seed=1,
                        cache_dir=cache, build_indices=False, cache_wait_s=1.0)
    expected = whole_epoch_gpt_indices(lengths, range(len(lengths)), 32, 2, 1)
    np.testing.assert_array_equal(mapped.doc_index, expected["doc_index"])
    np.testing.assert_array_equal(mapped.sample_index, expected["sample_index"])
    np.testing.assert_array_equal(mapped.shuffle_index, expected["shuffle_index"][:samples])


def test_indices_are_streamed_to_the_cache_and_mapped(tmp_path, monkeypatch):
    """A 100-epoch index (~16 MB) in entries of whole epochs (at least 20k samples each): the
    first built at construction holding about one epoch (numpy's allocations, traced), the others
    as the samples are read, the builder an entry ahead; every entry is read from its mapped
    files, and the arrays and samples are those of the in-memory build of the whole index."""
    monkeypatch.setattr(gpt_dataset, "EPOCH_GROUP_SAMPLES", 20_000)
    indexed, docs = make_corpus(str(tmp_path / "c"), num_docs=2000, seed=4)
    seq, samples = 16, 100 * int(indexed.sequence_lengths.sum()) // 16
    epochs = epochs_for(samples, int(indexed.sequence_lengths.sum()), seq)
    kept, epoch = index_bytes(len(docs), seq, samples, epochs)
    tracemalloc.start()
    ds = GPTDataset(indexed, np.arange(len(docs)), seq, samples, seed=3,
                    cache_dir=str(tmp_path / "cache"))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < kept / 8 and peak < 4 * epoch, (peak, kept, epoch)
    assert len(ds._groups) == 1 and ds.num_groups > 3
    middle = ds._first_sample(2 * ds.group_epochs)  # the first sample of the third entry
    ds[middle]
    assert len(ds._groups) == 4
    in_memory = GPTDataset(indexed, np.arange(len(docs)), seq, samples, seed=3)
    for i in range(0, samples, 97):
        np.testing.assert_array_equal(ds[i], in_memory[i])
    assert all(file_backed(a) for group in ds._groups for a in group)
    expected = build_gpt_indices(indexed.sequence_lengths, np.arange(len(docs)), seq, epochs, 3)
    for name in expected:
        np.testing.assert_array_equal(getattr(ds, name), expected[name][: len(getattr(ds, name))])
        np.testing.assert_array_equal(getattr(in_memory, name), getattr(ds, name))


class Component:
    """A stand-in blend component: only its size and cache key matter to the blend index."""

    def __init__(self, n, key):
        self.n, self.cache_key, self.name = n, key, key

    def __len__(self):
        return self.n

    def __getitem__(self, j):
        return self.name, j

    def reserve(self, num_samples):
        assert num_samples <= self.n


def test_blend_index_is_streamed_to_the_cache_and_mapped(tmp_path, monkeypatch):
    """A 2M-sample blend of 40 datasets (20 MB of index) built 64k samples at a time: the builder
    holds a few chunks, and the index it keeps is the mapped file."""
    monkeypatch.setattr(gpt_dataset, "BLEND_CHUNK", 1 << 16)
    weights = np.random.default_rng(1).random(40)
    n = 2_000_000
    parts = [Component(int(w / weights.sum() * n) + 2, f"k{i}") for i, w in enumerate(weights)]
    tracemalloc.start()
    blend = BlendedDataset(parts, weights, n, seed=0, cache_dir=str(tmp_path))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 10 * n / 8, peak
    assert file_backed(blend.dataset_index) and file_backed(blend.dataset_sample_index)
    expected = greedy_blend(weights / weights.sum(), n)
    np.testing.assert_array_equal(blend.dataset_index, expected[0])
    np.testing.assert_array_equal(blend.dataset_sample_index, expected[1])


@pytest.mark.parametrize("num_datasets", [1, 2, 5, 200])
def test_blend_index_is_built_as_the_run_reads_it(tmp_path, monkeypatch, num_datasets):
    """Segments of 1,000 samples: construction builds the first two, reading a sample builds the
    next; the samples equal the whole index built at once (closed forms for 1 and 2 datasets,
    the compiled loop's scan and its blocks), in the cache or in memory, and a waiting rank's
    samples are the builder's."""
    monkeypatch.setattr(gpt_dataset, "BLEND_SEGMENT", 1000)
    monkeypatch.setattr(gpt_dataset, "BLEND_CHUNK", 300)
    weights = np.random.default_rng(num_datasets).lognormal(0, 1, num_datasets)
    weights /= weights.sum()
    n = 5500
    parts = [Component(int(w * n) + 2, f"k{i}") for i, w in enumerate(weights)]
    expected = gpt_dataset.blending_indices(weights, n)
    cache = str(tmp_path / "cache")

    def built():
        return sorted(f for f in os.listdir(cache) if f.startswith("blend_") and f.endswith(".json"))

    blend = BlendedDataset(parts, weights, n, seed=0, cache_dir=cache)
    assert len(built()) == 2
    waiting = BlendedDataset(parts, weights, n, seed=0, cache_dir=cache, build_indices=False)
    in_memory = BlendedDataset(parts, weights, n, seed=0)
    assert blend[2500] == (f"k{expected[0][2500]}", expected[1][2500]) and len(built()) == 4
    for dataset in (blend, waiting, in_memory):
        got = [dataset[i] for i in range(n)]
        assert got == [(f"k{d}", j) for d, j in zip(expected[0], expected[1])]
    assert len(built()) == 6  # [5000, 5500): the last is cut at the run's end
    np.testing.assert_array_equal(blend.dataset_index, expected[0])
    np.testing.assert_array_equal(blend.dataset_sample_index, expected[1])
    assert blend._draws().tolist() == np.bincount(expected[0], minlength=num_datasets).tolist()


def test_blend_of_prefixes_builds_what_the_run_reads_with_the_samples_of_a_whole_build(tmp_path,
                                                                                    monkeypatch):
    """Three prefixes, blend segments of 300 samples, sample index entries of at least 40: at
    construction only the entries the first two segments draw from exist; read to the end by the
    builder and by a waiting rank, every sample equals a build of each index whole at once."""
    prefixes = [str(tmp_path / name) for name in "abc"]
    for k, prefix in enumerate(prefixes):
        make_corpus(prefix, num_docs=30 + 10 * k, seed=k, first_token=1 + 1000 * k)
    args = (f"0.5 {prefixes[0]} 0.3 {prefixes[1]} 0.2 {prefixes[2]}", [90, 10, 0], 8, 0,
            {"train": 1500, "valid": 20})
    whole = gpt_dataset.build_gpt_datasets(*args, None)["train"]
    assert len(whole._segments) == 1 and all(len(d._groups) == 1 for d in whole.datasets)
    monkeypatch.setattr(gpt_dataset, "BLEND_SEGMENT", 300)
    monkeypatch.setattr(gpt_dataset, "EPOCH_GROUP_SAMPLES", 40)
    cache = str(tmp_path / "cache")
    built = gpt_dataset.build_gpt_datasets(*args, cache)["train"]
    assert len(built._segments) == 2
    for dataset, count in zip(built.datasets, built._segments[1][2]):
        assert dataset._groups and len(dataset._groups) == dataset._group_of(int(count) - 1) + 1
        assert len(dataset._groups) < dataset.num_groups
    waiting = gpt_dataset.build_gpt_datasets(*args, cache, build_indices=False)["train"]
    for i in range(1500):
        expected = whole[i]
        np.testing.assert_array_equal(built[i], expected)
        np.testing.assert_array_equal(waiting[i], expected)


def test_waiting_rank_prints_the_builders_progress(tmp_path, monkeypatch, capsys):
    """A rank waiting for the entry prints how far the builder is and about how long is left, and
    keeps waiting past its timeout while the builder reports progress."""
    monkeypatch.setattr(index_cache, "WAIT_LOG_S", 0.05)
    monkeypatch.setattr(index_cache, "PROGRESS_S", 0.0)
    cache, half_seen = str(tmp_path), threading.Event()

    def build(open_array, report):
        sink = open_array("a", np.int32)
        sink.append(np.arange(5, dtype=np.int32))
        report(0.5)
        while not half_seen.wait(0.05):  # keeps reporting, as a long build does
            report(0.5)
        sink.append(np.arange(5, 10, dtype=np.int32))

    def builder():
        index_cache.cached_or_built(cache, "entry", "key", ("a",), build, True, 0.0)

    thread = threading.Thread(target=builder)
    thread.start()
    try:
        seen = []

        def watch(*args, **kwargs):  # release the builder once a waiter printed its progress
            seen.append(" ".join(map(str, args)))
            if "50% after" in seen[-1] and "s left" in seen[-1]:
                half_seen.set()

        monkeypatch.setattr("builtins.print", watch)
        arrays = index_cache.load_indices(cache, "entry", "key", ("a",), wait_s=0.2)
    finally:
        half_seen.set()
        thread.join()
    np.testing.assert_array_equal(arrays["a"], np.arange(10))
    assert file_backed(arrays["a"]) or arrays["a"].size == 0
    assert any("waiting for the data index: entry is being built by pid" in s for s in seen)
