"""Muon (optim.optimizer muon): one process against torch.optim.Muon + torch.optim.AdamW, every
layout against one process, and its state in checkpoints."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megapretrain.checkpoint.manager import restore_optimizer
from megapretrain.config import OptimConfig
from megapretrain.errors import CheckpointError, ConfigError
from megapretrain.optim.muon import newton_schulz
from megapretrain.optim.optimizer import MixedPrecisionAdamW, check_optim
from megapretrain.parallel.state import ParallelState

from helpers import build, make_tokens, optimizer_checkpoint, tiny_args

NEOX_ARGS = dict(family="gpt_neox", mlp="gelu", num_kv_heads=4, num_heads=8, rotary_pct=0.5,
                 ffn_hidden_size=256)
MUON = dict(optimizer="muon", lr=1e-2, muon_lr=2e-2, weight_decay=0.1, muon_weight_decay=0.05,
            clip_grad=0.0)


def _loss(model, tokens):
    return model(tokens[:, :-1], tokens[:, 1:]).mean()


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (32, 32)])
def test_newton_schulz_is_torchs(shape):
    from torch.optim._muon import _zeropower_via_newtonschulz
    u = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    ref = _zeropower_via_newtonschulz(u, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert torch.equal(newton_schulz(u, 5), ref)


def _qkv_parts(weight, group_rows):
    """Split GPT-NeoX's fused QKV (rows per kv head: its queries, its key, its value) into the q,
    k and v matrices (independently of the optimizer's own split)."""
    q_rows, d = group_rows
    groups = weight.shape[0] // (q_rows + 2 * d)
    g = weight.reshape(groups, q_rows + 2 * d, -1)
    return [g[:, :q_rows].reshape(-1, weight.shape[1]),
            g[:, q_rows:q_rows + d].reshape(-1, weight.shape[1]),
            g[:, q_rows + d:].reshape(-1, weight.shape[1])]


def _join_qkv(parts, group_rows):
    q_rows, d = group_rows
    groups = parts[1].shape[0] // d
    q, k, v = (p.reshape(groups, -1, p.shape[1]) for p in parts)
    return torch.cat([q, k, v], dim=1).reshape(-1, q.shape[2])


class Reference:
    """torch.optim.Muon on every logical matrix of the decoder layers (a fused QKV split into its
    q, k and v) and torch.optim.AdamW (fused) on the rest, over fp32 copies of ``model``'s
    weights; clipping by the global norm as the trainer does."""

    def __init__(self, model, cfg: OptimConfig, group_rows=None):
        self.model, self.cfg, self.group_rows = model, cfg, group_rows
        self.masters = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        self.parts = {}  # name -> the logical matrices (leaf tensors) Muon steps
        for n, w in self.masters.items():
            if n.startswith("layers.") and w.ndim == 2:
                split = _qkv_parts(w, group_rows) if "qkv_proj" in n else [w]
                self.parts[n] = [p.clone().requires_grad_(True) for p in split]
        adam = {n: w.requires_grad_(True) for n, w in self.masters.items() if n not in self.parts}
        self.adam = torch.optim.AdamW(
            [{"params": [w for w in adam.values() if w.ndim >= 2],
              "weight_decay": cfg.weight_decay},
             {"params": [w for w in adam.values() if w.ndim < 2], "weight_decay": 0.0}],
            lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)
        self.muon = torch.optim.Muon([p for ps in self.parts.values() for p in ps], lr=cfg.muon_lr,
                                     weight_decay=cfg.muon_weight_decay,
                                     momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                                     ns_steps=cfg.muon_ns_steps, adjust_lr_fn=cfg.muon_adjust_lr)

    def step(self, tokens, scale: float = 1.0, norm: float | None = None) -> float:
        """One step at the schedule's factor ``scale`` of both learning rates; returns the global
        grad norm. ``norm``: clip by this one (equal to ours within rounding: checked by the
        caller), so that the clipped grads are the same bits."""
        _loss(self.model, tokens).backward()
        grads = {n: p.grad.float() for n, p in self.model.named_parameters()}
        for p in self.model.parameters():
            p.grad = None
        own = torch.stack([g.double().norm() for g in grads.values()]).norm()
        norm = own if norm is None else torch.tensor(norm, dtype=torch.float64)
        if self.cfg.clip_grad > 0:
            if norm > self.cfg.clip_grad:
                coef = (self.cfg.clip_grad / (norm + 1e-6)).float()
                grads = {n: g * coef for n, g in grads.items()}
        for n, g in grads.items():
            if n in self.parts:
                split = _qkv_parts(g, self.group_rows) if "qkv_proj" in n else [g]
                for p, pg in zip(self.parts[n], split):
                    p.grad = pg
            else:
                self.masters[n].grad = g
        for opt, lr in ((self.adam, self.cfg.lr), (self.muon, self.cfg.muon_lr)):
            for group in opt.param_groups:
                group["lr"] = lr * scale
            opt.step()
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if n in self.parts:
                    ps = [q.detach() for q in self.parts[n]]
                    p.copy_(_join_qkv(ps, self.group_rows) if "qkv_proj" in n else ps[0])
                else:
                    p.copy_(self.masters[n])
        return float(own)


def _ours(model, cfg, ps=None, **kw):
    ps = ps or ParallelState()
    return MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(), cfg,
                               "bf16" if next(model.parameters()).dtype == torch.bfloat16 else "fp32",
                               ps, bucket_size_mb=0.01, **kw)


