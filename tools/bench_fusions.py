"""Eager-mode fusions of the decoder layer timed against the forms the model runs, on CPU.

    python tools/bench_fusions.py [--shapes nanogpt bench_cpu] [--dtype fp32 bf16]
        [--only qkv gate_up rope rmsnorm] [--repeats 20] [--threads 1]

Each candidate is a way to write one region of the torch path of a Llama decoder layer with fewer
ops; the current side is the model's own code (``megapretrain.model.layers``) on a one-layer model
built and initialized as training builds it (tp = 1):

- ``qkv``: the attention block (projections, RoPE, SDPA, output projection) with the q, k and v
  projections as one GEMM on the concatenated weights (each weight's gradient is its rows of the
  one gradient; q, k and v are strided views of one output), against ``Attention.forward``.
- ``gate_up``: the SwiGLU MLP with gate and up as one GEMM, silu and the product on the strided
  halves of its output, against ``SwiGLU.forward``.
- ``rope``: q and k rotated together as ``x·cos + roll(x)·sin'`` (sin' = (-sin₁, sin₂), made once
  per shape), against ``apply_rope`` on each (q and k as transposed views, as the model makes them).
- ``rmsnorm``: RMSNorm whose products make new tensors, against the model's ``RMSNorm`` (a copy of
  x, then in-place products).

Before any timing each candidate's outputs and gradients (of the input and of every weight it
touches) are compared with the current form's: equal bitwise, or within the dtype's tolerance
(largest difference over the largest magnitude); a candidate that differs is reported, not timed.
Timing: forward + backward, the two forms in alternating blocks in one process (the order swapped
every block), the median per call of the blocks' CPU time of this thread (``time.thread_time``)
and wall time. ``speed`` is current / candidate: above 1 the candidate is faster. With more than
one thread the thread's CPU time misses the other threads' work: read the wall columns then.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import _tool  # noqa: F401  (the package installed, or one line saying how)
import torch
import torch.nn.functional as F

from megapretrain.cli import ToolParser, number, user_errors
from megapretrain.model.args import ModelArgs
from megapretrain.model.decoder import DecoderModel
from megapretrain.model.layers import RMSNorm, SwiGLU, apply_rope, rope_tables
from megapretrain.parallel.state import Group

FUSIONS = ("qkv", "gate_up", "rope", "rmsnorm")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# largest difference over the largest magnitude of each output and gradient: a few roundings of
# the dtype (bf16 keeps 8 bits of mantissa, and a reordered sum over tokens rounds differently)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
BLOCK_S = 0.05  # each timed block runs enough calls to last about this long


@dataclass(frozen=True)
class Shape:
    """A micro-batch (b, s) through a layer of width h with n query heads, k kv heads, FFN width f."""
    b: int
    s: int
    h: int
    n: int
    k: int
    f: int

    def __str__(self) -> str:
        return f"b{self.b} s{self.s} h{self.h} n{self.n} k{self.k} f{self.f}"


SHAPES = {
    "tiny": Shape(2, 16, 32, 4, 2, 64),
    "nanogpt": Shape(12, 64, 128, 4, 4, 352),  # nanoGPT's shakespeare_char shapes (docs/performance.md)
    "bench_cpu": Shape(4, 512, 512, 8, 4, 1376),  # configs/bench_cpu.yaml
}


def parse_args(argv=None):
    ap = ToolParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--shapes", nargs="+", choices=SHAPES, default=["nanogpt", "bench_cpu"],
                    help="shape presets: " + ", ".join(f"{k} ({v})" for k, v in SHAPES.items()))
    ap.add_argument("--dtype", nargs="+", choices=DTYPES, default=list(DTYPES), help="precisions to measure")
    ap.add_argument("--only", nargs="+", choices=FUSIONS, default=list(FUSIONS), help="fusions to measure")
    ap.add_argument("--repeats", type=number(int, 1, what="an integer of at least 1"), default=20,
                    help="timed blocks per form (after one warm-up block each)")
    ap.add_argument("--threads", type=number(int, 1, what="an integer of at least 1"), default=1,
                    help="CPU threads (torch.set_num_threads)")
    return ap.parse_args(argv)


# -- the candidates ---------------------------------------------------------------------------------


def joint_qkv_attention(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``Attention.forward`` (tp 1, causal, no QK-norm, no biases) with one GEMM for q, k and v."""
    n, k, d = attn.n_local, attn.k_local, attn.d
    b, s, _ = x.shape
    weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])  # ((n + 2k)·d, h)
    q, kk, v = F.linear(x, weight).split([n * d, k * d, k * d], dim=-1)  # (b, s, n·d), (b, s, k·d) × 2
    q = q.view(b, s, n, d).transpose(1, 2)  # (b, n, s, d)
    kk, v = kk.view(b, s, k, d).transpose(1, 2), v.view(b, s, k, d).transpose(1, 2)  # (b, k, s, d)
    q, kk = apply_rope(q, cos, sin), apply_rope(kk, cos, sin)
    y = F.scaled_dot_product_attention(q, kk, v, is_causal=True, enable_gqa=True)  # (b, n, s, d)
    return attn.o_proj(y.transpose(1, 2).reshape(b, s, n * d))  # (b, s, h)


