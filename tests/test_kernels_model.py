"""The kernels wired into training: ``model.kernels``, ``optim.impl`` and ``train.compile``.

A tiny run with ``--model.kernels triton --optim.impl triton`` (the Triton kernels on CPU through
the interpreter, in fp32) gives the torch path's losses within 1e-5 relative, in one process and
under tp=2 with sequence parallelism; ``--train.compile true`` (inductor's C++ backend) gives
eager's within bf16 tolerance; impossible combinations are refused in one line.

The interpreter must be on when Triton is first imported, and importing megapretrain imports
Triton, so the Triton tests run in a fresh process of their own with ``TRITON_INTERPRET=1`` (see
tests/test_kernels.py); sizes are tiny because the interpreter runs each program in numpy.
"""

from __future__ import annotations

import collections
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from megapretrain.train import main

from distributed import run_distributed
from helpers import KERNELS_TINY, TORCH, TRITON, losses_close, train_losses

SP = ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"]
CUDA = torch.cuda.is_available()  # the kernels compiled for the GPU; no interpreter needed
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and not CUDA
needs_interpreter = pytest.mark.skipif(not (INTERPRETED or CUDA), reason="runs in a fresh process with "
                                       "TRITON_INTERPRET=1 (test_triton_path_in_a_fresh_process)")


def test_triton_path_in_a_fresh_process():
    """Runs this file's interpreter tests in a process where Triton was imported interpreted."""
    if INTERPRETED or CUDA:
        pytest.skip("this process runs them")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-k",
                           "triton_kernels"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]


@needs_interpreter
def test_triton_kernels_train_like_torch(tmp_path, corpus):
    torch_losses = train_losses(0, 1, str(tmp_path / "torch"), corpus, TORCH)
    triton_losses = train_losses(0, 1, str(tmp_path / "triton"), corpus, TRITON)
    assert losses_close(triton_losses, torch_losses, 1e-5), (triton_losses, torch_losses)


@needs_interpreter
@pytest.mark.skipif(CUDA, reason="two ranks on gloo and CPU tensors: the interpreter's case")
def test_triton_kernels_train_like_torch_under_tp2_sp(tmp_path, corpus):
    reference = train_losses(0, 1, str(tmp_path / "single"), corpus, TORCH)
    ranks = run_distributed(train_losses, 2, str(tmp_path / "tp2"), corpus, [*TRITON, *SP], timeout=600)
    for losses in ranks:
        assert losses_close(losses, reference, 1e-5), (losses, reference)


@needs_interpreter
@pytest.mark.skipif(CUDA, reason="two ranks on gloo and CPU tensors: the interpreter's case")
def test_triton_kernels_train_like_torch_under_zero3(tmp_path, corpus):
    """ZeRO-3 hands the fused AdamW shards whose bf16/fp32 parameter copy is the only one."""
    reference = train_losses(0, 1, str(tmp_path / "single"), corpus, TORCH)
    ranks = run_distributed(train_losses, 2, str(tmp_path / "zero3"), corpus, [*TRITON, "--parallel.zero", "3"],
                            timeout=600)
    for losses in ranks:
        assert losses_close(losses, reference, 1e-5), (losses, reference)


@needs_interpreter
def test_triton_kernels_z_loss_matches_torch_reference(tmp_path, corpus):
    """The z-loss runs the chunked loss on both paths: kernels and torch phases agree."""
    z = ["--model.z_loss", "1e-3"]
    ref = train_losses(0, 1, str(tmp_path / "torch"), corpus, [*TORCH, *z])
    fused = train_losses(0, 1, str(tmp_path / "triton"), corpus, [*TRITON, *z])
    plain = train_losses(0, 1, str(tmp_path / "plain"), corpus, TORCH)
    assert losses_close(fused, ref, 1e-5), (fused, ref)
    assert ref[0] > plain[0]  # the same first step, plus z · lse² > 0


def test_compile_trains_like_eager(tmp_path, corpus):
    eager = train_losses(0, 1, str(tmp_path / "eager"), corpus, ["--train.precision", "bf16"])
    compiled = train_losses(0, 1, str(tmp_path / "compiled"), corpus, ["--train.precision", "bf16",
                                                                 "--train.compile", "true"])
    assert losses_close(compiled, eager, 2e-2), (compiled, eager)


