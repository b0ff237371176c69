#!/usr/bin/env python
"""Join indexed datasets (shards, partitions) into one prefix, streaming: nothing is loaded whole.

    python tools/merge_datasets.py --input data/shard_a_text_document data/shard_b_text_document \\
        --output-prefix data/all_text_document
    python tools/merge_datasets.py --input shards/ --output-prefix data/all_text_document  # every prefix in it

Like Megatron-LM's tools/merge_datasets.py, ``--input`` may be a directory, whose .bin/.idx pairs are
joined in sorted name order; here it may also be a list of prefixes, joined in the order given.
The documents keep their order and boundaries; the inputs must share one token dtype. Output goes
to temporary names renamed when complete (the .idx last), never over an existing dataset without
``--overwrite``, with a ``.summary.json`` (counts, sha256 of the .bin, the inputs' tokenizer).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from megapretrain.cli import print_error, user_errors
from megapretrain.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, dataset_exists

SUMMARY_FORMAT = "megapretrain-preprocess-summary-v1"


def input_prefixes(inputs: list[str]) -> list[str]:
    """Prefixes named directly, or every complete .bin/.idx pair in a directory (sorted by name)."""
    prefixes = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(item, name[:-4]) for name in os.listdir(item) if name.endswith(".idx"))
            found = [p for p in found if dataset_exists(p)]
            if not found:
                raise FileNotFoundError(f"--input {item}: the directory holds no .bin/.idx pair")
            prefixes += found
        elif dataset_exists(item):
            prefixes.append(item)
        else:
            raise FileNotFoundError(f"--input {item}: {item}.bin/.idx not found (give a prefix or a directory)")
    return prefixes


def _tokenizer_of(prefixes: list[str]) -> dict | None:
    """The tokenizer the inputs' summaries name; inputs tokenized differently are refused."""
    named = {}
    for prefix in prefixes:
        tok = (_read_summary(prefix) or {}).get("tokenizer")
        if isinstance(tok, dict):
            named[prefix] = tok
    kinds = {(t.get("type"), t.get("vocab_size"), t.get("eod")) for t in named.values()}
    if len(kinds) > 1:
        described = "; ".join(f"{p}: {t.get('type')} ({t.get('vocab_size')} tokens)" for p, t in named.items())
        raise ValueError(f"the inputs were tokenized differently ({described}); merge only datasets made "
                         "with the same tokenizer")
    if named and len(named) < len(prefixes):
        unknown = [p for p in prefixes if p not in named]
        print(f"warning: no tokenizer recorded for {', '.join(unknown)} (no .summary.json); the output "
              f"records {next(iter(named.values())).get('type')} from the others", file=sys.stderr)
    return next(iter(named.values())) if named else None


def merge(prefixes: list[str], output_prefix: str) -> dict:
    """Write ``output_prefix`` from ``prefixes`` in order; returns its summary."""
    tokenizer = _tokenizer_of(prefixes)
    datasets = [IndexedDataset(p) for p in prefixes]
    dtypes = {ds.dtype for ds in datasets}
    if len(dtypes) > 1:
        raise ValueError(f"inputs have different token dtypes ({', '.join(sorted(map(str, dtypes)))}); "
                         "merge only datasets made with the same tokenizer")
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(output_prefix + ".bin.tmp", datasets[0].dtype)
    try:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(output_prefix + ".idx.tmp")
    except BaseException:
        builder.close()
        for suffix in (".bin.tmp", ".idx.tmp"):
            if os.path.exists(output_prefix + suffix):
                os.remove(output_prefix + suffix)
        raise
    summary = {"format": SUMMARY_FORMAT, "dtype": datasets[0].dtype.name, "inputs": prefixes,
               "documents": builder.document_count, "sequences": builder.sequence_count,
               "tokens": builder.token_count, "max_token_id": builder.max_token,
               "checksum": {"algorithm": "sha256", "bin": builder.checksum},
               "created": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    sources = [_read_summary(p) for p in prefixes]
    if tokenizer is not None:
        summary["tokenizer"] = tokenizer
    if all(sources):
        summary["append_eod"] = all(s.get("append_eod") for s in sources)
    with open(output_prefix + ".summary.json.tmp", "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    if os.path.exists(output_prefix + ".idx"):
        os.remove(output_prefix + ".idx")  # --overwrite: the old pair stops looking complete first
    os.replace(output_prefix + ".bin.tmp", output_prefix + ".bin")
    os.replace(output_prefix + ".summary.json.tmp", output_prefix + ".summary.json")
    os.replace(output_prefix + ".idx.tmp", output_prefix + ".idx")
    return summary


def _read_summary(prefix: str) -> dict | None:
    try:
        with open(prefix + ".summary.json", encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


@user_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="prefixes, or directories of .bin/.idx pairs")
    p.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin/.idx/.summary.json")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output dataset")
    args = p.parse_args(argv)
    try:
        prefixes = input_prefixes(args.input)
        out = os.path.abspath(args.output_prefix)
        if out in {os.path.abspath(x) for x in prefixes}:
            raise ValueError(f"--output-prefix {args.output_prefix} is also an input")
        existing = [out + s for s in (".bin", ".idx", ".summary.json") if os.path.exists(out + s)]
        if not args.overwrite and existing:
            raise FileExistsError(f"{existing[0]} already exists; pass --overwrite to replace it")
        summary = merge(prefixes, args.output_prefix)
    except (OSError, ValueError) as e:
        print_error(e)
        return 1
    print(f"{args.output_prefix}: {len(prefixes)} inputs, {summary['documents']} documents, "
          f"{summary['tokens']} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
