"""Choose a parallel layout before spending GPU hours: memory per GPU, step time, MFU, run length.

    python tools/plan.py --config configs/llama3_70b.yaml --gpus 512 --train-tokens 2T
    python tools/plan.py --config configs/llama3_8b.yaml --gpus 64 --device a100 --top 5
    python tools/plan.py --config configs/llama3_405b.yaml --gpus 2048 --check --json   # the config's own layout
    python tools/plan.py --config configs/llama3_70b.yaml --gpus 512 --write-config runs/70b.yaml \\
        --write-launch runs/70b.sh --emit deepspeed runs/70b_ds.json --emit accelerate runs/70b_acc.yaml
    python tools/plan.py --published                                  # the model against published runs

Every layout of ``--gpus`` devices (tp within a node, cp for long sequences, pp dividing the layers,
virtual chunks, micro batches 1-4, ZeRO 0-2, recompute none/selective/full, sequence parallelism
with tp; ranks tp × cp × pp × dp) is estimated
with the model of ``megapretrain/planner.py``; those that fit in memory are ranked by step time and
the fastest becomes the plan: memory per GPU by part, step time by part, tokens/s, MFU and HFU,
the token budget (``--train-tokens`` or ``train.train_tokens``; else ``train.iters`` steps),
wall-clock days and GPU-hours. ``--check`` plans the layout the config already has. ``--json``
prints the plan as one JSON object. ``--write-config`` / ``--write-launch`` write the plan's layout
as a config and a launch script, ``--emit deepspeed|accelerate PATH`` the same recipe as a DeepSpeed
JSON or an Accelerate YAML (none overwrites a file without ``--overwrite``). Device figures can be
overridden (``--peak-tflops``, ``--memory-gb``, ``--hbm-gbs``, ``--intra-gbs``, ``--inter-gbs``,
``--efficiency``). Any other ``--section.key VALUE`` overrides the config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import yaml

from megapretrain.config import TrainConfig, load_config, to_dict
from megapretrain.data.sampler import run_length
from megapretrain.errors import ConfigError, UserError
from megapretrain.model.build import model_args
from megapretrain.model.llama import ModelArgs, num_parameters
from megapretrain.monitor.flops import DEVICES, with_device
from megapretrain.planner import (
    ATTENTION,
    GIB,
    Layout,
    context_gather_bytes,
    estimate,
    estimate_run,
    search,
    split_layers,
)
from megapretrain.resolve import resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class PlanArgumentError(UserError):
    """A bad flag of tools/plan.py."""


class OutputExistsError(UserError):
    """An output file that exists (pass --overwrite)."""


# ----------------------------------------------------------------------------------------------
# Published runs the planner is checked against (tests/test_planner.py holds each within ±20%)


def _gpt(layers: int, hidden: int, heads: int) -> ModelArgs:
    """A GPT-3-style model as Megatron-LM ran them: GELU MLP of 4h, multi-head attention, vocabulary
    51,200, tied embeddings, dropout 0.1."""
    return ModelArgs(layers, hidden, heads, heads, 4 * hidden, 51200, tie_embeddings=True, mlp="gelu",
                     attention_dropout=0.1, hidden_dropout=0.1)


_L3_405B = ModelArgs(126, 16384, 128, 8, 53248, 128256, rope_theta=500000.0)
N21 = "Narayanan et al. 2021 (arXiv 2104.04473), Table 1: A100 80GB, full recompute, TFLOP/s counting it"
K22 = "Korthikanti et al. 2022 (arXiv 2205.05198), end-to-end results: A100 80GB, selective recompute + SP, MFU"
L3 = "Dubey et al. 2024 (arXiv 2407.21783), Table 4: H100, BF16 MFU"


@dataclasses.dataclass(frozen=True)
class Published:
    name: str
    source: str
    model: ModelArgs
    seq: int
    layout: Layout
    global_batch: int
    device: str
    attention: str
    metric: str        # "hw_tflops_per_gpu" (recompute counted) or "tflops_per_gpu" (model FLOPs)
    value: float       # TFLOP/s per GPU

    @property
    def gpus(self) -> int:
        return self.layout.tp * self.layout.cp * self.layout.pp * self.layout.dp


def _row(name, source, model, seq, tp, pp, gpus, batch, recompute, sp, device, attention, metric, value, vpp=1,
         layers=None, zero=0, cp=1):
    layout = Layout(tp, pp, gpus // (tp * cp * pp), vpp, 1, zero, recompute,
                    layers or split_layers(model.num_layers, pp * vpp), sp, cp)
    return Published(name, source, model, seq, layout, batch, device, attention, metric, value)


PUBLISHED = [  # Megatron-LM 2021: no sequence parallelism, unfused attention, micro-batch 1, fp16
    _row("GPT 1.7B", N21, _gpt(24, 2304, 24), 2048, 1, 1, 32, 512, "full", False, "a100", "unfused",
         "hw_tflops_per_gpu", 137),
    _row("GPT 3.6B", N21, _gpt(30, 3072, 32), 2048, 2, 1, 64, 512, "full", False, "a100", "unfused",
         "hw_tflops_per_gpu", 138),
    _row("GPT 7.5B", N21, _gpt(36, 4096, 32), 2048, 4, 1, 128, 512, "full", False, "a100", "unfused",
         "hw_tflops_per_gpu", 142),
    _row("GPT 18.4B", N21, _gpt(40, 6144, 48), 2048, 8, 1, 256, 1024, "full", False, "a100", "unfused",
         "hw_tflops_per_gpu", 135),
    _row("GPT 39.1B", N21, _gpt(48, 8192, 64), 2048, 8, 2, 512, 1536, "full", False, "a100", "unfused",
         "hw_tflops_per_gpu", 138),
    _row("GPT 76.1B", N21, _gpt(60, 10240, 80), 2048, 8, 4, 1024, 1792, "full", False, "a100", "unfused",
         "hw_tflops_per_gpu", 140),
    _row("GPT 145.6B", N21, _gpt(80, 12288, 96), 2048, 8, 8, 1536, 2304, "full", False, "a100", "unfused",
         "hw_tflops_per_gpu", 148),
    _row("GPT 310.1B", N21, _gpt(96, 16384, 128), 2048, 8, 16, 1920, 2160, "full", False, "a100", "unfused",
         "hw_tflops_per_gpu", 155),
    _row("GPT 529.6B", N21, _gpt(105, 20480, 128), 2048, 8, 35, 2520, 2520, "full", False, "a100", "unfused",
         "hw_tflops_per_gpu", 163),
    _row("GPT 1008B", N21, _gpt(128, 25600, 160), 2048, 8, 64, 3072, 3072, "full", False, "a100", "unfused",
         "hw_tflops_per_gpu", 163),
    # Megatron-LM 2022: sequence parallelism + selective recompute, one data-parallel replica
    _row("GPT 22B sel", K22, _gpt(48, 6144, 64), 2048, 8, 1, 8, 4, "selective", True, "a100", "unfused",
         "tflops_per_gpu", 0.415 * 312),
    _row("GPT 175B sel", K22, _gpt(96, 12288, 96), 2048, 8, 8, 64, 64, "selective", True, "a100", "unfused",
         "tflops_per_gpu", 0.514 * 312),
    _row("GPT 530B sel", K22, _gpt(105, 20480, 128), 2048, 8, 35, 280, 280, "selective", True, "a100", "unfused",
         "tflops_per_gpu", 0.560 * 312),
    _row("GPT 1T sel", K22, _gpt(128, 25600, 160), 2048, 8, 64, 512, 512, "selective", True, "a100", "unfused",
         "tflops_per_gpu", 0.563 * 312),
    # Llama 3 405B: 16M-token batches, interleaved 1F1B (8 layers a stage in chunks of 2 -- the paper
    # gives pp only) with a layer less on the first and the last stage (§3.3.2)
    _row("Llama 3 405B", L3, _L3_405B, 8192, 8, 16, 8192, 2048, "none", True, "h100", "flash",
         "tflops_per_gpu", 430, vpp=4, zero=1),
    _row("Llama 3 405B 16k", L3, _L3_405B, 8192, 8, 16, 16384, 2048, "none", True, "h100", "flash",
         "tflops_per_gpu", 400, vpp=4, zero=1),
    # its long-context stage: 131,072-token sequences over context parallelism 16, the same 16M-token
    # batches (dp 8); the throughput is estimated as published (the memory model puts this layout's
    # activations above 80 GB without recomputation, which the paper does not detail)
    _row("Llama 3 405B 128k", L3, _L3_405B, 131072, 8, 16, 16384, 128, "none", True, "h100", "flash",
         "tflops_per_gpu", 380, vpp=4, zero=1, cp=16),
]


def published_estimates() -> list[tuple[Published, float]]:
    """Every published run with the planner's figure for it (the same metric)."""
    out = []
    for row in PUBLISHED:
        e = estimate(row.model, row.seq, row.layout, row.global_batch, DEVICES[row.device], "bf16", "auto",
                     row.attention)
        out.append((row, getattr(e, row.metric)))
    return out


