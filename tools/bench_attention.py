"""Peak memory and time of attention forward + backward under document masking, per kernel.

    python tools/bench_attention.py [--seqs 1024 2048 4096 8192] [--docs short long]
        [--kinds sdpa blockwise flex causal] [--heads 8 --kv-heads 2 --head-dim 64] [--iters 2] [--json]

Each case runs one attention call (b, heads, s, d) with grouped-query heads over a packed sample
of documents — ``short``: lengths drawn from 64..448 tokens; ``long``: two documents, 3/8 and 5/8 of
the sample — through the kernel ``model.attention`` names (``model/attention.py``), with the mask
built as the trainer builds it (``documents()``, then ``prepare``): ``sdpa`` with the dense
(b, 1, s, s) mask, the reference; ``blockwise``; ``flex`` (CUDA only: torch has no FlexAttention
backward on CPU). ``causal`` is SDPA's causal kernel without documents, the floor to compare with.

Peak memory is what the case adds above its inputs, the gradients it returns included: on CPU the
peak resident set of a fresh process (glibc told to map large blocks on their own and unmap them
when freed, so the resident set follows what is allocated; one warm-up run first), on CUDA the
allocator's peak. Time: the median of ``--iters`` runs after the warm-up. The last lines give each
kernel's memory growth from the shortest sequence to the longest against the growth of s and of s².
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing as mp
import sys
import time

import torch
import torch.nn.functional as F
from _tool import rss_bytes

from megapretrain.cli import ToolParser, number, user_errors
from megapretrain.errors import UserError

KINDS = ("sdpa", "blockwise", "flex", "causal")
DOCS = ("short", "long")
EOD = 0


class BenchArgumentError(UserError):
    """A bad flag of tools/bench_attention.py."""


def parse_args(argv=None):
    ap = ToolParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    count = number(int, 1, what="an integer of at least 1")
    ap.add_argument("--seqs", type=number(int, 2, what="a sequence length of at least 2 tokens"), nargs="+",
                    default=[1024, 2048, 4096, 8192], help="sequence lengths")
    ap.add_argument("--docs", nargs="+", choices=DOCS, default=list(DOCS), help="document layouts of a sample")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="kernels to measure")
    ap.add_argument("--batch", type=count, default=1)
    ap.add_argument("--heads", type=count, default=8, help="query heads")
    ap.add_argument("--kv-heads", type=count, default=2, help="key/value heads (grouped-query attention)")
    ap.add_argument("--head-dim", type=count, default=64)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--iters", type=count, default=2, help="timed runs per case (after one warm-up)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--threads", type=count, default=None, help="CPU threads (default: torch's, one per core)")
    ap.add_argument("--json", action="store_true", help="one JSON object per case instead of the table")
    a = ap.parse_args(argv)
    if a.heads % a.kv_heads:
        raise BenchArgumentError(f"--kv-heads {a.kv_heads} must divide --heads {a.heads}")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise BenchArgumentError("--device cuda: no CUDA device is visible (use --device cpu)")
    return a


def doc_tokens(seq: int, layout: str, batch: int) -> torch.Tensor:
    """(batch, seq) token ids whose EODs end the documents of ``layout`` (the same every run)."""
    g = torch.Generator().manual_seed(seq)
    tokens = torch.ones(batch, seq, dtype=torch.long)
    for row in tokens:
        if layout == "long":
            row[3 * seq // 8 - 1] = EOD
            continue
        end = -1
        while True:
            end += int(torch.randint(64, 449, (), generator=g))
            if end >= seq:
                break
            row[end] = EOD
    return tokens


def _case(a, kind: str, layout: str, seq: int, device: torch.device):
    """Inputs (q, k, v) and the call of one case (its mask prepared outside the timed call, once
    per micro-batch, as the trainer does)."""
    from megapretrain.model.decoder import documents

    dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(a.batch, a.heads, seq, a.head_dim, generator=g, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(a.batch, a.kv_heads, seq, a.head_dim, generator=g, device=device, dtype=dtype,
                        requires_grad=True) for _ in range(2))
    if kind == "causal":
        return (q, k, v), lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    mask = documents(doc_tokens(seq, layout, a.batch).to(device), EOD, True, False).mask
    return (q, k, v), lambda: mask.prepare(kind).attend(q, k, v, 0.0)


def _step(call, inputs) -> None:
    call().sum().backward()
    for t in inputs:
        t.grad = None


def _median_s(fn, iters: int, sync) -> float:
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _cpu_child(a, kind, layout, seq, results) -> None:
    """One case in a fresh process: peak resident memory above the inputs, and its median time."""
    torch.set_num_threads(a.threads)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD: every block of 128 KB or more its own mapping
    libc.mallopt(-1, 128 << 10)  # M_TRIM_THRESHOLD
    inputs, call = _case(a, kind, layout, seq, torch.device("cpu"))
    _step(call, inputs)  # warm-up: one-time allocations, and the prepared mask (kept, as a step keeps it)
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set (VmHWM) to the current one
    base = rss_bytes("VmRSS")
    times = []
    for i in range(a.iters):
        start = time.perf_counter()
        call().sum().backward()
        times.append(time.perf_counter() - start)
        if i == 0:  # the peak of a step, the gradients it returns included
            peak = rss_bytes("VmHWM") - base
        for t in inputs:
            t.grad = None
    seconds = sorted(times)[len(times) // 2]
    results.put((peak, seconds))


def measure(a, kind: str, layout: str, seq: int, device: torch.device) -> tuple[int, float]:
    """(peak bytes, seconds) of one case's forward + backward."""
    if device.type == "cuda":
        inputs, call = _case(a, kind, layout, seq, device)
        _step(call, inputs)  # warm-up (and FlexAttention's compilation)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        seconds = _median_s(lambda: _step(call, inputs), a.iters, torch.cuda.synchronize)
        return torch.cuda.max_memory_allocated(device) - base, seconds
    ctx = mp.get_context("spawn")  # a fresh process per case: no freed-but-kept heap from an earlier one
    results = ctx.Queue()
    proc = ctx.Process(target=_cpu_child, args=(a, kind, layout, seq, results))
    proc.start()
    out = results.get(timeout=3600)
    proc.join()
    return out


