"""FP8 training (``model.fp8``) through the real trainer: parallel layouts against one process,
checkpoints across precisions, torch.compile, and 200 steps on real text against bf16 (slow).

Equivalence under parallel layouts runs in fp32 and over two optimizer steps. FP8 rounds each
operand to 3 mantissa bits, so the ~1e-7 differences of fp32 summation order that tensor
parallelism makes in the gradients turn, once an update has moved the weights by them, into whole
FP8 steps of a few elements: measured on this model, tp 2 + sp equals one process at step 1 (bit
for bit with AVX-512; a grad norm 9e-6 apart on an AVX2-only CPU, whose GEMMs sum in another
order) and within 4e-6 at step 2 (2.7e-5 on AVX2), but drifts to 2e-5 at step 3 and 5e-5 at step 5
(a relative perturbation of 1e-7 of the weights moves a tensorwise FP8 loss by 2e-6; without FP8
the same layouts stay within 1e-7).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from megapretrain.parallel.fp8 import RECIPES

from distributed import run_distributed
from helpers import fp8_model

# -- the trainer ----------------------------------------------------------------------------------


def _train(rank, world, run_dir, corpus, flags):
    from megapretrain.model.fp8 import LINEARS
    from megapretrain.train import setup

    from helpers import BASE

    trainer = setup(["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *BASE, *flags])
    trainer.fit()
    fp8 = [m.fp8 for c in trainer.model_chunks for m in c.modules() if isinstance(m, LINEARS) and m.fp8 is not None]
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [r for r in map(json.loads, fh) if "loss" in r]
    # the linears that take their input from sequence parallelism's FP8 gather, and their weight
    # from ZeRO-3's (a weight missing from the FP8 gather would have raised)
    return {"losses": [r["loss"] for r in rows], "grad_norms": [r["grad_norm"] for r in rows], "fp8_linears": len(fp8),
            "fp8_gathered": (sum(f.inputs is not None for f in fp8), sum(f.weights is not None for f in fp8))}


FP8_LAYOUTS = {
    "tp2_sp": ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"],
    "pp2": ["--parallel.pp", "2"],
    "dp2_zero3": ["--parallel.zero", "3"],
    "dp2_zero2": ["--parallel.zero", "2"],
    "pp2_vpp2": ["--parallel.pp", "2", "--parallel.vpp", "2"],
    "cp2": ["--parallel.cp", "2"],
}
_SINGLE: dict = {}


@pytest.mark.parametrize("layout, recipe", [("tp2_sp", "tensorwise"), ("tp2_sp", "rowwise"), ("pp2", "tensorwise"),
                                            ("pp2_vpp2", "rowwise"), ("dp2_zero3", "tensorwise"),
                                            ("dp2_zero2", "rowwise"), ("cp2", "tensorwise")])
def test_fp8_layout_matches_single_process(layout, recipe, corpus, tmp_path, tmp_path_factory):
    """The trainer with FP8 under tp 2 + sp (FP8 input gathers), pp 2, pp 2 × vpp 2, dp 2 ZeRO-3
    (FP8 weight gathers), dp 2 ZeRO-2 and cp 2 (amaxes over the tokens all-reduced) gives one FP8
    process's first loss within 1e-6 and the rest within 1e-3 (two steps: see the module
    docstring), with the FP8 gathers on."""
    # the first two steps of a 5-step schedule; eps 1e-4: an element whose gradient is ~0 gets no
    # update that hinges on its sign; one thread everywhere: the same fp32 sums in the reference
    flags = ["--model.fp8", recipe, "--train.iters", "2", "--schedule.decay_iters", "5", "--optim.eps", "1e-4",
             "--train.threads", "1"]
    if recipe not in _SINGLE:
        _SINGLE[recipe] = run_distributed(_train, 1, str(tmp_path_factory.mktemp("single")), corpus, flags)[0]
    single = _SINGLE[recipe]
    ranks = run_distributed(_train, 2, str(tmp_path), corpus, [*flags, *FP8_LAYOUTS[layout]], timeout=300)
    assert single["fp8_linears"] == 4 * 7  # every decoder linear of the 4 layers
    stage = 2 * 7 if layout.startswith("pp2") else 4 * 7  # pp: 2 layers a stage (vpp: in two chunks)
    assert [r["fp8_linears"] for r in ranks] == [stage] * 2
    inputs = 4 * 5 if layout == "tp2_sp" else 0  # q, k, v, gate, up: the column-parallel linears
    weights = 4 * 7 if layout == "dp2_zero3" else 0  # tensorwise: every linear's weight
    assert single["fp8_gathered"] == (0, 0) and [r["fp8_gathered"] for r in ranks] == [(inputs, weights)] * 2
    # step 1's forward runs on the same weights: only the fp32 summation order differs, and the
    # forward's FP8 casts see values that agree to 1e-6 on every CPU kind
    assert ranks[0]["losses"][0] == pytest.approx(single["losses"][0], rel=1e-6)
    # the backward casts gradients that differ by that summation order, and step 2 runs on weights
    # one fp32-rounded update apart: FP8 turns a few elements of either into whole FP8 steps, as
    # many as the CPU's GEMM blocking puts near a rounding edge (measured under tp 2 + sp
    # tensorwise: step-2 loss 2.7e-5 on one AVX2-only CPU, 3.2e-4 on another, below 5e-6 with
    # AVX-512). An operand scaled by the wrong amax or an FP8 weight left stale by the update
    # moves these by ~1e-2 or more (step 2's loss is 20% below step 1's), far past 1e-3
    assert ranks[0]["losses"][1] == pytest.approx(single["losses"][1], rel=1e-3)
    assert ranks[0]["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-3)


def _losses(run_dir: str) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return {r["iter"]: r["loss"] for r in map(json.loads, fh) if "loss" in r and "event" not in r}


def _run(rank, world, run_dir, corpus, flags):
    from megapretrain.train import main

    from helpers import BASE

    assert main(["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *BASE, "--train.precision", "bf16",
                 "--checkpoint.interval", "2", "--schedule.decay_iters", "6", *flags]) == 0


@pytest.mark.slow
def test_an_fp8_checkpoint_resumes_in_bf16_and_back(corpus, tmp_path):
    """Checkpoints hold the fp32 masters and nothing of FP8: a tensorwise run saved under tp 2 +
    sp resumes in one process in bf16, whose checkpoint resumes in rowwise; each resumed step's
    loss is within 1% of an uninterrupted tensorwise run's (a fresh model's would be ~10% off).
    Slow (~70 s on 2 busy cores): four training runs, one of them on 2 ranks."""
    straight = str(tmp_path / "straight")
    _run(0, 1, straight, corpus, ["--model.fp8", "tensorwise", "--train.iters", "6"])
    run = str(tmp_path / "run")
    run_distributed(_run, 2, run, corpus, ["--model.fp8", "tensorwise", "--train.iters", "2", "--parallel.tp", "2",
                                           "--parallel.sequence_parallel", "true"], timeout=300)
    _run(0, 1, run, corpus, ["--model.fp8", "none", "--train.iters", "4"])
    _run(0, 1, run, corpus, ["--model.fp8", "rowwise", "--train.iters", "6"])
    want, got = _losses(straight), _losses(run)
    assert sorted(got) == list(range(1, 7))
    for i in range(1, 7):
        assert got[i] == pytest.approx(want[i], rel=1e-2), i
    assert want[6] < 0.9 * want[1]


@pytest.mark.slow
def test_compiled_fp8_layers_have_no_graph_break_and_train_like_eager():
    """torch.compile traces the FP8 linears whole (casts and scaled GEMMs in the layer's graph, no
    break) and gives eager's gradients (fp32: inductor only reorders float operations). Slow: the
    compilation on CPU takes minutes."""
    from torch._dynamo.utils import counters

    from megapretrain.model.build import compile_layers

    from helpers import make_tokens

    tokens = make_tokens(batch=2, seq=32)
    out = {}
    for compiled in (False, True):
        _, model = fp8_model("tensorwise")
        model.float()
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            compile_layers(model, torch.device("cpu"))
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        loss.backward()
        out[compiled] = loss.item(), {n: p.grad for n, p in model.named_parameters()}
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-5)
    for name, g in out[False][1].items():
        torch.testing.assert_close(out[True][1][name], g, rtol=1e-3, atol=1e-5, msg=name)


# -- 200 steps on real text -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def stdlib_corpus(tmp_path_factory) -> str:
    """1 MB of the Python standard library's sources, byte-tokenized: real text, no download."""
    from megapretrain.commands import build_demo_corpus, preprocess_data

    d = tmp_path_factory.mktemp("stdlib")
    assert build_demo_corpus.main(["--output", str(d / "c.jsonl"), "--max-mb", "1"]) == 0
    assert preprocess_data.main(["--input", str(d / "c.jsonl"), "--output-prefix", str(d / "c"), "--tokenizer-type",
                                 "ByteTokenizer", "--json-keys", "text", "--append-eod", "--workers", "1"]) == 0
    return str(d / "c_text_document")