def published_table() -> str:
    lines = ["| run | GPUs | layout (tp/cp/pp/dp, recompute) | metric | estimate | published | error |",
             "|---|---|---|---|---|---|---|"]
    for row, got in published_estimates():
        L = row.layout
        metric = "TFLOP/s/GPU incl. recompute" if row.metric == "hw_tflops_per_gpu" else "model TFLOP/s/GPU"
        lines.append(f"| {row.name} ({row.device.upper()}) | {row.gpus:,} | {L.tp}/{L.cp}/{L.pp}/{L.dp}, "
                     f"{L.recompute} | "
                     f"{metric} | {got:.0f} | {row.value:.0f} | {got / row.value - 1:+.1%} |")
    sources = sorted({row.source for row in PUBLISHED})
    return "\n".join(lines + [""] + [f"- {s}" for s in sources])


# ----------------------------------------------------------------------------------------------
# Arguments


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if not value > 0 or (isinstance(value, float) and not math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def fraction(text: str) -> float:
    value = _positive(float)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {text!r}")
    return value


_SUFFIX = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def tokens(text: str) -> int:
    """A token count: 2000000000000, 2e12, 2T, 300B, 1.5T."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", str(text))
    if not match or float(match[1]) * _SUFFIX[match[2].upper()] < 1:
        raise argparse.ArgumentTypeError(f"expected a positive token count like 2T, 300B or 2e12, got {text!r}")
    return int(round(float(match[1]) * _SUFFIX[match[2].upper()]))


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, through the UserError path
        raise PlanArgumentError(f"{message} (see tools/plan.py --help)")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML config (model, batch, sequence, iterations)")
    ap.add_argument("--gpus", type=_positive(int), help="number of GPUs")
    ap.add_argument("--device", default="h100", choices=sorted(DEVICES), help="GPU type (default h100)")
    ap.add_argument("--top", type=_positive(int), default=8, help="layouts to show")
    ap.add_argument("--check", action="store_true", help="plan only the config's own layout")
    ap.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    ap.add_argument("--train-tokens", type=tokens, help="token budget (e.g. 2T); also --train.train_tokens")
    ap.add_argument("--attention", default="flash", choices=ATTENTION, help="attention kernels (default flash)")
    ap.add_argument("--published", action="store_true", help="compare the model with published runs and exit")
    for name, kind, help_ in (("peak-tflops", _positive(float), "dense bf16 peak per GPU"),
                              ("memory-gb", _positive(float), "memory per GPU"),
                              ("hbm-gbs", _positive(float), "memory bandwidth per GPU, GB/s"),
                              ("intra-gbs", _positive(float), "bus bandwidth within a node, GB/s"),
                              ("inter-gbs", _positive(float), "bandwidth per GPU between nodes, GB/s"),
                              ("efficiency", fraction, "fraction of peak large matmuls reach")):
        ap.add_argument(f"--{name}", type=kind, help=help_)
    ap.add_argument("--write-config", metavar="PATH", help="write the config with the plan's layout")
    ap.add_argument("--write-launch", metavar="PATH", help="write a launch script (SLURM or by hand) for it")
    ap.add_argument("--emit", nargs=2, action="append", default=[], metavar=("FORMAT", "PATH"),
                    help="write the recipe for another framework: deepspeed PATH.json | accelerate PATH.yaml")
    ap.add_argument("--accelerate-plugin", default="deepspeed", choices=("deepspeed", "fsdp"),
                    help="the Accelerate YAML's plugin (default deepspeed)")
    ap.add_argument("--overwrite", action="store_true", help="replace files that exist")
    args, rest = ap.parse_known_args(argv)
    for fmt, _ in args.emit:
        if fmt not in ("deepspeed", "accelerate"):
            raise PlanArgumentError(f"--emit {fmt}: the formats are deepspeed and accelerate")
    if not args.published and (args.config is None or args.gpus is None):
        raise PlanArgumentError("--config and --gpus are required (or --published)")
    return args, rest


def split_train_tokens(overrides: list[str]) -> tuple[list[str], int | None]:
    """Take ``--train.train_tokens T`` out of the overrides: the plan's budget, which may replace
    the config's ``train.iters`` (validation accepts only one of the two)."""
    rest, found, i = [], None, 0
    while i < len(overrides):
        arg = overrides[i]
        if arg == "--train.train_tokens" or arg.startswith("--train.train_tokens="):
            value = arg.split("=", 1)[1] if "=" in arg else (overrides[i + 1] if i + 1 < len(overrides) else "")
            i += 1 if "=" in arg else 2
            try:
                found = tokens(value)
            except argparse.ArgumentTypeError as exc:
                raise PlanArgumentError(f"--train.train_tokens: {exc}") from None
            continue
        rest.append(arg)
        i += 1
    return rest, found


def run_samples(t, budget: int | None) -> tuple[int, int]:
    """(steps, samples) of the run: ``budget`` tokens (or the config's train.train_tokens, else
    train.iters steps), batch-size ramp-up included where the config has one."""
    budget = budget or t.train_tokens
    return run_length(dataclasses.replace(t, train_tokens=budget, iters=TrainConfig.iters) if budget else t)


# ----------------------------------------------------------------------------------------------
# The plan


def make_plan(args: argparse.Namespace, overrides: list[str]) -> dict:
    overrides, budget = split_train_tokens(overrides)
    cfg = load_config(args.config, overrides)
    m, t = cfg.model, cfg.train
    if m.vocab_size is None:
        raise ConfigError("model.vocab_size is null: set it (--model.vocab_size N) for the plan")
    device = with_device(DEVICES[args.device], peak_tflops=args.peak_tflops, memory_gb=args.memory_gb,
                         hbm_gbs=args.hbm_gbs, intra_gbs=args.intra_gbs, inter_gbs=args.inter_gbs,
                         efficiency=args.efficiency)
    model = model_args(cfg)
    if args.check:
        found = [estimate_run(cfg, resolve(cfg, args.gpus).layout, device, args.attention)]
    else:
        found = search(model, t.seq_length, args.gpus, t.global_batch_size, device, t.precision, args.attention)
    budget = args.train_tokens or budget
    steps, samples = run_samples(t, budget)
    return {"cfg": cfg, "device": device, "model": model, "found": found, "steps": steps,
            "tokens": samples * t.seq_length, "budget": budget or t.train_tokens,
            "full_steps": samples / t.global_batch_size, "overrides": overrides}


def summary(plan: dict, e, args) -> dict:
    """The plan as plain numbers (``--json``)."""
    L, mem, t, cfg = e.layout, e.memory, e.time, plan["cfg"]
    days = plan["full_steps"] * t["total"] / 86400  # a ramp-up's smaller steps take proportionally less
    return {
        "config": args.config, "gpus": args.gpus, "nodes": math.ceil(args.gpus / plan["device"].gpus_per_node),
        "device": plan["device"].name,
        "params": num_parameters(plan["model"]),
        "layout": {"tp": L.tp, "cp": L.cp, "pp": L.pp, "dp": L.dp, "vpp": L.vpp, "micro_batch_size": L.micro_batch,
                   "zero": L.zero, "zero_shard_size": L.shard, "recompute": L.recompute,
                   "sequence_parallel": L.sequence_parallel,
                   "pipeline_layers": list(L.pipeline_layers) if L.pipeline_layers else None,
                   "flags": L.flags()},
        "fits": e.fits,
        "memory_gb": {"weights": mem["params"] / GIB, "grads_optimizer": (mem["state"] - mem["params"]) / GIB,
                      "activations": mem["activations"] / GIB, "overhead": mem["overhead"] / GIB,
                      "total": mem["total"] / GIB, "capacity": mem["capacity"] / GIB},
        "time_s": dict(t),
        "cp_kv_gather_mib_per_layer": context_gather_bytes(plan["model"], L, cfg.train.seq_length) / 2**20,
        "step_s": t["total"], "mfu": e.mfu, "hfu": e.hfu, "tflops_per_gpu": e.tflops_per_gpu,
        "hw_tflops_per_gpu": e.hw_tflops_per_gpu, "tokens_per_s_per_gpu": e.tokens_per_gpu_s,
        "tokens_per_s": e.tokens_per_gpu_s * args.gpus,
        "global_batch_size": cfg.train.global_batch_size, "seq_length": cfg.train.seq_length,
        "tokens_per_step": cfg.train.global_batch_size * cfg.train.seq_length,
        "steps": plan["steps"], "train_tokens": plan["tokens"], "days": days, "gpu_hours": days * 24 * args.gpus,
    }


HEADER = ["tp", "cp", "pp", "vpp", "dp", "mb", "zero", "recompute", "mem GB", "step s",
          "compute/memory/tp/cp/bubble/p2p/dp s", "MFU", "tok/s/GPU", "days"]


def describe(e, steps: float) -> list[str]:
    L, t, mem = e.layout, e.time, e.memory
    parts = "/".join(f"{t[k]:.2f}" for k in ("compute", "memory", "tensor", "context", "bubble", "p2p", "data"))
    zero = f"{L.zero}/{L.shard}" if L.shard else str(L.zero)  # zero/shard group: hybrid sharding
    return [str(L.tp), str(L.cp), str(L.pp), str(L.vpp), str(L.dp), str(L.micro_batch), zero, L.recompute,
            f"{mem['total'] / GIB:.1f}", f"{t['total']:.2f}", parts, f"{e.mfu:.1%}", f"{e.tokens_per_gpu_s:,.0f}",
            f"{steps * t['total'] / 86400:.1f}"]


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows + [HEADER]) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [HEADER] + rows)


