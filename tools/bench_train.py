"""Training throughput and the step's anatomy: megapretrain's full optimizer steps, measured
against this machine's matmul ceiling and, optionally, against Hugging Face and nanoGPT.

    python tools/bench_train.py --config configs/bench_cpu.yaml --compare-hf
    python tools/bench_train.py --config configs/bench_cpu.yaml --compare-hf --compare-nanogpt ../nanoGPT
    python tools/bench_train.py --config configs/tiny.yaml --steps 10 --warmup 2 --threads 2
    python tools/bench_train.py --config configs/bench_cpu.yaml --profile

The model and optimizer are built exactly as training builds them (``build_model_chunks``,
``MixedPrecisionAdamW`` and its parameter-gather hooks on the model); each step runs every
micro-batch of the global batch forward and backward, then reduces grads and steps AdamW on the
device, reading nothing back (as the trainer between its logging steps) — on synthetic random
tokens, so no dataset is read. Single process, tp = pp = 1.

It prints:

- the **matmul ceiling**: the best GFLOP/s of a square matmul in the run's precision on this
  device, measured in the same run (the figure a step's FLOP/s is held against);
- the **anatomy** of one step, counted at the dispatcher (``monitor/anatomy.py``): ops dispatched
  per decoder layer forward + backward and per step, host syncs per step (scalar reads and
  device-to-host copies), tensors allocated per step, the time inside the ops and the rest —
  Python and framework time — of the step's median time;
- **throughput**: the systems timed in interleaved rounds (each round runs ``--steps`` steps of
  each, in a rotated order, so that a change of load hits them alike), the median step, tokens/s,
  achieved GFLOP/s (by the Llama FLOPs formula of ``model/decoder.py``) and their share of the
  ceiling; with peers, each ratio's median over the rounds and its spread (lowest–highest); on a
  GPU without peers, the **peak memory** of the timed steps (``torch.cuda.max_memory_allocated``,
  what ``tools/gpu_check.py`` holds against the planner's estimate);
- the **start-up**: seconds from process start to the first step of ``python -m megapretrain.train``
  on this config (a small generated corpus in a temporary directory), with its data indices
  built (cold) and then cached (warm); ``--no-startup`` leaves it out.

``--compare-hf`` times ``transformers.LlamaForCausalLM`` of the same sizes the way it is usually
trained on CPU: fp32 parameters, ``torch.autocast(bfloat16)`` when precision is bf16, SDPA
attention, ``torch.optim.AdamW`` with the same gradient clipping, batch and micro-batching.
``--compare-nanogpt DIR`` times the ``GPT`` of a nanoGPT checkout (its ``model.py``) at the same
layers, heads, width, context, vocabulary and batch, as its train.py trains it.

CPU notes: with more threads than free cores, OpenMP spin-waiting makes elementwise ops up to ~100×
slower; check the load (``uptime``) and pass ``--threads`` accordingly. All models run in one
process under the same allocator, set as training sets it on CPU (``megapretrain/host_memory.py``:
freed blocks are kept for the next step rather than page-faulted afresh).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import _tool  # noqa: F401  (the package installed, or one line saying how)
import numpy as np
import torch
from _bench_peers import hf_step, load_nanogpt, nanogpt_step

from megapretrain.cli import ToolParser, non_negative_int, positive_int, user_errors
from megapretrain.config import load_config
from megapretrain.errors import ConfigError
from megapretrain.host_memory import keep_freed_host_memory
from megapretrain.model.build import DTYPES, build_model_chunks, deferred_initializer
from megapretrain.model.decoder import flops_per_token
from megapretrain.monitor.anatomy import DispatchCounter, count_in_module
from megapretrain.monitor.flops import slow_half_precision_warning
from megapretrain.optim.optimizer import MixedPrecisionAdamW
from megapretrain.parallel.state import ParallelState
from megapretrain.resolve import resolve

BYTE_VOCAB = 257  # ByteTokenizer: 256 bytes + EOS


def parse_args(argv: list[str]):
    ap = ToolParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                 epilog="Any other --section.key VALUE overrides the config.")
    ap.add_argument("--config", required=True, help="YAML config, e.g. configs/bench_cpu.yaml")
    ap.add_argument("--steps", type=positive_int, default=10, help="timed optimizer steps per round (default 10)")
    ap.add_argument("--warmup", type=non_negative_int, default=2,
                    help="untimed steps of each system before its first round (default 2)")
    ap.add_argument("--rounds", type=positive_int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--threads", type=non_negative_int, default=0,
                    help="torch CPU threads (0: train.threads, else all cores)")
    ap.add_argument("--compare-hf", action="store_true", help="also time transformers.LlamaForCausalLM")
    ap.add_argument("--compare-nanogpt", metavar="DIR", help="also time the GPT of a nanoGPT checkout in DIR")
    ap.add_argument("--no-startup", action="store_true", help="do not measure the start-up to the first step")
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table of one step")
    return ap.parse_known_args(argv)


def load(path: str, overrides: list[str]):
    cfg = load_config(path, overrides)
    if cfg.model.vocab_size is None:
        if cfg.data.tokenizer.type != "ByteTokenizer":
            raise ConfigError("model.vocab_size is null: set it (the benchmark loads no tokenizer)")
        cfg.model.vocab_size = BYTE_VOCAB
    plan = resolve(cfg, 1).sizes
    if plan.tp != 1 or plan.pp != 1:
        raise ConfigError(f"the benchmark runs one process: use --parallel.tp 1 --parallel.pp 1 "
                          f"(got tp={plan.tp} pp={plan.pp})")
    return cfg, plan


def micro_batches(cfg, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch of random tokens as (inputs, targets) micro-batches."""
    t = cfg.train
    g = torch.Generator().manual_seed(t.seed)
    ids = torch.randint(0, cfg.model.vocab_size, (t.global_batch_size, t.seq_length + 1), generator=g)
    return [(c[:, :-1].to(device), c[:, 1:].to(device)) for c in ids.split(t.micro_batch_size)]


