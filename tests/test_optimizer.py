"""The mixed-precision AdamW and its bucketed buffers, in one process (the multi-rank behaviour is
in test_data_parallel.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megapretrain.checkpoint.manager import restore_optimizer
from megapretrain.config import OptimConfig
from megapretrain.optim.optimizer import LossScaler, MixedPrecisionAdamW
from megapretrain.parallel.data import ALIGN
from megapretrain.parallel.specs import plain_specs
from megapretrain.parallel.state import ParallelState

from helpers import build, make_tokens, optimizer_checkpoint, tiny_args


def _loss(model, tokens):
    return model(tokens[:, :-1], tokens[:, 1:]).mean()


def _train_beside_torch_adamw(ours, opt, ref, tokens, cfg: OptimConfig, steps: int = 3) -> None:
    """``steps`` steps of ``opt`` on ``ours`` and, from the same tokens, of torch.optim.AdamW (fused)
    on fp32 copies of ``ref``'s parameters (matrices decay, vectors do not), copied back into
    ``ref`` after each step; with ``cfg.moments_dtype`` bf16 torch's moments are rounded to bf16
    after each step."""
    masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in ref.named_parameters()}
    groups = [{"params": [m for m in masters.values() if m.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [m for m in masters.values() if m.ndim < 2], "weight_decay": 0.0}]
    torch_opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)
    for _ in range(steps):
        opt.zero_grad()
        with opt.grad_sync(last=True):
            _loss(ours, tokens).backward()
        opt.reduce_grads()
        opt.step(cfg.lr)

        _loss(ref, tokens).backward()
        for n, p in ref.named_parameters():
            masters[n].grad = p.grad.float()
            p.grad = None
        torch_opt.step()
        if cfg.moments_dtype == "bf16":
            for state in torch_opt.state.values():
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key].copy_(state[key].bfloat16())
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(masters[n])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_matches_torch_adamw_exactly(precision):
    """Same grads in, same weights out, bit for bit: torch.optim.AdamW (fused) on fp32 copies vs ours."""
    ps, tokens = ParallelState(), make_tokens(batch=4, seq=16)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    ours = build(ps, tiny_args(), dtype=dtype)
    ref = build(ps, tiny_args(), dtype=dtype)
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0)
    opt = MixedPrecisionAdamW(list(ours.named_parameters()), ours.param_specs(), cfg, precision, ps,
                              bucket_size_mb=0.01)
    _train_beside_torch_adamw(ours, opt, ref, tokens, cfg)
    for (n, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    assert opt.step_count == 3


def test_buffer_layout():
    """Params in reverse order, aligned views into one buffer per dtype; buckets padded to dp."""
    ps = ParallelState()
    model = build(ps, tiny_args())
    named = list(model.named_parameters())
    opt = MixedPrecisionAdamW(named, model.param_specs(), OptimConfig(), "fp32", ps, bucket_size_mb=0.02)
    buffers = opt.buffers
    assert len(buffers.param_buffers) == len(buffers.grad_buffers) == 1
    order = [p for b in buffers.buckets for p in b.params]
    assert [id(p) for p in order] == [id(p) for _, p in reversed(named)]
    base = buffers.param_buffers[0].data_ptr()
    grad_base = buffers.grad_buffers[0].data_ptr()
    start = 0
    for b in buffers.buckets[:-1]:
        assert b.numel * 4 >= 0.02 * 2**20 and b.numel % ALIGN == 0
    for b in buffers.buckets:
        for p, off in zip(b.params, b.offsets):
            assert off % ALIGN == 0
            assert p.data_ptr() == base + (start + off) * p.element_size()
            assert p.main_grad.data_ptr() == grad_base + (start + off) * 4
        start += b.numel
    assert start == buffers.param_buffers[0].numel()
    # the values survived the move into the buffer
    fresh = dict(build(ps, tiny_args()).named_parameters())
    assert all(torch.equal(p, fresh[n]) for n, p in named)


def test_one_buffer_per_dtype_and_unused_params():
    ps = ParallelState()
    model = nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.Linear(8, 8).to(torch.bfloat16),
                           "unused": nn.Linear(8, 8)})
    opt = MixedPrecisionAdamW(list(model.named_parameters()), plain_specs(model.named_parameters()), OptimConfig(),
                              "bf16", ps)
    assert sorted(str(b.dtype) for b in opt.buffers.param_buffers) == ["torch.bfloat16", "torch.float32"]
    assert all(b.dtype == torch.float32 for b in opt.buffers.grad_buffers)
    x = torch.randn(4, 8)
    with opt.grad_sync(last=True):
        (model["a"](x).sum() + model["b"](x.bfloat16()).float().sum()).backward()
    opt.reduce_grads()  # "unused" got no grad: its bucket is still completed
    assert not model["unused"].weight.main_grad.any()
    assert model["a"].weight.main_grad.abs().sum() > 0
    before = model["unused"].weight.detach().clone()
    opt.step(1e-2)
    assert torch.equal(model["unused"].weight, before * (1 - 1e-2 * 0.1))  # weight decay only


def test_grad_after_reduction_is_an_error():
    ps = ParallelState()
    model = nn.Linear(4, 4)
    opt = MixedPrecisionAdamW(list(model.named_parameters()), plain_specs(model.named_parameters()), OptimConfig(),
                              "fp32", ps)
    with opt.grad_sync(last=True):
        model(torch.randn(2, 4)).sum().backward()
    opt.reduce_grads()
    with pytest.raises(RuntimeError, match="received a gradient after its bucket"):
        model(torch.randn(2, 4)).sum().backward()


def test_accumulation_equals_one_big_batch():
    ps, tokens = ParallelState(), make_tokens(batch=8, seq=16)
    results = []
    for micro in (1, 2, 4):
        model = build(ps, tiny_args())
        opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(), OptimConfig(eps=1e-6), "fp32",
                                  ps,
                                  bucket_size_mb=0.02)
        chunks = tokens.chunk(micro)
        for i, chunk in enumerate(chunks):
            with opt.grad_sync(last=i == micro - 1):
                (model(chunk[:, :-1], chunk[:, 1:]).sum() / (8 * 16)).backward()
        opt.reduce_grads()
        opt.step(3e-3)
        results.append(dict(model.named_parameters()))
    for other in results[1:]:
        for n, p in results[0].items():
            torch.testing.assert_close(other[n], p, rtol=1e-4, atol=1e-5, msg=n)


def test_clipping_uses_the_global_norm():
    ps, tokens = ParallelState(), make_tokens(batch=2, seq=16)
    model = build(ps, tiny_args())
    opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(), OptimConfig(clip_grad=1e-3),
                              "fp32", ps,
                              bucket_size_mb=0.02)
    with opt.grad_sync(last=True):
        (_loss(model, tokens) * 100).backward()
    opt.reduce_grads()
    expected = torch.linalg.vector_norm(torch.stack([p.main_grad.norm() for p in model.parameters()])).item()
    norm, skipped = opt.step(1e-3)
    assert not skipped and norm == pytest.approx(expected, rel=1e-5)
    clipped = torch.linalg.vector_norm(torch.stack([p.main_grad.norm() for p in model.parameters()])).item()
    assert clipped == pytest.approx(1e-3, rel=1e-4)


def test_nan_grad_skips_the_step():
    ps, tokens = ParallelState(), make_tokens(batch=2, seq=16)
    model = build(ps, tiny_args())
    opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(), OptimConfig(), "fp32", ps)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with opt.grad_sync(last=True):
        (_loss(model, tokens) * float("nan")).backward()
    opt.reduce_grads()
    norm, skipped = opt.step(1e-2)
    assert skipped and norm == float("inf") and opt.step_count == 0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def _steps(read_at_once: bool, poisoned=(1,)) -> tuple[dict, int]:
    """Four steps, the ``poisoned`` ones with NaN grads, read after each (``step``) or all at the
    end (``step_on_device``, then ``settle`` in order); the weights and Adam's step count."""
    ps, tokens = ParallelState(), make_tokens(batch=2, seq=16)
    model = build(ps, tiny_args())
    opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(), OptimConfig(lr=1e-2), "fp32", ps)
    flags = []
    for i in range(4):
        opt.zero_grad()
        with opt.grad_sync(last=True):
            (_loss(model, tokens) * (float("nan") if i in poisoned else 1.0)).backward()
        opt.reduce_grads()
        if read_at_once:
            opt.step(1e-2)
        else:
            flags.append(opt.step_on_device(1e-2)[1])
    for skipped in flags:
        opt.settle(bool(skipped))
    return {n: p.detach().clone() for n, p in model.named_parameters()}, opt.step_count