def _our_step(model, opt, tokens, lr):
    opt.zero_grad()
    with opt.grad_sync(last=True):
        _loss(model, tokens).backward()
    opt.reduce_grads()
    return opt.step(lr)


CASES = {
    "llama_fp32": (dict(), {}, torch.float32),
    "llama_bf16": (dict(), {}, torch.bfloat16),
    "llama_match_rms_no_nesterov": (dict(), dict(muon_adjust_lr="match_rms_adamw",
                                                 muon_nesterov=False, muon_momentum=0.9,
                                                 muon_ns_steps=3), torch.float32),
    "gpt_neox_fused_qkv": (NEOX_ARGS, {}, torch.float32),
    "llama_clipped": (dict(), dict(clip_grad=0.05), torch.float32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_process_equals_torch_muon_and_adamw(case):
    """Six steps under a changing learning rate: the same weights as torch.optim.Muon on each
    logical matrix + torch.optim.AdamW on the rest, bit for bit (clipped: by our global norm, which
    equals the reference's within rounding — NS in bf16 turns any rounding difference of its input
    into differences of bf16 ulps)."""
    model_kw, opt_kw, dtype = CASES[case]
    cfg = OptimConfig(**{**MUON, **opt_kw})
    ps, tokens = ParallelState(), make_tokens(batch=4, seq=16)
    ours, ref_model = build(ps, tiny_args(**model_kw), dtype=dtype), \
        build(ps, tiny_args(**model_kw), dtype=dtype)
    head = 64 // 8
    group_rows = ((8 // 4) * head, head)
    opt = _ours(ours, cfg)
    ref = Reference(ref_model, cfg, group_rows)
    assert len(opt.muon.momentum) == 2 * (7 if not model_kw else 4)  # every decoder matrix
    for step, scale in enumerate((0.5, 1.0, 1.0, 0.8, 0.6, 0.3)):
        norm, _ = _our_step(ours, opt, tokens, cfg.lr * scale)
        assert ref.step(tokens, scale, norm) == pytest.approx(norm, rel=1e-6)
        for (n, p), q in zip(ours.named_parameters(), ref_model.parameters()):
            assert torch.equal(p, q), f"{n} differs at step {step}"


def test_a_nan_step_changes_nothing():
    ps, tokens = ParallelState(), make_tokens(batch=2, seq=16)
    model = build(ps, tiny_args())
    opt = _ours(model, OptimConfig(**MUON))
    _our_step(model, opt, tokens, 1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    momentum = {n: m.clone() for n, m in opt.muon.momentum.items()}
    opt.zero_grad()
    with opt.grad_sync(last=True):
        (_loss(model, tokens) * float("nan")).backward()
    opt.reduce_grads()
    norm, skipped = opt.step(1e-2)
    assert skipped and opt.step_count == 1
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(torch.equal(m, momentum[n]) for n, m in opt.muon.momentum.items())


def test_muon_state_is_one_momentum_per_matrix():
    """Muon's matrices hold one fp32 momentum, AdamW's parameters two moments: the memory report
    counts exactly that."""
    ps = ParallelState()
    model = build(ps, tiny_args())
    specs = model.param_specs()
    muon = sum(s.numel for n, s in specs.items() if s.layer is not None and len(s.shape) == 2)
    adam = sum(p.numel() for p in model.parameters()) - muon
    report = _ours(model, OptimConfig(**MUON)).memory_report()
    assert report["moments"] == 4 * (muon + 2 * adam)


@pytest.mark.parametrize("zero, offload, resume_offload", [(0, False, False), (1, False, False),
                                                          (1, True, True), (0, True, False)])
def test_checkpoint_resumes_bitwise(zero, offload, resume_offload):
    """Saved after 2 steps and restored into a fresh optimizer: the next steps equal those of the
    optimizer that went on — with optim.offload (the state in host memory) too, and across it."""
    ps, tokens = ParallelState(), make_tokens(batch=2, seq=16)
    cfg = OptimConfig(**MUON, offload=offload)
    a = build(ps, tiny_args())
    opt_a = _ours(a, cfg, zero=zero)
    for _ in range(2):
        _our_step(a, opt_a, tokens, 1e-2)
    saved = optimizer_checkpoint(opt_a)
    assert any("momentum" in v for v in saved["optimizer"]["params"].values())
    b = build(ps, tiny_args(), seed=99)
    opt_b = _ours(b, dataclasses.replace(cfg, offload=resume_offload), zero=zero)
    restore_optimizer(opt_b, saved)
    for _ in range(2):
        _our_step(a, opt_a, tokens, 1e-2)
        _our_step(b, opt_b, tokens, 1e-2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_switching_optimizer_at_a_resume_is_refused():
    ps, tokens = ParallelState(), make_tokens(batch=2, seq=16)
    for saved_with, loaded_with in (("adamw", "muon"), ("muon", "adamw")):
        a = build(ps, tiny_args())
        opt_a = _ours(a, OptimConfig(**{**MUON, "optimizer": saved_with}))
        _our_step(a, opt_a, tokens, 1e-2)
        b = build(ps, tiny_args())
        opt_b = _ours(b, OptimConfig(**{**MUON, "optimizer": loaded_with}))
        with pytest.raises(CheckpointError, match=f"optim.optimizer={saved_with}.*finetune"):
            restore_optimizer(opt_b, optimizer_checkpoint(opt_a))
        restore_optimizer(opt_b, optimizer_checkpoint(opt_a), moments=False)  # finetune: weights


@pytest.mark.parametrize("bad, match", [(dict(impl="triton"), "optim.impl=triton"),
                                        (dict(impl="apex", offload=True), "optim.impl=apex")])
def test_muon_refuses_what_it_does_not_support(bad, match):
    cfg = dataclasses.replace(OptimConfig(optimizer="muon"), **bad)
    with pytest.raises(ConfigError, match=match):
        check_optim(cfg)
    check_optim(OptimConfig(optimizer="muon", offload=True))  # the state in host memory: taken


@pytest.mark.parametrize("case, zero", [("llama_bf16", 1), ("gpt_neox_fused_qkv", 0),
                                        ("llama_clipped", 1)])
def test_offload_steps_as_on_the_device(case, zero):
    """optim.offload: Muon's momentum and AdamW's moments in host memory, stepped there, NS where
    the matrices are — on CPU the same operations on the same values, so four steps give the
    weights, masters and momenta of Muon without offload, bit for bit."""
    model_kw, opt_kw, dtype = CASES[case]
    ps, tokens = ParallelState(), make_tokens(batch=2, seq=16)
    runs = []
    for offload in (False, True):
        model = build(ps, tiny_args(**model_kw), dtype=dtype)
        opt = _ours(model, OptimConfig(**{**MUON, **opt_kw}, offload=offload), zero=zero)
        for scale in (1.0, 0.8, 0.6, 0.3):
            _our_step(model, opt, tokens, 1e-2 * scale)
        runs.append((model, opt))
    (model, opt), (off_model, off_opt) = runs
    assert off_opt.offload and off_opt.memory_report()["offload"]
    # offloaded, fp32 parameters get a master of their own (the host's copy)
    assert all(s.master is not s.param_shard for s in off_opt.shards)
    for (n, p), q in zip(model.named_parameters(), off_model.parameters()):
        assert torch.equal(p, q), n
    for s, off in zip(opt.shards, off_opt.shards):
        assert torch.equal(s.master, off.master)
        assert torch.equal(s.exp_avg, off.exp_avg) and torch.equal(s.exp_avg_sq, off.exp_avg_sq)
    assert opt.muon.momentum.keys() == off_opt.muon.momentum.keys()
    for name, m in opt.muon.momentum.items():
        assert torch.equal(m, off_opt.muon.momentum[name]), name


# -- every layout against one process (the trainer, tests/helpers.py's BASE run) -----------------

# NS in fp32: in bf16 the last fp32 bit of a reduced gradient (summed in another order) can flip a
# rounding that the iteration amplifies (newton_schulz); the layouts' own numbers in bf16 are
# checked bit for bit against one process by test_layouts_step_as_one_process_bitwise
MUON_FLAGS = ("--optim.optimizer", "muon", "--optim.muon_lr", "0.02", "--optim.muon_ns_precision",
              "fp32")
NEOX = ("--model.family", "gpt_neox", "--model.mlp", "gelu", "--model.num_kv_heads", "4",
        "--model.rotary_pct", "0.5")
LAYOUTS = {
    "tp2_sp": (2, ("--parallel.tp", "2", "--parallel.sequence_parallel", "true"), ()),
    "dp2": (2, (), ()),
    "dp2_zero1": (2, ("--parallel.zero", "1"), ()),
    "dp2_zero2": (2, ("--parallel.zero", "2"), ()),
    "dp2_zero3": (2, ("--parallel.zero", "3"), ()),
    "dp2_zero3_offload": (2, ("--parallel.zero", "3", "--optim.offload", "true"), ()),
    "pp2": (2, ("--parallel.pp", "2"), ()),
    "cp2": (2, ("--parallel.cp", "2"), ()),
    "gpt_neox_tp2": (2, ("--parallel.tp", "2"), NEOX),
    "gpt_neox_dp2_zero1": (2, ("--parallel.zero", "1"), NEOX),
    "tp2_dp2_zero1": (4, ("--parallel.tp", "2", "--parallel.zero", "1"), NEOX),
    "dp4_zero3_shard2": (4, ("--parallel.zero", "3", "--parallel.zero_shard_size", "2"), ()),
    "tp2_pp2_dp2_zero1": (8, ("--parallel.tp", "2", "--parallel.pp", "2", "--parallel.zero", "1",
                              "--parallel.sequence_parallel", "true"), ()),
}
# dp2_zero3_offload: test_zero_stages_step_as_one_process_bitwise holds offload to one process too
# tp2_dp2_zero1 and dp4_zero3_shard2 run in CI: the owners' all-to-alls with tp, and over shard
# groups that are not the whole of dp (hybrid shards)
SLOW = ("tp2_pp2_dp2_zero1", "dp2_zero3_offload")


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] * (n in SLOW))
                                  for n in LAYOUTS])
def test_layout_matches_single_process(name, corpus, tmp_path, tmp_path_factory):
    """The trainer with optim.optimizer muon under a layout: the losses, grad norms and final
    parameters of one process."""
    from distributed import run_distributed
    from helpers import check, reference_for, train_layout

    world, layout, model = LAYOUTS[name]
    reference = reference_for((*MUON_FLAGS, *model), corpus, tmp_path_factory)
    results = run_distributed(train_layout, world, str(tmp_path), corpus,
                              [*MUON_FLAGS, *model, *layout], timeout=300)
    check(reference, results)



# -- ZeRO's assembly of whole matrices, bit for bit (NS in bf16, torch's) --------------------------

def _dp_runs(rank, world):
    """Three Muon steps under each ZeRO stage (small buckets: shards cut matrices anywhere), every
    dp rank on the same tokens with the loss over ``world``: the reduced gradients are then the
    single process's bit for bit, and so must be the weights. AdamW's parameters are frozen
    (torch's CPU AdamW rounds an element by where it falls in a vector: not bitwise across shard
    boundaries, and NS in bf16 would amplify that)."""
    from helpers import full_params

    ps, tokens = ParallelState(), make_tokens(batch=2, seq=16)
    out = {}
    for name, model_kw, zero, offload in (("llama", {}, 0, False), ("llama", {}, 1, False),
                                          ("llama", {}, 2, False), ("llama", {}, 3, False),
                                          ("gpt_neox", NEOX_ARGS, 1, False),
                                          ("llama", {}, 1, True), ("llama", {}, 3, True)):
        if offload and world == 1:
            continue  # (the reference: one process without offload)
        model = build(ps, tiny_args(**model_kw))
        for n, p in model.named_parameters():
            p.requires_grad_(n.startswith("layers.") and p.ndim == 2)
        opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(),
                                  OptimConfig(**MUON, offload=offload), "fp32", ps,
                                  zero=zero, bucket_size_mb=0.01)
        opt.hook_models([model])
        for _ in range(3):
            opt.zero_grad()
            with opt.grad_sync(last=True):
                (_loss(model, tokens) / world).backward()
            opt.reduce_grads()
            opt.step(1e-2)
        opt.buffers.wait_params()  # zero 1, 2: the post-step all-gathers
        with full_params(opt):
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[name, zero, offload] = params, sorted(set(opt.muon.owner.values()))
    return out


def test_zero_stages_step_as_one_process_bitwise():
    """Every ZeRO stage on 2 ranks, and ZeRO 1 and 3 with optim.offload (each rank's momenta and
    masters in host memory, the updates gathered and scattered where the matrices are), as one
    process without offload: the same weights, bit for bit."""
    from distributed import run_distributed

    single = _dp_runs(0, 1)
    results = run_distributed(_dp_runs, 2, timeout=300)
    for key in results[0]:
        ref = single[key[0], key[1], False][0]  # one process, without offload
        for rank, result in enumerate(results):
            params, owners = result[key]
            # zero ≥ 1: the matrices are shared between the two ranks, each NS'd on one of them
            assert owners == ([0, 1] if key[1] >= 1 else []), key
            for n, p in ref.items():
                assert torch.equal(params[n], p), (key, rank, n)


def _muon_events(rank, world):
    """One Muon step under ZeRO-1 (small buckets: several hold matrices, shards cut them
    anywhere), logging in order what the step does with the shard group and the iterations: each
    all-to-all as it is started (with the elements it sends and receives) and as its handle is
    waited for, and each Newton–Schulz call."""
    import math

    import megapretrain.optim.muon as muon

    ps, tokens = ParallelState(), make_tokens(batch=2, seq=16)
    model = build(ps, tiny_args())
    opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(),
                              OptimConfig(**MUON), "fp32", ps, zero=1, bucket_size_mb=0.01)
    opt.hook_models([model])
    opt.zero_grad()
    with opt.grad_sync(last=True):
        _loss(model, tokens).backward()
    opt.reduce_grads()
    events, group, ns = [], ps.dp_shard, muon.newton_schulz

    class Logged:
        def __init__(self, work):
            self.work = work

        def wait(self):
            events.append("wait")
            self.work.wait()

    def exchange(output, tensor, output_sizes, input_sizes):
        events.append(("a2a", sum(input_sizes), sum(output_sizes)))
        return Logged(all_to_all(output, tensor, output_sizes, input_sizes))

    def counted(*args, **kw):
        events.append("ns")
        return ns(*args, **kw)
    step, all_to_all = opt.muon.step, group.all_to_all_async

    def muon_step(*args):
        group.all_to_all_async = exchange
        muon.newton_schulz = counted
        try:
            step(*args)
        finally:
            del group.all_to_all_async
            muon.newton_schulz = ns
    opt.muon.step = muon_step
    opt.step(1e-2)
    held = sum(f.end - f.start for _, frags in opt.muon.work for f in frags)  # this shard's
    owned = sum(math.prod(spec.local_shape) for name, spec in opt.muon.matrices().items()
                if opt.muon.owner[name] == ps.dp_shard.rank)
    return events, len(opt.muon.work), len(opt.muon.groups), held, owned


