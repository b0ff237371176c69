"""Split backward and the zero-bubble schedules under the real trainer.

A zero-bubble schedule runs each chunk's backward as B (input gradients) and a later W (the
linears' weight gradients, kept back by ``parallel/tensor.py``'s DeferredGrads). The tests check
that the split changes nothing but the order: B then W gives a whole backward's gradients (the
output layer's included: its W makes them from the saved input), and checkpoints and resumes
under zbv. The trainer under zb_h1 and zbv (with dp buckets, ZeRO 1, 2 and 3, sequence
parallelism, recompute, tied embeddings) against one process: the cases of tests/layouts.py.
"""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch

from megapretrain.model.decoder import DecoderModel
from megapretrain.model.fused_loss import linear_cross_entropy_per_token
from megapretrain.parallel.cross_entropy import vocab_parallel_linear_cross_entropy
from megapretrain.parallel.data import DataParallelBuffers
from megapretrain.parallel.random import RNGTracker
from megapretrain.parallel.specs import plain_specs
from megapretrain.parallel.state import Group
from megapretrain.parallel.tensor import ColumnParallelLinear, DeferredGrads, RowParallelLinear, defer_weight_grads
from megapretrain.train import setup

from distributed import run_distributed
from helpers import BASE, PART_ITERS, PART_SPLIT, launch_part, tiny_args