PARTS = ("compute", "memory", "tensor", "context", "bubble", "p2p", "data", "optimizer")


def report(s: dict, checked: bool) -> str:
    L, mem, t = s["layout"], s["memory_gb"], s["time_s"]
    return "\n".join([
        f"\n{'layout' if checked else 'plan'}: {s['gpus']:,} × {s['device']} "
        f"({s['nodes']} node{'s' * (s['nodes'] > 1)}), "
        f"tp {L['tp']} × cp {L['cp']} × pp {L['pp']} × dp {L['dp']} (vpp {L['vpp']}, "
        f"micro-batch {L['micro_batch_size']}, "
        f"zero {L['zero']}, recompute {L['recompute']})",
        f"{'layout' if checked else 'fastest'}: {L['flags']}",
        f"  memory/GPU  {mem['total']:.1f} of {mem['capacity']:.1f} usable GB{'' if s['fits'] else ' (DOES NOT FIT)'}: "
        f"weights {mem['weights']:.1f}, grads+optimizer {mem['grads_optimizer']:.1f}, activations "
        f"{mem['activations']:.1f}, allowance {mem['overhead']:.1f}",
        f"  step        {t['total']:.2f} s: " + ", ".join(f"{k} {t[k]:.2f}" for k in PARTS)
        + f" (recompute {t['recompute']:.2f})",
        f"  throughput  {s['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, {s['tokens_per_s']:,.0f} tokens/s; "
        f"MFU {s['mfu']:.1%}, HFU {s['hfu']:.1%}; {s['tflops_per_gpu']:.0f} TFLOP/s/GPU "
        f"({s['hw_tflops_per_gpu']:.0f} with recompute)",
        f"  budget      {s['train_tokens']:,} tokens in {s['steps']:,} steps of up to {s['tokens_per_step']:,} tokens "
        f"({s['train_tokens'] / s['params']:.0f} tokens/parameter, {s['params'] / 1e9:.2f}B parameters)",
        f"  time        {s['days']:.1f} days wall-clock, {s['gpu_hours']:,.0f} GPU-hours",
        "  estimates: check them with tools/bench_train.py on the real machines before the run"])


