#!/usr/bin/env python
"""Validate an indexed dataset and describe what is in it.

    python tools/inspect_data.py data/corpus_text_document \\
        [--vocab-size 50257] [--seq-length 2048] [--png DIR]

Checks (each failure is printed as ``FAIL <check>: <what>`` and makes the exit status 1):
header (magic, version, dtype code), .idx size against its counts, .bin size against the sequence
lengths, pointers starting at 0 and following the lengths, document indices running from 0 to the
sequence count without going back, every token id in [0, vocab size), and — when preprocessing left
a ``PREFIX.summary.json`` — document and token counts and the .bin's sha256 against it. The vocab
size and the end-of-document id come from the summary unless given.

Reports: document and token counts, document length percentiles and a histogram (``--png`` also
draws it, with matplotlib), end-of-document frequency, and for ``--seq-length`` the packed view:
how many ``seq_length + 1`` token samples cross a document boundary.
"""

from __future__ import annotations

import json
import mmap
import os
import sys

import numpy as np

from megapretrain.cli import ToolParser, positive_int, user_errors
from megapretrain.data.checks import read_summary
from megapretrain.data.indexed_dataset import (
    _HEADER,
    _read_header,
    data_file_path,
    index_file_path,
    index_problems,
    scan_tokens,
)
from megapretrain.errors import DataError
from megapretrain.user_files import DATASET, check_kind

BLOCK = 1 << 24  # items per streamed block: memory stays flat for any dataset size
PERCENTILES = (0, 1, 5, 25, 50, 75, 95, 99, 100)


class Report:
    """Collects failures and facts; prints them as they come."""

    def __init__(self, quiet_json: bool = False):
        self.failures: list[str] = []
        self.facts: dict = {}
        self.quiet = quiet_json

    def fail(self, check: str, message: str) -> None:
        self.failures.append(f"{check}: {message}")
        print(f"FAIL {check}: {message}", file=sys.stderr)

    def say(self, line: str) -> None:
        if not self.quiet:
            print(line)


def inspect(prefix: str, vocab_size: int | None, seq_length: int | None, png: str | None,
            checksum: bool, report: Report) -> None:
    idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            report.fail("files", f"{path} not found")
            return
    summary = _summary(prefix, report)
    with open(idx_path, "rb") as f:
        idx = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(f.fileno()).st_size \
            else b""
    try:
        dtype, count, doc_count = _read_header(idx_path, idx)
    except ValueError as e:
        report.fail("header", str(e))
        return
    offset = _HEADER.size
    lengths = np.frombuffer(idx, dtype=np.int32, count=count, offset=offset)
    pointers = np.frombuffer(idx, dtype=np.int64, count=count, offset=offset + 4 * count)
    documents = np.frombuffer(idx, dtype=np.int64, count=doc_count, offset=offset + 12 * count)
    report.say(f"{prefix}: dtype {dtype}, {count:,} sequences, {doc_count - 1:,} documents")
    layout_ok = _check_layout(bin_path, dtype, lengths, pointers, documents, report)
    total = int(lengths.sum(dtype=np.int64))
    report.facts.update(dtype=dtype.name, sequences=count, documents=doc_count - 1, tokens=total)
    if summary:
        for name, value in (("documents", doc_count - 1), ("tokens", total)):
            if name in summary and summary[name] != value:
                report.fail("summary", f"{name}: {value:,} in the files, {summary[name]:,} in "
                                       f"{prefix}.summary.json")
    report.say(f"tokens: {total:,}" + (f" (summary: {summary['tokens']:,})" if summary and
                                       "tokens" in summary else ""))
    tokenizer = (summary or {}).get("tokenizer", {})
    vocab_size = vocab_size or tokenizer.get("vocab_size")
    eod = tokenizer.get("eod")
    if not layout_ok:
        return  # token offsets cannot be trusted: skip the checks that read tokens
    _scan_tokens(bin_path, dtype, vocab_size, eod, summary if checksum else None, report)
    _describe_lengths(prefix, lengths, documents, png, report)
    if eod is not None and count:
        ends = (pointers // dtype.itemsize + lengths.astype(np.int64) - 1)[lengths > 0]
        tokens = np.memmap(bin_path, dtype=dtype, mode="r") if total else np.zeros(0, dtype)
        ending = int(np.count_nonzero(tokens[ends] == eod)) if ends.size else 0
        report.facts["documents_ending_with_eod"] = ending
        report.say(f"sequences ending with eod ({eod}): {ending:,} of {int((lengths > 0).sum()):,} "
                   "non-empty")
    if seq_length:
        _packed_view(lengths, seq_length, report)


def _summary(prefix: str, report: Report) -> dict | None:
    if not os.path.exists(prefix + ".summary.json"):
        report.say(f"no {os.path.basename(prefix)}.summary.json: counts and checksum not compared")
        return None
    try:
        return read_summary(prefix)
    except DataError as e:  # unreadable, or a field of the wrong type
        report.fail("summary", str(e))
        return None


def _check_layout(bin_path, dtype, lengths, pointers, documents, report: Report) -> bool:
    """Lengths, pointers and document indices consistent with each other and with the .bin size."""
    found = index_problems(os.path.getsize(bin_path), dtype, lengths, pointers, documents, BLOCK)
    for check, message in found:
        report.fail(check, message.replace("the .bin", bin_path))
    return not found


def _scan_tokens(bin_path, dtype, vocab_size, eod, summary, report: Report) -> None:
    """One streamed pass over the .bin: id range, eod count, and the checksum."""
    recorded = (summary or {}).get("checksum", {}).get("bin")
    scan = scan_tokens(bin_path, dtype, digest=recorded is not None, eod=eod, block=BLOCK)
    low, high = scan["min_token_id"], scan["max_token_id"]
    if low is not None and low < 0:
        report.fail("token ids", f"negative token id {low}")
    if vocab_size and high is not None and high >= vocab_size:
        report.fail("token ids", f"token id {high} >= vocab size {vocab_size}")
    report.say(f"token ids: [{low}, {high}]" + (f", vocab size {vocab_size}" if vocab_size else
                                                  " (no vocab size: pass --vocab-size to check the "
                                                  "range)"))
    report.facts.update(min_id=low, max_id=high)
    if eod is not None:
        total = max(report.facts["tokens"], 1)
        report.facts["eod_count"] = scan["eod_count"]
        report.say(f"eod ({eod}): {scan['eod_count']:,} tokens, {scan['eod_count'] / total:.4%} of "
                   f"all, {scan['eod_count'] / max(report.facts['documents'], 1):.3f} per document")
    if recorded is not None:
        if recorded != scan["sha256"]:
            report.fail("checksum", f"sha256 of {bin_path} is {scan['sha256'][:16]}..., the "
                                    f"summary records {str(recorded)[:16]}... (the .bin changed "
                                    "after preprocessing)")
        else:
            report.say("checksum: sha256 matches the summary")


def _describe_lengths(prefix, lengths, documents, png, report: Report) -> None:
    """Document lengths (documents may hold several sequences): percentiles and a log2 histogram."""
    if lengths.size == 0:
        report.say("no documents")
        return
    ends = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    doc_lengths = ends[documents[1:]] - ends[documents[:-1]]
    values = np.percentile(doc_lengths, PERCENTILES)
    report.facts["length_percentiles"] = dict(zip(map(str, PERCENTILES), map(float, values)))
    report.say(f"document length: mean {doc_lengths.mean():,.1f}; " +
               ", ".join(f"p{p} {v:,.0f}" for p, v in zip(PERCENTILES, values)))
    edges = 2 ** np.arange(0, max(1, int(np.ceil(np.log2(max(int(doc_lengths.max()), 1) + 1)))) + 1)
    counts = np.histogram(doc_lengths, bins=np.concatenate([[0], edges]))[0]
    widest = max(int(counts.max()), 1)
    report.say("histogram of document lengths (tokens):")
    lower = 0
    for upper, n in zip(edges, counts):
        report.say(f"  [{lower:>9,}, {upper:>9,})  {n:>11,}  {'#' * int(round(40 * n / widest))}")
        lower = upper
    if png:
        _plot(prefix, doc_lengths, png, report)


def _plot(prefix, doc_lengths, directory, report: Report) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: --png needs matplotlib (pip install matplotlib); the histogram above is the "
              "text version", file=sys.stderr)
        return
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, os.path.basename(prefix) + "_lengths.png")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.hist(np.maximum(doc_lengths, 1),
            bins=np.logspace(0, np.log10(max(doc_lengths.max(), 2)), 60))
    ax.set_xscale("log")
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("documents")
    ax.set_title(os.path.basename(prefix))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    report.say(f"wrote {path}")