def test_muon_collectives_run_under_the_iterations():
    """Sharded, each group of buckets' pieces go to their matrices' owners in one all-to-all, all
    started before the first iteration; each group's results start back as soon as its owners
    are done (before the next group's iterations), and none is waited for before the last
    iteration: the collectives run asynchronously, under the iterations. A rank sends each
    element of its shard once, to its owner, and receives the matrices it owns: not every
    matrix, as an all-gather would."""
    from distributed import run_distributed

    for events, buckets, groups, held, owned in run_distributed(_muon_events, 2, timeout=300):
        assert buckets > groups > 1
        flow = [e if isinstance(e, str) else e[0] for e in events if e != "ns"]
        assert flow == ["a2a"] * groups + ["wait", "a2a"] * groups + ["wait"] * groups
        exchanges = [e for e in events if isinstance(e, tuple)]
        gathers, returns = exchanges[:groups], exchanges[groups:]
        assert sum(sent for _, sent, _ in gathers) == held == sum(got for _, _, got in returns)
        assert sum(got for _, _, got in gathers) == owned == sum(sent for _, sent, _ in returns)
        first_wait, last_start = events.index("wait"), \
            max(i for i, e in enumerate(events) if isinstance(e, tuple))
        iterations = [i for i, e in enumerate(events) if e == "ns"]
        assert iterations and first_wait < min(iterations) and max(iterations) < last_start


