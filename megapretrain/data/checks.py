"""Data and model must agree, and the data must be what it says, before the first step.

A dataset tokenized with another tokenizer, holding ids past the model's vocabulary, or whose
.bin and .idx do not belong together trains on garbage or crashes deep inside the embedding (a
device-side assert on a GPU). So before any work, the trainer checks what ``tools/inspect_data.py``
checks, for every prefix of ``data.paths``:

- a prefix's ``.summary.json`` (written by ``tools/preprocess_data.py`` and ``merge_datasets.py``)
  is well formed and names the tokenizer; its type and vocabulary size must be those of
  ``data.tokenizer``;
- the .idx header and sizes, the pointers following the lengths, the document indices, and the
  .bin size they describe (:func:`~megapretrain.data.indexed_dataset.index_problems`);
- one pass over the .bin: its largest token id must lie below ``model.vocab_size`` (the real
  vocabulary: padding rows are not tokens), and it must match the summary's sha256, documents,
  tokens and largest id when the summary records them (a .bin of the same size from another
  dataset, or a summary left over from an earlier build, is named).

The pass is made once per file: its result is cached in ``data_checks.json`` beside the run's
sample indices, keyed by the files' sizes and modification times. On a node with several ranks
only local rank 0 makes it (the others read the same files).
"""

from __future__ import annotations

import json
import os

from ..errors import ConfigError, DataError, UserError, read_json_file
from .gpt_dataset import missing_prefix, parse_data_paths
from .indexed_dataset import (
    IndexedDataset,
    data_file_path,
    dataset_exists,
    index_file_path,
    index_problems,
    scan_tokens,
)
from .tokenizers import build_tokenizer

CACHE_FILE = "data_checks.json"
_FIX_SUMMARY = "re-create it with tools/preprocess_data.py, or delete it"
# the summary's fields that are checked, and their types (an absent field is not checked)
_COUNTS = ("documents", "sequences", "tokens", "max_token_id")


def check_split(split: list) -> None:
    """``data.split``: three non-negative weights [train, valid, test], train above zero."""
    if not (len(split) == 3 and all(isinstance(x, (int, float)) and x >= 0 for x in split) and
            split[0] > 0):
        raise ConfigError(f"data.split={split} must be three non-negative weights [train, valid, "
                          "test] with train > 0, e.g. [98, 2, 0]")


def read_summary(prefix: str) -> dict | None:
    """The preprocessing summary of ``prefix``, or None when there is none (e.g. Megatron-made
    data). A summary whose fields are of the wrong type is refused, naming the field: a
    ``tokenizer`` that is not an object would otherwise skip the tokenizer check."""
    path = prefix + ".summary.json"
    if not os.path.exists(path):
        return None
    summary = read_json_file(path, DataError, _FIX_SUMMARY)
    if not isinstance(summary, dict):
        raise DataError(f"{path} holds {type(summary).__name__}, not a JSON object; {_FIX_SUMMARY}")
    wrong = [f"{k}={summary[k]!r} (not an integer)" for k in _COUNTS
             if k in summary and not (_is_int(summary[k]) and summary[k] >= -1)]
    tok = summary.get("tokenizer")
    if "tokenizer" in summary and not (isinstance(tok, dict) and isinstance(tok.get("type"), str)):
        wrong.append(f"tokenizer={tok!r} (not an object with a 'type')")
    elif isinstance(tok, dict):
        wrong += [f"tokenizer.{k}={tok[k]!r} (not an integer)" for k in ("vocab_size", "eod")
                  if tok.get(k) is not None and not _is_int(tok[k])]
    checksum = summary.get("checksum")
    if "checksum" in summary \
            and not (isinstance(checksum, dict) and isinstance(checksum.get("bin"), str)):
        wrong.append(f"checksum={checksum!r} (not an object with a 'bin' sha256)")
    if wrong:
        raise DataError(f"{path}: {', '.join(wrong)}; the summary is damaged: {_FIX_SUMMARY}")
    return summary


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def verified_facts(prefix: str, summary: dict | None, cache_dir: str | None) -> dict:
    """What ``prefix``'s files hold, once they are known to be consistent: its index checked, one
    pass over its .bin (largest id, sha256 when the summary records one) compared with the summary.
    Raises a DataError naming the file on the first inconsistency; the pass is cached."""
    ds = IndexedDataset(prefix)  # header, .idx size, .bin size against the last sequence
    key = _file_key(prefix)
    cache = os.path.join(cache_dir, CACHE_FILE) if cache_dir else None
    known = _read_cache(cache).get(key)
    wants_digest = bool(summary and "checksum" in summary)
    if not (isinstance(known, dict) and (known.get("sha256") or not wants_digest)):
        found = index_problems(os.path.getsize(data_file_path(prefix)), ds.dtype,
                               ds.sequence_lengths, ds.sequence_pointers, ds.document_indices)
        if found:
            check, what = found[0]
            raise DataError(f"{index_file_path(prefix)}: {check}: "
                            f"{what.replace('the .bin', data_file_path(prefix))}; the .idx and "
                            ".bin do not belong together or are damaged: re-create them with "
                            "tools/preprocess_data.py")
        known = scan_tokens(data_file_path(prefix), ds.dtype, digest=wants_digest)
        known.update(documents=ds.num_documents, sequences=len(ds), tokens=ds.num_tokens)
        _write_cache(cache, key, known)
    _compare_with_summary(prefix, summary, known)
    stat = os.stat(data_file_path(prefix))
    return {**known, "bin_bytes": stat.st_size, "modified_ns": stat.st_mtime_ns}


