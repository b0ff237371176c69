#!/usr/bin/env python
"""Benchmarks of the data path: preprocessing throughput and memory, index build time, sample reads.

    python tools/bench_data.py preprocess --corpus corpus.jsonl --tokenizer-type GPT2BPETokenizer \\
        --tokenizer-model gpt2/ --workers 1 2 --repeats 3 [--verify-gpt2]
    python tools/bench_data.py memory --big-gb 2 [tokenizer flags]     # peak memory on a generated input
    python tools/bench_data.py index [--megatron]                       # 1M x 2048 and a 10B-token description
    python tools/bench_data.py reads [--samples 200000]                 # random 2049-token samples/s, one core
    python tools/bench_data.py verify [--tokens 500000000]              # the trainer's check of a dataset
    python tools/bench_data.py blend --prefixes 10 100 1000 --samples 1e6 1e7 1e8 [--megatron]
    python tools/bench_data.py startup --prefixes 1000 --train-tokens 1e11    # indices of a large blend

Each section prints one line per measurement with the machine load (1-minute load average and core
count), because these machines are shared: compare numbers taken under similar load. Every file a
section makes lives in a temporary directory that is deleted at the end, generated inputs included.
Preprocessing runs tools/preprocess_data.py as a child process, so its start-up is counted; its
peak memory is the largest sum of the proportional set sizes (PSS: shared pages split between the
processes sharing them) of the process tree, sampled every 20 ms, and the largest single RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
import warnings
from collections.abc import Iterator

import _tool  # noqa: F401  (the package installed, or one line saying how)
import numpy as np

from megapretrain.cli import ToolParser, positive_float, positive_int, user_errors
from megapretrain.data.gpt_dataset import GPTDataset, build_gpt_indices, epochs_for
from megapretrain.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def load() -> str:
    return f"load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"


# -- preprocessing ------------------------------------------------------------------------------------

def _tree_memory(pid: int) -> tuple[int, int]:
    """(sum of PSS, largest RSS) in bytes of ``pid`` and its descendants, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    pss = rss = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line and not line.startswith("0"))
            pss += int(fields["Pss"].split()[0]) * 1024
            rss = max(rss, int(fields["Rss"].split()[0]) * 1024)
        except (OSError, KeyError, ValueError):
            continue
    return pss, rss


def run_preprocess(argv: list[str], sample_memory: bool) -> dict:
    """Run tools/preprocess_data.py; wall time, its summary line, and peak memory of its process tree."""
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "megapretrain.commands.preprocess_data", *argv,
                              "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak_pss = peak_rss = 0
    while child.poll() is None:
        if sample_memory:
            pss, rss = _tree_memory(child.pid)
            peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
        time.sleep(0.02)
    out, err = child.communicate()
    wall = time.perf_counter() - start
    if child.returncode != 0:
        raise RuntimeError(f"preprocess_data.py failed ({child.returncode}): {err.strip()[-500:]}")
    return {"wall_s": wall, "out": out.strip(), "peak_pss": peak_pss, "peak_rss": peak_rss}


def tokenizer_flags(args) -> list[str]:
    flags = ["--tokenizer-type", args.tokenizer_type]
    for name in ("tokenizer_model", "vocab_file", "merge_file"):
        if getattr(args, name):
            flags += ["--" + name.replace("_", "-"), getattr(args, name)]
    return flags


