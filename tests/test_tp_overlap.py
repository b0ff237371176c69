"""parallel.tp_comm_overlap: the sequence-parallel all-gathers and reduce-scatters run in ring
steps under the linears' GEMMs and compute what the synchronous collectives compute."""

from __future__ import annotations

import pytest
import torch

from megapretrain.config import load_config
from megapretrain.errors import ConfigError
from megapretrain.parallel.state import ParallelState
from megapretrain.parallel.tensor import DeferredGrads, defer_weight_grads, overlap_tp_comm
from megapretrain.parallel.tp_overlap import RingStream
from megapretrain.resolve import resolve

from distributed import run_distributed
from helpers import build, make_tokens, tiny_args


def _step(ps, model, tokens, deferred=None):
    """Per-token losses and every local gradient of one forward and backward (a split one: B then
    W, when ``deferred``), and the tp traffic it made."""
    ps.stats.reset()
    model.zero_grad(set_to_none=True)
    losses = model(tokens[:, :-1], tokens[:, 1:])  # (b, s)
    if deferred is None:
        losses.sum().backward()
    else:
        with deferred.capture((0, 0)):
            losses.sum().backward()
        deferred.flush((0, 0))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return losses.detach(), grads, {k: v for k, v in ps.stats.summary().items() if k.startswith("tp.")}


def _compare(rank, world, recompute):
    ps = ParallelState(tp=world, comm_stats=True)
    tokens = make_tokens(batch=2, seq=16)
    out = {}
    for overlap in (False, True):
        for split in (False, True):
            model = build(ps, tiny_args(), sequence_parallel=True, recompute=recompute)
            overlap_tp_comm([model], overlap)
            deferred = DeferredGrads() if split else None
            defer_weight_grads([model], deferred)
            out[overlap, split] = _step(ps, model, tokens, deferred)
    return out


@pytest.mark.parametrize("tp, recompute", [(2, "none"), (2, "full"),
                                           pytest.param(4, "selective", marks=pytest.mark.slow)])
def test_overlapped_tp_comm_equals_the_collectives(tp, recompute):
    """Losses and gradients equal the synchronous path's (within 1e-6: the ring sums in another
    order), split backward too; the linears' all-gathers and reduce-scatters become ring steps."""
    for r in run_distributed(_compare, tp, recompute, timeout=300):
        sync_losses, sync_grads, sync_comm = r[False, False]
        for key in ((True, False), (True, True), (False, True)):
            losses, grads, comm = r[key]
            torch.testing.assert_close(losses, sync_losses, rtol=1e-6, atol=1e-6)
            for name, g in sync_grads.items():
                torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-6, msg=f"{key} {name}")
        overlap_comm = r[True, False][2]
        assert "tp.send" not in sync_comm and overlap_comm["tp.send"]["calls"] > 0
        layers = tiny_args().num_layers  # per layer: attention and MLP, each one gather and one reduce-scatter
        assert sync_comm["tp.all_gather"]["calls"] - overlap_comm.get("tp.all_gather", {"calls": 0})["calls"] \
            >= 2 * layers * (2 if recompute == "none" else 1)
        assert overlap_comm["tp.reduce_scatter"]["calls"] < sync_comm["tp.reduce_scatter"]["calls"]


def _ring_step(rank, world):
    ps = ParallelState(tp=world)
    stream, issued_on = RingStream(), []
    shift = ps.tp.shift_async

    def spy(*args, **kwargs):
        issued_on.append(torch.get_device_module("cpu").current_stream())
        return shift(*args, **kwargs)
    ps.tp.shift_async = spy
    (got,), step = stream.shift(ps.tp, [torch.full((2, 3), float(rank))])
    kept = step.keep is not None
    step.wait()
    current = torch.get_device_module("cpu").current_stream()
    return got, kept, step.keep is None, issued_on[0] is stream._side and issued_on[0] is not current


def test_ring_steps_run_on_the_side_stream():
    """A ring step is issued on the rank's side stream (on CPU ``torch.cpu.Stream``: the CUDA
    code path, whose waits return at once), keeps what it sends and receives until it is waited
    for, and delivers the previous rank's tensor."""
    for rank, (got, kept, released, on_side) in enumerate(run_distributed(_ring_step, 2, timeout=120)):
        assert torch.equal(got, torch.full((2, 3), float((rank - 1) % 2)))
        assert kept and released and on_side


def test_overlap_without_sequence_parallelism_is_refused_in_one_line():
    cfg = load_config(None, ["--model.vocab_size", "300", "--parallel.tp", "2", "--parallel.tp_comm_overlap", "true",
                             "--train.global_batch_size", "16"])
    with pytest.raises(ConfigError, match=r"parallel.tp_comm_overlap") as info:
        resolve(cfg, 2)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("flags, message", [(["--tp", "1"], "at least 2"),
                                           (["--tp", "2", "--seq", "511"], "--seq 511")])
def test_tp_bench_refuses_a_layout_in_one_line(flags, message, capsys):
    from helpers import load_tool

    bench_tp = load_tool("bench_tp")
    assert bench_tp.main(flags) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
