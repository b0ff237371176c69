"""Draw a config's learning-rate curve (and batch-size ramp-up) without training, and state its facts.

    python tools/plot_schedule.py --config configs/tiny.yaml                     # writes lr_schedule.png
    python tools/plot_schedule.py --config configs/tiny.yaml --train.iters 1000 --output /tmp/lr.png

The curve is megapretrain.optim.lr_schedule.LRSchedule — the function the trainer calls — at
every iteration from 1 to train.iters. Printed: the warmup's share of the run and whether (and
when) optim.min_lr is reached. With ``train.rampup_batch_size: [start, increment, ramp_samples]``
set (Megatron's rule, ``megapretrain.config.batch_size_at``: the batch grows by ``increment`` each
ramp_samples / ((global - start) / increment) samples, up to train.global_batch_size) a second
panel shows the batch size per step; with ``train.train_tokens`` set the steps are those it takes.
"""

from __future__ import annotations

import argparse
import sys

from megapretrain.cli import user_errors
from megapretrain.config import ConfigError, load_config
from megapretrain.data.sampler import batch_size_at, run_length
from megapretrain.errors import UserError
from megapretrain.optim.lr_schedule import LRSchedule


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--config", help="YAML config (configs/NAME.yaml); --section.key VALUE overrides follow")
    ap.add_argument("--output", default="lr_schedule.png", help="PNG to write (default: lr_schedule.png)")
    return ap.parse_known_args(argv)


def schedule_of(cfg) -> tuple[LRSchedule, int]:
    """The trainer's LR schedule for ``cfg`` and the optimizer steps the run takes (train.iters, or
    as many as train.train_tokens need)."""
    s = cfg.schedule
    iters, _ = run_length(cfg.train)
    decay_iters = s.decay_iters if s.decay_iters is not None else iters
    if decay_iters < s.warmup_iters:
        raise ConfigError(f"schedule.decay_iters={decay_iters} must be ≥ schedule.warmup_iters={s.warmup_iters}")
    if not 0 <= cfg.optim.min_lr <= cfg.optim.lr:
        raise ConfigError(f"optim.min_lr={cfg.optim.min_lr} must be between 0 and optim.lr={cfg.optim.lr}")
    return LRSchedule.from_config(cfg, decay_iters), iters


def batch_sizes(t, iters: int) -> list[int] | None:
    """Samples per step at every iteration under ``train.rampup_batch_size`` (None: no ramp-up)."""
    rampup = t.rampup_batch_size
    if not rampup:
        return None
    if (len(rampup) != 3 or not all(isinstance(v, (int, float)) and v > 0 for v in rampup)
            or not rampup[0] < t.global_batch_size):
        raise ConfigError(f"train.rampup_batch_size={rampup} must be [start, increment, ramp_samples], positive, "
                          f"with start < train.global_batch_size={t.global_batch_size}")
    sizes, consumed = [], 0
    for _ in range(iters):
        sizes.append(batch_size_at(consumed, t.global_batch_size, rampup))
        consumed += sizes[-1]
    return sizes


def facts(schedule: LRSchedule, iters: int, lrs: list[float]) -> list[str]:
    """The lines printed under the picture: warmup share, whether min_lr is reached."""
    lines = [f"warmup: {schedule.warmup_iters} of {iters} iterations = {100 * schedule.warmup_iters / iters:.1f}% "
             "of the run" + (" (more than 5%)" if schedule.warmup_iters > 0.05 * iters else "")]
    if schedule.decay == "constant":
        lines.append(f"min_lr: not reached (decay constant: the lr stays at {schedule.lr:g} after warmup)")
        return lines
    reached = next((i + 1 for i, lr in enumerate(lrs) if i + 1 > schedule.warmup_iters
                    and lr <= schedule.min_lr * (1 + 1e-9)), None)
    if reached is not None:
        lines.append(f"min_lr: {schedule.min_lr:g} reached at iteration {reached} of {iters}")
    else:
        lines.append(f"min_lr: {schedule.min_lr:g} not reached: the last iteration's lr is {lrs[-1]:.4g} "
                     f"(schedule.decay_iters={schedule.decay_iters} > train.iters={iters})")
    return lines


@user_errors
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    if not args.output.lower().endswith(".png"):
        raise UserError(f"--output {args.output}: the picture is a PNG; give a name ending in .png")
    cfg = load_config(args.config, overrides)
    schedule, iters = schedule_of(cfg)
    steps = list(range(1, iters + 1))
    lrs = [schedule(it) for it in steps]
    batch = batch_sizes(cfg.train, iters)
    from megapretrain.monitor.plots import plot_schedule_curves

    title = (f"{args.config or 'defaults'}: {schedule.decay} schedule, lr {schedule.lr:g} → {schedule.min_lr:g}, "
             f"decay_iters {schedule.decay_iters}, {iters} iterations")
    plot_schedule_curves(args.output, title, steps, lrs, batch, schedule.warmup_iters, schedule.min_lr)
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
