"""ZeRO-3 (``parallel.zero 3``): fully sharded parameters reproduce one process, layout by layout.

The layouts against one process (dp 2 and 4, kept gathered, no prefetch, recompute, tied
embeddings, offload, with tp + sp, pp, hybrid sharding and cp) are cases of ``tests/layouts.py``,
run by ``test_parallel_equivalence.py``. Here: resume, checkpoints across zero stages, the memory
each rank holds against the analytic formula, the number of layers gathered at once, and the
order of the gathers and reductions (prefetch, reduce-scatter during backward).
"""

from __future__ import annotations

import pytest

from distributed import run_distributed
from helpers import resume_run

Z3 = ["--parallel.zero", "3"]


# -- the mechanism, on a bare model and optimizer ---------------------------------------------------

def _probe(rank, world):
    """Memory by part against the formula, gathered layers counted, and the event order of two
    traced steps of a 4-layer model (2 micro-batches each)."""
    import torch

    from megapretrain.config import OptimConfig
    from megapretrain.optim.optimizer import MixedPrecisionAdamW
    from megapretrain.parallel.data import ALIGN, round_up
    from megapretrain.parallel.state import ParallelState

    from helpers import build, make_tokens, tiny_args

    ps = ParallelState()
    out = {"memory": {}}
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for offload in (False, True):
            model = build(ps, tiny_args(num_layers=4), dtype=dtype)
            opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(), OptimConfig(offload=offload),
                                      precision, ps, zero=3)
            opt.hook_models([model])
            padded = sum(round_up(sum(round_up(p.numel(), ALIGN) for p in b.params), ALIGN * world)
                         for b in opt.buffers.buckets)
            out["memory"][(precision, offload)] = (opt.memory_report(), padded, opt.buffers.gathered_bytes(),
                                                   len(opt.buffers.buckets))
    model = build(ps, tiny_args(num_layers=4))
    opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(), OptimConfig(lr=1e-3), "fp32",
                              ps, zero=3)
    opt.hook_models([model], trace=True)
    tokens = make_tokens(batch=4 * world)
    mine = tokens[rank * 4:(rank + 1) * 4]
    for _ in range(2):
        opt.zero_grad()
        for i, chunk in enumerate(mine.chunk(2)):
            with opt.grad_sync(last=i == 1):
                model(chunk[:, :-1], chunk[:, 1:]).mean().backward()
        opt.reduce_grads()
        opt.step(1e-3)
    out["events"] = [(event, unit) for _, event, unit in opt.units.events]
    out["max"] = dict(opt.units.max_gathered)
    out["peak_bound"] = opt.gathered_peak_bytes()
    out["freed_after_step"] = all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["dp2", "dp4"])
def probe(request):
    return run_distributed(_probe, request.param, timeout=300), request.param


def test_memory_per_rank_matches_the_formula(probe):
    """Parameters, grads, masters and moments: each 1/dp of the padded model (fp32 params are their
    own master unless offloaded), and nothing gathered at rest."""
    results, dp = probe
    for r in results:
        for (precision, offload), (mem, padded, gathered, buckets) in r["memory"].items():
            param_bytes = 4 if precision == "fp32" else 2
            shard = padded // dp
            expect = {"params": param_bytes * shard, "grads": 4 * shard,
                      "master": 0 if precision == "fp32" and not offload else 4 * shard, "moments": 8 * shard}
            assert {k: mem[k] for k in expect} == expect, (precision, offload)
            assert mem["padded_numel"] == padded and gathered == 0
            assert buckets == 4 + 2  # one per decoder layer; the root: the head with the norm, the embedding


def test_at_most_the_designed_units_are_gathered(probe):
    results, _ = probe
    for r in results:
        assert 2 <= r["max"]["layers"] <= 3 and r["max"]["roots"] == 1  # prefetch made it 2 at least
        assert 0 < r["max"]["bytes"] <= r["peak_bound"]
        assert r["freed_after_step"]


