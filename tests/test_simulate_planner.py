"""The planner held to the program: its figures for a rank (planner/memory.py, planner/traffic.py)
against the same rank simulated on fake tensors (tools/simulate.py) — every group's collectives
equal in bytes and calls, and at Llama 3 widths the peak within 5%."""

from __future__ import annotations

import pytest

from megapretrain.config import load_config
from megapretrain.simulate.report import role_ranks
from megapretrain.simulate.run import planned, resolve_for_simulation, simulate_rank
from megapretrain.simulate.sweep import SWEEP, Case, small

from helpers import load_tool

check_planner = load_tool("check_planner")
TINY = ["--model.vocab_size", "300", "--model.num_layers", "8", "--model.hidden_size", "64", "--model.num_heads", "4",
        "--model.num_kv_heads", "2", "--model.ffn_hidden_size", "128", "--train.seq_length", "64",
        "--parallel.bucket_size_mb", "0.01"]  # buckets of 2,621 elements: several per layer
BATCH = ["--train.micro_batch_size", "1", "--train.global_batch_size", "8"]

TRAFFIC = {  # world size, layout
    "tp2 sp pp2 zero1": (8, ["--parallel.tp", "2", "--parallel.pp", "2", "--parallel.sequence_parallel", "true",
                             "--parallel.zero", "1"]),
    "tp2 pp2 vpp2 zero2 (buckets across chunks)": (8, ["--parallel.tp", "2", "--parallel.pp", "2",
                                                       "--parallel.vpp", "2", "--parallel.zero", "2"]),
    "dp4 zero3 mb2": (4, ["--parallel.zero", "3", "--train.micro_batch_size", "2"]),
    "dp4 zero3 kept gathered, full": (4, ["--parallel.zero", "3", "--parallel.zero3_keep_gathered", "true",
                                          "--parallel.recompute", "full"]),
    "tp2 sp cp2 zero0 full": (8, ["--parallel.cp", "2", "--parallel.tp", "2", "--parallel.sequence_parallel",
                                  "true", "--parallel.zero", "0", "--parallel.recompute", "full"]),
    "pp2 hybrid zero1 selective": (8, ["--parallel.pp", "2", "--parallel.zero", "1", "--parallel.zero_shard_size",
                                       "2", "--parallel.recompute", "selective"]),
    "tp2 no sp, tied": (4, ["--parallel.tp", "2", "--parallel.pp", "2", "--model.tie_embeddings", "true",
                            "--parallel.zero", "1"]),
    "gpipe fp32 zero2 hybrid": (8, ["--parallel.pp", "2", "--parallel.pp_schedule", "gpipe", "--parallel.zero", "2",
                                    "--parallel.zero_shard_size", "2", "--train.precision", "fp32"]),
    "tp2 sp zbv tied zero1 (embedding and head on stage 0)": (
        8, ["--parallel.tp", "2", "--parallel.pp", "2", "--parallel.vpp", "2", "--parallel.pp_schedule", "zbv",
            "--parallel.sequence_parallel", "true", "--model.tie_embeddings", "true", "--parallel.zero", "1"]),
    "zb_h1 zero2": (4, ["--parallel.pp", "2", "--parallel.pp_schedule", "zb_h1", "--parallel.zero", "2"]),
}


@pytest.mark.parametrize("name", sorted(TRAFFIC))
def test_planned_traffic_equals_the_calls_the_program_issues(name):
    world, layout = TRAFFIC[name]
    cfg = load_config("configs/tiny.yaml", TINY + BATCH + layout)
    run = resolve_for_simulation(cfg, world)
    for rank, role in role_ranks(run.layout):
        sim = simulate_rank(cfg, world, rank, steps=1)
        plan = planned(cfg, run, sim.coords["pp"])
        assert plan["planned_comm_bytes"] == sim.comm_bytes, (role, plan["planned_comm_bytes"], sim.comm_bytes)
        assert plan["planned_comm_calls"] == sim.comm_calls, role


def _short(case: Case, layers: int) -> Case:
    """``case`` with fewer layers (its widths, sequence and layout kept): seconds to simulate."""
    return Case(case.name, case.config, case.world_size, case.overrides + ("--model.num_layers", str(layers),
                                                                          "--parallel.pipeline_layers", "null"),
                case.stages)


AT_SCALE = {c.name: c for c in SWEEP}
SHORT = [  # twelve of the sweep's layouts with fewer layers: two to ten per pipeline chunk
    _short(AT_SCALE["8b-config"], 4), _short(AT_SCALE["8b-z3-full-mb2"], 4), _short(AT_SCALE["8b-tp2-sp"], 4),
    _short(AT_SCALE["8b-pp4-zb_h1"], 8), _short(AT_SCALE["8b-pp4-zbv"], 16),
    _short(AT_SCALE["8b-cp2"], 4), _short(AT_SCALE["8b-tp2-pp2-vpp2-sel"], 8),
    _short(AT_SCALE["70b-config"], 40), _short(AT_SCALE["70b-tp8-pp2-z3-full"], 4),
    _short(AT_SCALE["70b-hybrid8-vpp2"], 16),
    Case("405b-tp8-pp4-vpp2-full", "configs/llama3_405b.yaml", 1024, small(128, parallel__pp=4) + (
        "--model.num_layers", "16", "--parallel.pipeline_layers", "null"), ("first", "last")),
    Case("405b-tp8-pp2-z3", "configs/llama3_405b.yaml", 512, small(64, parallel__pp=2, parallel__vpp=1,
                                                                      parallel__zero=3) + (
        "--model.num_layers", "8", "--parallel.pipeline_layers", "null")),
]


@pytest.mark.slow  # twelve layouts (sixteen ranks) at Llama 3 widths and 8,192 tokens: about 4 minutes of CPU
@pytest.mark.parametrize("case", SHORT, ids=lambda c: c.name)
def test_planned_peak_within_5_percent_at_llama3_widths(case):
    cfg = load_config(case.config, list(case.overrides))
    run = resolve_for_simulation(cfg, case.world_size)
    for rank in check_planner._ranks(case, run.layout):
        sim = simulate_rank(cfg, case.world_size, rank, steps=1).to_json()
        row = check_planner.compare(case, sim)
        assert row["ok"], row


def test_plan_checks_its_layout_by_simulation(capsys):
    """tools/plan.py --layout config --simulate 1 --json: the config's own layout, its busiest stage
    simulated, the figures side by side."""
    from megapretrain.commands import plan as plan_tool

    code = plan_tool.main(["--config", "configs/tiny.yaml", "--gpus", "8", "--layout", "config", "--simulate", "1",
                           "--json", *TINY, *BATCH, "--parallel.pp", "2", "--parallel.zero", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    import json

    doc = json.loads(out)
    assert doc["layout"]["pp"] == 2 and len(doc["simulated"]) == 1
    checked = doc["simulated"][0]
    assert checked["traffic_equal"] and checked["pp_rank"] in (0, 1)
    assert checked["peak_bytes"] > 0 and checked["planned_peak_bytes"] > 0
    assert "--parallel.pp 2" in checked["flags"]