def test_steps_read_later_update_as_steps_read_at_once():
    """A skipped step not yet settled leaves Adam's step count (its bias correction) exact on the
    device: the weights after skipped and clean steps read at the end equal those read each step."""
    at_once, count = _steps(True)
    later, later_count = _steps(False)
    assert count == later_count == 3
    assert all(torch.equal(later[n], p) for n, p in at_once.items())


def test_loss_scaler():
    s = LossScaler(initial=8.0, window=2, min_scale=2.0, dynamic=True)
    s.update(found_inf=True)
    assert s.scale == 4.0
    s.update(False)
    s.update(False)
    assert s.scale == 8.0
    s.update(True), s.update(True), s.update(True)
    assert s.scale == 2.0  # never below min_scale
    fixed = LossScaler(initial=1.0)
    fixed.update(True)
    assert fixed.scale == 1.0


def test_fp16_overflow_leaves_parameters_unchanged():
    ps, tokens = ParallelState(), make_tokens(batch=2, seq=16)
    model = build(ps, tiny_args(), dtype=torch.float16)
    opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(),
                              OptimConfig(initial_loss_scale=2.0 ** 40),
                              "fp16", ps)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with opt.grad_sync(last=True):
        (_loss(model, tokens) * opt.scaler.scale).backward()  # overflows fp16 grads for real
    opt.reduce_grads()
    _, skipped = opt.step(1e-2)
    assert skipped and opt.scaler.scale == 2.0 ** 39
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_memory_report_single_process():
    ps = ParallelState()
    model = build(ps, tiny_args(), dtype=torch.bfloat16)
    opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(), OptimConfig(), "bf16", ps)
    mem = opt.memory_report()
    n = mem["padded_numel"]
    assert (mem["params"], mem["grads"], mem["master"], mem["moments"]) == (2 * n, 4 * n, 4 * n, 8 * n)
    assert mem["total"] == 18 * n and mem["numel"] == sum(p.numel() for p in model.parameters())


