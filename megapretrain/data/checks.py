"""Data and model must agree before the first step.

A dataset tokenized with another tokenizer, or holding ids past the model's vocabulary, trains on
garbage or crashes deep inside the embedding (a device-side assert on a GPU). So before any work:

- a prefix's ``.summary.json`` (written by ``tools/preprocess_data.py`` and ``merge_datasets.py``)
  names the tokenizer; its type and vocabulary size must be those of ``data.tokenizer``;
- the largest token id in every ``.bin`` must lie below ``model.vocab_size`` (the real vocabulary:
  padding rows are not tokens). It is read from the summary when recorded, else computed over the
  memory map in chunks and cached beside the run's sample indices, keyed by the file's size and
  modification time.
"""

from __future__ import annotations

import json
import os

from ..errors import ConfigError, DataError, MissingFileError, read_json_file
from .gpt_dataset import parse_data_paths
from .indexed_dataset import IndexedDataset, data_file_path, dataset_exists
from .tokenizers import build_tokenizer

_CHUNK = 1 << 24  # tokens per pass over the memory map


def check_split(split: list) -> None:
    """``data.split``: three non-negative weights [train, valid, test], train above zero."""
    if not (len(split) == 3 and all(isinstance(x, (int, float)) and x >= 0 for x in split) and split[0] > 0):
        raise ConfigError(f"data.split={split} must be three non-negative weights [train, valid, test] "
                          "with train > 0, e.g. [98, 2, 0]")


def read_summary(prefix: str) -> dict | None:
    """The preprocessing summary of ``prefix``, or None when there is none (e.g. Megatron-made data)."""
    path = prefix + ".summary.json"
    if not os.path.exists(path):
        return None
    summary = read_json_file(path, DataError, "re-create it with tools/preprocess_data.py, or delete it")
    if not isinstance(summary, dict):
        raise DataError(f"{path} holds {type(summary).__name__}, not a JSON object; re-create it with "
                        "tools/preprocess_data.py, or delete it")
    return summary


def max_token_id(prefix: str, cache_dir: str | None) -> int:
    """The largest token id in ``prefix``'s .bin (-1 when empty), cached in ``cache_dir``."""
    path = data_file_path(prefix)
    stat = os.stat(path)
    key = f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}"
    cache = os.path.join(cache_dir, "max_token_ids.json") if cache_dir else None
    known = _read_cache(cache)
    if key in known:
        return int(known[key])
    tokens = IndexedDataset(prefix).tokens  # the whole .bin as one memory-mapped array
    high = -1
    for start in range(0, tokens.size, _CHUNK):
        high = max(high, int(tokens[start:start + _CHUNK].max()))
    if cache:
        os.makedirs(cache_dir, exist_ok=True)
        known[key] = high
        tmp = f"{cache}.tmp-{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(known, fh, indent=1)
        os.replace(tmp, cache)
    return high


def _read_cache(path: str | None) -> dict:
    try:
        with open(path) as fh:
            found = json.load(fh)
        return found if isinstance(found, dict) else {}
    except (TypeError, OSError, ValueError):  # none yet, or a damaged one: computed again
        return {}


def check_data_matches_model(paths, tokenizer_type: str, tokenizer_vocab: int, vocab_size: int,
                             cache_dir: str | None) -> None:
    """Raise a DataError naming the file when a dataset of ``paths`` was made with another
    tokenizer than ``data.tokenizer`` or holds a token id at or past ``model.vocab_size``."""
    for _, prefix in parse_data_paths(paths):
        if not dataset_exists(prefix):
            raise MissingFileError(f"data prefix {prefix}: {prefix}.bin/.idx not found; create it with "
                                   "tools/preprocess_data.py --output-prefix ... (it appends _text_document)")
        summary = read_summary(prefix)
        tok = summary.get("tokenizer") if summary else None
        if isinstance(tok, dict):
            if tok.get("type") != tokenizer_type:
                raise DataError(f"{prefix}.summary.json: the data was tokenized with {tok.get('type')}, but "
                                f"data.tokenizer.type={tokenizer_type}; set data.tokenizer to the one used for "
                                "preprocessing, or tokenize the data again")
            if tok.get("vocab_size") not in (None, tokenizer_vocab):
                raise DataError(f"{prefix}.summary.json: the data's {tokenizer_type} has {tok['vocab_size']} tokens, "
                                f"data.tokenizer ({tokenizer_type} {tokenizer_vocab}) another vocabulary; point "
                                "data.tokenizer.model at the tokenizer used for preprocessing")
        recorded = summary.get("max_token_id") if summary else None
        high = int(recorded) if isinstance(recorded, int) else max_token_id(prefix, cache_dir)
        if high >= vocab_size:
            raise DataError(f"{data_file_path(prefix)}: token id {high} is not below model.vocab_size={vocab_size}; "
                            "the data was tokenized with another tokenizer or vocabulary: tokenize it again with "
                            "data.tokenizer's, or set model.vocab_size to cover it")


def resolve_vocab(cfg) -> int:
    """Fill ``model.vocab_size`` from the tokenizer when unset; check it covers the tokenizer.
    Returns the tokenizer's vocabulary size."""
    tok = cfg.data.tokenizer
    tokenizer_vocab = build_tokenizer(tok.type, tok.model).vocab_size
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = tokenizer_vocab
    elif cfg.model.vocab_size < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the vocabulary of "
                          f"data.tokenizer ({tok.type}: {tokenizer_vocab}); set it to at least "
                          f"{tokenizer_vocab} or to null")
    return tokenizer_vocab
