#!/usr/bin/env python
"""Tokenize a raw corpus into Megatron indexed datasets: OUT_{key}_document.bin/.idx (+
.summary.json).

    python tools/preprocess_data.py --input corpus.jsonl[.gz|.zst] --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --tokenizer-model gpt2/ --append-eod --workers 8
    # .jsonl/.parquet/.txt files
    python tools/preprocess_data.py --input shards/ --output-prefix data/web ...
    python tools/preprocess_data.py --hf-dataset saved_ds/ --split train --streaming \\
        --output-prefix ...

Flags are Megatron-LM's, plus input formats and safety. The input is read lazily in chunks; worker
processes parse and tokenize them; the parent writes results in input order as they arrive, with a
bounded number of chunks in flight, so memory stays flat whatever the corpus size. ``--partitions
N`` runs N such pipelines on parts of the input (for many cores, where one reader would not keep up)
and joins their outputs in input order. Output is written under temporary names and renamed only
when complete (the .idx last): a failed run leaves nothing that looks finished, and an existing
dataset is replaced only with ``--overwrite``. ``OUT_{key}_document.summary.json`` records the
counts, the tokenizer and the .bin's sha256, which tools/inspect_data.py checks.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np
from tqdm import tqdm

from megapretrain.cli import ToolParser, positive_int, print_error, user_errors
from megapretrain.config import expand_path
from megapretrain.data import readers
from megapretrain.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from megapretrain.data.readers import Bad, Chunk
from megapretrain.data.tokenizers import TOKENIZER_TYPES, build_tokenizer
from megapretrain.errors import (
    FULL_DISK,
    DataError,
    UserError,
    WrongKindError,
    free_bytes,
    size_text,
)

SUMMARY_FORMAT = "megapretrain-preprocess-summary-v1"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ToolParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("input")
    src.add_argument("--input", nargs="+", help="files, directories or glob patterns: JSON lines "
                                                "(.jsonl/.json, optionally .gz/.zst), .parquet, or "
                                                "plain text (anything else)")
    src.add_argument("--input-format", default="auto", choices=("auto",) + readers.FORMATS,
                     help="format of every --input file (default: from each file name)")
    src.add_argument("--text-mode", default="file", choices=("file", "paragraph"),
                     help="plain text: one document per file, or per blank-line-separated block")
    src.add_argument("--hf-dataset",
                     help="a Hugging Face dataset: a save_to_disk directory, or a builder (json, "
                          "parquet, text, a local dataset directory) with --hf-data-files")
    src.add_argument("--split", default="train", help="--hf-dataset split")
    src.add_argument("--streaming", action="store_true",
                     help="--hf-dataset: stream instead of preparing it")
    src.add_argument("--hf-data-files", nargs="+", help="--hf-dataset builder data files")
    src.add_argument("--json-keys", nargs="+", default=["text"],
                     help="keys (JSON) or columns (parquet, HF) to tokenize, one dataset each")
    p.add_argument("--output-prefix", required=True,
                   help="writes OUTPUT_PREFIX_{key}_document.bin/.idx")
    tok = p.add_argument_group("tokenizer")
    tok.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    tok.add_argument("--tokenizer-model", help="tokenizer file or directory (see the README, "
                                               "'Tokenizer types')")
    tok.add_argument("--vocab-file", help="GPT2BPETokenizer vocab.json")
    tok.add_argument("--merge-file", help="GPT2BPETokenizer merges.txt")
    tok.add_argument("--append-eod", action="store_true", help="append the end-of-document token "
                                                               "to each document")
    run = p.add_argument_group("execution")
    run.add_argument("--workers", type=positive_int, default=1, help="tokenizer processes (in all "
                                                                     "partitions together)")
    run.add_argument("--partitions", type=positive_int, default=1,
                     help="independent reader/tokenizer/writer pipelines over parts of the input, "
                          "joined at the end")
    run.add_argument("--tokenizer-threads", type=positive_int, default=1,
                     help="threads each tokenizer process may use (tiktoken, sentencepiece and "
                          "tokenizers run GIL-free); with --workers 1 this parallelizes inside one "
                          "process")
    run.add_argument("--chunk-size", type=positive_int, default=64,
                     help="records per task sent to a worker")
    run.add_argument("--overwrite", action="store_true", help="replace existing output datasets")
    run.add_argument("--skip-bad-records", action="store_true",
                     help="skip and count malformed records instead of stopping at the first one")
    run.add_argument("--log-interval", type=positive_int, default=1000,
                     help="documents between progress updates")
    run.add_argument("--no-progress", action="store_true", help="no progress bar (the summary is "
                                                                "still printed)")
    return p.parse_args(argv)


class ChunkEncoder:
    """Turns a chunk of raw records into token arrays, per key, plus the problems it met."""

    def __init__(self, tokenizer, keys: list[str], append_eod: bool, dtype: str, threads: int = 1):
        self.tokenizer, self.keys, self.append_eod = tokenizer, keys, append_eod
        self.dtype, self.threads = np.dtype(dtype), threads

    def encode(self, chunk: Chunk) -> dict:
        """{"tokens": [(tokens, lengths) per key], "errors": [(number, problem)], "empty", "bytes",
        "docs"}."""
        texts: list[list[str]] = [[] for _ in self.keys]
        errors = []
        for number, item in zip(chunk.numbers, chunk.items):
            values = self._parse(item) if isinstance(item, bytes) else item
            if isinstance(values, Bad):
                errors.append((number, str(values)))
                continue
            for per_key, value in zip(texts, values):
                per_key.append(value)
        results, empty = [], 0
        for per_key in texts:
            tokens, lengths, skipped = self._tokenize(per_key)
            results.append((tokens, lengths))
            empty += skipped
        return {"tokens": results, "errors": errors, "empty": empty, "bytes": chunk.nbytes,
                "source": chunk.source, "unit": chunk.unit}

    def _parse(self, line: bytes) -> tuple[str, ...] | Bad:
        """The record's text for each key, or what is wrong with the line."""
        try:
            record = json.loads(line)
        except UnicodeDecodeError:
            return Bad("not valid UTF-8")
        except json.JSONDecodeError as e:
            return Bad(f"malformed JSON ({e.msg} at column {e.colno})")
        if not isinstance(record, dict):
            return Bad(f"expected a JSON object, got {type(record).__name__}")
        for key in self.keys:
            if key not in record:
                return Bad(f"missing key {key!r} (keys: {', '.join(list(record)[:8])})")
            if not isinstance(record[key], str):
                return Bad(f"key {key!r} holds {type(record[key]).__name__}, expected a string")
        return tuple(record[key] for key in self.keys)

    def _tokenize(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
        """Concatenated tokens (+ eod per document) and document lengths; empty documents are
        dropped."""
        ids = [x for x in self.tokenizer.tokenize_batch([t for t in texts if t],
                                                        threads=self.threads) if x.size]
        skipped = len(texts) - len(ids)
        lengths = np.array([x.size + self.append_eod for x in ids], dtype=np.int64)
        if ids and (min(int(x.min()) for x in ids) < 0 or
                    max(int(x.max()) for x in ids) >= self.tokenizer.vocab_size):
            raise ValueError("the tokenizer produced an id outside its vocab_size "
                             f"{self.tokenizer.vocab_size}")
        tokens = np.empty(int(lengths.sum()), dtype=self.dtype)
        position = 0
        for x in ids:
            tokens[position: position + x.size] = x
            position += x.size
            if self.append_eod:
                tokens[position] = self.tokenizer.eod
                position += 1
        return tokens, lengths, skipped


# Each worker process holds one encoder. With fork it is the parent's (built before the pool, so a
# tokenizer is loaded once); with spawn the initializer builds it from its arguments.
_worker_encoder: ChunkEncoder | None = None


def _init_worker(encoder_args: tuple) -> None:
    global _worker_encoder
    _default_signals()
    # one process per core already; no threads on top
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if _worker_encoder is None:
        tokenizer_args, *rest = encoder_args
        _worker_encoder = ChunkEncoder(build_tokenizer(*tokenizer_args), *rest)


def _default_signals() -> None:
    """In a forked child: SIGTERM kills again, whatever handler the parent had installed (a
    trainer's save-on-SIGTERM handler would make ``Pool.terminate`` wait forever); Ctrl-C is the
    parent's job."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _encode_in_worker(chunk: Chunk) -> dict:
    return _worker_encoder.encode(chunk)


def ordered_results(pool, chunks: Iterable[Chunk], max_in_flight: int) -> Iterator[dict]:
    """Like ``pool.imap`` (results in input order) but with at most ``max_in_flight`` chunks queued.

    ``Pool.imap`` reads its whole input ahead of the workers, so memory would grow with the corpus.
    """
    pending: deque = deque()
    for chunk in chunks:
        pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
        if len(pending) >= max_in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


@contextlib.contextmanager
def worker_pool(workers: int, encoder: ChunkEncoder, encoder_args: tuple):
    """A process pool of tokenizer workers, or None for one worker (then this process tokenizes)."""
    global _worker_encoder
    if workers == 1:
        yield None
        return
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    _worker_encoder = encoder if context.get_start_method() == "fork" else None
    # Fork the workers with the default SIGTERM action: a handler installed by the caller (a
    # trainer's save-on-SIGTERM) would otherwise be inherited until _init_worker runs, and a
    # terminate() landing in that window would leave a worker alive, waiting for work forever.
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL) if in_main else None
    try:
        pool = context.Pool(workers, initializer=_init_worker, initargs=(encoder_args,))
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    try:
        yield pool
    except BaseException:
        pool.terminate()  # stop the workers at once
        raise
    else:
        pool.close()  # all work done: the workers take their stop sentinels and exit
    finally:
        pool.join()
        _worker_encoder = None


class Outputs:
    """The datasets being written, one per key, under temporary names until ``commit``."""

    def __init__(self, output_prefix: str, keys: list[str], dtype: np.dtype):
        self.prefixes = [f"{output_prefix}_{key}_document" for key in keys]
        os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
        self.builders = [IndexedDatasetBuilder(p + ".bin.tmp", dtype) for p in self.prefixes]
        self.documents = [0] * len(keys)
        self.tokens = [0] * len(keys)

    def add(self, per_key: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for k, (tokens, lengths) in enumerate(per_key):
            self.builders[k].add_documents(tokens, lengths)
            self.documents[k] += lengths.size
            self.tokens[k] += tokens.size

    def add_index(self, k: int, prefix: str) -> None:
        """Append a finished partial dataset (a partition's output) to key ``k``'s output."""
        builder = self.builders[k]
        before = (builder.document_count, builder.token_count)
        builder.add_index(prefix)
        self.documents[k] += builder.document_count - before[0]
        self.tokens[k] += builder.token_count - before[1]

    def commit(self, summaries: list[dict]) -> None:
        """Finish every file under its temporary name, then rename: .bin, summary, and the .idx last
        (a dataset exists once its .idx does, so an interrupted commit never looks complete)."""
        for prefix, builder, summary in zip(self.prefixes, self.builders, summaries):
            builder.finalize(prefix + ".idx.tmp")
            summary.update(documents=builder.document_count, sequences=builder.sequence_count,
                           tokens=builder.token_count, max_token_id=builder.max_token,
                           checksum={"algorithm": "sha256", "bin": builder.checksum})
            with open(prefix + ".summary.json.tmp", "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=1)
                f.write("\n")
        for prefix in self.prefixes:
            if os.path.exists(prefix + ".idx"):
                os.remove(prefix + ".idx")  # --overwrite: the old pair stops looking complete first
            os.replace(prefix + ".bin.tmp", prefix + ".bin")
            os.replace(prefix + ".summary.json.tmp", prefix + ".summary.json")
            os.replace(prefix + ".idx.tmp", prefix + ".idx")

    def bytes_written(self) -> int:
        """Token bytes written so far, over every key's dataset."""
        return sum(b.token_count * b.dtype.itemsize for b in self.builders)

    def discard(self) -> None:
        """Close and delete the temporary files of an unfinished run."""
        for prefix, builder in zip(self.prefixes, self.builders):
            builder.close()
            for path in (prefix + ".bin.tmp", prefix + ".idx.tmp", prefix + ".summary.json.tmp"):
                if os.path.exists(path):
                    os.remove(path)


class Stats:
    """Counts of one conversion (a partition's, or the whole run's)."""

    def __init__(self):
        self.documents = self.tokens = self.bytes = self.empty = self.bad = 0

    def add(self, other: Stats) -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))