# ----------------------------------------------------------------------------------------------
# Writers


def _open_new(path: str, overwrite: bool):
    if os.path.exists(path) and not overwrite:
        raise OutputExistsError(f"{path} exists; pass --overwrite to replace it")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return open(path, "w")


def layout_config(plan: dict, s: dict) -> dict:
    """The config with the plan's layout (and token budget) as a plain dict."""
    tree, L = to_dict(plan["cfg"]), s["layout"]
    tree["parallel"].update(tp=L["tp"], cp=L["cp"], pp=L["pp"], vpp=L["vpp"], zero=L["zero"], recompute=L["recompute"],
                            sequence_parallel=L["sequence_parallel"], pipeline_layers=L["pipeline_layers"],
                            zero_shard_size=L["zero_shard_size"])
    tree["train"]["micro_batch_size"] = L["micro_batch_size"]
    if plan["budget"] and "train_tokens" in tree["train"]:  # the budget, the steps derived from it
        tree["train"].update(train_tokens=plan["budget"], iters=TrainConfig.iters)
    elif plan["budget"]:
        tree["train"]["iters"] = plan["steps"]
    return tree


def write_config(path: str, plan: dict, s: dict, overwrite: bool) -> None:
    tree = layout_config(plan, s)
    L = s["layout"]
    with _open_new(path, overwrite) as fh:
        fh.write(f"# Written by tools/plan.py from {s['config']}: {s['gpus']} GPUs ({s['nodes']} nodes), "
                 f"tp {L['tp']} × cp {L['cp']} × pp {L['pp']} × dp {L['dp']} (vpp {L['vpp']}); "
                 f"estimated {s['step_s']:.2f} s/step, "
                 f"MFU {s['mfu']:.1%}, {s['days']:.1f} days\n")
        yaml.safe_dump(tree, fh, sort_keys=False)