def _compare_with_summary(prefix: str, summary: dict | None, facts: dict) -> None:
    """The summary must describe these files: the .bin's sha256, then the counts and largest id."""
    if not summary:
        return
    path = prefix + ".summary.json"
    if "checksum" in summary and summary["checksum"]["bin"] != facts["sha256"]:
        raise DataError(f"{data_file_path(prefix)}: its sha256 is {facts['sha256'][:16]}..., "
                        f"{path} records {summary['checksum']['bin'][:16]}...: the .bin is not the "
                        "one preprocessing wrote (another dataset's, or changed since); re-create "
                        "the dataset with tools/preprocess_data.py")
    for name in _COUNTS:
        if name in summary and facts.get(name) is not None and summary[name] != facts[name]:
            raise DataError(f"{path} records {name}={summary[name]:,}, the files hold "
                            f"{facts[name]:,}: the summary is stale (left from another build of "
                            f"{prefix}); {_FIX_SUMMARY}")


def _file_key(prefix: str) -> str:
    """The identity of a dataset's files: where they are, their sizes and modification times."""
    parts = [os.path.realpath(data_file_path(prefix))]
    for path in (data_file_path(prefix), index_file_path(prefix)):
        stat = os.stat(path)
        parts += [str(stat.st_size), str(stat.st_mtime_ns)]
    return ":".join(parts)


def _read_cache(path: str | None) -> dict:
    try:
        with open(path) as fh:
            found = json.load(fh)
        return found if isinstance(found, dict) else {}
    except (TypeError, OSError, ValueError):  # none yet, or a damaged one: computed again
        return {}


def _write_cache(path: str | None, key: str, facts: dict) -> None:
    """Add an entry (another process writing at once may drop it: it is then computed again)."""
    if path is None:
        return
    known = _read_cache(path)
    known[key] = facts
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            json.dump(known, fh, indent=1)
        os.replace(tmp, path)
    except OSError:  # a cache that cannot be written costs a pass next time, nothing else
        if os.path.exists(tmp):
            os.remove(tmp)


def check_data_matches_model(paths, tokenizer_type: str, tokenizer_vocab: int, vocab_size: int,
                             cache_dir: str | None, verify: bool = True) -> dict[str, dict]:
    """Raise a DataError naming the file when a dataset of ``paths`` is inconsistent, was made with
    another tokenizer than ``data.tokenizer``, or holds a token id at or past ``model.vocab_size``.
    ``verify=False`` (the other ranks of a node) checks the summaries and headers only. Returns
    each prefix's facts (sizes, counts, largest id, sha256 when computed)."""
    facts = {}
    for _, prefix in parse_data_paths(paths):
        if not dataset_exists(prefix):
            raise missing_prefix(prefix)
        summary = read_summary(prefix)
        tok = summary.get("tokenizer") if summary else None
        if tok is not None:
            if tok["type"] != tokenizer_type:
                raise DataError(f"{prefix}.summary.json: the data was tokenized with "
                                f"{tok['type']}, but data.tokenizer.type={tokenizer_type}; set "
                                "data.tokenizer to the one used for preprocessing, or tokenize the "
                                "data again")
            if tok.get("vocab_size") not in (None, tokenizer_vocab):
                raise DataError(f"{prefix}.summary.json: the data's {tokenizer_type} has "
                                f"{tok['vocab_size']} tokens, data.tokenizer ({tokenizer_type} "
                                f"{tokenizer_vocab}) another vocabulary; point "
                                "data.tokenizer.model at the tokenizer used for preprocessing")
        if not verify:
            IndexedDataset(prefix)  # header and sizes
            continue
        facts[prefix] = found = verified_facts(prefix, summary, cache_dir)
        high = found["max_token_id"]
        if high is not None and high >= vocab_size:
            raise DataError(f"{data_file_path(prefix)}: token id {high} is not below "
                            f"model.vocab_size={vocab_size}; the data was tokenized with another "
                            "tokenizer or vocabulary: tokenize it again with data.tokenizer's, or "
                            "set model.vocab_size to cover it")
        if found["min_token_id"] is not None and found["min_token_id"] < 0:
            raise DataError(f"{data_file_path(prefix)}: negative token id {found['min_token_id']}; "
                            "the file is not token ids: re-create it with tools/preprocess_data.py")
    return facts


