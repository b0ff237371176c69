"""Downstream evaluation: task files, the lm-evaluation-harness tokenization rule, scores in the
training loop under tp/sp, pp, dp + ZeRO 3 and cp against one process, the offline tool against
the loop, and per-item log-likelihoods against transformers on the to-hf export."""

from __future__ import annotations

import json
import random

import pytest
import torch

from megapretrain.config import ConfigError, load_config
from megapretrain.data.tokenizers import ByteTokenizer, HuggingFaceTokenizer
from megapretrain.errors import DataError
from megapretrain.eval import encode_pair, load_tasks, pack, task_metrics, tasks_from_corpus
from megapretrain.eval.tasks import corpus_documents
from megapretrain.resolve import resolve

from distributed import run_distributed
from helpers import BASE, eval_layout, evaluate_watched, item_logliks, load_tool, train_hf_tokenizer

SEQ = 32  # BASE's train.seq_length


@pytest.fixture(scope="module")
def task_file(corpus, tmp_path_factory) -> str:
    """Ten 3-choice items made from the training corpus (contexts of 20 bytes, choices of 8)."""
    path = str(tmp_path_factory.mktemp("tasks") / "corpus_mc.jsonl")
    return tasks_from_corpus(corpus_documents(corpus, ByteTokenizer()), path, num_items=10,
                             num_choices=3, context_chars=20, choice_chars=8, seed=3)


def _flags(task_file, *layout):
    return ["--eval.tasks", f"[{task_file}]", "--train.eval_interval", "3", "--train.eval_iters",
            "1", *layout]


@pytest.fixture(scope="module")
def single(corpus, task_file, tmp_path_factory) -> dict:
    """One process: eval lines at iterations 3 and 5 (the end), its run directory."""
    run = str(tmp_path_factory.mktemp("single"))
    out = eval_layout(0, 1, run, corpus, _flags(task_file))
    return {**out, "run": run, "task_file": task_file}


# -- task files --------------------------------------------------------------------------------


def test_continuation_follows_lm_evaluation_harness_rule(tmp_path):
    """Trailing whitespace of the context moves to the continuation; the continuation is the
    tokens of context + choice after those of the context; an empty context is the EOD token."""
    byte = ByteTokenizer()
    assert encode_pair(byte, "ab ", "c") == ([97, 98], [32, 99])
    assert encode_pair(byte, "", "xy") == ([byte.eod], [120, 121])
    train_hf_tokenizer(tmp_path / "tokenizer.json")
    bpe = HuggingFaceTokenizer(str(tmp_path / "tokenizer.json"))
    merged = 0
    for context, choice in [("hello", " world"), ("the quick ", "brown fox"), ("hel", "lo world")]:
        ctx, cont = encode_pair(bpe, context, choice)
        whole = bpe.tokenize(context + choice)
        assert ctx == bpe.tokenize(context.rstrip())  # the context alone, as the model reads it
        assert cont == whole[len(ctx):]  # the rest of the whole text's tokens
        merged += whole[:len(ctx)] != ctx
    # "hel" + "lo" merge across the boundary: the context is still read as tokenized alone
    assert merged >= 1


@pytest.mark.parametrize("line, words", [
    ('{"choices": ["a"], "label": 0}', ["line 2", "missing key 'context'"]),
    ('{"context": "x", "choices": ["a", "b"], "label": 2}', ["line 2", "label 2 is out of range"]),
    ('{"context": "x", "choices": [], "label": 0}', ["line 2", "'choices' is empty"]),
    ('{"context": "' + "x" * 40 + '", "choices": ["a"], "label": 0}',
     ["line 2", "longer than train.seq_length=32"]),
    ('{"context": "' + "x" * 20 + '", "choices": ["' + "y" * 20 + '"], "label": 0}',
     ["line 2", "items are not truncated"]),
    ('{"context": "x", "choices": ["a"], "label": true}', ["line 2", "'label' must be an integer"]),
    ("not json", ["line 2", "not JSON"]),
])
def test_a_bad_task_file_is_one_line_naming_file_line_and_rule(tmp_path, line, words):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"context": "ok", "choices": [" a", " b"], "label": 1}\n' + line + "\n")
    with pytest.raises(DataError) as err:
        load_tasks([str(path)], ByteTokenizer(), SEQ)
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    for word in words:
        assert word in message, message