def joint_gate_up(mlp: SwiGLU, x: torch.Tensor) -> torch.Tensor:
    """``SwiGLU.forward`` (tp 1, no biases) with gate and up as one GEMM."""
    f = mlp.gate_proj.weight.shape[0]
    both = F.linear(x, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))  # (b, s, 2f)
    return mlp.down_proj(F.silu(both[..., :f]) * both[..., f:])  # (b, s, h)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin' = (-sin₁, sin₂) of a (s, d) table, so that rotate_half(x)·sin = roll(x, d/2)·sin'."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # (s, d)


def joint_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor):
    """q (b, n, s, d) and k (b, k, s, d) rotated together: x·cos + roll(x)·sin' on one tensor."""
    x = torch.cat([q, k], dim=1)  # (b, n + k, s, d)
    y = x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed  # (b, n + k, s, d)
    return y.split([q.shape[1], k.shape[1]], dim=1)


class OutOfPlaceRMSNorm(torch.autograd.Function):
    """The model's ``_RMSNormFunction`` with every product making a new tensor (no copy of x first,
    no in-place ops): the same values, fewer ops, more buffers."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # (..., h): x itself in fp32
        rstd = (torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square() / x.shape[-1] + eps).rsqrt()  # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.to(rstd.dtype) * rstd  # (..., h) fp32
        g = grad.to(rstd.dtype)
        grad_weight = (g * x_hat).flatten(0, -2).sum(0).to(weight.dtype)  # (h,)
        g = g * weight.to(rstd.dtype)
        dot = torch.linalg.vecdot(g, x_hat).unsqueeze(-1) / x.shape[-1]  # (..., 1)
        return ((g - x_hat * dot) * rstd).to(x.dtype), grad_weight, None


# -- the cases --------------------------------------------------------------------------------------


@dataclass
class Case:
    """Two forms of one region: ``current`` and ``candidate`` each return the region's outputs from
    the same ``leaves`` (input and weights); ``grads`` are the outputs' incoming gradients."""
    leaves: list[torch.Tensor]
    current: Callable[[], tuple]
    candidate: Callable[[], tuple]
    grads: tuple


def make_case(fusion: str, shape: Shape, dtype: torch.dtype) -> Case:
    """The region of ``fusion`` on a one-layer model of ``shape``, initialized as training does."""
    args = ModelArgs(num_layers=1, hidden_size=shape.h, num_heads=shape.n, num_kv_heads=shape.k,
                     ffn_hidden_size=shape.f, vocab_size=256)
    model = DecoderModel(args, Group("tp", [0]), dtype=dtype)
    model.init_weights(0)
    layer = model.layers["0"]
    gen = torch.Generator().manual_seed(0)

    def randn(*size):
        return torch.randn(*size, generator=gen).to(dtype)

    b, s, h = shape.b, shape.s, shape.h
    x = randn(b, s, h).requires_grad_(True)
    cos, sin = rope_tables(s, args.rotary_dim, args.rope_theta, "cpu", dtype)  # (s, d) each
    if fusion == "qkv":
        attn = layer.self_attn
        weights = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight]
        return Case([x, *weights], lambda: (attn(x, cos, sin),), lambda: (joint_qkv_attention(attn, x, cos, sin),),
                    (randn(b, s, h),))
    if fusion == "gate_up":
        mlp = layer.mlp
        weights = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
        return Case([x, *weights], lambda: (mlp(x),), lambda: (joint_gate_up(mlp, x),), (randn(b, s, h),))
    if fusion == "rope":
        d = args.head_dim
        q_rows = randn(b, s, shape.n, d).requires_grad_(True)  # as the projections make them
        k_rows = randn(b, s, shape.k, d).requires_grad_(True)
        q, k = q_rows.transpose(1, 2), k_rows.transpose(1, 2)  # (b, n, s, d), (b, k, s, d): views
        sin_signed = signed_sin(sin)
        return Case([q_rows, k_rows], lambda: (apply_rope(q, cos, sin), apply_rope(k, cos, sin)),
                    lambda: joint_rope(q, k, cos, sin_signed), (randn(b, shape.n, s, d), randn(b, shape.k, s, d)))
    norm = layer.input_layernorm
    if not isinstance(norm, RMSNorm):
        raise TypeError(f"the model's input norm is {type(norm).__name__}, not RMSNorm")
    with torch.no_grad():  # a weight of ones would hide a wrong product with it
        norm.weight.copy_(1 + 0.1 * randn(h))
    return Case([x, norm.weight], lambda: (norm(x),), lambda: (OutOfPlaceRMSNorm.apply(x, norm.weight, norm.eps),),
                (randn(b, s, h),))


