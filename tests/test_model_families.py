"""Model families through the one chunk contract: the Llama family's Qwen options (``model.qkv_bias``:
Qwen2, ``model.qk_norm`` + ``model.head_dim``: Qwen3) and GPT-NeoX (Pythia).

For each: a random transformers model converts here and back bit for bit, our logits are
transformers' (fp32), 20 steps of the real trainer from it equal transformers + torch.optim.AdamW
on the same batches (and under tp2+sp, pp2, dp2 with ZeRO-3 and cp2 they equal one process: cases
of tests/layouts.py). The spec table gives the parameter count (Pythia's published figures), the
initializations and the weight decay (none on biases and norm weights)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megapretrain.commands import convert_checkpoint as convert
from megapretrain.config import load_config
from megapretrain.errors import ConfigError
from megapretrain.model.build import model_args, rank_param_specs
from megapretrain.model.decoder import num_parameters
from megapretrain.train import setup

from helpers import BASE, NEOX, OLMO3, OLMO3_YARN, QWEN, safetensors_of

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 257  # the corpus' byte tokenizer


def _hf_model(kind: str):
    """A random transformers model of ``kind`` whose biases and norm weights are not their init."""
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, tie_word_embeddings=False)
    if kind == "gpt_neox":
        config = transformers.GPTNeoXConfig(**common, intermediate_size=256, rotary_pct=0.25, rotary_emb_base=10000,
                                            layer_norm_eps=1e-5, use_parallel_residual=True, hidden_act="gelu")
        cls = transformers.GPTNeoXForCausalLM
    elif kind == "gpt_neox_sequential":
        config = transformers.GPTNeoXConfig(**common, intermediate_size=128, rotary_pct=0.5, layer_norm_eps=1e-5,
                                            use_parallel_residual=False)
        cls = transformers.GPTNeoXForCausalLM
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**common, intermediate_size=128, num_key_value_heads=2, rms_norm_eps=1e-6)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "olmo2":
        config = transformers.Olmo2Config(**common, intermediate_size=128, num_key_value_heads=2, rms_norm_eps=1e-6)
        cls = transformers.Olmo2ForCausalLM
    elif kind == "olmo3":  # a window smaller than the tests' sequences; layers 0, 2 windowed, 1 full
        config = transformers.Olmo3Config(**{**common, "num_hidden_layers": 3}, intermediate_size=128,
                                          num_key_value_heads=2, rms_norm_eps=1e-6, sliding_window=7,
                                          layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        cls = transformers.Olmo3ForCausalLM
    elif kind == "olmo3_yarn":  # the long-context OLMo 3's rotary: YaRN on the full layer only
        rope = {"full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                   "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}
        config = transformers.Olmo3Config(**common | {"num_hidden_layers": 3}, intermediate_size=128,
                                          num_key_value_heads=2, rms_norm_eps=1e-6, sliding_window=7,
                                          layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                          rope_parameters=rope)
        cls = transformers.Olmo3ForCausalLM
    else:
        config = transformers.Qwen3Config(**common, intermediate_size=128, num_key_value_heads=2, head_dim=32,
                                          rms_norm_eps=1e-6)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _family(kind: str) -> str:
    return "gpt_neox" if kind.startswith("gpt_neox") else "olmo" if kind.startswith("olmo") else "llama"


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "gpt_neox", "gpt_neox_sequential", "olmo2", "olmo3",
                                  "olmo3_yarn"])
def test_hf_round_trip_is_bitwise_and_logits_match(kind, tmp_path, capsys):
    from megapretrain.checkpoint.hf import model_overrides, our_logits, our_model
    from megapretrain.checkpoint.reshard import GlobalWeights

    hf_dir, ckpt, back = str(tmp_path / "hf"), str(tmp_path / "ckpt"), str(tmp_path / "back")
    reference = _hf_model(kind)
    reference.save_pretrained(hf_dir)
    assert convert.main(["from-hf", "--hf", hf_dir, "--output", ckpt, "--parallel.tp", "2", "--verify"]) == 0
    out = capsys.readouterr().out
    assert f"--model.family {_family(kind)}" in out and "--verify: max logit difference" in out
    assert convert.main(["to-hf", "--checkpoint", ckpt, "--output", back, "--dtype", "fp32", "--verify"]) == 0
    original, again = safetensors_of(hf_dir), safetensors_of(back)
    assert set(original) == set(again)
    assert all(torch.equal(original[k], again[k]) for k in original)
    config = json.load(open(os.path.join(back, "config.json")))
    assert config["architectures"] == reference.config.architectures
    assert config["model_type"] == reference.config.model_type
    hf_config = json.load(open(os.path.join(hf_dir, "config.json")))
    assert model_overrides(config, back) == model_overrides(hf_config, hf_dir)

    cfg = load_config(os.path.join(ckpt, "config.yaml"), [])
    weights = GlobalWeights(ckpt, cfg)
    ours = our_model(cfg, weights.get)
    weights.close()
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = reference(tokens).logits
    torch.testing.assert_close(our_logits(ours, tokens), theirs, rtol=0, atol=1e-5)


def _flags(run_dir, corpus, arch, *extra):
    return ["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *arch, "--train.seq_length", "32",
            "--train.micro_batch_size", "2", "--train.global_batch_size", "4", "--train.eval_interval", "0",
            "--logging.tensorboard", "false", "--checkpoint.interval", "0", "--train.seed", "5", *extra]


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "gpt_neox", "olmo2", "olmo3"])
def test_twenty_steps_from_hf_equal_transformers_and_adamw(kind, corpus, tmp_path):
    from megapretrain.checkpoint.hf import model_overrides

    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    reference = _hf_model(kind)
    reference.save_pretrained(hf_dir)
    assert convert.main(["from-hf", "--hf", hf_dir, "--output", ckpt]) == 0
    arch = model_overrides(json.load(open(os.path.join(hf_dir, "config.json"))), hf_dir)
    lr, wd, betas, eps = 1e-3, 0.1, (0.9, 0.95), 1e-6
    trainer = setup(_flags(str(tmp_path / "run"), corpus, arch, "--checkpoint.load", ckpt, "--checkpoint.finetune",
                           "true", "--train.iters", "20", "--optim.lr", str(lr), "--optim.weight_decay", str(wd),
                           "--optim.betas", f"[{betas[0]}, {betas[1]}]", "--optim.eps", str(eps),
                           "--optim.clip_grad", "0", "--schedule.decay", "constant", "--schedule.warmup_iters", "0"))
    seen, corrupt = [], trainer.faults.corrupt

    def record(it, consumed, batches, vocab):
        batches = corrupt(it, consumed, batches, vocab)
        seen.append([(t.clone(), y.clone()) for t, y in batches])
        return batches
    trainer.faults.corrupt = record
    trainer.fit()
    with open(os.path.join(str(tmp_path / "run"), "metrics.jsonl")) as fh:
        ours = [r["loss"] for r in map(json.loads, fh) if "loss" in r]

    model = reference.train()  # dropout 0: train mode changes nothing else
    decay = [p for p in model.parameters() if p.ndim >= 2]  # the HF Trainer's groups: not biases, not norms
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=betas, eps=eps)
    theirs = []
    for batches in seen:
        opt.zero_grad()
        count = sum(t.numel() for _, t in batches)
        total = 0.0
        for tokens, targets in batches:
            logits = model(tokens).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")
            (loss / count).backward()
            total += loss.item()
        opt.step()
        theirs.append(total / count)
    assert len(ours) == len(theirs) == 20
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert theirs[-1] < theirs[0]


# the families under parallel layouts against one process: the qwen_* and gpt_neox_* cases of
# tests/layouts.py


# -- the spec table: counts, initialization, weight decay -----------------------------------------------


def _config(*overrides):
    return load_config(None, ["--model.vocab_size", "300", *BASE, *overrides])


@pytest.mark.parametrize("flags", [(), ("--model.tie_embeddings", "true"), QWEN, NEOX,
                                   (*NEOX, "--model.parallel_residual", "false")])
def test_parameter_count_is_the_spec_table(flags):
    cfg = _config(*flags, "--parallel.tp", "2", "--parallel.pp", "2")
    table = {n: s for pp in range(2) for tp in range(2) for n, s in rank_param_specs(cfg, pp, tp).items()}
    assert num_parameters(model_args(cfg)) == sum(s.numel for s in table.values())


@pytest.mark.parametrize("name, published", [("pythia_160m", 162_322_944), ("pythia_1p4b", 1_414_647_808)])
def test_pythia_configs_have_the_published_parameter_counts(name, published):
    cfg = load_config(os.path.join(ROOT, "configs", f"{name}.yaml"), [])
    m, args = cfg.model, model_args(cfg)
    assert num_parameters(args) == published
    hf = transformers.GPTNeoXConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                                    num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                                    intermediate_size=args.ffn_hidden_size, rotary_pct=m.rotary_pct)
    with torch.device("meta"):
        theirs = transformers.GPTNeoXForCausalLM(hf)
    assert sum(p.numel() for p in theirs.parameters()) == published


@pytest.mark.parametrize("name", ["olmo2_1b", "olmo3_7b"])
def test_olmo_configs_count_what_transformers_builds(name):
    """The shipped OLMo configs written as Hugging Face configs build, on the meta device, a
    transformers model of exactly our parameter count (post-norms, full-width QK-norm included)."""
    from megapretrain.checkpoint.hf import hf_config

    cfg = load_config(os.path.join(ROOT, "configs", f"{name}.yaml"), [])
    hf = hf_config(cfg, torch.bfloat16, None, None)
    assert hf["model_type"] == {"olmo2_1b": "olmo2", "olmo3_7b": "olmo3"}[name]
    config_cls = getattr(transformers, {"olmo2": "Olmo2Config", "olmo3": "Olmo3Config"}[hf["model_type"]])
    config = config_cls(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        theirs = getattr(transformers, hf["architectures"][0])(config)
    assert sum(p.numel() for p in theirs.parameters()) == num_parameters(model_args(cfg))


@pytest.mark.parametrize("flags", [QWEN, NEOX])
def test_biases_and_norm_weights_do_not_decay_and_start_as_declared(flags):
    specs = rank_param_specs(_config(*flags, "--parallel.tp", "2", "--parallel.sequence_parallel", "true"), 0, 1)
    for name, spec in specs.items():
        vector = len(spec.shape) == 1  # a bias or a norm weight
        assert spec.weight_decay is not vector, name
        if name.endswith(".bias"):
            assert spec.init.kind == "zeros", name
        elif vector:
            assert spec.init.kind == "ones", name
        else:
            assert spec.init.kind == "normal" and spec.init.std > 0, name
    assert any(n.endswith(".bias") for n in specs)
    if flags == QWEN:  # one QK-norm weight for every head, tp ranks hold other heads: partial grads
        assert specs["layers.0.self_attn.q_norm.weight"].partial_grad_over_tp
        assert not specs["layers.0.self_attn.q_proj.bias"].partial_grad_over_tp
        assert specs["layers.0.self_attn.q_proj.bias"].tp_dim == 0
    else:  # a row-parallel bias under sequence parallelism: each rank's positions
        assert specs["layers.0.self_attn.o_proj.bias"].partial_grad_over_tp
        assert specs["layers.0.self_attn.o_proj.bias"].tp_dim is None


@pytest.mark.parametrize("flags, message", [
    (("--model.family", "gpt_neox"), "model.mlp=swiglu: GPT-NeoX's MLP is gelu"),
    ((*NEOX, "--model.qk_norm", "true"), "model.qk_norm=true is a llama-family option"),
    ((*NEOX, "--model.num_kv_heads", "2"), "GPT-NeoX has no grouped-query attention"),
    (("--model.rotary_pct", "0.5"), "the llama family rotates every head dim"),
    ((*NEOX, "--model.rotary_pct", "0.1"), "must be even and at least 2"),
    (("--model.family", "mamba"), "model.family='mamba' is not a model family"),
])
def test_family_rules_are_one_line(flags, message):
    from megapretrain.resolve import resolve
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        resolve(_config(*flags), 1)
    assert "\n" not in str(err.value)


def test_triton_kernels_name_the_layers_that_have_none_once(monkeypatch, capsys):
    from megapretrain.model import build
    from megapretrain.parallel.state import ParallelState

    monkeypatch.setattr(build, "resolve_kernels", lambda choice, device: "triton")  # building calls no kernel
    for flags, said in ((NEOX, ["model.kernels=triton: LayerNorm and GELU of model.family=gpt_neox have no Triton "
                                "kernel and run torch's ops"]), (QWEN, [])):
        build.build_model_chunks(_config(*flags, "--train.device", "cpu"), ParallelState())
        assert [line for line in capsys.readouterr().out.splitlines() if "model.kernels" in line] == said


def test_the_family_is_read_off_model_type_or_architectures():
    from megapretrain.model.families import family_of_hf
    from megapretrain.model.hf_adapter import ConvertError

    assert family_of_hf({"model_type": "qwen3"}, "x").name == "llama"
    assert family_of_hf({"architectures": ["GPTNeoXForCausalLM"]}, "x").name == "gpt_neox"
    with pytest.raises(ConvertError, match="model_type='mamba'.*is not a family megapretrain converts"):
        family_of_hf({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}, "x")


# -- the Family type: every registered family has every part, and nothing else names one -----------

# per registered family: flags its rules accept, and flags they refuse (with the message's start);
# a family registered without an entry here fails the tests below
ACCEPTED = {"llama": QWEN, "gpt_neox": NEOX, "olmo": OLMO3_YARN}
REFUSED = {"llama": (("--model.rotary_pct", "0.5"), "model.rotary_pct=0.5: the llama family"),
           "gpt_neox": ((*NEOX, "--model.num_kv_heads", "2"), "model.num_kv_heads=2: GPT-NeoX"),
           "olmo": ((*OLMO3, "--model.qk_norm", "true"), "model.qk_norm=true is the llama family's")}


def _registered():
    from megapretrain.model.families import FAMILIES
    assert set(ACCEPTED) == set(REFUSED) == set(FAMILIES), "every registered family needs its cases"
    return FAMILIES


def test_only_the_family_modules_compare_a_family_to_its_name():
    """No package module but a family's own (its module, its adapter's) and the registry compares
    a family (``x.family``, ``family``) with a string, or anything with a family's name: such a
    comparison gives a new family another's rules silently. Ask the Family object instead."""
    import ast
    import inspect

    from megapretrain.model import families
    from megapretrain.model import family as family_type

    registry = _registered()
    owners = {inspect.getsourcefile(m) for m in (families, family_type)}
    for fam in registry.values():
        owners |= {inspect.getsourcefile(fam.build_spec), inspect.getsourcefile(type(fam.hf))}

    def names_a_family(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "family" or \
            isinstance(node, ast.Name) and node.id in ("family", "model_family")

    def strings(node) -> list[str]:
        items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return [n.value for n in items if isinstance(n, ast.Constant) and isinstance(n.value, str)]

    wrong = []
    for folder, _, files in os.walk(os.path.join(ROOT, "megapretrain")):
        for f in sorted(files):
            path = os.path.join(folder, f)
            if not f.endswith(".py") or path in owners:
                continue
            for node in ast.walk(ast.parse(open(path).read(), path)):
                if isinstance(node, ast.Compare):
                    sides = [node.left, *node.comparators]
                    literals = [s for side in sides for s in strings(side)]
                    by_name = any(map(names_a_family, sides)) and literals
                    if by_name or set(literals) & set(registry):
                        wrong.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert not wrong, f"compare family names outside the family modules: {wrong}"


def test_every_family_has_a_spec_with_its_defaults_filled():
    from megapretrain.model.args import FAMILY_DEFAULTS, ModelArgs
    from megapretrain.model.layers import LayerSpec

    for name, fam in _registered().items():
        args = model_args(_config(*ACCEPTED[name], "--model.family", name))
        assert all(getattr(args, k) is None for k in FAMILY_DEFAULTS)  # null: the family's value
        spec = fam.layer_spec(args)
        assert isinstance(spec, LayerSpec)
        flags = ("qkv_bias", "dense_bias", "qk_norm", "fused_qkv", "parallel_residual", "full_qk_norm",
                 "post_norm")
        assert all(isinstance(getattr(spec, k), bool) for k in flags), name
        assert all(isinstance(getattr(fam.args(args), k), bool) for k in FAMILY_DEFAULTS)
        tiny = ModelArgs(1, 64, 4, 4, 128, 300, family=name)
        assert isinstance(fam.torch_only_layers(tiny), list)


def test_every_family_accepts_its_cases_and_refuses_a_bad_shape_in_one_line():
    from megapretrain.resolve import resolve

    for name in _registered():
        resolve(_config(*ACCEPTED[name], "--model.family", name), 1)
        flags, message = REFUSED[name]
        with pytest.raises(ConfigError, match=message) as err:
            resolve(_config(*flags, "--model.family", name), 1)
        assert "\n" not in str(err.value)


def test_every_family_s_adapter_round_trips_its_config_json():
    """cfg → config.json → checked → model.* flags → the same model, read as its family."""
    from megapretrain.model.families import family_of_hf

    for name, fam in _registered().items():
        cfg = _config(*ACCEPTED[name], "--model.family", name)
        if name == "llama":  # both Qwen options at once match no Hugging Face architecture
            cfg = _config("--model.qk_norm", "true", "--model.head_dim", "32")
        args = fam.args(model_args(cfg))
        hf = fam.hf.hf_config(cfg, args, "float32", None, None)
        fam.hf.check(hf, "config.json")
        assert family_of_hf(hf, "config.json") is fam
        flags = fam.hf.model_flags(hf, "config.json")
        again = _config(*(f for k, v in flags.items() for f in (f"--model.{k}", json.dumps(v))))
        assert fam.args(model_args(again)) == args, name


def test_a_family_without_rules_or_defaults_is_refused_not_given_llama_s(monkeypatch):
    import dataclasses

    from megapretrain.model import families, llama
    from megapretrain.model.family import Family
    from megapretrain.resolve import resolve

    with pytest.raises(TypeError):  # no rules: it cannot be made
        Family(name="fake", build_spec=llama.layer_spec, hf=llama.ADAPTER)
    with pytest.raises(TypeError, match="FAMILY_DEFAULTS"):
        Family(name="fake", build_spec=llama.layer_spec, hf=llama.ADAPTER, check=lambda m: None)
    flags = ("--model.family", "fake", "--model.rotary_pct", "0.5")  # what llama's rules refuse
    unknown = r"model.family='fake' is not a model family \(valid: llama, gpt_neox"
    with pytest.raises(ConfigError, match=unknown):
        resolve(_config(*flags), 1)
    def spec(args):
        return dataclasses.replace(llama.layer_spec(args), parallel_residual=args.parallel_residual)
    fake = Family(name="fake", build_spec=spec, hf=llama.ADAPTER, check=lambda m: None,
                  defaults={"parallel_residual": True})
    monkeypatch.setitem(families.FAMILIES, "fake", fake)
    resolve(_config(*flags), 1)  # its own rules, not llama's
    assert families.layer_spec(model_args(_config(*flags))).parallel_residual  # its own default


def test_the_planner_reads_fused_qkv_off_the_layer_spec(monkeypatch):
    import dataclasses

    from megapretrain.model import families, llama
    from megapretrain.model.args import ModelArgs
    from megapretrain.planner.fp8 import _linears

    for name, fam in _registered().items():
        args = ModelArgs(2, 64, 4, 4, 128, 300, mlp="gelu", family=name)
        assert _linears(args, 1)[0][2] == (1 if fam.layer_spec(args).fused_qkv else 3), name
    def spec(args):
        return dataclasses.replace(llama.layer_spec(args), fused_qkv=True)
    fused = dataclasses.replace(llama.FAMILY, name="fused", build_spec=spec)
    monkeypatch.setitem(families.FAMILIES, "fused", fused)
    assert _linears(ModelArgs(2, 64, 4, 4, 128, 300, family="fused"), 1)[0][2] == 1


@pytest.mark.parametrize("change, message", [
    (lambda hf: hf["rope_parameters"]["full_attention"].update(rope_type="dynamic", factor=8.0),
     "rope_type must be llama3"),
    (lambda hf: hf["rope_parameters"]["full_attention"].update(
        rope_type="yarn", factor=8.0, original_max_position_embeddings=8, truncate=False), "truncate"),
    (lambda hf: hf.update(attention_bias=True), "not supported by megapretrain's olmo family"),
    (lambda hf: hf.update(layer_types=["sliding_attention"]), "layer_types=")])
def test_olmo_config_json_the_family_cannot_compute_is_refused_in_one_line(change, message, tmp_path):
    from megapretrain.checkpoint.hf import read_hf_config

    _hf_model("olmo3").save_pretrained(str(tmp_path))
    path = os.path.join(str(tmp_path), "config.json")
    hf = json.load(open(path))
    change(hf)
    json.dump(hf, open(path, "w"))
    with pytest.raises(convert.ConvertError, match=message) as err:
        read_hf_config(str(tmp_path))
    assert "\n" not in str(err.value)


def test_olmo3_yarn_on_the_full_layers_matters_and_reads_from_the_released_form():
    """The YaRN case of the round trip above is one where YaRN changes the logits (40 tokens, a
    window of 7); a config.json in the released checkpoints' form (top-level rope_scaling and
    rope_theta) reads as transformers reads it: the scaling and the base on the full layers."""
    from megapretrain.model.olmo_hf import ADAPTER

    yarn, plain = _hf_model("olmo3_yarn"), _hf_model("olmo3")
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (yarn(tokens).logits - plain(tokens).logits).abs().max() > 1e-3
    nested = yarn.config.to_dict()
    full = dict(nested["rope_parameters"]["full_attention"])
    released = {**nested, "rope_theta": full.pop("rope_theta"), "rope_scaling": full}
    del released["rope_parameters"]
    assert transformers.Olmo3Config(**released).rope_parameters == yarn.config.rope_parameters
    flags = ADAPTER.model_flags(released, "config.json")
    assert flags == ADAPTER.model_flags(nested, "config.json")
    assert flags["rope_scaling"]["rope_type"] == "yarn" and flags["rope_theta"] == 10000.0
    assert flags["sliding_rope"] == {"rope_theta": 500000.0, "rope_type": "default"}


def test_olmo_norms_round_as_transformers_in_bf16():
    """In bf16 the OLMo family's norms — its sublayer and final norm, and the QK-norm over the whole
    projection — equal transformers' Olmo3RMSNorm bit for bit: the weight multiplies x / rms(x) in fp32,
    then one rounding. The Llama order (x / rms(x) rounded first) differs on the same input."""
    from transformers.models.olmo3.modeling_olmo3 import Olmo3RMSNorm

    from megapretrain.model import olmo
    from megapretrain.model.args import ModelArgs
    from megapretrain.model.layers import RMSNorm, SpanningRMSNorm
    from megapretrain.parallel.state import Group

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 96, generator=g) * 3).bfloat16()
    weight = (1 + 0.5 * torch.randn(96, generator=g)).bfloat16()
    theirs = Olmo3RMSNorm(96, eps=1e-6).bfloat16()
    spec = olmo.layer_spec(ModelArgs(2, 96, 4, 4, 128, 300, family="olmo"))
    ours = [spec.norm(96, 1e-6, dtype=torch.bfloat16),
            SpanningRMSNorm(96, 1e-6, Group("tp", [0]), dtype=torch.bfloat16)]
    llama = RMSNorm(96, 1e-6, dtype=torch.bfloat16)
    with torch.no_grad():
        for norm in (theirs, *ours, llama):
            norm.weight.copy_(weight)
        expected = theirs(x)
        for norm in ours:
            assert torch.equal(norm(x), expected), type(norm).__name__
        assert not torch.equal(llama(x), expected)
