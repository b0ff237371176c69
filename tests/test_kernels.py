"""The Triton kernels against their torch references, on CPU through Triton's interpreter.

On a CUDA machine the same tests run the compiled kernels on the GPU; on CPU, tests/triton_helpers.py
imports Triton for its interpreter (and says why it must come first), and if that cannot be done here
:func:`test_kernels_in_a_fresh_process` runs this file again in a process of its own.
The losses (cross entropy, linear + cross entropy) are tested in tests/test_kernels_loss.py.
Sizes are small and odd (not multiples of any block): the interpreter runs each program in numpy.
"""

from __future__ import annotations

import pytest
import torch

# isort: off
# first: it imports Triton for the interpreter; triton_interpreter is an autouse fixture
from triton_helpers import DEVICE, FP32_ROW_SUM_TOL, FP32_TOL, as_leaf, close, run_in_fresh_process
from triton_helpers import triton_interpreter  # noqa: F401
# isort: on
from megapretrain.kernels import adamw, cross_entropy, rmsnorm, rope, swiglu


def test_kernels_in_a_fresh_process():
    """Runs this file in its own process when Triton was imported here without the interpreter."""
    run_in_fresh_process(__file__)


def test_the_triton_kernels_are_what_runs(monkeypatch):
    """With the torch fallbacks removed every op still runs: the tests below test the kernels."""
    from megapretrain.kernels import _triton

    assert _triton.use_triton(torch.zeros(1, device=DEVICE))

    def fallback(*args, **kwargs):
        raise AssertionError("the torch fallback ran")

    for module, name in [(rmsnorm, "_torch_forward"), (rmsnorm, "_torch_backward"), (swiglu, "_torch_backward"),
                         (rope, "_torch_rotate"), (cross_entropy, "_torch_stats"), (cross_entropy, "_torch_grad_"),
                         (adamw, "_torch_adamw_")]:
        monkeypatch.setattr(module, name, fallback)
    x = torch.randn(3, 1, 4, 8, device=DEVICE, requires_grad=True)
    cos, sin = torch.ones(4, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE)
    y = rope.rope(x, cos, sin)
    y = rmsnorm.rms_norm(y, torch.ones(8, device=DEVICE), 1e-6)
    y = swiglu.swiglu(y, y)
    cross_entropy.cross_entropy(y.reshape(12, 8), torch.arange(12, device=DEVICE) % 8).sum().backward()
    adamw.fused_adamw_(torch.ones(5, device=DEVICE), *(torch.zeros(5, device=DEVICE) for _ in range(3)),
                       lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, step=1)
    assert x.grad is not None


def test_empty_inputs():
    """No rows: nothing is launched, the results are empty and the weight gradient is zero."""
    x = torch.zeros(0, 33, device=DEVICE, requires_grad=True)
    w = torch.ones(33, device=DEVICE, requires_grad=True)
    y = rmsnorm.rms_norm(x, w, 1e-6)
    y.sum().backward()
    assert y.shape == (0, 33) and x.grad.shape == (0, 33) and (w.grad == 0).all()
    gate = torch.zeros(0, 7, device=DEVICE, requires_grad=True)
    swiglu.swiglu(gate, gate).sum().backward()
    q = torch.zeros(0, 2, 3, 8, device=DEVICE, requires_grad=True)
    rope.rope(q, torch.ones(3, 8, device=DEVICE), torch.zeros(3, 8, device=DEVICE)).sum().backward()
    assert gate.grad.shape == (0, 7) and q.grad.shape == (0, 2, 3, 8)
    adamw.fused_adamw_(*(torch.zeros(0, device=DEVICE) for _ in range(4)), lr=1e-3, beta1=0.9, beta2=0.95,
                       eps=1e-8, weight_decay=0.1, step=1)
    assert adamw.grad_sq_sum(torch.zeros(0, device=DEVICE)) == 0