def write_launch(path: str, s: dict, config: str, flags: str, overwrite: bool) -> None:
    name = os.path.splitext(os.path.basename(path))[0]
    per_node = s["gpus"] // s["nodes"]
    script = f"""#!/usr/bin/env bash
# Written by tools/plan.py: {s['gpus']} GPUs = {s['nodes']} nodes × {per_node}, {s['layout']['flags']}
# Estimated {s['step_s']:.2f} s/step, MFU {s['mfu']:.1%}, {s['steps']:,} steps, {s['days']:.1f} days.
# SLURM:   sbatch {path}
# By hand: NNODES={s['nodes']} NODE_RANK=<i> MASTER_ADDR=<node 0> bash {path}   (on every node)
# Check first: bash {path} --dry-run
#SBATCH --job-name={name}
#SBATCH --nodes={s['nodes']}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={per_node}
#SBATCH --exclusive
set -euo pipefail
ROOT={shlex.quote(ROOT)}
[ -f "$ROOT/run_scripts/launch.sh" ] || ROOT="${{SLURM_SUBMIT_DIR:?submit from the repository root}}"
export DEFAULT_NNODES={s['nodes']} DEFAULT_NPROC_PER_NODE={per_node}
exec bash "$ROOT/run_scripts/launch.sh" {shlex.quote(os.path.abspath(config))}{" " + flags if flags else ""} "$@"
"""
    with _open_new(path, overwrite) as fh:
        fh.write(script)
    os.chmod(path, 0o755)