def step(case: Case, form: Callable[[], tuple]) -> list[torch.Tensor]:
    """One forward + backward of ``form``; its outputs and the leaves' gradients (then cleared)."""
    outs = form()
    torch.autograd.backward(outs, case.grads)
    got = [o.detach() for o in outs] + [leaf.grad for leaf in case.leaves]
    for leaf in case.leaves:
        leaf.grad = None
    return got


def compare(case: Case, dtype: torch.dtype) -> tuple[bool, str]:
    """(equal within tolerance, a word on how) of the two forms' outputs and gradients."""
    want, got = step(case, case.current), step(case, case.candidate)
    if all(torch.equal(a, b) for a, b in zip(want, got)):
        return True, "bitwise"
    worst = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                for a, b in zip(want, got))
    return worst <= TOLERANCE[dtype], f"{worst:.1e}"


def time_forms(case: Case, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Per form, per clock ("cpu", "wall"): seconds per call of each timed block."""
    forms = {"current": case.current, "candidate": case.candidate}
    start = time.perf_counter()
    for form in forms.values():  # warm-up, and the calls a block needs to last BLOCK_S
        step(case, form)
    calls = max(1, min(50, round(BLOCK_S / max((time.perf_counter() - start) / 2, 1e-6))))
    times = {name: {"cpu": [], "wall": []} for name in forms}
    for r in range(repeats):
        for name in (("current", "candidate") if r % 2 else ("candidate", "current")):
            cpu, wall = time.thread_time(), time.perf_counter()
            for _ in range(calls):
                step(case, forms[name])
            times[name]["cpu"].append((time.thread_time() - cpu) / calls)
            times[name]["wall"].append((time.perf_counter() - wall) / calls)
    return times


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


@user_errors
def main(argv=None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(a.threads)
    try:
        measure(a)
    finally:  # a caller in the same process (tests/test_docs.py) keeps its own thread count
        torch.set_num_threads(threads)
    return 0


def measure(a) -> None:
    """Check, time and print each fusion at each shape and dtype of the flags ``a``."""
    print(f"eager fusions, forward + backward on CPU, {a.threads} thread(s), {time.strftime('%Y-%m-%d %H:%M')}; "
          f"load average at start {_load()}")
    print("speed = current / candidate (above 1: the candidate is faster); ms per call, median of "
          f"{a.repeats} alternating blocks")
    if a.threads > 1:
        print("note: the CPU column counts this thread only; with more threads read the wall columns")
    head = (f"{'fusion':<8} {'shape':<28} {'dtype':<5} {'check':<8} {'cpu cur':>8} {'cpu cand':>8} {'speed':>6} "
            f"{'pairs IQR':>11} {'wall cur':>8} {'wall cand':>9} {'speed':>6}")
    print(head)
    for name in a.shapes:
        shape = SHAPES[name]
        for dtype_name in a.dtype:
            dtype = DTYPES[dtype_name]
            for fusion in a.only:
                case = make_case(fusion, shape, dtype)
                ok, how = compare(case, dtype)
                row = f"{fusion:<8} {str(shape):<28} {dtype_name:<5} {how:<8}"
                if not ok:
                    print(f"{row} differs from the current form (tolerance {TOLERANCE[dtype]:.0e}): not timed",
                          flush=True)
                    continue
                t = time_forms(case, a.repeats)
                cur, cand = ({c: statistics.median(t[f][c]) for c in ("cpu", "wall")} for f in ("current", "candidate"))
                pairs = sorted(x / y for x, y in zip(t["current"]["cpu"], t["candidate"]["cpu"]))
                iqr = f"{pairs[len(pairs) // 4]:.2f}-{pairs[3 * len(pairs) // 4]:.2f}"
                print(f"{row} {1e3 * cur['cpu']:>8.3f} {1e3 * cand['cpu']:>8.3f} {cur['cpu'] / cand['cpu']:>6.3f} "
                      f"{iqr:>11} {1e3 * cur['wall']:>8.3f} {1e3 * cand['wall']:>9.3f} "
                      f"{cur['wall'] / cand['wall']:>6.3f}", flush=True)
    print(f"load average at end {_load()}")


if __name__ == "__main__":
    sys.exit(main())