def test_fewshot_prefix_and_metrics(tmp_path):
    """The prefix is the example items answered, each followed by a blank line, in the order
    lm-evaluation-harness's seeded sampler draws them; acc takes the highest log-likelihood,
    acc_norm the highest per byte."""
    shots = tmp_path / "shots.jsonl"
    shots.write_text('{"context": "Q1", "choices": [" A", " B"], "label": 1}\n'
                     '{"context": "Q2", "choices": [" C"], "label": 0}\n')
    task = tmp_path / "t.jsonl"
    task.write_text('{"context": "Q", "choices": [" x", " yyyy"], "label": 1}\n')
    [t] = load_tasks([str(task)], ByteTokenizer(), 64, [str(shots)], 2)
    seq, n = t.items[0].requests[0]
    order = random.Random(1234).sample(["Q1 B", "Q2 C"], 2)
    assert bytes(seq).decode() == "\n\n".join(order) + "\n\nQ x" and n == 2
    # per byte: -3/2 = -1.5 < -4/5 = -0.8: the long choice wins acc_norm only
    metrics, records = task_metrics([t], [-3.0, -4.0])
    assert metrics == {"t/acc": 0.0, "t/acc_norm": 1.0, "t/n": 1}
    assert records[0]["pred"] == 0 and records[0]["pred_norm"] == 1
    tokens, targets = pack([t], 64)
    assert (targets[0] != -100).sum() == 2 and targets[0, len(seq) - 3].item() == ord(" ")


def _lm_eval_prefixes(items: list[dict], examples: list[dict], k: int, seed: int,
                     same_file: bool) -> list[str]:
    """lm-evaluation-harness's ContextSampler.get_context written out: one random.Random(seed)
    per task; per item ``rnd.sample(docs, k + 1 if same split else k)``, the item itself dropped,
    the first k kept, each ``text + target + "\\n\\n"``."""
    rnd = random.Random(seed)
    out = []
    for item in items:
        drawn = rnd.sample(examples, k + 1 if same_file else k)
        kept = [x for x in drawn if x != item][:k]
        out.append("".join(x["context"] + x["choices"][x["label"]] + "\n\n" for x in kept))
    return out


@pytest.mark.parametrize("same_file", [False, True])
def test_fewshot_examples_are_sampled_per_item_as_lm_evaluation_harness_does(tmp_path, same_file):
    """Each item gets its own seeded draw of examples (not the file's first K), never itself when
    the examples are the task's own file; the same seed gives the same prompts, another seed
    others."""
    items = [{"context": f"Q{i}", "choices": [f" a{i}", f" b{i}"], "label": i % 2}
             for i in range(12)]
    task = tmp_path / "t.jsonl"
    task.write_text("".join(json.dumps(x) + "\n" for x in items))
    shots = task
    if not same_file:
        shots = tmp_path / "shots.jsonl"
        shots.write_text("".join(json.dumps({**x, "context": "S" + x["context"]}) + "\n"
                                 for x in items))
    examples = [json.loads(line) for line in shots.read_text().splitlines()]

    def prompts(seed):
        [t] = load_tasks([str(task)], ByteTokenizer(), 256, [str(shots)], 3, seed)
        return [bytes(item.requests[0][0][:-item.requests[0][1]]).decode() for item in t.items]

    got = prompts(1234)
    want = [p + x["context"] for p, x in
            zip(_lm_eval_prefixes(items, examples, 3, 1234, same_file), items)]
    assert got == want
    assert len({p[:-len(x["context"])] for p, x in zip(got, items)}) > 1  # not one prefix
    for p, x in zip(got, items):
        assert p.count("\n\n") == 3
        if same_file:
            assert f"{x['context']}{x['choices'][x['label']]}\n\n" not in p
    assert prompts(1234) == got and prompts(7) != got
    # lm-evaluation-harness's first_n sampler: the file's first K (K + 1, the item left out)
    [t] = load_tasks([str(task)], ByteTokenizer(), 256, [str(shots)], 3, sampler="first_n")
    firsts = examples[:4 if same_file else 3]
    for item, x in zip(t.items, items):
        kept = [e for e in firsts if e != x][:3]
        prefix = "".join(e["context"] + e["choices"][e["label"]] + "\n\n" for e in kept)
        assert bytes(item.requests[0][0][:-item.requests[0][1]]).decode() == prefix + x["context"]
    with pytest.raises(DataError, match="fewer than num_fewshot=12 \\+ the item itself"):
        load_tasks([str(task)], ByteTokenizer(), 256, [str(task)], 12)