def time_steps(step, warmup: int, steps: int, device) -> tuple[list[float], torch.Tensor]:
    """Run ``warmup`` + ``steps`` calls of ``step()``; returns the timed durations and the last
    step's loss sum (a device tensor: nothing is read between the steps)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, loss = [], None
    for i in range(warmup + steps):
        sync()
        start = time.perf_counter()
        loss = step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times, loss


def matmul_ceiling(dtype: torch.dtype, device, sizes=(512, 1024, 2048), repeats: int = 3) -> tuple[float, int]:
    """The best GFLOP/s of an n×n matmul in ``dtype`` on ``device`` over ``sizes``, and its n."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = (0.0, 0)
    for n in sizes:
        a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
        torch.mm(a, b)  # warm up
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            torch.mm(a, b)
            sync()
            best = max(best, (2 * n**3 / max(time.perf_counter() - start, 1e-9) / 1e9, n))
    return best


# -- megapretrain ---------------------------------------------------------------------------------


def megapretrain_step(cfg, plan, batches, device):
    """A closure running one training step as the trainer does between its logging steps (nothing
    read back), the model, its optimizer and the model's FLOPs/token."""
    ps = ParallelState(device=device)
    torch.manual_seed(cfg.train.seed)
    (model,), specs = build_model_chunks(cfg, ps)  # pp 1: one chunk, built as training builds it
    model.train()
    opt = MixedPrecisionAdamW(list(model.named_parameters()), specs, cfg.optim, cfg.train.precision, ps,
                              zero=cfg.parallel.zero, bucket_size_mb=cfg.parallel.bucket_size_mb,
                              initialize=deferred_initializer([model], specs, cfg.train.seed))
    opt.hook_models([model])  # the parameter-gather hooks training attaches (a compiled layer must not trace them)
    opt.buffers.grad_scale_checks = []  # as the trainer: the loss's backward brings what it announced
    fp16 = opt.scaler.dynamic

    def step() -> torch.Tensor:
        opt.zero_grad()
        total = torch.zeros((), device=device)
        scale = opt.scaler.scale / plan.tokens_per_batch
        for i, (tokens, targets) in enumerate(batches):
            losses = model(tokens, targets, loss_grad_scale=scale)  # (b, s) fp32 per-token losses
            with opt.grad_sync(last=i == len(batches) - 1):
                (losses.sum() * scale).backward()
            total += losses.detach().sum()
        opt.reduce_grads()
        _, skipped = opt.step_on_device(cfg.optim.lr)
        opt.buffers.grad_scale_checks.clear()
        if fp16:  # the next step's loss scale needs this one's outcome (as in the trainer)
            opt.settle(bool(skipped))
        return total

    return step, model, flops_per_token(model.args, cfg.train.seq_length)


def anatomy(step, model) -> tuple[DispatchCounter, float]:
    """One step counted at the dispatcher, and its wall time; ``scoped_ops`` are the first decoder
    layer's (forward and backward, over all micro-batches)."""
    counter = DispatchCounter()
    first_layer = next(iter(model.layers.values()))
    hooks = count_in_module(counter, first_layer)
    try:
        start = time.perf_counter()
        with counter:
            step()
        wall = time.perf_counter() - start
    finally:
        for h in hooks:
            h.remove()
    return counter, wall


