"""Training throughput: full optimizer steps of megapretrain (optionally against Hugging Face).

    python tools/bench_train.py --config configs/bench_cpu.yaml --compare-hf
    python tools/bench_train.py --config configs/bench_cpu.yaml --compare-hf --train.precision fp32
    python tools/bench_train.py --config configs/tiny.yaml --steps 10 --warmup 2 --threads 2
    python tools/bench_train.py --config configs/bench_cpu.yaml --profile

The model and optimizer are built exactly as training builds them (``build_model_chunks``,
``MixedPrecisionAdamW`` and its parameter-gather hooks on the model); each step runs every
micro-batch of the global batch forward and backward, then reduces grads and steps AdamW — on
synthetic random tokens, so no dataset is read.
Start-up and ``--warmup`` steps are excluded; the median step time of ``--steps`` steps is reported.
With ``--train.compile true`` it also prints what Dynamo compiled (frames, graphs, graph breaks).
Dotted overrides (``--train.precision fp32``) work as for ``python -m megapretrain.train``.
Single process, tp = pp = 1.

``--compare-hf`` times ``transformers.LlamaForCausalLM`` of the same sizes the way it is usually
trained on CPU: fp32 parameters, ``torch.autocast(bfloat16)`` when precision is bf16, SDPA
attention, ``torch.optim.AdamW`` with the same gradient clipping, batch and micro-batching.

CPU notes: with more threads than free cores, OpenMP spin-waiting makes elementwise ops up to ~100×
slower; check the load (``uptime``) and pass ``--threads`` accordingly. Both models run in one
process under the same allocator, set as training sets it on CPU (``megapretrain/host_memory.py``:
freed blocks are kept for the next step rather than page-faulted afresh).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from megapretrain.cli import non_negative_int, positive_int, user_errors
from megapretrain.config import load_config
from megapretrain.errors import ConfigError
from megapretrain.host_memory import keep_freed_host_memory
from megapretrain.model.build import DTYPES, build_model_chunks, deferred_initializer
from megapretrain.model.decoder import flops_per_token
from megapretrain.monitor.flops import slow_half_precision_warning
from megapretrain.optim.optimizer import MixedPrecisionAdamW
from megapretrain.parallel.state import ParallelState
from megapretrain.resolve import resolve

BYTE_VOCAB = 257  # ByteTokenizer: 256 bytes + EOS


def parse_args(argv: list[str]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                 epilog="Any other --section.key VALUE overrides the config.")
    ap.add_argument("--config", required=True, help="YAML config, e.g. configs/bench_cpu.yaml")
    ap.add_argument("--steps", type=positive_int, default=10, help="timed optimizer steps (default 10)")
    ap.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("--threads", type=non_negative_int, default=0,
                    help="torch CPU threads (0: train.threads, else all cores)")
    ap.add_argument("--compare-hf", action="store_true", help="also time transformers.LlamaForCausalLM")
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


def time_steps(step, warmup: int, steps: int, device) -> tuple[list[float], float]:
    """Run ``warmup`` + ``steps`` calls of ``step()``; returns the timed durations and the last loss."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, loss = [], float("nan")
    for i in range(warmup + steps):
        sync()
        start = time.perf_counter()
        loss = step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times, loss


# -- megapretrain ---------------------------------------------------------------------------------


def megapretrain_step(cfg, plan, device):
    """A closure running one training step exactly as the trainer does, and the model's FLOPs/token."""
    ps = ParallelState(device=device)
    torch.manual_seed(cfg.train.seed)
    (model,), specs = build_model_chunks(cfg, ps)  # pp 1: one chunk, built as training builds it
    model.train()
    opt = MixedPrecisionAdamW(list(model.named_parameters()), specs, cfg.optim, cfg.train.precision, ps,
                              zero=cfg.parallel.zero, bucket_size_mb=cfg.parallel.bucket_size_mb,
                              initialize=deferred_initializer([model], specs, cfg.train.seed))
    opt.hook_models([model])  # the parameter-gather hooks training attaches (a compiled layer must not trace them)
    batches = micro_batches(cfg, device)

    def step() -> float:
        opt.zero_grad()
        total = torch.zeros((), device=device)
        scale = opt.scaler.scale / plan.tokens_per_batch
        for i, (tokens, targets) in enumerate(batches):
            losses = model(tokens, targets, loss_grad_scale=scale)  # (b, s) fp32 per-token losses
            with opt.grad_sync(last=i == len(batches) - 1):
                (losses.sum() * scale).backward()
            total += losses.detach().sum()
        opt.reduce_grads()
        opt.step(cfg.optim.lr)
        return total.item() / plan.tokens_per_batch

    return step, flops_per_token(model.args, cfg.train.seq_length)


