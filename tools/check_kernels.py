"""Compile every Triton kernel ahead of time, as the ops launch it, for sm_80, sm_90 and sm_100.

No GPU is needed: Triton ships ptxas. The project's own ops (RMSNorm forward and backward, SwiGLU,
RoPE, cross entropy on one rank and vocab-parallel, linear + cross entropy, AdamW, the grad
sum of squares) run on meta tensors shaped like the real calls of every shipped config
(``configs/**/*.yaml``: hidden, FFN, heads, padded vocabulary, tp, sequence parallelism), with
:func:`megapretrain.kernels._triton.capture_launches` recording each launch instead of running it.
A meta tensor's ``data_ptr`` is its byte offset, so views are as (mis)aligned as on the GPU, where
every allocation is 512-byte aligned. Each launch is then specialised exactly as Triton's launcher
does it (its own binder: 16-byte alignment of pointers, ints divisible by 16 or equal to 1, i32 or
i64), compiled with ``triton.compile`` for each target, and ptxas is asked (``-v``) for registers
and spills. One line per distinct specialisation and target; the exit status is 1 on a compile
error, any spill, or shared memory over the target's limit.

    python tools/check_kernels.py [--configs configs] [--targets 80,90,100] [--dtypes fp32,bf16,fp16]
"""

from __future__ import annotations

import concurrent.futures
import glob
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass

import _tool  # noqa: F401  (the package installed, or one line saying how)
import torch

from megapretrain.cli import ToolParser


@dataclass(frozen=True)
class Target:
    """A GPU's per-SM limits, for occupancy and the shared-memory check."""
    cc: int
    sms: int  # multiprocessors, for the persistent grids (A100, H100 SXM, B200)
    smem_per_block: int  # the opt-in maximum of one program
    smem_per_sm: int
    regs_per_sm: int = 65536
    threads_per_sm: int = 2048
    blocks_per_sm: int = 32


