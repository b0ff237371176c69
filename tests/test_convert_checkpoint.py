"""tools/convert_checkpoint.py: a checkpoint (any layout) becomes a Hugging Face Llama that computes
the same losses, and a Hugging Face Llama becomes a checkpoint that training starts from."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megapretrain.commands import convert_checkpoint as convert
from megapretrain.train import setup

from distributed import run_distributed
from helpers import BASE, peak_host_mib, safetensors_of, write_hf_llama

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
    (["--parallel.zero", "3"], 2, False),
], ids=["single", "tp2_pp2_zero1_tied", "dp2_zero3"])
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
    (folder / "sp.model").write_bytes(b"sentencepiece")  # a SentencePiece run: tokenizer.model for LlamaTokenizer
    sp = tmp_path / "sp_out"
    sp.mkdir()
    cfg = SimpleNamespace(data=SimpleNamespace(tokenizer=SimpleNamespace(type="SentencePieceTokenizer",
                                                                         model=str(folder / "sp.model"))))
    assert convert._copy_tokenizer(cfg, str(sp)) == ["tokenizer.model", "tokenizer_config.json"]
    assert (sp / "tokenizer.model").read_bytes() == b"sentencepiece"


# -- Llama 3.1 from Hugging Face into tp=2 × pp=2 and back ------------------------------------------

ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
TP2PP2 = ["--parallel.tp", "2", "--parallel.pp", "2"]


def _tiny_llama31(hf_dir):
    """A random transformers Llama with GQA, untied embeddings and Llama 3.1 rotary scaling."""
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters=dict(ROPE))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(hf_dir)
    return model


def _train_from(rank, world, run_dir, corpus, flags):
    trainer = setup(["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *BASE, *flags])
    trainer.fit()
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if r.get("event") == "resumed"]


def test_llama31_from_hf_into_tp2_pp2_trains_and_goes_back(corpus, tmp_path, capsys):
    from megapretrain.checkpoint.hf import greedy, model_overrides, our_model
    from megapretrain.checkpoint.reshard import GlobalWeights
    from megapretrain.config import load_config

    hf_dir, ckpt, back = str(tmp_path / "hf"), str(tmp_path / "ckpt"), str(tmp_path / "back")
    reference = _tiny_llama31(hf_dir)
    assert convert.main(["from-hf", "--hf", hf_dir, "--output", ckpt, *TP2PP2, "--world-size", "4",
                         "--verify"]) == 0
    out = capsys.readouterr().out
    assert "--verify: max logit difference" in out and "--model.rope_scaling" in out
    meta = json.load(open(os.path.join(ckpt, "metadata.json")))
    assert meta["layout"] == {"tp": 2, "pp": 2, "dp": 1, "cp": 1} and len(meta["files"]) == 4
    interleaved = str(tmp_path / "vpp")  # virtual stages and data-parallel replicas (hard links) too
    assert convert.main(["from-hf", "--hf", hf_dir, "--output", interleaved, "--parallel.pp", "2", "--parallel.vpp",
                         "2", "--world-size", "4", "--train.global_batch_size", "16", "--verify"]) == 0
    a, b = (os.stat(os.path.join(interleaved, f"rank_0000{i}.safetensors")) for i in (0, 1))
    assert a.st_ino == b.st_ino

    # HF → here → HF reproduces every tensor exactly, and the config's rotary scaling both ways
    assert convert.main(["to-hf", "--checkpoint", ckpt, "--output", back, "--dtype", "fp32", "--verify"]) == 0
    original, again = safetensors_of(hf_dir), safetensors_of(back)
    assert set(original) == set(again)
    assert all(torch.equal(original[k], again[k]) for k in original)
    config = json.load(open(os.path.join(back, "config.json")))
    assert config["rope_parameters"] == ROPE and config["rope_scaling"]["rope_type"] == "llama3"
    assert os.path.exists(os.path.join(back, "generation_config.json"))

    # continued pretraining under the converted layout: loaded as is (no reshard), then back to HF
    run = str(tmp_path / "run")
    arch = model_overrides(json.load(open(os.path.join(hf_dir, "config.json"))), hf_dir)
    resumed = run_distributed(_train_from, 4, run, corpus, [*arch, *TP2PP2, "--checkpoint.load", ckpt,
                                                            "--train.iters", "2"], timeout=400)[0]
    assert [r["iter"] for r in resumed] == [0] and "resharded_from" not in resumed[0]
    trained = str(tmp_path / "trained")
    assert convert.main(["to-hf", "--checkpoint", run, "--output", trained, "--dtype", "fp32", "--verify"]) == 0
    assert "max logit difference" in capsys.readouterr().out
    exported = transformers.LlamaForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
    assert exported.config.rope_parameters["rope_type"] == "llama3"
    assert not all(torch.equal(a, b) for a, b in zip(exported.parameters(), reference.parameters()))  # it trained

    # our model and the exported one generate the same greedy tokens
    cfg = load_config(os.path.join(run, "config.yaml"), [])
    weights = GlobalWeights(os.path.join(run, "checkpoints", "iter_0000002"), cfg)
    ours = our_model(cfg, weights.get)
    weights.close()
    prompt = torch.tensor([[1, 17, 42, 99, 7, 250]])
    with torch.no_grad():
        theirs = exported.generate(prompt, max_new_tokens=10, do_sample=False, num_beams=1)
    assert torch.equal(greedy(ours, prompt, 10), theirs)


def test_llama_with_yarn_converts_both_ways_with_transformers_logits(tmp_path, capsys):
    """YaRN (rope_type yarn, an explicit attention factor) in a Llama config.json: from-hf and to-hf
    each check the logits against transformers (--verify) on 64 tokens, four times the original
    context, and the config comes back as it was."""
    hf_dir, ckpt, back = str(tmp_path / "hf"), str(tmp_path / "ckpt"), str(tmp_path / "back")
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "attention_factor": 1.2, "beta_fast": 16.0, "beta_slow": 2.0}
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, rope_parameters=dict(yarn))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(hf_dir)
    assert convert.main(["from-hf", "--hf", hf_dir, "--output", ckpt, "--train.seq_length", "64", "--verify"]) == 0
    assert convert.main(["to-hf", "--checkpoint", ckpt, "--output", back, "--dtype", "fp32", "--verify"]) == 0
    assert capsys.readouterr().out.count("max logit difference") == 2
    assert json.load(open(os.path.join(back, "config.json")))["rope_parameters"] == yarn


def test_rope_scaling_is_read_from_either_config_form(tmp_path):
    from megapretrain.checkpoint.hf import ConvertError, rope_from_hf

    scaling = {k: v for k, v in ROPE.items() if k != "rope_theta"}
    assert rope_from_hf({"rope_parameters": ROPE}, "x") == (10000.0, scaling)  # transformers 5
    legacy = {"rope_theta": 500000.0, "rope_scaling": {**scaling, "rope_type": None, "type": "llama3"}}
    legacy["rope_scaling"].pop("rope_type")
    assert rope_from_hf(legacy, "x") == (500000.0, scaling)  # older checkpoints
    assert rope_from_hf({"rope_theta": 1e4, "rope_scaling": None}, "x") == (1e4, None)
    with pytest.raises(ConvertError, match="rope_type must be llama3"):
        rope_from_hf({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "x")
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    assert rope_from_hf({"rope_scaling": yarn, "rope_theta": 1e4}, "x") == (1e4, yarn)
    with pytest.raises(ConvertError, match=r"keys \['low_freq_factor'\] are not part of rope_type yarn"):
        rope_from_hf({"rope_scaling": {**yarn, "low_freq_factor": 1.0}}, "x")


def test_a_tied_checkpoint_into_an_untied_export_and_back_is_refused(corpus, tmp_path, capsys):
    """Every saved tensor must be used: an untied checkpoint exported under a tied config names
    lm_head.weight."""
    run = str(tmp_path / "run")
    _train(0, 1, run, corpus, [])
    config = str(tmp_path / "tied.yaml")
    text = open(os.path.join(run, "config.yaml")).read().replace("tie_embeddings: false", "tie_embeddings: true")
    open(config, "w").write(text)
    assert convert.main(["to-hf", "--checkpoint", run, "--output", str(tmp_path / "x"), "--config", config]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'lm_head.weight'" in err
    assert "saved with model.tie_embeddings false" in err and "the config says true" in err
    assert "set model.tie_embeddings: false in the config" in err
    tied_run = str(tmp_path / "tied_run")  # and the other way round: a tied checkpoint, untied
    _train(0, 1, tied_run, corpus, ["--model.tie_embeddings", "true"])
    untied = str(tmp_path / "untied.yaml")
    open(untied, "w").write(open(os.path.join(tied_run, "config.yaml")).read()
                            .replace("tie_embeddings: true", "tie_embeddings: false"))
    assert convert.main(["to-hf", "--checkpoint", tied_run, "--output", str(tmp_path / "y"),
                         "--config", untied]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "saved with model.tie_embeddings true" in err
    assert "the config says false" in err and "set model.tie_embeddings: true" in err


def _big_hf(hf_dir, vocab=16000, hidden=512, ffn=1536, layers=12, heads=8, kv=4):
    """A random Llama of ~54M parameters (~217 MB fp32) in two safetensors shards, written one
    tensor at a time (this process never holds it whole either): (model MiB, largest MiB)."""
    shapes = write_hf_llama(hf_dir, hidden=hidden, ffn=ffn, layers=layers, vocab=vocab, heads=heads,
                            kv=kv, dtype=torch.float32, shards=2, rope_theta=10000.0, max_positions=256)
    return sum(4 * torch.Size(s).numel() for s in shapes.values()) / 2**20, 4 * vocab * hidden / 2**20


@pytest.mark.slow
def test_conversions_stream_with_bounded_host_memory(tmp_path):
    """Peak host memory above the imports, for a ~400 MB model (24 layers): about a few copies of
    its largest tensor (the 31 MB embedding), far from a whole-model copy."""
    hf_dir, ckpt, back = str(tmp_path / "hf"), str(tmp_path / "ckpt"), str(tmp_path / "back")
    model_mib, largest_mib = _big_hf(hf_dir, layers=24)
    from_hf = peak_host_mib("convert_checkpoint", "from-hf", "--hf", hf_dir, "--output", ckpt,
                            "--parallel.tp", "2", "--world-size", "2")
    to_hf = peak_host_mib("convert_checkpoint", "to-hf", "--checkpoint", ckpt, "--output", back, "--dtype", "bf16")
    print(f"model {model_mib:.0f} MiB, largest tensor {largest_mib:.0f} MiB; peak above imports: "
          f"from-hf {from_hf:.0f} MiB, to-hf {to_hf:.0f} MiB")
    for extra in (from_hf, to_hf):
        assert extra < min(0.5 * model_mib, 4 * largest_mib)
