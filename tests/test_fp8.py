"""FP8 training (``model.fp8``) below the trainer: the linear against torchao.float8, tensor and
context parallelism against one process at the GEMM level, recomputation, what the FP8 all-gathers
send, the bench, the config's rules, the start-up plan and the planner. The trainer itself (parallel
layouts, checkpoints, compile, 200 steps on real text) is in test_fp8_training.py.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from megapretrain.config import load_config
from megapretrain.errors import ConfigError
from megapretrain.parallel.fp8 import E4M3, RECIPES, FP8Linear, cast
from megapretrain.parallel.state import Group

from distributed import run_distributed
from helpers import fp8_model

ONE = Group("tp", [0])
ROLES = {"tensorwise": None, "rowwise": -1}  # the amax dimension of x and g in the forward/data gradient


# -- the linear -----------------------------------------------------------------------------------


def _inputs(seed: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 20, 96, generator=g) * 3
    x[0, 0] = 0.0  # a zero row: the amax floor
    x[1, 2, 5] = 900.0  # one outlier
    w = torch.randn(160, 96, generator=g) * 0.02
    grad = torch.randn(3, 20, 160, generator=g) * 1e-4
    return x.to(dtype), w.to(dtype), grad.to(dtype)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_linear_matches_torchao(recipe):
    """Forward output, input and weight gradients equal torchao.float8's Float8Linear of the same
    recipe bit for bit, and so do the scales of each operand's cast."""
    # skipped only where torchao is not installed (setup.py's dev extra installs it): a torchao that
    # is there but fails to import, or lacks float8, fails the test
    pytest.importorskip("torchao", reason="torchao (the dev extra) is the FP8 reference")
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_utils import tensor_to_scale

    x, w, grad = _inputs(0)
    lin = torch.nn.Linear(96, 160, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    reference = Float8Linear.from_float(lin, Float8LinearConfig.from_recipe_name(recipe))
    xr = x.clone().requires_grad_()
    reference(xr).backward(grad)

    ours = FP8Linear(RECIPES[recipe], ONE, "out")
    xo, wo = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = ours(xo, wo)
    y.backward(grad)
    assert torch.equal(y, reference(x))
    assert torch.equal(xo.grad, xr.grad)
    assert torch.equal(wo.grad, reference.weight.grad)

    r = RECIPES[recipe]
    axis = ScalingGranularity.AXISWISE if r.rowwise else ScalingGranularity.TENSORWISE
    for t, ours_scale, dtype, dim in [
        (x.reshape(-1, 96), ours.cast_input(x.reshape(-1, 96)).scale, E4M3, ROLES[recipe]),
        (w.t(), ours.cast_weight(w).scale.t(), E4M3, 0 if r.rowwise else None),  # torchao casts Wᵀ
        (grad.reshape(-1, 160), ours.cast_grad(grad.reshape(-1, 160)).scale, r.grad_dtype, ROLES[recipe]),
    ]:
        theirs = tensor_to_scale(t, dtype, scaling_granularity=axis, axiswise_dim=dim,
                                 round_scales_to_power_of_2=r.pow2_scales)
        assert torch.equal(ours_scale, theirs)
    if r.pow2_scales:
        scale = cast(x, E4M3, dim=-1, pow2=True).scale
        assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))


def _tp_linears(rank, world):
    """Each recipe's column- and row-parallel FP8 linear on this rank against the whole linear."""
    from megapretrain.parallel.state import ParallelState

    ps = ParallelState(tp=world)
    return {(recipe, split): _tp_linear(ps, rank, world, recipe, split)
            for recipe in RECIPES for split in ("out", "in")}


