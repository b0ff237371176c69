"""The output layer's weight gradient added straight into its fp32 main grad by the chunked loss
(``model/fused_loss.py`` with ``grad_sink``), as the trainer runs it: the same gradients as
autograd's, no weight-sized gradient ever allocated, and the data-parallel bucket still told."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megapretrain.model.fused_loss import linear_cross_entropy_per_token
from megapretrain.parallel.cross_entropy import vocab_parallel_linear_cross_entropy
from megapretrain.parallel.data import DataParallelBuffers
from megapretrain.parallel.specs import plain_specs
from megapretrain.parallel.state import Group

from helpers import records, train_tiny

VOCAB, HIDDEN = 45, 16


def _setup(dtype, seed=0):
    """x (2, 11, h), targets (two ignored), and the output weight held by 1-rank buffers with a
    second parameter in its bucket (so the bucket completes only when both are in)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 11, HIDDEN, generator=g).to(dtype)
    targets = torch.randint(0, VOCAB, (2, 11), generator=g)
    targets[0, 3] = targets[1, 0] = -100
    weight = torch.nn.Parameter((torch.randn(VOCAB, HIDDEN, generator=g) * 0.3).to(dtype))
    norm = torch.nn.Parameter(torch.ones(HIDDEN, dtype=dtype))
    named = [("norm", norm), ("weight", weight)]
    one = Group("dp", [0])
    buffers = DataParallelBuffers(named, plain_specs(named), one, Group("tp", [0]))
    return x, targets, weight, norm, buffers


def _reference(x, weight, targets, dy):
    """d/dx, d/dweight of Σ dy · per-token loss, unfused, in fp32."""
    xl = x.float().requires_grad_(True)
    wl = weight.detach().float().requires_grad_(True)
    loss = F.cross_entropy(F.linear(xl, wl).view(-1, VOCAB), targets.view(-1), reduction="none").view(2, 11)
    loss.backward(dy)
    return loss.detach(), xl.grad, wl.grad


def _run(x, targets, weight, norm, buffers, dy, **kw):
    xl = x.clone().requires_grad_(True)
    with buffers.grad_sync(last=True):
        loss = linear_cross_entropy_per_token(xl * norm, weight, targets, Group("tp", [0]), 0, VOCAB,
                                              reference=True, chunk_rows=5, grad_sink=buffers, **kw)
        loss.backward(dy)
    return loss.detach(), xl.grad


