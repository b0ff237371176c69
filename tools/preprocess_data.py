#!/usr/bin/env python
"""Tokenize a JSON-lines corpus into Megatron indexed datasets: OUT_{key}_document.bin/.idx.

    python tools/preprocess_data.py --input corpus.jsonl[.gz|.zst] --output-prefix data/corpus \\
        --tokenizer-type ByteTokenizer --append-eod --workers 8

Flags are Megatron-LM's. The input is read lazily in chunks of lines; worker processes parse and
tokenize them (one tokenizer per worker); the parent writes results in input order as they arrive,
with a bounded number of chunks in flight, so memory stays flat whatever the corpus size. Output is
written under ``.tmp`` names and renamed only when complete: a failed run leaves nothing that
looks finished, and an existing dataset is replaced only with ``--overwrite``.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib.util
import io
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from typing import Iterable, Iterator

import numpy as np

try:
    import megapretrain  # noqa: F401  (installed: use it as is)
except ImportError:  # running from a checkout without installing: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tqdm import tqdm

from megapretrain.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from megapretrain.data.tokenizers import TOKENIZER_TYPES, build_tokenizer


CHUNK_BYTES = 1 << 18  # cap on the raw bytes in one worker task (see read_chunks)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="JSON-lines file, optionally .gz or .zst compressed")
    p.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX_{key}_document.bin/.idx")
    p.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    p.add_argument("--tokenizer-model", help="tokenizer file or directory (see DESIGN.md, data.tokenizer.model)")
    p.add_argument("--vocab-file", help="GPT2BPETokenizer vocab.json")
    p.add_argument("--merge-file", help="GPT2BPETokenizer merges.txt")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize, one dataset each")
    p.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--chunk-size", type=int, default=64, help="lines per task sent to a worker")
    p.add_argument("--overwrite", action="store_true", help="replace existing output datasets")
    p.add_argument("--skip-bad-records", action="store_true",
                   help="skip and count malformed lines instead of stopping at the first one")
    p.add_argument("--log-interval", type=int, default=1000, help="documents between progress updates")
    return p.parse_args(argv)


class ChunkEncoder:
    """Turns a chunk of raw JSON lines into token arrays, per json key, plus the problems it met."""

    def __init__(self, tokenizer_args: tuple, keys: list[str], append_eod: bool, dtype: str):
        self.tokenizer = build_tokenizer(*tokenizer_args)
        self.keys, self.append_eod, self.dtype = keys, append_eod, np.dtype(dtype)

    def encode(self, chunk: tuple[int, list[bytes]]) -> dict:
        """Returns {"tokens": [(tokens, lengths) per key], "errors": [(line, problem)], "empty", "bytes"}."""
        first_line, lines = chunk
        texts: list[list[str]] = [[] for _ in self.keys]
        errors = []
        for lineno, line in enumerate(lines, first_line):
            if not line.strip():
                continue  # blank lines (a trailing newline, say) are not records
            values, problem = self._parse(line)
            if problem:
                errors.append((lineno, problem))
                continue
            for per_key, value in zip(texts, values):
                per_key.append(value)
        results, empty = [], 0
        for per_key in texts:
            tokens, lengths, skipped = self._tokenize(per_key)
            results.append((tokens, lengths))
            empty += skipped
        return {"tokens": results, "errors": errors, "empty": empty, "bytes": sum(len(x) for x in lines)}

    def _parse(self, line: bytes) -> tuple[list[str], str | None]:
        """The record's text for each key, or a one-phrase description of what is wrong with the line."""
        try:
            record = json.loads(line)
        except UnicodeDecodeError:
            return [], "not valid UTF-8"
        except json.JSONDecodeError as e:
            return [], f"malformed JSON ({e.msg} at column {e.colno})"
        if not isinstance(record, dict):
            return [], f"expected a JSON object, got {type(record).__name__}"
        for key in self.keys:
            if key not in record:
                return [], f"missing key {key!r} (keys: {', '.join(list(record)[:8])})"
            if not isinstance(record[key], str):
                return [], f"key {key!r} holds {type(record[key]).__name__}, expected a string"
        return [record[key] for key in self.keys], None

    def _tokenize(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
        """Concatenated tokens (+ eod per document) and document lengths; empty documents are dropped."""
        ids = [x for x in self.tokenizer.tokenize_batch([t for t in texts if t]) if x.size]
        skipped = len(texts) - len(ids)
        eod = np.array([self.tokenizer.eod], dtype=self.dtype)
        pieces = [piece for x in ids for piece in ((x, eod) if self.append_eod else (x,))]
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=self.dtype)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.tokenizer.vocab_size):
            raise ValueError(f"tokenizer produced id {tokens.max()} outside its vocab_size {self.tokenizer.vocab_size}")
        lengths = np.array([x.size + self.append_eod for x in ids], dtype=np.int64)
        return tokens.astype(self.dtype, copy=False), lengths, skipped