@pytest.mark.parametrize("flags, words", [
    (["--train.eval_interval", "0"], "train.eval_interval > 0"),
    (["--eval.fewshot", "[a.jsonl, b.jsonl]"], "one per task"),
    (["--eval.num_fewshot", "3"], "needs eval.fewshot"),
])
def test_eval_fields_that_cannot_work_are_refused(flags, words):
    cfg = load_config(None, ["--eval.tasks", "[a.jsonl]", "--model.vocab_size", "300", *flags])
    with pytest.raises(ConfigError, match=words):
        resolve(cfg, 1)


def test_a_bad_task_or_fewshot_file_stops_before_the_model_is_built(single, corpus, task_file,
                                                                   tmp_path, monkeypatch, capsys):
    """In the loop and offline, the task and few-shot files are checked before the model is built
    (or a checkpoint read into it): one line naming the file, the line and the rule."""
    import megapretrain.commands.evaluate as offline
    import megapretrain.trainer as trainer
    from megapretrain.train import main as train

    def never(*args, **kwargs):
        raise AssertionError("the model was built before the task files were checked")

    monkeypatch.setattr(trainer, "build_model_chunks", never)
    monkeypatch.setattr(offline, "build_model_chunks", never)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "x", "choices": [" a"], "label": 0}\n'
                   '{"context": "x", "choices": [], "label": 0}\n')
    checkpoint = ["--checkpoint", single["run"]]
    for argv in (["--tasks", str(bad)],
                 ["--tasks", task_file, "--fewshot", str(bad), "--num-fewshot", "1"]):
        assert offline.main(checkpoint + argv) == 2
        err = capsys.readouterr().err
        assert f"task file {bad} line 2" in err and "'choices' is empty" in err, err
    for flags in (_flags(str(bad)),
                  _flags(task_file, "--eval.fewshot", f"[{bad}]", "--eval.num_fewshot", "1")):
        for check in ([], ["--check"]):  # (--check: checked without training)
            assert train(["--run.dir", str(tmp_path / "run"), "--data.paths", f"[{corpus}]",
                          *BASE, *flags, *check]) == 2
            err = capsys.readouterr().err
            assert f"task file {bad} line 2" in err and "'choices' is empty" in err, err


def test_tasks_from_corpus_are_learnable_items(task_file):
    [t] = load_tasks([task_file], ByteTokenizer(), SEQ)
    assert len(t.items) == 10 and all(len(i.requests) == 3 for i in t.items)
    assert {i.label for i in t.items} != {0}  # the right choice is not always first


# -- in the loop, on every layout ----------------------------------------------------------------


def test_in_loop_eval_lines(single):
    """Eval lines at every train.eval_interval and at the end, each with the task's figures and
    the time they took; the model learned the corpus, so it beats chance (1/3) at the end."""
    evals = single["evals"]
    assert [r["iter"] for r in evals] == [3, 5]
    for r in evals:
        assert r["corpus_mc/n"] == 10 and 0 <= r["corpus_mc/acc"] <= 1
        assert 0 <= r["corpus_mc/acc_norm"] <= 1 and r["downstream_time_s"] >= 0
        assert "valid_loss" in r
    # the logged acc is the one of the log-likelihoods scored after training
    assert evals[-1]["corpus_mc/acc"] == _acc(single["logliks"], 3, _labels(single))


def _labels(single):
    with open(single["task_file"]) as fh:
        return [json.loads(line)["label"] for line in fh]


def _acc(logliks, k, labels):
    groups = [logliks[i:i + k] for i in range(0, len(logliks), k)]
    return sum(max(range(k), key=lambda c: (g[c], -c)) == y for g, y in zip(groups, labels)) \
        / len(labels)


LAYOUTS = {
    "tp2-sp": (2, ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"]),
    "pp2": (2, ["--parallel.pp", "2"]),
    "dp2-zero3": (2, ["--parallel.zero", "3"]),
    "cp2": (2, ["--parallel.cp", "2"]),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] * (n == "cp2"))
                                  for n in LAYOUTS])