def test_checkpoint_from_zero0_loads_into_a_sharded_optimizer():
    """Whole tensors (zero=0) can seed fragments (zero ≥ 1): each rank slices what it owns."""
    ps, tokens = ParallelState(), make_tokens(batch=2, seq=16)
    a = build(ps, tiny_args(), dtype=torch.bfloat16)
    opt_a = MixedPrecisionAdamW(list(a.named_parameters()), a.param_specs(), OptimConfig(), "bf16", ps)
    with opt_a.grad_sync(last=True):
        _loss(a, tokens).backward()
    opt_a.reduce_grads()
    opt_a.step(1e-2)
    b = build(ps, tiny_args(), dtype=torch.bfloat16)
    opt_b = MixedPrecisionAdamW(list(b.named_parameters()), b.param_specs(), OptimConfig(), "bf16", ps, zero=1,
                                bucket_size_mb=0.01)
    saved = optimizer_checkpoint(opt_a)
    restore_optimizer(opt_b, saved)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert opt_b.step_count == 1
    fragments = optimizer_checkpoint(opt_b)["model"]
    assert all(set(v) == {"start", "end", "master"} for v in fragments.values())
    with pytest.raises(ValueError, match="has shape"):
        other = {**saved["model"], "norm.weight": torch.zeros(3)}
        restore_optimizer(opt_b, {**saved, "model": other})


