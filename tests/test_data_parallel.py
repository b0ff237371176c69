"""Data parallelism and the ZeRO optimizer compute what one process computes.

One spawned run per layout covers every configuration of it (spawning costs seconds): zero 0/1/2/3
equivalence with the single-process run, gradient accumulation, the overlap of bucket reductions
with backward, measured memory against the analytic per-stage value, fp16 overflow handling,
optimizer offload and checkpoint round trips.
"""

from __future__ import annotations

import io
import time
from unittest import mock

import pytest
import torch
from torch import nn

from megapretrain.checkpoint.manager import restore_optimizer
from megapretrain.config import OptimConfig
from megapretrain.optim.optimizer import MixedPrecisionAdamW
from megapretrain.parallel.data import ALIGN, round_up
from megapretrain.parallel.specs import Sharding, make_spec, plain_specs
from megapretrain.parallel.state import Group, ParallelState

from distributed import run_distributed
from helpers import (
    VOCAB,
    build,
    full_params,
    gather_full,
    make_tokens,
    optimizer_checkpoint,
    tiny_args,
)

STEPS = 5
BUCKET_MB = 0.02  # ~5k fp32 elements: the tiny model spreads over about a dozen buckets
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def run_steps(ps, tokens, steps, *, zero=0, micro=1, precision="fp32", offload=False, state=None,
              inject_inf_on_rank=None, lr=3e-3, bucket_mb=BUCKET_MB, opt_kw=None, overlap_params=False):
    """Train a fresh tiny model ``steps`` steps on ``tokens`` (the global batch, split over dp and
    into ``micro`` micro-batches per rank); optionally resume from ``state`` first.

    Returns the per-step global mean losses, the tp-gathered parameters, and the optimizer."""
    model = build(ps, tiny_args(), dtype=DTYPES[precision],
                  sequence_parallel=ps.tp.size > 1)
    # eps 1e-6, not 1e-8: with |grad| ~ eps Adam's update hinges on the grad's last bits, which
    # differ between layouts by summation order alone (up to lr per element and step)
    cfg = OptimConfig(lr=lr, offload=offload, **{"eps": 1e-6, **(opt_kw or {})})
    opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(), cfg, precision, ps, zero=zero,
                              bucket_size_mb=bucket_mb)
    if zero == 3:
        opt.hook_models([model])  # each layer gathered around its use
    elif overlap_params:
        opt.overlap_param_gather(model)
    if state is not None:
        restore_optimizer(opt, state)
    rows = tokens.shape[0] // ps.dp.size
    mine = tokens[ps.dp_rank * rows:(ps.dp_rank + 1) * rows]
    n_tokens = tokens.shape[0] * (tokens.shape[1] - 1)
    losses, skipped = [], []
    for _ in range(steps):
        opt.zero_grad()
        total = torch.zeros(())
        chunks = mine.chunk(micro)
        for i, chunk in enumerate(chunks):
            per_token = model(chunk[:, :-1], chunk[:, 1:])
            factor = float("inf") if inject_inf_on_rank == ps.dp_rank else 1.0
            with opt.grad_sync(last=i == len(chunks) - 1):
                (per_token.sum() * factor * opt.scaler.scale / n_tokens).backward()
            total += per_token.detach().sum()
        opt.reduce_grads()
        ps.dp.all_reduce(total)
        skipped.append(opt.step(lr)[1])
        losses.append(total.item() / n_tokens)
    opt.buffers.wait_params()  # the next forward would have waited for the param all-gathers
    with full_params(opt):
        return losses, gather_full(model, ps), opt, skipped


