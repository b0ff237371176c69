"""Choose a parallel layout before spending GPU hours: memory per GPU, step time, MFU, run length.

    python tools/plan.py --config configs/llama3_70b.yaml --gpus 512 --train-tokens 2T
    python tools/plan.py --config configs/llama3_8b.yaml --gpus 64 --device a100 --top 5
    # its own layout
    python tools/plan.py --config configs/llama3_405b.yaml --gpus 2048 --layout config --json
    # top 3 checked by simulation
    python tools/plan.py --config configs/llama3_8b.yaml --gpus 64 --simulate 3
    python tools/plan.py --config configs/llama3_70b.yaml --gpus 512 --write-config runs/70b.yaml \\
        --write-launch runs/70b.sh
    # neither holds a ramp-up
    python tools/plan.py --config configs/llama3_70b.yaml --gpus 512 \\
        --train.rampup_batch_size null \\
        --emit deepspeed runs/70b_ds.json --emit accelerate runs/70b_acc.yaml
    python tools/plan.py --published                           # the model against published runs

Every layout of ``--gpus`` devices (tp within a node, cp for long sequences, pp dividing the layers,
virtual chunks, micro batches 1-4, ZeRO 0-3 with hybrid sharding inside a node, recompute
none/selective/full, sequence parallelism with tp; ranks tp × cp × pp × dp) is estimated
with the model of ``megapretrain/planner/``; those that fit in memory are ranked by step time and
the fastest becomes the plan: memory per GPU by part, step time by part, tokens/s, MFU and HFU,
the token budget (``--train-tokens`` or ``train.train_tokens``; else ``train.iters`` steps),
wall-clock time and GPU-hours, and the goodput expected under failures with the checkpoint
interval that maximises it (``megapretrain/planner/goodput.py``: Young/Daly): from a failure rate
(``--failures-per-gpu-hour``, default Llama 3's published interruption rate — 419 in 54 days on
16,384 H100s, Dubey et al. 2024, "The Llama 3 Herd of Models"), the layout's checkpoint bytes
written at ``--checkpoint-write-gbps`` (the file system's aggregate rate; default Llama 3's
Tectonic, 2 TB/s sustained; an async save hides most of the write) and a restart cost
(``--restart-minutes``: detection, restart, reload). ``--layout config`` (or ``--check``)
plans the layout the config already has. ``--simulate K`` then simulates the busiest pipeline
stage of the top K layouts with the trainer's own program (``tools/simulate.py``) and prints the
planner's figures beside the simulated ones: peak memory, and whether every group's traffic is
equal. ``--json`` prints the plan as one JSON object (the goodput figures under ``goodput``).
``--write-config`` / ``--write-launch`` write the plan's layout as a config and a launch script,
``--emit deepspeed|accelerate PATH`` the same recipe as a DeepSpeed JSON or an Accelerate YAML
(none overwrites a file without ``--overwrite``; what a format cannot hold — a batch-size ramp-up
where the batch is fixed, hybrid sharding in DeepSpeed, cp — is refused in one line before
anything is written, and what an Accelerate YAML leaves to the training script is printed).
Device figures can be overridden (``--peak-tflops``, ``--memory-gb``, ``--hbm-gbs``,
``--intra-gbs``, ``--inter-gbs``, ``--efficiency``). Any other ``--section.key VALUE`` overrides
the config.
"""


from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from megapretrain.cli import (
    ToolParser,
    fraction,
    non_negative_float,
    positive_float,
    positive_int,
    print_error,
    user_errors,
)
from megapretrain.config import load_config
from megapretrain.monitor.flops import DEVICES
from megapretrain.monitor.progress import human_duration
from megapretrain.planner import ATTENTION, GIB
from megapretrain.planner.emit import (
    OutputExistsError,
    render,
    write_config,
    write_launch,
    write_text,
)
from megapretrain.planner.goodput import (
    CHECKPOINT_WRITE_GBPS,
    LLAMA3_FAILURES_PER_GPU_HOUR,
    RESTART_MINUTES,
)
from megapretrain.planner.plan import PlanArgumentError, make_plan, summary, tokens
from megapretrain.planner.published import published_table
from megapretrain.simulate.run import check_layout

# ----------------------------------------------------------------------------------------------
# Arguments