@pytest.mark.parametrize("clip", [0.0, 0.05], ids=["no_clip", "clipped"])
def test_a_device_grad_factor_scales_the_grads_before_the_norm_and_clipping(clip):
    """``step_on_device(lr, grad_factor)`` (the trainer's every / kept tokens under
    data.eod_mask_loss) steps as if the backward had brought the grads times the factor: the same
    norm, the same grads once scaled and clipped, and so the same weights, to fp32 rounding."""
    ps, tokens = ParallelState(), make_tokens(batch=4, seq=16)
    # eps 1e-6: with |grad| ~ eps Adam's update hinges on the grad's last bits (test_data_parallel.py)
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=clip, eps=1e-6)
    every, kept = 64, 37.0  # tokens of the batch, and those a mask would keep
    runs = []
    for factor in (torch.tensor(every / kept, dtype=torch.float64), None):
        model = build(ps, tiny_args())
        opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(), cfg, "fp32", ps,
                                  bucket_size_mb=0.01)
        with opt.grad_sync(last=True):
            (model(tokens[:, :-1], tokens[:, 1:]).sum() / (every if factor is not None else kept)).backward()
        opt.reduce_grads()
        norm, skipped = opt.step_on_device(1e-2, factor)
        assert not bool(skipped)
        runs.append((float(norm), {n: (p.main_grad.clone(), p.detach().clone()) for n, p in model.named_parameters()}))
    (norm, params), (ref_norm, ref_params) = runs
    assert norm == pytest.approx(ref_norm, rel=1e-6)
    if clip:
        assert ref_norm > clip  # the clipping was in play
    for n, (grad, param) in params.items():
        ref_grad, ref_param = ref_params[n]  # the main grads after step_on_device: scaled and clipped
        # the backward ran at another scale: each tensor's grads agree to fp32 rounding as a whole
        # (single elements summed with cancellation differ more, relatively)
        assert (grad - ref_grad).norm() <= 1e-5 * ref_grad.norm(), n
        # the weights AdamW made of them (its first update, lr·g/(|g|+eps), turns on each grad's
        # sign, so where a grad is near 0 another rounding flips it: compared where it is not)
        clear = ref_grad.abs() > 1e-3 * ref_grad.abs().max()
        torch.testing.assert_close(param[clear], ref_param[clear], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("zero", [0, 1])
def test_bf16_moments_match_torch_adamw_with_rounded_state(zero):
    """optim.moments_dtype bf16: torch.optim.AdamW (fused, fp32) whose moments are rounded to bf16
    after every step, bit for bit; the moments take half the bytes, and a checkpoint resumes them."""
    ps, tokens = ParallelState(), make_tokens(batch=4, seq=16)
    ours, ref = build(ps, tiny_args()), build(ps, tiny_args())
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0, moments_dtype="bf16")
    opt = MixedPrecisionAdamW(list(ours.named_parameters()), ours.param_specs(), cfg, "fp32", ps,
                              zero=zero, bucket_size_mb=0.01)
    _train_beside_torch_adamw(ours, opt, ref, tokens, cfg)
    for (n, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    report = opt.memory_report()
    assert report["moments"] == 2 * 2 * sum(s.exp_avg.numel() for s in opt.shards)
    assert all(s.exp_avg.dtype == torch.bfloat16 for s in opt.shards)
    again = build(ps, tiny_args(), seed=3)
    opt_again = MixedPrecisionAdamW(list(again.named_parameters()), again.param_specs(), cfg,
                                    "fp32", ps, zero=zero, bucket_size_mb=0.01)
    restore_optimizer(opt_again, optimizer_checkpoint(opt))
    for o, model in ((opt, ours), (opt_again, again)):
        o.zero_grad()
        with o.grad_sync(last=True):
            _loss(model, tokens).backward()
        o.reduce_grads()
        o.step(1e-2)
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), again.parameters()))


@pytest.mark.parametrize("offload", [False, True])
def test_impl_auto_takes_the_same_adamw_with_bf16_moments(offload):
    """optim.impl auto resolves by the device alone, whatever optim.moments_dtype: torch's AdamW on
    CPU (where the Triton one runs only when named, under TRITON_INTERPRET), the Triton AdamW with
    its weight-decay mask on CUDA (simulated: the choice only) where Triton is installed, unless
    the state is offloaded (the host steps, with torch's)."""
    import contextlib
    import importlib.util

    from megapretrain.kernels.dispatch import simulated_device

    ps = ParallelState()
    for device in ("cpu", "cuda"):
        impls = {}
        for moments in ("fp32", "bf16"):
            with simulated_device(device) if device == "cuda" else contextlib.nullcontext():
                model = build(ps, tiny_args())
                opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(),
                                          OptimConfig(moments_dtype=moments, offload=offload), "fp32",
                                          ps, bucket_size_mb=0.01)
            impls[moments] = opt.impl
            assert all((s.decay_mask is not None) == (opt.impl == "triton") for s in opt.shards)
        triton = device == "cuda" and not offload and importlib.util.find_spec("triton") is not None
        assert impls == dict.fromkeys(("fp32", "bf16"), "triton" if triton else "torch"), device


def test_bf16_moments_refuse_apex():
    """apex's Adam keeps fp32 moments: refused in one line; the Triton AdamW takes bf16 ones
    (tests/test_kernels.py)."""
    from megapretrain.errors import ConfigError
    from megapretrain.optim.optimizer import check_optim

    with pytest.raises(ConfigError, match="optim.moments_dtype=bf16.*not optim.impl=apex"):
        check_optim(OptimConfig(moments_dtype="bf16", impl="apex"))
    check_optim(OptimConfig(moments_dtype="bf16", impl="triton"))
