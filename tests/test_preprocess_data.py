"""tools/preprocess_data.py end to end (in-process, with real worker processes) and the demo corpus tool."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megapretrain.commands import preprocess_data as preprocess
from megapretrain.data.indexed_dataset import IndexedDataset
from megapretrain.data.tokenizers import build_tokenizer

from helpers import train_gpt2_files, train_hf_tokenizer, train_sentencepiece, write_jsonl, write_tiktoken_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


TEXTS = ["plain ascii text", "unicode: naïve café ✓ 数据", "", "line one\nline two\n", "x" * 3000]


def sample_texts(n=300):
    return [TEXTS[i % len(TEXTS)] + f" #{i}" * (i % 3) for i in range(n)]


def run(tmp_path, input_path, *flags, out="out", tokenizer="ByteTokenizer"):
    """Run the tool in-process on one input path (or a list of them); returns (status, output prefix)."""
    prefix = str(tmp_path / out)
    inputs = input_path if isinstance(input_path, list) else [input_path]
    argv = ["--input", *inputs, "--output-prefix", prefix, "--tokenizer-type", tokenizer, *flags]
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
    from megapretrain.commands import build_demo_corpus as demo
    output = str(tmp_path / "demo" / "corpus.jsonl")
    assert demo.main(["--output", output, "--max-mb", "0.3"]) == 0
    records = [json.loads(line) for line in open(output, encoding="utf-8")]
    assert records and all(r["text"] for r in records)
    assert sum(len(r["text"].encode()) for r in records) <= 300_000
    assert os.listdir(tmp_path / "demo") == ["corpus.jsonl"]


# -- input formats ------------------------------------------------------------------------------------

def byte_docs(texts):
    return [list(t.encode()) + [256] for t in texts if t]


def test_zstd_input(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    texts = sample_texts(40)
    raw = write_jsonl(tmp_path / "plain.jsonl", texts)
    compressor = zstandard.ZstdCompressor()
    with open(raw, "rb") as f:  # two frames, as parallel compressors write them
        data = f.read()
    half = data.index(b"\n", len(data) // 2) + 1
    (tmp_path / "in.jsonl.zst").write_bytes(compressor.compress(data[:half]) + compressor.compress(data[half:]))
    status, prefix = run(tmp_path, str(tmp_path / "in.jsonl.zst"), "--append-eod")
    assert status == 0
    assert_dataset(prefix, byte_docs(texts))


def test_parquet_input_and_missing_column(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = sample_texts(30)
    pq.write_table(pa.table({"content": texts, "n": list(range(30))}), tmp_path / "in.parquet", row_group_size=7)
    status, prefix = run(tmp_path, str(tmp_path / "in.parquet"), "--append-eod", "--json-keys", "content",
                         "--chunk-size", "4", "--workers", "2")
    assert status == 0
    assert_dataset(str(tmp_path / "out_content_document"), byte_docs(texts))
    status, _ = run(tmp_path, str(tmp_path / "in.parquet"), out="other")
    assert status == 1 and "no column 'text' (columns: content, n)" in capsys.readouterr().err


def test_parquet_null_is_a_bad_row(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["a", None, "c"]}), tmp_path / "in.parquet")
    assert run(tmp_path, str(tmp_path / "in.parquet"))[0] == 1
    assert "in.parquet: row 2: key 'text' holds NoneType" in capsys.readouterr().err
    status, prefix = run(tmp_path, str(tmp_path / "in.parquet"), "--skip-bad-records")
    assert status == 0 and IndexedDataset(prefix)[1].tolist() == list(b"c")


def test_text_files_one_document_per_file_and_directories(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "b.txt").write_text("bee\n\nsecond paragraph")
    (corpus / "a.md").write_text("ay")
    (corpus / "sub" / "c.txt").write_text("sea ✓")
    (corpus / ".hidden").write_text("never read")
    status, prefix = run(tmp_path, str(corpus), "--append-eod")
    assert status == 0
    assert_dataset(prefix, byte_docs(["ay", "bee\n\nsecond paragraph", "sea ✓"]))  # sorted, depth first


def test_text_paragraph_mode_and_bad_utf8(tmp_path, capsys):
    path = tmp_path / "in.txt"
    path.write_bytes(b"one\nstill one\n\n\ntwo\n \nthree\xff\nx\n\nfour")
    status, _ = run(tmp_path, str(path), "--text-mode", "paragraph")
    assert status == 1 and f"{path}:7: not valid UTF-8" in capsys.readouterr().err
    status, prefix = run(tmp_path, str(path), "--text-mode", "paragraph", "--skip-bad-records", "--append-eod")
    assert status == 0
    assert_dataset(prefix, byte_docs(["one\nstill one", "two", "four"]))


def test_globs_and_several_files_in_order(tmp_path):
    texts = sample_texts(30)
    for k in range(3):
        write_jsonl(tmp_path / f"shard_{k}.jsonl", texts[10 * k: 10 * (k + 1)])
    status, prefix = run(tmp_path, str(tmp_path / "shard_*.jsonl"), "--append-eod", "--workers", "2")
    assert status == 0
    assert_dataset(prefix, byte_docs(texts))


def hf_dataset_dir(tmp_path, texts):
    datasets = pytest.importorskip("datasets")
    directory = str(tmp_path / "hf_saved")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts}),
                          "validation": datasets.Dataset.from_dict({"text": ["held out"]})}).save_to_disk(directory)
    return directory


@pytest.mark.parametrize("streaming", [False, True])
def test_hf_dataset_saved_to_disk(tmp_path, streaming):
    texts = sample_texts(25)
    directory = hf_dataset_dir(tmp_path, texts)
    argv = ["--hf-dataset", directory, "--split", "train", "--output-prefix", str(tmp_path / "out"),
            "--tokenizer-type", "ByteTokenizer", "--append-eod", "--chunk-size", "8", "--no-progress"]
    assert preprocess.main(argv + (["--streaming"] if streaming else [])) == 0
    assert_dataset(str(tmp_path / "out_text_document"), byte_docs(texts))
    argv[argv.index("train")] = "validation"
    argv[argv.index(str(tmp_path / "out"))] = str(tmp_path / "val")
    assert preprocess.main(argv) == 0
    assert_dataset(str(tmp_path / "val_text_document"), byte_docs(["held out"]))


def test_hf_dataset_builder_with_local_files(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    texts = sample_texts(20)
    source = write_jsonl(tmp_path / "in.jsonl", texts)
    argv = ["--hf-dataset", "json", "--hf-data-files", source, "--streaming", "--output-prefix",
            str(tmp_path / "out"), "--tokenizer-type", "ByteTokenizer", "--append-eod", "--no-progress"]
    assert preprocess.main(argv) == 0
    assert_dataset(str(tmp_path / "out_text_document"), byte_docs(texts))


# -- partitions, summary, merging, interruption --------------------------------------------------------

@pytest.mark.parametrize("inputs", ["one_file", "files"])
def test_partitions_join_in_input_order(tmp_path, inputs):
    texts = sample_texts(200)
    if inputs == "one_file":  # cut into byte ranges
        sources = [write_jsonl(tmp_path / "in.jsonl", texts)]
    else:
        sources = [write_jsonl(tmp_path / f"in{k}.jsonl", texts[50 * k: 50 * (k + 1)]) for k in range(4)]
    status, prefix = run(tmp_path, sources, "--partitions", "3", "--workers", "3", "--append-eod",
                         "--chunk-size", "7")
    assert status == 0
    assert_dataset(prefix, byte_docs(texts))
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(s) for s in sources] +
                                                  [f"out_text_document.{x}" for x in ("bin", "idx", "summary.json")])


def test_partition_bad_record_reports_the_files_line(tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", sample_texts(150), extra_lines=["{broken", '{"text": "x"}'])
    status, _ = run(tmp_path, source, "--partitions", "2")
    assert status == 1
    assert f"{source}:151: malformed JSON" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_summary_records_counts_tokenizer_and_checksum(tmp_path):
    texts = sample_texts(30)
    status, prefix = run(tmp_path, write_jsonl(tmp_path / "in.jsonl", texts), "--append-eod")
    assert status == 0
    summary = json.load(open(prefix + ".summary.json"))
    expected = byte_docs(texts)
    assert summary["documents"] == len(expected) and summary["tokens"] == sum(map(len, expected))
    assert summary["tokenizer"]["type"] == "ByteTokenizer" and summary["tokenizer"]["vocab_size"] == 257
    assert summary["tokenizer"]["eod"] == 256 and summary["skipped_empty"] == texts.count("")
    import hashlib
    assert summary["checksum"] == {"algorithm": "sha256",
                                   "bin": hashlib.sha256(open(prefix + ".bin", "rb").read()).hexdigest()}


def test_interrupted_run_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    source = write_jsonl(tmp_path / "in.jsonl", sample_texts(300))
    calls = []

    def interrupt_after_two(self, per_key):
        calls.append(1)
        if len(calls) > 2:
            raise KeyboardInterrupt
        original(self, per_key)

    original = preprocess.Outputs.add
    monkeypatch.setattr(preprocess.Outputs, "add", interrupt_after_two)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, source, "--chunk-size", "10", "--workers", "2")
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_merge_datasets_streams_prefixes_in_order(tmp_path, capsys):
    from megapretrain.commands import merge_datasets as merge_tool
    texts = sample_texts(60)
    prefixes = []
    for k in range(3):
        status, prefix = run(tmp_path, write_jsonl(tmp_path / f"in{k}.jsonl", texts[20 * k: 20 * (k + 1)]),
                             "--append-eod", out=f"shard{k}")
        prefixes.append(prefix)
    out = str(tmp_path / "merged" / "all")
    assert merge_tool.main(["--input", *prefixes, "--output-prefix", out]) == 0
    assert_dataset(out, byte_docs(texts))
    summary = json.load(open(out + ".summary.json"))
    assert summary["tokenizer"]["type"] == "ByteTokenizer" and summary["documents"] == len(byte_docs(texts))
    assert merge_tool.main(["--input", *prefixes, "--output-prefix", out]) == 1
    assert "already exists" in capsys.readouterr().err
    (tmp_path / "dir").mkdir()
    for prefix in prefixes[::-1]:  # a directory is joined in name order
        for suffix in (".bin", ".idx"):
            os.link(prefix + suffix, str(tmp_path / "dir" / os.path.basename(prefix)) + suffix)
    assert merge_tool.main(["--input", str(tmp_path / "dir"), "--output-prefix", out, "--overwrite"]) == 0
    assert_dataset(out, byte_docs(texts))


def test_merge_refuses_mixed_dtypes(tmp_path, capsys):
    from megapretrain.commands import merge_datasets as merge_tool
    from megapretrain.data.indexed_dataset import IndexedDatasetBuilder
    for name, dtype in (("a", np.uint16), ("b", np.int32)):
        builder = IndexedDatasetBuilder(str(tmp_path / name) + ".bin", dtype)
        builder.add_document([1, 2])
        builder.finalize(str(tmp_path / name) + ".idx")
    assert merge_tool.main(["--input", str(tmp_path / "a"), str(tmp_path / "b"), "--output-prefix",
                            str(tmp_path / "c")]) == 1
    assert "different token dtypes" in capsys.readouterr().err
    assert not [p for p in os.listdir(tmp_path) if p.startswith("c.")]


@pytest.mark.parametrize("tokenizer_type", ["ByteTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer",
                                            "SentencePieceTokenizer", "TikTokenizer"])
def test_every_tokenizer_type_in_workers(tmp_path, tokenizer_type):
    pytest.importorskip("tokenizers")
    model = {"ByteTokenizer": None,
             "HuggingFaceTokenizer": lambda: (train_hf_tokenizer(tmp_path / "tokenizer.json"),
                                              str(tmp_path / "tokenizer.json"))[1],
             "GPT2BPETokenizer": lambda: str(train_gpt2_files(tmp_path)),
             "SentencePieceTokenizer": lambda: train_sentencepiece(tmp_path),
             "TikTokenizer": lambda: (pytest.importorskip("tiktoken"),
                                      write_tiktoken_ranks(tmp_path / "t.tiktoken"))[1]}[tokenizer_type]
    model = model() if model else None
    texts = sample_texts(60)
    flags = ["--append-eod", "--workers", "2", "--chunk-size", "8"] + (["--tokenizer-model", model] if model else [])
    status, prefix = run(tmp_path, write_jsonl(tmp_path / "in.jsonl", texts), *flags, tokenizer=tokenizer_type)
    assert status == 0
    tokenizer = build_tokenizer(tokenizer_type, model)
    assert_dataset(prefix, expected_documents(texts, tokenizer))
    summary = json.load(open(prefix + ".summary.json"))
    assert summary["tokenizer"]["vocab_size"] == tokenizer.vocab_size and summary["dtype"] == "uint16"


def test_int32_tokens_for_large_vocabularies(tmp_path):
    pytest.importorskip("tiktoken")
    import base64

    ranks = tmp_path / "big.tiktoken"  # 70,000 ranks: the 256 bytes and filler tokens never produced
    ranks.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)) +
                     "".join(f"{base64.b64encode(b'~%d~' % i).decode()} {256 + i}\n" for i in range(70_000)))
    status, prefix = run(tmp_path, write_jsonl(tmp_path / "in.jsonl", ["int32 ids"]), "--append-eod",
                         "--tokenizer-model", str(ranks), tokenizer="TikTokenizer")
    assert status == 0 and IndexedDataset(prefix).dtype == np.int32


def test_preprocessing_workers_stop_even_under_a_sigterm_handler(tmp_path):
    """A trainer in the same process installs a save-on-SIGTERM handler; forked workers must not keep it."""
    import signal

    previous = signal.signal(signal.SIGTERM, lambda *a: None)
    try:
        source = write_jsonl(tmp_path / "in.jsonl", sample_texts(50))
        assert run(tmp_path, source, "--workers", "2", "--chunk-size", "5")[0] == 0
        assert run(tmp_path, source, "--workers", "2", "--partitions", "2", out="p")[0] == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