def test_gathers_are_prefetched_and_grads_reduced_during_backward(probe):
    """Forward: layer i+1's gather is issued before layer i's compute ends. Backward: layer i-1's
    gather is issued before layer i's reduction, and every layer but the first is reduced before
    the first layer's backward starts."""
    results, _ = probe
    for r in results:
        events = r["events"]
        at = {}  # (event, unit) -> positions
        for i, key in enumerate(events):
            at.setdefault(key, []).append(i)
        layers = [f"layers.{i}" for i in range(4)]
        for i in range(3):
            first_done = at[("forward_done", layers[i])][0]
            assert any(g < first_done for g in at[("gather", layers[i + 1])]), (layers[i + 1], events)
        for i in range(1, 4):
            reduce = at[("reduce", layers[i])][0]
            assert any(g < reduce for g in at[("gather", layers[i - 1])][1:]), (layers[i - 1], events)
            assert reduce < at[("backward", layers[0])][0]
        # every micro-batch gathers each layer twice (forward, backward) and frees it twice, but
        # the last, kept from its forward to its backward (one chunk, no pipeline)
        assert len(at[("gather", layers[2])]) == len(at[("free", layers[2])]) == 2 * 2 * 2
        assert len(at[("gather", layers[3])]) == len(at[("free", layers[3])]) == 2 * 2


# -- checkpoints ------------------------------------------------------------------------------------

def _run(rank, world, run_dir, corpus, iters, layout, dropout=0.0):
    """``resume_run`` without dropout unless asked: runs under different layouts are compared."""
    return resume_run(rank, world, run_dir, corpus, iters, layout, dropout)


@pytest.mark.slow
def test_resume_under_zero3_is_bitwise_exact(corpus, tmp_path):
    """zero 3 on 2 ranks with dropout: 3 iterations, stop, relaunch to 6 == 6 straight, bit for bit."""
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    a = run_distributed(_run, 2, straight, corpus, 6, Z3, 0.1, timeout=300)
    run_distributed(_run, 2, split, corpus, 3, Z3, 0.1, timeout=300)
    b = run_distributed(_run, 2, split, corpus, 6, Z3, 0.1, timeout=300)
    for (rows_a, _), (rows_b, resumed) in zip(a, b):
        assert resumed == [3] and [r[0] for r in rows_b] == list(range(1, 7))
        assert rows_a == rows_b


@pytest.mark.slow
def test_zero3_checkpoints_load_under_other_stages_and_sizes(corpus, tmp_path):
    """A zero-3 checkpoint of 4 ranks resumes at zero 1 on 2 ranks and on one process, and a zero-1
    checkpoint of 2 ranks resumes at zero 3 on 4: each onto the single-process curve."""
    import shutil

    one = run_distributed(_run, 1, str(tmp_path / "one"), corpus, 6, [], timeout=300)[0][0]
    z3 = str(tmp_path / "z3")
    run_distributed(_run, 4, z3, corpus, 3, Z3, timeout=300)
    shutil.copytree(z3, str(tmp_path / "z3_copy"))
    to_zero1 = run_distributed(_run, 2, z3, corpus, 6, ["--parallel.zero", "1"], timeout=300)[0]
    to_one = run_distributed(_run, 1, str(tmp_path / "z3_copy"), corpus, 6, [], timeout=300)[0]
    z1 = str(tmp_path / "z1")
    run_distributed(_run, 2, z1, corpus, 3, ["--parallel.zero", "1"], timeout=300)
    to_zero3 = run_distributed(_run, 4, z1, corpus, 6, Z3, timeout=300)[0]
    for rows, resumed in (to_zero1, to_one, to_zero3):
        assert resumed == [3]
        assert [r[0] for r in rows] == list(range(1, 7))
        assert [r[1] for r in rows[3:]] == pytest.approx([r[1] for r in one[3:]], rel=1e-5)
        assert [r[2] for r in rows[3:]] == pytest.approx([r[2] for r in one[3:]], rel=1e-5)


