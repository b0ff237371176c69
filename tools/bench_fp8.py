"""FP8 linears against bf16: forward + backward of every decoder linear of Llama-3 8B and 70B at
their real shapes, in bf16 (``F.linear``) and in each FP8 recipe (``parallel/fp8.py``).

    python tools/bench_fp8.py                                  # CPU: 64 tokens, 2 timed runs
    python tools/bench_fp8.py --models 8b --tokens 8192 --tp 2  # a GPU at 8192 tokens, tp 2 shards
    python tools/bench_fp8.py --compile --jsonl fp8.jsonl       # also torch.compile'd FP8 (fused casts)

Each case is one linear ``y = x Wᵀ`` of ``--tokens`` rows on one tp rank (column-parallel ones
split their output rows, row-parallel ones their input columns, as ``--tp`` ranks do), timed as
the forward and both backward GEMMs with their casts; the table gives the median milliseconds,
TFLOP/s (6·tokens·in·out per forward + backward) and the speed-up over bf16, then the sum over a
whole decoder layer. On CPU, ``torch._scaled_mm`` runs FP8 as a reference kernel (slower than
bf16: the figures show the overhead of the casts and that the path runs, not a speed-up).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from _tool import sync

from megapretrain.cli import ToolParser, positive_int, user_errors
from megapretrain.errors import UserError
from megapretrain.model.fp8 import GEMM_MULTIPLE
from megapretrain.parallel.fp8 import RECIPES, FP8Linear
from megapretrain.parallel.state import Group

# Llama-3: (hidden, kv heads × head dim, ffn)
MODELS = {"8b": (4096, 1024, 14336), "70b": (8192, 1024, 28672)}


def layer_linears(model: str, tp: int) -> list[tuple[str, int, int]]:
    """(name, out, in) of one decoder layer's linears on one of ``tp`` ranks."""
    h, kv, f = MODELS[model]
    return [("q_proj", h // tp, h), ("k_proj", kv // tp, h), ("v_proj", kv // tp, h), ("o_proj", h, h // tp),
            ("gate_proj", f // tp, h), ("up_proj", f // tp, h), ("down_proj", h, f // tp)]


def parse_args(argv=None):
    ap = ToolParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--tokens", type=positive_int, default=None, help="rows of x (default: 64 CPU, 8192 GPU)")
    ap.add_argument("--tp", type=positive_int, default=1, help="the linears' shards on one of this many tp ranks")
    ap.add_argument("--iters", type=positive_int, default=None, help="timed runs (default: 2 CPU, 20 GPU)")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile'd FP8 linears")
    ap.add_argument("--jsonl", default=None, help="append each result to this file as one JSON line as it is measured")
    return ap.parse_args(argv)


def check_sizes(a) -> None:
    """Every linear's shard a whole one, and every GEMM dimension (the tokens included: the weight
    gradient's inner one) a multiple of 16, as FP8 GEMMs need; one line naming the flag otherwise."""
    if a.tokens % GEMM_MULTIPLE:
        raise UserError(f"--tokens {a.tokens} must be a multiple of {GEMM_MULTIPLE} (FP8 GEMMs' rule)")
    for model in a.models:
        h, kv, f = MODELS[model]
        if any(d % (a.tp * GEMM_MULTIPLE) for d in (h, kv, f)):
            raise UserError(f"--tp {a.tp}: Llama-3 {model}'s hidden {h}, kv heads × head dim {kv} and ffn {f} split "
                            f"over tp must stay multiples of {GEMM_MULTIPLE} (FP8 GEMMs' rule): take a smaller "
                            f"power of two")


def median_s(fn, device: torch.device, iters: int) -> float:
    fn()  # warm-up (and compilation)
    times = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def linear_step(kind: str, out: int, inp: int, tokens: int, device: torch.device, compiled: bool):
    """A forward + backward of one (out × inp) linear on ``tokens`` rows, as a callable."""
    x = torch.randn(tokens, inp, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(out, inp, device=device) * 0.02).to(torch.bfloat16).requires_grad_()
    g = torch.randn(tokens, out, device=device, dtype=torch.bfloat16)
    tp = Group("tp", [0])  # one rank's shard: no all-reduce of amaxes (a scalar or a vector: negligible)
    if kind == "bf16":
        fn = F.linear
    else:
        linear = FP8Linear(RECIPES[kind], tp, "out")
        fn = torch.compile(linear.__call__) if compiled else linear

    def step():
        x.grad = w.grad = None
        fn(x, w).backward(g)
    return step


def bench(a, device: torch.device) -> list[dict]:
    kinds = ["bf16", *RECIPES] + ([f"{r}+compile" for r in RECIPES] if a.compile else [])
    rows = []
    for model in a.models:
        for name, out, inp in layer_linears(model, a.tp):
            base = None
            for kind in kinds:
                recipe, compiled = kind.split("+")[0], kind.endswith("+compile")
                seconds = median_s(linear_step(recipe, out, inp, a.tokens, device, compiled), device, a.iters)
                base = base or seconds
                row = {"model": model, "linear": name, "out": out, "in": inp, "tokens": a.tokens, "kind": kind,
                       "ms": seconds * 1e3, "tflops": 6 * a.tokens * out * inp / seconds / 1e12,
                       "speedup": base / seconds}
                rows.append(row)
                if a.jsonl:
                    with open(a.jsonl, "a") as fh:
                        fh.write(json.dumps(row) + "\n")
                print(f"{model:>4} {name:<10} {out:>6}×{inp:<6} {kind:<19} {row['ms']:>10.2f} ms "
                      f"{row['tflops']:>8.3f} TFLOP/s  ×{row['speedup']:.2f}", flush=True)
    return rows


def layer_totals(rows: list[dict]) -> list[dict]:
    """Per model and kind: a whole layer's linears, and the speed-up over bf16."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        ms = {}
        for r in rows:
            if r["model"] == model:
                ms[r["kind"]] = ms.get(r["kind"], 0.0) + r["ms"]
        out += [{"model": model, "kind": k, "layer_ms": v, "speedup": ms["bf16"] / v} for k, v in ms.items()]
    return out


@user_errors
def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    a.tokens = a.tokens or (8192 if gpu else 64)
    a.iters = a.iters or (20 if gpu else 2)
    check_sizes(a)
    name = torch.cuda.get_device_name(device) if gpu else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {name}; torch {torch.__version__}; {a.tokens} tokens, tp {a.tp}; forward + backward per linear")
    rows = bench(a, device)
    print("a whole decoder layer's linears:")
    for t in layer_totals(rows):
        print(f"{t['model']:>4} {t['kind']:<19} {t['layer_ms']:>10.2f} ms  ×{t['speedup']:.2f} of bf16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
