"""Draw a config's learning-rate curve (and batch-size ramp-up) without training, and state its
facts; or, with ``--pipeline``, the timelines of pipeline schedules.

    python tools/plot_schedule.py --config configs/tiny.yaml                # writes lr_schedule.png
    python tools/plot_schedule.py --config configs/tiny.yaml --train.iters 1000 --output /tmp/lr.png
    python tools/plot_schedule.py --pipeline --pp 4 --micro-batches 8 --schedules 1f1b,zb_h1,zbv \\
        --output pipeline.png                                               # one panel per schedule

The curve is megapretrain.optim.lr_schedule.LRSchedule — the function the trainer calls — at
every iteration from 1 to train.iters. Printed: the warmup's share of the run and whether (and
when) optim.min_lr is reached. With ``train.rampup_batch_size: [start, increment, ramp_samples]``
set (Megatron's rule, ``megapretrain.config.batch_size_at``: the batch grows by ``increment`` each
ramp_samples / ((global - start) / increment) samples, up to train.global_batch_size) a second
panel shows the batch size per step; with ``train.train_tokens`` set the steps are those it takes.

``--pipeline`` draws each schedule's orders (``megapretrain.parallel.pipeline``, what the trainer
runs) replayed as ``tools/pipeline_schedule.py`` replays them: a stage's forward costing 1, its
backward ``--backward-cost``, the ``--weight-cost`` part of it run as W ops by zb_h1 and zbv; vpp
2 for interleaved and zbv (a chunk costing half), so that every panel does the same work on one
time axis. With ``--config`` the stages and micro-batches come from the config (at
``--world-size`` GPUs) and the schedules default to its own.
"""

from __future__ import annotations

import argparse
import sys

from megapretrain.cli import ToolParser, positive_float, positive_int, user_errors
from megapretrain.config import ConfigError, load_config
from megapretrain.data.sampler import batch_size_at, run_length
from megapretrain.errors import UserError
from megapretrain.optim.lr_schedule import LRSchedule
from megapretrain.parallel.pipeline import SCHEDULES, resolve_schedule


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = ToolParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--config", help="YAML config (configs/NAME.yaml); --section.key VALUE "
                                     "overrides follow")
    ap.add_argument("--output", default=None, help="PNG to write (default: lr_schedule.png, or "
                                                   "pipeline.png)")
    ap.add_argument("--pipeline", action="store_true",
                    help="draw pipeline schedules instead of the LR curve")
    ap.add_argument("--pp", type=positive_int, help="--pipeline: stages (without --config)")
    ap.add_argument("--micro-batches", type=positive_int, help="--pipeline: micro-batches per step "
                                                               "(without --config)")
    ap.add_argument("--world-size", type=positive_int,
                    help="--pipeline with --config: GPUs (default: its first line's)")
    ap.add_argument("--schedules", default=None,
                    help="--pipeline: comma-separated schedules to draw (default: 1f1b,zb_h1,zbv; "
                         "the config's own)")
    ap.add_argument("--backward-cost", type=positive_float, default=2.0,
                    help="--pipeline: a backward, a forward being 1")
    ap.add_argument("--weight-cost", type=positive_float, default=1.0,
                    help="--pipeline: the weight-gradient part of the backward (zb_h1, zbv)")
    args, rest = ap.parse_known_args(argv)
    if args.output is None:
        args.output = "pipeline.png" if args.pipeline else "lr_schedule.png"
    if args.pipeline and args.config is None and (args.pp is None or args.micro_batches is None):
        ap.error("--pipeline needs --config, or --pp and --micro-batches")
    if args.pipeline and args.weight_cost >= args.backward_cost:
        ap.error(f"--weight-cost={args.weight_cost:g} must be less than "
                 f"--backward-cost={args.backward_cost:g}")
    return args, rest


def pipeline_panels(args, overrides: list[str]) -> tuple[str, list]:
    """(title, one (name, stages) panel per schedule) for --pipeline, and their idle fractions
    printed."""
    from .pipeline_schedule import from_config, spans

    if args.config:
        setup = from_config(args.config, args.world_size, overrides)
        pp, m, title = setup["pp"], setup["micro_batches"], setup["title"]
        names = (args.schedules or setup["schedule"]).split(",")
    else:
        pp, m, title = args.pp, args.micro_batches, f"pp={args.pp}"
        names = (args.schedules or "1f1b,zb_h1,zbv").split(",")
    panels = []
    for name in names:
        vpp = SCHEDULES[name].shown_vpp if name in SCHEDULES else 1  # auto: one chunk per stage
        kind = resolve_schedule(name, pp, vpp, m)
        orders = kind.orders(pp, vpp, m)
        v = kind.v_shape
        b, w = args.backward_cost, args.weight_cost
        stages = spans(orders, pp, vpp, b / vpp, w / vpp, v, f_cost=1.0 / vpp)
        makespan = max(e for stage in stages for _, e, _ in stage)
        idle = 1 - m * (1 + b) / makespan
        chunked = vpp > 1
        panels.append((f"{kind.name} (vpp {vpp}): step {makespan:g}, idle {idle:.1%}",
                       [[(s, e, op.kind,
                          f"{op.kind}{op.micro}" + (f".{op.chunk}" if chunked else ""))
                         for s, e, op in stage] for stage in stages]))
        print(f"{kind.name:>12}: step {makespan:g} forward-units, idle {idle:.1%} of it on every "
              "stage")
    return f"{title}, {m} micro-batches, backward {args.backward_cost:g} (weight gradient " \
           f"{args.weight_cost:g})", panels