class _Parser(ToolParser):
    def error(self, message):  # one line, through the UserError path
        raise PlanArgumentError(f"{message} (see tools/plan.py --help)")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = _Parser(description=__doc__.split("\n\n")[0],
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML config (model, batch, sequence, iterations)")
    ap.add_argument("--gpus", type=positive_int, help="number of GPUs")
    ap.add_argument("--device", default="h100", choices=sorted(DEVICES),
                    help="GPU type (default h100)")
    ap.add_argument("--top", type=positive_int, default=8, help="layouts to show")
    ap.add_argument("--check", action="store_true", help="plan only the config's own layout (= "
                                                         "--layout config)")
    ap.add_argument("--layout", choices=("search", "config"), default="search",
                    help="search every layout (default) or plan the config's own")
    ap.add_argument("--simulate", type=positive_int, metavar="K",
                    help="simulate the busiest stage of the top K layouts and compare (see "
                         "tools/simulate.py)")
    ap.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    ap.add_argument("--train-tokens", type=tokens, help="token budget (e.g. 2T); also "
                                                        "--train.train_tokens")
    ap.add_argument("--attention", default="flash", choices=ATTENTION,
                    help="attention kernels (default flash)")
    ap.add_argument("--published", action="store_true", help="compare the model with published "
                                                             "runs and exit")
    for name, kind, help_ in (("peak-tflops", positive_float, "dense bf16 peak per GPU"),
                              ("memory-gb", positive_float, "memory per GPU"),
                              ("hbm-gbs", positive_float, "memory bandwidth per GPU, GB/s"),
                              ("intra-gbs", positive_float, "bus bandwidth within a node, GB/s"),
                              ("inter-gbs", positive_float,
                               "bandwidth per GPU between nodes, GB/s"),
                              ("efficiency", fraction, "fraction of peak large matmuls reach")):
        ap.add_argument(f"--{name}", type=kind, help=help_)
    ap.add_argument("--failures-per-gpu-hour", type=positive_float,
                    default=LLAMA3_FAILURES_PER_GPU_HOUR,
                    help="interruptions per GPU-hour (default: Llama 3's, 419 in 54 days on 16,384 "
                         f"GPUs = {LLAMA3_FAILURES_PER_GPU_HOUR:.3g}; Dubey et al. 2024)")
    ap.add_argument("--checkpoint-write-gbps", type=positive_float, default=CHECKPOINT_WRITE_GBPS,
                    help="the file system's aggregate write rate, GB/s (default "
                         f"{CHECKPOINT_WRITE_GBPS:g}: Llama 3's Tectonic, sustained)")
    ap.add_argument("--restart-minutes", type=non_negative_float, default=RESTART_MINUTES,
                    help="a failure's detection + restart + reload, minutes (default "
                         f"{RESTART_MINUTES:g})")
    ap.add_argument("--write-config", metavar="PATH",
                    help="write the config with the plan's layout")
    ap.add_argument("--write-launch", metavar="PATH",
                    help="write a launch script (SLURM or by hand) for it")
    ap.add_argument("--emit", nargs=2, action="append", default=[], metavar=("FORMAT", "PATH"),
                    help="write the recipe for another framework: deepspeed PATH.json | accelerate "
                         "PATH.yaml")
    ap.add_argument("--accelerate-plugin", default="deepspeed", choices=("deepspeed", "fsdp"),
                    help="the Accelerate YAML's plugin (default deepspeed)")
    ap.add_argument("--overwrite", action="store_true", help="replace files that exist")
    args, rest = ap.parse_known_args(argv)
    args.check = args.check or args.layout == "config"
    for fmt, _ in args.emit:
        if fmt not in ("deepspeed", "accelerate"):
            raise PlanArgumentError(f"--emit {fmt}: the formats are deepspeed and accelerate")
    if not args.published and (args.config is None or args.gpus is None):
        raise PlanArgumentError("--config and --gpus are required (or --published)")
    return args, rest


# ----------------------------------------------------------------------------------------------
# Printing


HEADER = ["tp", "cp", "pp", "vpp", "dp", "mb", "zero", "recompute", "mem GB", "step s",
          "compute/memory/tp/cp/bubble/p2p/dp s", "MFU", "tok/s/GPU", "wall-clock"]


def describe(e, steps: float) -> list[str]:
    L, t, mem = e.layout, e.time, e.memory
    parts = "/".join(f"{t[k]:.2f}" for k in ("compute", "memory", "tensor", "context", "bubble",
                                             "p2p", "data"))
    zero = f"{L.zero}/{L.shard}" if L.shard else str(L.zero)  # zero/shard group: hybrid sharding
    return [str(L.tp), str(L.cp), str(L.pp), str(L.vpp), str(L.dp), str(L.micro_batch), zero,
            L.recompute, f"{mem['total'] / GIB:.1f}", f"{t['total']:.2f}", parts, f"{e.mfu:.1%}",
            f"{e.tokens_per_gpu_s:,.0f}", human_duration(steps * t['total'])]


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
        + (f"cp_comm {L['cp_comm']}: {s['cp_traffic_mib_per_step']:,.0f} MiB/step over cp, "
           if L['cp'] > 1 else "")
        + f"micro-batch {L['micro_batch_size']}, "
        f"zero {L['zero']}, recompute {L['recompute']})",
        f"{'layout' if checked else 'fastest'}: {L['flags']}",
        f"  memory/GPU  {mem['total']:.1f} of {mem['capacity']:.1f} usable "
        f"GB{'' if s['fits'] else ' (DOES NOT FIT)'}: weights {mem['weights']:.1f}, "
        f"grads+optimizer {mem['grads_optimizer']:.1f}, activations {mem['activations']:.1f}, "
        f"allowance {mem['overhead']:.1f}", f"  step        {t['total']:.2f} s: "
        + ", ".join(f"{k} {t[k]:.2f}" for k in PARTS)
        + f" (recompute {t['recompute']:.2f})",
        f"  optimizer   {s['optimizer']} (moments {s['moments_dtype']}): {t['optimizer']:.3f} s, "
        f"{s['optimizer_share']:.2%} of the step"
        + (f" (Newton–Schulz {t['optimizer_ns']:.3f} s, its collectives exposed "
           f"{t['optimizer_comm']:.3f} s)" if s['optimizer'] == "muon" else ""),
        f"  throughput  {s['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, {s['tokens_per_s']:,.0f} "
        f"tokens/s; MFU {s['mfu']:.1%}, HFU {s['hfu']:.1%}; {s['tflops_per_gpu']:.0f} TFLOP/s/GPU "
        f"({s['hw_tflops_per_gpu']:.0f} with recompute)",
        f"  budget      {s['train_tokens']:,} tokens in {s['steps']:,} steps of up to "
        f"{s['tokens_per_step']:,} tokens ({s['train_tokens'] / s['params']:.0f} tokens/parameter, "
        f"{s['params'] / 1e9:.2f}B parameters)",
        f"  time        {human_duration(s['days'] * 86400)} wall-clock, {s['gpu_hours']:,.0f} "
        "GPU-hours", *goodput_lines(s),
        "  estimates: check them with tools/bench_train.py on the real machines before the run"])