def _tp_linear(ps, rank, world, recipe, split):
    """One tp rank's FP8 linear (fp32 tensors) against the whole linear in one process."""
    import torch.distributed as dist

    x, w, grad = _inputs(1, torch.float32)
    full = FP8Linear(RECIPES[recipe], ONE, split)
    xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
    yf = full(xf, wf)
    yf.backward(grad)
    mine = FP8Linear(RECIPES[recipe], ps.tp, split)
    if split == "out":  # column-parallel: W's rows, y's features
        xs, ws, gs = x.clone(), w.chunk(world, 0)[rank].clone(), grad.chunk(world, -1)[rank]
    else:  # row-parallel: W's columns, x's features
        xs, ws, gs = x.chunk(world, -1)[rank].clone(), w.chunk(world, 1)[rank].clone(), grad
    xs.requires_grad_(), ws.requires_grad_()
    y = mine(xs, ws)
    y.backward(gs)
    if split == "out":
        dx = xs.grad.clone()
        dist.all_reduce(dx)
        return {"y": (y, yf.chunk(world, -1)[rank]), "dw": (ws.grad, wf.grad.chunk(world, 0)[rank]),
                "dx_sum": (dx, xf.grad)}
    y = y.clone()
    dist.all_reduce(y)
    return {"y_sum": (y, yf), "dx": (xs.grad, xf.grad.chunk(world, -1)[rank]),
            "dw": (ws.grad, wf.grad.chunk(world, 1)[rank])}


def test_tensor_parallel_linear_equals_one_process():
    """Column- and row-parallel FP8 linears over 2 ranks, each recipe: every amax over a split
    dimension is all-reduced, so each rank casts as one process does — the unsummed results are the
    same bits, the sums over tp the same up to fp32 summation order."""
    for result in run_distributed(_tp_linears, 2):
        for case, tensors in result.items():
            for name, (got, want) in tensors.items():
                if name.endswith("_sum"):
                    atol = 1e-6 * want.abs().max().item()  # fp32 rounding of the partial sums, not of the result
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=atol,
                                               msg=lambda m, c=case, n=name: f"{c} {n}: {m}")
                else:
                    assert torch.equal(got, want), (case, name)


def _cp_linears(rank, world):
    """Each recipe's FP8 linear on this cp rank's tokens against the whole linear."""
    import torch.distributed as dist

    from megapretrain.parallel.state import ParallelState

    cp = ParallelState(cp=world).cp
    out = {}
    for recipe in RECIPES:
        x, w, grad = _inputs(2, torch.float32)
        full = FP8Linear(RECIPES[recipe], ONE, "out")
        xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
        yf = full(xf, wf)
        yf.backward(grad)
        mine = FP8Linear(RECIPES[recipe], ONE, "out", cp=cp)
        xs, ws = x.chunk(world, 1)[rank].clone().requires_grad_(), w.clone().requires_grad_()  # (b, s/cp, k)
        y = mine(xs, ws)
        y.backward(grad.chunk(world, 1)[rank])
        dw = ws.grad.clone()
        dist.all_reduce(dw)
        out[recipe] = {"y": (y, yf.chunk(world, 1)[rank]), "dx": (xs.grad, xf.grad.chunk(world, 1)[rank]),
                       "dw_sum": (dw, wf.grad)}
    return out


def test_context_parallel_linear_equals_one_process():
    """FP8 linears on 2 cp ranks' tokens: the amaxes over the tokens (tensorwise: every
    activation's; rowwise: the weight gradient's per-column ones) are all-reduced over cp, so
    each token's output and input gradient are one process's bits, the weight gradient's sum over
    cp the same up to fp32 summation order."""
    for result in run_distributed(_cp_linears, 2):
        for recipe, tensors in result.items():
            for name, (got, want) in tensors.items():
                if name.endswith("_sum"):
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item(),
                                               msg=lambda m, r=recipe, n=name: f"{r} {n}: {m}")
                else:
                    assert torch.equal(got, want), (recipe, name)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recomputation_recasts_the_same_bits(recipe):
    """Full recomputation re-runs the casts in the backward, selective keeps the linears' saved
    inputs: both give the gradients of a run that keeps everything, bit for bit."""
    from helpers import make_tokens

    tokens = make_tokens(batch=4, seq=32)
    grads = {}
    for recompute in ("none", "selective", "full"):
        _, model = fp8_model(recipe, recompute=recompute)
        model(tokens[:, :-1], tokens[:, 1:]).float().mean().backward()
        grads[recompute] = {n: p.grad for n, p in model.named_parameters()}
    for recompute in ("selective", "full"):
        for name, g in grads["none"].items():
            assert torch.equal(grads[recompute][name], g), (recompute, name)


# -- FP8 communication ----------------------------------------------------------------------------