def describe_anatomy(counter: DispatchCounter, wall_s: float, micro: int) -> list[str]:
    """The counted step's figures. Python and framework time is its wall time less the time inside
    the ops, both of that one step (so that a load changing between steps does not skew it); it
    includes the counter's own cost per op, so it is an upper bound."""
    python_s = max(0.0, wall_s - counter.op_seconds)
    return [f"  ops dispatched per layer (forward + backward, one micro-batch): {counter.scoped_ops / micro:,.0f}",
            f"  ops dispatched per step: {counter.ops:,} ({micro} micro-batches)",
            f"  host syncs per step: {counter.syncs} ({counter.scalar_reads} scalar reads, "
            f"{counter.host_copies} device-to-host copies)",
            f"  tensors allocated per step: {counter.allocations:,}",
            f"  time in ops: {1e3 * counter.op_seconds:,.1f} ms of the counted step's {1e3 * wall_s:,.1f} ms; "
            f"Python and framework: {1e3 * python_s:,.1f} ms ({100 * python_s / wall_s:.0f}%, at most: the "
            "counter's own cost included)"]


# -- start-up -------------------------------------------------------------------------------------


def startup_seconds(config: str, overrides: list[str], cfg) -> tuple[tuple, tuple, str]:
    """(Seconds, CPU seconds) from process start to the first step of ``python -m
    megapretrain.train`` on this config and a generated corpus: with the data indices to build
    (cold), then cached (warm); and the failed run's last line, if it failed."""
    from megapretrain.data.indexed_dataset import IndexedDatasetBuilder

    t = cfg.train
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "startup_text_document")
        builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
        rng = np.random.default_rng(0)
        for _ in range(64 * t.global_batch_size // 4 + 16):  # documents of ~4 samples: a few steps' worth
            builder.add_document(rng.integers(0, 256, size=4 * t.seq_length).tolist() + [256])
        builder.finalize(prefix + ".idx")
        figures = []
        for run in ("cold", "warm"):
            run_dir = os.path.join(tmp, f"run_{run}")
            argv = [sys.executable, "-m", "megapretrain.train", "--config", config, *overrides,
                    "--data.paths", f"[{prefix}]", "--data.tokenizer.type", "ByteTokenizer",
                    "--data.tokenizer.model", "null", "--data.cache_dir", os.path.join(tmp, "cache"),
                    "--model.vocab_size", str(max(cfg.model.vocab_size, BYTE_VOCAB)),  # the corpus's byte ids
                    "--run.dir", run_dir, "--train.iters", "1", "--schedule.warmup_iters", "0",
                    "--schedule.decay_iters", "null", "--train.eval_interval", "0",
                    "--checkpoint.interval", "0", "--logging.wandb", "false"]  # TensorBoard as configured
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode != 0:
                return (), (), (done.stderr.strip().splitlines() or ["no output"])[-1]
            with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
                events = [r for r in map(json.loads, fh) if r.get("event") == "first_step"]
            figures.append((events[0]["startup_s"], events[0]["startup_cpu_s"]) if events else (None, None))
    return figures[0], figures[1], ""


# -- report ---------------------------------------------------------------------------------------


def interleaved(systems: dict, rounds: int, warmup: int, steps: int, device) -> dict[str, list[list[float]]]:
    """Each system's step times per round; round r runs the systems in an order rotated by r."""
    names, times = list(systems), {name: [] for name in systems}
    for name in names:
        time_steps(systems[name], warmup, 0, device)
    if device.type == "cuda":  # the timed steps' peak (the state built and warmed up included)
        torch.cuda.reset_peak_memory_stats(device)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(time_steps(systems[name], 0, steps, device)[0])
    return times


def describe_throughput(times: dict, tokens: int, flops: dict, ceiling: float) -> list[str]:
    lines = [f"{'system':<13} {'step ms':>9} {'(min-max)':>17} {'tokens/s':>10} {'GFLOP/s':>9} {'of ceiling':>10}"]
    for name, rounds in times.items():
        flat = [t for r in rounds for t in r]
        median = statistics.median(flat)
        gflops = flops[name] * tokens / median / 1e9
        lines.append(f"{name:<13} {1e3 * median:9.1f} {f'({1e3 * min(flat):.1f}-{1e3 * max(flat):.1f})':>17} "
                     f"{tokens / median:10,.0f} {gflops:9.1f} {100 * gflops / ceiling:9.0f}%")
    ours = times["megapretrain"]
    for name, rounds in times.items():
        if name == "megapretrain":
            continue
        ratios = [statistics.median(p) / statistics.median(m) for m, p in zip(ours, rounds)]
        lines.append(f"megapretrain / {name}: {statistics.median(ratios):.2f}× tokens/s (per round "
                     f"{min(ratios):.2f}-{max(ratios):.2f}×, {len(ratios)} rounds)")
    return lines


def compile_report() -> str:
    """What Dynamo did: frames compiled (each recompilation is one more), graphs and graph breaks."""
    from torch._dynamo.utils import counters

    return (f"torch.compile: {counters['frames']['ok']} frames compiled, {counters['stats']['unique_graphs']} "
            f"graphs, {sum(counters['graph_break'].values())} graph breaks")


def profile(step, device) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        step()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25))


