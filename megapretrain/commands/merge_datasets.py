#!/usr/bin/env python
"""Join indexed datasets (shards, partitions) into one prefix, streaming: nothing is loaded whole.

    python tools/merge_datasets.py --input data/shard_a_text_document data/shard_b_text_document \\
        --output-prefix data/all_text_document
    # every prefix in it
    python tools/merge_datasets.py --input shards/ --output-prefix data/all_text_document

Like Megatron-LM's tools/merge_datasets.py, ``--input`` may be a directory, whose .bin/.idx pairs
are joined in sorted name order; here it may also be a list of prefixes, joined in the order given.
The documents keep their order and boundaries; the inputs must share one token dtype. Output goes
to temporary names renamed when complete (the .idx last), never over an existing dataset without
``--overwrite``, with a ``.summary.json`` (counts, sha256 of the .bin, the inputs' tokenizer).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

from megapretrain.cli import ToolParser, print_error, progress_bar, user_errors
from megapretrain.data.checks import read_summary
from megapretrain.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, dataset_exists
from megapretrain.errors import (
    DataError,
    MissingFileError,
    WrongKindError,
    check_free_space,
    full_disk_guard,
    size_text,
)
from megapretrain.user_files import DATASET, check_kind

SUMMARY_FORMAT = "megapretrain-preprocess-summary-v1"
_FIX_SPACE = "free space or choose another --output-prefix (nothing was written)"


def input_prefixes(inputs: list[str]) -> list[str]:
    """Prefixes named directly, or every complete .bin/.idx pair in a directory (sorted by name)."""
    prefixes = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(item, name[:-4]) for name in os.listdir(item)
                           if name.endswith(".idx"))
            found = [p for p in found if dataset_exists(p)]
            if not found:
                check_kind("--input", item, DATASET, "give a dataset prefix (PREFIX.bin/.idx) or "
                           "a directory of them")
                raise MissingFileError(f"--input {item}: the directory holds no .bin/.idx pair")
            prefixes += found
        elif dataset_exists(item):
            prefixes.append(item)
        else:
            check_kind("--input", item, DATASET, "give a dataset prefix (PREFIX.bin/.idx) or a "
                       "directory of them")
            raise MissingFileError(f"--input {item}: {item}.bin/.idx not found (give a prefix or a "
                                   "directory)")
    return prefixes


def check_no_duplicates(prefixes: list[str], summaries: dict[str, dict | None]) -> None:
    """Refuse inputs that would put a document in the output twice: a prefix given twice (or the
    same files under two names), an earlier merge beside the shards it was made of, or two inputs
    whose recorded checksums are equal."""
    seen: dict[tuple, str] = {}
    for prefix in prefixes:
        stat = os.stat(prefix + ".bin")
        if (stat.st_dev, stat.st_ino) in seen:
            first = seen[(stat.st_dev, stat.st_ino)]
            same = "is given twice" if first == prefix else f"and {first} are the same files"
            raise DataError(f"--input: {prefix} {same}; every document would be merged twice: give "
                            "each dataset once")
        seen[(stat.st_dev, stat.st_ino)] = prefix
    by_path = {_real(p): p for p in prefixes}
    for prefix in prefixes:
        summary = summaries[prefix] or {}
        parts = summary.get("inputs") if isinstance(summary.get("inputs"), list) else []
        base = os.path.dirname(os.path.abspath(prefix))
        inside = [by_path[r] for part in parts if isinstance(part, str)
                  for r in {_real(part), _real(os.path.join(base, part))} if r in by_path and
                  by_path[r] != prefix]
        if inside:
            raise DataError(f"--input: {prefix} is a merge of {', '.join(sorted(set(inside)))}, "
                            "which are inputs too; every document of them would be merged twice: "
                            f"leave out {prefix} or them")
    digests: dict[str, str] = {}
    for prefix in prefixes:
        digest = ((summaries[prefix] or {}).get("checksum") or {}).get("bin")
        if digest and digests.setdefault(digest, prefix) != prefix:
            raise DataError(f"--input: {prefix} and {digests[digest]} hold the same tokens (equal "
                            "sha256 in their summaries); every document would be merged twice: "
                            "give each dataset once")


def _real(path: str) -> str:
    return os.path.realpath(path)


def _tokenizer_of(prefixes: list[str], summaries: dict[str, dict | None]) -> dict | None:
    """The tokenizer every input's summary names; inputs tokenized differently are refused, and an
    output made partly of inputs that record none records none either (with a warning)."""
    named = {p: s["tokenizer"] for p, s in summaries.items() if s and "tokenizer" in s}
    kinds = {(t.get("type"), t.get("vocab_size"), t.get("eod")) for t in named.values()}
    if len(kinds) > 1:
        described = "; ".join(f"{p}: {t.get('type')} ({t.get('vocab_size')} tokens)" for p,
                              t in named.items())
        raise DataError(f"the inputs were tokenized differently ({described}); merge only datasets "
                        "made with the same tokenizer")
    if named and len(named) < len(prefixes):
        unknown = [p for p in prefixes if p not in named]
        print(f"warning: no tokenizer recorded for {', '.join(unknown)} (no .summary.json, or none "
              f"in it); the others were tokenized with {next(iter(named.values())).get('type')}, "
              "but nothing says these were: the output records no tokenizer, so training cannot "
              "check it", file=sys.stderr)
        return None
    return next(iter(named.values())) if named else None


def merge(prefixes: list[str], output_prefix: str) -> dict:
    """Write ``output_prefix`` from ``prefixes`` in order; returns its summary."""
    summaries = {p: read_summary(p) for p in prefixes}  # a damaged one is refused, naming it
    check_no_duplicates(prefixes, summaries)
    tokenizer = _tokenizer_of(prefixes, summaries)
    datasets = [IndexedDataset(p) for p in prefixes]
    dtypes = {ds.dtype for ds in datasets}
    if len(dtypes) > 1:
        raise DataError("inputs have different token dtypes "
                        f"({', '.join(sorted(map(str, dtypes)))}); merge only datasets made with "
                        "the same tokenizer")
    if sum(ds.num_documents for ds in datasets) == 0:
        raise DataError(f"the {len(prefixes)} inputs hold no documents; nothing to merge (nothing "
                        "was written)")
    sizes = [os.path.getsize(p + ".bin") + os.path.getsize(p + ".idx") for p in prefixes]
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    check_free_space(output_prefix + ".bin", sum(sizes), _FIX_SPACE)
    builder = IndexedDatasetBuilder(output_prefix + ".bin.tmp", datasets[0].dtype)
    try:
        with full_disk_guard(output_prefix + ".bin", sum(sizes), _FIX_SPACE), \
                progress_bar(sum(os.path.getsize(p + ".bin") for p in prefixes), "merging") as bar:
            for prefix in prefixes:
                builder.add_index(prefix, progress=bar.update)
            builder.finalize(output_prefix + ".idx.tmp")
            summary = _summary(prefixes, summaries, tokenizer, builder, datasets[0].dtype.name)
            with open(output_prefix + ".summary.json.tmp", "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=1)
                f.write("\n")
    except BaseException:
        builder.close()
        for suffix in (".bin.tmp", ".idx.tmp", ".summary.json.tmp"):
            if os.path.exists(output_prefix + suffix):
                os.remove(output_prefix + suffix)
        raise
    if os.path.exists(output_prefix + ".idx"):
        os.remove(output_prefix + ".idx")  # --overwrite: the old pair stops looking complete first
    os.replace(output_prefix + ".bin.tmp", output_prefix + ".bin")
    os.replace(output_prefix + ".summary.json.tmp", output_prefix + ".summary.json")
    os.replace(output_prefix + ".idx.tmp", output_prefix + ".idx")
    return summary


def _summary(prefixes, summaries, tokenizer, builder: IndexedDatasetBuilder, dtype: str) -> dict:
    """The output's summary: counts, its checksum, and where it came from (absolute paths and
    checksums: a later merge given this output and its inputs together finds them)."""
    summary = {"format": SUMMARY_FORMAT, "dtype": dtype,
               "inputs": [os.path.abspath(p) for p in prefixes],
               "input_checksums": [((summaries[p] or {}).get("checksum") or {}).get("bin")
                                   for p in prefixes], "documents": builder.document_count,
               "sequences": builder.sequence_count, "tokens": builder.token_count,
               "max_token_id": builder.max_token,
               "checksum": {"algorithm": "sha256", "bin": builder.checksum},
               "created": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    if tokenizer is not None:
        summary["tokenizer"] = tokenizer
    if all(summaries.values()):
        summary["append_eod"] = all(s.get("append_eod") for s in summaries.values())
    return summary


@user_errors
def main(argv: list[str] | None = None) -> int:
    p = ToolParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="prefixes, or directories of "
                                                             ".bin/.idx pairs")
    p.add_argument("--output-prefix", required=True,
                   help="writes OUTPUT_PREFIX.bin/.idx/.summary.json")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output dataset")
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        prefixes = input_prefixes(args.input)
        out = os.path.abspath(args.output_prefix)
        if out in {os.path.abspath(x) for x in prefixes}:
            raise DataError(f"--output-prefix {args.output_prefix} is also an input")
        existing = [out + s for s in (".bin", ".idx", ".summary.json") if os.path.exists(out + s)]
        if not args.overwrite and existing:
            raise FileExistsError(f"{existing[0]} already exists; pass --overwrite to replace it")
        summary = merge(prefixes, args.output_prefix)
    except WrongKindError:
        raise  # one line, exit status 2 (bad input)
    except (OSError, ValueError) as e:
        print_error(e)
        return 1
    print(f"{args.output_prefix}: merged {len(prefixes)} inputs, {summary['documents']:,} "
          f"documents, {summary['tokens']:,} tokens, "
          f"{size_text(os.path.getsize(args.output_prefix + '.bin'))} in "
          f"{time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