def test_in_loop_and_offline_scores_equal_one_process(name, single, corpus, task_file, tmp_path):
    """The loop's scores under the layout equal one process's; so do tools/evaluate.py's, run
    next on the same ranks in the same layout (its weights loaded into that layout from the
    checkpoint), and on one process from the checkpoint this layout saved."""
    world, layout = LAYOUTS[name]
    results = run_distributed(eval_layout, world, str(tmp_path), corpus,
                              _flags(task_file, *layout), ["--tasks", task_file, *layout],
                              timeout=300)
    for r in results:  # every rank holds the same log-likelihoods
        assert r["logliks"] == pytest.approx(single["logliks"], rel=1e-4, abs=1e-4)
        assert r["offline_status"] == 0
    ours, ref = results[0]["evals"], single["evals"]
    assert [r["iter"] for r in ours] == [r["iter"] for r in ref]
    for a, b in zip(ours, ref):
        for key in ("corpus_mc/acc", "corpus_mc/acc_norm", "corpus_mc/n"):
            assert a[key] == b[key], (key, a, b)
    # offline in the layout (rank 0 wrote the file), then on one process
    assert item_logliks(tmp_path / "offline_items.jsonl") == \
        pytest.approx(results[0]["logliks"], rel=1e-5, abs=1e-5)
    items = tmp_path / "items.jsonl"
    assert load_tool("evaluate").main(["--checkpoint", str(tmp_path), "--tasks", task_file,
                                       "--output", str(items)]) == 0
    assert item_logliks(items) == pytest.approx(results[0]["logliks"], rel=1e-5, abs=1e-5)


@pytest.mark.slow  # (4 ranks)
def test_zero3_evaluation_gathers_a_unit_at_a_time_never_the_model(single, task_file, tmp_path):
    """tools/evaluate.py under ZeRO 3 and tp2 (4 ranks: dp2 × tp2), every collective recorded on
    every rank: no all-gather is larger than the largest ZeRO-3 unit (one decoder layer, or the
    embedding, final norm and head), none is the rank's whole model, and at no moment does a
    rank hold every layer gathered; the scores equal one process's."""
    items = tmp_path / "items.jsonl"
    argv = ["--checkpoint", single["run"], "--tasks", task_file, "--output", str(items),
            "--parallel.tp", "2", "--parallel.zero", "3"]
    results = run_distributed(evaluate_watched, 4, argv, timeout=300)
    for rank, r in enumerate(results):
        assert r["status"] == 0
        units = r["units"]  # bytes of each unit gathered whole (this rank's tp share)
        model = sum(units.values())  # the rank's tp share of the whole model
        layers = [name for name in units if name.startswith("layers.")]
        gathers = [size * sent for _, kind, sent, size in r["calls"] if kind == "all_gather"]
        assert len(layers) == 4 and gathers
        assert max(gathers) <= max(units.values()) < model
        assert r["max_gathered"]["layers"] < len(layers)
        assert r["max_gathered"]["bytes"] < model
        print(f"rank {rank}: {len(gathers)} all-gathers, the largest {max(gathers):,} B; units "
              f"{sorted(units.values())} B; at most {r['max_gathered']['bytes']:,} B gathered at "
              f"once ({r['max_gathered']['layers']} layers) of the model's {model:,} B")
    assert item_logliks(items) == pytest.approx(single["logliks"], rel=1e-5, abs=1e-5)


# -- offline, and against transformers -------------------------------------------------------------


