"""Every Triton kernel compiles, through ptxas, for an H100/H200 (sm_90) — no GPU needed.

The interpreter tests (tests/test_kernels.py) check what the kernels compute; they cannot see code
that only the compiler rejects (types changing across loop iterations, unsupported casts, shapes).
Triton ships ptxas, so each kernel is compiled here ahead of time for ``GPUTarget("cuda", 90, 32)``
in a fresh process (one where Triton was imported without ``TRITON_INTERPRET``), for the dtypes and
constexpr branches the dispatch launches.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("triton") is None:  # not imported here: see tests/test_kernels.py on why
    pytest.skip("triton is not installed", allow_module_level=True)

P16, F32 = "*bf16", "*fp32"


def _cases():
    """(module, kernel, signature types in order, constexprs, num_warps) for each launch variant."""
    from megapretrain.kernels import adamw, cross_entropy, rmsnorm, rope, swiglu

    cases = []
    for p in (P16, F32, "*fp16"):
        for h in (1024, 4096, 8192):
            block_r, block_h, warps = rmsnorm.blocks(h, rmsnorm.FWD_TILE)
            cases.append((rmsnorm, "_rmsnorm_fwd", [p, p, p, F32, "i32", "i32", "fp32"],
                          dict(BLOCK_R=block_r, BLOCK_H=block_h), warps))
            block_r, block_h, warps = rmsnorm.blocks(h, rmsnorm.BWD_TILE)
            cases.append((rmsnorm, "_rmsnorm_bwd", [p, p, p, F32, p, F32, "i32", "i32", "i32"],
                          dict(BLOCK_R=block_r, BLOCK_H=block_h), warps))
        cases += [
            (swiglu, "_swiglu_fwd", [p, p, p, "i32"], dict(BLOCK=swiglu.BLOCK), 4),
            (swiglu, "_swiglu_bwd", [p, p, p, p, p, "i32"], dict(BLOCK=swiglu.BLOCK), 4),
            (cross_entropy, "_ce_stats_kernel", [p, "*i64", F32, F32, F32, "i32", "i32", "i32", "i32"],
             dict(BLOCK_V=4096), 8),
            (cross_entropy, "_ce_grad_kernel", [p, "*i64", F32, F32, "i32", "i32", "i32", "i32", "fp32"],
             dict(BLOCK_V=4096), 8),
        ]
        for half in (32, 64):
            block_r, block_d = rope.blocks(half)
            cases += [(rope, "_rope_kernel", [p, p, p, p] + ["i32"] * 10,
                       dict(BACKWARD=b, BLOCK_R=block_r, BLOCK_D=block_d), 4) for b in (False, True)]
    for has_out in (False, True):
        for has_mask in (False, True):
            cases.append((adamw, "_adamw_kernel", [F32, F32, F32, F32, P16, "*i32", F32, "i32"] + ["fp32"] * 6,
                          dict(HAS_OUT=has_out, HAS_MASK=has_mask, BLOCK=adamw.BLOCK), 4))
    cases.append((adamw, "_adamw_kernel", [P16, F32, F32, F32, "*fp16", "*i32", F32, "i64"] + ["fp32"] * 6,
                  dict(HAS_OUT=True, HAS_MASK=True, BLOCK=adamw.BLOCK), 4))
    cases.append((adamw, "_sq_sum_kernel", [F32, F32, F32, "i32"], dict(BLOCK=adamw.SQ_BLOCK), 4))
    return cases


def compile_all() -> int:
    """Compile every case; print one line each; return how many compiled."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    for module, name, types, constexprs, warps in _cases():
        fn = getattr(module, name)
        runtime = [a for a in fn.arg_names if a not in constexprs]
        signature = dict(zip(runtime, types), **dict.fromkeys(constexprs, "constexpr"))
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target,
                                  options={"num_warps": warps})
        print(f"{module.__name__.rsplit('.', 1)[-1]}.{name} {types[0]} {constexprs}: "
              f"{len(compiled.asm['cubin'])} bytes of sm_90 code")
    return len(_cases())


def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path))  # compile, rather than find an earlier run's results
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "compiled 48 kernels" in proc.stdout, proc.stdout[-3000:]


if __name__ == "__main__":
    print(f"compiled {compile_all()} kernels")
