"""What the Triton kernel tests share (tests/test_kernels.py, tests/test_kernels_loss.py).

On a CUDA machine the kernel tests run the compiled kernels on the GPU. On CPU, ``TRITON_INTERPRET=1``
must be set when Triton is first imported (it decides then, for its own library and every kernel,
between compiling and interpreting), so this module imports Triton with the variable set — a kernel
test module imports it before megapretrain — and the autouse fixture :func:`triton_interpreter`
(imported into each kernel test module) sets it again while each test runs (the kernels' dispatch
reads it at call time; other modules' tests run without it). If an earlier module already imported
Triton without the interpreter (``torch.compile`` and megatron-core do, so in a run of the whole
suite tests/test_data_megatron_compat.py has), the tests are skipped and each module's
``test_kernels_in_a_fresh_process`` runs it again in a process of its own
(:func:`run_in_fresh_process`). Also the tolerances, each from the error of the operation.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _import_triton():
    """Import Triton (for the interpreter on CPU); whether its kernels can run in this process."""
    if DEVICE == "cuda" or "triton" in sys.modules:
        triton = pytest.importorskip("triton")
        return DEVICE == "cuda" or type(triton.language.sum).__name__ == "InterpretedFunction"
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # only while importing: other modules' tests run without it
    try:
        pytest.importorskip("triton")
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return True


RUNNABLE = _import_triton()


@pytest.fixture(autouse=True)
def triton_interpreter(request, monkeypatch):
    """Run the Triton kernels on CPU tensors through the interpreter (not needed on CUDA)."""
    if request.node.name == "test_kernels_in_a_fresh_process":
        return
    if not RUNNABLE:
        pytest.skip("triton was imported without TRITON_INTERPRET=1; run in a fresh process instead")
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def run_in_fresh_process(path: str) -> None:
    """Run the test file ``path`` in a process of its own, with the interpreter set from the start."""
    if RUNNABLE:
        pytest.skip("the kernel tests run in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", path, "-q", "-p", "no:cacheprovider"],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


# -- Tolerances, each from the error of the operation ------------------------------------------------
# u = 2⁻²⁴, fp32's unit roundoff. Kernel and reference compute in fp32 and round to the output dtype
# at the same points, and every division and square root in the kernels is correctly rounded
# (tl.div_rn, tl.sqrt_rn: the GPU's defaults, div.full and sqrt.approx, are not), so the interpreted and
# the compiled kernels differ from the reference only by summation order (a tree or loop of n adds:
# at most ⌈log2 n⌉·u, or n·u, of the sum of magnitudes), by FMA contraction (compiled: one rounding
# fewer per fused product) and by exp / sigmoid (compiled: ex2.approx, 2 ulp, plus u·|x·log2 e| from
# scaling the argument). The same tolerances hold interpreted and compiled.
U = 2.0 ** -24
# fp32 elementwise and row ops: at most ~20 roundings of u on each side (2.4e-6 of values of O(1-10),
# sums over rows of at most 512 terms: ⌈log2 512⌉ = 9 of them), with 4× margin
FP32_TOL = 1e-5
# fp32 sums over rows (RMSNorm's weight grad): each program adds its up to 150 rows in sequence,
# ≤ 150·u = 9e-6 of Σ|dy·x_hat|, which for random signs is ~√150 ≈ 12 times |Σ dy·x_hat|
FP32_ROW_SUM_TOL = 1e-4
# bf16 / fp16: torch's defaults (bf16 rtol 1.6e-2 = 4 ulps of 2⁻⁸, fp16 rtol 1e-3 ≥ 1 ulp of 2⁻¹⁰, atol
# 1e-5): the fp32 values before the final rounding agree to ~1e-6, so the outputs differ by at most the
# one ulp of a rounding that falls the other way


def close(actual, expected, dtype, fp32_tol=FP32_TOL):
    """assert_close at FP32_TOL (or ``fp32_tol``) for fp32, at torch's defaults for bf16/fp16."""
    tol = {"rtol": fp32_tol, "atol": fp32_tol} if dtype == torch.float32 else {}
    torch.testing.assert_close(actual, expected, **tol)


def as_leaf(t):
    """A copy of ``t`` that is a leaf requiring its gradient."""
    return t.detach().clone().requires_grad_(True)