def _grads(model: DecoderModel) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_input_then_weight_gradients_equal_one_backward(recompute):
    """Two micro-batches' B ops, then their W ops (in the order ZB-H1's last stage runs them):
    the same gradients as two whole backwards; during the Bs every linear's weight has none."""
    args = tiny_args()
    tokens = torch.randint(0, args.vocab_size, (2, 2, 17), generator=torch.Generator().manual_seed(3))
    tp = Group("tp", [0], None, 0)

    def model():
        m = DecoderModel(args, tp, recompute=recompute, rng=RNGTracker(0, 0, "cpu"))
        m.init_weights(5)
        return m

    whole, split = model(), model()
    for micro in tokens:
        whole(micro[:, :-1], micro[:, 1:]).sum().backward()
    deferred = DeferredGrads()
    defer_weight_grads([split], deferred)
    for i, micro in enumerate(tokens):
        with deferred.capture((i, 0)):
            split(micro[:, :-1], micro[:, 1:]).sum().backward()
    linears = {f"{name}.weight" for name, m in split.named_modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
    assert len(linears) >= args.num_layers * 4 and "lm_head.weight" in linears  # the output layer's too
    assert {name for name, p in split.named_parameters() if p.grad is None} == linears
    assert deferred.pending() == 2
    for i in range(2):
        deferred.flush((i, 0))
    assert deferred.pending() == 0
    reference, got = _grads(whole), _grads(split)
    assert set(got) == set(reference)
    for name, grad in reference.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("loss", ["chunked, grads in forward", "chunked", "one buffer"])
def test_output_layer_weight_gradient_waits_for_the_w(loss):
    """The output layer's B leaves its weight's fp32 main grad untouched and its bucket waiting;
    the W adds d loss / d weight there (for the gradient the B brought, here one per token) and
    completes the bucket: the same gradients as one whole backward."""
    vocab, hidden, one = 45, 16, Group("tp", [0])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 11, hidden, generator=g)
    targets = torch.randint(0, vocab, (2, 11), generator=g)
    targets[0, 3] = -100
    dy = torch.rand(2, 11, generator=g)
    weight = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g) * 0.3)
    named = [("weight", weight)]
    buffers = DataParallelBuffers(named, plain_specs(named), Group("dp", [0]), one)
    deferred = DeferredGrads(buffers)

    def run(defer: bool, capture: bool):
        xl = x.clone().requires_grad_(True)
        key, split = (0, 0), deferred if defer else None
        with buffers.grad_sync(True, ("B", key) if capture else None), \
                (deferred.capture(key) if capture else contextlib.nullcontext()):
            if loss == "one buffer":
                out = vocab_parallel_linear_cross_entropy(xl, weight, targets, one, 0, vocab, deferred=split)
            else:
                out = linear_cross_entropy_per_token(xl, weight, targets, one, 0, vocab, reference=True, chunk_rows=5,
                                                     grads_in_forward=loss == "chunked, grads in forward",
                                                     grad_sink=buffers, grad_scale=0.5, deferred=split)
            out.backward(dy)
        return xl.grad

    whole_dx = run(defer=False, capture=False)
    whole = weight.main_grad.clone()
    assert whole.abs().sum() > 0 and weight.grad is None and buffers.buckets[0].launched
    for capture in (False, True):  # no W waiting (made in the backward itself), then a B and its W
        buffers.zero_grad()
        dx = run(defer=True, capture=capture)
        if capture:
            assert weight.main_grad.abs().sum() == 0 and not buffers.buckets[0].launched and deferred.pending() == 1
            with buffers.grad_sync(True, ("W", (0, 0))):
                deferred.flush((0, 0))
        assert buffers.buckets[0].launched and weight.grad is None and deferred.pending() == 0
        torch.testing.assert_close(dx, whole_dx, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(weight.main_grad, whole, rtol=1e-6, atol=1e-7)


def test_a_micro_batch_cannot_be_captured_twice():
    deferred = DeferredGrads()
    with deferred.capture((0, 0)):
        pass
    with pytest.raises(RuntimeError, match=r"already waiting for their W"), deferred.capture((0, 0)):
        pass


RESHARD = {"zbv": (2, ["--parallel.pp", "2", "--parallel.vpp", "2", "--parallel.pp_schedule", "zbv"]),
           "1f1b": (2, ["--parallel.pp", "2"]),
           "interleaved": (2, ["--parallel.pp", "2", "--parallel.vpp", "2"])}


@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed", [("zbv", "1f1b"), ("interleaved", "zbv")])
def test_checkpoints_move_between_zero_bubble_and_other_layouts(saved, resumed, corpus, tmp_path):
    """A zbv checkpoint (stage p holds chunks p and 2·pp − 1 − p) resumes under 1F1B, an interleaved
    one (chunks p and p + pp) under zbv: the run continues with the single process's losses."""
    straight = launch_part(1, str(tmp_path / "straight"), corpus, PART_ITERS, [])[0]
    run = str(tmp_path / "run")
    launch_part(RESHARD[saved][0], run, corpus, PART_SPLIT, RESHARD[saved][1])
    record = launch_part(RESHARD[resumed][0], run, corpus, PART_ITERS, RESHARD[resumed][1])[0]
    assert [r["iter"] for r in record["resumed"]] == [PART_SPLIT]
    for it in range(1, PART_ITERS + 1):
        assert record["losses"][it] == pytest.approx(straight["losses"][it], rel=1e-5), it


@pytest.mark.parametrize("flags, message", [
    (["--pp", "3", "--layers", "8"], "model.num_layers=8"),
    (["--pp", "4", "--schedules", "zbv", "--layers", "4"], "model.num_layers=4"),
])
def test_pipeline_bench_refuses_a_layout_in_one_line(flags, message, capsys):
    from helpers import load_tool

    bench_pipeline = load_tool("bench_pipeline")
    assert bench_pipeline.main(flags) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def _fit(rank, world, run_dir, corpus, iters, layout):
    setup(["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *BASE, *layout, "--train.iters", str(iters),
           "--schedule.decay_iters", "6", "--model.hidden_dropout", "0.1", "--model.attention_dropout", "0.1"]).fit()


def _rows(run_dir: str) -> tuple[list, list]:
    """(iter, loss, grad norm) of every step metrics.jsonl records, and the iterations resumed from."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    return [(r["iter"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r], \
        [r["iter"] for r in rows if r.get("event") == "resumed"]


@pytest.mark.slow
def test_resume_under_zbv_is_bitwise_exact(corpus, tmp_path):
    """pp 2 with ZB-V and dropout: 3 iterations, stop, relaunch to 6 gives bit for bit the losses
    and grad norms of 6 straight (the deferred weight gradients leave nothing behind a step)."""
    layout = RESHARD["zbv"][1]
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    run_distributed(_fit, 2, straight, corpus, 6, layout, timeout=300)
    run_distributed(_fit, 2, split, corpus, 3, layout, timeout=300)
    run_distributed(_fit, 2, split, corpus, 6, layout, timeout=300)
    (rows_a, _), (rows_b, resumed) = _rows(straight), _rows(split)
    assert resumed == [3] and [r[0] for r in rows_b] == list(range(1, 7))
    assert rows_a == rows_b