# -- Hugging Face ---------------------------------------------------------------------------------


def hf_step(cfg, plan, device):
    """One step of transformers' Llama: fp32 weights, autocast for bf16/fp16, torch AdamW."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m, o = cfg.model, cfg.optim
    hf_cfg = LlamaConfig(hidden_size=m.hidden_size, intermediate_size=plan.ffn_hidden_size,
                         num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                         num_key_value_heads=plan.num_kv_heads, vocab_size=plan.padded_vocab,
                         max_position_embeddings=cfg.train.seq_length, rope_theta=m.rope_theta,
                         rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings,
                         initializer_range=m.init_std, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(cfg.train.seed)
    model = LlamaForCausalLM(hf_cfg).to(device=device, dtype=torch.float32).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    batches = micro_batches(cfg, device)
    amp = cfg.train.precision != "fp32"

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for tokens, targets in batches:
            with torch.autocast(device.type, dtype=DTYPES[cfg.train.precision], enabled=amp):
                logits = model(input_ids=tokens).logits  # (b, s, v)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
            (loss / plan.tokens_per_batch).backward()
            total += loss.item()
        if o.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, o.clip_grad)
        opt.step()
        return total / plan.tokens_per_batch

    return step


# -- report ---------------------------------------------------------------------------------------


def report(name: str, times: list[float], loss: float, tokens: int, flops: float) -> float:
    median = statistics.median(times)
    tok_s = tokens / median
    print(f"{name:<13} step {1e3 * median:8.1f} ms (min {1e3 * min(times):.1f}, max {1e3 * max(times):.1f})"
          f" | {tok_s:9,.0f} tokens/s | {flops * tok_s / 1e12:6.3f} TFLOP/s | loss {loss:.4f}")
    return tok_s


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
        keep_freed_host_memory()  # as train.py does on CPU; both models below run with it
    t = cfg.train
    slow = slow_half_precision_warning(t.precision) if device.type == "cpu" and t.precision != "fp32" else None
    if slow:
        print(f"warning: {slow}", file=sys.stderr)
    print(f"config {args.config} | precision {t.precision} | device {device} | threads "
          f"{torch.get_num_threads()} | cpus {os.cpu_count()} | load {os.getloadavg()[0]:.2f}")
    print(f"{plan.tokens_per_batch:,} tokens/step = global batch {t.global_batch_size} × seq {t.seq_length} "
          f"(micro-batch {t.micro_batch_size}, {plan.grad_accum} per step) | vocab {plan.padded_vocab:,} (padded)")

    start = time.perf_counter()
    step, flops = megapretrain_step(cfg, plan, device)
    print(f"megapretrain built in {time.perf_counter() - start:.1f} s | {flops:.3g} FLOPs/token")
    mp_tok_s = report("megapretrain", *time_steps(step, args.warmup, args.steps, device),
                      plan.tokens_per_batch, flops)
    if cfg.train.compile:
        print(compile_report())
    if args.profile:
        profile(step, device)
    del step
    if args.compare_hf:
        hf_tok_s = report("transformers", *time_steps(hf_step(cfg, plan, device), args.warmup, args.steps, device),
                          plan.tokens_per_batch, flops)
        print(f"megapretrain / transformers: {mp_tok_s / hf_tok_s:.2f}×")
    print(f"load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