@pytest.mark.parametrize("grads_in_forward", [True, False])
@pytest.mark.parametrize("incoming", ["announced", "another uniform", "per token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_lands_in_the_main_grad(grads_in_forward, incoming, dtype):
    """Made in the forward for the announced gradient, or in the backward: the main grad holds
    autograd's d/dweight (fp32, summed in fp32), the weight gets no .grad, and the bucket is
    launched once the other parameter is in too. A backward that brings another gradient than
    the one announced is still exact (the difference is added)."""
    x, targets, weight, norm, buffers = _setup(dtype)
    announced = 0.25
    dy = {"announced": torch.full((2, 11), announced), "another uniform": torch.full((2, 11), 0.5),
          "per token": torch.rand(2, 11, generator=torch.Generator().manual_seed(1))}[incoming]
    dy[0, 3] = 9.0  # an ignored token's incoming gradient changes nothing
    before = weight.main_grad.clone()
    loss, dx = _run(x, targets, weight, norm, buffers, dy, grads_in_forward=grads_in_forward,
                    grad_scale=announced)
    want_loss, want_dx, want_dw = _reference(x, weight, targets, dy)
    assert weight.grad is None and before.abs().sum() == 0
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(loss, want_loss, **tol)
    torch.testing.assert_close(dx.float(), want_dx, **tol)
    torch.testing.assert_close(weight.main_grad, want_dw, **tol)
    assert weight.main_grad.dtype == torch.float32
    assert all(b.launched for b in buffers.buckets)  # norm folded by autograd, weight told by the loss


def test_main_grad_sums_micro_batches_and_bf16_sums_in_fp32():
    """Two micro-batches add up in the main grad; in bf16 the sum over chunks is fp32's, closer to
    the exact gradient than bf16 autograd's (which rounds its running sum per chunk)."""
    x, targets, weight, norm, buffers = _setup(torch.bfloat16, seed=4)
    dy = torch.full((2, 11), 0.5)
    for _ in range(2):
        with buffers.grad_sync(last=False):
            linear_cross_entropy_per_token(x * norm, weight, targets, Group("tp", [0]), 0, VOCAB, reference=True,
                                           chunk_rows=2, grad_sink=buffers, grad_scale=0.5).backward(dy)
    exact = 2 * _reference(x, weight, targets, dy)[2]
    fused_err = (weight.main_grad - exact).abs().max()
    wl = weight.detach().clone().requires_grad_(True)
    linear_cross_entropy_per_token(x, wl, targets, Group("tp", [0]), 0, VOCAB, reference=True,
                                   chunk_rows=2).backward(dy)
    torch.testing.assert_close(weight.main_grad, exact, rtol=1e-2, atol=1e-2)
    assert fused_err <= (2 * wl.grad.float() - exact).abs().max()


class _Allocations(TorchDispatchMode):
    """The bytes of every new storage an op returns while active."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.sizes.append(t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("grads_in_forward", [True, False])
def test_no_weight_sized_gradient_is_allocated(grads_in_forward):
    """Forward and backward with the sink make no tensor of the weight's size (the product is
    folded into the main grad a tile of vocabulary rows at a time); without it the weight's
    gradient is one. 2048 vocabulary rows a tile: a 6000-row weight is three tiles."""
    g = torch.Generator().manual_seed(0)
    vocab, hidden = 6000, 64
    x = torch.randn(1, 24, hidden, generator=g).bfloat16().requires_grad_(True)
    targets = torch.randint(0, vocab, (1, 24), generator=g)
    weight = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g).bfloat16())
    named = [("weight", weight)]
    buffers = DataParallelBuffers(named, plain_specs(named), Group("dp", [0]), Group("tp", [0]))
    weight_bytes = weight.numel() * weight.element_size()
    for sink in (buffers, None):
        with _Allocations() as seen:
            linear_cross_entropy_per_token(x, weight, targets, Group("tp", [0]), 0, vocab, reference=True,
                                           chunk_rows=8, grads_in_forward=grads_in_forward, grad_sink=sink,
                                           grad_scale=1.0).sum().backward()
        largest = max(seen.sizes)
        if sink is not None:
            assert largest < weight_bytes and weight.grad is None
        else:  # the weight's gradient through autograd (then folded into the main grad by the buffers)
            assert largest >= weight_bytes
    # the one-buffer loss as the trainer had it: logits (and their gradient) far above the weight
    with _Allocations() as seen:
        vocab_parallel_linear_cross_entropy(x, weight, targets, Group("tp", [0]), 0, vocab).sum().backward()
    assert max(seen.sizes) >= weight_bytes


@pytest.mark.parametrize("extra", [[], ["--model.tie_embeddings", "true"]])
def test_training_with_the_fused_weight_gradient_gives_autograds_losses(tmp_path, corpus, monkeypatch, extra):
    """Ten fp32 steps with the output layer's gradient added into its main grad give the losses
    and grad norms of the same run with that gradient returned to autograd (a tied embedding,
    whose weight the embedding's backward also reaches, keeps autograd's path: the same run).
    The gradient the trainer announces is the one its backward brings: no chunk is recomputed."""
    from megapretrain.model import fused_loss
    from megapretrain.model.decoder import DecoderModel

    recomputed = []
    real_chunks = fused_loss.chunked_loss_and_grads

    def spy(*args, lse=None, **kw):
        recomputed.append(lse is not None)  # the backward's passes are given the forward's lse
        return real_chunks(*args, lse=lse, **kw)

    monkeypatch.setattr(fused_loss, "chunked_loss_and_grads", spy)

    common = ["--train.iters", "10", "--train.precision", "fp32", "--train.eval_interval", "0",
              "--checkpoint.interval", "0", *extra]
    calls = []
    real = DecoderModel._grad_sink

    def counting(self, weight):
        sink = real(self, weight)
        calls.append(sink is not None)
        return sink

    monkeypatch.setattr(DecoderModel, "_grad_sink", counting)
    assert train_tiny(tmp_path / "fused", corpus, *common) == 0
    assert calls and (not any(calls) if extra else all(calls))  # fused on every micro-batch unless tied
    assert recomputed and not any(recomputed)
    monkeypatch.setattr(DecoderModel, "_grad_sink", lambda self, weight: None)
    assert train_tiny(tmp_path / "autograd", corpus, *common) == 0
    fused, plain = records(tmp_path / "fused", "loss"), records(tmp_path / "autograd", "loss")
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[key] for r in fused]), torch.tensor([r[key] for r in plain]),
                                   rtol=1e-5, atol=0)