def goodput_lines(s: dict) -> list[str]:
    """The expected goodput under failures and the checkpoint interval that maximises it
    (planner/goodput.py)."""
    g = s["goodput"]
    longer = human_duration(g["days_with_failures"] * 86400) if g["days_with_failures"] \
        else "never done"
    return [f"  goodput     {g['goodput']:.2%} expected: {longer} wall-clock with failures, at "
            f"--checkpoint.interval {g['interval_iters']}",
            f"  failures    one every {g['mtbf_hours']:.1f} h "
            f"({g['failures_per_gpu_hour']:.3g} per GPU-hour), restart {g['restart_s'] / 60:g} min",
            f"  checkpoint  {g['checkpoint_bytes'] / 1e12:,.2f} TB "
            f"({g['checkpoint_rank_bytes'] / 1e9:,.2f} GB a rank) in {g['checkpoint_s']:.1f} s at "
            f"{g['checkpoint_write_gbps']:,.0f} GB/s; best every {human_duration(g['interval_s'])} "
            "(Young/Daly)"]


# ----------------------------------------------------------------------------------------------


@user_errors
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    if args.published:
        print(published_table())
        return 0
    plan = make_plan(args, overrides)
    cfg, found, device = plan["cfg"], plan["found"], plan["device"]
    fitting = [e for e in found if e.fits]
    if not found:
        print_error("no layout of these GPUs divides the model and batch; change --gpus or "
                    "train.global_batch_size")
        return 1
    best = fitting[0] if fitting else (found[0] if args.check else None)
    checked = simulate_top(args, overrides, (fitting or found)[:args.simulate]) if args.simulate \
        else None
    if args.json:
        out = summary(plan, best or min(found, key=lambda e: e.memory["total"]), args)
        print(json.dumps(out if checked is None else {**out, "simulated": checked}))
    else:
        m, t = cfg.model, cfg.train
        fp8 = "" if m.fp8 == "none" else f" + fp8 {m.fp8} linears ({device.fp8_tflops:g} TFLOP/s)"
        print(f"{args.config}: {m.num_layers} layers, hidden {m.hidden_size}, "
              f"{t.global_batch_size} × {t.seq_length} = {t.global_batch_size * t.seq_length:,} "
              f"tokens per step, {plan['steps']:,} steps, "
              f"{t.precision}{fp8}; "
              f"{args.gpus} × {device.name} ({device.peak_tflops:g} TFLOP/s, matmuls up to "
              f"{device.efficiency:.0%}, {device.memory_gb:g} GB)")
        if best is None:
            print(f"nothing fits in {device.memory_gb:g} GB; the leanest layouts need:")
            leanest = sorted(found, key=lambda e: e.memory["total"])[:args.top]
            print(table([describe(e, plan["full_steps"]) for e in leanest]))
            return 1
        print(table([describe(e, plan["full_steps"]) for e in (fitting or found)[:args.top]]))
        print(report(summary(plan, best, args), args.check))
        if checked is not None:
            print(simulated_table(checked))
    if best is None or not best.fits:
        if not args.json and best is not None:
            print(f"nothing fits in {device.memory_gb:g} GB: this layout needs "
                  f"{best.memory['total'] / GIB:.1f} GB")
        return 1
    try:
        write_outputs(args, plan, summary(plan, best, args), best)
    except OSError as err:  # a UserError goes through user_errors: the same line, exit 2
        print_error(err)
        return 2
    return 0


