"""Show a pipeline schedule before running it: each stage's idle time (the bubble), the peak number
of micro-batches whose activations it holds, the point-to-point traffic, and a timeline.

    python tools/pipeline_schedule.py --pp 4 --micro-batches 8 --timeline
    python tools/pipeline_schedule.py --pp 4 --vpp 2 --micro-batches 8 --timeline
    python tools/pipeline_schedule.py --pp 4 --micro-batches 8 --schedule zb_h1 --timeline
    python tools/pipeline_schedule.py --pp 4 --vpp 2 --micro-batches 8 --schedule zbv --timeline
    python tools/pipeline_schedule.py --config configs/llama3_405b.yaml        # at its GPU count
    python tools/pipeline_schedule.py --config configs/llama3_70b.yaml --world-size 1024 \\
        --parallel.vpp 2

The orders are the ones the trainer runs (``megapretrain.parallel.pipeline``), replayed with a
forward costing 1 and a backward costing ``--backward-cost`` (about 2; about 3 with full
recompute), each op starting once its stage is free and its input exists. The zero-bubble
schedules (zb_h1, zbv) run the ``--weight-cost`` part of each backward (about half of it) as a
separate W op, where the bubble was. With ``--config`` the
stages, chunks and micro-batches per step come from the config at ``--world-size`` GPUs (default:
the count its first line names), and any ``--section.key VALUE`` overrides it; the title then shows
where the stages sit in the 4D rank grid, and a transfer's size is a stage's share of each sample
(``seq_length / cp``, and ``/ tp`` with sequence parallelism).
"""

from __future__ import annotations

import argparse
import re
import sys

from megapretrain.cli import ToolParser, positive_float, positive_int, print_error, user_errors
from megapretrain.config import load_config
from megapretrain.errors import ConfigError, PipelineError
from megapretrain.parallel.pipeline import (
    AUTO,
    SCHEDULES,
    Schedule,
    op_costs,
    peak_in_flight,
    replay,
    resolve_schedule,
    simulate,
    transfer_rounds,
)
from megapretrain.resolve import resolve

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    pipelined = [s.name for s in SCHEDULES.values() if s.pipelines]
    described = "\n".join(f"  {s.name:<12} {s.description}" for s in SCHEDULES.values())
    ap = ToolParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Any other --section.key VALUE overrides the config.\n\n"
                                 f"schedules:\n{described}")
    ap.add_argument("--config",
                    help="YAML config: take pp, vpp, schedule and micro-batches from it")
    ap.add_argument("--world-size", type=positive_int,
                    help="GPUs for --config (default: the count its first line names)")
    ap.add_argument("--pp", type=positive_int, help="pipeline stages (without --config)")
    ap.add_argument("--vpp", type=positive_int, default=1,
                    help="virtual chunks per stage (without --config)")
    ap.add_argument("--micro-batches", type=positive_int, help="micro-batches per step and dp rank "
                                                               "(without --config)")
    ap.add_argument("--schedule", default=AUTO,
                    help=f"{', '.join([AUTO, *pipelined[:-1]])} or {pipelined[-1]} "
                         "(without --config)")
    ap.add_argument("--backward-cost", type=positive_float, default=2.0,
                    help="a backward's cost, a forward's being 1")
    ap.add_argument("--weight-cost", type=positive_float, default=None,
                    help="the weight-gradient part of the backward, run as W by zb_h1 and zbv "
                         "(default: half)")
    ap.add_argument("--timeline", action="store_true", help="draw each stage's ops over time")
    args, rest = ap.parse_known_args(argv)
    if args.config is None and rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)} (config overrides need --config)")
    if args.config is None and (args.pp is None or args.micro_batches is None):
        ap.error("give --config, or --pp and --micro-batches")
    if args.backward_cost <= 0:
        ap.error(f"--backward-cost={args.backward_cost} must be positive")
    if args.weight_cost is None:
        args.weight_cost = args.backward_cost / 2
    if args.weight_cost >= args.backward_cost:
        ap.error(f"--weight-cost={args.weight_cost:g} must be less than "
                 f"--backward-cost={args.backward_cost:g} (it is a part of the backward)")
    return args, rest


def from_config(path: str, world_size: int | None, overrides: list[str]) -> dict:
    """The pipeline of a config at a world size: stages, chunks, schedule, micro-batches, message
    size."""
    cfg = load_config(path, overrides)  # first: a file of another kind is refused as such
    if world_size is None:
        with open(path, encoding="utf-8") as fh:
            found = re.search(r"(\d+) GPUs", fh.readline())
        if found is None:
            raise ConfigError(f"{path}: its first line names no GPU count; pass --world-size")
        world_size = int(found.group(1))
    if cfg.model.vocab_size is None:
        # only the vocabulary padding depends on it; the pipeline does not
        cfg.model.vocab_size = 257
    sizes = resolve(cfg, world_size).sizes
    p, t = cfg.parallel, cfg.train
    # a stage's share of a sample
    seq = t.seq_length // p.cp // (p.tp if p.sequence_parallel and p.tp > 1 else 1)
    per_stage = world_size // sizes.pp
    grid = (f"rank grid arange({world_size}).reshape(pp={sizes.pp}, dp={sizes.dp}, cp={sizes.cp}, "
            f"tp={sizes.tp}): stage s is ranks {per_stage}·s .. {per_stage}·s + {per_stage - 1}, "
            f"each sending to the rank {per_stage} further on")
    return {"pp": sizes.pp, "vpp": p.vpp, "schedule": p.pp_schedule,
            "micro_batches": sizes.grad_accum,
            "message_bytes": t.micro_batch_size * seq * cfg.model.hidden_size * BYTES[t.precision],
            "title": f"{path} at {world_size} GPUs (tp={sizes.tp} cp={sizes.cp} pp={sizes.pp} "
                     f"dp={sizes.dp})", "grid": grid}


