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

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from megapretrain.train import main

from distributed import run_distributed

TINY = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_heads", "4",
        "--model.num_kv_heads", "2", "--model.ffn_hidden_size", "128", "--train.seq_length", "32",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "4", "--train.iters", "2",
        "--train.eval_interval", "0", "--logging.interval", "1", "--logging.tensorboard", "false",
        "--checkpoint.interval", "0", "--optim.lr", "3e-3", "--schedule.warmup_iters", "1"]
TRITON = ["--model.kernels", "triton", "--optim.impl", "triton"]
TORCH = ["--model.kernels", "torch", "--optim.impl", "torch"]
SP = ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"]
CUDA = torch.cuda.is_available()  # the kernels compiled for the GPU; no interpreter needed
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and not CUDA
needs_interpreter = pytest.mark.skipif(not (INTERPRETED or CUDA), reason="runs in a fresh process with "
                                       "TRITON_INTERPRET=1 (test_triton_path_in_a_fresh_process)")


def _losses(run_dir: str) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r["loss"] for r in map(json.loads, fh) if "loss" in r]


def _train(rank, world, run_dir, corpus, flags) -> list[float]:
    assert main(["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *TINY, *flags]) == 0
    return _losses(run_dir)


def _close(a: list[float], b: list[float], rel: float) -> bool:
    return len(a) == len(b) > 0 and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


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
    torch_losses = _train(0, 1, str(tmp_path / "torch"), corpus, TORCH)
    triton_losses = _train(0, 1, str(tmp_path / "triton"), corpus, TRITON)
    assert _close(triton_losses, torch_losses, 1e-5), (triton_losses, torch_losses)


@needs_interpreter
@pytest.mark.skipif(CUDA, reason="two ranks on gloo and CPU tensors: the interpreter's case")
def test_triton_kernels_train_like_torch_under_tp2_sp(tmp_path, corpus):
    reference = _train(0, 1, str(tmp_path / "single"), corpus, TORCH)
    ranks = run_distributed(_train, 2, str(tmp_path / "tp2"), corpus, [*TRITON, *SP], timeout=600)
    for losses in ranks:
        assert _close(losses, reference, 1e-5), (losses, reference)


@needs_interpreter
def test_triton_kernels_z_loss_matches_torch_reference(tmp_path, corpus):
    """The z-loss runs the chunked loss on both paths: kernels and torch phases agree."""
    z = ["--model.z_loss", "1e-3"]
    ref = _train(0, 1, str(tmp_path / "torch"), corpus, [*TORCH, *z])
    fused = _train(0, 1, str(tmp_path / "triton"), corpus, [*TRITON, *z])
    plain = _train(0, 1, str(tmp_path / "plain"), corpus, TORCH)
    assert _close(fused, ref, 1e-5), (fused, ref)
    assert ref[0] > plain[0]  # the same first step, plus z · lse² > 0


def test_compile_trains_like_eager(tmp_path, corpus):
    eager = _train(0, 1, str(tmp_path / "eager"), corpus, ["--train.precision", "bf16"])
    compiled = _train(0, 1, str(tmp_path / "compiled"), corpus, ["--train.precision", "bf16",
                                                                 "--train.compile", "true"])
    assert _close(compiled, eager, 2e-2), (compiled, eager)


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
    assert main(["--run.dir", str(tmp_path / "r"), "--data.paths", f"[{corpus}]", *TINY, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any(message in line for line in err), err
