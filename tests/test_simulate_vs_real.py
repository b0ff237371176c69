"""The simulation held to reality: a rank simulated on fake tensors and the fake process group
holds what the same rank of a real gloo run holds — its peak within 2% and every collective's
bytes and calls exactly — measured by the same accounting (``simulate/measure.py``) around the
same trainer, on tiny models under tp2 × pp2 (sequence parallel), dp2 ZeRO-3 and cp2."""

from __future__ import annotations

import pytest

from megapretrain.config import load_config
from megapretrain.parallel.state import ParallelState
from megapretrain.simulate.run import measure_rank, resolve_for_simulation, simulate_rank, simulation_config

from distributed import run_distributed

TINY = ["--model.vocab_size", "300", "--model.num_layers", "4", "--model.hidden_size", "64",
        "--model.num_heads", "4", "--model.num_kv_heads", "2", "--model.ffn_hidden_size", "128",
        "--train.seq_length", "64", "--train.precision", "fp32"]
LAYOUTS = {
    "tp2_pp2": ["--parallel.tp", "2", "--parallel.pp", "2", "--parallel.sequence_parallel", "true",
                "--parallel.zero", "1", "--train.micro_batch_size", "2", "--train.global_batch_size", "8"],
    "dp2_zero3": ["--parallel.zero", "3", "--train.micro_batch_size", "2", "--train.global_batch_size", "8"],
    "cp2": ["--parallel.cp", "2", "--parallel.zero", "1", "--parallel.recompute", "selective",
            "--train.micro_batch_size", "2", "--train.global_batch_size", "4"],
}
STEPS = 2


def _config(layout: str, run_dir: str):
    cfg = load_config("configs/tiny.yaml", TINY + LAYOUTS[layout])
    return simulation_config(cfg, run_dir)


def _real_rank(rank: int, world: int, layout: str, run_dir: str) -> dict:
    cfg = _config(layout, f"{run_dir}/rank{rank}")
    run = resolve_for_simulation(cfg, world)
    ps = ParallelState.of(run.layout, device="cpu", comm_stats=True)
    result = measure_rank(cfg, run, ps, STEPS)
    return {"peak": result.peak_bytes, "comm_bytes": result.comm_bytes, "comm_calls": result.comm_calls,
            "breakdown": result.breakdown}


@pytest.mark.parametrize("layout,world", [
    pytest.param("tp2_pp2", 4, marks=pytest.mark.slow),  # four gloo ranks and a simulation of each: 40-75 s
    ("dp2_zero3", 2), ("cp2", 2)])
def test_simulated_rank_holds_and_moves_what_the_real_rank_does(layout, world, tmp_path):
    real = run_distributed(_real_rank, world, layout, str(tmp_path), timeout=600)
    for rank in range(world):
        sim = simulate_rank(_config(layout, str(tmp_path)), world, rank, steps=STEPS, device="cpu")
        assert sim.comm_bytes == real[rank]["comm_bytes"], (rank, sim.comm_bytes, real[rank]["comm_bytes"])
        assert sim.comm_calls == real[rank]["comm_calls"], rank
        assert abs(sim.peak_bytes - real[rank]["peak"]) <= 0.02 * real[rank]["peak"], \
            (rank, sim.peak_bytes, real[rank]["peak"], sim.breakdown, real[rank]["breakdown"])
        assert sum(sim.breakdown.values()) == sim.peak_bytes  # every byte at the peak in one part