def test_trainer_resume_is_bitwise(corpus, tmp_path):
    """The trainer with Muon (bf16 iterations): 3 iterations, stop, resume to 6 gives the losses
    and grad norms of 6 straight, bit for bit."""
    from helpers import resume_run

    flags = ["--optim.optimizer", "muon", "--optim.muon_lr", "0.02", "--checkpoint.interval", "3"]
    straight, _ = resume_run(0, 1, str(tmp_path / "straight"), corpus, 6, flags, dropout=0.0)
    resume_run(0, 1, str(tmp_path / "split"), corpus, 3, flags, dropout=0.0)
    rows, resumed = resume_run(0, 1, str(tmp_path / "split"), corpus, 6, flags, dropout=0.0)
    assert resumed == [3]
    assert rows == straight


def test_resume_on_another_layout_carries_the_momentum(corpus, tmp_path):
    """3 iterations on dp=2 with ZeRO-1, resumed on one process to 6: the losses and grad norms of
    6 straight on one process (NS in fp32: across layouts, see MUON_FLAGS) — the resharded momentum
    is the saved one, where starting it from zero would move them."""
    from distributed import run_distributed
    from helpers import resume_run

    flags = [*MUON_FLAGS, "--checkpoint.interval", "3"]
    straight, _ = resume_run(0, 1, str(tmp_path / "straight"), corpus, 6, flags, dropout=0.0)
    split = str(tmp_path / "split")
    run_distributed(resume_run, 2, split, corpus, 3, [*flags, "--parallel.zero", "1"], 0.0,
                    timeout=300)
    rows, resumed = resume_run(0, 1, split, corpus, 6, flags, dropout=0.0)
    assert resumed == [3]
    assert [r[0] for r in rows] == [r[0] for r in straight]
    for (_, loss, norm), (_, ref_loss, ref_norm) in zip(rows, straight):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5)


def test_a_simulated_rank_counts_one_momentum_for_the_matrices():
    """The simulator (fake tensors, one rank of dp=2 with ZeRO-1) measures Muon's state: 4 bytes
    less per decoder-matrix element than AdamW's two moments, over the 2 shards (and the padding
    AdamW's shard-wide moments carry)."""
    from megapretrain.config import load_config
    from megapretrain.simulate.run import simulate_rank

    flags = ["--model.vocab_size", "300", "--model.num_layers", "4", "--model.hidden_size", "64",
             "--model.num_heads", "4", "--model.num_kv_heads", "2", "--model.ffn_hidden_size",
             "128", "--train.seq_length", "64", "--parallel.zero", "1"]
    measured = {opt: simulate_rank(load_config("configs/tiny.yaml", [
        *flags, "--optim.optimizer", opt]), 2, 0, steps=1).breakdown["optimizer"]
        for opt in ("adamw", "muon")}
    matrices = 4 * (64 * 64 * 2 + 32 * 64 * 2 + 3 * 64 * 128)  # q, o, k, v, gate, up, down
    assert measured["adamw"] - measured["muon"] == pytest.approx(4 * matrices / 2, rel=0.05)
