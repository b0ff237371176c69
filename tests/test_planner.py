"""The planner's memory model against what the code really allocates, its time model's parts, and
tools/plan.py on the shipped configs."""

from __future__ import annotations

import os
import shlex

import pytest
import torch

from megapretrain.config import load_config, validate
from megapretrain.model.build import model_args
from megapretrain.model.llama import ModelArgs, flops_per_token
from megapretrain.monitor.flops import DEVICES
from megapretrain.optim.optimizer import MixedPrecisionAdamW
from megapretrain.parallel.state import ParallelState
from megapretrain.planner import GIB, Layout, estimate, layer_params, search, split_layers, state_bytes_per_param

from helpers import build, tiny_args
from test_preprocess_data import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
plan_tool = load_tool("plan")


def test_parameter_and_flop_counts_are_the_model_s():
    args = tiny_args(hidden_size=128, ffn_hidden_size=352, num_heads=8, num_kv_heads=2, num_layers=3)
    model = build(ParallelState(), args)
    split, replicated, head = layer_params(args)
    layer = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.0."))
    norms = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.0.") and "norm" in n)
    assert (split, replicated, head) == (layer - norms, norms, model.norm.weight.numel())
    # the step's model FLOPs (read back from the MFU) are the trainer's flops_per_token
    e = estimate(args, 256, Layout(tp=1, pp=1, dp=1, zero=0), 8, DEVICES["h100"])
    flops = e.mfu * e.time["total"] * DEVICES["h100"].peak_tflops * 1e12
    assert flops == pytest.approx(flops_per_token(args, 256) * 8 * 256, rel=1e-9)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_state_bytes_per_parameter_are_what_the_optimizer_allocates(precision):
    ps = ParallelState()
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model = build(ps, tiny_args(), dtype=dtype)
    opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(), load_config(None).optim, precision,
                              ps)
    report = opt.memory_report()
    assert report["total"] / report["padded_numel"] == state_bytes_per_param(precision, 0, 1)
    # the multi-rank figures tests/test_data_parallel.py measures at dp = 2
    assert [state_bytes_per_param("fp32", z, 2) for z in (0, 1, 2)] == [16, 12, 10]
    assert [state_bytes_per_param("bf16", z, 2) for z in (0, 1, 2)] == [18, 12, 10]


def test_uneven_pipelines_put_the_spare_layers_in_the_middle():
    assert split_layers(8, 4) is None
    assert split_layers(126, 32) == (3,) + (4,) * 30 + (3,)
    assert split_layers(10, 4) == (2, 3, 3, 2)
    assert sum(split_layers(127, 16)) == 127


def test_estimates_move_the_way_the_layout_says():
    m, seq = ModelArgs(32, 4096, 32, 8, 14336, 128256), 4096
    h100 = DEVICES["h100"]
    base = estimate(m, seq, Layout(tp=2, pp=4, dp=8, zero=1), 512, h100)
    assert base.time["bubble"] > 0 and base.time["tensor"] > 0
    interleaved = estimate(m, seq, Layout(tp=2, pp=4, dp=8, vpp=2, zero=1), 512, h100)
    assert interleaved.time["bubble"] < base.time["bubble"]
    full = estimate(m, seq, Layout(tp=2, pp=4, dp=8, zero=1, recompute="full"), 512, h100)
    assert full.memory["activations"] < base.memory["activations"] / 4
    assert full.time["compute"] == pytest.approx(base.time["compute"] * 4 / 3)
    zero2 = estimate(m, seq, Layout(tp=2, pp=4, dp=8, zero=2), 512, h100)
    assert zero2.memory["state"] < base.memory["state"]
    one_gpu_time = base.time["compute"] * 64  # the same work on one GPU
    assert estimate(m, seq, Layout(tp=1, pp=1, dp=1, zero=0), 512, h100).time["compute"] == pytest.approx(one_gpu_time)
    assert 0 < base.mfu < h100.efficiency


def test_every_layout_found_for_a_config_is_one_the_trainer_accepts():
    cfg = load_config(os.path.join(ROOT, "configs", "llama3_70b.yaml"))
    found = search(model_args(cfg), cfg.train.seq_length, 512, cfg.train.global_batch_size, DEVICES["h100"])
    fitting = [e for e in found if e.fits]
    assert fitting and all(e.memory["total"] <= 80 * GIB for e in fitting)
    assert [e.time["total"] for e in fitting] == sorted(e.time["total"] for e in fitting)
    for e in fitting[:5] + fitting[-3:]:
        checked = load_config(os.path.join(ROOT, "configs", "llama3_70b.yaml"), shlex.split(e.layout.flags()))
        plan, _ = validate(checked, 512)
        assert plan.dp == e.layout.dp


def test_the_tool_ranks_layouts_and_checks_a_config_s_own(capsys):
    config = os.path.join(ROOT, "configs", "llama3_8b.yaml")
    assert plan_tool.main(["--config", config, "--gpus", "64", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "fastest: --parallel.tp" in out and out.count("\n") > 6
    assert plan_tool.main(["--config", os.path.join(ROOT, "configs", "llama3_405b.yaml"), "--gpus", "2048",
                           "--check"]) == 0
    assert "--parallel.pipeline_layers '[3, 4," in capsys.readouterr().out
    assert plan_tool.main(["--config", config, "--gpus", "8", "--memory-gb", "8"]) == 1
    assert "nothing fits in 8 GB" in capsys.readouterr().out
    assert plan_tool.main(["--config", config, "--gpus", "7", "--check"]) == 2
    assert "must divide the world size 7" in capsys.readouterr().err