def test_the_offline_reshard_reads_a_zero3_checkpoint(corpus, tmp_path):
    """tools/reshard_checkpoint.py turns a zero-3 checkpoint of 2 ranks into one for a single
    process, which resumes onto the single-process curve (and loads without resharding)."""
    from megapretrain.commands import reshard_checkpoint as tool

    from helpers import BASE
    one = _run(0, 1, str(tmp_path / "one"), corpus, 6, [])[0]
    run = str(tmp_path / "z3")
    run_distributed(_run, 2, run, corpus, 3, Z3, timeout=300)
    out = str(tmp_path / "single")
    assert tool.main(["--checkpoint", run, "--output", out, "--world-size", "1", *BASE,
                      "--schedule.decay_iters", "6"]) == 0
    rows, resumed = _run(0, 1, str(tmp_path / "target"), corpus, 6, ["--checkpoint.load", out])
    assert resumed == [3]
    assert [r[1] for r in rows] == pytest.approx([r[1] for r in one[3:]], rel=1e-5)


def _start_up(rank, world):
    """Build a 4-layer model and its zero-3 optimizer as the trainer does, recording at each
    parameter's initialization the bytes of parameter storage alive on this rank; and the same
    model built for zero 1, for its parameters' initial values."""

    from megapretrain.config import load_config
    from megapretrain.model.build import build_model_chunks, deferred_initializer
    from megapretrain.optim.optimizer import MixedPrecisionAdamW
    from megapretrain.parallel.state import ParallelState

    from helpers import full_params

    ps = ParallelState()
    out = {}
    for zero in (3, 1):
        cfg = load_config(None, ["--model.num_layers", "4", "--model.hidden_size", "64", "--model.num_heads", "4",
                                 "--model.vocab_size", "300", "--parallel.zero", str(zero)])
        (model,), specs = build_model_chunks(cfg, ps)
        params = list(model.parameters())
        built = sum(p.untyped_storage().nbytes() for p in params)
        initialize, alive = deferred_initializer([model], specs, cfg.train.seed), []

        def record(p, view, initialize=initialize, alive=alive, params=params):
            storages = {q.untyped_storage().data_ptr(): q.untyped_storage().nbytes() for q in params}
            alive.append(sum(storages.values()))  # a unit's parameters share its buffer: counted once
            initialize(p, view)
        opt = MixedPrecisionAdamW(list(model.named_parameters()), specs, cfg.optim, "fp32", ps, zero=zero,
                                  initialize=record)
        opt.hook_models([model])
        with full_params(opt):
            values = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[zero] = dict(built=built, alive=max(alive, default=0), calls=len(alive), values=values,
                         params=len(params), model_bytes=sum(p.numel() * p.element_size() for p in params),
                         unit_bytes=max(b.numel * 4 for b in opt.buffers.buckets))
    return out


def test_zero3_never_holds_the_whole_model_at_start_up():
    """Under zero 3 the chunks are built without parameter storage, each unit is initialized in
    its own gathered buffer and cut to this rank's shard before the next one is made: at any
    initialization the parameter storage alive is at most one unit's (the model is 4 layers and a
    root); gathered, the parameters hold a zero-1 build's initial values, bit for bit."""
    import torch

    for got in run_distributed(_start_up, 2, timeout=300):
        z3, z1 = got[3], got[1]
        assert z3["built"] == 0 and z1["built"] == z1["model_bytes"]
        assert z3["calls"] == z3["params"] and z1["calls"] == 0  # zero 1: built with values, copied
        assert 0 < z3["alive"] <= z3["unit_bytes"] < z3["model_bytes"] / 2, z3
        assert z3["values"].keys() == z1["values"].keys()
        for name, value in z1["values"].items():
            torch.testing.assert_close(z3["values"][name], value, rtol=0, atol=0, msg=name)
