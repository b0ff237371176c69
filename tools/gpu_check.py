"""The first hour on a GPU, in one call: every check and figure one device can give, in under 8 minutes.

    bash run_scripts/gpu_check.sh [--output DIR] [--only NAME ...] [--dry-run]

Phases run in the order that gives the most if time runs out, each under its own limit (the limits
sum to under 8 minutes) and each result streamed to ``DIR/gpu_check.jsonl`` as one JSON line the
moment it is known, so a run cut short keeps everything before the cut:

 1. ``env``         torch, CUDA, the device, triton, the optional packages
 2. ``aot``         tools/check_kernels.py: every Triton kernel compiled for sm_80/sm_90 (registers, spills)
 3. ``kernel_tests`` the kernel tests on real CUDA (no interpreter): what only the GPU can check
 4. ``gemm``        the measured bf16 GEMM rate (the ceiling MFU is compared with, besides the datasheet)
 5. ``bench_kernels`` per-kernel bandwidth against the measured copy bandwidth; eager, torch.compile,
                    Liger-Kernel where importable; one JSON line per case as it is timed
 6. ``attention``   attention at seq 8192 with grouped-query heads: SDPA causal, and document-masked
                    through the trainer's own path (model.attention auto: FlexAttention), then
                    through sdpa's dense mask for comparison
 7. ``nccl``        one NCCL rank: every collective and dtype the project uses, and a batched
                    send/recv to itself (``Group.shift_async``: context parallelism's ring step)
 8. ``resume``      a bf16 training run with async checkpoints, killed and resumed, against an
                    uninterrupted run: the same losses, bit for bit
 9. ``throughput``  2 layers of Llama-3-8B at seq 8192, bf16, the Triton kernels: tokens/s, MFU
                    against the datasheet peak and against the measured GEMM rate (one round of
                    bench_train's timed steps, no start-up runs: what fits its limit); then
    ``memory``      the peak memory of those steps against the planner's estimate for the same
                    layout (:class:`PeakMemoryCheck`: the ratio and its band)
10. ``fp8``         FP8 training (``model.fp8``): every linear of Llama-3 8B and 70B forward + backward
                    in bf16 and each recipe (tools/bench_fp8.py's cases), then 2 layers of Llama-3-8B
                    at seq 4096 trained a few steps in bf16 and in each recipe: tokens/s, the speed-up
                    and the loss

Each phase's output is unbuffered, so a phase cut off at its limit keeps the figures it printed.
The run ends with ``PASS n / FAIL m`` and exits non-zero when anything failed — a phase that did not
run (its tool missing, the time budget spent) or a check without its figure counts as failed: only
``--only`` leaves phases out. One GPU cannot test multi-rank NCCL (tensor, pipeline and data
parallelism across devices): ``tools/smoke_test.py`` does that on a real cluster, every layout
against one process. ``--dry-run`` walks every phase's setup on any machine and prints the plan
without running it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field

from _tool import ROOT, TOOLS

from megapretrain.cli import ToolParser, user_errors

BUDGET_S = 475  # the phases' limits add up to this: under 8 minutes, with room for start-up


@dataclass
class Phase:
    """One check: a command (run in a subprocess under ``limit_s``) or an in-process probe."""
    name: str
    limit_s: int
    what: str
    command: list[str] = field(default_factory=list)
    parse: object = None  # (stdout) -> figures dict, for commands
    config: list[str] = field(default_factory=list)  # --config PATH and overrides its run resolves (checked in
    #                                                 a dry run, on any machine)
    check: object = None  # (figures) -> the record of a check of its figures, written after it

    def describe(self) -> str:
        return f"{self.name:<14} {self.limit_s:>4}s  {self.what}" + (
            f"\n{'':<21}$ {' '.join(self.command)}" if self.command else "")


class Results:
    """The JSON lines file, written (and flushed) a result at a time. A phase that did not run
    (``skip``: the time budget spent, its tool missing, the figures it checks not printed) counts
    as failed: a check that gave no figure has not passed. Phases left out with ``--only`` are not
    run at all."""

    def __init__(self, path: str):
        self.path, self.passed, self.failed, self.skipped = path, 0, 0, 0
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._fh = open(path, "a")

    def write(self, record: dict) -> None:
        record = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **record}
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        status = record.get("status")
        if status == "pass":
            self.passed += 1
        elif status in ("fail", "timeout", "skip"):
            self.failed += 1
            self.skipped += status == "skip"

    def close(self) -> None:
        self._fh.close()


# -- what the commands print, as figures ------------------------------------------------------------


def _bench_train_figures(out: str) -> dict:
    """bench_train's throughput row (``megapretrain STEP_MS (MIN-MAX) TOKENS/S GFLOP/S N%``) and
    its ``peak memory: ... (N bytes ...)`` line, whichever it printed before it ended."""
    figures = {}
    row = r"^megapretrain\s+([\d.]+)\s+\([\d.]+-[\d.]+\)\s+([\d,]+)\s+([\d.]+)\s"
    found = re.search(row, out, re.M)
    if found:
        figures.update(step_ms=float(found.group(1)),
                       tokens_per_s=float(found.group(2).replace(",", "")),
                       tflops=float(found.group(3)) / 1e3)
    peak = re.search(r"^peak memory: .*?\(([\d,]+) bytes", out, re.M)
    if peak:
        figures["peak_bytes"] = int(peak.group(1).replace(",", ""))
    return figures


@dataclass
class PeakMemoryCheck:
    """The peak memory of a phase's training steps (bench_train's
    ``torch.cuda.max_memory_allocated`` over its timed steps) against the planner's peak for the
    same config and layout
    (``planner/memory.py`` through ``simulate/run.py: planned``, as on CUDA: the tensors, without
    the planner's allowance for the CUDA context and allocator slack).

    The band, measured / planned: above 1.15 fails — the planner is held within 5% of the
    trainer's own program at Llama 3 widths (tests/test_simulate_planner.py; this run's layout in
    tests/test_gpu_check.py: 0.3% apart) and that program within 2% of real runs
    (tests/test_simulate_vs_real.py); what CUDA adds beyond the program's tensors (cuBLAS
    workspaces, kernel scratch) is a few hundred MiB, about 1% of this run's ~28 GiB; more than 15%
    over means plans would put layouts where they do not fit. Below 0.5 fails too: an estimate
    above the real peak only leaves memory spare, but twice the real one means the measurement
    missed the step's state or the model counts a part twice — the comparison is void."""
    config: list[str]
    band: tuple[float, float] = (0.5, 1.15)
    name: str = "memory"

    def planned_bytes(self) -> int:
        from megapretrain.simulate.run import planned, resolve_for_simulation
        cfg = _load(self.config)
        return planned(cfg, resolve_for_simulation(cfg, 1), 0, "cuda")["planned_peak_bytes"]

    def describe(self) -> str:
        return (f"memory: planned peak {self.planned_bytes() / 2**30:.2f} GiB; the measured must "
                f"be {self.band[0]:g}-{self.band[1]:g} × it")

    def __call__(self, figures: dict) -> dict:
        planned = self.planned_bytes()
        record = {"phase": self.name, "planned_bytes": planned, "band": list(self.band)}
        measured = figures.get("peak_bytes")
        if measured is None:
            return {**record, "status": "skip", "why": "the phase printed no peak memory"}
        ratio = measured / planned
        record.update(measured_bytes=measured, ratio=round(ratio, 4))
        if self.band[0] <= ratio <= self.band[1]:
            return {**record, "status": "pass"}
        why = (f"measured {measured / 2**30:.2f} GiB is {ratio:.2f} × the planned "
               f"{planned / 2**30:.2f} GiB, outside {self.band[0]:g}-{self.band[1]:g}")
        return {**record, "status": "fail", "why": why}