def record_location(source: readers.Source, unit: str, number: int) -> str:
    """``file:line`` (the file's own line number, also inside a partition) or ``file: row N``."""
    if unit == "row":
        return f"{source.path}: row {number}"
    if source.start > 0:
        with open(source.path, "rb") as f:
            f.seek(source.start - 1)
            # the range's first partial line belongs to the previous one
            partial = f.read(1) != b"\n"
        number += readers.lines_before(source.path, source.start) + partial
    return f"{source.path}:{number}"


def convert(chunks: Iterator[Chunk], encoder: ChunkEncoder, encoder_args: tuple, workers: int,
            outputs: Outputs, skip_bad: bool, progress) -> tuple[Stats, str | None]:
    """Tokenize ``chunks`` into ``outputs`` with ``workers`` processes; (stats, first bad record or
    None)."""
    stats = Stats()
    with worker_pool(workers, encoder, encoder_args) as pool:
        results = map(encoder.encode, chunks) if pool is None \
            else ordered_results(pool, chunks, 4 * workers)
        for result in results:
            for number, problem in result["errors"]:
                if not skip_bad:
                    where = record_location(result["source"], result["unit"], number)
                    return stats, f"{where}: {problem} (pass --skip-bad-records to skip such " \
                                  "records)"
                stats.bad += 1
            outputs.add(result["tokens"])
            docs = result["tokens"][0][1].size
            stats.documents += docs
            stats.tokens += sum(t.size for t, _ in result["tokens"])
            stats.bytes += result["bytes"]
            stats.empty += result["empty"]
            progress(docs, sum(t.size for t, _ in result["tokens"]), result["bytes"])
    return stats, None


