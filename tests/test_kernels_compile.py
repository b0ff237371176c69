"""Every Triton kernel compiles, as the ops launch it, for A100, H100/H200 and B200 (sm_80, sm_90, sm_100), without
spills or too much shared memory — no GPU needed.

The interpreter tests (tests/test_kernels.py) check what the kernels compute; they cannot see code
that only the compiler rejects, registers that spill, or shared memory over a GPU's limit.
``tools/check_kernels.py`` runs the project's ops on meta tensors
shaped as every shipped config calls them, records each launch's own specialisation (alignment,
divisibility, constexprs, warps) and compiles it through Triton's bundled ptxas. Here it runs in a
fresh process (Triton imported without ``TRITON_INTERPRET``) with an empty Triton cache, for bf16 and
fp32 (fp16 compiles as bf16 does but for its conversions; the tool's default checks all three), on
2 cores in about 1.5 minutes. sm_100 is checked where the bundled ptxas has it (12.8 on).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:  # not imported here: see tests/test_kernels.py on why
    pytest.skip("triton is not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ["_adamw_kernel", "_ce_grad_kernel", "_ce_stats_kernel", "_rmsnorm_bwd", "_rmsnorm_fwd", "_rope_kernel",
           "_sq_sum_kernel", "_swiglu_bwd", "_swiglu_fwd"]


def test_every_kernel_compiles_without_spills_for_sm80_sm90_sm100(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path))  # compile, rather than find an earlier run's results
    cmd = [sys.executable, str(ROOT / "tools" / "check_kernels.py"), "--configs", str(ROOT / "configs"),
           "--targets", "80,90,100", "--dtypes", "bf16,fp32"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    out = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, out[-6000:]
    assert f"checked {len(KERNELS)} kernels: {', '.join(KERNELS)}" in proc.stdout, out[-3000:]
    lines = proc.stdout.splitlines()
    targets = ["sm_80", "sm_90"] + (["sm_100"] if "sm_100" in lines[0] else [])  # the header names them
    for kernel in KERNELS:
        for target in targets:
            assert any(line.split()[:1] == [kernel] and f" {target} " in line for line in lines), (kernel, target)
    # the 405B norm (hidden 16384 over its column chunks) is among the shapes compiled
    assert any(line.startswith("_rmsnorm_bwd") and "llama3_405b" in line for line in lines), out[-3000:]