def _no_hybrid(L: dict, target: str) -> None:
    """DeepSpeed shards over all data-parallel ranks: hybrid sharding has no equivalent there."""
    if L["zero_shard_size"]:
        raise ConfigError(f"parallel.zero_shard_size={L['zero_shard_size']}: {target} has no hybrid sharding (shard "
                          "inside groups, replicate across them); emit with --parallel.zero_shard_size null, or use "
                          "--accelerate-plugin fsdp (HYBRID_SHARD)")


def deepspeed_config(plan: dict, s: dict) -> dict:
    """The recipe as a DeepSpeed config: the same batch, precision, ZeRO stage, optimizer, schedule."""
    cfg, L = plan["cfg"], s["layout"]
    o, sch, t = cfg.optim, cfg.schedule, cfg.train
    accum = t.global_batch_size // (L["micro_batch_size"] * L["dp"])
    ds = {"train_batch_size": t.global_batch_size, "train_micro_batch_size_per_gpu": L["micro_batch_size"],
          "gradient_accumulation_steps": accum, "gradient_clipping": o.clip_grad,
          "steps_per_print": cfg.logging.interval, "wall_clock_breakdown": False}
    if t.precision == "bf16":
        ds["bf16"] = {"enabled": True}
    elif t.precision == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": int(math.log2(o.initial_loss_scale)),
                      "loss_scale_window": o.loss_scale_window, "min_loss_scale": o.min_loss_scale, "hysteresis": 2}
    zero = {"stage": L["zero"], "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": int(cfg.parallel.bucket_size_mb * 2**20)}
    _no_hybrid(L, "DeepSpeed")
    if o.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    ds["zero_optimization"] = zero
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps,
                                                   "weight_decay": o.weight_decay}}
    total = sch.decay_iters if sch.decay_iters is not None else plan["steps"]
    if sch.decay == "cosine":
        ds["scheduler"] = {"type": "WarmupCosineLR", "params": {
            "total_num_steps": total, "warmup_num_steps": sch.warmup_iters, "warmup_min_ratio": 0.0,
            "cos_min_ratio": o.min_lr / o.lr, "warmup_type": "linear"}}
    elif sch.decay == "constant":
        ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": o.lr,
                                                          "warmup_num_steps": sch.warmup_iters,
                                                          "warmup_type": "linear"}}
    elif sch.decay == "linear" and o.min_lr == 0:
        ds["scheduler"] = {"type": "WarmupDecayLR", "params": {
            "total_num_steps": total, "warmup_min_lr": 0.0, "warmup_max_lr": o.lr,
            "warmup_num_steps": sch.warmup_iters, "warmup_type": "linear"}}
    else:
        raise ConfigError(f"schedule.decay={sch.decay} with optim.min_lr={o.min_lr} has no DeepSpeed scheduler; "
                          "use schedule.decay cosine or constant (or linear with optim.min_lr 0) for --emit deepspeed")
    if L["tp"] > 1:
        ds["tensor_parallel"] = {"autotp_size": L["tp"]}
    if L["pp"] > 1:
        ds["pipeline"] = {"stages": L["pp"], "partition": "uniform",
                          "activation_checkpoint_interval": 1 if L["recompute"] == "full" else 0}
    if L["recompute"] != "none":
        ds["activation_checkpointing"] = {"partition_activations": L["sequence_parallel"],
                                          "contiguous_memory_optimization": False, "cpu_checkpointing": False}
    return ds