# Each worker process holds one encoder, built once by the pool initializer (it cannot be passed
# per task cheaply: tokenizers are large and some do not pickle).
_worker_encoder: ChunkEncoder | None = None


def _init_worker(*encoder_args) -> None:
    global _worker_encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already; no threads on top
    _worker_encoder = ChunkEncoder(*encoder_args)


def _encode_in_worker(chunk: tuple[int, list[bytes]]) -> dict:
    return _worker_encoder.encode(chunk)


def open_input(path: str) -> io.BufferedIOBase:
    """Open a .jsonl, .jsonl.gz or .jsonl.zst file for reading binary lines."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        import zstandard  # optional; main() checks it is installed before opening

        # read_across_frames: files from parallel compressors (pzstd, zstd -T) hold many frames.
        reader = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), read_across_frames=True, closefd=True)
        return io.BufferedReader(reader)
    return open(path, "rb")


def read_chunks(lines: Iterable[bytes], chunk_size: int, chunk_bytes: int = CHUNK_BYTES
                ) -> Iterator[tuple[int, list[bytes]]]:
    """Group lines lazily into (first line number, lines) chunks of at most ``chunk_size`` lines.

    A chunk also ends once it holds ``chunk_bytes``: with very long documents, equal line counts
    would make some tasks far longer than others and leave workers idle.
    """
    chunk, first, size = [], 1, 0
    for lineno, line in enumerate(lines, 1):
        if not chunk:
            first, size = lineno, 0
        chunk.append(line)
        size += len(line)
        if len(chunk) == chunk_size or size >= chunk_bytes:
            yield first, chunk
            chunk = []
    if chunk:
        yield first, chunk


def ordered_results(pool, chunks: Iterable, max_in_flight: int) -> Iterator[dict]:
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


class Outputs:
    """The datasets being written, one per json key, under temporary names until ``commit``."""

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

    def commit(self) -> None:
        """Write the indices, then rename .bin and .idx into place (all writing is done by then)."""
        for prefix, builder in zip(self.prefixes, self.builders):
            builder.finalize(prefix + ".idx.tmp")
        for prefix in self.prefixes:
            os.replace(prefix + ".bin.tmp", prefix + ".bin")
            os.replace(prefix + ".idx.tmp", prefix + ".idx")

    def discard(self) -> None:
        """Close and delete the temporary files of an unfinished run."""
        for prefix, builder in zip(self.prefixes, self.builders):
            builder.close()
            for path in (prefix + ".bin.tmp", prefix + ".idx.tmp"):
                if os.path.exists(path):
                    os.remove(path)


def _check_args(args: argparse.Namespace) -> str | None:
    """The first problem with the arguments as one line, or None."""
    if not os.path.isfile(args.input):
        return f"--input {args.input}: no such file"
    if args.input.endswith(".zst") and importlib.util.find_spec("zstandard") is None:
        return f"--input {args.input}: reading .zst needs the 'zstandard' package: pip install zstandard"
    if args.workers < 1 or args.chunk_size < 1 or args.log_interval < 1:
        return "--workers, --chunk-size and --log-interval must be >= 1"
    for key in args.json_keys:
        prefix = f"{args.output_prefix}_{key}_document"
        if not args.overwrite and (os.path.exists(prefix + ".bin") or os.path.exists(prefix + ".idx")):
            return f"{prefix}.bin/.idx already exists; pass --overwrite to replace it"
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the tool; returns the exit status (0 done, 1 a reported problem, output left untouched)."""
    args = parse_args(argv)
    problem = _check_args(args)
    tokenizer_args = (args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file)
    if problem is None:
        try:
            tokenizer = build_tokenizer(*tokenizer_args)  # here too, to fail fast and pick the dtype
        except (ValueError, OSError, ImportError) as e:
            problem = str(e)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    dtype = best_dtype(tokenizer.vocab_size)
    encoder_args = (tokenizer_args, args.json_keys, args.append_eod, dtype.str)
    outputs = None
    try:
        outputs = Outputs(args.output_prefix, args.json_keys, dtype)
        status = _run(args, encoder_args, outputs)
    except (OSError, EOFError) as e:  # unreadable or corrupt input, full or unwritable disk
        print(f"error: {type(e).__name__}: {e} (while converting {args.input})", file=sys.stderr)
        status = 1
    except BaseException:  # a bug or Ctrl-C: leave no partial output either
        if outputs is not None:
            outputs.discard()
        raise
    if status != 0 and outputs is not None:
        outputs.discard()
    return status