def bench_preprocess(args) -> None:
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        corpus = args.corpus
        if corpus is None:
            corpus = os.path.join(tmp, "corpus.jsonl")
            subprocess.run([sys.executable, "-m", "megapretrain.commands.build_demo_corpus", "--output", corpus],
                           check=True, capture_output=True)
        size = os.path.getsize(corpus)
        print(f"corpus {corpus}: {size / 1e6:.1f} MB")
        for workers in args.workers:
            for threads in args.tokenizer_threads:
                runs = []
                for r in range(args.repeats):
                    prefix = os.path.join(tmp, f"out_w{workers}_t{threads}")
                    runs.append(run_preprocess(["--input", corpus, "--output-prefix", prefix, *tokenizer_flags(args),
                                                "--append-eod", "--workers", str(workers), "--tokenizer-threads",
                                                str(threads), "--overwrite"], sample_memory=r == 0))
                    print(f"  run {r + 1}: {runs[-1]['wall_s']:.2f} s wall ({load()})", flush=True)
                summary = json.load(open(prefix + "_text_document.summary.json"))
                wall = float(np.median([run["wall_s"] for run in runs]))
                print(f"{args.tokenizer_type} workers={workers} tokenizer-threads={threads}: median {wall:.2f} s wall "
                      f"(start-up included) over {len(runs)} runs, {summary['documents']:,} docs, "
                      f"{summary['tokens']:,} tokens, {summary['tokens'] / wall:,.0f} tokens/s, "
                      f"{size / 1e6 / wall:.1f} MB/s, peak memory {runs[0]['peak_pss'] / 2**20:.0f} MiB PSS "
                      f"(largest process {runs[0]['peak_rss'] / 2**20:.0f} MiB RSS)", flush=True)
        if args.verify_gpt2:
            verify_gpt2(corpus, prefix + "_text_document", args)


def verify_gpt2(corpus: str, prefix: str, args) -> None:
    """Every document of ``prefix`` against the `tokenizers` implementation of the same GPT-2 files."""
    from megapretrain.data.tokenizers import GPT2BPETokenizer

    reference = GPT2BPETokenizer(args.tokenizer_model, args.vocab_file, args.merge_file, backend="tokenizers")
    ds = IndexedDataset(prefix)
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    texts = [t for t in texts if t]
    expected = reference.tokenize_batch(texts)
    mismatches = sum(not np.array_equal(ds[i][:-1], expected[i]) or ds[i][-1] != reference.eod
                     for i in range(len(texts)))
    total = sum(e.size + 1 for e in expected)
    print(f"verify: {len(texts):,} documents, {total:,} tokens vs the `tokenizers` GPT-2 BPE: "
          f"{'token-identical' if mismatches == 0 and len(ds) == len(texts) else f'{mismatches} documents differ'}")


def bench_memory(args) -> None:
    """Preprocess a generated JSON-lines input of ``--big-gb`` GB and report peak memory."""
    target = int(args.big_gb * 1e9)
    with tempfile.TemporaryDirectory(prefix="bench_data_big_", dir=args.tmp_dir) as tmp:
        corpus = os.path.join(tmp, "big.jsonl")
        rng = np.random.default_rng(0)
        words = np.array("the of and to in is for on that with as by this be from at are it an or not have has "
                         "def return import class self value index tensor rank batch layer model data".split())
        written, start = 0, time.perf_counter()
        with open(corpus, "w", encoding="utf-8") as f:
            while written < target:
                lengths = rng.integers(20, 4000, 256)  # words per document
                pool = rng.choice(words, int(lengths.sum()))
                bounds = np.concatenate([[0], np.cumsum(lengths)])
                lines = "".join(json.dumps({"text": " ".join(pool[bounds[i]:bounds[i + 1]])}) + "\n"
                                for i in range(len(lengths)))
                f.write(lines)
                written += len(lines)
        print(f"generated {written / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s", flush=True)
        result = run_preprocess(["--input", corpus, "--output-prefix", os.path.join(tmp, "big"), *tokenizer_flags(args),
                                 "--append-eod", "--workers", str(args.workers[0])], sample_memory=True)
        print(f"{args.tokenizer_type} workers={args.workers[0]} on {written / 1e9:.2f} GB: {result['wall_s']:.0f} s, "
              f"peak memory {result['peak_pss'] / 2**20:.0f} MiB PSS summed over the process tree, largest "
              f"process {result['peak_rss'] / 2**20:.0f} MiB RSS ({load()})\n  {result['out']}")
    print("deleted the generated input and its output")