def accelerate_config(plan: dict, s: dict, plugin: str) -> dict:
    """The recipe as an Accelerate config file: machines, processes, precision, and the plugin."""
    cfg, L = plan["cfg"], s["layout"]
    acc = {"compute_environment": "LOCAL_MACHINE", "debug": False,
           "mixed_precision": {"bf16": "bf16", "fp16": "fp16"}.get(cfg.train.precision, "no"),
           "num_machines": s["nodes"], "num_processes": s["gpus"], "machine_rank": 0,
           "main_process_ip": "127.0.0.1", "main_process_port": 29500, "rdzv_backend": "static",
           "same_network": True, "main_training_function": "main", "use_cpu": False, "downcast_bf16": False}
    if plugin == "deepspeed":
        _no_hybrid(L, "Accelerate's DeepSpeed plugin")
        acc["distributed_type"] = "DEEPSPEED"
        accum = cfg.train.global_batch_size // (L["micro_batch_size"] * L["dp"])
        acc["deepspeed_config"] = {"zero_stage": L["zero"], "gradient_accumulation_steps": accum,
                                   "gradient_clipping": cfg.optim.clip_grad,
                                   "offload_optimizer_device": "cpu" if cfg.optim.offload else "none",
                                   "offload_param_device": "none", "zero3_init_flag": False}
    else:  # FSDP has no ZeRO-1: ZeRO 1 and 2 map to SHARD_GRAD_OP (2's memory or less), 3 to FULL_SHARD
        acc["distributed_type"] = "FSDP"
        hybrid = "HYBRID_SHARD" if L["zero"] == 3 else "HYBRID_SHARD_ZERO2"  # shard inside a node
        strategy = "NO_SHARD" if L["zero"] == 0 else "FULL_SHARD" if L["zero"] == 3 else "SHARD_GRAD_OP"
        acc["fsdp_config"] = {"fsdp_sharding_strategy": hybrid if L["zero_shard_size"] and L["zero"] else strategy,
                              "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                              "fsdp_backward_prefetch": "BACKWARD_PRE", "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                              "fsdp_offload_params": bool(cfg.optim.offload), "fsdp_use_orig_params": True,
                              "fsdp_sync_module_states": True, "fsdp_cpu_ram_efficient_loading": True,
                              "fsdp_activation_checkpointing": L["recompute"] != "none"}
    return acc