# -- RMSNorm ----------------------------------------------------------------------------------------

def _rms_norm_both(x, w, dy, weight_in_fp32=False) -> list[tuple]:
    """(output, input grad, weight grad) of the kernel and of the reference, for ``dy``."""
    outs = []
    for fn in (rmsnorm.rms_norm, rmsnorm.rms_norm_reference):
        xl, wl = as_leaf(x), as_leaf(w)
        y = fn(xl, wl, 1e-6, weight_in_fp32)
        y.backward(dy)
        outs.append((y, xl.grad, wl.grad))
    return outs


@pytest.mark.parametrize("shape,dtype,wdtype", [((3, 7, 33), torch.float32, torch.float32),
                                                ((37, 300), torch.bfloat16, torch.bfloat16),
                                                ((19, 65), torch.float16, torch.float16),
                                                ((2, 5, 130), torch.bfloat16, torch.float32)])
def test_rms_norm_matches_reference(shape, dtype, wdtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(DEVICE, wdtype)
    dy = torch.randn(shape, generator=g).to(DEVICE, torch.promote_types(dtype, wdtype))
    (y, dx, dw), (y_ref, dx_ref, dw_ref) = _rms_norm_both(x, w, dy)
    assert y.dtype == y_ref.dtype and dx.dtype == dtype and dw.dtype == wdtype
    close(y, y_ref, dtype)
    close(dx, dx_ref, dtype)
    close(dw, dw_ref, wdtype, fp32_tol=FP32_ROW_SUM_TOL)


def test_rms_norm_with_the_weight_in_fp32_rounds_once():
    """weight_in_fp32 (OLMo's order): the kernel equals the reference, whose output is
    round(w · x / rms(x)) computed in fp32, where the default rounds x / rms(x) first."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 300, generator=g) * 3).to(DEVICE, torch.bfloat16)
    w = (1 + 0.1 * torch.randn(300, generator=g)).to(DEVICE, torch.bfloat16)
    dy = torch.randn(37, 300, generator=g).to(DEVICE, torch.bfloat16)
    (y, dx, dw), (y_ref, dx_ref, dw_ref) = _rms_norm_both(x, w, dy, True)
    for ours, ref in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        close(ours, ref, torch.bfloat16)
    xf = x.float()
    expected = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6) * w.float()).bfloat16()
    assert torch.equal(y_ref, expected)
    assert not torch.equal(rmsnorm.rms_norm_reference(x, w, 1e-6), expected)


def test_rms_norm_reference_is_rms_norm():
    """The reference itself against autograd through the textbook formula, in float64."""
    x = torch.randn(6, 41, dtype=torch.float64)
    w = torch.randn(41, dtype=torch.float64)
    xl, wl, xa, wa = as_leaf(x), as_leaf(w), as_leaf(x), as_leaf(w)
    y = rmsnorm.rms_norm_reference(xl.float(), wl.float(), 1e-5)
    y_auto = xa / torch.sqrt(xa.square().mean(-1, keepdim=True) + 1e-5) * wa
    dy = torch.randn(6, 41, dtype=torch.float64)
    y.backward(dy.float())
    y_auto.backward(dy)
    # the fp32 reference against float64: y as FP32_TOL; its grads through the row dot product (41
    # terms, then a cancelling difference of O(1) terms, ~1e-6 of them) and a sum over 6 rows, ×10 margin
    torch.testing.assert_close(y.double(), y_auto.detach(), rtol=FP32_TOL, atol=FP32_TOL)
    torch.testing.assert_close(xl.grad, xa.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(wl.grad, wa.grad, rtol=1e-4, atol=1e-4)


def test_rms_norm_extreme_values():
    """Huge, tiny and all-zero rows, and a zero incoming gradient: finite, and as the reference."""
    x = torch.randn(9, 67)
    x[0] *= 1e4
    x[1] *= 1e-20
    x[2] = 0.0
    x = x.to(DEVICE)
    w = torch.rand(67).to(DEVICE)
    for dy in (torch.randn(9, 67).to(DEVICE), torch.zeros(9, 67, device=DEVICE)):
        outs = _rms_norm_both(x, w, dy)
        for a, b in zip(*outs):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, rtol=FP32_TOL, atol=FP32_TOL)  # relative: scale-free
    assert (outs[0][1] == 0).all() and (outs[0][2] == 0).all()


def test_rms_norm_weight_grad_spans_many_programs():
    """Enough rows that the backward splits them over several programs (two-stage reduction)."""
    x = torch.randn(150, 33, device=DEVICE)
    w = torch.randn(33, device=DEVICE)
    dy = torch.randn(150, 33, device=DEVICE)
    grads = []
    for fn in (rmsnorm.rms_norm, rmsnorm.rms_norm_reference):
        wl = as_leaf(w)
        fn(x, wl, 1e-6).backward(dy)
        grads.append(wl.grad)
    # 150 rows over 4 programs of ~38 rows each, then 4 partials: ≤ ~40·u = 2.4e-6 of Σ|dy·x_hat|
    torch.testing.assert_close(grads[0], grads[1], rtol=FP32_TOL, atol=FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_backward_over_column_chunks(monkeypatch, dtype):
    """Rows wider than BWD_CHUNK (405B's 16384 at BWD_CHUNK 8192) are split over programs by columns:
    here 300 columns in chunks of 64 (the last ones partly or wholly past the row), as the reference."""
    monkeypatch.setattr(rmsnorm, "BWD_CHUNK", 64)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(23, 300, generator=g).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(300, generator=g)).to(DEVICE, dtype)
    dy = torch.randn(23, 300, generator=g).to(DEVICE, dtype)
    (y, dx, dw), (y_ref, dx_ref, dw_ref) = _rms_norm_both(x, w, dy)
    close(dx, dx_ref, dtype)
    close(dw, dw_ref, dtype, fp32_tol=FP32_ROW_SUM_TOL)


def test_rms_norm_op_registration_and_compile():
    x = torch.randn(5, 33, device=DEVICE, requires_grad=True)
    w = torch.randn(33, device=DEVICE, requires_grad=True)
    for weight_in_fp32 in (False, True):
        torch.library.opcheck(torch.ops.megapretrain.rms_norm.default, (x, w, 1e-6, weight_in_fp32))
    compiled = torch.compile(rmsnorm.rms_norm, backend="aot_eager", fullgraph=True)
    y = compiled(x, w, 1e-6)
    y.sum().backward()
    torch.testing.assert_close(y, rmsnorm.rms_norm_reference(x, w, 1e-6), rtol=FP32_TOL, atol=FP32_TOL)


# -- SwiGLU -----------------------------------------------------------------------------------------

def _swiglu_both(gate, up, dy):
    outs = []
    for fn in (swiglu.swiglu, swiglu.swiglu_reference):
        gl, ul = as_leaf(gate), as_leaf(up)
        y = fn(gl, ul)
        y.backward(dy)
        outs.append((y, gl.grad, ul.grad))
    return outs


@pytest.mark.parametrize("shape,dtype", [((3, 5, 67), torch.float32), ((7, 300), torch.bfloat16),
                                         ((2, 1031), torch.float16)])
def test_swiglu_matches_reference(shape, dtype):
    g = torch.Generator().manual_seed(1)
    gate, up, dy = (torch.randn(shape, generator=g).mul(3).to(DEVICE, dtype) for _ in range(3))
    for a, b in zip(*_swiglu_both(gate, up, dy)):
        assert a.dtype == dtype
        close(a, b, dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_swiglu_extreme_values():
    """Gates far into both tails (sigmoid saturates), zeros, and a zero incoming gradient."""
    gate = torch.tensor([-1e4, -88.0, -20.0, 0.0, 20.0, 88.0, 1e4] * 5, device=DEVICE)
    up = torch.linspace(-3, 3, gate.numel(), device=DEVICE)
    for dy in (torch.randn(gate.numel(), device=DEVICE), torch.zeros(gate.numel(), device=DEVICE)):
        for a, b in zip(*_swiglu_both(gate, up, dy)):
            assert torch.isfinite(a).all()
            # sigmoid saturates to 0 or 1 in the tails (exp's approximation error vanishes there), and
            # at |gate| ≤ 20 costs ≤ (2 + 20·1.44)·u = 1.8e-6 relative: FP32_TOL
            torch.testing.assert_close(a, b, rtol=FP32_TOL, atol=FP32_TOL)


def test_swiglu_op_registration_and_compile():
    gate = torch.randn(4, 37, device=DEVICE, requires_grad=True)
    up = torch.randn(4, 37, device=DEVICE, requires_grad=True)
    torch.library.opcheck(torch.ops.megapretrain.swiglu.default, (gate, up))
    compiled = torch.compile(swiglu.swiglu, backend="aot_eager", fullgraph=True)
    y = compiled(gate, up)
    y.sum().backward()
    torch.testing.assert_close(y, swiglu.swiglu_reference(gate, up))
    with pytest.raises(ValueError, match="one shape and dtype"):
        swiglu.swiglu(gate, up[:, :5])


# -- RoPE -------------------------------------------------------------------------------------------

def _tables(s, d, dtype, theta=10000.0):
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    emb = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq).repeat(1, 2)  # (s, d)
    return emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)


def _rope_both(x, cos, sin, dy):
    outs = []
    for fn in (rope.rope, rope.rope_reference):
        xl = as_leaf(x)
        y = fn(xl, cos, sin)
        y.backward(dy)
        outs.append((y, xl.grad))
    return outs


@pytest.mark.parametrize("shape,dtype,transposed", [((2, 3, 7, 34), torch.float32, False),
                                                    ((1, 2, 5, 66), torch.bfloat16, False),
                                                    ((2, 3, 9, 18), torch.float16, False),
                                                    ((2, 5, 3, 34), torch.float32, True)])
def test_rope_matches_reference(shape, dtype, transposed):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=g).to(DEVICE, dtype)
    if transposed:  # (b, s, n, d) projection viewed as (b, n, s, d)
        x = torch.randn(shape[0], shape[2], shape[1], shape[3], generator=g).to(DEVICE, dtype).transpose(1, 2)
    cos, sin = _tables(x.shape[2], x.shape[3], dtype)
    dy = torch.randn(x.shape, generator=g).to(DEVICE, dtype)
    (y, dx), (y_ref, dx_ref) = _rope_both(x, cos, sin, dy)
    assert y.dtype == dtype and dx.dtype == dtype
    close(y, y_ref, dtype)
    close(dx, dx_ref, dtype)


def test_rope_reference_is_a_rotation():
    """The reference against complex multiplication by e^{i·angle}, in float64; the backward of a
    rotation is the inverse rotation, so dx of dy = y is x."""
    x = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    cos, sin = (t.double().cpu() for t in _tables(6, 8, torch.float32))
    y = rope.rope_reference(x, cos, sin)
    z = torch.complex(x[..., :4], x[..., 4:]) * torch.complex(cos[:, :4], sin[:, :4])
    torch.testing.assert_close(y, torch.cat([z.real, z.imag], -1))
    xl = as_leaf(x)
    rope.rope_reference(xl, cos, sin).backward(y)
    torch.testing.assert_close(xl.grad, x)


def test_rope_extreme_values():
    x = torch.tensor([1e4, -1e4, 0.0, 1e-30] * 17, device=DEVICE)[:64].reshape(1, 2, 4, 8)
    cos, sin = _tables(4, 8, torch.float32)
    for dy in (torch.randn(1, 2, 4, 8, device=DEVICE), torch.zeros(1, 2, 4, 8, device=DEVICE)):
        for a, b in zip(*_rope_both(x, cos, sin, dy)):
            assert torch.isfinite(a).all()
            # x·cos rounded, then x·sin added: 2-3 roundings, u each, of terms up to 1e4; where they
            # cancel (y1 = 1e4·(cos - sin) here), an FMA (compiled) moves y by ≤ u·1e4 = 6e-4, inside
            # rtol·|y| while |cos ± sin| > 0.06 (here ≥ 0.3 at every angle)
            torch.testing.assert_close(a, b, rtol=FP32_TOL, atol=FP32_TOL)


def test_rope_op_registration_and_compile():
    x = torch.randn(1, 2, 5, 10, device=DEVICE, requires_grad=True)
    cos, sin = _tables(5, 10, torch.float32)
    torch.library.opcheck(torch.ops.megapretrain.rope.default, (x, cos, sin, False))
    compiled = torch.compile(rope.rope, backend="aot_eager", fullgraph=True)
    y = compiled(x, cos, sin)
    y.sum().backward()
    torch.testing.assert_close(y, rope.rope_reference(x, cos, sin))
    with pytest.raises(ValueError, match=r"cos, sin \(s, d\)"):
        rope.rope(x, cos[:4], sin[:4])


# -- fused AdamW ------------------------------------------------------------------------------------

ADAM = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
# a flat shard: a (20, 31) matrix (decays), a 1-D norm weight of 37 (does not), another matrix, padding
SHARD = [(0, 620, True), (620, 657, False), (657, 1000, True)]
NUMEL = 1011


def _torch_optimizer(master: torch.Tensor, fused: bool):
    params = [torch.nn.Parameter(master[a:b].clone()) for a, b, _ in SHARD]
    groups = [{"params": [p for p, (_, _, d) in zip(params, SHARD) if d], "weight_decay": ADAM["weight_decay"]},
              {"params": [p for p, (_, _, d) in zip(params, SHARD) if not d], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=ADAM["lr"], betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"],
                            fused=fused)
    return params, opt


@pytest.mark.parametrize("fn,out_dtype", [(adamw.fused_adamw_, torch.bfloat16), (adamw.fused_adamw_, torch.float16),
                                          (adamw.fused_adamw_reference, torch.bfloat16)])
def test_fused_adamw_matches_torch_adamw_over_ten_steps(fn, out_dtype):
    g = torch.Generator().manual_seed(5)
    master = torch.randn(NUMEL, generator=g)
    state = [master.clone().to(DEVICE), torch.zeros(NUMEL, device=DEVICE), torch.zeros(NUMEL, device=DEVICE)]
    out = torch.empty(NUMEL, dtype=out_dtype, device=DEVICE)
    mask = adamw.decay_mask(NUMEL, SHARD, DEVICE)
    clip, loss_scale = 0.37, 1024.0
    grads = [torch.randn(NUMEL, generator=g) for _ in range(10)]
    for fused in (True, False):
        params, opt = _torch_optimizer(master, fused)
        for step, grad in enumerate(grads, start=1):
            for p, (a, b, _) in zip(params, SHARD):
                p.grad = grad[a:b] * clip
            opt.step()
            if fused:  # one run of the kernel, checked against both torch implementations
                fn(grad.to(DEVICE) * loss_scale, *state, step=step, param_out=out, decay=mask,
                   grad_scale=torch.tensor(clip / loss_scale, device=DEVICE), **ADAM)
        expected = torch.cat([p.detach() for p in params])
        got = state[0].cpu()
        # per step both round p (|p| ~ 1) a few times, u each, and the update (lr·m̂/(√v̂ + eps), all
        # correctly rounded) ~6 times: over 10 steps ≤ ~30·u = 1.8e-6 relative; atol for p near 0
        torch.testing.assert_close(got[:1000], expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(out, state[0].to(out_dtype))  # the model's copy, rounded as .to() rounds


@pytest.mark.parametrize("fn", [adamw.fused_adamw_, adamw.fused_adamw_reference])
def test_fused_adamw_bf16_moments_match_torch_adamw_with_rounded_state(fn):
    """bf16 moments (optim.moments_dtype bf16): widened as read, stepped in fp32, rounded to nearest
    even as written — torch.optim.AdamW (fused) whose moments are rounded to bf16 after each step,
    over ten steps; mixed moment dtypes are refused."""
    g = torch.Generator().manual_seed(5)
    master = torch.randn(NUMEL, generator=g)
    state = [master.clone().to(DEVICE), *(torch.zeros(NUMEL, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))]
    out = torch.empty(NUMEL, dtype=torch.bfloat16, device=DEVICE)
    mask = adamw.decay_mask(NUMEL, SHARD, DEVICE)
    params, opt = _torch_optimizer(master, fused=True)
    for step in range(1, 11):
        grad = torch.randn(NUMEL, generator=g)
        for p, (a, b, _) in zip(params, SHARD):
            p.grad = grad[a:b] * 0.37
        opt.step()
        for moments in opt.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                moments[key].copy_(moments[key].bfloat16())
        fn(grad.to(DEVICE) * 1024.0, *state, step=step, param_out=out, decay=mask,
           grad_scale=torch.tensor(0.37 / 1024.0, device=DEVICE), **ADAM)
    assert all(t.dtype == torch.bfloat16 for t in state[1:])
    # the masters as in the fp32 test (≤ ~30·u over ten steps); the moments from the same fp32
    # values, rounded alike: within one bf16 ulp (2⁻⁷ relative), where a last fp32 bit moves a tie
    torch.testing.assert_close(state[0].cpu()[:1000], torch.cat([p.detach() for p in params]), rtol=1e-5, atol=1e-6)
    for i, key in ((1, "exp_avg"), (2, "exp_avg_sq")):
        expected = torch.cat([opt.state[p][key] for p in params])
        torch.testing.assert_close(state[i].cpu()[:1000].float(), expected, rtol=2**-7, atol=0.0)
    assert torch.equal(out, state[0].to(torch.bfloat16))
    with pytest.raises(ValueError, match="both moments in float32 or both in bfloat16"):
        fn(grad.to(DEVICE), state[0], state[1], state[2].float(), step=11, **ADAM)


def test_optimizer_triton_path_with_bf16_moments_steps_like_the_torch_path():
    """optim.impl triton with optim.moments_dtype bf16 (one kernel pass per shard, the moments
    stored in bf16, clipping inside the kernel) against the torch path's bf16 moments, on ZeRO-1
    shards of a bf16 model: the same step from the same grads (the ten-step kernel test above holds
    the kernel to torch.optim.AdamW)."""
    from megapretrain.config import OptimConfig
    from megapretrain.optim.optimizer import MixedPrecisionAdamW
    from megapretrain.parallel.state import ParallelState

    from helpers import build, make_tokens, tiny_args

    ps, tokens = ParallelState(), make_tokens(batch=2, seq=16)
    runs = []
    for impl in ("triton", "torch"):
        cfg = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5, moments_dtype="bf16", impl=impl)
        model = build(ps, tiny_args(), dtype=torch.bfloat16)
        opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(), cfg, "bf16", ps,
                                  zero=1, bucket_size_mb=0.01)
        assert opt.impl == impl
        with opt.grad_sync(last=True):
            model(tokens[:, :-1], tokens[:, 1:]).mean().backward()
        opt.reduce_grads()
        norm, skipped = opt.step(1e-2)
        assert norm > 0.5 and not skipped  # the clipping was in play
        assert all(s.exp_avg.dtype == s.exp_avg_sq.dtype == torch.bfloat16 for s in opt.shards)
        runs.append((model, [torch.cat([getattr(s, key).float() for s in opt.shards])
                             for key in ("master", "exp_avg", "exp_avg_sq")]))
    (fused, fused_state), (ref, ref_state) = runs
    # the clip coefficient multiplies each grad inside the kernel, before the step on the torch
    # path: a last fp32 bit apart; the moments then round to bf16 alike or one bf16 ulp apart
    torch.testing.assert_close(fused_state[0], ref_state[0], rtol=1e-5, atol=1e-6)
    for got, expected in zip(fused_state[1:], ref_state[1:]):
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=0.0)
    for (n, p), q in zip(fused.named_parameters(), ref.parameters()):  # the kernel's bf16 copy
        torch.testing.assert_close(p, q, rtol=2**-7, atol=1e-6, msg=n)


def test_fused_adamw_kernel_matches_reference_at_extremes():
    """Huge moments, huge and zero grads, no weight decay mask, fp32 grads and bf16 grads."""
    g = torch.Generator().manual_seed(6)
    n = 300
    grad = torch.randn(n, generator=g)
    grad[:50] = 0.0
    grad[50:60] = 1e18
    exp_avg = torch.randn(n, generator=g) * 1e15
    exp_avg_sq = torch.rand(n, generator=g) * 1e30
    for grad_dtype in (torch.float32, torch.bfloat16):
        runs = []
        for fn in (adamw.fused_adamw_, adamw.fused_adamw_reference):
            state = [t.clone().to(DEVICE) for t in (torch.randn(n, generator=torch.Generator().manual_seed(7)),
                                                    exp_avg, exp_avg_sq)]
            fn(grad.to(DEVICE, grad_dtype), *state, step=3, **ADAM)
            runs.append(state)
        for a, b in zip(*runs):
            assert torch.isfinite(a).all()
            # one step, same formulas, correctly rounded: the moments ≤ 4·u, p ≤ ~8·u = 4.8e-7 (1e-6 = 16·u)
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_decay_mask_round_trips_ranges():
    mask = adamw.decay_mask(NUMEL, SHARD)
    flags = adamw._unpack(mask, NUMEL)
    assert flags[:620].all() and not flags[620:657].any() and flags[657:1000].all() and not flags[1000:].any()
    state = [torch.zeros(NUMEL) for _ in range(3)]
    with pytest.raises(ValueError, match="decay mask must be int32"):
        adamw.fused_adamw_(torch.zeros(NUMEL), *state, step=1, decay=mask[:-1], **ADAM)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 4095, 4097, 9001])
def test_grad_sq_sum_matches_reference(dtype, n):
    """Odd sizes, a few huge grads among ordinary ones, zeros: within the stated 9e-7 of fp64.

    9e-7 ≥ (log2(SQ_BLOCK) + 3)·u: g / max correctly rounded (tl.div_rn) u, its square 2u + u, a tree
    of 12 adds of non-negative terms 12u; the fp64 combination adds nothing at this scale."""
    grad = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(DEVICE, dtype)
    grad[: min(3, n)] = 1e18 if dtype == torch.float32 else 1e15
    got = adamw.grad_sq_sum(grad)
    assert got.dtype == torch.float64 and got.shape == ()
    torch.testing.assert_close(got, adamw.grad_sq_sum_reference(grad), rtol=9e-7, atol=0.0)
    assert adamw.grad_sq_sum(torch.zeros(n, device=DEVICE, dtype=dtype)) == 0


def test_grad_sq_sum_range_and_accuracy():
    """Squares beyond fp32's range either way (1e20² and 1e-25²) are summed exactly enough, a
    large random shard within 9e-7 of the exact sum, and a NaN or inf grad gives a non-finite sum."""
    for value in (1e20, 3e38, 1e-25):
        grad = torch.full((5000,), value, device=DEVICE)
        grad[::7] = 0.0
        torch.testing.assert_close(adamw.grad_sq_sum(grad), adamw.grad_sq_sum_reference(grad), rtol=9e-7, atol=0.0)
    grad = (torch.randn(100_003, generator=torch.Generator().manual_seed(1)) * 1e-3).to(DEVICE)
    exact = adamw.grad_sq_sum_reference(grad)
    assert abs(adamw.grad_sq_sum(grad) / exact - 1) < 9e-7
    for bad in (float("nan"), float("inf")):
        grad[123] = bad
        assert not torch.isfinite(adamw.grad_sq_sum(grad))
    assert adamw.grad_sq_sum(torch.zeros(0, device=DEVICE)) == 0


@pytest.mark.parametrize("fn", [adamw.fused_adamw_, adamw.fused_adamw_reference])
def test_fused_adamw_grad_scale_is_applied_as_the_grad_is_read(fn):
    """grad_scale (clip coefficient × 1 / loss scale) as a Python float or a device tensor: the
    step of the grads multiplied beforehand, bit for bit; a zero scale only decays."""
    g = torch.Generator().manual_seed(8)
    n, scale = 1001, 0.37 / 1024
    grad = (torch.randn(n, generator=g) * 1024).to(DEVICE)
    start = [torch.randn(n, generator=g).to(DEVICE), torch.randn(n, generator=g).to(DEVICE),
             torch.rand(n, generator=g).to(DEVICE)]
    runs = []
    for g_in, s in ((grad * scale, 1.0), (grad, scale), (grad, torch.tensor(scale, device=DEVICE))):
        state = [t.clone() for t in start]
        fn(g_in, *state, step=4, grad_scale=s, **ADAM)
        runs.append(state)
    for run in runs[1:]:
        for a, b in zip(run, runs[0]):
            assert torch.equal(a, b)
    state = [t.clone() for t in start]
    fn(grad, *state, step=4, grad_scale=0.0, **ADAM)
    zero = [t.clone() for t in start]
    fn(torch.zeros(n, device=DEVICE), *zero, step=4, **ADAM)
    for a, b in zip(state, zero):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fn", [adamw.fused_adamw_, adamw.fused_adamw_reference])
def test_fused_adamw_found_inf_skips_the_step_on_the_device(fn):
    """A set found_inf flag writes nothing (master, moments, parameter copy); an unset one is the
    step without a flag, bit for bit."""
    g = torch.Generator().manual_seed(9)
    n = 777
    grad = torch.randn(n, generator=g).to(DEVICE)
    start = [torch.randn(n, generator=g).to(DEVICE), torch.randn(n, generator=g).to(DEVICE),
             torch.rand(n, generator=g).to(DEVICE), torch.zeros(n, dtype=torch.bfloat16, device=DEVICE)]
    runs = {}
    for flag in (None, False, True):
        state = [t.clone() for t in start]
        found_inf = None if flag is None else torch.tensor(flag, device=DEVICE)
        fn(grad, *state[:3], step=3, param_out=state[3], found_inf=found_inf, **ADAM)
        runs[flag] = state
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[None]))
    assert all(torch.equal(a, b) for a, b in zip(runs[True], start))
    assert not torch.equal(runs[None][0], start[0])


def test_fused_adamw_op_registration():
    n = 70
    for skip in (None, torch.zeros(1, dtype=torch.int32, device=DEVICE)):
        args = (torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE), torch.zeros(n, device=DEVICE),
                torch.zeros(n, device=DEVICE), torch.empty(n, dtype=torch.bfloat16, device=DEVICE),
                adamw.decay_mask(n, [(0, 40, True)], DEVICE), torch.ones(1, device=DEVICE), skip,
                1e-3, 0.9, 0.95, 1e-8, 0.1, 1)
        torch.library.opcheck(torch.ops.megapretrain.fused_adamw_.default, args)
    torch.library.opcheck(torch.ops.megapretrain.grad_sq_sum.default, (torch.randn(n, device=DEVICE),))