def _check_args(args: argparse.Namespace) -> str | None:
    """The first problem with the arguments as one line, or None (``--output-prefix`` taken as
    :func:`_output_prefix` reads it)."""
    try:
        args.output_prefix = _output_prefix(args.output_prefix, args.json_keys)
    except UserError as exc:
        return str(exc)
    if (args.input is None) == (args.hf_dataset is None):
        return "give exactly one of --input (files) and --hf-dataset"
    if min(args.workers, args.partitions, args.chunk_size, args.log_interval,
           args.tokenizer_threads) < 1:
        return "--workers, --partitions, --tokenizer-threads, --chunk-size and --log-interval " \
               "must be >= 1"
    repeated = sorted({k for k in args.json_keys if args.json_keys.count(k) > 1})
    if repeated:
        return (f"--json-keys names {', '.join(map(repr, repeated))} more than once: each key "
                "writes one dataset (OUT_{key}_document); give each key once")
    if args.hf_dataset is not None and args.partitions > 1:
        return "--partitions applies to --input files; a --hf-dataset is read by one pipeline"
    needs = {".zst": "zstandard", ".parquet": "pyarrow"}
    for suffix, module in needs.items():
        if any(suffix in s for s in (args.input or [])) \
                and importlib.util.find_spec(module) is None:
            return f"reading {suffix} files needs the '{module}' package: pip install {module}"
    if args.hf_dataset is not None and importlib.util.find_spec("datasets") is None:
        return "--hf-dataset needs the 'datasets' package: pip install datasets"
    for key in args.json_keys:
        prefix = f"{args.output_prefix}_{key}_document"
        existing = [prefix + s for s in (".bin", ".idx", ".summary.json")
                    if os.path.exists(prefix + s)]
        if not args.overwrite and existing:
            return f"{existing[0]} already exists; pass --overwrite to replace it"
    return None


