"""tools/convert_checkpoint.py: a checkpoint (any layout) becomes a Hugging Face Llama that computes
the same losses, and a Hugging Face Llama becomes a checkpoint that training starts from."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megapretrain.train import setup

from distributed import run_distributed
from test_parallel_equivalence import BASE
from test_preprocess_data import load_tool

convert = load_tool("convert_checkpoint")
transformers = pytest.importorskip("transformers")


def _train(rank, world, run_dir, corpus, flags):
    argv = ["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *BASE, "--train.iters", "2", *flags]
    setup(argv).fit()


def _our_loss(run_dir, corpus, checkpoint, tokens, flags=()):
    """Mean per-token loss of megapretrain's model started from ``checkpoint`` (one process)."""
    trainer = setup(["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *BASE, "--checkpoint.load", checkpoint,
                     *flags])
    model = trainer.model_chunks[0].eval()
    with torch.no_grad():
        return model(tokens[:, :-1], tokens[:, 1:]).mean().item(), trainer


def _hf_loss(hf_dir, tokens):
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).item()


@pytest.mark.parametrize("layout, world, tied", [
    ([], 1, False),
    (["--parallel.tp", "2", "--parallel.pp", "2", "--parallel.zero", "1"], 4, True),
], ids=["single", "tp2_pp2_zero1_tied"])
def test_round_trip_computes_the_same_losses(layout, world, tied, corpus, tmp_path, capsys):
    flags = ["--model.tie_embeddings", str(tied).lower()]
    run = str(tmp_path / "run")
    if world == 1:
        _train(0, 1, run, corpus, [*layout, *flags])
    else:
        run_distributed(_train, world, run, corpus, [*layout, *flags], timeout=300)
    hf_dir, back = str(tmp_path / "hf"), str(tmp_path / "back")
    assert convert.main(["to-hf", "--checkpoint", run, "--output", hf_dir, "--dtype", "fp32"]) == 0
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    assert config["tie_word_embeddings"] is tied and config["vocab_size"] == 257  # no padding rows
    tokens = torch.randint(0, 257, (2, 33), generator=torch.Generator().manual_seed(3))
    ours, trainer = _our_loss(str(tmp_path / "check1"), corpus, os.path.join(run, "checkpoints"), tokens, flags)
    assert _hf_loss(hf_dir, tokens) == pytest.approx(ours, rel=1e-5)

    assert convert.main(["from-hf", "--hf", hf_dir, "--output", back]) == 0
    assert "--model.num_layers 4" in capsys.readouterr().out
    again, trainer2 = _our_loss(str(tmp_path / "check2"), corpus, back, tokens, flags)
    assert again == pytest.approx(ours, rel=1e-6)
    for (name, p), q in zip(trainer.model_chunks[0].named_parameters(), trainer2.model_chunks[0].parameters()):
        assert torch.equal(p, q), name  # fp32 weights survive the round trip exactly
    assert trainer2.iteration == 0 and trainer2.optimizer.step_count == 0


def test_sharded_output_has_an_index(corpus, tmp_path):
    run, hf_dir = str(tmp_path / "run"), str(tmp_path / "hf")
    _train(0, 1, run, corpus, [])
    assert convert.main(["to-hf", "--checkpoint", run, "--output", hf_dir, "--max-shard-gb", "0.0001"]) == 0
    index = json.load(open(os.path.join(hf_dir, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0].endswith(f"-of-{len(files):05d}.safetensors")
    assert "lm_head.weight" in index["weight_map"] and "model.norm.weight" in index["weight_map"]
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir)
    assert model.config.num_hidden_layers == 4


def test_bad_input_is_one_line_and_nothing_is_overwritten(corpus, tmp_path, capsys):
    run, hf_dir = str(tmp_path / "run"), str(tmp_path / "hf")
    _train(0, 1, run, corpus, [])
    os.makedirs(hf_dir)
    keep = os.path.join(hf_dir, "notes.txt")
    open(keep, "w").write("mine")
    assert convert.main(["to-hf", "--checkpoint", run, "--output", hf_dir]) == 2
    err = capsys.readouterr().err
    assert "exists and is not empty" in err and err.count("\n") == 1
    assert open(keep).read() == "mine" and not [n for n in os.listdir(tmp_path) if ".tmp-" in n]

    assert convert.main(["to-hf", "--checkpoint", str(tmp_path), "--output", str(tmp_path / "x")]) == 2
    assert "not a complete checkpoint" in capsys.readouterr().err

    good = str(tmp_path / "good")
    assert convert.main(["to-hf", "--checkpoint", run, "--output", good]) == 0
    cfg = json.load(open(os.path.join(good, "config.json")))
    json.dump({**cfg, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, open(os.path.join(good, "config.json"),
                                                                                    "w"))
    assert convert.main(["from-hf", "--hf", good, "--output", str(tmp_path / "c")]) == 2
    assert "rope_scaling" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "c")


def test_the_tokenizer_of_a_huggingface_run_goes_along(tmp_path):
    from types import SimpleNamespace

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    (folder / "tokenizer_config.json").write_text("{}")
    out = tmp_path / "out"
    out.mkdir()
    for model in (str(folder), str(folder / "tokenizer.json")):  # a directory, or the file itself
        cfg = SimpleNamespace(data=SimpleNamespace(tokenizer=SimpleNamespace(type="HuggingFaceTokenizer", model=model)))
        copied = convert._copy_tokenizer(cfg, str(out))
        assert "tokenizer.json" in copied and (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert convert._copy_tokenizer(SimpleNamespace(data=SimpleNamespace(tokenizer=SimpleNamespace(
        type="ByteTokenizer", model=None))), str(out)) == []
