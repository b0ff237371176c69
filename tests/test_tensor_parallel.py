"""Tensor and sequence parallelism compute exactly what one process computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megapretrain.parallel.cross_entropy import vocab_parallel_cross_entropy
from megapretrain.parallel.state import ParallelState

from distributed import run_distributed
from helpers import build, gather_full, make_tokens, tiny_args, train

LAYOUTS = [(sp, rc) for sp in (False, True) for rc in ("none", "selective", "full")]
STEPS = 5


def _reference():
    ps = ParallelState()
    tokens = make_tokens()
    out = {}
    for sp, rc in LAYOUTS:
        model = build(ps, tiny_args(), sequence_parallel=sp, recompute=rc)
        out[(sp, rc)] = train(ps, model, tokens, STEPS)
    return out


def _tp_run(rank, world, layouts):
    ps = ParallelState(tp=world)
    tokens = make_tokens()
    out = {}
    for sp, rc in layouts:
        model = build(ps, tiny_args(), sequence_parallel=sp, recompute=rc)
        losses, grads = train(ps, model, tokens, STEPS)
        out[(sp, rc)] = (losses, grads if rank == 0 else None)
    return out


@pytest.fixture(scope="module")
def reference():
    return _reference()


def _unpad(name: str, t: torch.Tensor, vocab: int) -> torch.Tensor:
    return t[:vocab] if name in ("embed_tokens.weight", "lm_head.weight") else t


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_single_process(tp, reference):
    results = run_distributed(_tp_run, tp, LAYOUTS)
    for layout in LAYOUTS:
        ref_losses, ref_grads = reference[layout]
        for rank_out in results:  # every rank logs the same loss
            losses = rank_out[layout][0]
            assert losses == pytest.approx(ref_losses, rel=1e-5), (tp, layout)
        assert ref_losses[-1] < ref_losses[0]
        grads = results[0][layout][1]
        for name, g in ref_grads.items():
            got = _unpad(name, grads[name], g.shape[0] if "embed" in name or "lm_head" in name else None)
            torch.testing.assert_close(got, _unpad(name, g, g.shape[0]), rtol=1e-4, atol=1e-6,
                                       msg=f"grad {name} tp={tp} {layout}")


def _init_run(rank, world):
    ps = ParallelState(tp=world)
    return gather_full(build(ps, tiny_args()), ps)


@pytest.mark.parametrize("tp", [2, 4])
def test_initialization_is_layout_invariant(tp):
    ref = gather_full(build(ParallelState(), tiny_args()), ParallelState())
    full = run_distributed(_init_run, tp)[0]
    for name, w in ref.items():
        rows = w.shape[0]
        assert torch.equal(full[name][:rows], w), name
        assert not full[name][rows:].any(), f"{name}: vocabulary padding rows must be zero"


def _ce_run(rank, world, logits, targets):
    ps = ParallelState(tp=world)
    shard = logits.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
    rows = shard.shape[-1]
    loss = vocab_parallel_cross_entropy(shard, targets, ps.tp, vocab_start=rank * rows, real_vocab=logits.shape[-1])
    (loss * torch.linspace(0.5, 1.5, loss.numel()).view_as(loss)).sum().backward()
    return loss.detach(), shard.grad


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_cross_entropy_matches_torch(tp):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 64, generator=g) * 4
    logits[0, 0, 7] = 1e4   # extreme values must not overflow
    logits[1, 2, :] = -1e4
    logits[2, 1, 40] = 1e4
    targets = torch.randint(0, 64, (3, 5), generator=g)
    targets[0, 0], targets[2, 1] = 7, 3
    targets[1, 3] = -100     # ignored
    ref_logits = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits.view(-1, 64), targets.view(-1), reduction="none",
                          ignore_index=-100).view(3, 5)
    (ref * torch.linspace(0.5, 1.5, ref.numel()).view_as(ref)).sum().backward()
    if tp == 1:
        results = [_ce_run_single(logits, targets)]
    else:
        results = run_distributed(_ce_run, tp, logits, targets)
    for rank, (loss, grad) in enumerate(results):
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, ref_logits.grad.chunk(tp, dim=-1)[rank], rtol=1e-5, atol=1e-6)


def _ce_run_single(logits, targets):
    ps = ParallelState()
    x = logits.clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(x, targets, ps.tp)
    (loss * torch.linspace(0.5, 1.5, loss.numel()).view_as(loss)).sum().backward()
    return loss.detach(), x.grad


def test_padded_vocabulary_columns_get_no_probability():
    ps = ParallelState()
    logits = torch.zeros(1, 2, 8, requires_grad=True)
    loss = vocab_parallel_cross_entropy(logits, torch.tensor([[0, 1]]), ps.tp, real_vocab=5)
    torch.testing.assert_close(loss, torch.full((1, 2), torch.log(torch.tensor(5.0)).item()))
    loss.sum().backward()
    assert not logits.grad[..., 5:].any()


def _dropout_run(rank, world):
    """With dropout on, recomputation (selective, full) must reproduce the run without it exactly."""
    from megapretrain.parallel.random import RNGTracker

    ps = ParallelState(tp=world)
    tokens = make_tokens()
    out = {}
    for sp in (False, True):
        for rc in ("none", "selective", "full"):
            torch.manual_seed(123)
            args = tiny_args(attention_dropout=0.2, hidden_dropout=0.1)
            model = build(ps, args, sequence_parallel=sp, recompute=rc)
            model.rng = RNGTracker(5, ps.tp_rank)
            for module in model.modules():
                if hasattr(module, "rng"):
                    module.rng = model.rng
            out[(sp, rc)] = train(ps, model, tokens, 3)[0]
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_dropout_is_reproduced_by_recomputation(tp):
    results = [_dropout_run(0, 1)] if tp == 1 else run_distributed(_dropout_run, tp)
    for out in results:
        for sp in (False, True):
            assert out[(sp, "selective")] == out[(sp, "none")]
            assert out[(sp, "full")] == out[(sp, "none")]
    assert results[0][(False, "none")] != _dropout_free_losses()  # dropout really was applied


def _dropout_free_losses():
    ps = ParallelState()
    return train(ps, build(ps, tiny_args()), make_tokens(), 3)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_linear_cross_entropy_matches_unchunked(monkeypatch, dtype):
    """Many small row chunks and a reused logits buffer give what one whole chunk gives."""
    from megapretrain.parallel import cross_entropy as ce

    ps = ParallelState()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 16, generator=g).to(dtype)
    w = (torch.randn(50, 16, generator=g) * 2).to(dtype)
    targets = torch.randint(0, 45, (3, 7), generator=g)
    targets[1, 2] = -100

    def run(pool):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = ce.vocab_parallel_linear_cross_entropy(xi, wi, targets, ps.tp, 0, 45, pool=pool)
        (loss * torch.linspace(0.5, 1.5, loss.numel()).view_as(loss)).sum().backward()
        return loss.detach(), xi.grad, wi.grad

    whole = run(None)
    monkeypatch.setitem(ce.CHUNK_BYTES, "cpu", 4 * 50 * 2)  # two rows per chunk
    pool = ce.BufferPool()
    for _ in range(2):  # the second call reuses the pooled logits buffer
        chunked = run(pool)
        for a, b in zip(chunked, whole):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    ref = torch.nn.functional.cross_entropy((x.float() @ w.float().t())[..., :45].reshape(-1, 45),
                                            targets.reshape(-1), reduction="none").view(3, 7)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(whole[0], ref, rtol=tol, atol=tol)


def _saved_bytes_per_token(rank, world, sequence_parallel):
    """Bytes autograd keeps for backward per token of one decoder layer (bf16, weights excluded)."""
    from megapretrain.parallel.tensor import SavedShards

    ps = ParallelState(tp=world)
    h, f, heads, kv = 256, 704, 8, 2
    args = tiny_args(hidden_size=h, ffn_hidden_size=f, num_heads=heads, num_kv_heads=kv, num_layers=1)
    model = build(ps, args, dtype=torch.bfloat16, sequence_parallel=sequence_parallel)
    saved = model.saved_shards or SavedShards()  # without SP nothing is registered: tensors kept as they are
    b, s = 2, 64
    x = torch.randn(b, s // (world if sequence_parallel else 1), h, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = model._rope(s, x, args.rope(0))
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), cos, sin]}
    seen = {}

    def pack(t):
        packed = saved._pack(t)
        kept = packed if isinstance(packed, torch.Tensor) else packed[0].shard  # a shard stands in
        if kept.untyped_storage().data_ptr() not in skip:
            seen[kept.untyped_storage().data_ptr()] = kept.untyped_storage().nbytes()
        return packed

    with torch.autograd.graph.saved_tensors_hooks(pack, saved._unpack):
        y = model._layer(model.layers["0"], x, cos, sin)
    y.float().square().sum().backward()  # the shards gather again on demand
    from megapretrain.planner import activation_bytes_per_token
    planned = activation_bytes_per_token(args, world, sequence_parallel)
    return sum(seen.values()) / (b * s), planned


def test_sequence_parallel_keeps_a_1_over_tp_share_of_the_activations():
    """With SP every saved activation is a 1/tp share — the column-parallel linears' input included,
    which is gathered again in backward — so a layer keeps (12h + 4·kv·d + 8f)/tp bytes per token,
    as the planner counts (plus norm statistics and logsumexp); without SP the norm and linear
    inputs stay whole."""
    with_sp, planned_sp = run_distributed(_saved_bytes_per_token, 2, True)[0]
    without_sp, planned = run_distributed(_saved_bytes_per_token, 2, False)[0]
    assert with_sp == pytest.approx(planned_sp, rel=0.01)
    assert without_sp == pytest.approx(planned, rel=0.01)
    assert planned_sp == (12 * 256 + 4 * 2 * 32 + 8 * 704) / 2