def _run(args: argparse.Namespace, encoder_args: tuple, outputs: Outputs) -> int:
    """Tokenize the input into ``outputs``; 0 on success, 1 on a bad record (already reported)."""
    start, skipped_bad, skipped_empty, nbytes = time.perf_counter(), 0, 0, 0
    with (open_input(args.input) as f, worker_pool(args.workers, encoder_args) as pool,
          tqdm(unit=" docs", file=sys.stderr, miniters=args.log_interval, smoothing=0.1) as bar):
        chunks = read_chunks(f, args.chunk_size)
        if pool is None:
            results = map(ChunkEncoder(*encoder_args).encode, chunks)
        else:
            results = ordered_results(pool, chunks, max_in_flight=4 * args.workers)
        for result in results:
            for lineno, problem in result["errors"]:
                if not args.skip_bad_records:
                    bar.close()
                    print(f"error: {args.input}:{lineno}: {problem} (pass --skip-bad-records to skip such lines)",
                          file=sys.stderr)
                    return 1
                skipped_bad += 1
            outputs.add(result["tokens"])
            skipped_empty += result["empty"]
            nbytes += result["bytes"]
            elapsed = max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{sum(outputs.tokens) / elapsed:,.0f} tokens/s, {nbytes / elapsed / 1e6:.1f} MB/s",
                                refresh=False)
            bar.update(result["tokens"][0][1].size)
    outputs.commit()
    elapsed = time.perf_counter() - start
    for prefix, docs, tokens in zip(outputs.prefixes, outputs.documents, outputs.tokens):
        print(f"{prefix}: {docs} documents, {tokens} tokens, skipped {skipped_empty} empty and {skipped_bad} bad "
              f"records, {elapsed:.1f}s, {tokens / max(elapsed, 1e-9):,.0f} tokens/s")
    return 0


@contextlib.contextmanager
def worker_pool(workers: int, encoder_args: tuple):
    """A process pool of tokenizer workers, or None for one worker (then the parent tokenizes)."""
    if workers == 1:
        yield None
        return
    # fork: workers inherit this module even when it was imported from a file path (as tests do).
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    pool = context.Pool(workers, initializer=_init_worker, initargs=encoder_args)
    try:
        yield pool
    finally:
        pool.terminate()
        pool.join()


if __name__ == "__main__":
    sys.exit(main())