def chunked_step(ps, zero: int, interleaved: bool) -> dict:
    """One step of two "pipeline chunks" a -> b. ``interleaved`` runs backward per chunk in a
    pipeline's order — b's micro-batches (the last inside grad_sync(last=True)), then a's — with
    a bucket holding parameters of both chunks; otherwise one plain backward per micro-batch."""
    torch.manual_seed(0)
    a, b = nn.Linear(16, 32), nn.Linear(32, 8)
    named = [(f"a.{n}", p) for n, p in a.named_parameters()] + [(f"b.{n}", p) for n, p in b.named_parameters()]
    # 350 elements: bucket 0 = b.bias, b.weight, a.bias (both chunks); bucket 1 = a.weight
    opt = MixedPrecisionAdamW(named, plain_specs(named), OptimConfig(lr=1e-2, eps=1e-6), "fp32", ps, zero=zero,
                              bucket_size_mb=350 * 4 / 2**20)
    assert [len(bk.params) for bk in opt.buffers.buckets] == [3, 1]
    g = torch.Generator().manual_seed(ps.dp_rank)
    xs = [torch.randn(4, 16, generator=g) for _ in range(2)]
    opt.zero_grad()
    if interleaved:
        hidden = [a(x) for x in xs]
        inputs = [h.detach().requires_grad_(True) for h in hidden]
        outputs = [b(i).square().sum() for i in inputs]
        for i, out in enumerate(outputs):
            with opt.grad_sync(last=i == 1):
                out.backward()
        for i, (h, inp) in enumerate(zip(hidden, inputs)):
            with opt.grad_sync(last=i == 1):
                h.backward(inp.grad)
    else:
        for i, x in enumerate(xs):
            with opt.grad_sync(last=i == 1):
                b(a(x)).square().sum().backward()
    opt.reduce_grads()
    opt.step(1e-2)
    return {n: p.detach().clone() for n, p in named}


def roundtrip(state: dict) -> dict:
    """Through torch.save / torch.load(weights_only=True), as the checkpoint manager does."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def checkpoint_of(opt) -> dict:
    return roundtrip(optimizer_checkpoint(opt))


# -- the single-process reference ------------------------------------------------------------------

def _reference():
    ps = ParallelState()
    tokens = make_tokens()
    out = {"train": run_steps(ps, tokens, STEPS, micro=2)[:2]}
    out["accum"] = {m: run_steps(ps, tokens, 1, micro=m)[1] for m in (1, 2, 4)}
    return out


@pytest.fixture(scope="module")
def reference():
    return _reference()


def assert_params_close(got: dict, ref: dict, what: str):
    """Equal up to fp32 summation order; vocabulary rows beyond the real ones (padding, which
    depends on tp) are left out."""
    assert set(got) == set(ref)
    for name, w in ref.items():
        torch.testing.assert_close(got[name][:VOCAB], w[:VOCAB], rtol=1e-4, atol=1e-5, msg=f"{what}: {name}")


# -- equivalence over layouts --------------------------------------------------------------------

def _shared_embedding(ps) -> dict:
    """A tied embedding's grads summed over dp and over its first/last-stage copies (zero 0/1/2)."""
    out = {}
    for zero in (0, 1, 2):
        tied, other = nn.Parameter(torch.ones(10, 7)), nn.Parameter(torch.ones(300))
        named = [("tied", tied), ("other", other)]
        specs = {**plain_specs(named), "tied": make_spec("tied", tied, Sharding(), 1, layer=None, tied=True)}
        opt = MixedPrecisionAdamW(named, specs, OptimConfig(), "fp32", ps, zero=zero)
        with opt.grad_sync(last=True):
            ((tied * (ps.rank + 1)).sum() + other.sum()).backward()
        opt.reduce_grads()
        shard = next(s for s in opt.shards if s.bucket.params == [tied])
        out[zero] = torch.cat([f.of(shard.bucket.grad_shard) for f in shard.fragments])
    return out


def _equivalence(rank, world, tps):
    pp2 = ParallelState(pp=2)
    out = {"shared_embedding": (_shared_embedding(pp2), pp2.dp_rank)}
    for tp in tps:
        ps = ParallelState(tp=tp)
        out[tp] = {zero: run_steps(ps, make_tokens(), STEPS, zero=zero)[:2] for zero in (0, 1, 2, 3)}
    return out


def check_equivalence(results, reference):
    ref_losses, ref_params = reference["train"]
    assert ref_losses[-1] < ref_losses[0]
    for rank, out in enumerate(results):
        for zero, (losses, params) in out.items():
            assert losses == pytest.approx(ref_losses, rel=1e-5), (rank, zero)
            assert_params_close(params, ref_params, f"rank {rank} zero {zero}")


@pytest.fixture(scope="module")
def four_ranks():
    """dp=4 (tp=1) and tp=2 × dp=2 (sequence parallel), zero 0/1/2/3 each, in one spawned run."""
    return run_distributed(_equivalence, 4, (1, 2), timeout=600)


def test_dp4_matches_single_process(four_ranks, reference):
    check_equivalence([r[1] for r in four_ranks], reference)


def test_tp2_dp2_sequence_parallel_matches_single_process(four_ranks, reference):
    check_equivalence([r[2] for r in four_ranks], reference)