def _hooked_compile_run(compile_: bool, recompute: str, calls: list) -> list[torch.Tensor]:
    """Two forward + backward passes of a 4-layer model, every decoder layer and every module with
    parameters inside one carrying hooks that read ``id(module)`` (as parallel/data.py's do):
    the per-token losses and the embedding's gradient of each."""
    from megapretrain.model.build import compile_layers
    from megapretrain.parallel.state import ParallelState

    from helpers import build, make_tokens, tiny_args

    model = build(ParallelState(), tiny_args(num_layers=4), recompute=recompute)
    if compile_:
        compile_layers(model, torch.device("cpu"))
    for layer in model.layers.values():
        layer.register_forward_pre_hook(lambda m, args: calls.append(("layer", id(m))))
        layer.register_forward_hook(lambda m, args, out: calls.append(("layer done", id(m))))
        for sub in layer.modules():
            if sub is not layer and any(True for _ in sub.parameters(recurse=False)):
                sub.register_forward_pre_hook(lambda m, args: calls.append(("module", id(m))))
    out = []
    for seed in (0, 1):
        tokens = make_tokens(batch=2, seq=16, seed=seed)
        losses = model(tokens[:, :-1], tokens[:, 1:])  # (b, s)
        losses.sum().backward()
        out += [losses.detach(), model.embed_tokens.weight.grad.clone()]
        model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_compiled_layers_compile_once_with_hooks_kept_eager(recompute):
    """train.compile on a chunk of 4 decoder layers: one frame compiled for all of them, module
    hooks (on the layers, and forward pre-hooks on their modules) each run once per layer call
    and outside the graph (traced, their id() would make Dynamo compile once per layer), and the
    eager model's losses and gradients (fp32). A recomputation stops once it has what the
    backward needs, before the layer's forward hook, in eager mode too."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager_calls, compiled_calls = [], []
    eager = _hooked_compile_run(False, recompute, eager_calls)
    compiled = _hooked_compile_run(True, recompute, compiled_calls)
    assert counters["frames"]["ok"] == 1 and counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0
    kinds = [kind for kind, _ in compiled_calls]
    passes = 2 * (2 if recompute == "full" else 1)  # full recomputation runs each layer again in backward
    assert kinds.count("layer") == 4 * passes and kinds.count("layer done") == 4 * 2
    assert kinds.count("module") == 4 * 9 * passes  # 2 norms, q k v o, gate up down
    assert collections.Counter(kinds) == collections.Counter(kind for kind, _ in eager_calls)
    per_module = collections.Counter(call for call in compiled_calls if call[0] != "layer done")
    assert set(per_module.values()) == {passes}  # every module's hooks, on every pass
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_torch_chunked_loss_matches_todays_loss(tmp_path, corpus):
    """The chunked per-token loss (what the kernels path runs), with the torch phases and chunks of
    a few tokens, against today's unchunked loss: same per-token losses and gradients."""
    from megapretrain.model.fused_loss import linear_cross_entropy_per_token
    from megapretrain.parallel.cross_entropy import vocab_parallel_linear_cross_entropy
    from megapretrain.parallel.state import Group

    torch.manual_seed(0)
    tp = Group("tp", [0], None, 0)
    x = torch.randn(2, 7, 16, requires_grad=True)
    w = torch.randn(40, 16, requires_grad=True)
    targets = torch.randint(0, 37, (2, 7))
    targets[0, 3] = -100
    grad = torch.rand(2, 7)
    got = linear_cross_entropy_per_token(x, w, targets, tp, 0, 37, reference=True, chunk_rows=3)
    gx, gw = torch.autograd.grad(got, (x, w), grad)
    want = vocab_parallel_linear_cross_entropy(x, w, targets, tp, 0, 37)
    wx, ww = torch.autograd.grad(want, (x, w), grad)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(gx, wx)
    torch.testing.assert_close(gw, ww)


@pytest.mark.parametrize("flags, message", [
    (["--model.kernels", "triton", "--train.device", "cpu"], "model.kernels=triton on train.device=cpu"),
    (["--optim.impl", "apex"], "optim.impl=apex"),
    (["--optim.impl", "triton", "--optim.offload", "true"], "optim.impl=triton steps on the GPU"),
    (["--model.kernels", "fast"], "model.kernels='fast' is not one of"),
    *([] if CUDA else [(["--model.kernels", "triton"], "model.kernels=triton cannot run on cpu"),
                       (["--optim.impl", "triton"], "optim.impl=triton cannot run on cpu")]),
])
def test_impossible_combinations_are_one_line_errors(tmp_path, corpus, capsys, monkeypatch, flags, message):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if "apex" in flags and importlib.util.find_spec("apex") is not None:
        pytest.skip("apex is installed")
    assert main(["--run.dir", str(tmp_path / "r"), "--data.paths", f"[{corpus}]", *KERNELS_TINY, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any(message in line for line in err), err
