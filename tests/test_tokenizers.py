"""Tokenizers: round trips, end-of-document ids, no added specials, and one-line errors."""

import importlib.util
import json

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")  # the [hf] / [dev] extra

from megapretrain.data.tokenizers import TOKENIZER_TYPES, build_tokenizer  # noqa: E402

from helpers import CORPUS, train_gpt2_files, train_hf_tokenizer, train_sentencepiece, write_tiktoken_ranks  # noqa: E402

SAMPLES = ["hello world", "  leading spaces and\ttabs\n", "café ✓ 数据", ""]


def check_round_trip(tokenizer):
    for text in SAMPLES:
        ids = tokenizer.tokenize(text)
        assert all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.detokenize(ids) == text
    assert tokenizer.tokenize("") == []  # nothing added: no BOS, no EOS
    batch = tokenizer.tokenize_batch(SAMPLES)
    assert [b.tolist() for b in batch] == [tokenizer.tokenize(t) for t in SAMPLES]


def test_byte_tokenizer():
    tok = build_tokenizer("ByteTokenizer")
    assert (tok.vocab_size, tok.eod, tok.name) == (257, 256, "ByteTokenizer")
    assert tok.tokenize("aé") == [97, 0xC3, 0xA9]
    assert tok.detokenize([104, 105, 256]) == "hi"
    check_round_trip(tok)


@pytest.mark.parametrize("as_directory", [False, True])
def test_huggingface_tokenizer(tmp_path, as_directory):
    trained = train_hf_tokenizer(tmp_path / "tokenizer.json")
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path if as_directory else tmp_path / "tokenizer.json"))
    assert tok.name == "HuggingFaceTokenizer"
    assert tok.eod == trained.token_to_id("<|endoftext|>")
    assert tok.vocab_size == trained.get_vocab_size()
    check_round_trip(tok)
    assert tok.tokenize("hello world") == trained.encode("hello world").ids


def test_huggingface_eod_falls_back_and_fails_clearly(tmp_path):
    train_hf_tokenizer(tmp_path / "s.json", special="</s>")
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "s.json"))
    assert tok.detokenize([tok.eod]) == "</s>"
    train_hf_tokenizer(tmp_path / "none.json", special="<pad>")
    with pytest.raises(ValueError, match="none of the end-of-document tokens"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "none.json"))


def test_gpt2_bpe_tokenizer(tmp_path):
    train_gpt2_files(tmp_path)
    vocab = json.load(open(tmp_path / "vocab.json"))
    for tok in (build_tokenizer("GPT2BPETokenizer", str(tmp_path)),
                build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                                merge_file=str(tmp_path / "merges.txt"))):
        assert tok.eod == vocab["<|endoftext|>"]
        assert tok.vocab_size == len(vocab)
        check_round_trip(tok)


def test_unknown_type_lists_valid_types():
    with pytest.raises(ValueError) as info:
        build_tokenizer("WordPiece")
    message = str(info.value)
    assert "WordPiece" in message and all(t in message for t in TOKENIZER_TYPES) and "\n" not in message


@pytest.mark.parametrize("tokenizer_type", ["HuggingFaceTokenizer", "GPT2BPETokenizer"])
def test_missing_model_names_the_path(tmp_path, tokenizer_type):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        build_tokenizer(tokenizer_type, missing)
    with pytest.raises(FileNotFoundError, match="needs a model path"):
        build_tokenizer(tokenizer_type)


@pytest.mark.parametrize("tokenizer_type,module", [("SentencePieceTokenizer", "sentencepiece"),
                                                   ("TikTokenizer", "tiktoken")])
def test_optional_backends_say_what_to_install(tmp_path, tokenizer_type, module):
    if importlib.util.find_spec(module) is not None:
        with pytest.raises(FileNotFoundError):
            build_tokenizer(tokenizer_type, str(tmp_path / "missing.model"))
        return
    with pytest.raises(ImportError, match=f"pip install {module}"):
        build_tokenizer(tokenizer_type, str(tmp_path / "missing.model"))


def test_tokenize_batch_returns_integer_arrays():
    batch = build_tokenizer("ByteTokenizer").tokenize_batch(["ab", ""])
    assert all(isinstance(b, np.ndarray) and b.dtype.kind in "iu" for b in batch)
    assert [b.size for b in batch] == [2, 0]


def test_sentencepiece_tokenizer(tmp_path):
    model = train_sentencepiece(tmp_path)
    tok = build_tokenizer("SentencePieceTokenizer", model)
    import sentencepiece

    reference = sentencepiece.SentencePieceProcessor(model_file=model)
    assert tok.eod == reference.eos_id() and tok.vocab_size == reference.get_piece_size()
    check_round_trip(tok)
    assert [b.tolist() for b in tok.tokenize_batch(SAMPLES, threads=2)] == [tok.tokenize(t) for t in SAMPLES]


def test_tiktokenizer(tmp_path):
    pytest.importorskip("tiktoken")
    tok = build_tokenizer("TikTokenizer", write_tiktoken_ranks(tmp_path / "tiny.tiktoken"))
    assert tok.eod == 2 and tok.vocab_size > 1256
    check_round_trip(tok)
    assert min(tok.tokenize("hello world")) >= 1000  # BPE ranks sit after the 1000 special ids
    assert tok.detokenize([tok.eod] + tok.tokenize("hi")) == "</s>hi"
    assert [b.tolist() for b in tok.tokenize_batch(SAMPLES, threads=2)] == [tok.tokenize(t) for t in SAMPLES]


def test_tiktoken_file_errors_name_the_line(tmp_path):
    pytest.importorskip("tiktoken")
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("YQ== 0\nnot-a-rank-line\n")
    with pytest.raises(ValueError, match="bad.tiktoken:2"):
        build_tokenizer("TikTokenizer", str(bad))


def test_gpt2_backends_agree(tmp_path):
    """tiktoken (fast path) and tokenizers give the same ids for GPT-2 style files, specials spelled out."""
    pytest.importorskip("tiktoken")
    from megapretrain.data.tokenizers import GPT2BPETokenizer

    train_gpt2_files(tmp_path)
    fast = GPT2BPETokenizer(str(tmp_path), None, None)
    slow = GPT2BPETokenizer(str(tmp_path), None, None, backend="tokenizers")
    assert (fast.backend, slow.backend) == ("tiktoken", "tokenizers")
    assert (fast.eod, fast.vocab_size) == (slow.eod, slow.vocab_size)
    rng = np.random.default_rng(0)
    alphabet = list("the quick brown fox 0123 ,.;:'s've\n\t  é✓数据<|endoftext|>") + ["'ll", "'re", " the"]
    texts = SAMPLES + CORPUS[:4] + ["".join(rng.choice(alphabet, size=int(rng.integers(0, 60))))
                                    for _ in range(300)]
    assert [b.tolist() for b in fast.tokenize_batch(texts, threads=2)] == \
        [b.tolist() for b in slow.tokenize_batch(texts)]
    assert fast.tokenize("a<|endoftext|>b") != [fast.eod]  # ordinary text, as GPT-2's encoder.py does
    check_round_trip(fast)
