"""Kernel benchmarks: time, achieved bandwidth and its fraction of the device's copy bandwidth for
each fused kernel beside torch eager, ``torch.compile`` of the reference and, when importable,
Liger-Kernel and apex; then the peak memory of the loss computation (output layer + cross entropy,
forward and backward) for the chunked linear + cross entropy against the unfused forms.

    python tools/bench_kernels.py                          # whatever this machine can run
    python tools/bench_kernels.py --no-compile --vocab 32000 128000 --json kernels.json
    python tools/bench_kernels.py --no-timing --vocab 50304      # the loss memory table alone

Bandwidth is the bytes a kernel must move (each input read once, each output written once; the
``bytes`` column) over its median time, and ``of copy`` is that against ``dst.copy_(src)`` measured
here. Every timed case is the forward and the backward together (one optimizer step for AdamW).

On CPU the Triton kernels cannot be timed (only Triton's interpreter runs them, a numpy emulation
far too slow to mean anything): the table holds the torch references eager and compiled (inductor's
C++ backend), and the memory table measures the chunked torch algorithm, which is what CPU training
gets. GPU figures need a CUDA device; the script says so instead of printing them.

The memory table gives two figures for each form: its peak above the inputs, and its working
memory, that peak less the gradients it returns, for x and the weight (the weight's is most of
what the chunked forms hold). The trainer's form returns x's alone: it adds the weight's into the
weight's fp32 main grad, which the trainer holds anyway (made before the measurement).
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from _tool import rss_bytes, sync

from megapretrain.cli import ToolParser, positive_int, user_errors
from megapretrain.kernels import adamw, cross_entropy, linear_cross_entropy, rmsnorm, rope, swiglu

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None):
    ap = ToolParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--tokens", type=positive_int, default=None, help="rows per case (default: 2048 CPU, 16384 GPU)")
    ap.add_argument("--hidden", type=positive_int, default=None, help="hidden size (default: 512 CPU, 4096 GPU)")
    ap.add_argument("--vocab", type=positive_int, nargs="+", default=[32000, 128000],
                    help="vocabularies for the memory table")
    ap.add_argument("--cross-entropy-vocab", type=positive_int, default=None, help="vocab of the timed cross entropy")
    ap.add_argument("--iters", type=positive_int, default=None, help="timed repetitions (default: 5 CPU, 50 GPU)")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile of the references")
    ap.add_argument("--no-memory", action="store_true", help="skip the loss memory table")
    ap.add_argument("--no-timing", action="store_true", help="skip the kernel timings (the memory table only)")
    ap.add_argument("--json", default=None, help="also write the results to this file (at the end)")
    ap.add_argument("--jsonl", default=None, help="also append each result to this file as one JSON line, "
                    "the moment it is measured (a run cut short keeps what it measured)")
    return ap.parse_args(argv)


# -- timing -----------------------------------------------------------------------------------------

def median_time(fn, device: torch.device, iters: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, iters: int) -> float:
    """Bytes per second of ``dst.copy_(src)`` over a buffer well beyond the caches (read + write)."""
    numel = (256 << 20) // 4 if device.type == "cuda" else (64 << 20) // 4
    src, dst = torch.randn(numel, device=device), torch.empty(numel, device=device)
    return 2 * src.numel() * 4 / median_time(lambda: dst.copy_(src), device, iters)


def _fwd_bwd(fn, inputs: list[torch.Tensor], grad: torch.Tensor | None = None):
    """A closure running fn(*inputs) and its backward (inputs that require grad get fresh grads)."""
    def run():
        for t in inputs:
            t.grad = None
        out = fn(*inputs)
        out.backward(grad if grad is not None else torch.ones_like(out))
    return run


# -- the kernels ------------------------------------------------------------------------------------

def _optional(module: str):
    """The module if importable (Liger-Kernel, apex), else None."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return None
    try:
        return importlib.import_module(module)
    except ImportError as e:  # installed but broken (e.g. built for another torch): say so, go on
        print(f"note: {module} is installed but does not import ({e}); left out")
        return None