def _growth(rows: list[dict], seqs: list[int]) -> list[str]:
    """Per kernel and layout: memory at the longest sequence over memory at the shortest."""
    lo, hi, lines = min(seqs), max(seqs), []
    for (kind, layout) in dict.fromkeys((r["kind"], r["docs"]) for r in rows):
        by_seq = {r["seq"]: r["peak_bytes"] for r in rows if (r["kind"], r["docs"]) == (kind, layout)}
        if lo in by_seq and hi in by_seq and lo < hi:
            lines.append(f"  {kind:<10} {layout:<6} seq {lo} -> {hi}: memory x{by_seq[hi] / max(by_seq[lo], 1):.1f} "
                         f"(s grew x{hi / lo:.0f}, s² x{(hi / lo) ** 2:.0f})")
    return lines


@user_errors
def main(argv=None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device("cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    a.threads = a.threads or torch.get_num_threads()
    kinds = [k for k in a.kinds if k != "flex" or device.type == "cuda"]
    if len(kinds) < len(a.kinds):
        print("note: flex skipped: torch's FlexAttention has no backward on CPU", file=sys.stderr)
    if not a.json:
        print(f"attention forward + backward on {device.type} ({a.threads} threads): batch {a.batch}, {a.heads} "
              f"query heads / {a.kv_heads} kv heads of {a.head_dim}, {a.dtype}; peak memory above the inputs")
        print(f"{'seq':>6} {'docs':<6} {'kind':<10} {'ms':>10} {'peak MiB':>10} {'MiB per 1k tokens':>18}")
    rows = []
    for seq in a.seqs:
        for layout in a.docs:
            for kind in kinds:
                if kind == "causal" and layout != a.docs[0]:
                    continue  # no documents: one row per sequence length
                peak, seconds = measure(a, kind, layout, seq, device)
                row = {"seq": seq, "docs": "none" if kind == "causal" else layout, "kind": kind,
                       "ms": seconds * 1e3, "peak_bytes": peak, "device": device.type}
                rows.append(row)
                if a.json:
                    print(json.dumps(row), flush=True)
                else:
                    print(f"{seq:>6} {row['docs']:<6} {kind:<10} {row['ms']:>10.1f} {peak / 2**20:>10.1f} "
                          f"{peak / 2**20 / (seq / 1024):>18.2f}", flush=True)
    if not a.json and len(a.seqs) > 1:
        print("memory growth:")
        print("\n".join(_growth(rows, a.seqs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
