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
import importlib.util
import json
import os
from collections.abc import Sequence

import numpy as np

from ..errors import DataError, MissingFileError, MissingPackageError, UserError

# Special tokens tried, in order, to find a HuggingFace tokenizer's end-of-document id.
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


class Tokenizer:
    """Base class: subclasses set ``name``, ``vocab_size`` and ``eod`` and implement
    tokenize/detokenize."""

    name: str = ""
    vocab_size: int = 0
    eod: int = 0

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def tokenize_batch(self, texts: Sequence[str], threads: int = 1) -> list[np.ndarray]:
        """One integer array of ids per text; subclasses override this with a faster batched path,
        which may use up to ``threads`` threads (the backends release the GIL)."""
        return [np.asarray(self.tokenize(text), dtype=np.int64) for text in texts]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255 and ``eod`` = 256: needs no model file, so tests and demos use
    it."""

    name = "ByteTokenizer"
    vocab_size = 257
    eod = 256

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        # eod (and anything else outside 0..255) is not a byte of the text: drop it.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def tokenize_batch(self, texts: Sequence[str], threads: int = 1) -> list[np.ndarray]:
        # A zero-copy view of the encoded bytes: the fast path for preprocessing.
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]


class _HFBackedTokenizer(Tokenizer):
    """Shared code for tokenizers built on the ``tokenizers`` library (HuggingFace and GPT-2
    BPE)."""

    def __init__(self, backend, eod: int):
        self._backend = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.eod = eod

    def tokenize(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def tokenize_batch(self, texts: Sequence[str], threads: int = 1) -> list[np.ndarray]:
        # Multi-threaded in Rust unless TOKENIZERS_PARALLELISM=false (set in forked workers).
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(enc.ids, dtype=np.int64) for enc in encodings]


class HuggingFaceTokenizer(_HFBackedTokenizer):
    """A ``tokenizer.json`` (or a directory holding one) loaded with
    ``tokenizers.Tokenizer.from_file``."""

    name = "HuggingFaceTokenizer"

    def __init__(self, model: str | None):
        tokenizers = _import_optional("tokenizers", "HuggingFaceTokenizer")
        path = _require_path(model, "HuggingFaceTokenizer",
                             "a tokenizer.json file or a directory holding one")
        if os.path.isdir(path):
            path = _require_path(os.path.join(path, "tokenizer.json"), "HuggingFaceTokenizer",
                                 "a tokenizer.json file or a directory holding one")
        backend = tokenizers.Tokenizer.from_file(path)
        eod = next((backend.token_to_id(t) for t in EOD_CANDIDATES
                    if backend.token_to_id(t) is not None), None)
        if eod is None:
            raise DataError(f"HuggingFaceTokenizer {path}: none of the end-of-document tokens "
                             f"{', '.join(EOD_CANDIDATES)} is in the vocabulary; add one as a "
                             "special token")
        super().__init__(backend, eod)


class GPT2BPETokenizer(Tokenizer):
    """Byte-level BPE from GPT-2 style ``vocab.json`` + ``merges.txt``; ``eod`` is
    ``<|endoftext|>``.

    Text is encoded as ordinary text, the way GPT-2's ``encoder.py`` (and so Megatron-LM's
    GPT2BPETokenizer) does: a literal ``<|endoftext|>`` in a document is spelled out, not mapped to
    eod. Backend: ``tiktoken`` where installed (7x faster than ``tokenizers`` on the stdlib corpus,
    and it releases the GIL); the BPE ranks are the merge order of merges.txt, so its output is
    GPT-2's (tools/bench_data.py --verify-gpt2 checks every token of a corpus against
    ``tokenizers``). ``backend="tokenizers"`` forces the HuggingFace implementation.
    """

    name = "GPT2BPETokenizer"

    def __init__(self, model: str | None, vocab_file: str | None, merge_file: str | None,
                 backend: str = "auto"):
        what = "a directory with vocab.json and merges.txt (or --vocab-file and --merge-file)"
        if vocab_file is None and merge_file is None:
            directory = _require_path(model, "GPT2BPETokenizer", what)
            vocab_file = os.path.join(directory, "vocab.json")
            merge_file = os.path.join(directory, "merges.txt")
        vocab_file = _require_path(vocab_file, "GPT2BPETokenizer", f"vocab.json from {what}")
        merge_file = _require_path(merge_file, "GPT2BPETokenizer", f"merges.txt from {what}")
        with open(vocab_file, encoding="utf-8") as f:
            vocab: dict[str, int] = json.load(f)
        if "<|endoftext|>" not in vocab:
            raise DataError(f"GPT2BPETokenizer {vocab_file}: '<|endoftext|>' is not in the "
                            "vocabulary")
        self.eod = vocab["<|endoftext|>"]
        self.vocab_size = max(vocab.values()) + 1
        self._id_to_bytes = {i: _bytes_of_token(t) for t, i in vocab.items()}
        self._tiktoken = None
        if backend in ("auto", "tiktoken") and importlib.util.find_spec("tiktoken") is not None:
            self._tiktoken = _gpt2_tiktoken(vocab, merge_file)
        if self._tiktoken is None:
            if backend == "tiktoken":
                raise MissingPackageError("GPT2BPETokenizer backend='tiktoken' needs the "
                                          "'tiktoken' package and merges.txt "
                                  "tokens that are all in vocab.json")
            tokenizers = _import_optional("tokenizers", "GPT2BPETokenizer")
            self._hf = tokenizers.ByteLevelBPETokenizer(vocab_file, merge_file,
                                                        add_prefix_space=False)
        self.backend = "tiktoken" if self._tiktoken is not None else "tokenizers"

    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_batch([text])[0].tolist()

    def detokenize(self, ids: Sequence[int]) -> str:
        return b"".join(self._id_to_bytes[int(i)] for i in ids).decode("utf-8", errors="replace")

    def tokenize_batch(self, texts: Sequence[str], threads: int = 1) -> list[np.ndarray]:
        """Ids per text; ``threads`` > 1 encodes in that many threads (tiktoken releases the
        GIL)."""
        if self._tiktoken is None:
            return [np.asarray(e.ids, dtype=np.int64)
                    for e in self._hf.encode_batch(list(texts), add_special_tokens=False)]
        encoding, rank_to_id = self._tiktoken
        if threads > 1:
            batch = encoding.encode_ordinary_batch(list(texts), num_threads=threads)
        else:
            batch = [encoding.encode_ordinary(t) for t in texts]
        if rank_to_id is None:  # GPT-2's own files: rank == id
            return [np.array(ids, dtype=np.int64) for ids in batch]
        return [rank_to_id[np.array(ids, dtype=np.int64)] for ids in batch]


# GPT-2's pre-tokenizer regex (encoder.py), in tiktoken's spelling.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's map from the printable stand-in characters of vocab.json back to bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_BYTE_DECODER = _gpt2_byte_decoder()
_BYTE_ENCODER = {b: c for c, b in _BYTE_DECODER.items()}


def _bytes_of_token(token: str) -> bytes:
    """The bytes a vocab.json token stands for (special tokens such as <|endoftext|> as their
    UTF-8)."""
    if all(c in _BYTE_DECODER for c in token):
        return bytes(_BYTE_DECODER[c] for c in token)
    return token.encode("utf-8")


def _gpt2_tiktoken(vocab: dict[str, int], merge_file: str):
    """(tiktoken Encoding, rank->id table or None) for GPT-2 style files, or None if they do not
    map.

    Ranks: the 256 single bytes, then each merge's result in merges.txt order (merge priority, what
    tiktoken needs); a table maps ranks to vocab.json ids unless they already coincide.
    """
    import tiktoken

    byte_ids = [vocab.get(_token_of_bytes(bytes([b]))) for b in range(256)]
    # GPT-2's layout: rank = id
    if sorted(i for i in byte_ids if i is not None) == list(range(256)):
        ranks: dict[bytes, int] = {bytes([b]): byte_ids[b] for b in range(256)}
        ids = list(range(256))  # ids[rank]
    else:
        ranks = {bytes([b]): b for b in range(256)}
        ids = byte_ids
    with open(merge_file, encoding="utf-8") as f:
        for line in f:
            parts = line.split()
            if len(parts) != 2 or line.startswith("#version"):
                continue
            merged = parts[0] + parts[1]
            token = _bytes_of_token(merged)
            if token in ranks:
                continue
            ranks[token] = len(ids)
            ids.append(vocab.get(merged))
    if any(i is None for i in ids):
        # a byte or merge result missing from vocab.json: leave these files to `tokenizers`
        return None
    encoding = tiktoken.Encoding(name="gpt2-bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                 special_tokens={})
    table = np.asarray(ids, dtype=np.int64)
    return encoding, (None if np.array_equal(table, np.arange(table.size)) else table)


def _token_of_bytes(data: bytes) -> str:
    return "".join(_BYTE_ENCODER[b] for b in data)


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
            raise DataError(f"SentencePieceTokenizer {path}: the model defines no EOS piece "
                            "(eos_id = -1)")

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text, add_bos=False, add_eos=False)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def tokenize_batch(self, texts: Sequence[str], threads: int = 1) -> list[np.ndarray]:
        batch = self._sp.encode(list(texts), add_bos=False, add_eos=False, num_threads=threads)
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
    """A ``.tiktoken`` rank file (base64 token, rank per line) run by ``tiktoken``; ``eod`` is
    ``</s>``."""

    name = "TikTokenizer"

    def __init__(self, model: str | None):
        tiktoken = _import_optional("tiktoken", "TikTokenizer")
        path = _require_path(model, "TikTokenizer", "a .tiktoken rank file")
        ranks = _load_tiktoken_ranks(path)
        self._enc = tiktoken.Encoding(name=os.path.basename(path), pat_str=TIKTOKEN_PATTERN,
                                      mergeable_ranks=ranks, special_tokens={})
        self._specials = list(TIKTOKEN_SPECIALS) + [f"<SPECIAL_{i}>" for i in
                                                    range(len(TIKTOKEN_SPECIALS),
                                                          NUM_TIKTOKEN_SPECIALS)]
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

    def tokenize_batch(self, texts: Sequence[str], threads: int = 1) -> list[np.ndarray]:
        if threads > 1:
            batch = self._enc.encode_ordinary_batch(list(texts), num_threads=threads)
        else:
            batch = [self._enc.encode_ordinary(t) for t in texts]
        return [np.asarray(ids, dtype=np.int64) + NUM_TIKTOKEN_SPECIALS for ids in batch]


def _load_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """Read ``base64-token rank`` lines (the .tiktoken format) into tiktoken's mergeable-ranks
    dict."""
    ranks = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
            except ValueError:
                raise DataError(f"{path}:{lineno}: expected '<base64 token> <rank>', got "
                                f"{line[:60]!r}") from None
    return ranks


TOKENIZER_TYPES = ("ByteTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer",
                   "SentencePieceTokenizer", "TikTokenizer")


def build_tokenizer(tokenizer_type: str, model: str | None = None, vocab_file: str | None = None,
                    merge_file: str | None = None) -> Tokenizer:
    """Build a tokenizer by its Megatron-LM type name; ``model`` is its file or directory (see the
    README, "Tokenizer types"). A file the chosen type would not read is refused, never ignored."""
    if tokenizer_type == "ByteTokenizer" and (model or vocab_file or merge_file):
        given = ", ".join(str(p) for p in (model, vocab_file, merge_file) if p)
        raise DataError(f"ByteTokenizer reads no tokenizer file, but {given} was given; drop "
                        "--tokenizer-model / data.tokenizer.model (set it to null), or choose the "
                        "tokenizer type that file is for")
    if tokenizer_type not in ("ByteTokenizer", "GPT2BPETokenizer") and (vocab_file or merge_file):
        raise DataError(f"--vocab-file / --merge-file are GPT2BPETokenizer's; {tokenizer_type} "
                        "reads only --tokenizer-model: drop them")
    if tokenizer_type == "GPT2BPETokenizer" and model and (vocab_file or merge_file):
        raise DataError(f"GPT2BPETokenizer: give either --tokenizer-model {model} (a directory "
                        "with vocab.json and merges.txt) or --vocab-file and --merge-file, not "
                        "both")
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    make = {"HuggingFaceTokenizer": lambda: HuggingFaceTokenizer(model),
            "GPT2BPETokenizer": lambda: GPT2BPETokenizer(model, vocab_file, merge_file),
            "SentencePieceTokenizer": lambda: SentencePieceTokenizer(model),
            "TikTokenizer": lambda: TikTokenizer(model)}.get(tokenizer_type)
    if make is None:
        raise DataError(f"unknown tokenizer type {tokenizer_type!r}; valid types: "
                        f"{', '.join(TOKENIZER_TYPES)}")
    try:
        return make()
    except UserError:
        raise
    except Exception as exc:  # the backend's own parse error for a damaged or foreign file
        files = ", ".join(str(p) for p in (model, vocab_file, merge_file) if p)
        raise DataError(f"{tokenizer_type} cannot load {files} ({type(exc).__name__}: "
                        f"{str(exc)[:200]}); check that it is a tokenizer file of this type "
                        "(data.tokenizer.model / --tokenizer-model)") from None


def _require_path(path: str | None, tokenizer_type: str, expected: str) -> str:
    """Return ``path`` if it exists, else fail with one line naming the path and what was
    expected."""
    if not path:
        raise MissingFileError(f"{tokenizer_type} needs a model path: {expected} "
                               "(--tokenizer-model / data.tokenizer.model)")
    if not os.path.exists(path):
        raise MissingFileError(f"{tokenizer_type}: {path} does not exist; expected {expected}")
    return path


def _import_optional(module: str, tokenizer_type: str):
    """Import an optional backend, or fail with one line saying which package to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingPackageError(f"{tokenizer_type} needs the '{module}' package: pip install "
                                  f"{module}") from None