# 2 layers of hidden 64 at 1,024 tokens a step; lr 1e-3: at a larger rate this model's curve turns
# chaotic, and fp32 itself departs from bf16 by 4% at single steps (here: under 0.1%). One thread:
# two threads of a rank on a busy 2-core machine spin-wait on each other (measured under load 4:
# 0.065 s a tensorwise step with one, 0.05-10 s with two; the same losses)
CURVE = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_heads", "4", "--model.num_kv_heads", "2",
         "--model.ffn_hidden_size", "192", "--train.seq_length", "64", "--train.micro_batch_size", "16",
         "--train.global_batch_size", "16", "--train.iters", "200", "--train.precision", "bf16",
         "--train.eval_interval", "0", "--logging.interval", "10", "--logging.tensorboard", "false",
         "--checkpoint.interval", "0", "--optim.lr", "1e-3", "--schedule.warmup_iters", "20",
         "--schedule.decay_iters", "200", "--recovery.action", "none", "--train.threads", "1"]


def _curve(run_dir: str, corpus: str, recipe: str, iters: int = 200) -> dict[int, float]:
    """The logged losses of the first ``iters`` steps of the 200-step run (the same schedule)."""
    from megapretrain.train import main

    assert main(["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *CURVE, "--model.fp8", recipe,
                 "--train.iters", str(iters)]) == 0
    return _losses(run_dir)


