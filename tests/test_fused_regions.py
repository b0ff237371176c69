"""The decoder layer's hand-fused regions of the torch path equal their eager forms, values and
gradients: RMSNorm (``model/layers.py``'s ``_RMSNormFunction``: fp32 statistics, a hand-written
backward saving x and 1/rms only) against autograd through the textbook formula as Hugging Face
writes it, and RoPE (``_RoPEFunction``: one product and two in-place multiply-adds each way)
against ``x·cos + rotate_half(x)·sin``, under both kinds of tables (positions 0..s-1, and the
per-token positions of document masking) and partial rotary. fp32 to a few units of rounding;
bf16 against the eager form computed in fp32, to bf16's rounding of the output."""

from __future__ import annotations

import pytest
import torch

from megapretrain.model.layers import RMSNorm, apply_rope, rope_tables

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# fp32: a few units of fp32 rounding on values of order 1-10; bf16: a couple of bf16 ulps (2⁻⁸ relative)
TOL = {"fp32": dict(rtol=1e-5, atol=1e-5), "bf16": dict(rtol=1.6e-2, atol=1.6e-2)}


def _leaf(shape, dtype, g, scale=1.0):
    return (torch.randn(shape, generator=g) * scale).to(dtype).requires_grad_(True)


def _eager_rms_norm(x, weight, eps):
    """Hugging Face's LlamaRMSNorm, in fp32 throughout (autograd's backward)."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_rms_norm_equals_its_eager_form(dtype):
    g = torch.Generator().manual_seed(0)
    dt = DTYPES[dtype]
    norm = RMSNorm(48, 1e-5, dtype=dt)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=g) * 0.5 + 1)
    x = _leaf((3, 7, 48), dt, g, scale=3.0)
    dy = torch.randn(3, 7, 48, generator=g).to(dt)
    y = norm(x)
    y.backward(dy)
    xf = x.detach().float().requires_grad_(True)
    wf = norm.weight.detach().float().requires_grad_(True)
    ref = _eager_rms_norm(xf, wf, 1e-5)
    ref.backward(dy.float())
    assert y.dtype == x.grad.dtype == norm.weight.grad.dtype == dt
    for ours, eager in ((y, ref), (x.grad, xf.grad), (norm.weight.grad, wf.grad)):
        torch.testing.assert_close(ours.float(), eager.detach(), **TOL[dtype])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _eager_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's apply_rotary_pos_emb on the first r dims, the rest passed through (fp32)."""
    r = cos.shape[-1]
    turned = x[..., :r] * cos.float() + _rotate_half(x[..., :r]) * sin.float()
    return torch.cat([turned, x[..., r:]], dim=-1)


@pytest.mark.parametrize("per_token", [False, True], ids=["tables", "document_positions"])
@pytest.mark.parametrize("rotary", [16, 8], ids=["full", "partial"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_rope_equals_its_eager_form(dtype, rotary, per_token):
    g = torch.Generator().manual_seed(1)
    dt = DTYPES[dtype]
    b, n, s, d = 2, 4, 12, 16
    cos, sin = rope_tables(s, rotary, 10000.0, "cpu", dt)  # (s, r)
    if per_token:  # positions restarting at each document: (b, 1, s, r) tables
        positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1], list(range(s))])
        cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    # as the model makes them: a transposed view of the projection's (b, s, n, d) output
    x = torch.randn(b, s, n, d, generator=g).to(dt).transpose(1, 2).requires_grad_(True)
    dy = torch.randn(b, n, s, d, generator=g).to(dt)
    y = apply_rope(x, cos, sin)
    y.backward(dy)
    xf = x.detach().float().requires_grad_(True)
    ref = _eager_rope(xf, cos, sin)
    ref.backward(dy.float())
    assert y.dtype == x.grad.dtype == dt and y.shape == x.shape
    torch.testing.assert_close(y.float(), ref.detach(), **TOL[dtype])
    torch.testing.assert_close(x.grad.float(), xf.grad, **TOL[dtype])
    if rotary < d:  # the dims past r pass through untouched, both ways
        assert torch.equal(y[..., rotary:], x.detach()[..., rotary:])
        assert torch.equal(x.grad[..., rotary:], dy[..., rotary:])