def _output_prefix(prefix: str, keys: list[str]) -> str:
    """``--output-prefix`` as the tool uses it: ``~`` and environment variables expanded, and a
    trailing ``_{key}_document`` (the suffix the tool appends) dropped, so it is never doubled.
    A prefix that is a directory (ends in ``/``, or exists as one) or lies under a file is refused:
    it would write files named ``_text_document.bin`` or fail half-way."""
    given, prefix = prefix, expand_path(prefix, "--output-prefix")
    example = os.path.join(prefix, "corpus")
    if prefix.endswith(os.sep) or os.path.isdir(prefix):
        raise DataError(f"--output-prefix {given} is a directory; give a file name prefix in it, "
                        f"e.g. {example} (writes {example}_text_document.bin/.idx)")
    for key in keys:
        if prefix.endswith(f"_{key}_document"):
            prefix = prefix[:-len(f"_{key}_document")]
            break
    folder = os.path.dirname(os.path.abspath(prefix))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise DataError(f"--output-prefix {given}: {folder} is a file, not a directory; choose a "
                        "prefix under a directory (nothing was written)")
    return prefix


def _describe(e: BaseException, output_prefix: str, outputs: Outputs | None = None) -> str:
    """One line for a failure; a full disk names the directory, the file being written, how much
    was written and how much is free."""
    if isinstance(e, OSError) and e.errno in FULL_DISK:
        where = os.path.dirname(os.path.abspath(output_prefix))
        written = f"{size_text(outputs.bytes_written())} written, " if outputs is not None else ""
        return (f"no space left on {where} while writing {e.filename or output_prefix + '*'} "
                f"({written}{size_text(free_bytes(where) or 0)} free); free space or choose "
                "another --output-prefix (the partial files were removed, existing ones kept)")
    if isinstance(e, UserError):
        return str(e)
    return f"{type(e).__name__}: {e}"


