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
import torch

from megapretrain.train import setup

from distributed import run_distributed
from helpers import trainer_params

ITERS = 5
BASE = ["--model.num_layers", "4", "--model.hidden_size", "64", "--model.num_heads", "4",
        "--model.num_kv_heads", "2", "--model.ffn_hidden_size", "128", "--train.seq_length", "32",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "8", "--train.iters", str(ITERS),
        "--train.eval_interval", "0", "--logging.tensorboard", "false", "--checkpoint.interval", "0",
        "--optim.lr", "3e-3", "--train.seed", "11",
        # eps 1e-6: with 1e-8, elements whose grad is ~0 get updates that hinge on summation order
        "--optim.eps", "1e-6"]


def _train(rank, world, run_dir, corpus, layout):
    argv = ["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *BASE, *layout]
    trainer = setup(argv)
    trainer.fit()
    ps = trainer.ps
    params = trainer_params(trainer)
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [r for r in map(json.loads, fh) if "loss" in r]
    return {"params": params if ps.dp_rank == 0 and ps.tp_rank == 0 else {}, "losses": [r["loss"] for r in rows],
            "grad_norms": [r["grad_norm"] for r in rows], "loss_on_rank": trainer.last_loss}


_REFERENCES: dict = {}


def reference_for(model_flags: tuple, corpus: str, tmp_path_factory) -> dict:
    """The single-process run for these model flags (computed once per test session)."""
    if model_flags not in _REFERENCES:
        run = str(tmp_path_factory.mktemp("single"))
        _REFERENCES[model_flags] = _train(0, 1, run, corpus, list(model_flags))
    return _REFERENCES[model_flags]


def check(reference, results):
    merged = {}
    for r in results:
        merged.update(r["params"])
        assert r["loss_on_rank"] == pytest.approx(reference["losses"][-1], rel=1e-5)
    assert results[0]["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert results[0]["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5)
    assert reference["losses"][-1] < reference["losses"][0]
    assert set(merged) == set(reference["params"])
    for name, ref in reference["params"].items():
        torch.testing.assert_close(merged[name], ref, rtol=1e-4, atol=1e-5, msg=name)


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
    results = run_distributed(_train, world, str(tmp_path), corpus, [*flags, *layout], timeout=300)
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
    from megapretrain.parallel.pipeline import schedule_order

    traces = run_distributed(_traced, pp, str(tmp_path), corpus, timeout=300)
    for rank, records in enumerate(traces):
        assert [r["iter"] for r in records] == [1, 2]
        for r in records:
            expected = [f"{op.kind}{op.micro}.{op.chunk}" for op in schedule_order("1f1b", rank, pp, 1, 6)]
            assert r["ops"] == expected and r["schedule"] == "1f1b"
            assert r["peak_in_flight"] == min(pp - rank, 6) <= pp


def _resume_run(rank, world, run_dir, corpus, iters, layout, dropout=0.1):
    """``iters`` iterations (resuming from RUN_DIR's checkpoint if any) of a 6-iteration schedule;
    returns the (iter, loss, grad norm) rows and the iterations resumed from."""
    argv = ["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *BASE, *layout, "--train.iters", str(iters),
            "--schedule.decay_iters", "6", "--model.hidden_dropout", str(dropout),
            "--model.attention_dropout", str(dropout)]
    setup(argv).fit()
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    return [(r["iter"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r], \
        [r["iter"] for r in rows if r.get("event") == "resumed"]


@pytest.mark.slow
def test_resume_under_tp_pp_vpp_is_bitwise_exact(corpus, tmp_path):
    """Four ranks, tp=2 × pp=2 with two virtual chunks each, sequence parallel and dropout: 3
    iterations, stop, relaunch to 6 gives bit for bit the losses and grad norms of 6 straight."""
    layout = ["--parallel.tp", "2", "--parallel.pp", "2", "--parallel.vpp", "2",
              "--parallel.sequence_parallel", "true"]
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    a = run_distributed(_resume_run, 4, straight, corpus, 6, layout, timeout=300)
    run_distributed(_resume_run, 4, split, corpus, 3, layout, timeout=300)
    b = run_distributed(_resume_run, 4, split, corpus, 6, layout, timeout=300)
    for (rows_a, _), (rows_b, resumed) in zip(a, b):
        assert resumed == [3]
        assert [r[0] for r in rows_b] == list(range(1, 7))
        assert rows_a == rows_b  # exact: losses and grad norms
