"""Config loading, overrides, coercion and every validation rule."""

from __future__ import annotations

import glob
import os
import re

import pytest
import yaml

from megapretrain.config import Config, ConfigError, check_fields, help_text, load_config, to_dict
from megapretrain.model.args import default_ffn_hidden_size, padded_vocab_size
from megapretrain.resolve import resolve


def valid(**sections) -> Config:
    cfg = load_config(None, [])
    cfg.model.vocab_size = 257
    for dotted, value in sections.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


def test_defaults_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"iters": 7, "seq_length": 64}, "checkpoint": {"async": True}}))
    cfg = load_config(str(path), ["--train.iters", "9", "--data.paths=[a, b]", "--optim.lr", "3e-4",
                                  "--parallel.sequence_parallel", "true", "--model.num_kv_heads", "null"])
    assert cfg.train.iters == 9 and cfg.train.seq_length == 64        # CLI beats YAML beats default
    assert cfg.train.micro_batch_size == Config().train.micro_batch_size
    assert cfg.data.paths == ["a", "b"]
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.parallel.sequence_parallel is True
    assert cfg.checkpoint.async_save is True and to_dict(cfg)["checkpoint"]["async"] is True
    assert cfg.model.num_kv_heads is None


def test_yaml_strings_are_coerced(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 3e-4\ntrain:\n  iters: 10.0\n")  # YAML 1.1 reads 3e-4 as a string
    cfg = load_config(str(path))
    assert cfg.optim.lr == pytest.approx(3e-4) and cfg.train.iters == 10


def test_integers_in_exponent_notation(tmp_path):
    """3e9 (a string to YAML 1.1) is an integer field's 3,000,000,000, on the command line and in a
    file; exact beyond float's 53 bits; a fraction, NaN or a number past int64 is still refused."""
    cfg = load_config(None, ["--train.iters", "null", "--train.train_tokens", "3e9", "--train.seq_length", "2.048E3"])
    assert cfg.train.train_tokens == 3_000_000_000 and isinstance(cfg.train.train_tokens, int)
    assert cfg.train.seq_length == 2048
    assert load_config(None, ["--train.train_tokens", "3_000_000_000"]).train.train_tokens == 3_000_000_000
    assert load_config(None, ["--train.train_tokens", "12345678901234567e0"]).train.train_tokens == 12345678901234567
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  iters: null\n  train_tokens: 1.5e12\n")
    assert load_config(str(path)).train.train_tokens == 1_500_000_000_000
    for raw in ("2.5e0", "1e-3", "nan", "3e9x", "1e99999"):
        with pytest.raises(ConfigError, match="train.train_tokens: expected an integer"):
            load_config(None, ["--train.train_tokens", raw])
    with pytest.raises(ConfigError, match=r"train.train_tokens=10000000000000000000000000.*below 2\*\*63"):
        check_fields(load_config(None, ["--train.train_tokens", "1e25"]))


@pytest.mark.parametrize("args, message", [
    (["--trian.iters", "5"], "did you mean '--train.iters'"),
    (["--train.iter", "5"], "did you mean '--train.iters'"),
    (["--train.iters", "abc"], "train.iters: expected an integer"),
    (["--train.iters", "2.5"], "train.iters: expected an integer"),
    (["--parallel.sequence_parallel", "maybe"], "expected true or false"),
    (["--optim.lr", "fast"], "optim.lr: expected a number"),
    (["--data.paths", "5"], "expected a list"),
    (["--train.iters"], "needs a value"),
    (["train.iters", "5"], "unexpected argument"),
])
def test_bad_overrides(args, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config(None, args)


def test_unknown_yaml_key_suggests(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  hiden_size: 64\n")
    with pytest.raises(ConfigError, match="unknown config key 'model.hiden_size': did you mean 'model.hidden_size'"):
        load_config(str(path))


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))


@pytest.mark.parametrize("changes, world, message", [
    ({"parallel__tp": 3}, 1, r"parallel.tp=3 × parallel.pp=1 = 3 must divide the world size 1"),
    ({"parallel__tp": 3, "model__num_heads": 6, "model__hidden_size": 96, "model__ffn_hidden_size": 100}, 3,
     r"parallel.tp=3 must divide model.ffn_hidden_size=100"),
    ({"model__num_heads": 3}, 1, r"model.num_heads=3 must divide model.hidden_size=128"),
    ({"model__num_kv_heads": 3}, 1, r"model.num_kv_heads=3 must divide model.num_heads=4"),
    ({"parallel__tp": 8}, 8, r"parallel.tp=8 must divide model.num_heads=4 \(valid: 1, 2, 4\)"),
    ({"model__num_kv_heads": 1, "parallel__tp": 2}, 2, r"parallel.tp=2 must divide model.num_kv_heads=1"),
    ({"parallel__pp": 4, "model__num_layers": 6}, 4, r"= 4 must divide model.num_layers=6"),
    ({"train__global_batch_size": 10}, 2, r"train.global_batch_size=10 must be a multiple of"),
    ({"train__precision": "fp8"}, 1, r"train.precision='fp8' is not one of"),
    ({"schedule__decay": "step"}, 1, r"schedule.decay='step' is not one of"),
    ({"parallel__recompute": "some"}, 1, r"parallel.recompute='some' is not one of"),
    ({"parallel__zero": 4}, 1, r"parallel.zero=4 must be 0, 1, 2 or 3"),
    ({"optim__min_lr": 1.0}, 1, r"optim.min_lr=1.0 must be between 0 and optim.lr"),
    ({"optim__betas": [0.9]}, 1, r"optim.betas=\[0.9\] must be two numbers"),
    ({"optim__eps": 0.0}, 1, r"optim.eps=0.0 must be positive"),
    ({"optim__clip_grad": -1.0}, 1, r"optim.clip_grad=-1.0 must be non-negative"),
    ({"schedule__warmup_iters": 200}, 1, r"schedule.decay_iters=100 must be ≥ schedule.warmup_iters=200"),
    ({"data__split": [0, 1, 1]}, 1, r"data.split=\[0, 1, 1\] must be three non-negative weights"),
    ({"train__iters": 0}, 1, r"train.iters=0 must be at least 1"),
    ({"parallel__sequence_parallel": True, "parallel__tp": 2, "train__seq_length": 255}, 2,
     r"sequence_parallel needs parallel.tp=2 to divide train.seq_length=255"),
    ({"model__vocab_size": None}, 1, r"model.vocab_size is unset"),
    ({"recovery__action": "False"}, 1, r"recovery.action='False' must be one of: rollback, alert, none "
                                       r"\(YAML reads off/on/yes/no as booleans\)"),
    ({"recovery__window": 1}, 1, r"recovery.window=1 must be at least 2"),
    ({"recovery__max_rollbacks": 0}, 1, r"recovery.max_rollbacks=0 must be at least 1"),
])
def test_validation_errors(changes, world, message):
    cfg = valid(**changes)
    with pytest.raises(ConfigError, match=message):
        resolve(cfg, world)


def test_validation_does_not_mutate_and_derives_plan():
    cfg = valid(train__global_batch_size=32, train__micro_batch_size=4, parallel__tp=2)
    before = to_dict(cfg)
    run = resolve(cfg, world_size=8)
    plan, warnings = run.sizes, list(run.warnings)
    assert to_dict(cfg) == before
    assert (plan.dp, plan.grad_accum) == (4, 2)
    assert plan.tokens_per_batch == 32 * cfg.train.seq_length
    assert plan.total_tokens == plan.tokens_per_batch * cfg.train.iters
    assert plan.padded_vocab == 512 and plan.num_kv_heads == cfg.model.num_heads
    assert warnings == []


def test_schedule_warnings():
    warnings = list(resolve(valid(schedule__warmup_iters=10, train__iters=100), 1).warnings)
    assert any("more than 5%" in w for w in warnings)
    warnings = list(resolve(valid(schedule__decay_iters=200, train__iters=100), 1).warnings)
    assert any("not reached" in w for w in warnings)


def test_derived_sizes():
    assert default_ffn_hidden_size(4096) == 11008
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 8) == 51200
    assert "--train.iters" in help_text() and "--checkpoint.async" in help_text()


CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "*.yaml")))


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_configs_validate_at_their_world_size(path):
    """Each config's first line names the GPUs it is laid out for; it must validate there."""
    with open(path) as fh:
        header = fh.readline()
    match = re.search(r"(\d+) GPUs", header)
    world = int(match.group(1)) if match else 1
    cfg = load_config(path)
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = 257  # the byte tokenizer's
    plan = resolve(cfg, world).sizes
    assert plan.world_size == world and plan.dp >= 1