def _packed_view(lengths, seq_length: int, report: Report) -> None:
    """Samples of seq_length + 1 tokens at every seq_length in file order: how many hold a boundary.

    Sample k holds tokens [k*s, k*s + s]; a document starting at token b > 0 makes exactly sample
    ceil(b/s) - 1 cross a boundary, so the count is the number of distinct such k."""
    total = int(lengths.sum(dtype=np.int64))
    if total == 0:
        return
    samples = -(-total // seq_length)
    starts = np.cumsum(lengths[:-1], dtype=np.int64)
    starts = starts[(starts > 0) & (starts < total)]
    crossing = np.unique(-(-starts // seq_length) - 1).size
    report.facts.update(packed_samples=samples, crossing_fraction=crossing / samples)
    report.say(f"packed view (seq_length {seq_length}): {samples:,} samples, "
               f"{crossing / samples:.2%} cross a document boundary, "
               f"{(np.unique(starts).size + samples) / samples:.2f} documents per sample")


@user_errors
def main(argv: list[str] | None = None) -> int:
    p = ToolParser(description=__doc__.split("\n\n")[0])
    p.add_argument("prefix", help="dataset prefix (PREFIX.bin / PREFIX.idx)")
    p.add_argument("--vocab-size", type=positive_int,
                   help="every token id must be below this (default: from the summary)")
    p.add_argument("--seq-length", type=positive_int,
                   help="also report the packed-sample view for this sequence length")
    p.add_argument("--png", metavar="DIR", help="write the length histogram as a PNG into DIR "
                                                "(needs matplotlib)")
    p.add_argument("--no-checksum", action="store_true",
                   help="skip the sha256 comparison with the summary")
    p.add_argument("--json", action="store_true",
                   help="print the facts as one JSON object instead of text")
    args = p.parse_args(argv)
    if not os.path.isfile(args.prefix + ".idx"):
        check_kind("prefix", args.prefix, DATASET, "give the prefix of a dataset that "
                   "tools/preprocess_data.py wrote (PREFIX.bin/.idx)")
    report = Report(quiet_json=args.json)
    inspect(args.prefix, args.vocab_size, args.seq_length, args.png, not args.no_checksum, report)
    if args.json:
        print(json.dumps(dict(report.facts, failures=report.failures)))
    if report.failures:
        print(f"{args.prefix}: {len(report.failures)} integrity failure(s): "
              + "; ".join(f.split(':')[0] for f in report.failures), file=sys.stderr)
        return 1
    if not args.json:
        print(f"{args.prefix}: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