def test_tied_embedding_grads_are_summed_over_stages_and_dp(four_ranks):
    """pp=2 × dp=2: each rank's grad is (rank + 1), so every element sums to 1 + 2 + 3 + 4."""
    for r in four_ranks:
        shared, dp_rank = r["shared_embedding"]
        for zero, grads in shared.items():
            # 70 elements padded to 128: dp rank 0 owns 64 of them, dp rank 1 the other 6 (+ padding)
            assert grads.numel() == (70 if zero == 0 else 64 if dp_rank == 0 else 6), zero
            assert torch.all(grads == 10.0), zero


# -- dp = 2: everything else in one spawned run ----------------------------------------------------

def _grad_hook_times(model):
    """perf_counter() when the embedding's grad (the last one backward computes) is accumulated."""
    times = []
    model.embed_tokens.weight.register_post_accumulate_grad_hook(lambda p: times.append(time.perf_counter()))
    return times


def _overlap(ps, tokens):
    """Launch times of every bucket's reduction relative to the end of backward; whether each was
    still in flight when the last gradient arrived."""
    model = build(ps, tiny_args())
    opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(), OptimConfig(), "fp32", ps, zero=1,
                              bucket_size_mb=BUCKET_MB)
    last_grad = _grad_hook_times(model)
    in_flight = []
    model.embed_tokens.weight.register_post_accumulate_grad_hook(
        lambda p: in_flight.extend(b.work is not None for b in opt.buffers.buckets[:-1]))
    opt.zero_grad()
    mine = tokens[ps.dp_rank * 4:(ps.dp_rank + 1) * 4]
    with opt.grad_sync(last=True):
        model(mine[:, :-1], mine[:, 1:]).sum().backward()
    backward_end = time.perf_counter()
    opt.reduce_grads()
    return {"launch": [b.launch_time - backward_end for b in opt.buffers.buckets],
            "last_grad": last_grad[-1] - backward_end, "in_flight": in_flight}


def _zero2_reductions(ps, tokens, wait_at_issue: bool = False):
    """zero=2 over 3 micro-batches, each forward and each reduce-scatter's issue and wait recorded
    in order; ``wait_at_issue``: every reduce-scatter waited for as it is issued (the most
    synchronous program). Returns the events, the step's losses and its grad shards."""
    events = []
    issue = Group.reduce_scatter_async

    class Recorded:
        def __init__(self, work, n):
            self.work, self.n = work, n

        def wait(self):
            events.append(("wait", self.n))
            self.work.wait()

    def recorded(group, output, tensor):
        n = sum(kind == "issue" for kind, _ in events)
        events.append(("issue", n))
        work = Recorded(issue(group, output, tensor), n)
        if wait_at_issue:
            work.wait()
        return work

    model = build(ps, tiny_args())
    opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(), OptimConfig(), "fp32", ps, zero=2,
                              bucket_size_mb=BUCKET_MB)
    mine = tokens[ps.dp_rank * 3:(ps.dp_rank + 1) * 3]  # one sample a micro-batch
    opt.zero_grad()
    with mock.patch.object(Group, "reduce_scatter_async", recorded):
        for i, chunk in enumerate(mine.chunk(3)):
            events.append(("forward", i))
            per_token = model(chunk[:, :-1], chunk[:, 1:])
            with opt.grad_sync(last=i == 2):
                per_token.sum().backward()
        opt.reduce_grads()
    events.append(("reduced", None))
    return events, torch.cat([b.grad_shard for b in opt.buffers.buckets]).clone()


def _memory(ps):
    """Measured per-rank bytes and the padded parameter count by the documented rule."""
    out = {}
    for zero in (0, 1, 2):
        for precision in ("fp32", "bf16"):
            for offload in (False, True):
                model = build(ps, tiny_args(), dtype=DTYPES[precision])
                opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(),
                                          OptimConfig(offload=offload),
                                          precision, ps, zero=zero, bucket_size_mb=BUCKET_MB)
                padded = sum(round_up(sum(round_up(p.numel(), ALIGN) for p in b.params), ALIGN * ps.dp.size)
                             for b in opt.buffers.buckets)
                numel = sum(p.numel() for p in model.parameters())
                out[(zero, precision, offload)] = (opt.memory_report(), padded, numel)
    return out