def _pytest_figures(out: str) -> dict:
    return {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", out)}


def _resume_figures(out: str) -> dict:
    found = re.search(r"^RESUME (\{.*\})$", out, re.M)
    return json.loads(found.group(1)) if found else {}


def _probe_figures(out: str) -> dict:
    """The last ``FIGURES {...}`` line (a probe may print its figures so far after each case)."""
    found = re.findall(r"^FIGURES (\{.*\})$", out, re.M)
    return json.loads(found[-1]) if found else {}


THROUGHPUT = ["--config", os.path.join(ROOT, "configs", "llama3_8b.yaml"), "--model.num_layers", "2",
              "--train.seq_length", "8192", "--train.micro_batch_size", "1", "--train.global_batch_size", "1",
              "--train.rampup_batch_size", "null", "--train.train_tokens", "null", "--train.iters", "10",
              "--schedule.warmup_iters", "0",
              "--parallel.tp", "1", "--parallel.pp", "1", "--parallel.zero", "0", "--parallel.sequence_parallel",
              "false", "--model.kernels", "triton", "--optim.impl", "triton", "--train.precision", "bf16"]


FP8_RUN = ["--config", os.path.join(ROOT, "configs", "llama3_8b.yaml"), "--model.num_layers", "2",
           "--train.seq_length", "4096", "--train.micro_batch_size", "1", "--train.global_batch_size", "2",
           "--train.rampup_batch_size", "null", "--train.train_tokens", "null", "--train.iters", "10",
           "--schedule.warmup_iters", "0", "--parallel.tp", "1", "--parallel.pp", "1", "--parallel.zero", "0",
           "--parallel.sequence_parallel", "false", "--model.kernels", "triton", "--optim.impl", "triton",
           "--train.precision", "bf16", "--model.fp8", "tensorwise"]  # the probe runs none, tensorwise, rowwise


def resume_argv(corpus: str) -> list[str]:
    """The resume phase's training flags (``--run.dir`` added per run)."""
    return ["--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--data.paths", f"[{corpus}_text_document]",
            "--train.device", "cuda", "--train.precision", "bf16", "--train.iters", "20", "--train.eval_interval",
            "0", "--train.deterministic", "true", "--checkpoint.interval", "5", "--checkpoint.async", "true",
            "--logging.tensorboard", "false", "--recovery.action", "none"]


def phases(out_dir: str, python: str) -> list[Phase]:
    """Every phase, in order; commands use ``python`` and write under ``out_dir``."""
    me = [python, os.path.join(TOOLS, "gpu_check.py")]
    tiny = os.path.join(out_dir, "train")
    return [
        Phase("env", 10, "torch, CUDA, device, triton and the optional packages", me + ["--probe", "env"],
              _probe_figures),
        Phase("aot", 55, "every Triton kernel compiled ahead of time for this device's sm_90: registers, spills, "
              "shared memory (CI checks sm_80/90/100)",
              [python, os.path.join(ROOT, "tools", "check_kernels.py"), "--targets", "90",
               "--configs", os.path.join(ROOT, "configs")]),
        Phase("kernel_tests", 80, "the kernel tests on CUDA, compiled (no interpreter)",
              [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
               *(os.path.join(ROOT, "tests", f"test_kernels{s}.py") for s in ("", "_loss", "_model"))],
              _pytest_figures),
        Phase("gemm", 10, "measured bf16 GEMM rate, 8192³", me + ["--probe", "gemm"], _probe_figures),
        Phase("bench_kernels", 50, "per-kernel GB/s against the copy bandwidth (one JSON line per case)",
              [python, os.path.join(ROOT, "tools", "bench_kernels.py"), "--iters", "20",
               "--jsonl", os.path.join(out_dir, "bench_kernels.jsonl")]),
        Phase("attention", 35, "seq 8192, GQA 32/8 heads: SDPA causal; document-masked as the trainer runs it "
              "(model.attention auto, compiled on first use), and with sdpa's dense mask",
              me + ["--probe", "attention"], _probe_figures),
        Phase("nccl", 20, "one NCCL rank: every collective and dtype of parallel/state.py's Group, "
              "and a batched send/recv to itself (Group.shift_async)",
              [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               os.path.join(TOOLS, "gpu_check.py"), "--probe", "nccl"], _probe_figures),
        Phase("resume", 80, "bf16 training, async checkpoints, killed at step 15 and resumed: losses equal to "
              "an uninterrupted run", me + ["--probe", "resume", "--output", tiny], _resume_figures,
              config=resume_argv(os.path.join(tiny, "corpus"))),
        Phase("throughput", 75, "2 layers of Llama-3-8B at seq 8192 (bf16, Triton kernels): "
              "tokens/s, MFU, and the steps' peak memory against the planner's",
              [python, "-u", os.path.join(ROOT, "tools", "bench_train.py"), "--steps", "4",
               "--warmup", "2", "--rounds", "1", "--no-startup", *THROUGHPUT],
              _bench_train_figures, config=THROUGHPUT, check=PeakMemoryCheck(THROUGHPUT)),
        Phase("fp8", 60, "FP8 linears of Llama-3 8B/70B against bf16, then 2 layers of Llama-3-8B at seq 4096 in "
              "bf16, tensorwise and rowwise: tokens/s, speed-up, loss", me + ["--probe", "fp8"], _probe_figures,
              config=FP8_RUN),
    ]


# -- in-process probes (each prints FIGURES {...}) ------------------------------------------------------


def _probe_env() -> dict:
    import importlib.util

    import torch
    figures = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        figures.update(device=p.name, memory_gib=round(p.total_memory / 2**30, 1), sm=f"{p.major}{p.minor}",
                       sms=p.multi_processor_count)
    for name in ("triton", "liger_kernel", "apex", "transformers", "pytest"):
        figures[name] = importlib.util.find_spec(name) is not None
    if not (torch.version.cuda and torch.cuda.is_available()):
        raise SystemExit(f"FIGURES {json.dumps(figures)}\nno CUDA device: a CUDA build of torch and a GPU are needed")
    return figures


def _cuda_time(fn, iters: int) -> float:
    """Median seconds of ``fn`` on the current stream, timed with CUDA events."""
    import torch
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _probe_gemm() -> dict:
    import torch
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seconds = _cuda_time(lambda: a @ b, 20)
    return {"n": n, "ms": seconds * 1e3, "tflops": 2 * n**3 / seconds / 1e12}


def _probe_attention() -> dict:
    """Forward + backward at seq 8192 (eight documents of 1024 tokens): SDPA causal; document
    masking through the trainer's path — ``documents()``, ``model.attention: auto`` resolved for
    this device, the prepared mask's kernel — and through sdpa's dense mask. The figures so far
    are printed after each case, so a timeout keeps them."""
    import torch
    import torch.nn.functional as F

    from megapretrain.model.attention import resolve_attention
    from megapretrain.model.decoder import documents
    b, heads, kv, s, d, eod = 1, 32, 8, 8192, 128, 0
    device = torch.device("cuda")
    q = torch.randn(b, heads, s, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, kv, s, d, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    tokens = torch.ones(b, s, dtype=torch.long, device=device)
    tokens[:, 1023::1024] = eod  # eight documents of 1024 tokens
    kind = resolve_attention("auto", device, dropout=0.0, documents=True)
    mask = documents(tokens, eod, True, False).mask
    start = time.perf_counter()
    documents(tokens, eod, True, False).mask.prepare(kind)
    torch.cuda.synchronize()
    figures = {"trainer_kind": kind, "prepare_ms": (time.perf_counter() - start) * 1e3}
    cases = {"causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
             f"documents_{kind}": lambda: mask.prepare(kind).attend(q, k, v, 0.0),
             "documents_sdpa_dense_mask": lambda: mask.prepare("sdpa").attend(q, k, v, 0.0)}
    for name, attend in cases.items():
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        try:
            seconds = _cuda_time(lambda attend=attend: attend().sum().backward(), 5)
            figures[name] = {"ms": seconds * 1e3, "peak_mib": (torch.cuda.max_memory_allocated() - base) / 2**20}
        except torch.OutOfMemoryError:
            figures[name] = {"error": "out of memory"}
        q.grad = k.grad = v.grad = None
        print(f"FIGURES {json.dumps(figures)}", flush=True)
    return figures


def _probe_nccl() -> dict:
    """Each collective parallel/state.py issues, by the same torch.distributed calls, in every
    dtype it sends, on a one-rank NCCL group (a world of one still goes through NCCL); then the
    batched send/recv of a ring step to itself (:func:`ring_step`)."""
    import torch
    import torch.distributed as dist

    from megapretrain.parallel.state import Group
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")  # torchrun's world of one: init_distributed would skip it
    pg = dist.new_group([0])
    figures = {"backend": dist.get_backend(pg),
               "nccl": ".".join(map(str, torch.cuda.nccl.version())),
               **one_rank_collectives(pg, device)}
    # after the collectives: the group's communicator exists before its first batched send/recv
    figures.update(ring_step(Group("self", [0], pg), device))
    dist.barrier()
    dist.destroy_process_group()
    return figures


def one_rank_collectives(pg, device) -> dict:
    """all_reduce, reduce-scatter and all-gather (parallel/state.py's helpers, async), all_gather,
    broadcast and a MAX all_reduce of fp32, bf16 and fp16 tensors on the one-rank group ``pg``:
    each must leave the values as they were."""
    import torch
    import torch.distributed as dist

    from megapretrain.parallel import state
    figures = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.arange(1 << 20, device=device).to(dtype)
        out = torch.empty_like(x)
        works = [dist.all_reduce(x, group=pg, async_op=True),
                 state._reduce_scatter_single(out, x.clone(), group=pg, async_op=True),
                 state._all_gather_single(out, x, group=pg, async_op=True)]
        for w in works:
            w.wait()
        parts = [torch.empty_like(x)]
        dist.all_gather(parts, x, group=pg)
        dist.broadcast(x, src=0, group=pg)
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=pg)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if not torch.equal(parts[0], x):
            raise SystemExit(f"all_gather of {dtype} returned other values")
        figures[str(dtype).replace("torch.", "")] = "ok"
    return figures


def ring_step(group, device) -> dict:
    """One step of a ring through ``Group.shift_async`` — the batched send/recv
    (``dist.batch_isend_irecv``) context parallelism's ring runs — with an fp32 and a bf16 tensor:
    each rank sends to the next and receives what the previous one sent. On a group of one that is
    a send to itself, which NCCL (2.7+) runs inside a batch; gloo does not (its tests run the same
    code on a ring of two)."""
    import torch
    sends = [torch.arange(1 << 20, device=device, dtype=torch.float32) + group.rank,
             torch.full((4096,), float(group.rank), device=device, dtype=torch.bfloat16)]
    received, work = group.shift_async(sends)
    work.wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    prev = (group.rank - 1) % group.size
    expected = [torch.arange(1 << 20, device=device, dtype=torch.float32) + prev,
                torch.full((4096,), float(prev), device=device, dtype=torch.bfloat16)]
    for got, want in zip(received, expected):
        if not torch.equal(got, want):
            raise SystemExit(f"batched send/recv of {want.dtype} on a ring of {group.size} "
                             f"delivered other values (expected rank {prev}'s)")
    return {"batched_send_recv": f"ok (ring of {group.size})"}


def _probe_resume(out_dir: str) -> dict:
    """Train 20 steps uninterrupted; train again with a fault at step 15 and checkpoints every 5
    (async), restart: the restarted run's losses must equal the uninterrupted one's."""
    corpus = os.path.join(out_dir, "corpus")
    os.makedirs(out_dir, exist_ok=True)
    py = sys.executable
    subprocess.run([py, os.path.join(ROOT, "tools", "build_demo_corpus.py"), "--output", corpus + ".jsonl",
                    "--max-mb", "2"], check=True)
    subprocess.run([py, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", corpus + ".jsonl",
                    "--output-prefix", corpus, "--tokenizer-type", "ByteTokenizer", "--json-keys", "text",
                    "--append-eod", "--workers", "2"], check=True)
    base = [py, "-m", "megapretrain.train", *resume_argv(corpus)]
    straight, broken = os.path.join(out_dir, "straight"), os.path.join(out_dir, "resumed")
    start = time.perf_counter()
    subprocess.run(base + ["--run.dir", straight], check=True)
    first = subprocess.run(base + ["--run.dir", broken, "--faults.exit_at", "15"])
    subprocess.run(base + ["--run.dir", broken], check=True)

    def losses(run_dir: str) -> dict:
        with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
            records = [json.loads(line) for line in fh]
        return {r["iter"]: r["loss"] for r in records if "loss" in r and "event" not in r}

    a, b = losses(straight), losses(broken)
    equal = sorted(a) == sorted(b) == list(range(1, 21)) and all(a[i] == b[i] for i in a)
    return {"equal": equal, "first_exit": first.returncode, "final_loss": a.get(20),
            "seconds": time.perf_counter() - start, "differ_at": [i for i in sorted(a) if a.get(i) != b.get(i)][:5]}


def _probe_fp8() -> dict:
    """tools/bench_fp8.py's linears (8B and 70B shapes, a few runs each), then the FP8_RUN model
    built and trained 1 + 3 steps in bf16 and in each recipe, from the same seed and batch. The
    figures so far are printed after each part, so a timeout keeps them."""
    import argparse

    import bench_fp8
    import torch
    from bench_train import load, megapretrain_step, time_steps

    from megapretrain.parallel.fp8 import RECIPES
    device = torch.device("cuda")
    linears = bench_fp8.bench(argparse.Namespace(models=list(bench_fp8.MODELS), tokens=8192, tp=1, iters=5,
                                                 compile=False, jsonl=None), device)
    figures = {"layer": bench_fp8.layer_totals(linears)}
    print(f"FIGURES {json.dumps(figures)}", flush=True)
    at = FP8_RUN.index("--config")
    for recipe in ("none", *RECIPES):
        cfg, plan = load(FP8_RUN[at + 1], FP8_RUN[:at] + FP8_RUN[at + 2:] + ["--model.fp8", recipe])
        step, _ = megapretrain_step(cfg, plan, device)
        times, loss = time_steps(step, 1, 3, device)
        figures[recipe] = {"tokens_per_s": plan.tokens_per_batch / sorted(times)[1], "loss": loss}
        if recipe != "none":
            figures[recipe]["speedup"] = figures[recipe]["tokens_per_s"] / figures["none"]["tokens_per_s"]
        print(f"FIGURES {json.dumps(figures)}", flush=True)
        del step
        torch.cuda.empty_cache()
    return figures


PROBES = {"env": _probe_env, "gemm": _probe_gemm, "attention": _probe_attention, "nccl": _probe_nccl,
          "fp8": _probe_fp8}


def run_probe(name: str, output: str | None) -> int:
    if name == "resume":
        figures = _probe_resume(output or os.path.join("runs", "gpu_check", "train"))
        print(f"RESUME {json.dumps(figures)}")
        return 0 if figures["equal"] else 1
    figures = PROBES[name]()
    print(f"FIGURES {json.dumps(figures)}")
    return 0


# -- the driver ---------------------------------------------------------------------------------------


def run_phase(phase: Phase, results: Results, left_s: float) -> dict:
    limit = int(min(phase.limit_s, left_s))
    if left_s < 5:
        results.write({"phase": phase.name, "status": "skip", "why": "the time budget is spent"})
        return {}
    missing = [c for c in phase.command if c.startswith(ROOT) and c.endswith(".py") and not os.path.exists(c)]
    if missing:
        results.write({"phase": phase.name, "status": "skip", "why": f"{missing[0]} is not in this checkout"})
        return {}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiled kernels
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"  # a phase cut off at its limit keeps every line it printed
    start = time.perf_counter()
    try:
        done = subprocess.run(phase.command, capture_output=True, text=True, timeout=limit, env=env, cwd=ROOT)
        status = "pass" if done.returncode == 0 else "fail"
        out, err, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        status, code = "timeout", None
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    record = {"phase": phase.name, "status": status, "seconds": round(time.perf_counter() - start, 1),
              "limit_s": limit, "exit": code, "command": phase.command}
    if phase.parse:
        record["figures"] = phase.parse(out)
    if status != "pass":
        record["tail"] = (out[-1500:] + "\n" + err[-2500:]).strip()
    results.write(record)
    print(f"{phase.name:<14} {status:<8} {record['seconds']:>6.1f}s  {json.dumps(record.get('figures', {}))[:150]}",
          flush=True)
    return record.get("figures", {})  # printed before a timeout or a failure: measured too


def run_check(phase: Phase, figures: dict, results: Results) -> None:
    """The check of a phase's figures (:class:`PeakMemoryCheck`), as one more result."""
    record = phase.check(figures)
    results.write(record)
    shown = {k: record[k] for k in ("measured_bytes", "planned_bytes", "ratio", "why")
             if k in record}
    print(f"{record['phase']:<14} {record['status']:<8} {'':>7}  {json.dumps(shown)[:150]}",
          flush=True)


def _load(argv: list[str]):
    """A phase's config (``--config PATH`` and overrides), its vocabulary set as its run sets it."""
    from megapretrain.config import load_config
    at = argv.index("--config")
    cfg = load_config(argv[at + 1], argv[:at] + argv[at + 2:])
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = 257  # the byte tokenizer's, as the run reads it from the tokenizer
    return cfg


def check_config(argv: list[str]) -> str:
    """What a phase's training run resolves to: its layout and sizes, or the error it would stop on."""
    from megapretrain.errors import UserError
    from megapretrain.resolve import resolve
    try:
        cfg = _load(argv)
        run = resolve(cfg, 1)
    except UserError as exc:
        raise UserError(f"gpu_check: a phase's config does not resolve: {exc}") from None
    return (f"{run.layout.describe()}, {run.sizes.tokens_per_batch:,} tokens/step, {run.sizes.iters} steps, "
            f"{cfg.train.precision}" + (f"; {run.sizes.fp8}" if run.sizes.fp8 else ""))


def derived(figures: dict) -> dict:
    """MFU of the throughput run against the datasheet peak and the measured GEMM rate."""
    from megapretrain.monitor.flops import find_device, peak_for
    tflops = figures.get("throughput", {}).get("tflops")
    out = {}
    if not tflops:
        return out
    device = find_device(figures.get("env", {}).get("device", "")) if figures.get("env") else None
    if device is not None:
        out["mfu_datasheet"] = tflops / peak_for(device, "bf16")
        out["datasheet_tflops"] = peak_for(device, "bf16")
    gemm = figures.get("gemm", {}).get("tflops")
    if gemm:
        out["of_measured_gemm"] = tflops / gemm
    return out


def parse_args(argv):
    ap = ToolParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--output", default=None, help="directory for gpu_check.jsonl and the phases' files "
                                                   "(default: $OUT when set, else runs/gpu_check/TIME)")
    ap.add_argument("--only", nargs="+", default=None, help="run only these phases")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (each phase's setup) and run nothing")
    ap.add_argument("--probe", choices=[*PROBES, "resume"], help=argparse.SUPPRESS)  # one phase's own process
    return ap.parse_args(argv)


@user_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.probe:
        return run_probe(args.probe, args.output)
    out_dir = args.output or os.environ.get("OUT") or os.path.join(
        "runs", "gpu_check", time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    out_dir = os.path.abspath(out_dir)
    todo = phases(out_dir, sys.executable)
    names = [p.name for p in todo]
    if args.only:
        unknown = [n for n in args.only if n not in names]
        if unknown:
            print(f"error: --only {unknown[0]}: not a phase (phases: {', '.join(names)})", file=sys.stderr)
            return 2
        todo = [p for p in todo if p.name in args.only]
    total = sum(p.limit_s for p in todo)
    print(f"gpu_check: {len(todo)} phases, limits {total}s in all (budget {BUDGET_S}s); results stream to "
          f"{os.path.join(out_dir, 'gpu_check.jsonl')}")
    if args.dry_run:
        for p in todo:
            print(p.describe())
            if p.config:
                print(f"{'':<21}config: {check_config(p.config)}")
            if p.check:
                print(f"{'':<21}{p.check.describe()}")
        missing = [c for p in todo for c in p.command if c.startswith(ROOT) and c.endswith(".py")
                   and not os.path.exists(c)]
        for path in missing:
            print(f"note: {os.path.relpath(path, ROOT)} is not in this checkout; its phase will be "
                  "skipped (a failure)")
        return 0
    results = Results(os.path.join(out_dir, "gpu_check.jsonl"))
    start = time.perf_counter()
    results.write({"phase": "start", "root": ROOT, "phases": [p.name for p in todo], "budget_s": BUDGET_S})
    figures = {}
    try:
        for p in todo:
            figures[p.name] = run_phase(p, results, BUDGET_S - (time.perf_counter() - start))
            if p.check:
                run_check(p, figures[p.name], results)
        if derived(figures):
            results.write({"phase": "mfu", **derived(figures)})
            print(f"mfu: {json.dumps(derived(figures))}")
    finally:
        results.write({"phase": "end", "passed": results.passed, "failed": results.failed,
                       "skipped": results.skipped,
                       "seconds": round(time.perf_counter() - start, 1)})
        results.close()
    skipped = f" ({results.skipped} of them skipped)" if results.skipped else ""
    print(f"PASS {results.passed} / FAIL {results.failed}{skipped}  "
          f"({os.path.join(out_dir, 'gpu_check.jsonl')})")
    return 1 if results.failed else 0


if __name__ == "__main__":
    sys.exit(main())