def changed_datasets(record_path: str, facts: dict[str, dict]) -> list[str]:
    """Compare ``facts`` with the ones recorded at ``record_path`` by an earlier start of this run,
    then record them: the prefixes whose files are not the same any more (their sha256 when both
    starts computed it, else their size and modification time), one line each."""
    before = _read_cache(record_path)
    changed = []
    for prefix, now in facts.items():
        old = before.get(os.path.realpath(prefix))
        if not isinstance(old, dict):
            continue
        if old.get("sha256") and now.get("sha256"):
            same = old["sha256"] == now["sha256"]
        else:
            same = (old.get("bin_bytes"), old.get("modified_ns")) == (now["bin_bytes"],
                                                                      now["modified_ns"])
        if not same:
            changed.append(f"{prefix}: {old.get('documents')} documents, {old.get('tokens')} "
                           f"tokens when the run started; now {now['documents']} documents, "
                           f"{now['tokens']} tokens (rebuilt)")
    record = {**before, **{os.path.realpath(p): f for p, f in facts.items()}}
    try:
        tmp = f"{record_path}.tmp-{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(record, fh, indent=1)
        os.replace(tmp, record_path)
    except OSError:
        pass  # the run directory was checked writable; losing this record costs only the warning
    return changed


def resolve_vocab(cfg) -> int:
    """Fill ``model.vocab_size`` from the tokenizer when unset; check it covers the tokenizer.
    Returns the tokenizer's vocabulary size."""
    tok = cfg.data.tokenizer
    tokenizer_vocab = build_tokenizer(tok.type, tok.model).vocab_size
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = tokenizer_vocab
    elif cfg.model.vocab_size < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the vocabulary "
                          f"of data.tokenizer ({tok.type}: {tokenizer_vocab}); set it to at least "
                          f"{tokenizer_vocab} or to null")
    return tokenizer_vocab


def vocab_without_data(cfg, purpose: str) -> None:
    """Fill a null ``model.vocab_size`` as :func:`resolve_vocab` does, for a tool that reads no data
    (the planner, the simulator): the tokenizer fixes the vocabulary when it can be read here
    (ByteTokenizer's 257 ids, or a tokenizer file that exists). When it cannot, one line asks for
    the size (never a guess: another model's vocabulary would plan another model)."""
    if cfg.model.vocab_size is not None:
        return
    try:
        resolve_vocab(cfg)
    except UserError as exc:  # a missing file, a missing package
        raise ConfigError(f"model.vocab_size is null and data.tokenizer cannot be read here "
                          f"({exc}); set --model.vocab_size to the tokenizer's vocabulary size "
                          f"for the {purpose}") from None


class DataFileWatch:
    """The files of ``data.paths`` as the run opened them, checked again at each logging step: a
    .bin or .idx rewritten, replaced or removed under a running job changes what its memory maps
    read (a same-size overwrite in place silently, from the next page read). Only ``os.stat``
    (size, modification time, inode): a few microseconds a file, never a hash on the training
    path."""

    def __init__(self, prefixes):
        self.files = [path for prefix in prefixes
                      for path in (data_file_path(prefix), index_file_path(prefix))]
        self.seen = {path: _identity(path) for path in self.files}

    def changed(self) -> str | None:
        """What changed in the first file found changed since the run opened it, or None."""
        for path in self.files:
            before, now = self.seen[path], _identity(path)
            if now != before:
                return f"{path} {_difference(before, now)} since the run opened it"
        return None


def _identity(path: str) -> tuple[int, int, int] | None:
    """(size, modification time in ns, inode) of ``path``, or None when it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def _difference(before, now) -> str:
    if now is None:
        return "was removed"
    if before is None:
        return "appeared"
    if now[2] != before[2]:
        return "was replaced by another file (another inode)"
    if now[0] != before[0]:
        return f"changed size from {before[0]:,} to {now[0]:,} bytes"
    return "was written in place (same size and inode, modification time changed)"