def _dp2(rank, world):
    ps = ParallelState()
    tokens = make_tokens()
    out = {"train": {zero: run_steps(ps, tokens, STEPS, zero=zero, micro=2)[:2] for zero in (0, 1, 2, 3)}}
    out["accum"] = {(zero, m): run_steps(ps, tokens, 1, zero=zero, micro=m)[1]
                    for zero in (0, 1, 2, 3) for m in (1, 2, 4)}
    out["overlap"] = _overlap(ps, tokens)
    out["memory"] = _memory(ps)
    six = make_tokens(batch=6)
    out["zero2_waits"] = (_zero2_reductions(ps, six), _zero2_reductions(ps, six, wait_at_issue=True))

    # after a zero=2 step only the grad shards persist
    opt = run_steps(ps, tokens, 1, zero=2, micro=2)[2]
    out["zero2_transient"] = [b.grad_data is None for b in opt.buffers.buckets]

    # fp16: an overflow injected on rank 1 only is seen (after the reduction) by both ranks
    fp16 = {}
    for zero in (0, 1, 2, 3):
        cfg = dict(initial_loss_scale=2.0 ** 12, loss_scale_window=2)
        init = run_steps(ps, tokens, 0, zero=zero, precision="fp16", opt_kw=cfg)[1]
        _, after, opt, skipped = run_steps(ps, tokens, 1, zero=zero, precision="fp16", opt_kw=cfg,
                                           inject_inf_on_rank=1)
        _, _, opt_clean, skipped_clean = run_steps(ps, tokens, 3, zero=zero, precision="fp16", opt_kw=cfg)
        fp16[zero] = {"unchanged": all(torch.equal(after[k], init[k]) for k in init), "skipped": skipped,
                      "scale": opt.scaler.scale, "clean_skipped": skipped_clean,
                      "clean_scale": opt_clean.scaler.scale}
    out["fp16"] = fp16

    # offload: the same numbers, stepped on the host copies
    out["offload"] = {(zero, p): (run_steps(ps, tokens, 3, zero=zero, precision=p)[:2],
                                  run_steps(ps, tokens, 3, zero=zero, precision=p, offload=True)[:2])
                      for zero in (0, 1, 3) for p in ("fp32", "bf16")}

    # the post-step all-gathers overlapped with the next forward: the same numbers
    out["param_overlap"] = {zero: (run_steps(ps, tokens, 3, zero=zero, precision="bf16")[:2],
                                   run_steps(ps, tokens, 3, zero=zero, precision="bf16", overlap_params=True)[:2])
                            for zero in (1, 2)}

    # pipeline-style backward per chunk, a bucket straddling both chunks
    out["chunks"] = {zero: (chunked_step(ps, zero, interleaved=True), chunked_step(ps, zero, interleaved=False))
                     for zero in (0, 1, 2)}

    # checkpoints: 2 steps, save, resume in fresh objects, 2 more == 4 straight (bitwise)
    resume, states = {}, {}
    for zero in (0, 1, 2, 3):
        straight = run_steps(ps, tokens, 4, zero=zero, precision="bf16")
        first = run_steps(ps, tokens, 2, zero=zero, precision="bf16")
        state = states[zero] = checkpoint_of(first[2])
        second = run_steps(ps, tokens, 2, zero=zero, precision="bf16", state=state)
        resume[zero] = (straight[0], first[0] + second[0],
                        all(torch.equal(straight[1][k], second[1][k]) for k in straight[1]))
    out["resume"] = resume
    try:  # fragments of another bucket layout are refused with a clear message
        run_steps(ps, tokens, 0, zero=1, bucket_mb=0.05, state=states[1])
        out["mismatch"] = None
    except ValueError as exc:
        out["mismatch"] = str(exc)
    return out


@pytest.fixture(scope="module")
def dp2():
    return run_distributed(_dp2, 2, timeout=600)


def test_dp2_matches_single_process(dp2, reference):
    check_equivalence([r["train"] for r in dp2], reference)


def test_accumulation_over_micro_batches_gives_the_same_update(dp2, reference):
    for rank, r in enumerate(dp2):
        for (zero, micro), params in r["accum"].items():
            for m, ref in reference["accum"].items():
                assert_params_close(params, ref, f"rank {rank} zero {zero}: {micro} vs {m} micro-batches")


