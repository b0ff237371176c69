"""Tokenizers behind one small interface: ids in, text out, and the end-of-document id.

The type names are Megatron-LM's (``--tokenizer-type``), so preprocessing scripts carry over.
Every tokenizer turns text into plain ids: no BOS/EOS is added here; preprocessing appends ``eod``
itself, so the .bin files hold exactly ``tokenize(text) + [eod]`` per document.

Backends (``tokenizers``, ``sentencepiece``, ``tiktoken``) are optional and imported only when their
tokenizer is built; a missing one is a one-line error naming the package to install.
"""

from __future__ import annotations

import base64
import importlib
import os
from typing import Sequence

import numpy as np

# Special tokens tried, in order, to find a HuggingFace tokenizer's end-of-document id.
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


class Tokenizer:
    """Base class: subclasses set ``name``, ``vocab_size`` and ``eod`` and implement tokenize/detokenize."""

    name: str = ""
    vocab_size: int = 0
    eod: int = 0

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def tokenize_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """One integer array of ids per text; subclasses override this with a faster batched path."""
        return [np.asarray(self.tokenize(text), dtype=np.int64) for text in texts]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255 and ``eod`` = 256: needs no model file, so tests and demos use it."""

    name = "ByteTokenizer"
    vocab_size = 257
    eod = 256

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        # eod (and anything else outside 0..255) is not a byte of the text: drop it.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def tokenize_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # A zero-copy view of the encoded bytes: the fast path for preprocessing.
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]


class _HFBackedTokenizer(Tokenizer):
    """Shared code for tokenizers built on the ``tokenizers`` library (HuggingFace and GPT-2 BPE)."""

    def __init__(self, backend, eod: int):
        self._backend = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.eod = eod

    def tokenize(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def tokenize_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(enc.ids, dtype=np.int64) for enc in encodings]


class HuggingFaceTokenizer(_HFBackedTokenizer):
    """A ``tokenizer.json`` (or a directory holding one) loaded with ``tokenizers.Tokenizer.from_file``."""

    name = "HuggingFaceTokenizer"

    def __init__(self, model: str | None):
        tokenizers = _import_optional("tokenizers", "HuggingFaceTokenizer")
        path = _require_path(model, "HuggingFaceTokenizer", "a tokenizer.json file or a directory holding one")
        if os.path.isdir(path):
            path = _require_path(os.path.join(path, "tokenizer.json"), "HuggingFaceTokenizer",
                                 "a tokenizer.json file or a directory holding one")
        backend = tokenizers.Tokenizer.from_file(path)
        eod = next((backend.token_to_id(t) for t in EOD_CANDIDATES if backend.token_to_id(t) is not None), None)
        if eod is None:
            raise ValueError(f"HuggingFaceTokenizer {path}: none of the end-of-document tokens "
                             f"{', '.join(EOD_CANDIDATES)} is in the vocabulary; add one as a special token")
        super().__init__(backend, eod)


class GPT2BPETokenizer(_HFBackedTokenizer):
    """Byte-level BPE from GPT-2 style ``vocab.json`` + ``merges.txt``; ``eod`` is ``<|endoftext|>``."""

    name = "GPT2BPETokenizer"

    def __init__(self, model: str | None, vocab_file: str | None, merge_file: str | None):
        tokenizers = _import_optional("tokenizers", "GPT2BPETokenizer")
        what = "a directory with vocab.json and merges.txt (or --vocab-file and --merge-file)"
        if vocab_file is None and merge_file is None:
            directory = _require_path(model, "GPT2BPETokenizer", what)
            vocab_file = os.path.join(directory, "vocab.json")
            merge_file = os.path.join(directory, "merges.txt")
        vocab_file = _require_path(vocab_file, "GPT2BPETokenizer", f"vocab.json from {what}")
        merge_file = _require_path(merge_file, "GPT2BPETokenizer", f"merges.txt from {what}")
        backend = tokenizers.ByteLevelBPETokenizer(vocab_file, merge_file, add_prefix_space=False)
        eod = backend.token_to_id("<|endoftext|>")
        if eod is None:
            raise ValueError(f"GPT2BPETokenizer {vocab_file}: '<|endoftext|>' is not in the vocabulary")
        super().__init__(backend, eod)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model``; ``eod`` is the model's EOS id."""

    name = "SentencePieceTokenizer"

    def __init__(self, model: str | None):
        sentencepiece = _import_optional("sentencepiece", "SentencePieceTokenizer")
        path = _require_path(model, "SentencePieceTokenizer", "a SentencePiece .model file")
        self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise ValueError(f"SentencePieceTokenizer {path}: the model defines no EOS piece (eos_id = -1)")

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text, add_bos=False, add_eos=False)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def tokenize_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        batch = self._sp.encode(list(texts), add_bos=False, add_eos=False)
        return [np.asarray(ids, dtype=np.int64) for ids in batch]