def emit(fmt: str, path: str, plan: dict, s: dict, args) -> str:
    if fmt == "deepspeed":
        ds = deepspeed_config(plan, s)  # before the file is opened: a refusal leaves nothing behind
        with _open_new(path, args.overwrite) as fh:
            json.dump(ds, fh, indent=2)
            fh.write("\n")
    else:
        acc = accelerate_config(plan, s, args.accelerate_plugin)
        with _open_new(path, args.overwrite) as fh:
            yaml.safe_dump(acc, fh, sort_keys=False)
    if s["layout"]["tp"] * s["layout"]["pp"] > 1 and fmt == "accelerate":
        return (f"note: {path}: Accelerate's {args.accelerate_plugin} plugin has no tensor or pipeline parallelism; "
                f"set them up in the model code (tp {s['layout']['tp']}, pp {s['layout']['pp']})")
    return ""


# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    try:
        args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        if args.published:
            print(published_table())
            return 0
        plan = make_plan(args, overrides)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    cfg, found, device = plan["cfg"], plan["found"], plan["device"]
    fitting = [e for e in found if e.fits]
    if not found:
        print("error: no layout of these GPUs divides the model and batch; change --gpus or train.global_batch_size",
              file=sys.stderr)
        return 1
    best = fitting[0] if fitting else (found[0] if args.check else None)
    if args.json:
        print(json.dumps(summary(plan, best or min(found, key=lambda e: e.memory["total"]), args)))
    else:
        m, t = cfg.model, cfg.train
        print(f"{args.config}: {m.num_layers} layers, hidden {m.hidden_size}, {t.global_batch_size} × "
              f"{t.seq_length} = {t.global_batch_size * t.seq_length:,} tokens per step, {plan['steps']:,} steps, "
              f"{t.precision}; {args.gpus} × {device.name} ({device.peak_tflops:g} TFLOP/s, matmuls up to "
              f"{device.efficiency:.0%}, {device.memory_gb:g} GB)")
        if best is None:
            print(f"nothing fits in {device.memory_gb:g} GB; the leanest layouts need:")
            leanest = sorted(found, key=lambda e: e.memory["total"])[:args.top]
            print(table([describe(e, plan["full_steps"]) for e in leanest]))
            return 1
        print(table([describe(e, plan["full_steps"]) for e in (fitting or found)[:args.top]]))
        print(report(summary(plan, best, args), args.check))
    if best is None or not best.fits:
        if not args.json and best is not None:
            print(f"nothing fits in {device.memory_gb:g} GB: this layout needs {best.memory['total'] / GIB:.1f} GB")
        return 1
    try:
        write_outputs(args, plan, summary(plan, best, args), best)
    except (UserError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def write_outputs(args, plan: dict, s: dict, best) -> None:
    """--write-config, --write-launch and --emit, after checking that none would overwrite a file."""
    paths = [p for p in (args.write_config, args.write_launch) if p] + [path for _, path in args.emit]
    for path in paths:
        if os.path.exists(path) and not args.overwrite:
            raise OutputExistsError(f"{path} exists; pass --overwrite to replace it")
    if args.emit and s["layout"]["cp"] > 1:
        raise PlanArgumentError(f"--emit {args.emit[0][0]}: the plan's layout has parallel.cp={s['layout']['cp']}, "
                                "which DeepSpeed and Accelerate configs do not express (their sequence parallelism "
                                "is another scheme); plan without it: --check --parallel.cp 1")
    done = sys.stderr if args.json else sys.stdout  # --json keeps stdout one object
    # the launch script runs the written config, or the given one with the layout and overrides
    config_path, flags = args.config, " ".join([best.layout.flags(), shlex.join(plan["overrides"])]).strip()
    if args.write_config:
        write_config(args.write_config, plan, s, args.overwrite)
        config_path, flags = args.write_config, ""
        print(f"wrote {args.write_config}", file=done)
    if args.write_launch:
        write_launch(args.write_launch, s, config_path, flags, args.overwrite)
        print(f"wrote {args.write_launch}", file=done)
    for fmt, path in args.emit:
        note = emit(fmt, path, plan, s, args)
        print(f"wrote {path}" + (f"\n{note}" if note else ""), file=done)

if __name__ == "__main__":
    sys.exit(main())