def peers(args, cfg, plan, batches, device, flops: float) -> tuple[dict, dict]:
    """The peer systems asked for (steps and FLOPs/token), saying which are left out and why."""
    systems, peer_flops = {}, {}
    if args.compare_hf:
        systems["transformers"], peer_flops["transformers"] = hf_step(cfg, plan, batches, device), flops
    if args.compare_nanogpt:
        module = load_nanogpt(args.compare_nanogpt)
        if module is None:
            print(f"nanogpt: skipped: {args.compare_nanogpt} holds no nanoGPT model.py (GPT, GPTConfig); "
                  "git clone https://github.com/karpathy/nanoGPT there to compare")
        else:
            systems["nanogpt"], peer_flops["nanogpt"] = nanogpt_step(module, cfg, plan, batches, device), flops
    return systems, peer_flops


@user_errors
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    cfg, plan = load(args.config, overrides)
    want = cfg.train.device
    device = torch.device("cuda" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu")
    threads = args.threads or cfg.train.threads
    if threads:
        torch.set_num_threads(threads)
    if device.type == "cpu":
        keep_freed_host_memory()  # as train.py does on CPU; every model below runs with it
    t = cfg.train
    slow = slow_half_precision_warning(t.precision) if device.type == "cpu" and t.precision != "fp32" else None
    if slow:
        print(f"warning: {slow}", file=sys.stderr)
    print(f"config {args.config} | precision {t.precision} | device {device} | threads "
          f"{torch.get_num_threads()} | cpus {os.cpu_count()} | load {os.getloadavg()[0]:.2f}")
    print(f"{plan.tokens_per_batch:,} tokens/step = global batch {t.global_batch_size} × seq {t.seq_length} "
          f"(micro-batch {t.micro_batch_size}, {plan.grad_accum} per step) | vocab {plan.padded_vocab:,} (padded)")
    ceiling, n = matmul_ceiling(DTYPES[t.precision], device)
    print(f"matmul ceiling: {ceiling:,.1f} GFLOP/s ({t.precision} {n}×{n} matmul, best of 3 per size, this run)")

    batches = micro_batches(cfg, device)
    start = time.perf_counter()
    step, model, flops = megapretrain_step(cfg, plan, batches, device)
    print(f"megapretrain built in {time.perf_counter() - start:.1f} s | {flops:.3g} FLOPs/token")
    systems, peer_flops = peers(args, cfg, plan, batches, device, flops)
    systems = {"megapretrain": step, **systems}
    times = interleaved(systems, args.rounds, args.warmup, args.steps, device)
    print(f"throughput: {args.rounds} interleaved rounds of {args.steps} steps each "
          f"(after {args.warmup} warm-up steps); medians over all the rounds' steps")
    for line in describe_throughput(times, plan.tokens_per_batch, {"megapretrain": flops, **peer_flops}, ceiling):
        print(line, flush=True)
    if device.type == "cuda" and len(systems) == 1:
        peak = torch.cuda.max_memory_allocated(device)
        print(f"peak memory: {peak / 2**30:.2f} GiB allocated in the timed steps ({peak:,} bytes, "
              "torch.cuda.max_memory_allocated)", flush=True)
    print("anatomy of a megapretrain step:")
    for line in describe_anatomy(*anatomy(step, model), plan.grad_accum):
        print(line)
    if cfg.train.compile:
        print(compile_report())
    if args.profile:
        profile(step, device)
    if not args.no_startup:
        cold, warm, error = startup_seconds(args.config, overrides, cfg)
        if error:
            print(f"start-up: not measured: the training run failed: {error}")
        else:
            print(f"start-up to the first step (python -m megapretrain.train, this config): cold {cold[0]:.1f} s "
                  f"({cold[1]:.1f} s CPU; data indices built), warm {warm[0]:.1f} s ({warm[1]:.1f} s CPU; cached)")
    print(f"load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