# Megatron-LM's TikTokenizer layout: the first NUM_TIKTOKEN_SPECIALS ids are special tokens
# (<unk>, <s>, </s>, then fillers) and the BPE ranks follow, shifted by that amount.
TIKTOKEN_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_TIKTOKEN_SPECIALS = 1000
TIKTOKEN_SPECIALS = ("<unk>", "<s>", "</s>")


class TikTokenizer(Tokenizer):
    """A ``.tiktoken`` rank file (base64 token, rank per line) run by ``tiktoken``; ``eod`` is ``</s>``."""

    name = "TikTokenizer"

    def __init__(self, model: str | None):
        tiktoken = _import_optional("tiktoken", "TikTokenizer")
        path = _require_path(model, "TikTokenizer", "a .tiktoken rank file")
        ranks = _load_tiktoken_ranks(path)
        self._enc = tiktoken.Encoding(name=os.path.basename(path), pat_str=TIKTOKEN_PATTERN,
                                      mergeable_ranks=ranks, special_tokens={})
        self._specials = list(TIKTOKEN_SPECIALS) + [f"<SPECIAL_{i}>" for i in
                                                    range(len(TIKTOKEN_SPECIALS), NUM_TIKTOKEN_SPECIALS)]
        self.vocab_size = NUM_TIKTOKEN_SPECIALS + len(ranks)
        self.eod = TIKTOKEN_SPECIALS.index("</s>")

    def tokenize(self, text: str) -> list[int]:
        return [i + NUM_TIKTOKEN_SPECIALS for i in self._enc.encode_ordinary(text)]

    def detokenize(self, ids: Sequence[int]) -> str:
        pieces, run = [], []
        for i in (int(i) for i in ids):
            if i >= NUM_TIKTOKEN_SPECIALS:
                run.append(i - NUM_TIKTOKEN_SPECIALS)
                continue
            pieces.append(self._enc.decode(run))
            run = []
            pieces.append(self._specials[i])
        pieces.append(self._enc.decode(run))
        return "".join(pieces)

    def tokenize_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        batch = self._enc.encode_ordinary_batch(list(texts))
        return [np.asarray(ids, dtype=np.int64) + NUM_TIKTOKEN_SPECIALS for ids in batch]


def _load_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """Read ``base64-token rank`` lines (the .tiktoken format) into tiktoken's mergeable-ranks dict."""
    ranks = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
            except ValueError:
                raise ValueError(f"{path}:{lineno}: expected '<base64 token> <rank>', got {line[:60]!r}") from None
    return ranks


TOKENIZER_TYPES = ("ByteTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer",
                   "SentencePieceTokenizer", "TikTokenizer")


def build_tokenizer(tokenizer_type: str, model: str | None = None, vocab_file: str | None = None,
                    merge_file: str | None = None) -> Tokenizer:
    """Build a tokenizer by its Megatron-LM type name; ``model`` is its file or directory (see DESIGN.md §4)."""
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(model)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(model, vocab_file, merge_file)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(model)
    if tokenizer_type == "TikTokenizer":
        return TikTokenizer(model)
    raise ValueError(f"unknown tokenizer type {tokenizer_type!r}; valid types: {', '.join(TOKENIZER_TYPES)}")


def _require_path(path: str | None, tokenizer_type: str, expected: str) -> str:
    """Return ``path`` if it exists, else fail with one line naming the path and what was expected."""
    if not path:
        raise FileNotFoundError(f"{tokenizer_type} needs a model path: {expected} (--tokenizer-model / "
                                "data.tokenizer.model)")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{tokenizer_type}: {path} does not exist; expected {expected}")
    return path


def _import_optional(module: str, tokenizer_type: str):
    """Import an optional backend, or fail with one line saying which package to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{tokenizer_type} needs the '{module}' package: pip install {module}") from None

