"""Choose a parallel layout before spending GPU hours: memory per GPU, step time, MFU, run length.

    python tools/plan.py --config configs/llama3_70b.yaml --gpus 512 --device h100
    python tools/plan.py --config configs/llama3_8b.yaml --gpus 64 --device a100 --top 5
    python tools/plan.py --config configs/llama3_405b.yaml --gpus 2048 --check      # the config's own layout

Every layout of ``--gpus`` devices (tp within a node, pp dividing the layers, virtual chunks, micro
batches 1-4, ZeRO 0-2, recompute none/full, sequence parallelism with tp) is estimated with the
model of ``megapretrain/planner.py``; those that fit in memory are ranked by step time. The table
shows memory on the busiest stage, the step's time and its parts, MFU against the device's dense
bf16 peak, and the days ``train.iters`` steps take; the fastest layout's flags follow. ``--check``
estimates only the layout the config already has. Device figures can be overridden (``--peak-tflops``,
``--memory-gb``, ``--intra-gbs``, ``--inter-gbs``, ``--efficiency``). Any other ``--section.key
VALUE`` overrides the config (e.g. ``--train.global_batch_size 2048``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megapretrain.config import load_config, validate
from megapretrain.errors import ConfigError, UserError
from megapretrain.model.build import model_args
from megapretrain.monitor.flops import DEVICES, with_device
from megapretrain.planner import GIB, Layout, estimate, search


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="YAML config (model, batch, sequence, iterations)")
    ap.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    ap.add_argument("--device", default="h100", choices=sorted(DEVICES), help="GPU type (default h100)")
    ap.add_argument("--top", type=int, default=8, help="layouts to show")
    ap.add_argument("--check", action="store_true", help="estimate only the config's own layout")
    for name, help_ in (("peak-tflops", "dense bf16 peak per GPU"), ("memory-gb", "memory per GPU"),
                        ("intra-gbs", "bus bandwidth within a node, GB/s"),
                        ("inter-gbs", "bandwidth per GPU between nodes, GB/s"),
                        ("efficiency", "fraction of peak the matmuls reach")):
        ap.add_argument(f"--{name}", type=float, help=help_)
    args, rest = ap.parse_known_args(argv)
    if args.gpus < 1 or args.top < 1:
        ap.error("--gpus and --top must be positive")
    return args, rest


def describe(e, iters: int) -> list[str]:
    L, t, mem = e.layout, e.time, e.memory
    return [str(L.tp), str(L.pp), str(L.vpp), str(L.dp), str(L.micro_batch), str(L.zero), L.recompute,
            f"{mem['total'] / GIB:.1f}", f"{t['total']:.2f}",
            f"{t['compute']:.2f}/{t['tensor']:.2f}/{t['bubble']:.2f}/{t['data']:.2f}/{t['p2p']:.2f}",
            f"{e.mfu:.1%}", f"{e.tokens_per_gpu_s:,.0f}", f"{iters * t['total'] / 86400:.1f}"]


HEADER = ["tp", "pp", "vpp", "dp", "mb", "zero", "recompute", "mem GB", "step s",
          "compute/tp/bubble/dp/p2p s", "MFU", "tok/s/GPU", "days"]


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows + [HEADER]) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [HEADER] + rows)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(args.config, overrides)
        m, t = cfg.model, cfg.train
        if m.vocab_size is None:
            raise ConfigError("model.vocab_size is null: set it (--model.vocab_size N) for the plan")
        device = with_device(DEVICES[args.device], peak_tflops=args.peak_tflops, memory_gb=args.memory_gb,
                             intra_gbs=args.intra_gbs, inter_gbs=args.inter_gbs, efficiency=args.efficiency)
        model = model_args(cfg)
        if args.check:
            sizes, _ = validate(cfg, args.gpus)
            p = cfg.parallel
            layout = Layout(p.tp, p.pp, sizes.dp, p.vpp, t.micro_batch_size, p.zero, p.recompute,
                            tuple(p.pipeline_layers) if p.pipeline_layers else None)
            found = [estimate(model, t.seq_length, layout, t.global_batch_size, device, t.precision, p.pp_schedule)]
        else:
            found = search(model, t.seq_length, args.gpus, t.global_batch_size, device, t.precision)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    tokens = t.global_batch_size * t.seq_length
    print(f"{args.config}: {m.num_layers} layers, hidden {m.hidden_size}, {t.global_batch_size} × {t.seq_length} "
          f"= {tokens:,} tokens per step, {t.iters:,} steps, {t.precision}; {args.gpus} × {device.name} "
          f"({device.peak_tflops:g} TFLOP/s at {device.efficiency:.0%}, {device.memory_gb:g} GB)")
    fitting = [e for e in found if e.fits]
    if not found:
        print("no layout of these GPUs divides the model and batch; change --gpus or train.global_batch_size")
        return 1
    if not fitting:
        print(f"nothing fits in {device.memory_gb:g} GB; the leanest layouts need:")
        print(table([describe(e, t.iters) for e in sorted(found, key=lambda e: e.memory["total"])[:args.top]]))
        return 1
    print(table([describe(e, t.iters) for e in fitting[:args.top]]))
    best = fitting[0]
    print(f"\n{'layout' if args.check else 'fastest'}: {best.layout.flags()}")
    print(f"  {best.time['total']:.2f} s per step, {best.mfu:.1%} MFU, {t.iters * best.time['total'] / 86400:.1f} days "
          f"for {t.iters:,} steps; {best.memory['total'] / GIB:.1f} of {device.memory_gb:g} GB on the busiest stage "
          f"(state {best.memory['state'] / GIB:.1f}, activations {best.memory['activations'] / GIB:.1f}, "
          f"allowance {best.memory['overhead'] / GIB:.1f})")
    print("  estimates: check them with tools/bench_train.py on the real machines before the run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