@pytest.fixture(scope="module")
def bf16_curve(stdlib_corpus, tmp_path_factory) -> dict[int, float]:
    from megapretrain.monitor.flops import slow_half_precision_warning

    # read off the CPU's bf16 instructions where it has them (a timing under load is not reliable);
    # emulated bf16 matmuls would make the 200-step runs many times slower
    if slow_half_precision_warning("bf16"):
        pytest.skip("this CPU emulates bf16 matmuls: the 200-step bf16/FP8 curves need AVX-512 BF16 or AMX")
    return _curve(str(tmp_path_factory.mktemp("bf16")), stdlib_corpus, "none")


def _deviation(curve: dict[int, float], reference: dict[int, float]) -> float:
    """The largest relative gap of ``curve`` from ``reference`` at any step ``curve`` logged."""
    assert sorted(reference) == list(range(10, 201, 10)) and set(curve) <= set(reference) and len(curve) >= 10
    return max(abs(curve[i] - reference[i]) / reference[i] for i in curve)


@pytest.mark.slow  # with the broken run: 51 s of CPU, 55-95 s on 2 busy cores
@pytest.mark.ci  # the FP8 recipes' loss curves are checked on every change
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fp8_tracks_the_bf16_loss_for_200_steps(recipe, stdlib_corpus, bf16_curve, tmp_path, capsys):
    """Each recipe's loss is within 1% of bf16's at every logged step of 200 (measured: 0.51%
    tensorwise, 0.35% rowwise, both at step 130); the run's start-up plan says what ran in FP8.
    Slow: with the broken run below, 3½ runs of 200 steps (one thread each)."""
    curve = _curve(str(tmp_path), stdlib_corpus, recipe)
    assert (f"fp8={recipe}: 14/14 linears (q_proj×2 k_proj×2 v_proj×2 o_proj×2 gate_proj×2 up_proj×2 down_proj×2); "
            "embedding, output layer, attention, norms in bf16") in capsys.readouterr().out
    assert sorted(curve) == sorted(bf16_curve)
    assert _deviation(curve, bf16_curve) < 0.01
    assert bf16_curve[200] < 0.6 * bf16_curve[10]


@pytest.mark.slow
@pytest.mark.ci
def test_the_curve_check_fails_when_the_scaling_is_broken(stdlib_corpus, bf16_curve, tmp_path, monkeypatch):
    """The same check on a run whose casts ignore their amax (every scale 1: small weights and
    gradients flush to zero in FP8) falls well outside 1% within its first 100 steps: measured
    1.45% at step 50, 5.74% at 90."""
    import megapretrain.parallel.fp8 as fp8

    monkeypatch.setattr(fp8, "amax_to_scale", lambda amax, dtype, pow2: torch.ones_like(amax))
    assert _deviation(_curve(str(tmp_path), stdlib_corpus, "tensorwise", iters=100), bf16_curve) > 0.03