def _nothing_to_write(stats: Stats, keys: list[str], outputs: Outputs) -> str | None:
    """Why a conversion that found no document for a key writes no dataset at all, or None."""
    empty = [key for key, documents in zip(keys, outputs.documents) if documents == 0]
    if not empty:
        return None
    skipped = f"{stats.empty} empty and {stats.bad} bad records were skipped" \
        if stats.empty or stats.bad \
        else "the input holds no records"
    return (f"no documents to write for --json-keys {' '.join(empty)}: {skipped}; nothing was "
            "written (check --input, --json-keys and --input-format)")


@user_errors
def main(argv: list[str] | None = None) -> int:
    """Run the tool; returns the exit status (0 done, 1 a reported problem, output left
    untouched)."""
    args = parse_args(argv)
    problem = _check_args(args)
    tokenizer_args = (args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file)
    sources: list[readers.Source] = []
    if problem is None:
        try:
            if args.input is not None:
                sources = readers.discover(args.input, args.input_format)
                if any(s.path.endswith(".zst") for s in sources) \
                        and importlib.util.find_spec("zstandard") is None:
                    raise ImportError("reading .zst files needs the 'zstandard' package: pip "
                                      "install zstandard")
            tokenizer = build_tokenizer(*tokenizer_args)
        except WrongKindError:
            raise  # one line, exit status 2 (bad input)
        except (ValueError, OSError, ImportError) as e:
            problem = str(e)
    if problem is not None:
        print_error(problem)
        return 1
    dtype = best_dtype(tokenizer.vocab_size)
    encoder_args = (tokenizer_args, args.json_keys, args.append_eod, dtype.str,
                    args.tokenizer_threads)
    encoder = ChunkEncoder(tokenizer, *encoder_args[1:])
    start = time.perf_counter()
    outputs = None
    try:
        outputs = Outputs(args.output_prefix, args.json_keys, dtype)
        if args.partitions > 1 \
                and len(groups := readers.split_for_partitions(sources, args.partitions)) > 1:
            stats, problem = _run_partitions(args, groups, encoder, encoder_args, outputs)
        else:
            with throughput_bar(args) as progress:
                stats, problem = convert(_chunks(args, sources), encoder, encoder_args,
                                         args.workers, outputs, args.skip_bad_records, progress)
        if problem is None:
            problem = _nothing_to_write(stats, args.json_keys, outputs)
        if problem is None:
            outputs.commit([_summary(args, tokenizer, dtype, key, stats,
                                     time.perf_counter() - start)
                            for key in args.json_keys])
    # unreadable input, full disk, missing column
    except (OSError, EOFError, ValueError, ImportError) as e:
        problem = _describe(e, args.output_prefix, outputs)
    except BaseException:  # a bug or Ctrl-C: leave no partial output either
        if outputs is not None:
            outputs.discard()
        raise
    if problem is not None:
        if outputs is not None:
            outputs.discard()
        print_error(problem)
        return 1
    elapsed = time.perf_counter() - start
    for prefix, docs, tokens in zip(outputs.prefixes, outputs.documents, outputs.tokens):
        print(f"{prefix}: {docs} documents, {tokens} tokens, skipped {stats.empty} empty and "
              f"{stats.bad} bad records, {stats.bytes / 1e6:.1f} MB in {elapsed:.1f}s, "
              f"{tokens / max(elapsed, 1e-9):,.0f} tokens/s, "
              f"{stats.bytes / 1e6 / max(elapsed, 1e-9):.1f} MB/s")
    return 0


def _chunks(args: argparse.Namespace, sources: list[readers.Source]) -> Iterator[Chunk]:
    if args.hf_dataset is not None:
        yield from readers.read_hf_chunks(args.hf_dataset, args.split, args.json_keys,
                                          args.chunk_size, args.streaming, args.hf_data_files)
        return
    for source in sources:
        yield from readers.read_chunks(source, args.json_keys, args.chunk_size, args.text_mode)