# -- indices ------------------------------------------------------------------------------------------

def synthetic_lengths(tokens: int, seed: int = 0) -> np.ndarray:
    """Document lengths uniform in [1, 2047] (mean ~1024) adding up to about ``tokens``."""
    return np.random.default_rng(seed).integers(1, 2048, max(1, tokens // 1024)).astype(np.int32)


def bench_index(args) -> None:
    megatron = None
    if args.megatron:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                from megatron.core.datasets import helpers
                from megatron.core.datasets.gpt_dataset import _build_document_index, _build_shuffle_index
                megatron = (helpers, _build_document_index, _build_shuffle_index)
            except ImportError:
                print("megatron-core is not installed: only our build is timed")
    seq = 2048
    cases = [("1M samples x 2048 tokens", 1_000_000 * seq + 1, 1_000_000),
             ("10B-token dataset, one epoch", 10_000_000_000, None)]
    for name, tokens, samples in cases:
        lengths = synthetic_lengths(tokens)
        total = int(lengths.sum(dtype=np.int64))
        samples = samples or total // seq
        epochs = epochs_for(samples, total, seq)
        ids = np.arange(lengths.size, dtype=np.int64)
        ours, theirs = [], []
        for _ in range(args.repeats):  # interleaved, so both see the same load
            start = time.perf_counter()
            build_gpt_indices(lengths, ids, seq, epochs, 1234)
            ours.append(time.perf_counter() - start)
            if megatron:
                helpers, document_index, shuffle_index = megatron
                start = time.perf_counter()
                state = np.random.RandomState(1234)
                doc = document_index(ids.astype(np.int32), epochs, state, False)
                sample = helpers.build_sample_idx(lengths, doc, seq, epochs, total, True, True)
                shuffle_index(sample.shape[0] - 1, sample.shape[0] - 1, state)
                theirs.append(time.perf_counter() - start)
        line = (f"index build, {name}: {lengths.size:,} documents, {total:,} tokens, {samples:,} samples, "
                f"{epochs} epoch(s): ours best {min(ours):.3f} s / median {np.median(ours):.3f} s")
        if theirs:
            line += f"; megatron-core best {min(theirs):.3f} s / median {np.median(theirs):.3f} s"
        print(f"{line} ({load()})", flush=True)


# -- blend index -------------------------------------------------------------------------------------

def megatron_blend_helper():
    """megatron-core's compiled build_blending_indices, or None where it is not installed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from megatron.core.datasets import helpers_cpp
        except ImportError:
            return None
    return helpers_cpp.build_blending_indices


def traced(run, *args, **kwargs):
    """(seconds, peak bytes numpy allocated) of ``run(*args, **kwargs)`` (numpy reports its arrays
    to tracemalloc, megatron-core's helper fills numpy arrays: both are counted the same way)."""
    tracemalloc.start()
    start = time.perf_counter()
    run(*args, **kwargs)
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return seconds, peak


def megatron_blend(helper, weights: np.ndarray, n: int) -> None:
    """megatron-core's blend index, allocated as its BlendedDataset does."""
    index = np.zeros(n, dtype=np.int16)
    sample = np.zeros(n, dtype=np.int64)
    helper(index, sample, weights, weights.size, n, False)


def bench_blend(args) -> None:
    """The blend index for each prefix count and sample count: ours in memory, ours streamed to a
    cache file in chunks, and megatron-core's C++ helper, on the same weights."""
    from megapretrain.data.blending import greedy_blend
    from megapretrain.data.gpt_dataset import BlendedDataset

    helper = megatron_blend_helper() if args.megatron else None
    if args.megatron and helper is None:
        print("megatron-core is not installed: only ours is timed")

    class Component:  # all the blend needs of a dataset: a size and a cache key
        def __init__(self, n, key):
            self.n, self.cache_key = n, key

        def __len__(self):
            return self.n

        def reserve(self, num_samples):
            pass

    def streamed(parts, weights, n, cache):  # the whole index, segment by segment
        BlendedDataset(parts, weights, n, 0, cache_dir=cache).reserve(n)

    for prefixes in args.prefixes:
        rng = np.random.default_rng(0)
        weights = np.ones(prefixes) if args.equal else rng.random(prefixes)
        weights /= weights.sum()
        for n in (int(s) for s in args.samples):
            line = [f"blend of {prefixes} prefixes ({'equal' if args.equal else 'uniform random'} "
                    f"weights), {n:,} samples:"]
            seconds, peak = traced(greedy_blend, weights, n)
            line.append(f"ours {seconds:.2f} s, peak {peak / 2**20:,.0f} MiB")
            with tempfile.TemporaryDirectory(prefix="bench_blend_", dir=args.tmp_dir) as tmp:
                parts = [Component(int(w * n) + 2, f"c{i}") for i, w in enumerate(weights)]
                seconds, peak = traced(streamed, parts, weights, n, tmp)
            line.append(f"ours streamed to a cache file {seconds:.2f} s, peak {peak / 2**20:,.0f} MiB")
            if helper is not None:
                seconds, peak = traced(megatron_blend, helper, weights, n)
                line.append(f"megatron-core {seconds:.2f} s, peak {peak / 2**20:,.0f} MiB")
            print(" ".join(line[:1]) + " " + "; ".join(line[1:]) + f" ({load()})", flush=True)


# -- start-up of a large blend -------------------------------------------------------------------------

def lengths_only_prefix(prefix: str, lengths, dtype=np.uint16) -> None:
    """A dataset prefix whose .idx holds ``lengths`` (an array, or an iterable of arrays: its
    blocks, in order) and whose .bin is a sparse file of the right size (all-zero tokens, no disk
    blocks): what index building reads, at no cost in disk."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    tokens = 0
    for block in [lengths] if isinstance(lengths, np.ndarray) else lengths:
        builder._write_lengths(block)  # the index only: no tokens are written
        builder._docs_file.write((1 + builder.document_count
                                  + np.arange(block.size, dtype=np.int64)).tobytes())
        builder.document_count += block.size
        tokens += int(block.sum(dtype=np.int64))
    builder.finalize(prefix + ".idx")
    os.truncate(prefix + ".bin", tokens * np.dtype(dtype).itemsize)


def synthetic_prefix_lengths(rng: np.random.Generator, documents: int,
                             block: int = 1 << 24) -> Iterator[np.ndarray]:
    """Document lengths of 1-2047 tokens, ``documents`` of them, made block by block as they are
    written (a prefix of 10^8 documents is made holding one block of ``block``)."""
    if documents <= block:
        yield rng.integers(1, 2048, documents).astype(np.int32)
        return
    for i in range(0, documents, block):
        yield rng.integers(1, 2048, min(block, documents - i), dtype=np.int32)


def first_sample(prefixes: list[str], seq: int, samples: int, cache: str) -> None:
    """The datasets of a run over ``prefixes`` (split 99/1/0, 10 x 2048 valid samples), then the
    first training sample: what start-up does before the first step reads data."""
    from megapretrain.data.gpt_dataset import build_gpt_datasets

    datasets = build_gpt_datasets(prefixes, [99, 1, 0], seq, 1234,
                                  {"train": samples, "valid": 10 * 2048}, cache)
    datasets["train"][0]


def bench_startup(args) -> None:
    """What a run's start-up spends on data: ``build_gpt_datasets`` over ``--prefixes`` prefixes
    (token-weighted, split 99/1/0) for ``--train-tokens`` at ``--seq-length``, first with an empty
    cache (building every index) and again from the cache, with the first sample read."""
    seq = args.seq_length
    samples = int(args.train_tokens) // seq
    with tempfile.TemporaryDirectory(prefix="bench_startup_", dir=args.tmp_dir) as tmp:
        rng = np.random.default_rng(0)
        prefixes = []
        start = time.perf_counter()
        for p in range(args.prefixes):
            prefix = os.path.join(tmp, f"p{p:04d}")
            # documents of 1-2047 tokens, as many per prefix as --documents (sizes differ)
            lengths = synthetic_prefix_lengths(rng, int(args.documents * rng.uniform(0.5, 1.5)))
            lengths_only_prefix(prefix, lengths)
            prefixes.append(prefix)
        print(f"made {args.prefixes} prefixes (index files, sparse .bin) in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
        cache = os.path.join(tmp, "cache")
        for what in ("empty cache", "from the cache"):
            cpu = time.process_time()  # this process's CPU time: a loaded machine's wall time is not
            seconds, peak = traced(first_sample, prefixes, seq, samples, cache)
            cpu = time.process_time() - cpu
            size = sum(os.path.getsize(os.path.join(cache, f)) for f in os.listdir(cache))
            print(f"start-up data, {args.prefixes} prefixes, {samples:,} train samples of {seq} "
                  f"tokens ({samples * seq:.3g} tokens), {what}: {seconds:.1f} s ({cpu:.1f} s "
                  f"of CPU), numpy peak "
                  f"{peak / 2**20:,.0f} MiB, process max RSS "
                  f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:,.0f} MiB, cache "
                  f"{size / 2**30:.2f} GiB ({load()})", flush=True)


# -- reads --------------------------------------------------------------------------------------------

def bench_reads(args) -> None:
    """Random samples/s from a GPTDataset on a synthetic uint16 shard, in this one process and thread."""
    with tempfile.TemporaryDirectory(prefix="bench_data_reads_") as tmp:
        prefix = os.path.join(tmp, "shard")
        lengths = synthetic_lengths(args.tokens, seed=1)
        builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
        rng = np.random.default_rng(1)
        for i in range(0, lengths.size, 4096):  # written in blocks: memory stays small
            part = lengths[i: i + 4096]
            builder.add_documents(rng.integers(0, 50257, int(part.sum()), dtype=np.uint16), part)
        builder.finalize(prefix + ".idx")
        indexed = IndexedDataset(prefix)
        samples = int(lengths.sum()) // 2048
        ds = GPTDataset(indexed, np.arange(len(indexed)), 2048, samples, seed=0)
        order = np.random.default_rng(2).integers(0, samples, args.samples).tolist()
        for i in order[:1000]:  # touch the pages once: measure reads from the page cache
            ds[i]
        rates = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for i in order:
                ds[i]
            rates.append(len(order) / (time.perf_counter() - start))
        print(f"GPTDataset random reads: {int(lengths.sum()):,}-token uint16 shard, {len(order):,} random 2049-token "
              f"samples: best {max(rates):,.0f} / median {np.median(rates):,.0f} samples/s on one core ({load()})")


# -- the trainer's verification of a dataset -----------------------------------------------------------

def bench_verify(args) -> None:
    """Seconds the trainer's start-up check of a dataset takes (data/checks.py: the index checked,
    one pass over the .bin with its sha256), the first time and from its cache."""
    from megapretrain.data.checks import check_data_matches_model

    with tempfile.TemporaryDirectory(prefix="bench_data_verify_") as tmp:
        prefix = os.path.join(tmp, "shard")
        lengths = synthetic_lengths(args.tokens, seed=2)
        builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
        rng = np.random.default_rng(2)
        for i in range(0, lengths.size, 4096):
            part = lengths[i: i + 4096]
            builder.add_documents(rng.integers(0, 50257, int(part.sum()), dtype=np.uint16), part)
        builder.finalize(prefix + ".idx")
        with open(prefix + ".summary.json", "w") as fh:
            json.dump({"documents": builder.document_count, "tokens": builder.token_count,
                       "checksum": {"algorithm": "sha256", "bin": builder.checksum}}, fh)
        size = os.path.getsize(prefix + ".bin")
        times = []
        for cache in ("cache", "cache"):  # the second start finds the first one's pass
            start = time.perf_counter()
            check_data_matches_model([prefix], "ByteTokenizer", 50257, 50257, os.path.join(tmp, cache))
            times.append(time.perf_counter() - start)
        print(f"dataset check at start-up: {int(lengths.sum()):,} tokens, {lengths.size:,} documents, "
              f"{size / 2**20:,.0f} MiB .bin (page cache warm): first {times[0]:.2f} s "
              f"({size / 2**20 / times[0]:,.0f} MiB/s), cached {times[1] * 1e3:.1f} ms ({load()})")


@user_errors
def main(argv: list[str] | None = None) -> int:
    p = ToolParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sections = p.add_subparsers(dest="section", required=True)
    for name in ("preprocess", "memory"):
        s = sections.add_parser(name)
        s.add_argument("--tokenizer-type", default="ByteTokenizer")
        s.add_argument("--tokenizer-model")
        s.add_argument("--vocab-file")
        s.add_argument("--merge-file")
        s.add_argument("--workers", type=positive_int, nargs="+", default=[2])
    pre = sections.choices["preprocess"]
    pre.add_argument("--corpus", help="a JSON-lines corpus (default: tools/build_demo_corpus.py's, made here)")
    pre.add_argument("--tokenizer-threads", type=positive_int, nargs="+", default=[1])
    pre.add_argument("--repeats", type=positive_int, default=3)
    pre.add_argument("--verify-gpt2", action="store_true",
                     help="check every output token against the `tokenizers` GPT-2 BPE (GPT2BPETokenizer only)")
    mem = sections.choices["memory"]
    mem.add_argument("--big-gb", type=positive_float, default=2.0, help="size of the generated input in GB")
    mem.add_argument("--tmp-dir", help="where to generate it (default: the system temporary directory)")
    idx = sections.add_parser("index")
    idx.add_argument("--repeats", type=positive_int, default=5)
    idx.add_argument("--megatron", action="store_true", help="also time megatron-core's compiled helpers")
    reads = sections.add_parser("reads")
    reads.add_argument("--tokens", type=positive_int, default=50_000_000, help="size of the synthetic shard")
    reads.add_argument("--samples", type=positive_int, default=200_000)
    reads.add_argument("--repeats", type=positive_int, default=3)
    blend = sections.add_parser("blend")
    blend.add_argument("--prefixes", type=positive_int, nargs="+", default=[10, 100, 1000])
    blend.add_argument("--samples", type=positive_float, nargs="+", default=[1e6, 1e7, 1e8])
    blend.add_argument("--equal", action="store_true", help="equal weights (default: uniform random)")
    blend.add_argument("--megatron", action="store_true", help="also time megatron-core's C++ helper")
    blend.add_argument("--tmp-dir", help="where the streamed index is written (default: system temp)")
    startup = sections.add_parser("startup")
    startup.add_argument("--prefixes", type=positive_int, default=1000)
    startup.add_argument("--documents", type=positive_int, default=100_000,
                         help="documents per prefix, on average (each 1-2047 tokens)")
    startup.add_argument("--train-tokens", type=positive_float, default=1e11)
    startup.add_argument("--seq-length", type=positive_int, default=8192)
    startup.add_argument("--tmp-dir", help="where prefixes and cache are made (default: system temp)")
    verify = sections.add_parser("verify")
    verify.add_argument("--tokens", type=positive_int, default=500_000_000, help="size of the synthetic shard")
    args = p.parse_args(argv)
    {"preprocess": bench_preprocess, "memory": bench_memory, "index": bench_index, "reads": bench_reads,
     "verify": bench_verify, "blend": bench_blend, "startup": bench_startup}[args.section](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