def spans(orders: list, pp: int, vpp: int, b_cost: float, w_cost: float, v_shape: bool,
          f_cost: float = 1.0) -> list[list[tuple]]:
    """Each stage's ops as (start, end, op), replayed at these costs of one chunk (what the
    timeline and tools/plot_schedule.py's picture draw)."""
    starts = replay(orders, pp, vpp, f_cost, b_cost, w_cost, v_shape)
    cost = op_costs(orders, f_cost, b_cost, w_cost)
    return [[(s, s + cost[op.kind], op) for s, op in zip(starts[r], orders[r])] for r in range(pp)]


def timeline(orders: list, pp: int, vpp: int, b_cost: float, w_cost: float = 0.0,
             v_shape: bool = False) -> list[str]:
    """One text row per stage; a column is one chunk's forward time, ``F3`` / ``b3`` / ``w3`` mark
    forward, backward and weight gradient of micro-batch 3 (``F3.1``: its chunk 1 when vpp > 1),
    ``.`` an idle column (costs rounded to whole columns)."""
    stages = spans(orders, pp, vpp, b_cost, w_cost, v_shape)
    end = max(e for stage in stages for _, e, _ in stage)
    label = (lambda op: f"{ {'F': 'F', 'B': 'b', 'W': 'w'}[op.kind]}{op.micro}"
             + (f".{op.chunk}" if vpp > 1 else ""))
    width = max(len(label(op)) for order in orders for op in order) + 1
    rows = []
    for r, stage in enumerate(stages):
        cells = ["." * (width - 1)] * int(round(end))
        for s, e, op in stage:
            for c in range(int(round(s)), int(round(e))):
                cells[c] = label(op).ljust(width - 1)
        rows.append(f"stage {r:<3}| " + " ".join(cells))
    return rows


def theory_line(kind: Schedule, pp: int, vpp: int, m: int, b_cost: float, w_cost: float,
                busy: float) -> str:
    """The schedule's bubble formula at these costs, where it has one (parallel/pipeline.py)."""
    try:
        idle = kind.idle(pp, vpp, m, 1.0 / vpp, b_cost / vpp, w_cost / vpp)
    except ValueError as why:
        return f"theory: {why}"
    return f"theory: idle {idle:g} forward-units per stage ({idle / (busy + idle):.1%} of the step)"


@user_errors
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.config:
            setup = from_config(args.config, args.world_size, overrides)
        else:
            setup = {"pp": args.pp, "vpp": args.vpp, "schedule": args.schedule,
                     "micro_batches": args.micro_batches, "message_bytes": None, "grid": None,
                     "title": f"pp={args.pp} vpp={args.vpp}"}
        pp, vpp, m = setup["pp"], setup["vpp"], setup["micro_batches"]
        if pp < 1 or vpp < 1 or m < 1:
            raise PipelineError(f"pp={pp}, vpp={vpp} and micro-batches={m} must be positive")
        kind = resolve_schedule(setup["schedule"], pp, vpp, m)
    except OSError as err:  # a UserError goes through user_errors: the same line, exit 2
        print_error(err)
        return 2
    orders = kind.orders(pp, vpp, m)
    v = kind.v_shape
    b_cost, w_cost = args.backward_cost, args.weight_cost
    # costs of one chunk: a chunk holds 1/vpp of a stage's layers, so that a step's busy time is
    # the same under every schedule
    sim = simulate(orders, pp, vpp, 1.0 / vpp, b_cost / vpp, w_cost / vpp, v_shape=v)
    plans = transfer_rounds(orders, pp, vpp, v)
    ideal = m * (1.0 + b_cost)  # one stage's busy time
    split = kind.split_backward
    print(f"{setup['title']} | schedule {kind.name} | {m} micro-batches per step | backward = "
          f"{b_cost:g} × forward" + (f", its weight gradient {w_cost:g} of it run as W ops" if split
                                     else ""))
    if setup["grid"]:
        print(setup["grid"])
    print(f"{'stage':>5} {'ops':>6} {'idle':>7} {'peak in-flight':>15} {'sends':>6} "
          f"{'receives':>9}")
    for r in range(pp):
        sends = sum(len(s.sends) for s in plans[r])
        recvs = sum(len(s.recvs) for s in plans[r])
        print(f"{r:>5} {len(orders[r]):>6} {sim['idle_fraction'][r]:>7.1%} "
              f"{peak_in_flight(orders[r]):>15} {sends:>6} {recvs:>9}")
    print(f"step time {sim['makespan']:g} forward-units; without a bubble {ideal:g} "
          f"(efficiency {ideal / sim['makespan']:.1%}); 1F1B's bubble (pp-1)/(m+pp-1) = "
          f"{(pp - 1) / (m + pp - 1):.1%}")
    print(theory_line(kind, pp, vpp, m, b_cost, w_cost, ideal))
    print("peak in-flight: micro-batches whose forward ran and " + ("W" if split else "backward")
          + " has not on one chunk (activation memory)"
          + (f"; a chunk holds 1/{vpp} of the stage's layers" if vpp > 1 else ""))
    if setup["message_bytes"] is not None and pp > 1:
        most = max(sum(len(s.sends) for s in steps) for steps in plans)
        print(f"point-to-point: {setup['message_bytes'] / 2**20:.1f} MiB per transfer, at most "
              f"{most * setup['message_bytes'] / 2**30:.2f} GiB sent per stage and step")
    if args.timeline:
        print()
        print("\n".join(timeline(orders, pp, vpp, b_cost, w_cost, v)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
