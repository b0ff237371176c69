"""tools/preprocess_data.py end to end (in-process, with real worker processes) and the demo corpus tool."""

import gzip
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megapretrain.data.indexed_dataset import IndexedDataset
from megapretrain.data.tokenizers import build_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_tool(name):
    """Import tools/NAME.py; registered in sys.modules so forked workers resolve its functions."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


preprocess = load_tool("preprocess_data")

TEXTS = ["plain ascii text", "unicode: naïve café ✓ 数据", "", "line one\nline two\n", "x" * 3000]


def write_jsonl(path, texts, extra_lines=()):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"text": text, "id": i}) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return str(path)


def sample_texts(n=300):
    return [TEXTS[i % len(TEXTS)] + f" #{i}" * (i % 3) for i in range(n)]


def run(tmp_path, input_path, *flags, out="out", tokenizer="ByteTokenizer"):
    prefix = str(tmp_path / out)
    argv = ["--input", input_path, "--output-prefix", prefix, "--tokenizer-type", tokenizer, *flags]
    return preprocess.main(argv), prefix + "_text_document"


def expected_documents(texts, tokenizer):
    return [tokenizer.tokenize(t) + [tokenizer.eod] for t in texts if t]


def assert_dataset(prefix, documents):
    ds = IndexedDataset(prefix)
    assert len(ds) == len(documents) and ds.document_indices.tolist() == list(range(len(documents) + 1))
    for i, doc in enumerate(documents):
        assert ds[i].tolist() == doc, f"document {i} differs"


def test_two_workers_match_one_process_in_order(tmp_path):
    texts = sample_texts()
    source = write_jsonl(tmp_path / "in.jsonl", texts)
    status, prefix = run(tmp_path, source, "--append-eod", "--workers", "2", "--chunk-size", "7")
    assert status == 0
    assert_dataset(prefix, expected_documents(texts, build_tokenizer("ByteTokenizer")))
    assert IndexedDataset(prefix).dtype == np.uint16
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_huggingface_tokenizer_in_workers(tmp_path):
    ByteLevelBPETokenizer = pytest.importorskip("tokenizers").ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(TEXTS * 10, vocab_size=280, special_tokens=["<|endoftext|>"], show_progress=False)
    tok.save_model(str(tmp_path))
    texts = sample_texts(100)
    source = write_jsonl(tmp_path / "in.jsonl", texts)
    status, prefix = run(tmp_path, source, "--append-eod", "--workers", "2", "--chunk-size", "5",
                         "--tokenizer-model", str(tmp_path), tokenizer="GPT2BPETokenizer")
    assert status == 0
    assert_dataset(prefix, expected_documents(texts, build_tokenizer("GPT2BPETokenizer", str(tmp_path))))


def test_gzip_input_and_no_eod(tmp_path):
    texts = sample_texts(50)
    status, prefix = run(tmp_path, write_jsonl(tmp_path / "in.jsonl.gz", texts))
    assert status == 0
    assert_dataset(prefix, [list(t.encode()) for t in texts if t])


def test_several_json_keys(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": f"t{i}", "title": f"T{i}"}) + "\n" for i in range(5)))
    prefix = str(tmp_path / "out")
    argv = ["--input", str(source), "--output-prefix", prefix, "--tokenizer-type", "ByteTokenizer",
            "--json-keys", "text", "title"]
    assert preprocess.main(argv) == 0
    assert IndexedDataset(prefix + "_title_document")[3].tolist() == list(b"T3")
    assert IndexedDataset(prefix + "_text_document")[3].tolist() == list(b"t3")


def test_refuses_to_overwrite(tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", sample_texts(10))
    assert run(tmp_path, source)[0] == 0
    capsys.readouterr()
    before = open(str(tmp_path / "out_text_document.bin"), "rb").read()
    other = write_jsonl(tmp_path / "other.jsonl", ["different"])
    assert run(tmp_path, other)[0] == 1
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert open(str(tmp_path / "out_text_document.bin"), "rb").read() == before
    status, prefix = run(tmp_path, other, "--overwrite")
    assert status == 0 and IndexedDataset(prefix)[0].tolist() == list(b"different")


@pytest.mark.parametrize("bad_line,problem", [
    ('{"text": "unterminated', "malformed JSON"),
    ('{"body": "no text key"}', "missing key 'text'"),
    ('{"text": 42}', "holds int, expected a string"),
    ('["not", "an", "object"]', "expected a JSON object"),
])
def test_bad_record_stops_with_line_number(tmp_path, capsys, bad_line, problem):
    source = write_jsonl(tmp_path / "in.jsonl", sample_texts(150), extra_lines=[bad_line, '{"text": "after"}'])
    status, prefix = run(tmp_path, source, "--workers", "2", "--chunk-size", "16")
    assert status == 1
    err = capsys.readouterr().err
    assert f"{source}:151: " in err and problem in err and "--skip-bad-records" in err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]  # nothing that looks complete, no temporaries


def test_skip_bad_records_counts_them(tmp_path, capsys):
    texts = sample_texts(20)
    source = write_jsonl(tmp_path / "in.jsonl", texts, extra_lines=["{oops", '{"text": 1}', '{"text": "last"}'])
    status, prefix = run(tmp_path, source, "--skip-bad-records", "--append-eod")
    assert status == 0
    assert_dataset(prefix, expected_documents(texts + ["last"], build_tokenizer("ByteTokenizer")))
    out = capsys.readouterr().out
    assert f"skipped {texts.count('')} empty and 2 bad records" in out and texts.count("") > 0


def test_missing_input_and_bad_tokenizer_are_one_line_errors(tmp_path, capsys):
    assert run(tmp_path, str(tmp_path / "nope.jsonl"))[0] == 1
    assert "nope.jsonl: no such file" in capsys.readouterr().err
    source = write_jsonl(tmp_path / "in.jsonl", ["x"])
    assert run(tmp_path, source, "--tokenizer-model", str(tmp_path / "tok"), tokenizer="HuggingFaceTokenizer")[0] == 1
    err = capsys.readouterr().err
    assert "tok does not exist" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out_text_document.bin.tmp").exists()


def test_runs_as_a_script_from_the_repository_root(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", ["hello"])
    result = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", source, "--output-prefix",
                             str(tmp_path / "out"), "--tokenizer-type", "ByteTokenizer", "--append-eod"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "1 documents, 6 tokens" in result.stdout


def test_build_demo_corpus(tmp_path):
    demo = load_tool("build_demo_corpus")
    output = str(tmp_path / "demo" / "corpus.jsonl")
    assert demo.main(["--output", output, "--max-mb", "0.3"]) == 0
    records = [json.loads(line) for line in open(output, encoding="utf-8")]
    assert records and all(r["text"] for r in records)
    assert sum(len(r["text"].encode()) for r in records) <= 300_000
    assert os.listdir(tmp_path / "demo") == ["corpus.jsonl"]