def simulate_top(args, overrides: list[str], estimates: list) -> list[dict]:
    """Each layout's busiest stage simulated (tools/simulate.py) beside the planner's figures."""
    rows = []
    for e in estimates:
        if not args.json:
            print(f"simulating the busiest stage of {e.layout.flags()} ...", file=sys.stderr,
                  flush=True)
        cfg = load_config(args.config, overrides + shlex.split(e.layout.flags()))
        rows.append({"flags": e.layout.flags(), **check_layout(cfg, args.gpus)})
    return rows


def simulated_table(rows: list[dict]) -> str:
    lines = ["\nchecked by simulation (the busiest stage's first rank; memory in tensors, without "
             "the allowance):"]
    for r in rows:
        lines.append(f"  {r['flags']}\n    rank {r['rank']} (stage {r['pp_rank']}): simulated "
                     f"{r['peak_bytes'] / GIB:.1f} GB, planned {r['planned_peak_bytes'] / GIB:.1f} "
                     f"GB ({r['memory_error']:+.1%}); traffic per group "
                     f"{'equal' if r['traffic_equal'] else 'NOT equal'}; {r['seconds']:.0f} s")
    return "\n".join(lines)


def write_outputs(args, plan: dict, s: dict, best) -> None:
    """--write-config, --write-launch and --emit, after checking that none would overwrite a
    file."""
    paths = [p for p in (args.write_config, args.write_launch)
             if p] + [path for _, path in args.emit]
    for path in paths:
        if os.path.exists(path) and not args.overwrite:
            raise OutputExistsError(f"{path} exists; pass --overwrite to replace it")
    if args.emit and s["layout"]["cp"] > 1:
        raise PlanArgumentError(f"--emit {args.emit[0][0]}: the plan's layout has "
                                f"parallel.cp={s['layout']['cp']}, which DeepSpeed and Accelerate "
                                "configs do not express (their sequence parallelism is another "
                                "scheme); plan without it: --check --parallel.cp 1")
    # refusals before any write
    emitted = [(path, *render(fmt, path, plan, s, args)) for fmt, path in args.emit]
    done = sys.stderr if args.json else sys.stdout  # --json keeps stdout one object
    # the launch script runs the written config, or the given one with the layout and overrides
    config_path, flags = args.config, " ".join([best.layout.flags(),
                                                shlex.join(plan["overrides"])]).strip()
    if args.write_config:
        write_config(args.write_config, plan, s, args.overwrite)
        config_path, flags = args.write_config, ""
        print(f"wrote {args.write_config}", file=done)
    if args.write_launch:
        write_launch(args.write_launch, s, config_path, flags, args.overwrite)
        print(f"wrote {args.write_launch}", file=done)
    for path, text, note in emitted:
        write_text(path, text, args.overwrite)
        print(f"wrote {path}" + (f"\n{note}" if note else ""), file=done)


if __name__ == "__main__":
    sys.exit(main())