TARGETS = {80: Target(80, 108, 163 << 10, 164 << 10), 90: Target(90, 132, 227 << 10, 228 << 10),
           100: Target(100, 148, 227 << 10, 228 << 10)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Shape:
    """The kernel-relevant sizes of one config on one rank."""
    name: str
    tokens: int  # b · s
    seq: int
    hidden: int
    ffn_local: int  # ffn / tp
    heads_local: int  # query heads / tp
    kv_local: int
    head_dim: int
    vocab: int  # the real vocabulary
    vocab_local: int  # padded vocabulary / tp
    tp: int
    sp: bool
    params_local: int  # parameters per (tp, pp) rank: the optimizer's flat shard at most


def config_shapes(paths: list[str]) -> list[Shape]:
    """:class:`Shape` of each config file (those without a vocabulary size are skipped)."""
    import yaml

    from megapretrain.model.args import default_ffn_hidden_size, padded_vocab_size

    shapes = []
    for path in paths:
        with open(path) as f:
            cfg = yaml.safe_load(f) or {}
        m, p, t = cfg.get("model", {}), cfg.get("parallel", {}), cfg.get("train", {})
        if not m.get("vocab_size"):
            continue
        h, heads, tp = m["hidden_size"], m["num_heads"], p.get("tp", 1)
        kv, ffn = m.get("num_kv_heads") or heads, m.get("ffn_hidden_size") or default_ffn_hidden_size(h)
        vocab_local = padded_vocab_size(m["vocab_size"], m.get("make_vocab_size_divisible_by", 128), tp) // tp
        seq, mb = t.get("seq_length", 2048), t.get("micro_batch_size", 1)
        d = h // heads
        per_layer = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * ffn + 2 * h
        params = (m.get("num_layers", 1) * per_layer + 2 * vocab_local * tp * h) // (tp * p.get("pp", 1))
        shapes.append(Shape(os.path.splitext(os.path.basename(path))[0], mb * seq, seq, h, ffn // tp, heads // tp,
                            kv // tp, d, m["vocab_size"], vocab_local, tp, bool(p.get("sequence_parallel")), params))
    return shapes


class _Group:
    """A tp group of ``size`` ranks whose all-reduces return their input (meta tensors carry no values)."""

    def __init__(self, size: int):
        self.size = size

    def all_reduce(self, tensor, op=None):
        return tensor


def run_ops(shape: Shape, dtype: torch.dtype) -> None:
    """Every op, forward and backward, on meta tensors as one rank of ``shape`` calls it."""
    from megapretrain.kernels import adamw, cross_entropy, linear_cross_entropy, rmsnorm, rope, swiglu

    meta = dict(device="meta", dtype=dtype)
    norm_rows = shape.tokens // shape.tp if shape.sp else shape.tokens  # sequence parallel: s/tp rows
    x = torch.empty(norm_rows, shape.hidden, **meta, requires_grad=True)  # (b·s/tp, h)
    w = torch.empty(shape.hidden, **meta, requires_grad=True)
    for weight_in_fp32 in (False, True):  # Llama's order, OLMo's (the weight before rounding)
        rmsnorm.rms_norm(x, w, 1e-5, weight_in_fp32).backward(torch.empty(norm_rows, shape.hidden, **meta))
    gate, up = (torch.empty(shape.tokens, shape.ffn_local, **meta, requires_grad=True) for _ in range(2))
    swiglu.swiglu(gate, up).backward(torch.empty(shape.tokens, shape.ffn_local, **meta))
    cos, sin = (torch.empty(shape.seq, shape.head_dim, **meta) for _ in range(2))
    b = shape.tokens // shape.seq
    for heads in {shape.heads_local, shape.kv_local}:  # q and k: transposed views of the projections
        qk = torch.empty(b, shape.seq, heads, shape.head_dim, **meta).transpose(1, 2).requires_grad_()
        rope.rope(qk, cos, sin).backward(torch.empty(b, heads, shape.seq, shape.head_dim, **meta))
    group = _Group(shape.tp) if shape.tp > 1 else None
    targets = torch.empty(b, shape.seq, device="meta", dtype=torch.int64)
    logits = torch.empty(b, shape.seq, shape.vocab_local, **meta, requires_grad=True)
    cross_entropy.cross_entropy(logits, targets, group, 0, shape.vocab).sum().backward()
    last = (shape.tp - 1) * shape.vocab_local  # the last rank: where the padding columns are
    cross_entropy.cross_entropy(logits, targets, group, last, shape.vocab).sum().backward()
    xh = torch.empty(b, shape.seq, shape.hidden, **meta, requires_grad=True)
    out_w = torch.empty(shape.vocab_local, shape.hidden, **meta, requires_grad=True)
    linear_cross_entropy.linear_cross_entropy(xh, out_w, targets, group, last, shape.vocab).backward()
    n = shape.params_local
    for grad_dtype in {torch.float32, dtype}:
        grad = torch.empty(n, device="meta", dtype=grad_dtype)
        adamw.grad_sq_sum(grad)
        master, m, v = (torch.empty(n, device="meta") for _ in range(3))
        decay = torch.empty((n + 31) // 32, device="meta", dtype=torch.int32)
        out = torch.empty(n, **meta) if dtype != torch.float32 else None
        for mask in (None, decay):
            adamw.fused_adamw_(grad, master, m, v, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                               step=1, param_out=out, decay=mask, grad_scale=torch.ones((), device="meta"),
                               found_inf=torch.zeros((), device="meta", dtype=torch.bool))  # as the optimizer


@dataclass(frozen=True)
class Variant:
    """One kernel specialisation, as Triton's launcher would compile it for ``cc``."""
    kernel: object  # the JITFunction
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict

    def key(self):
        return (self.kernel.fn.__qualname__, repr(self.signature), repr(self.constexprs), repr(self.attrs),
                repr(sorted(self.options.items())))


def specialise(kernel, args, kwargs, cc: int) -> Variant:
    """Triton 3.9's own launch path (``JITFunction.run`` up to ``_do_compile``) for a ``cc`` target."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", cc, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, _ = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, None)
    return Variant(kernel, signature, constexprs, attrs, options.__dict__)


def _with_real_impls():
    """A scoped library that makes each ``megapretrain::`` kernel op run its own implementation
    (not its fake) on meta tensors, so the dispatch reaches the Triton launches."""
    from torch._library.custom_ops import CustomOpDef

    from megapretrain.kernels import adamw, cross_entropy, rmsnorm, rope, swiglu

    lib = torch.library.Library("megapretrain", "IMPL")
    for module in (adamw, cross_entropy, rmsnorm, rope, swiglu):
        for op in vars(module).values():
            if isinstance(op, CustomOpDef):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "overriding a previously registered kernel": meant
                    lib.impl(op._name, op._init_fn, "Meta")
    return lib


def capture(shapes: list[Shape], dtypes: list[torch.dtype], cc: int) -> dict:
    """{variant key: (Variant, [case names])} of every launch the ops make for these shapes."""
    from megapretrain.kernels._triton import capture_launches

    found = {}
    case = []

    def on_launch(kernel, args, kwargs):
        variant = specialise(kernel, args, kwargs, cc)
        found.setdefault(variant.key(), (variant, []))[1].append(case[0])

    lib = _with_real_impls()
    try:
        with capture_launches(on_launch, TARGETS[cc].sms):
            for shape in shapes:
                for dtype in dtypes:
                    case[:] = [f"{shape.name}/{str(dtype)[6:]}"]
                    run_ops(shape, dtype)
    finally:
        lib._destroy()
    return found


_USAGE = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_LOAD = re.compile(r"^\s*(?:@%p\d+\s+)?ld\.global(?:\.[a-z_]+)*?(?:\.v(\d))?\.[bfsu](\d+)\s", re.M)


def ptxas_usage(ptx: str, cc: int, fp_fusion: bool) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) a thread from ``ptxas -v``, run with Triton's flags."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(cc).path, "-lineinfo", *([] if fp_fusion else ["--fmad=false"]), "-v",
               "--regAllocOptLevel=2", f"--gpu-name={sm_arch_from_capability(cc)}", src, "-o", src + ".o"]
        log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
    regs = int(_USAGE.search(log).group(1))
    stores, loads = (sum(int(m[i]) for m in _SPILL.findall(log)) for i in (0, 1))
    return regs, stores, loads


def load_widths(ptx: str) -> str:
    """Bits per global load instruction in the PTX, narrowest-widest (128: ld.global.v4.b32)."""
    bits = {int(v or 1) * int(w) for v, w in _LOAD.findall(ptx)}
    if not bits:
        return "-"
    return f"{min(bits)}" if len(bits) == 1 else f"{min(bits)}-{max(bits)}"


def warps_per_sm(regs: int, shared: int, warps: int, t: Target) -> int:
    """Resident warps per SM: whole programs, limited by registers (256-register units per warp),
    shared memory (1 KB reserved per program) and threads."""
    regs_per_warp = -(-regs * 32 // 256) * 256
    by_regs = (t.regs_per_sm // regs_per_warp) // warps
    by_smem = t.smem_per_sm // (shared + 1024)
    by_threads = t.threads_per_sm // (32 * warps)
    return min(by_regs, by_smem, by_threads, t.blocks_per_sm) * warps


def compile_variant(variant: Variant, cc: int) -> dict:
    """Compile one specialisation for sm_``cc``; its resource usage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=variant.kernel, signature=variant.signature, constexprs=variant.constexprs,
                    attrs=variant.attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=variant.options)
    ptx = compiled.asm["ptx"]
    regs, spills, spill_loads = ptxas_usage(ptx, cc, variant.options.get("enable_fp_fusion", True))
    shared, warps = compiled.metadata.shared, variant.options["num_warps"]
    return dict(regs=regs, spills=spills, spill_loads=spill_loads, shared=shared, warps=warps,
                warps_per_sm=warps_per_sm(regs, shared, warps, TARGETS[cc]), loads=load_widths(ptx))


def describe(variant: Variant) -> str:
    """The first pointer's dtype, the constexprs by name, and per runtime argument D (a pointer
    16-byte aligned, an int divisible by 16: Triton's tt.divisibility) or . (neither)."""
    names = variant.kernel.arg_names
    first = next((v for v in variant.signature.values() if isinstance(v, str) and v.startswith("*")), "")
    consts = ",".join(f"{names[k[0]]}={v}" for k, v in variant.constexprs.items())
    marks = "".join("D" if ((i,), [["tt.divisibility", 16]]) in variant.attrs.items() else "."
                    for i, t in enumerate(variant.signature.values()) if t != "constexpr")
    return f"{first[1:]} {consts} {marks}"


def supported_targets(requested: list[int]) -> list[int]:
    """The requested compute capabilities the installed ptxas compiles for (sm_100: CUDA 12.8 on)."""
    from triton.backends.nvidia.compiler import get_ptxas

    oldest = {80: (11, 0), 90: (12, 0), 100: (12, 8)}  # the first ptxas for each target
    return [cc for cc in requested
            if tuple(int(p) for p in get_ptxas(cc).version.split(".")[:2]) >= oldest.get(cc, (99, 0))]


def main(argv=None) -> int:
    parser = ToolParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="configs", help="folder of config YAML files (searched recursively)")
    parser.add_argument("--targets", default="80,90,100", help="compute capabilities (100: ptxas 12.8 or later)")
    parser.add_argument("--dtypes", default="fp32,bf16,fp16")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="compiles run at once (default: one per CPU)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("check_kernels: unset TRITON_INTERPRET (the interpreter compiles nothing)", file=sys.stderr)
        return 2
    paths = sorted(glob.glob(os.path.join(args.configs, "**", "*.yaml"), recursive=True))
    shapes = config_shapes(paths)
    if not shapes:
        print(f"check_kernels: no config with a model.vocab_size under {args.configs}", file=sys.stderr)
        return 2
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    targets = supported_targets([int(c) for c in args.targets.split(",")])
    print(f"{len(shapes)} configs ({', '.join(s.name for s in shapes)}); targets "
          f"{', '.join(f'sm_{c}' for c in targets)}")
    print(f"{'kernel':<17} {'target':<6} {'regs':>4} {'spill':>5} {'smem':>6} {'warps/SM':>8} {'ld bits':>7}  "
          f"{'first case (of n)':<26} specialisation (pointer dtype, constexprs, D: 16-aligned / divisible)")
    failures, kernels, start = [], set(), time.perf_counter()
    work = [(cc, variant, cases) for cc in targets
            for variant, cases in capture(shapes, dtypes, cc).values()]
    # ptxas runs as its own process: compiles overlap on threads (results printed in order)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = [pool.submit(compile_variant, variant, cc) for cc, variant, _ in work]
        for (cc, variant, cases), future in zip(work, results):
            name = variant.kernel.fn.__name__
            kernels.add(name)
            try:
                r = future.result()
            except Exception as e:  # reported; the exit status says so
                failures.append(f"{name} sm_{cc} {describe(variant)}: {type(e).__name__}: {str(e)[:400]}")
                print(f"{name:<17} sm_{cc:<3} COMPILE ERROR  {cases[0]} ({len(cases)})  {describe(variant)}")
                continue
            bad = []
            if r["spills"] or r["spill_loads"]:
                bad.append(f"spills {r['spills']} B (stores), {r['spill_loads']} B (loads) a thread")
            if r["shared"] > TARGETS[cc].smem_per_block:
                bad.append(f"shared {r['shared']} B > {TARGETS[cc].smem_per_block}")
            print(f"{name:<17} sm_{cc:<3} {r['regs']:>4} {r['spills']:>5} {r['shared']:>6} {r['warps_per_sm']:>8} "
                  f"{r['loads']:>7}  {f'{cases[0]} ({len(cases)})':<26} {describe(variant)}"
                  + (f"  FAIL: {', '.join(bad)}" if bad else ""))
            if bad:
                failures.append(f"{name} sm_{cc} {describe(variant)}: {', '.join(bad)}")
    print(f"checked {len(kernels)} kernels: {', '.join(sorted(kernels))} in {time.perf_counter() - start:.0f} s")
    for failure in failures:
        print(f"FAIL {failure}")
    return 1 if failures else 0

if __name__ == "__main__":
    sys.exit(main())