def _sp_bytes(rank, world):
    """Each recipe's (and bf16's) collectives of one forward and backward under tp + sp, and for
    each recipe the parameters whose gradients differ from those of bf16 input gathers."""
    from megapretrain.parallel.state import ParallelState

    from helpers import make_tokens

    ps = ParallelState(tp=world, comm_stats=True)
    tokens = make_tokens(batch=2, seq=32)
    out, grads = {}, {}
    for recipe, allgather in [("none", True), *((r, a) for r in RECIPES for a in (True, False))]:
        _, model = fp8_model(recipe, tp=ps, sequence_parallel=True, allgather=allgather)
        ps.stats.reset()
        model(tokens[:, :-1], tokens[:, 1:]).sum().backward()
        if allgather:
            out[recipe] = ps.stats.summary()
        grads[recipe, allgather] = {n: p.grad for n, p in model.named_parameters()}
    differ = {r: [n for n, g in grads[r, True].items() if not torch.equal(g, grads[r, False][n])] for r in RECIPES}
    return out, differ


def test_sequence_parallel_gathers_send_fp8():
    """tp 2 + sp, bf16, 2 layers: each block's input all-gather sends e4m3 (half of bf16's bytes),
    and tensorwise's backward gathers the saved FP8 shard again (rowwise gathers the bf16 shard:
    its weight gradient scales x per column); rowwise also sends each token's scale. The FP8 gather
    changes no bit of the gradients: its casts are those a linear makes of the bf16-gathered input."""
    b, s, h, layers, world = 2, 32, 64, 2, 2
    shard = b * s // world * h * 2  # bytes of a (b, s/tp, h) bf16 shard
    blocks = 2 * layers  # attention and MLP inputs
    counts, differ = run_distributed(_sp_bytes, world)[0]
    assert differ == {r: [] for r in RECIPES}
    base, tensorwise, rowwise = ({k: counts[r]["tp.all_gather"][k] for k in ("calls", "bytes")}
                                 for r in ("none", "tensorwise", "rowwise"))  # (not the timed exposed_s)
    assert tensorwise == {"calls": base["calls"], "bytes": base["bytes"] - 2 * blocks * shard // 2}
    scales = b * s // world * 4  # fp32, one per token of the shard
    assert rowwise == {"calls": base["calls"] + blocks, "bytes": base["bytes"] - blocks * (shard // 2 - scales)}


def _zero3_bytes(rank, world):
    """Each recipe's (and bf16's) dp all-gathers of one step under ZeRO-3, and what they should be."""
    from megapretrain.parallel.state import ParallelState

    ps = ParallelState(comm_stats=True)
    return {recipe: _zero3_step(ps, rank, world, recipe) for recipe in ("none", *RECIPES)}


def _zero3_step(ps, rank, world, recipe):
    from megapretrain.config import OptimConfig
    from megapretrain.optim.optimizer import MixedPrecisionAdamW
    from megapretrain.parallel.fp8 import WeightCasts

    from helpers import make_tokens

    ps, model = fp8_model(recipe, tp=ps, zero=3, weights=WeightCasts())
    opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(), OptimConfig(), "bf16", ps, zero=3)
    opt.hook_models([model], trace=True)
    tokens = make_tokens(batch=2 * world)[2 * rank:2 * rank + 2]
    ps.stats.reset()
    opt.zero_grad()
    with opt.grad_sync(last=True):
        model(tokens[:, :-1], tokens[:, 1:]).sum().backward()
    opt.reduce_grads()
    units = {u.name: u for u in opt.units.units}
    gathered = [units[name] for _, event, name in opt.units.events if event == "gather"]
    sent = sum(b.shard_size * (1 if b.fp8_gather else 2) for u in gathered for b in u.buckets)
    fp8 = [b.numel for b in opt.buffers.buckets if b.fp8_gather]
    return ps.stats.summary()["dp.all_gather"]["bytes"], sent, fp8, len(gathered)


def test_zero3_gathers_tensorwise_weights_as_fp8():
    """dp 2 under ZeRO-3, bf16: each layer's linear weights are a bucket of their own, gathered
    as e4m3 (one byte an element) — the bytes the dp all-gathers send are exactly that; rowwise
    (whose backward needs the bf16 weight) gathers bf16."""
    counts = run_distributed(_zero3_bytes, 2)[0]
    sent, expected, fp8, gathers = counts["tensorwise"]
    assert sent == expected and len(fp8) == 2  # one FP8 bucket per decoder layer
    none_sent, _, _, none_gathers = counts["none"]
    assert gathers == none_gathers and sent < none_sent - sum(fp8) // 2  # every gather of a layer: half its weights
    rowwise_sent, rowwise_expected, rowwise_fp8, _ = counts["rowwise"]
    assert rowwise_fp8 == [] and rowwise_sent == rowwise_expected == none_sent


def test_the_bench_prints_each_linear_and_layer_and_refuses_bad_sizes(capsys, monkeypatch, tmp_path):
    """tools/bench_fp8.py on a small Llama-shaped layer: one row per linear and kind (bf16 the
    ×1.00 base), a JSON line per row, a layer total per kind; sizes FP8 cannot take are one line."""
    from helpers import load_tool

    bench_fp8 = load_tool("bench_fp8")

    monkeypatch.setitem(bench_fp8.MODELS, "small", (64, 32, 128))  # hidden, kv heads × head dim, ffn
    out = tmp_path / "fp8.jsonl"
    assert bench_fp8.main(["--models", "small", "--tokens", "32", "--tp", "2", "--iters", "1",
                           "--jsonl", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    shapes = [(name, o, i) for name, o, i in bench_fp8.layer_linears("small", 2)]
    assert [(r["linear"], r["out"], r["in"], r["kind"]) for r in rows] == \
        [(*shape, kind) for shape in shapes for kind in ("bf16", *RECIPES)]
    assert shapes[0] == ("q_proj", 32, 64) and shapes[-1] == ("down_proj", 64, 64)  # tp 2 shards
    assert all(r["ms"] > 0 and (r["speedup"] == 1.0) == (r["kind"] == "bf16") for r in rows)
    printed = capsys.readouterr().out
    totals = [line.split()[1] for line in printed.splitlines() if line.endswith("of bf16")]
    assert totals == ["bf16", *RECIPES]  # a whole layer's total per kind
    assert bench_fp8.main(["--models", "small", "--tokens", "40"]) == 2
    assert capsys.readouterr().err.strip() == "error: --tokens 40 must be a multiple of 16 (FP8 GEMMs' rule)"
    assert bench_fp8.main(["--models", "8b", "--tp", "3"]) == 2
    assert capsys.readouterr().err.startswith("error: --tp 3: Llama-3 8b's hidden 4096")


# -- the config, the start-up plan, the planner ---------------------------------------------------

TINY = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_heads", "4", "--model.num_kv_heads", "2",
        "--model.ffn_hidden_size", "128", "--model.vocab_size", "300", "--train.seq_length", "32",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "4"]


def _resolve(*flags, world=1):
    from megapretrain.resolve import resolve

    return resolve(load_config(None, [*TINY, *flags]), world)


@pytest.mark.parametrize("flags, message", [
    (["--model.fp8", "fp4"], "model.fp8='fp4' is not one of: none, tensorwise, rowwise"),
    (["--model.fp8", "rowwise", "--model.fp8_skip", "['layers.*.mlp.dwn_proj']"],
     "model.fp8_skip pattern 'layers.*.mlp.dwn_proj' matches no decoder linear"),
    (["--model.fp8", "tensorwise", "--model.ffn_hidden_size", "200"],
     "mlp.gate_proj is 200×64, mlp.up_proj is 200×64, mlp.down_proj is 64×200 on a tp rank (tp=1); FP8 GEMMs "
     "need multiples of 16: change the sizes or tp, or keep them in fp32 with --model.fp8_skip "
     "\"['*.mlp.gate_proj', '*.mlp.up_proj', '*.mlp.down_proj']\""),
    (["--model.fp8", "rowwise", "--model.ffn_hidden_size", "200", "--model.fp8_skip", "['layers.0.*', '*.down_proj']"],
     "mlp.gate_proj is 200×64, mlp.up_proj is 200×64 on a tp rank"),  # layer 1's still run in FP8
    (["--model.fp8", "tensorwise", "--train.seq_length", "36", "--train.micro_batch_size", "1"],
     "train.micro_batch_size × train.seq_length / parallel.cp = 36, must be a multiple of 16"),
])
def test_bad_fp8_configs_are_one_line(flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _resolve(*flags)


def test_the_start_up_plan_names_what_runs_in_fp8():
    """The plan line counts the FP8 linears per kind; skipped ones are left out of the count and
    named; a linear whose size FP8 cannot take passes when it is skipped."""
    plan = _resolve("--model.fp8", "rowwise", "--model.fp8_skip", "['layers.0.mlp.*']").sizes.describe()
    assert ("fp8=rowwise: 11/14 linears (q_proj×2 k_proj×2 v_proj×2 o_proj×2 gate_proj×1 up_proj×1 down_proj×1), "
            "skipped layers.0.mlp.*; embedding, output layer, attention, norms in fp32") in plan
    assert "fp8=" not in _resolve().sizes.describe()
    _resolve("--model.fp8", "tensorwise", "--model.ffn_hidden_size", "200", "--model.fp8_skip", "['*.mlp.*']")


def test_planner_models_fp8_gemms_and_copies():
    """Llama-3-8B on 8 H100s: FP8 linears shorten the step (their GEMMs at twice the bf16 peak, the
    casts added) and MFU, against the bf16 peak, rises; ZeRO-3 gathers tensorwise weights in FP8
    (less memory than rowwise's bf16); a GPU without FP8 is a one-line error."""
    from megapretrain.model.args import model_args
    from megapretrain.monitor.flops import DEVICES
    from megapretrain.parallel.layout import Layout
    from megapretrain.planner.model import estimate

    args = model_args(load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "llama3_8b.yaml")))
    layout = Layout(tp=1, pp=1, dp=8, zero=3, micro_batch=1)
    runs = {r: estimate(args, 8192, layout, 64, DEVICES["h100"], fp8=r) for r in ("none", "tensorwise", "rowwise")}
    for recipe in RECIPES:
        assert runs[recipe].time["total"] < 0.9 * runs["none"].time["total"]
        assert runs[recipe].time["memory"] > runs["none"].time["memory"]  # the casts
        assert runs[recipe].mfu > runs["none"].mfu
    assert runs["tensorwise"].memory["params"] < runs["rowwise"].memory["params"] == runs["none"].memory["params"]
    with pytest.raises(ConfigError, match="A100 SXM 80GB has no FP8 tensor cores"):
        estimate(args, 8192, layout, 64, DEVICES["a100"], fp8="tensorwise")


def test_planner_ranks_only_layouts_fp8_can_run(capsys):
    """The planner's search under FP8 leaves out the layouts whose FP8 GEMMs the run would refuse
    (an MLP shard of 88 at tp 4), keeps them when model.fp8_skip keeps that MLP out of FP8, ranks
    the rest by their FP8 step time; tools/plan.py on a GPU without FP8 is one line, not 'no layout'."""
    from megapretrain.commands import plan
    from megapretrain.model.args import model_args
    from megapretrain.monitor.flops import DEVICES
    from megapretrain.planner.model import search

    shape = ["--model.num_layers", "4", "--model.hidden_size", "128", "--model.num_heads", "8", "--model.num_kv_heads",
             "8", "--model.ffn_hidden_size", "352", "--model.vocab_size", "512"]  # ffn 352 = 16 × 22: tp 4 gives 88
    args = model_args(load_config(None, shape))
    tps = {}
    for fp8, skip in [("none", ()), ("tensorwise", ()), ("tensorwise", ("*.mlp.*",))]:
        found = search(args, 256, 8, 32, DEVICES["h100"], fp8=fp8, fp8_skip=skip)
        tps[fp8, skip] = {e.layout.tp for e in found}
        times = [e.time["total"] for e in found if e.fits]
        assert times == sorted(times)
    assert tps["none", ()] == tps["tensorwise", ("*.mlp.*",)] == {1, 2, 4, 8}
    assert tps["tensorwise", ()] == {1, 2}
    config = os.path.join(os.path.dirname(__file__), "..", "configs", "llama3_8b.yaml")
    assert plan.main(["--config", config, "--gpus", "8", "--device", "a100", "--model.fp8", "rowwise"]) == 2
    assert capsys.readouterr().err.strip() == ("error: model.fp8=rowwise: the A100 SXM 80GB has no FP8 tensor cores "
                                               "(set --model.fp8 none, or plan for H100/H200/B200/L40S/L4)")