def test_offline_tool_equals_in_loop(single, task_file, tmp_path, capsys):
    evaluate = load_tool("evaluate")
    items = tmp_path / "items.jsonl"
    assert evaluate.main(["--checkpoint", single["run"], "--tasks", task_file,
                          "--output", str(items), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    last = single["evals"][-1]
    assert metrics == {k: last[k] for k in metrics}
    offline = [ll for line in items.read_text().splitlines()
               for ll in json.loads(line)["logliks"]]
    assert offline == pytest.approx(single["logliks"], rel=1e-5, abs=1e-5)
    # a missing task file is one line; the output is never overwritten
    assert evaluate.main(["--checkpoint", single["run"], "--tasks", str(tmp_path / "no.jsonl")]) \
        == 2
    assert "task file" in capsys.readouterr().err
    assert evaluate.main(["--checkpoint", single["run"], "--tasks", task_file,
                          "--output", str(items)]) == 2


@pytest.mark.slow  # (bf16 on CPU)
def test_offline_scores_in_the_runs_precision_unless_told_fp32(corpus, task_file, tmp_path):
    """A bf16 run: the loop scores in bf16; tools/evaluate.py scores its checkpoint in bf16 too
    (the same log-likelihoods), and with --fp32 in fp32 (others, close to them)."""
    run = str(tmp_path / "run")
    loop = eval_layout(0, 1, run, corpus, _flags(task_file, "--train.precision", "bf16",
                                                 "--train.iters", "1"))
    evaluate = load_tool("evaluate")
    bf16, fp32 = tmp_path / "bf16.jsonl", tmp_path / "fp32.jsonl"
    assert evaluate.main(["--checkpoint", run, "--tasks", task_file, "--output", str(bf16)]) == 0
    assert evaluate.main(["--checkpoint", run, "--tasks", task_file, "--output", str(fp32),
                          "--fp32"]) == 0
    assert item_logliks(bf16) == pytest.approx(loop["logliks"], rel=1e-6, abs=1e-6)
    assert item_logliks(fp32) != pytest.approx(loop["logliks"], rel=1e-6, abs=1e-6)
    assert item_logliks(fp32) == pytest.approx(loop["logliks"], rel=5e-2, abs=5e-2)


def test_logliks_equal_transformers_on_the_export(single, task_file, tmp_path):
    """The to-hf export scored by transformers directly, with lm-evaluation-harness's rule
    written out here (the model reads context + continuation minus its last token; the
    continuation's log-probabilities are summed): per item within 1e-4, same acc and acc_norm."""
    transformers = pytest.importorskip("transformers")
    convert = load_tool("convert_checkpoint")
    hf_dir = str(tmp_path / "hf")
    assert convert.main(["to-hf", "--checkpoint", single["run"], "--output", hf_dir]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    byte = ByteTokenizer()
    theirs, labels, sizes = [], [], []
    with open(task_file) as fh:
        for line in fh:
            item = json.loads(line)
            labels.append(item["label"])
            for choice in item["choices"]:
                context = item["context"].rstrip()
                cont_text = item["context"][len(context):] + choice
                ctx = byte.tokenize(context)
                cont = byte.tokenize(context + cont_text)[len(ctx):]
                inp = torch.tensor([ctx + cont])[:, :-1]
                with torch.no_grad():
                    logp = torch.log_softmax(model(inp).logits.double(), -1)[0, -len(cont):]
                theirs.append(logp.gather(-1, torch.tensor(cont)[:, None]).sum().item())
                sizes.append(len(choice.encode()))
    assert single["logliks"] == pytest.approx(theirs, rel=1e-4, abs=1e-4)
    [t] = load_tasks([task_file], byte, SEQ)
    ours_metrics, _ = task_metrics([t], single["logliks"])
    their_metrics, _ = task_metrics([t], theirs)
    assert ours_metrics == their_metrics


# -- lm-evaluation-harness itself (the [eval-harness] extra) ---------------------------------------


def _bpe_corpus(directory) -> tuple[str, str]:
    """A tiny byte-level BPE tokenizer.json and a corpus of pseudo-code documents tokenized with it
    (the indexed format, end of document after each): where context and choice merge into other
    tokens than either alone."""
    import numpy as np

    from megapretrain.data.indexed_dataset import IndexedDatasetBuilder

    tok_path = str(directory / "tokenizer.json")
    train_hf_tokenizer(tok_path)
    bpe = HuggingFaceTokenizer(tok_path)
    words = "the quick brown fox jumps over lazy dog hello world return main def".split()
    rng = np.random.default_rng(0)
    prefix = str(directory / "bpe_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for _ in range(200):
        text = " ".join(rng.choice(words, size=int(rng.integers(8, 30))))
        builder.add_document(bpe.tokenize(text) + [bpe.eod])
    builder.finalize(prefix + ".idx")
    return tok_path, prefix


@pytest.mark.slow  # (about a minute: a run, an export, lm-evaluation-harness's imports)
def test_scores_equal_lm_evaluation_harness_on_the_export(tmp_path):
    """A run on a BPE tokenizer, exported with to-hf: lm-evaluation-harness's HFLM log-likelihoods
    on the export equal tools/evaluate.py's per item within 1e-4, and so do acc and acc_norm (the
    texts are ASCII: lm-evaluation-harness's length in characters is the length in bytes)."""
    pytest.importorskip("lm_eval", reason="pip install 'megapretrain[eval-harness]'")
    transformers = pytest.importorskip("transformers")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    tok_path, prefix = _bpe_corpus(tmp_path)
    bpe = HuggingFaceTokenizer(tok_path)
    task = str(tmp_path / "bpe_mc.jsonl")
    tasks_from_corpus(corpus_documents(prefix, bpe), task, num_items=8, num_choices=3,
                      context_chars=30, choice_chars=12, seed=5)
    run = str(tmp_path / "run")
    eval_layout(0, 1, run, prefix, _flags(task, "--data.tokenizer.type", "HuggingFaceTokenizer",
                                          "--data.tokenizer.model", tok_path,
                                          "--train.seq_length", "48"))
    items = tmp_path / "items.jsonl"
    assert load_tool("evaluate").main(["--checkpoint", run, "--tasks", task, "--output",
                                       str(items)]) == 0
    ours = [json.loads(line) for line in items.read_text().splitlines()]
    hf_dir = str(tmp_path / "hf")
    assert load_tool("convert_checkpoint").main(["to-hf", "--checkpoint", run, "--output",
                                                 hf_dir]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=tok_path,
                                                     eos_token="<|endoftext|>")
    lm = HFLM(pretrained=model.eval(), tokenizer=tokenizer, backend="causal", device="cpu",
              batch_size=1)
    with open(task) as fh:
        docs = [json.loads(line) for line in fh]
    requests = [Instance("loglikelihood", doc, (doc["context"], choice), idx)
                for doc in docs for idx, choice in enumerate(doc["choices"])]
    theirs = [ll for ll, _ in lm.loglikelihood(requests, disable_tqdm=True)]
    assert [ll for r in ours for ll in r["logliks"]] == pytest.approx(theirs, rel=1e-4, abs=1e-4)
    at = 0
    for doc, record in zip(docs, ours):
        lls = theirs[at:at + len(doc["choices"])]
        at += len(doc["choices"])
        lengths = [float(len(c)) for c in doc["choices"]]  # lm-evaluation-harness's acc_norm
        assert record["pred"] == max(range(len(lls)), key=lambda c: (lls[c], -c))
        assert record["pred_norm"] == max(range(len(lls)), key=lambda c: (lls[c] / lengths[c], -c))


def test_tensorboard_charts_downstream_accuracy_together():
    import re

    from megapretrain.monitor.metrics import TENSORBOARD_LAYOUT

    charts = {chart: tags for section in TENSORBOARD_LAYOUT.values()
              for chart, (_, tags) in section.items()}
    for tag in ("arc_easy/acc", "arc_easy/acc_norm", "piqa/acc"):
        assert [c for c, tags in charts.items() if any(re.search(t, tag) for t in tags)] \
            == ["downstream accuracy"]
    assert not any(re.search(t, "arc_easy/n") for t in charts["downstream accuracy"])


def test_dashboard_draws_downstream_accuracy_beside_the_loss(single):
    """tools/plot_run.py's dashboard of the run: a panel of each task's acc and acc_norm at the
    eval lines' iterations, on 0..1."""
    pytest.importorskip("matplotlib")
    from megapretrain.monitor import plots
    from megapretrain.monitor.metrics import read_metrics

    fig = plots.dashboard_figure(read_metrics(single["run"]), "run")
    titles = [ax.get_title() for ax in fig.axes]
    (panel,) = [ax for ax in fig.axes if ax.get_title() == "downstream accuracy"]
    assert titles.index("downstream accuracy") == 1  # beside the loss
    lines = {line.get_label(): line for line in panel.get_lines()}
    assert set(lines) >= {"corpus_mc/acc", "corpus_mc/acc_norm"}
    assert list(lines["corpus_mc/acc"].get_xdata()) == [3, 5]
    assert list(lines["corpus_mc/acc"].get_ydata()) == [r["corpus_mc/acc"] for r in single["evals"]]
    assert panel.get_ylim() == (-0.02, 1.02)
    plots.pyplot().close(fig)


def test_make_tasks_writes_a_new_task_file_only(corpus, tmp_path, capsys):
    make_tasks = load_tool("make_tasks")
    out = tmp_path / "mc.jsonl"
    argv = ["--data", corpus, "--output", str(out), "--items", "5", "--choices", "3",
            "--context-chars", "20", "--choice-chars", "8"]
    assert make_tasks.main(argv) == 0
    [t] = load_tasks([str(out)], ByteTokenizer(), SEQ)
    assert len(t.items) == 5 and all(len(i.requests) == 3 for i in t.items)
    before = out.read_text()
    assert make_tasks.main(argv) == 2 and out.read_text() == before
    assert "exists" in capsys.readouterr().err
