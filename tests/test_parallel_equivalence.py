"""The central test: the real trainer under a parallel layout reproduces the single-process run.

Each layout runs ``megapretrain.train.setup`` + ``fit`` on spawned gloo ranks with the same config,
seed and data as one process; per-iteration losses and grad norms (before clipping, as logged to
metrics.jsonl, on every rank) must match within 1e-5 relative, and after the last step every
parameter must equal the single-process parameter. The grad norm is the check that every rank
counts each parameter once (tp-split ones on every tp rank, replicated ones once, a tied
embedding's second copy never), which only the parameter-spec table tells it.
"""

from __future__ import annotations

import json
import os

import pytest

from megapretrain.train import setup

from distributed import run_distributed
from helpers import BASE, check, reference_for, resume_run, train_layout

LAYOUTS = {
    "tp2_sp": (2, ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"]),
    # the sequence-parallel collectives as ring steps under their GEMMs (parallel.tp_comm_overlap)
    "tp2_sp_overlap": (2, ["--parallel.tp", "2", "--parallel.sequence_parallel", "true",
                           "--parallel.tp_comm_overlap", "true"]),
    "dp2": (2, []),
    "dp2_zero1": (2, ["--parallel.zero", "1"]),
    "pp2": (2, ["--parallel.pp", "2"]),
    "pp2_vpp2": (2, ["--parallel.pp", "2", "--parallel.vpp", "2"]),
    # 3 micro-batches on 2 stages: the interleaved order's last group is one micro-batch
    "pp2_vpp2_3_micro": (2, ["--parallel.pp", "2", "--parallel.vpp", "2"]),
    "pp2_gpipe_tied": (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "gpipe"]),
    "tp2_dp2_zero1": (4, ["--parallel.tp", "2", "--parallel.zero", "1"]),
    "pp4": (4, ["--parallel.pp", "4"]),
    "dp4_zero2": (4, ["--parallel.zero", "2"]),
    # hybrid sharding: ZeRO over pairs of dp ranks, the pairs replicas of each other
    "dp4_zero1_shard2": (4, ["--parallel.zero", "1", "--parallel.zero_shard_size", "2"]),
    "dp4_zero2_shard2": (4, ["--parallel.zero", "2", "--parallel.zero_shard_size", "2"]),
    "dp2_zero1_shard1": (2, ["--parallel.zero", "1", "--parallel.zero_shard_size", "1"]),
}
SLOW = {"tp2_dp2_zero1", "pp4", "dp4_zero2", "tp2_pp2_dp2", "dp4_zero1_shard2", "dp4_zero2_shard2"}
LAYOUTS["tp2_pp2_dp2"] = (8, ["--parallel.tp", "2", "--parallel.pp", "2", "--parallel.sequence_parallel", "true",
                              "--parallel.zero", "1"])


MODEL_FLAGS = {"pp2_gpipe_tied": ("--model.tie_embeddings", "true"),
               "pp2_vpp2_3_micro": ("--train.global_batch_size", "6")}  # the reference at the same batch


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in LAYOUTS])
def test_layout_matches_single_process(name, corpus, tmp_path, tmp_path_factory):
    world, layout = LAYOUTS[name]
    flags = MODEL_FLAGS.get(name, ())
    reference = reference_for(flags, corpus, tmp_path_factory)
    results = run_distributed(train_layout, world, str(tmp_path), corpus, [*flags, *layout], timeout=300)
    check(reference, results)


def _traced(rank, world, run_dir, corpus):
    argv = ["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *BASE, "--parallel.pp", str(world),
            "--parallel.pp_trace", "true", "--train.iters", "2", "--train.global_batch_size", "12"]
    trainer = setup(argv)
    trainer.fit()
    with open(os.path.join(run_dir, f"pipeline_trace_rank{rank}.jsonl")) as fh:
        return [json.loads(line) for line in fh]


@pytest.mark.parametrize("pp", [2, 4])
def test_recorded_1f1b_trace(pp, corpus, tmp_path):
    """The trainer runs the published 1F1B order (6 micro-batches) and never holds more than pp
    micro-batches' activations — read from the trace each rank writes."""
    from megapretrain.parallel.pipeline import SCHEDULES

    traces = run_distributed(_traced, pp, str(tmp_path), corpus, timeout=300)
    for rank, records in enumerate(traces):
        assert [r["iter"] for r in records] == [1, 2]
        for r in records:
            order = SCHEDULES["1f1b"].order(rank, pp, 1, 6)
            expected = [f"{op.kind}{op.micro}.{op.chunk}" for op in order]
            assert r["ops"] == expected and r["schedule"] == "1f1b"
            assert r["peak_in_flight"] == min(pp - rank, 6) <= pp


@pytest.mark.slow
def test_resume_under_tp_pp_vpp_is_bitwise_exact(corpus, tmp_path):
    """Four ranks, tp=2 × pp=2 with two virtual chunks each, sequence parallel and dropout: 3
    iterations, stop, relaunch to 6 gives bit for bit the losses and grad norms of 6 straight."""
    layout = ["--parallel.tp", "2", "--parallel.pp", "2", "--parallel.vpp", "2",
              "--parallel.sequence_parallel", "true"]
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    a = run_distributed(resume_run, 4, straight, corpus, 6, layout, timeout=300)
    run_distributed(resume_run, 4, split, corpus, 3, layout, timeout=300)
    b = run_distributed(resume_run, 4, split, corpus, 6, layout, timeout=300)
    for (rows_a, _), (rows_b, resumed) in zip(a, b):
        assert resumed == [3]
        assert [r[0] for r in rows_b] == list(range(1, 7))
        assert rows_a == rows_b  # exact: losses and grad norms
