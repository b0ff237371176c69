"""The cross entropy kernels and the chunked linear + cross entropy against their references, on
CPU through Triton's interpreter (set up as tests/triton_helpers.py explains), tp=2 on gloo included.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# isort: off
# first: it imports Triton for the interpreter; triton_interpreter is an autouse fixture
from triton_helpers import DEVICE, as_leaf, close, run_in_fresh_process
from triton_helpers import triton_interpreter  # noqa: F401
# isort: on
from megapretrain.kernels import cross_entropy, linear_cross_entropy
from megapretrain.parallel.state import Group

from distributed import run_distributed

# Tolerances (u = 2⁻²⁴; the common rules are in tests/triton_helpers.py). Loss = log Σ exp(x - max) minus
# the target's logit; gradient = softmax · (1 + 2z·lse) - onehot. Compiled, exp is ex2.approx of
# (x - max)·log2 e: 2 ulp plus u·|x - max|·log2 e, at most ~45·u = 2.7e-6 relative for these logits
# (randn·4: |x - max| ≤ 30), and the sums over ≤ 300 columns add ⌈log2 300⌉·u. So losses of O(1-10)
# agree within 1e-5 relative or absolute (TOL), softmax entries within 1e-5 relative, 1e-6 absolute
# near 0 (SOFTMAX_TOL); the linear + cross entropy gradients are those entries through the same
# torch matmul on both sides, so they keep the relative error of the entries (TOL).
TOL = dict(rtol=1e-5, atol=1e-5)
SOFTMAX_TOL = dict(rtol=1e-5, atol=1e-6)
# bf16 x and weight against an unfused reference: each matmul rounds its (≤ 45 or 11 term) sums to bf16,
# 2⁻⁹ relative, and the weight grad once per chunk (the module docstring: 1.1e-3 over 8 chunks), so
# gradients within 2e-2 (5 bf16 ulps); the fp32 loss from bf16 logits within 1e-4 relative, 1e-3 abs
BF16_LOSS_TOL = dict(rtol=1e-4, atol=1e-3)


def test_kernels_in_a_fresh_process():
    """Runs this file in its own process when Triton was imported here without the interpreter."""
    run_in_fresh_process(__file__)


# -- cross entropy ----------------------------------------------------------------------------------

def _ce_both(logits, targets, dy, **kw):
    outs = []
    for fn in (cross_entropy.cross_entropy, cross_entropy.cross_entropy_reference):
        leaf = as_leaf(logits)
        loss = fn(leaf * 1, targets, **kw)  # a non-leaf, so the in-place gradient has a buffer to own
        loss.backward(dy)
        outs.append((loss, leaf.grad))
    return outs


def _ce_inputs(rows, width, dtype, real_vocab=None, seed=3, ignored=(1,)):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, width, generator=g) * 4).to(DEVICE, dtype)
    targets = torch.randint(0, real_vocab or width, (rows,), generator=g).to(DEVICE)
    targets[list(ignored)] = -100
    return logits, targets, torch.randn(rows, generator=g).to(DEVICE)


@pytest.mark.parametrize("rows,width,real_vocab,dtype,z_loss", [(13, 77, None, torch.float32, 0.0),
                                                               (11, 300, 290, torch.bfloat16, 0.0),
                                                               (7, 33, 30, torch.float32, 1e-3),
                                                               (9, 129, 100, torch.float16, 1e-4)])
def test_cross_entropy_matches_reference(rows, width, real_vocab, dtype, z_loss):
    logits, targets, dy = _ce_inputs(rows, width, dtype, real_vocab)
    (loss, grad), (loss_ref, grad_ref) = _ce_both(logits, targets, dy, real_vocab=real_vocab, z_loss=z_loss)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(loss, loss_ref, **TOL)
    close(grad, grad_ref, dtype)
    assert loss[1] == 0 and (grad[1] == 0).all()  # the ignored row
    if real_vocab:
        assert (grad[:, real_vocab:] == 0).all()  # vocabulary padding


def test_cross_entropy_reference_is_cross_entropy():
    """The reference against F.cross_entropy (plus z·logsumexp² by autograd), padding sliced off."""
    logits, targets, dy = _ce_inputs(10, 50, torch.float32, real_vocab=45)
    ref = as_leaf(logits)
    expected = F.cross_entropy(ref[:, :45], targets, reduction="none")
    expected = expected + 1e-2 * torch.logsumexp(ref[:, :45], -1).square() * (targets != -100)
    expected.backward(dy)
    (loss, grad), _ = _ce_both(logits, targets, dy, real_vocab=45, z_loss=1e-2)
    torch.testing.assert_close(loss, expected.detach(), **TOL)
    torch.testing.assert_close(grad, ref.grad, **SOFTMAX_TOL)


def test_cross_entropy_matches_the_model_loss():
    """The same numbers as megapretrain.parallel.cross_entropy, which the model uses today."""
    from megapretrain.parallel.cross_entropy import vocab_parallel_cross_entropy

    logits, targets, dy = _ce_inputs(12, 70, torch.float32, real_vocab=64)
    group = Group("tp", [0])
    outs = []
    for fn in (cross_entropy.cross_entropy, vocab_parallel_cross_entropy):
        leaf = as_leaf(logits)
        loss = fn(leaf * 1, targets, group, 0, 64, -100)
        loss.backward(dy)
        outs.append((loss, leaf.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, **SOFTMAX_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_extreme_logits(dtype):
    """Logits of ±1e4 (the target at -1e4: loss 2e4, softmax one-hot), a zero incoming gradient,
    and a batch whose every row is ignored."""
    logits = torch.full((5, 40), -1e4)
    logits[:, 7] = 1e4
    logits = logits.to(DEVICE, dtype)
    targets = torch.tensor([7, 0, 39, -100, 7], device=DEVICE)
    (loss, grad), (loss_ref, grad_ref) = _ce_both(logits, targets, torch.ones(5, device=DEVICE))
    big = logits[0, 7].float()  # 1e4 as the dtype holds it
    torch.testing.assert_close(loss, torch.stack([0 * big, 2 * big, 2 * big, 0 * big, 0 * big]))
    torch.testing.assert_close(loss, loss_ref)
    torch.testing.assert_close(grad, grad_ref)
    assert grad[1, 7] == 1 and grad[1, 0] == -1 and grad[3].abs().sum() == 0
    (_, grad), _ = _ce_both(logits, targets, torch.zeros(5, device=DEVICE))
    assert (grad == 0).all()
    ignored = torch.full((5,), -100, device=DEVICE)
    (loss, grad), _ = _ce_both(logits, ignored, torch.ones(5, device=DEVICE))
    assert (loss == 0).all() and (grad == 0).all()


def test_cross_entropy_of_no_rows():
    logits = torch.zeros(0, 7, device=DEVICE, requires_grad=True)
    loss = cross_entropy.cross_entropy(logits * 1, torch.zeros(0, dtype=torch.long, device=DEVICE))
    loss.sum().backward()
    assert loss.shape == (0,) and logits.grad.shape == (0, 7)


def test_cross_entropy_gradient_overwrites_the_logits():
    logits, targets, dy = _ce_inputs(6, 37, torch.float32)
    (_, expected), _ = _ce_both(logits, targets, dy)
    leaf = logits.clone().requires_grad_(True)
    cross_entropy.cross_entropy(leaf, targets).backward(dy)
    assert leaf.grad.data_ptr() == leaf.data_ptr()  # the gradient lives in the logits' storage
    torch.testing.assert_close(leaf.grad, expected)
    leaf = logits.clone().requires_grad_(True)
    cross_entropy.cross_entropy(leaf, targets, inplace_grad=False).backward(dy)
    assert torch.equal(leaf.detach(), logits) and leaf.grad.data_ptr() != leaf.data_ptr()
    torch.testing.assert_close(leaf.grad, expected)


def test_cross_entropy_op_registration_and_compile():
    logits, targets, _ = _ce_inputs(5, 33, torch.float32)
    torch.library.opcheck(torch.ops.megapretrain.cross_entropy_stats.default, (logits, targets, 0, 30, -100))
    leaf = as_leaf(logits)
    torch.library.opcheck(torch.ops.megapretrain.cross_entropy.default,
                          (leaf, targets, 0, 30, -100, 1e-3, False))
    compiled = torch.compile(cross_entropy.cross_entropy, backend="aot_eager", fullgraph=True)
    loss = compiled(leaf * 1, targets, None, 0, 30)
    loss.sum().backward()
    torch.testing.assert_close(loss, cross_entropy.cross_entropy_reference(logits, targets, real_vocab=30))


def _tp_cross_entropy(rank, world_size, logits, targets, dy, real_vocab, z_loss):
    group = Group("tp", list(range(world_size)), rank_in_group=rank)
    width = logits.shape[-1] // world_size
    local = logits[..., rank * width:(rank + 1) * width].clone().requires_grad_(True)
    loss = cross_entropy.cross_entropy(local * 1, targets, group, vocab_start=rank * width,
                                       real_vocab=real_vocab, z_loss=z_loss)
    loss.backward(dy)
    return loss.detach(), local.grad


@pytest.mark.parametrize("dtype,z_loss", [(torch.float32, 1e-3), (torch.bfloat16, 0.0)])
def test_vocab_parallel_cross_entropy_tp2(dtype, z_loss):
    """Two gloo ranks, each with half of the (padded) vocabulary: the one-process loss and gradient."""
    logits, targets, dy = _ce_inputs(2 * 7, 2 * 45, dtype, real_vocab=83, seed=4, ignored=(2, 5))
    logits, targets, dy = logits.view(2, 7, 90).cpu(), targets.view(2, 7).cpu(), dy.view(2, 7).cpu()
    targets[0, 0], targets[1, 1] = 44, 45  # either side of the rank boundary
    ranks = run_distributed(_tp_cross_entropy, 2, logits, targets, dy, 83, z_loss)
    (loss, grad), _ = _ce_both(logits, targets, dy, real_vocab=83, z_loss=z_loss)
    for loss_r, _ in ranks:
        torch.testing.assert_close(loss_r, loss, **TOL)
    close(torch.cat([g for _, g in ranks], -1), grad, dtype)


# -- chunked linear + cross entropy -----------------------------------------------------------------

LCE = (linear_cross_entropy.linear_cross_entropy, linear_cross_entropy.linear_cross_entropy_reference)


def _lce_inputs(dtype, seed=8, b=2, s=11, h=24, vocab=50, real_vocab=45):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, h, generator=g).to(DEVICE, dtype)
    weight = (torch.randn(vocab, h, generator=g) / h ** 0.5).to(DEVICE, dtype)
    targets = torch.randint(0, real_vocab, (b, s), generator=g).to(DEVICE)
    targets[0, 3] = targets[1, 0] = -100
    return x, weight, targets, torch.rand(b, s, generator=g).to(DEVICE)


def _unfused_loss(x, weight, targets, loss_weight, **kw):
    """What the chunked loss replaces: the full logits, then the cross entropy, then the sum."""
    logits = F.linear(x, weight)  # (b, s, v)
    return (cross_entropy.cross_entropy_reference(logits, targets, **kw) * loss_weight).sum()


def _lce_run(fn, x, weight, targets, grad_scale=2.5, **kw):
    xl, wl = as_leaf(x), as_leaf(weight)
    loss = fn(xl, wl, targets, **kw)
    (loss * grad_scale).backward()
    return loss, xl.grad, wl.grad


@pytest.mark.parametrize("fn", LCE)
@pytest.mark.parametrize("chunk_rows,z_loss", [(5, 0.0), (7, 1e-3), (22, 0.0), (None, 0.0)])
def test_linear_cross_entropy_matches_unfused(fn, chunk_rows, z_loss):
    x, weight, targets, lw = _lce_inputs(torch.float32)
    kw = dict(real_vocab=45, z_loss=z_loss)
    loss, dx, dw = _lce_run(fn, x, weight, targets, loss_weight=lw, chunk_rows=chunk_rows, **kw)
    ref = _lce_run(lambda *a, **k: _unfused_loss(*a, lw, **k), x, weight, targets, **kw)
    for a, b in zip((loss, dx, dw), ref):
        torch.testing.assert_close(a, b, **TOL)


def test_linear_cross_entropy_low_precision_and_defaults():
    """bf16 x and weight (the matmuls are torch's, so the interpreter handles bf16 here), unit
    loss weights by default, and no gradient work when none is needed."""
    x, weight, targets, _ = _lce_inputs(torch.bfloat16, seed=9)
    loss, dx, dw = _lce_run(LCE[0], x, weight, targets, chunk_rows=4)
    ref = _lce_run(lambda *a, **k: _unfused_loss(*a, torch.ones(2, 11, device=DEVICE), **k), x, weight, targets)
    assert dx.dtype == dw.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref[0], **BF16_LOSS_TOL)
    torch.testing.assert_close(dx, ref[1], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dw, ref[2], rtol=2e-2, atol=2e-2)
    fp32_sum = _lce_run(LCE[0], x, weight, targets, chunk_rows=4, accum_dtype=torch.float32)
    torch.testing.assert_close(fp32_sum[2], ref[2], rtol=2e-2, atol=2e-2)
    assert fp32_sum[2].dtype == torch.bfloat16
    with torch.no_grad():
        torch.testing.assert_close(LCE[0](x, weight, targets, chunk_rows=4), loss.detach())


def test_linear_cross_entropy_all_ignored():
    x, weight, targets, lw = _lce_inputs(torch.float32)
    loss, dx, dw = _lce_run(LCE[0], x, weight, torch.full_like(targets, -100), loss_weight=lw, chunk_rows=6)
    assert loss == 0 and (dx == 0).all() and (dw == 0).all()


def test_linear_cross_entropy_chunk_buffer_is_chunk_sized():
    """The chunked loss allocates one (chunk, v) logits buffer, never a (tokens, v) one."""
    x, weight, targets, _ = _lce_inputs(torch.float32, b=4, s=16, vocab=300, real_vocab=300)
    sizes = []
    real_mm = torch.mm

    def spy(a, b, out=None):
        if b.shape[-1] == 300:
            sizes.append(out.shape)
        return real_mm(a, b, out=out)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "mm", spy)
        LCE[1](x, weight, targets, chunk_rows=10)
    assert sizes and max(s[0] for s in sizes) == 10 and sum(s[0] for s in sizes) == 64


def _tp_linear_cross_entropy(rank, world_size, x, weight, targets, lw, real_vocab):
    group = Group("tp", list(range(world_size)), rank_in_group=rank)
    rows = weight.shape[0] // world_size
    xl = x.clone().requires_grad_(True)
    wl = weight[rank * rows:(rank + 1) * rows].clone().requires_grad_(True)
    loss = linear_cross_entropy.linear_cross_entropy(xl, wl, targets, group, vocab_start=rank * rows,
                                                     real_vocab=real_vocab, z_loss=1e-3, loss_weight=lw,
                                                     chunk_rows=6)
    loss.backward()
    return loss.detach(), xl.grad, wl.grad


def test_vocab_parallel_linear_cross_entropy_tp2():
    """Two gloo ranks with half the output rows each: the one-process loss, weight gradient slices,
    and d x as partial sums (what the tp mapping before the output layer adds up)."""
    x, weight, targets, lw = _lce_inputs(torch.float32, vocab=50, real_vocab=47)
    x, weight, targets, lw = x.cpu(), weight.cpu(), targets.cpu(), lw.cpu()
    targets[0, 0], targets[0, 1] = 24, 25  # either side of the rank boundary
    ranks = run_distributed(_tp_linear_cross_entropy, 2, x, weight, targets, lw, 47)
    loss, dx, dw = _lce_run(linear_cross_entropy.linear_cross_entropy_reference, x, weight, targets,
                            grad_scale=1.0, real_vocab=47, z_loss=1e-3, loss_weight=lw)
    for loss_r, _, _ in ranks:
        torch.testing.assert_close(loss_r, loss, **TOL)
    torch.testing.assert_close(ranks[0][1] + ranks[1][1], dx, **TOL)
    torch.testing.assert_close(torch.cat([r[2] for r in ranks]), dw, **TOL)


def test_linear_cross_entropy_compiles():
    x, weight, targets, lw = _lce_inputs(torch.float32, s=7)
    compiled = torch.compile(linear_cross_entropy.linear_cross_entropy, backend="aot_eager", fullgraph=True)
    got = _lce_run(lambda *a, **k: compiled(*a, **k), x, weight, targets, loss_weight=lw, chunk_rows=5)
    expected = _lce_run(LCE[1], x, weight, targets, loss_weight=lw, chunk_rows=5)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **TOL)


# -- the fused torch phase, the chunk size and the per-token chunked loss ---------------------------

@pytest.mark.parametrize("rows,width,real_vocab,dtype,z_loss", [(13, 77, None, torch.float32, 0.0),
                                                               (11, 300, 290, torch.bfloat16, 0.0),
                                                               (7, 33, 30, torch.float32, 1e-3),
                                                               (9, 129, 100, torch.float16, 1e-4)])
def test_one_pass_torch_phase_matches_the_two_phases(rows, width, real_vocab, dtype, z_loss):
    """cross_entropy.torch_loss_grad_ (one rank: stats, combine and gradient in one pass) gives the
    numbers of the two torch phases with combine_stats, padding, ignored rows and z-loss included."""
    logits, targets, dy = _ce_inputs(rows, width, dtype, real_vocab)
    valid = real_vocab or width
    one = logits.clone()
    loss, lse = cross_entropy.torch_loss_grad_(one, targets, dy.float(), z_loss, 0, valid, -100)
    two = logits.clone()
    stats = cross_entropy._torch_stats(two, targets, 0, valid, -100)
    loss_ref, lse_ref = cross_entropy.combine_stats(stats, targets, None, 0, valid, -100, z_loss)
    cross_entropy._torch_grad_(two, targets, lse_ref, dy.float().masked_fill(targets == -100, 0.0), z_loss, 0, valid)
    torch.testing.assert_close(loss, loss_ref, **TOL)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-6, atol=1e-5)  # both torch: only the order of the sums
    close(one, two, dtype)
    assert loss[1] == 0 and (one[1] == 0).all() and (one[:, valid:] == 0).all()


def test_one_pass_torch_phase_extreme_logits():
    logits = torch.full((4, 40), -1e4, device=DEVICE)
    logits[:, 7] = 1e4
    targets = torch.tensor([7, 0, -100, 39], device=DEVICE)
    grad = logits.clone()
    loss, _ = cross_entropy.torch_loss_grad_(grad, targets, torch.ones(4, device=DEVICE), 0.0, 0, 40, -100)
    torch.testing.assert_close(loss, torch.tensor([0.0, 2e4, 0.0, 2e4], device=DEVICE))
    assert grad[0].abs().sum() == 0 and grad[1, 7] == 1 and grad[1, 0] == -1 and grad[2].abs().sum() == 0


def test_default_chunks_are_equal_and_not_too_small():
    cpu = torch.device("cpu")
    rows = linear_cross_entropy.default_chunk_rows(2048, 50304, torch.bfloat16, cpu)
    assert rows == linear_cross_entropy.MIN_ROWS["cpu"] and 2048 % rows == 0
    assert linear_cross_entropy.default_chunk_rows(1000, 50304, torch.bfloat16, cpu) == 250  # 4 equal chunks
    assert linear_cross_entropy.default_chunk_rows(100, 50304, torch.bfloat16, cpu) == 100  # one chunk
    assert linear_cross_entropy.default_chunk_rows(5000, 256, torch.float32, cpu) == 5000  # 16 MiB of logits
    assert linear_cross_entropy.default_chunk_rows(0, 256, torch.float32, cpu) == 1


def _per_token_run(x, weight, targets, dy, **kw):
    from megapretrain.model.fused_loss import linear_cross_entropy_per_token

    xl, wl = as_leaf(x), as_leaf(weight)
    loss = linear_cross_entropy_per_token(xl, wl, targets, Group("tp", [0]), 0, 45, **kw)
    loss.backward(dy)
    return loss, xl.grad, wl.grad


@pytest.mark.parametrize("reference", [True, False])
@pytest.mark.parametrize("grads_in_forward", [True, False])
@pytest.mark.parametrize("incoming", ["uniform", "per token"])
def test_per_token_linear_cross_entropy_matches_unfused(reference, grads_in_forward, incoming):
    """model/fused_loss.py, with the gradients made in the forward and scaled (a uniform incoming
    gradient, as the trainer's) or recomputed (any other), against the unfused per-token loss."""
    x, weight, targets, _ = _lce_inputs(torch.float32)
    dy = torch.full((2, 11), 0.3, device=DEVICE) if incoming == "uniform" else torch.rand(2, 11, device=DEVICE)
    kw = dict(z_loss=1e-3, reference=reference, chunk_rows=5, grads_in_forward=grads_in_forward)
    got = _per_token_run(x, weight, targets, dy, **kw)
    xl, wl = as_leaf(x), as_leaf(weight)
    want = cross_entropy.cross_entropy_reference(F.linear(xl, wl), targets, real_vocab=45, z_loss=1e-3)
    want.backward(dy)
    for a, b in zip(got, (want, xl.grad, wl.grad)):
        torch.testing.assert_close(a, b, **TOL)


def test_per_token_backward_recomputes_only_for_a_gradient_that_differs():
    """Logits matmuls in the backward: none when the incoming gradient is the same for every kept
    token (the forward's gradients are scaled), one per chunk otherwise."""
    x, weight, targets, _ = _lce_inputs(torch.float32)
    calls = []
    real_mm = torch.mm

    def spy(a, b, out=None):
        calls.append(b.shape[-1] == weight.shape[0])  # (chunk, h) @ (h, v): a chunk's logits
        return real_mm(a, b, out=out)

    from megapretrain.model.fused_loss import linear_cross_entropy_per_token

    for dy, expected in ((torch.full((2, 11), 0.3), 0), (torch.rand(2, 11), 5)):  # 22 tokens, chunks of 5
        dy = dy.to(DEVICE)
        dy[0, 3] = 7.0  # an ignored token's incoming gradient does not count
        xl, wl = as_leaf(x), as_leaf(weight)
        loss = linear_cross_entropy_per_token(xl, wl, targets, Group("tp", [0]), 0, 45, reference=True,
                                              chunk_rows=5, grads_in_forward=True)
        calls.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "mm", spy)
            loss.backward(dy)
        assert sum(calls) == expected


def test_per_token_weight_gradient_is_the_buffer_summed_into():
    """d loss / d weight is summed in place into the tensor autograd hands to the weight: no second
    weight-sized buffer, and no copy when it becomes weight.grad."""
    from megapretrain.model.fused_loss import linear_cross_entropy_per_token

    x, weight, targets, _ = _lce_inputs(torch.bfloat16)
    sums = []
    real_add = linear_cross_entropy._add_product

    def spy(*args):
        out = real_add(*args)
        sums.append(out.data_ptr())  # not the tensor: a reference held here would make autograd copy it
        return out

    xl, wl = as_leaf(x), as_leaf(weight)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(linear_cross_entropy, "_add_product", spy)
        linear_cross_entropy_per_token(xl, wl, targets, Group("tp", [0]), 0, 45, reference=True,
                                       chunk_rows=6).sum().backward()
    assert len(sums) == 4 and len(set(sums)) == 1  # 22 tokens: 4 chunks, one sum
    assert wl.grad.data_ptr() == sums[0]


def test_per_token_bf16_matches_the_one_buffer_loss():
    """bf16, default chunks and path: the model's one-logits-buffer loss within bf16 rounding."""
    from megapretrain.parallel.cross_entropy import vocab_parallel_linear_cross_entropy

    x, weight, targets, _ = _lce_inputs(torch.bfloat16, seed=10)
    dy = torch.full((2, 11), 1 / 22, device=DEVICE)
    loss, dx, dw = _per_token_run(x, weight, targets, dy, reference=True)
    xl, wl = as_leaf(x), as_leaf(weight)
    want = vocab_parallel_linear_cross_entropy(xl, wl, targets, Group("tp", [0]), 0, 45)
    want.backward(dy)
    assert dx.dtype == dw.dtype == torch.bfloat16
    torch.testing.assert_close(loss, want, **BF16_LOSS_TOL)
    torch.testing.assert_close(dx, xl.grad, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(dw, wl.grad, rtol=2e-2, atol=2e-3)


def test_a_tp_rank_of_padding_columns_alone_gets_a_zero_gradient():
    """A small vocabulary over many tp ranks leaves the last rank only padding columns (valid 0):
    its logits' gradient is zero, and the rank runs like the others (no out-of-range target)."""
    logits = torch.randn(6, 8)
    targets = torch.tensor([0, 3, 5, 7, 2, 1])  # every target on other ranks (vocab_start 8)
    lse = torch.logsumexp(torch.randn(6, 16), -1)
    cross_entropy._torch_grad_(logits, targets, lse, torch.ones(6), 0.0, 8, 0)
    assert torch.equal(logits, torch.zeros(6, 8))
