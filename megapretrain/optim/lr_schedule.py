"""Learning-rate schedules: linear warmup, then cosine, linear, WSD or constant decay to min_lr.

The schedule is a pure function of the iteration, so resuming needs no scheduler state beyond the
iteration count; checkpoints keep the schedule they were trained with all the same
(:meth:`LRSchedule.to_dict`), because a resumed run keeps it (:func:`resumed_schedule`): changing
``train.iters`` moves where a null ``schedule.decay_iters`` would end, and a finished cosine run
extended that way would jump from ``min_lr`` back up, in the middle of training, without a word.

A re-warm (``schedule.rewarm_iters``, when a run is extended past its schedule's end) is a second
schedule that starts where the first ended: it warms from the rate reached there back to
``optim.lr`` and decays to ``optim.min_lr`` at the new end; before its start the first one holds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config import Config


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    decay: str = "cosine"
    wsd_decay_fraction: float = 0.2
    start: int = 0                         # the iteration this schedule takes over after (0: the
    #                                        run's start)
    start_lr: float = 0.0                  # the rate its warmup starts from
    before: LRSchedule | None = None       # the schedule of iterations up to ``start`` (a re-warm's
    #                                        first)

    def __call__(self, it: int) -> float:
        """Learning rate of optimizer step ``it``, counted from 1 like ``iter`` in metrics.jsonl.

        Warmup reaches ``lr`` at step ``start + warmup_iters``; the decay reaches ``min_lr`` at step
        ``decay_iters`` (so with decay_iters = train.iters the last step uses min_lr).
        """
        if self.before is not None and it <= self.start:
            return self.before(it)
        warm_end = self.start + self.warmup_iters
        if self.warmup_iters > 0 and it <= warm_end:
            return self.start_lr + (self.lr - self.start_lr) * (it - self.start) / self.warmup_iters
        if self.decay == "constant":
            return self.lr
        if it >= self.decay_iters:
            return self.min_lr
        if self.decay == "wsd":
            length = self.decay_iters - self.start
            decay_start = max(self.decay_iters - max(1, round(self.wsd_decay_fraction * length)),
                              warm_end)
            if it < decay_start:
                return self.lr
            progress = (it - decay_start) / max(1, self.decay_iters - decay_start)
            return self.min_lr + (self.lr - self.min_lr) * (1.0 - progress)
        progress = (it - warm_end) / max(1, self.decay_iters - warm_end)
        if self.decay == "linear":
            factor = 1.0 - progress
        else:  # cosine
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.lr - self.min_lr) * factor

    @property
    def end(self) -> int:
        """The last iteration whose rate the schedule changes (after it: constant)."""
        return self.start + self.warmup_iters if self.decay == "constant" else self.decay_iters

    @classmethod
    def from_config(cls, cfg, decay_iters: int) -> LRSchedule:
        return cls(lr=cfg.optim.lr, min_lr=cfg.optim.min_lr, warmup_iters=cfg.schedule.warmup_iters,
                   decay_iters=decay_iters, decay=cfg.schedule.decay,
                   wsd_decay_fraction=cfg.schedule.wsd_decay_fraction)

    def to_dict(self) -> dict:
        """The schedule as JSON-able data (what a checkpoint keeps)."""
        out = {k: v for k, v in asdict(self).items() if k != "before"}
        out["before"] = None if self.before is None else self.before.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict) -> LRSchedule:
        before = data.get("before")
        return cls(**{**data, "before": None if before is None else cls.from_dict(before)})

    def describe(self) -> str:
        """One phrase: ``cosine 2e-03 → 2e-04 at 300 (warmup 15)``, with a re-warm's first
        schedule."""
        shape = f"{self.decay} {self.lr:.3g} → {self.min_lr:.3g} at {self.decay_iters}" \
            if self.decay != "constant" else f"constant {self.lr:.3g}"
        if self.before is None:
            return f"{shape} (warmup {self.warmup_iters})"
        return f"{self.before.describe()}, then from iteration {self.start} re-warmed over " \
               f"{self.warmup_iters} " \
               f"steps to {shape}"


def resolve_decay_iters(cfg: Config, iters: int) -> tuple[int, list[str]]:
    """The step the decay ends at (``schedule.decay_iters``, null: the run's ``iters`` steps),
    checked against the warmup, and the warnings a schedule deserves (a long warmup, a min_lr the
    run never reaches)."""
    s, o = cfg.schedule, cfg.optim
    decay_iters = s.decay_iters if s.decay_iters is not None else iters
    if decay_iters < s.warmup_iters:
        raise ConfigError(f"schedule.decay_iters={decay_iters} must be ≥ "
                          f"schedule.warmup_iters={s.warmup_iters}")
    if not 0 <= o.min_lr <= o.lr:
        raise ConfigError(f"optim.min_lr={o.min_lr} must be between 0 and optim.lr={o.lr}")
    warnings = []
    if s.warmup_iters > 0.05 * iters:
        warnings.append(f"schedule.warmup_iters={s.warmup_iters} is more than 5% of the run's "
                        f"{iters} steps")
    if s.decay != "constant" and decay_iters > iters and o.min_lr < o.lr:
        warnings.append(f"optim.min_lr={o.min_lr} is not reached: "
                        f"schedule.decay_iters={decay_iters} > the run's {iters} steps")
    return decay_iters, warnings


def resumed_schedule(cfg: Config, saved: LRSchedule | None, iteration: int,
                     iters: int) -> tuple[LRSchedule, str]:
    """The schedule a run resumed at ``iteration`` of ``iters`` trains with, and a note on it (""
    when there is nothing to say). ``saved``: the schedule its checkpoint was trained with (None: a
    checkpoint that kept none: the config's).

    - ``schedule.decay_iters`` given: the config's schedule, whole.
    - else the checkpoint's decay end (and its re-warms) with the config's rates and shape: changing
      ``train.iters`` does not move the decay.
    - a run extended past that end continues at ``optim.min_lr``, or with ``schedule.rewarm_iters``
      > 0 re-warms from there to ``optim.lr`` and decays to ``optim.min_lr`` at ``iters``.
    """
    s = cfg.schedule
    config = LRSchedule.from_config(cfg, s.decay_iters if s.decay_iters is not None else iters)
    if saved is None or s.decay_iters is not None:
        return config, ""
    kept = _with_rates(saved, config)
    end = kept.end
    if iters <= end or s.decay == "constant":
        return kept, ""
    if s.rewarm_iters == 0:
        return kept, (f"schedule: the run is extended past its schedule's end at iteration {end} "
                      f"and continues at {kept(end + 1):.3g} (--schedule.rewarm_iters N re-warms "
                      "to optim.lr and decays again to the new train.iters; "
                      "--schedule.decay_iters M sets one decay for the whole run)")
    start = max(end, iteration)
    if iters - start < s.rewarm_iters:
        raise ConfigError(f"schedule.rewarm_iters={s.rewarm_iters} does not fit in the "
                          f"{iters - start} steps from iteration {start} to train.iters={iters}: "
                          "lower it or raise train.iters")
    rewarm = replace(config, warmup_iters=s.rewarm_iters, decay_iters=iters, start=start,
                     start_lr=kept(start), before=kept)
    return rewarm, f"schedule: re-warming from iteration {start}: {rewarm.describe()}"


def _with_rates(saved: LRSchedule, config: LRSchedule) -> LRSchedule:
    """``saved``'s iterations (decay end, re-warm starts) with ``config``'s rates and shape."""
    before = None if saved.before is None else _with_rates(saved.before, config)
    # a re-warm keeps its own
    warmup = config.warmup_iters if saved.before is None else saved.warmup_iters
    return replace(config, warmup_iters=warmup, decay_iters=saved.decay_iters, start=saved.start,
                   start_lr=0.0 if before is None else before(saved.start), before=before)