def test_bucket_reductions_launch_during_backward(dp2):
    for r in dp2:
        o = r["overlap"]
        launch = o["launch"]
        assert len(launch) >= 8
        assert all(t < 0 for t in launch)  # every launch happened inside backward
        # the first buckets (the last layers' grads) started reducing before backward computed
        # its final grad, and were still in flight then: the reduction overlapped with backward
        assert launch[0] < launch[-1] and launch[0] < o["last_grad"]
        assert sum(t < o["last_grad"] for t in launch) >= len(launch) - 1
        assert any(o["in_flight"])


def test_zero2_reductions_run_under_the_next_forward_and_add_up_the_same(dp2):
    """Each micro-batch's reduce-scatters are issued during its backward, one in flight at a time,
    and the last one is not waited for as the backward ends but after the next forward, as the
    next backward starts (the last micro-batch's by reduce_grads). Waiting for each one as it is
    issued gives bitwise the same grad shards."""
    for r in dp2:
        (events, shards), (sync_events, sync_shards) = r["zero2_waits"]
        at = {e: k for k, e in enumerate(events)}
        issued = [n for kind, n in events if kind == "issue"]
        assert len(issued) >= 8
        assert [n for kind, n in events if kind == "wait"] == issued  # all waited, in issue order
        for n in issued[1:]:  # one in flight at a time
            assert at["wait", n - 1] < at["issue", n]
        ends = [at["forward", 1], at["forward", 2], at["reduced", None]]
        for i in range(3):
            start = at["forward", i]
            mine = [n for n in issued if start < at["issue", n] < ends[i]]
            assert mine, i
            for n in mine[:-1]:  # waited for inside this backward
                assert at["wait", n] < ends[i]
            if i < 2:  # the last one runs under the next forward
                assert ends[i] < at["wait", mine[-1]] < at["issue", mine[-1] + 1]
        assert all(sync_events[sync_events.index(("issue", n)) + 1] == ("wait", n) for n in issued)
        assert torch.equal(shards, sync_shards)


def test_memory_per_rank_matches_the_analytic_value(dp2):
    dp = 2
    for r in dp2:
        for (zero, precision, offload), (mem, padded, numel) in r["memory"].items():
            assert numel <= padded < numel + ALIGN * dp * 20  # alignment padding stays small
            param_bytes = 4 if precision == "fp32" else 2
            shard = padded // (dp if zero >= 1 else 1)
            expect = {"params": param_bytes * padded,
                      "grads": 4 * (padded // dp if zero == 2 else padded),
                      # fp32 parameters are their own master unless offloaded
                      "master": 0 if precision == "fp32" and not offload else 4 * shard,
                      "moments": 8 * shard}
            got = {k: mem[k] for k in expect}
            assert got == expect, (zero, precision, offload)
            assert mem["padded_numel"] == padded and mem["numel"] == numel


def test_zero2_keeps_only_grad_shards_between_steps(dp2):
    for r in dp2:
        assert all(r["zero2_transient"])


def test_fp16_overflow_skips_the_step_and_halves_the_scale(dp2):
    for r in dp2:
        for zero, f in r["fp16"].items():
            assert f["skipped"] == [True] and f["unchanged"], zero
            assert f["scale"] == 2.0 ** 11, zero
            assert f["clean_skipped"] == [False] * 3, zero
            assert f["clean_scale"] == 2.0 ** 13, zero  # doubled once the 2-step window was clean


def test_offload_gives_the_same_results(dp2):
    for r in dp2:
        for key, ((losses, params), (off_losses, off_params)) in r["offload"].items():
            assert losses == off_losses, key
            assert all(torch.equal(params[k], off_params[k]) for k in params), key


def test_checkpoint_resume_is_bitwise_exact(dp2):
    for r in dp2:
        for zero, (straight, resumed, same_params) in r["resume"].items():
            assert straight == resumed, zero
            assert same_params, zero
        assert r["mismatch"] is not None and "parallel.bucket_size_mb" in r["mismatch"]


def test_param_all_gather_overlapped_with_forward_gives_the_same_results(dp2):
    for r in dp2:
        for zero, ((losses, params), (ov_losses, ov_params)) in r["param_overlap"].items():
            assert losses == ov_losses, zero
            assert all(torch.equal(params[k], ov_params[k]) for k in params), zero


def test_per_chunk_backward_in_pipeline_order(dp2):
    for r in dp2:
        for zero, (interleaved, plain) in r["chunks"].items():
            for name, w in plain.items():
                torch.testing.assert_close(interleaved[name], w, rtol=1e-5, atol=1e-6, msg=f"zero {zero} {name}")
