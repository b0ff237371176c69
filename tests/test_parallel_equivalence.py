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
from dataclasses import fields

import pytest

from megapretrain.config import ConfigError, ParallelConfig, load_config
from megapretrain.parallel.layout import Coords
from megapretrain.parallel.pipeline import SCHEDULES
from megapretrain.resolve import resolve
from megapretrain.train import setup

from distributed import run_distributed
from helpers import BASE, check, reference_for, resume_run, train_layout
from layouts import BY_NAME, CASES


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] * c.slow)
                                  for c in CASES])
def test_layout_matches_single_process(case, corpus, tmp_path, tmp_path_factory):
    """A case of tests/layouts.py: its per-step losses and grad norms and its final parameters
    equal those of one process on the case's model flags."""
    reference = reference_for(case.model, corpus, tmp_path_factory)
    flags = [*case.model, *case.layout]
    results = run_distributed(train_layout, case.world, str(tmp_path), corpus, flags, timeout=300)
    check(reference, results)


TRAITS = ("sequence_parallel", "tp_comm_overlap", "shard")  # Layout fields a case turns on


def _config(*flags):
    return load_config(None, ["--model.vocab_size", "300", *BASE, *flags])


def _features(case) -> set[str]:
    """What a case runs, read off the layout it resolves to (ConfigError: one its world size
    cannot run): its schedule, cp_comm mode (cp > 1), ZeRO stage (dp × cp > 1: ranks to shard
    over), every dimension over 1 and every trait turned on."""
    resolved = resolve(_config(*case.model, *case.layout), case.world)
    layout = resolved.layout
    found = {f"schedule {resolved.sizes.schedule.name}"}
    if layout.cp > 1:
        found.add(f"cp_comm {layout.cp_comm}")
    if layout.dp * layout.cp > 1:
        found.add(f"zero {layout.zero}")
    found.update(dim for dim in (*Coords._fields, "vpp") if getattr(layout, dim) > 1)
    found.update(trait for trait in TRAITS if getattr(layout, trait))
    return found


def _registered() -> list[str]:
    """What the package runs: its pipeline schedules, parallel.cp_comm's choices, the ZeRO stages
    the config accepts, the dimensions of the rank grid (and vpp), the traits."""
    cp_modes = {f.name: f for f in fields(ParallelConfig)}["cp_comm"].metadata["choices"]
    stages = []
    for stage in range(8):
        try:
            resolve(_config("--parallel.zero", str(stage)), 2)
        except ConfigError:
            continue
        stages.append(f"zero {stage}")
    return [*(f"schedule {name}" for name in SCHEDULES), *(f"cp_comm {mode}" for mode in cp_modes),
            *stages, *Coords._fields, "vpp", *TRAITS]


def test_the_cases_cover_what_the_package_registers():
    """tests/layouts.py: unique names; every case a layout its world size runs, every flag that
    changes the numbers run by the reference too; and every schedule, cp_comm mode, ZeRO stage,
    dimension and trait the package accepts in a case CI runs (not slow)."""
    names = [case.name for case in CASES]
    twice = sorted({name for name in names if names.count(name) > 1})
    assert not twice and len(BY_NAME) == len(CASES), f"case names used twice: {twice}"
    for case in CASES:
        shared = [f for f in case.layout if f.startswith(("--model.", "--train.", "--data."))]
        assert not shared, f"{case.name}: the reference must run {shared} too: put them in model"
    features = {case.name: _features(case) for case in CASES}
    in_ci = set().union(*(features[case.name] for case in CASES if not case.slow))
    missing = [feature for feature in _registered() if feature not in in_ci]
    assert not missing, f"no case of tests/layouts.py that CI runs (not slow) covers: {missing}"


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