def _leaf(shape, dtype, device, scale=1.0):
    return (torch.randn(shape, device=device) * scale).to(dtype).requires_grad_(True)


def rmsnorm_case(n, h, dtype, device):
    x, w = _leaf((n, h), dtype, device), _leaf((h,), dtype, device)
    ref = lambda x, w: rmsnorm.rms_norm_reference(x, w, 1e-5)
    impls = {"triton": _fwd_bwd(lambda x, w: rmsnorm.rms_norm(x, w, 1e-5), [x, w]), "eager": _fwd_bwd(ref, [x, w]),
             "compile": lambda: _fwd_bwd(torch.compile(ref), [x, w])}
    liger = _optional("liger_kernel.ops.rms_norm") if device.type == "cuda" else None
    if liger:
        impls["liger"] = _fwd_bwd(lambda x, w: liger.LigerRMSNormFunction.apply(x, w, 1e-5), [x, w])
    apex = _optional("apex.normalization") if device.type == "cuda" else None
    if apex:
        impls["apex"] = _fwd_bwd(lambda x, w: apex.fused_layer_norm.fused_rms_norm_affine(x, w, (h,), 1e-5), [x, w])
    return f"rmsnorm ({n}x{h})", 5 * x.numel() * x.element_size(), impls


def swiglu_case(n, h, dtype, device):
    f = (8 * h // 3 + 63) // 64 * 64
    gate, up = _leaf((n, f), dtype, device), _leaf((n, f), dtype, device)
    impls = {"triton": _fwd_bwd(swiglu.swiglu, [gate, up]), "eager": _fwd_bwd(swiglu.swiglu_reference, [gate, up]),
             "compile": lambda: _fwd_bwd(torch.compile(swiglu.swiglu_reference), [gate, up])}
    liger = _optional("liger_kernel.ops.swiglu") if device.type == "cuda" else None
    if liger:
        impls["liger"] = _fwd_bwd(liger.LigerSiLUMulFunction.apply, [gate, up])
    return f"swiglu ({n}x{f})", 8 * gate.numel() * gate.element_size(), impls


def rope_case(n, h, dtype, device):
    d = 128 if h >= 1024 else 64
    seq = min(n, 4096)
    x = _leaf((n // seq, h // d, seq, d), dtype, device)
    angle = torch.rand(seq, d, device=device) * 6.28
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    impls = {"triton": _fwd_bwd(lambda x: rope.rope(x, cos, sin), [x]),
             "eager": _fwd_bwd(lambda x: rope.rope_reference(x, cos, sin), [x]),
             "compile": lambda: _fwd_bwd(torch.compile(lambda x: rope.rope_reference(x, cos, sin)), [x])}
    return f"rope {tuple(x.shape)}", 4 * x.numel() * x.element_size(), impls


def cross_entropy_case(n, vocab, dtype, device):
    base = (torch.randn(n, vocab, device=device) * 2).to(dtype)
    targets = torch.randint(0, vocab, (n,), device=device)

    def run(fn, **kw):  # logits are a fresh non-leaf each time: the fused gradient overwrites them
        def step():
            leaf = base.requires_grad_(True)
            leaf.grad = None
            fn(leaf * 1, targets, **kw).sum().backward()
        return step

    impls = {"triton": run(cross_entropy.cross_entropy), "eager": run(cross_entropy.cross_entropy_reference),
             "torch F.cross_entropy": run(lambda x, t: F.cross_entropy(x.float(), t, reduction="none")),
             "compile": lambda: run(torch.compile(cross_entropy.cross_entropy_reference))}
    liger = _optional("liger_kernel.transformers") if device.type == "cuda" else None
    if liger:
        impls["liger"] = run(liger.LigerCrossEntropyLoss(reduction="none"))
    # the timed step passes over the logits 5 times: the fresh copy (read + write), the forward's read,
    # and the gradient written over them (read + write)
    return f"cross entropy ({n}x{vocab})", 5 * base.numel() * base.element_size(), impls


def _compiled_adamw(grad, master, m, v, kw):
    step = torch.compile(lambda g, p, a, b: adamw.fused_adamw_reference(g, p, a, b, **kw))
    return lambda: step(grad, master, m, v)


def linear_cross_entropy_case(n, h, vocab, dtype, device):
    """Compute-bound (two matmuls of the output layer): time only, no bandwidth."""
    x, w = _leaf((n, h), dtype, device, 0.5), _leaf((vocab, h), dtype, device, h ** -0.5)
    targets = torch.randint(0, vocab, (n,), device=device)
    unfused = lambda x, w: F.cross_entropy(F.linear(x, w).float(), targets, reduction="sum")
    impls = {"triton": _fwd_bwd(lambda x, w: linear_cross_entropy.linear_cross_entropy(x, w, targets), [x, w]),
             "eager": _fwd_bwd(lambda x, w: linear_cross_entropy.linear_cross_entropy_reference(x, w, targets),
                               [x, w]),
             "unfused F.linear + F.cross_entropy": _fwd_bwd(unfused, [x, w])}
    liger = _optional("liger_kernel.transformers") if device.type == "cuda" else None
    if liger:
        loss = liger.LigerFusedLinearCrossEntropyLoss(reduction="sum")
        impls["liger"] = _fwd_bwd(lambda x, w: loss(w, x, targets), [x, w])
    return f"linear + cross entropy ({n}x{h}x{vocab})", None, impls


def adamw_case(numel, out_dtype, device):
    grad, master = torch.randn(numel, device=device), torch.randn(numel, device=device)
    m, v, out = torch.zeros(numel, device=device), torch.zeros(numel, device=device), torch.empty(
        numel, dtype=out_dtype, device=device)
    kw = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=1, param_out=out)
    step_t = torch.ones((), device=device)

    def torch_fused():  # the optimizer today: torch's fused AdamW, then the copy into the bf16 params
        torch._fused_adamw_([master], [grad], [m], [v], [], [step_t], lr=1e-4, beta1=0.9, beta2=0.95,
                            weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
        out.copy_(master)

    impls = {"triton": lambda: adamw.fused_adamw_(grad, master, m, v, **kw),
             "eager": lambda: adamw.fused_adamw_reference(grad, master, m, v, **kw),
             "torch _fused_adamw_ + copy": torch_fused,
             "compile": lambda: _compiled_adamw(grad, master, m, v, kw)}
    bytes_moved = numel * (16 + 12 + out.element_size())
    return f"adamw ({numel / 1e6:.0f}M fp32)", bytes_moved, impls


def stream(a, record: dict) -> None:
    """Append ``record`` to ``--jsonl`` at once (flushed), when it is set."""
    if a.jsonl:
        with open(a.jsonl, "a") as fh:
            fh.write(json.dumps(record) + "\n")


def time_kernels(a, device: torch.device) -> list[dict]:
    """One row per (kernel, implementation) that runs on this device."""
    dtype = DTYPES[a.dtype]
    copy_bw = copy_bandwidth(device, a.iters)
    print(f"copy bandwidth ({device.type}): {copy_bw / 1e9:.1f} GB/s (dst.copy_(src), read + write)")
    cases = [rmsnorm_case(a.tokens, a.hidden, dtype, device), swiglu_case(a.tokens, a.hidden, dtype, device),
             rope_case(a.tokens, a.hidden, dtype, device),
             cross_entropy_case(a.tokens // 4, a.cross_entropy_vocab, dtype, device),
             linear_cross_entropy_case(a.tokens // 4, a.hidden, a.cross_entropy_vocab, dtype, device),
             adamw_case(a.tokens * a.hidden * 4, dtype, device)]
    rows = []
    print(f"\n{'kernel':40} {'implementation':34} {'ms':>9} {'bytes':>10} {'GB/s':>8} {'of copy':>8}")
    for name, nbytes, impls in cases:
        for impl, fn in impls.items():
            if impl == "triton" and device.type != "cuda":
                continue  # only the interpreter runs Triton on CPU: nothing to time
            if impl == "compile":
                if a.no_compile:
                    continue
                fn = fn()
            seconds = median_time(fn, device, a.iters)
            rows.append(dict(kernel=name, impl=impl, ms=seconds * 1e3, bytes=nbytes))
            if nbytes is None:  # compute-bound: the time is the figure
                print(f"{name:40} {impl:34} {seconds * 1e3:9.3f}")
            else:
                bw = nbytes / seconds
                rows[-1].update(gbps=bw / 1e9, of_copy=bw / copy_bw)
                print(f"{name:40} {impl:34} {seconds * 1e3:9.3f} {nbytes / 1e6:9.1f}M {bw / 1e9:8.1f} "
                      f"{bw / copy_bw:8.0%}")
            stream(a, {"case": "kernel", "copy_gbps": copy_bw / 1e9, **rows[-1]})
    if device.type != "cuda":
        print("\nTriton kernels (and Liger-Kernel, apex): not timed, no CUDA device here; GPU figures need a GPU.")
    return rows


# -- peak memory of the loss computation ------------------------------------------------------------

def _loss_fn(impl: str, device: torch.device, weight: torch.Tensor):
    """(x, weight, targets) -> scalar loss, for each form of the output layer + cross entropy. The
    trainer's form holds ``weight`` in data-parallel buffers first (made here, before any
    measurement: in training its fp32 main grad exists all along)."""
    from megapretrain.model.fused_loss import linear_cross_entropy_per_token
    from megapretrain.parallel.cross_entropy import vocab_parallel_linear_cross_entropy
    from megapretrain.parallel.data import DataParallelBuffers
    from megapretrain.parallel.specs import plain_specs
    from megapretrain.parallel.state import Group

    tp = Group("tp", [0])
    if impl == FUSED_GRAD:
        named = [("weight", weight)]
        sink = DataParallelBuffers(named, plain_specs(named), Group("dp", [0]), tp)
        reference = device.type != "cuda"
        return lambda x, w, t: linear_cross_entropy_per_token(x, w, t, tp, 0, w.shape[0], reference=reference,
                                                              grad_sink=sink, grad_scale=1.0).sum()
    if impl == MEMORY_IMPLS[0]:
        return lambda x, w, t: F.cross_entropy(F.linear(x, w).float(), t, reduction="sum")
    if impl == MEMORY_IMPLS[1]:
        return lambda x, w, t: vocab_parallel_linear_cross_entropy(x, w, t, tp).sum()
    if impl == MEMORY_IMPLS[2]:  # the torch phases on CPU, as model.kernels=torch runs them
        reference = device.type != "cuda"
        return lambda x, w, t: linear_cross_entropy_per_token(x, w, t, tp, 0, w.shape[0], reference=reference).sum()
    return lambda x, w, t: linear_cross_entropy.linear_cross_entropy(x, w, t)


MEMORY_IMPLS = ("unfused F.linear + F.cross_entropy", "one logits buffer (parallel/cross_entropy.py)",
                "chunked, per token (model/fused_loss.py)", "chunked, weights given (kernels/)",
                "chunked, weight grad into its fp32 main grad (trainer)")
FUSED_GRAD = MEMORY_IMPLS[4]  # returns no weight gradient: it is added into the (existing) main grad


def _loss_inputs(tokens, hidden, vocab, dtype, device):
    x = (torch.randn(tokens, hidden, device=device) * 0.5).to(dtype).requires_grad_(True)
    w = (torch.randn(vocab, hidden, device=device) * hidden ** -0.5).to(dtype).requires_grad_(True)
    return x, w, torch.randint(0, vocab, (tokens,), device=device)


def _cpu_peak_child(impl, tokens, hidden, vocab, dtype_name, results) -> None:
    """In a fresh process: peak resident memory above the inputs during forward + backward. glibc
    is told to map every block of 128 KB or more on its own and unmap it when freed, so the
    resident set follows what is allocated (by default a freed block below 32 MB stays in the heap,
    and the peak would also count how the allocator happened to place the blocks). One warm-up run
    first (one-time allocations of the libraries would otherwise count)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD, fixed
    libc.mallopt(-1, 128 << 10)  # M_TRIM_THRESHOLD
    x, w, t = _loss_inputs(tokens, hidden, vocab, DTYPES[dtype_name], torch.device("cpu"))
    fn = _loss_fn(impl, torch.device("cpu"), w)
    fn(x, w, t).backward()
    x.grad = w.grad = None
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set size (VmHWM) to the current one
    base = rss_bytes("VmRSS")
    fn(x, w, t).backward()
    results.put(rss_bytes("VmHWM") - base)


def peak_loss_memory(impl, tokens, hidden, vocab, dtype_name, device: torch.device) -> int:
    """Bytes the loss computation (forward + backward, incl. the gradients it returns) adds at peak."""
    if device.type == "cuda":
        x, w, t = _loss_inputs(tokens, hidden, vocab, DTYPES[dtype_name], device)
        fn = _loss_fn(impl, device, w)
        fn(x, w, t).backward()  # warm-up
        x.grad = w.grad = None
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn(x, w, t).backward()
        return torch.cuda.max_memory_allocated(device) - base
    ctx = mp.get_context("spawn")  # a fresh process: no freed-but-kept heap from an earlier case
    results = ctx.Queue()
    proc = ctx.Process(target=_cpu_peak_child, args=(impl, tokens, hidden, vocab, dtype_name, results))
    proc.start()
    peak = results.get(timeout=600)
    proc.join()
    return peak


def memory_table(a, device: torch.device) -> list[dict]:
    """Two figures per form: the whole peak, and its working memory, the peak less the gradients
    it returns: for x (tokens, hidden) and the weight (vocab, hidden), or for x alone in the
    trainer's form, which adds the weight's into the fp32 main grad the trainer holds anyway (at
    the benchmark's sizes the weight's gradient is most of what the other chunked forms hold)."""
    tokens, size = a.tokens, torch.finfo(DTYPES[a.dtype]).bits // 8
    print(f"\npeak memory of output layer + cross entropy, forward + backward: {tokens} tokens, hidden "
          f"{a.hidden}, {a.dtype} ({'peak RSS in a fresh process' if device.type == 'cpu' else 'CUDA allocator'}); "
          "working = peak - the gradients returned (x and weight; x only for the trainer's form)")
    rows = []
    for vocab in a.vocab:
        grads = (tokens + vocab) * a.hidden * size
        print(f"  vocab {vocab}: the logits alone {tokens * vocab * size / 2**20:.0f} MiB, the gradients "
              f"returned {grads / 2**20:.1f} MiB")
        peaks, works = {}, {}
        for impl in MEMORY_IMPLS:
            peak = peaks[impl] = peak_loss_memory(impl, tokens, a.hidden, vocab, a.dtype, device)
            returned = tokens * a.hidden * size if impl == FUSED_GRAD else grads
            work = works[impl] = max(peak - returned, 1)
            rows.append(dict(vocab=vocab, impl=impl, peak_bytes=peak, working_bytes=work))
            stream(a, {"case": "loss_memory", "tokens": tokens, "hidden": a.hidden, **rows[-1]})
            vs = [f"{peaks[ref] / peak:.1f}x less than {name} (working {works[ref] / work:.1f}x)"
                  for ref, name in zip(MEMORY_IMPLS[:2], ("unfused", "one buffer")) if ref in peaks and ref != impl]
            print(f"    {impl:55} peak {peak / 2**20:7.1f} MiB, working {work / 2**20:7.1f} MiB   "
                  f"{', '.join(vs)}")
    return rows


@user_errors
def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    a.tokens = a.tokens or (16384 if gpu else 2048)
    a.hidden = a.hidden or (4096 if gpu else 512)
    a.iters = a.iters or (50 if gpu else 5)
    a.cross_entropy_vocab = a.cross_entropy_vocab or (128256 if gpu else 50304)
    name = torch.cuda.get_device_name(device) if gpu else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {name}; torch {torch.__version__}; {a.dtype}")
    results = {"device": name, "dtype": a.dtype, "kernels": [] if a.no_timing else time_kernels(a, device)}
    if not a.no_memory:
        results["loss_memory"] = memory_table(a, device)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