def schedule_of(cfg) -> tuple[LRSchedule, int]:
    """The trainer's LR schedule for ``cfg`` and the optimizer steps the run takes (train.iters, or
    as many as train.train_tokens need)."""
    s = cfg.schedule
    iters, _ = run_length(cfg.train)
    decay_iters = s.decay_iters if s.decay_iters is not None else iters
    if decay_iters < s.warmup_iters:
        raise ConfigError(f"schedule.decay_iters={decay_iters} must be ≥ "
                          f"schedule.warmup_iters={s.warmup_iters}")
    if not 0 <= cfg.optim.min_lr <= cfg.optim.lr:
        raise ConfigError(f"optim.min_lr={cfg.optim.min_lr} must be between 0 and "
                          f"optim.lr={cfg.optim.lr}")
    return LRSchedule.from_config(cfg, decay_iters), iters


def batch_sizes(t, iters: int) -> list[int] | None:
    """Samples per step at every iteration under ``train.rampup_batch_size`` (None: no ramp-up)."""
    rampup = t.rampup_batch_size
    if not rampup:
        return None
    if (len(rampup) != 3 or not all(isinstance(v, (int, float)) and v > 0 for v in rampup)
            or not rampup[0] < t.global_batch_size):
        raise ConfigError(f"train.rampup_batch_size={rampup} must be [start, increment, "
                          "ramp_samples], positive, with start < "
                          f"train.global_batch_size={t.global_batch_size}")
    sizes, consumed = [], 0
    for _ in range(iters):
        sizes.append(batch_size_at(consumed, t.global_batch_size, rampup))
        consumed += sizes[-1]
    return sizes


def facts(schedule: LRSchedule, iters: int, lrs: list[float]) -> list[str]:
    """The lines printed under the picture: warmup share, whether min_lr is reached."""
    lines = [f"warmup: {schedule.warmup_iters} of {iters} iterations = "
             f"{100 * schedule.warmup_iters / iters:.1f}% of the run"
             + (" (more than 5%)" if schedule.warmup_iters > 0.05 * iters else "")]
    if schedule.decay == "constant":
        lines.append(f"min_lr: not reached (decay constant: the lr stays at {schedule.lr:g} after "
                     "warmup)")
        return lines
    reached = next((i + 1 for i, lr in enumerate(lrs) if i + 1 > schedule.warmup_iters
                    and lr <= schedule.min_lr * (1 + 1e-9)), None)
    if reached is not None:
        lines.append(f"min_lr: {schedule.min_lr:g} reached at iteration {reached} of {iters}")
    else:
        lines.append(f"min_lr: {schedule.min_lr:g} not reached: the last iteration's lr is "
                     f"{lrs[-1]:.4g} (schedule.decay_iters={schedule.decay_iters} > "
                     f"train.iters={iters})")
    return lines


@user_errors
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    if not args.output.lower().endswith(".png"):
        raise UserError(f"--output {args.output}: the picture is a PNG; give a name ending in .png")
    if args.pipeline:
        from megapretrain.monitor.plots import plot_pipeline

        title, panels = pipeline_panels(args, overrides)
        plot_pipeline(args.output, title, panels)
        print(f"wrote {args.output}")
        return 0
    cfg = load_config(args.config, overrides)
    schedule, iters = schedule_of(cfg)
    steps = list(range(1, iters + 1))
    lrs = [schedule(it) for it in steps]
    batch = batch_sizes(cfg.train, iters)
    from megapretrain.monitor.plots import plot_schedule_curves

    title = (f"{args.config or 'defaults'}: {schedule.decay} schedule, lr {schedule.lr:g} → "
             f"{schedule.min_lr:g}, decay_iters {schedule.decay_iters}, {iters} iterations")
    plot_schedule_curves(args.output, title, steps, lrs, batch, schedule.warmup_iters,
                         schedule.min_lr)
    for line in facts(schedule, iters, lrs):
        print(line)
    if batch:
        full = next((i + 1 for i, b in enumerate(batch) if b == cfg.train.global_batch_size), None)
        print(f"batch ramp-up: {batch[0]} → {cfg.train.global_batch_size} samples per step"
              + (f", full from iteration {full}" if full else f", not full by iteration {iters}"))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
