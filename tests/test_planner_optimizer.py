"""The planner's optimizer costs: AdamW's, Muon's and bf16 moments' state, Newton–Schulz FLOPs
against torch's own count, Muon's traffic, and tools/plan.py's optimizer share."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megapretrain.commands import plan as plan_tool
from megapretrain.config import load_config
from megapretrain.model.build import model_args, one_layer_specs
from megapretrain.monitor.flops import DEVICES
from megapretrain.optim.muon import is_muon_matrix, newton_schulz
from megapretrain.planner import Layout, estimate, layer_params
from megapretrain.planner.memory import stage_memory
from megapretrain.planner.optimizer import (
    OptimizerSpec,
    muon_layer_params,
    muon_step_seconds,
    ns_flops,
    ns_seconds,
)
from megapretrain.simulate.run import planned, resolve_for_simulation, simulate_rank

from helpers import tiny_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _args():
    return tiny_args(hidden_size=64, ffn_hidden_size=160, num_heads=4, num_kv_heads=2,
                     num_layers=4)


def test_muon_parameters_are_the_decoder_matrices():
    args = _args()
    matrices = [s for s in one_layer_specs(args).values() if s.layer == 0 and len(s.shape) == 2]
    assert matrices and all(is_muon_matrix(s) for s in matrices)
    assert muon_layer_params(args) == sum(s.numel for s in matrices)
    split, replicated, _ = layer_params(args)
    assert muon_layer_params(args) <= split and replicated > 0  # norms stay AdamW's


@pytest.mark.parametrize("zero,dp", [(0, 1), (1, 4), (3, 2)])
def test_optimizer_state_adamw_muon_bf16_moments(zero, dp):
    args = _args()
    layout = Layout(tp=2, pp=2, dp=dp, zero=zero)
    layer = layer_params(args)
    kw = dict(layer=layer, precision="bf16", fused_adamw=False)
    shard = dp if zero >= 1 else 1
    for r in range(2):
        adam = stage_memory(args, 64, layout, r, 4, **kw)
        muon = stage_memory(args, 64, layout, r, 4, optimizer=OptimizerSpec("muon"), **kw)
        bf16 = stage_memory(args, 64, layout, r, 4, optimizer=OptimizerSpec(moments_dtype="bf16"), **kw)
        params = adam["parameters"] * (shard if zero == 3 else 1) / 2  # bf16 weights
        assert adam["optimizer"] == pytest.approx(params * 12 / shard)  # master + 2 moments
        # 2 layers a stage, each matrix tp-split: 4 bytes (one moment) less per Muon parameter
        muon_params = 2 * muon_layer_params(args) / 2
        assert adam["optimizer"] - muon["optimizer"] == pytest.approx(muon_params * 4 / shard)
        assert adam["optimizer"] - bf16["optimizer"] == pytest.approx(params * 4 / shard)
        others = {k: v for k, v in adam.items() if k not in ("optimizer", "total")}
        assert others == {k: v for k, v in muon.items() if k not in ("optimizer", "total")}


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32)])
@pytest.mark.parametrize("steps", [1, 5])
def test_newton_schulz_flops_are_torch_s_count(shape, steps):
    u = torch.randn(shape)
    with FlopCounterMode(display=False) as counter:
        newton_schulz(u, steps, torch.float32)
    assert ns_flops(*shape, steps) == counter.get_total_flops()


def test_newton_schulz_work_is_balanced_over_the_shard_ranks():
    args = _args()
    one = ns_seconds(args, 4, 1, 5, 1e12)
    total = 4 * sum(ns_flops(*s.shape, 5) for s in one_layer_specs(args).values()
                    if s.layer == 0 and is_muon_matrix(s)) / 1e12
    assert one == pytest.approx(total)
    four = ns_seconds(args, 4, 4, 5, 1e12)  # 28 matrices over 4 ranks: a quarter or a bit more
    assert total / 4 <= four < total / 2
    assert ns_seconds(args, 4, 64, 5, 1e12) < four


def test_muon_collectives_are_counted_where_the_iterations_do_not_hide_them():
    """The planner's replay of Muon's step: without collectives it is the busiest rank's
    iterations; without iterations, the all-to-alls back to back — each rank moving about its
    share (its shard out, its own matrices in), far less than gathering and reduce-scattering
    every matrix; with both, less than the two one after the other (the collectives run under
    the iterations) and no less than either."""
    args = _args()

    def step(gemm_s, a2a_s):
        return muon_step_seconds(args, 4, 4, 1, False, 5, 2, gemm_s, a2a_s, lambda b: 0.0)

    gemm = lambda m, n, k: 2.0 * m * n * k / 1e12
    a2a = lambda nbytes: nbytes / 1e8
    ns, alone = step(gemm, lambda b: 0.0)
    assert alone == ns == ns_seconds(args, 4, 4, 5, 1e12)
    _, comm = step(lambda m, n, k: 0.0, a2a)
    matrices = 4 * muon_layer_params(args) * 2  # bytes of the stage's updates, bf16
    share = 2 * matrices * 3 / 4 / 4 / 1e8  # both ways, each rank 3/4 of a quarter, in balance
    ring = 2 * matrices * 3 / 4 / 1e8  # both ways, every matrix gathered and reduce-scattered
    assert share <= comm < ring / 2
    busiest, both = step(gemm, a2a)
    assert busiest == ns and max(ns, comm) <= both < ns + comm


@pytest.mark.parametrize("config, gpus", [("llama3_8b", 64), ("llama3_70b", 512),
                                          ("llama3_405b", 2048)])
def test_muon_share_of_the_step_is_within_3_percent(config, gpus):
    """The shipped configs at their layouts on H100s: Muon's step (iterations and what its
    collectives leave exposed) is at most 3% of the step, as tools/plan.py --optim.optimizer
    muon prints."""
    from megapretrain.planner.model import estimate_run
    from megapretrain.resolve import resolve

    cfg = load_config(os.path.join(ROOT, "configs", f"{config}.yaml"),
                      ["--optim.optimizer", "muon"])
    est = estimate_run(cfg, resolve(cfg, gpus).layout, DEVICES["h100"])
    assert est.time["optimizer_ns"] > 0 and est.time["optimizer_comm"] > 0
    assert est.time["optimizer"] <= 0.03 * est.time["total"]


def test_muon_adds_time_and_traffic():
    cfg = load_config(os.path.join(ROOT, "configs", "llama3_8b.yaml"), [])
    m, h100 = model_args(cfg), DEVICES["h100"]
    for layout in (Layout(tp=1, pp=1, dp=8, zero=1), Layout(tp=2, pp=2, dp=4, zero=3)):
        adam = estimate(m, 2048, layout, 64, h100)
        muon = estimate(m, 2048, layout, 64, h100, optimizer=OptimizerSpec("muon"))
        assert adam.time["optimizer_ns"] == adam.time["optimizer_comm"] == 0
        assert muon.time["optimizer_ns"] > 0 and muon.time["optimizer_comm"] > 0
        assert muon.time["optimizer"] > adam.time["optimizer"]
        assert muon.time["total"] - adam.time["total"] == pytest.approx(
            muon.time["optimizer"] - adam.time["optimizer"])
        assert muon.memory["state"] < adam.memory["state"]
    # zero 0 without tp: every rank runs every matrix, nothing to gather
    z0 = estimate(m, 2048, Layout(tp=1, pp=1, dp=8, zero=0), 64, h100, optimizer=OptimizerSpec("muon"))
    assert z0.time["optimizer_comm"] == 0 and z0.time["optimizer_ns"] > muon.time["optimizer_ns"]
    bf16 = estimate(m, 2048, Layout(tp=1, pp=1, dp=8, zero=1), 64, h100,
                    optimizer=OptimizerSpec(moments_dtype="bf16"))
    fp32 = estimate(m, 2048, Layout(tp=1, pp=1, dp=8, zero=1), 64, h100)
    assert bf16.time["optimizer"] < fp32.time["optimizer"]


def test_plan_prints_the_optimizer_share(capsys):
    config = os.path.join(ROOT, "configs", "llama3_8b.yaml")
    assert plan_tool.main(["--config", config, "--gpus", "64", "--check", "--optim.optimizer",
                           "muon"]) == 0
    out = capsys.readouterr().out
    assert "optimizer   muon (moments fp32)" in out and "of the step (Newton–Schulz" in out


@pytest.mark.parametrize("extra", [["--optim.optimizer", "adamw"], ["--optim.optimizer", "muon"],
                                   ["--optim.moments_dtype", "bf16"],
                                   ["--optim.optimizer", "muon", "--optim.offload", "true"],
                                   ["--optim.offload", "true"]],
                         ids=["adamw", "muon", "bf16", "muon_offload", "adamw_offload"])
def test_planned_optimizer_state_is_the_simulated_one(extra):
    """The planner's optimizer bytes against the state the optimizer allocates on a simulated rank
    (tp 2 × dp 2, ZeRO-1): equal up to the shards' alignment padding — bf16 moments with the
    Triton AdamW's decay mask (optim.impl auto takes it on CUDA, as with fp32 moments); under
    optim.offload, Muon's momentum and AdamW's state in host memory (fp32 masters included: the
    weights are fp32 here) and none of it on the device."""
    tiny = ["--model.vocab_size", "300", "--model.num_layers", "4", "--model.hidden_size", "64",
            "--model.num_heads", "4", "--model.num_kv_heads", "2", "--model.ffn_hidden_size", "128",
            "--train.seq_length", "64", "--train.micro_batch_size", "1", "--train.global_batch_size",
            "8", "--parallel.zero", "1", "--parallel.tp", "2"]
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), tiny + extra)
    run = resolve_for_simulation(cfg, 4)
    sim = simulate_rank(cfg, 4, 0, steps=1)
    plan = planned(cfg, run, sim.coords["pp"])
    assert plan["planned_breakdown"]["optimizer"] <= sim.breakdown["optimizer"] \
        <= plan["planned_breakdown"]["optimizer"] * 1.002
    host = plan["planned_host_optimizer_bytes"]
    assert host <= sim.host_optimizer_bytes <= host * 1.002
    assert (host > 0) == cfg.optim.offload == (sim.breakdown["optimizer"] == 0)


MUON_TRAFFIC = {  # world size, layout
    "tp2 dp2 zero1": (4, ["--parallel.tp", "2", "--parallel.zero", "1"]),
    "dp4 zero3": (4, ["--parallel.zero", "3"]),
    "tp2 dp2 zero0": (4, ["--parallel.tp", "2", "--parallel.zero", "0"]),
    "pp2 dp4 hybrid zero2 shards of 2": (8, ["--parallel.pp", "2", "--parallel.zero", "2",
                                             "--parallel.zero_shard_size", "2"]),
}


@pytest.mark.parametrize("name", sorted(MUON_TRAFFIC))
def test_planned_muon_traffic_equals_the_calls_the_program_issues(name):
    """Muon's collectives as planner/traffic.py counts them against a simulated rank's calls:
    the shard group's all-to-alls each way, the owned matrices' tp gathers."""
    world, layout = MUON_TRAFFIC[name]
    tiny = ["--model.vocab_size", "300", "--model.num_layers", "4", "--model.hidden_size", "64",
            "--model.num_heads", "4", "--model.num_kv_heads", "2", "--model.ffn_hidden_size", "128",
            "--train.seq_length", "64", "--train.micro_batch_size", "1", "--train.global_batch_size",
            "8", "--parallel.bucket_size_mb", "0.01", "--optim.optimizer", "muon"]
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), tiny + layout)
    run = resolve_for_simulation(cfg, world)
    shard = run.layout.shard or run.layout.dp
    adam = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), tiny + layout
                       + ["--optim.optimizer", "adamw"])
    for rank in (0, world - 1):
        sim = simulate_rank(cfg, world, rank, steps=1)
        plan = planned(cfg, run, sim.coords["pp"], shard_rank=sim.coords["dp"] % shard)
        assert plan["planned_comm_bytes"] == sim.comm_bytes
        assert plan["planned_comm_calls"] == sim.comm_calls
        without = planned(adam, run, sim.coords["pp"])["planned_comm_bytes"]
        assert sum(map(sum, (g.values() for g in sim.comm_bytes.values()))) > \
            sum(map(sum, (g.values() for g in without.values())))


def test_the_planner_reads_the_optimizer_as_one_description():
    """optim's optimizer, moments' dtype, Newton–Schulz steps and offload reach the estimate as one
    frozen description, read from the config as estimate_run reads it."""
    from megapretrain.planner.model import estimate_run
    from megapretrain.resolve import resolve

    cfg = load_config(os.path.join(ROOT, "configs", "llama3_8b.yaml"),
                      ["--optim.optimizer", "muon", "--optim.moments_dtype", "bf16", "--optim.muon_ns_steps", "3"])
    spec = OptimizerSpec.of(cfg.optim)
    assert spec == OptimizerSpec("muon", "bf16", 3, False) and spec.muon
    assert hash(spec) == hash(OptimizerSpec.of(cfg.optim))  # frozen: a cache key
    m, h100 = model_args(cfg), DEVICES["h100"]
    assert spec.muon_layer(m) == muon_layer_params(m) > 0 and OptimizerSpec().muon_layer(m) == 0
    layout = resolve(cfg, 64).layout
    direct = estimate(m, cfg.train.seq_length, layout, cfg.train.global_batch_size, h100, cfg.train.precision,
                      cfg.parallel.pp_schedule, optimizer=spec)
    via_config = estimate_run(cfg, layout, h100)
    assert direct.time == via_config.time and direct.memory["total"] == via_config.memory["total"]
    fewer = estimate(m, cfg.train.seq_length, layout, cfg.train.global_batch_size, h100, cfg.train.precision,
                     cfg.parallel.pp_schedule, optimizer=OptimizerSpec("muon", "bf16", 1, False))
    assert fewer.time["optimizer_ns"] < direct.time["optimizer_ns"]
