"""tools/merge_checkpoints.py: the weighted average of checkpoints saved under different layouts
equals the average of their global tensors read independently; it trains as a fine-tune start and
converts to Hugging Face; bad weights, different models and an existing output are one line each."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megapretrain.checkpoint.reshard import GlobalWeights
from megapretrain.commands import merge_checkpoints as merge
from megapretrain.config import load_config

from conftest import assert_one_line, snapshot
from helpers import ckpt_dir, launch_part, peak_host_mib, safetensors_of, train_part

# three runs of one model, each under its own layout and seed, stopped at different iterations
RUNS = {"tp2": (2, 2, ["--parallel.tp", "2", "--train.seed", "1"]),
        "dp2_zero1": (2, 3, ["--parallel.zero", "1", "--train.seed", "2"]),
        "pp2": (2, 1, ["--parallel.pp", "2", "--train.seed", "3"])}


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> dict[str, str]:
    """Run name -> its last checkpoint's directory."""
    out = {}
    for name, (world, iters, flags) in RUNS.items():
        run = str(tmp_path_factory.mktemp(name))
        launch_part(world, run, corpus, iters, flags)
        out[name] = ckpt_dir(run, iters)
    return out


def global_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every weight of checkpoint ``path`` as a global fp32 tensor, read as to-hf reads it."""
    cfg_path = os.path.join(path, "config.yaml")
    if not os.path.exists(cfg_path):
        cfg_path = os.path.join(os.path.dirname(os.path.dirname(path)), "config.yaml")
    weights = GlobalWeights(path, load_config(cfg_path, []))
    out = {name: weights.get(name) for name in weights.specs}
    weights.close()
    return out


def weighted_average(paths: list[str], weights: list[float]) -> dict[str, torch.Tensor]:
    """The reference: each input read whole, then averaged in float64."""
    tensors = [global_tensors(p) for p in paths]
    total = sum(weights)
    return {name: sum(t[name].double() * (w / total) for t, w in zip(tensors, weights))
            for name in tensors[0]}


def check_average(output: str, paths: list[str], weights: list[float]) -> None:
    merged, expected = global_tensors(output), weighted_average(paths, weights)
    assert set(merged) == set(expected)
    for name, ref in expected.items():
        torch.testing.assert_close(merged[name].double(), ref, rtol=1e-6, atol=1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")
    a, b = global_tensors(paths[0]), global_tensors(paths[1])
    assert not all(torch.equal(a[n], b[n]) for n in a)  # the inputs differ: the test can fail


def test_weighted_merge_of_three_layouts_equals_the_average(runs, tmp_path, capsys):
    paths = [runs["tp2"], os.path.dirname(os.path.dirname(runs["dp2_zero1"])), runs["pp2"]]
    out = str(tmp_path / "avg")
    assert merge.main(["--checkpoints", *paths, "--output", out, "--weights", "1", "2", "0.5"]) == 0
    printed = capsys.readouterr().out
    assert "not averaged" in printed and "--checkpoint.finetune true" in printed
    check_average(out, [runs["tp2"], runs["dp2_zero1"], runs["pp2"]], [1, 2, 0.5])
    meta = json.load(open(os.path.join(out, "metadata.json")))
    assert meta["iteration"] == 0 and meta["world_size"] == 2  # the first input's layout: tp 2
    assert meta["layout"]["tp"] == 2 and meta["layout"]["pp"] == 1
    assert [s["iteration"] for s in meta["merged_from"]] == [2, 3, 1]
    assert sum(s["weight"] for s in meta["merged_from"]) == pytest.approx(1.0)

    # uniform weights into a layout none of the inputs had: pp 2 × dp 2 (replicas: hard links)
    other = str(tmp_path / "pp2dp2")
    assert merge.main(["--checkpoints", runs["pp2"], runs["tp2"], "--output", other,
                       "--parallel.tp", "1", "--parallel.pp", "2", "--world-size", "4"]) == 0
    check_average(other, [runs["pp2"], runs["tp2"]], [1, 1])
    meta = json.load(open(os.path.join(other, "metadata.json")))
    assert meta["layout"]["pp"] == 2 and meta["layout"]["dp"] == 2
    # the grid is (pp, dp, tp): ranks 0 and 1 are the first stage's two replicas
    assert os.stat(os.path.join(other, "rank_00000.safetensors")).st_ino == \
        os.stat(os.path.join(other, "rank_00001.safetensors")).st_ino


def test_merged_checkpoint_fine_tunes_and_converts_to_hf(runs, corpus, tmp_path, capsys):
    pytest.importorskip("transformers")
    from megapretrain.commands import convert_checkpoint as convert

    out = str(tmp_path / "avg")
    assert merge.main(["--checkpoints", runs["dp2_zero1"], runs["pp2"], "--output", out]) == 0
    merged = global_tensors(out)
    result = train_part(0, 1, str(tmp_path / "ft"), corpus, 1,
                        ["--checkpoint.load", out, "--checkpoint.finetune", "true"])
    assert [r["iter"] for r in result["resumed"]] == [0]
    assert all(map(torch.isfinite, [torch.tensor(v) for v in result["losses"].values()]))
    hf = str(tmp_path / "hf")
    assert convert.main(["to-hf", "--checkpoint", out, "--output", hf, "--dtype", "fp32",
                         "--verify"]) == 0
    assert "max logit difference" in capsys.readouterr().out
    exported = safetensors_of(hf)
    torch.testing.assert_close(exported["model.norm.weight"], merged["norm.weight"], rtol=0, atol=0)
    torch.testing.assert_close(exported["model.embed_tokens.weight"], merged["embed_tokens.weight"],
                               rtol=0, atol=0)


@pytest.mark.parametrize("weights, words", [
    (["1"], ["--weights has 1 value(s) for 2 checkpoints"]),
    (["1", "-1"], ["--weights -1", ">= 0"]),
    (["nan", "1"], ["--weights", "nan is not a finite number"]),
    (["inf", "1"], ["--weights", "inf is not a finite number"]),
    (["0", "0"], ["--weights sum to 0"]),
], ids=["count", "negative", "nan", "inf", "zero-sum"])
def test_bad_weights_are_one_line(runs, tmp_path, capsys, weights, words):
    out = tmp_path / "avg"
    try:
        status = merge.main(["--checkpoints", runs["tp2"], runs["pp2"], "--output", str(out),
                             "--weights", *weights])
    except SystemExit as exc:  # (argparse refuses what is not a finite number)
        status = exc.code
    assert_one_line(capsys, status, 2, *words)
    assert not out.exists() and os.listdir(tmp_path) == []


def test_checkpoints_of_different_models_are_refused(runs, corpus, tmp_path, capsys):
    other = str(tmp_path / "other")
    launch_part(1, other, corpus, 1, ["--model.ffn_hidden_size", "96"])
    status = merge.main(["--checkpoints", runs["tp2"], ckpt_dir(other, 1), "--output",
                         str(tmp_path / "avg")])
    assert_one_line(capsys, status, 2, "different models", "model.ffn_hidden_size", runs["tp2"],
                    ckpt_dir(other, 1))
    assert not (tmp_path / "avg").exists()


def test_an_existing_output_and_a_single_checkpoint_are_refused(runs, tmp_path, capsys):
    out = tmp_path / "avg"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = snapshot(tmp_path)
    status = merge.main(["--checkpoints", runs["tp2"], runs["pp2"], "--output", str(out)])
    assert_one_line(capsys, status, 2, "--output", "exists and is not empty")
    assert snapshot(tmp_path) == before and os.listdir(tmp_path) == ["avg"]
    status = merge.main(["--checkpoints", runs["tp2"], "--output", str(tmp_path / "new")])
    assert_one_line(capsys, status, 2, "--checkpoints", "two or more")


# -- checkpoint.average_last: the average of the run's last checkpoints, written when it ends --------

AVERAGED = ["--checkpoint.interval", "2", "--checkpoint.keep_last", "3", "--checkpoint.average_last", "2"]


def test_average_last_is_written_beside_the_checkpoints_and_never_resumed_from(corpus, tmp_path):
    run = str(tmp_path / "run")
    launch_part(2, run, corpus, 4, ["--parallel.zero", "1", *AVERAGED])  # saves 2 and 4
    average = os.path.join(run, "checkpoints", "average_last_2_iter_0000004")
    check_average(average, [ckpt_dir(run, 2), ckpt_dir(run, 4)], [1, 1])
    meta = json.load(open(os.path.join(average, "metadata.json")))
    assert meta["iteration"] == 0 and meta["world_size"] == 2 and meta["layout"]["dp"] == 2
    assert open(os.path.join(run, "checkpoints", "latest")).read().strip() == "iter_0000004"
    events = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert [e["iterations"] for e in events if e.get("event") == "average_saved"] == [[2, 4]]

    # what an average interrupted by a kill leaves behind goes at the next start
    leftover = os.path.join(run, "checkpoints", ".average_last_2_iter_0000006.tmp-x1")
    os.makedirs(leftover)
    open(os.path.join(leftover, "rank_00000.safetensors"), "wb").write(b"half")
    # resumed (on one process) from iteration 4, not from the average; at its end 4 and 6 averaged
    result = train_part(0, 1, run, corpus, 6, AVERAGED)
    assert [r["iter"] for r in result["resumed"]] == [4]
    check_average(os.path.join(run, "checkpoints", "average_last_2_iter_0000006"),
                  [ckpt_dir(run, 4), ckpt_dir(run, 6)], [1, 1])
    assert os.path.exists(average)  # the earlier average stays, retention leaves it alone
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == [
        "average_last_2_iter_0000004", "average_last_2_iter_0000006", "iter_0000002", "iter_0000004",
        "iter_0000006", "latest"]


@pytest.mark.parametrize("flags, words", [
    (["--checkpoint.average_last", "1"], ["checkpoint.average_last=1", "2 or more"]),
    (["--checkpoint.average_last", "4", "--checkpoint.keep_last", "3"],
     ["checkpoint.average_last=4 > checkpoint.keep_last=3"]),
], ids=["one", "more-than-kept"])
def test_average_last_that_cannot_be_kept_is_refused(corpus, tmp_path, capsys, flags, words):
    from megapretrain.train import main

    status = main(["--run.dir", str(tmp_path / "run"), "--data.paths", f"[{corpus}]", "--train.iters", "1",
                   *flags])
    assert_one_line(capsys, status, 2, *words)


@pytest.mark.slow
def test_a_merge_streams_with_bounded_host_memory(tmp_path):
    """Two ~350 MB checkpoints (24 layers, a 31 MB embedding; one tp 2, one tp 1) merged into
    tp 2: the peak above the imports is a few copies of the largest tensor, far from a model."""
    from megapretrain.checkpoint.torchtitan import save_dcp
    from megapretrain.commands import convert_checkpoint

    vocab, dim, ffn, layers, heads, kv = 16000, 512, 1536, 24, 8, 4
    d = dim // heads
    shapes = {"tok_embeddings.weight": (vocab, dim), "norm.weight": (dim,),
              "output.weight": (vocab, dim)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({p + "attention.wq.weight": (heads * d, dim), p + "attention.wk.weight": (kv * d, dim),
                       p + "attention.wv.weight": (kv * d, dim), p + "attention.wo.weight": (dim, dim),
                       p + "attention_norm.weight": (dim,), p + "ffn_norm.weight": (dim,),
                       p + "feed_forward.w1.weight": (ffn, dim), p + "feed_forward.w2.weight": (dim, ffn),
                       p + "feed_forward.w3.weight": (ffn, dim)})
    flags = ["--model.num_layers", str(layers), "--model.hidden_size", str(dim), "--model.num_heads",
             str(heads), "--model.num_kv_heads", str(kv), "--model.ffn_hidden_size", str(ffn),
             "--model.vocab_size", str(vocab)]
    inputs = []
    for n, tp in enumerate((2, 1)):  # two checkpoints of one model under different layouts
        step, ckpt = str(tmp_path / f"step-{n}"), str(tmp_path / f"ckpt{n}")
        save_dcp(step, {k: (s, torch.float32) for k, s in shapes.items()},
                 lambda k: torch.randn(shapes[k]) * 0.02)
        assert convert_checkpoint.main(["from-torchtitan", "--dcp", step, "--output", ckpt, *flags,
                                        "--parallel.tp", str(tp), "--world-size", str(tp)]) == 0
        inputs.append(ckpt)
    extra = peak_host_mib("merge_checkpoints", "--checkpoints", *inputs, "--output",
                          str(tmp_path / "avg"), "--weights", "1", "3")
    model_mib = sum(4 * torch.Size(s).numel() for s in shapes.values()) / 2**20
    largest_mib = 4 * vocab * dim / 2**20
    print(f"model {model_mib:.0f} MiB, largest tensor {largest_mib:.0f} MiB; peak above imports: "
          f"merge of 2 {extra:.0f} MiB")
    assert extra < min(0.5 * model_mib, 6 * largest_mib)