def _summary(args, tokenizer, dtype: np.dtype, key: str, stats: Stats, seconds: float) -> dict:
    """The sidecar written beside each output (counts and checksum are filled in by
    Outputs.commit)."""
    return {
        "format": SUMMARY_FORMAT, "key": key, "dtype": dtype.name, "append_eod": args.append_eod,
        "tokenizer": {"type": args.tokenizer_type, "model": args.tokenizer_model,
                      "vocab_file": args.vocab_file, "merge_file": args.merge_file,
                      "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod},
        "inputs": args.input or [f"{args.hf_dataset}[{args.split}]"], "skipped_empty": stats.empty,
        "skipped_bad": stats.bad, "input_bytes": stats.bytes, "seconds": round(seconds, 3),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(), }


@contextlib.contextmanager
def throughput_bar(args: argparse.Namespace):
    """A progress callback (documents, tokens, bytes) that drives a tqdm bar with tokens/s and
    MB/s."""
    start, totals = time.perf_counter(), [0, 0]
    with tqdm(unit=" docs", file=sys.stderr, miniters=args.log_interval, smoothing=0.1,
              disable=args.no_progress) as bar:
        def update(docs: int, tokens: int, nbytes: int) -> None:
            totals[0] += tokens
            totals[1] += nbytes
            elapsed = max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{totals[0] / elapsed:,.0f} tokens/s, "
                                f"{totals[1] / elapsed / 1e6:.1f} MB/s", refresh=False)
            bar.update(docs)
        yield update


def _run_partitions(args, groups, encoder, encoder_args, outputs: Outputs) -> tuple[Stats,
                                                                                    str | None]:
    """Convert each group of sources in its own process into a partial dataset, then append the
    partial datasets to ``outputs`` in input order (streamed: nothing is loaded whole)."""
    scratch = os.path.join(os.path.dirname(os.path.abspath(args.output_prefix)),
                           f".{os.path.basename(args.output_prefix)}.partitions.tmp")
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    context = multiprocessing.get_context("fork"
                                          if "fork" in multiprocessing.get_all_start_methods()
                                          else None)
    # documents, tokens, bytes per partition
    counters = context.Array("d", 3 * len(groups), lock=False)
    results = context.Queue()
    workers = [max(1, args.workers * (k + 1) // len(groups) - args.workers * k // len(groups))
               for k in range(len(groups))]
    processes = [context.Process(target=_partition_main, daemon=False,
                                 args=(k, group, args, encoder, encoder_args, workers[k], scratch,
                                       counters, results))
                 for k, group in enumerate(groups)]
    total, problem, done = Stats(), None, {}
    try:
        for process in processes:
            process.start()
        with throughput_bar(args) as progress:
            seen = [0.0] * 3
            while len(done) < len(processes) and problem is None:
                while not results.empty():
                    k, stats, error = results.get()
                    done[k] = stats
                    problem = problem or error
                if len(done) < len(processes) and not any(p.is_alive() for p in processes) \
                        and results.empty():
                    problem = "a partition process died without a result (out of memory?)"
                now = [sum(counters[3 * k + j] for k in range(len(groups))) for j in range(3)]
                progress(int(now[0] - seen[0]), int(now[1] - seen[1]), int(now[2] - seen[2]))
                seen = now
                time.sleep(0.05)
        if problem is None:
            for k in range(len(groups)):
                total.add(done[k])
                for i, key in enumerate(args.json_keys):
                    outputs.add_index(i, os.path.join(scratch, f"part{k}_{key}_document"))
        return total, problem
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join()
        shutil.rmtree(scratch, ignore_errors=True)


def _partition_main(k, group, args, encoder, encoder_args, workers, scratch, counters,
                    results) -> None:
    """One partition: its sources into ``scratch/part{k}_{key}_document``; reports (k, stats,
    problem)."""
    _default_signals()
    outputs = Outputs(os.path.join(scratch, f"part{k}"), args.json_keys, encoder.dtype)

    def progress(docs: int, tokens: int, nbytes: int) -> None:
        counters[3 * k] += docs
        counters[3 * k + 1] += tokens
        counters[3 * k + 2] += nbytes

    stats, problem = Stats(), None
    try:
        stats, problem = convert(_chunks(args, group), encoder, encoder_args, workers, outputs,
                                 args.skip_bad_records, progress)
        if problem is None:
            outputs.commit([{} for _ in args.json_keys])
    except (OSError, EOFError, ValueError, ImportError) as e:
        problem = _describe(e, args.output_prefix)
    if problem is not None:
        outputs.discard()
    results.put((k, stats, problem))


if __name__ == "__main__":
    sys.exit(main())
