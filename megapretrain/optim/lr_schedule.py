"""Learning-rate schedules: linear warmup, then cosine, linear, WSD or constant decay to min_lr.

The schedule is a pure function of the iteration, so resuming needs no scheduler state beyond the
iteration count (kept in the checkpoint anyway, with the config it was built from).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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

    def __call__(self, it: int) -> float:
        """Learning rate of optimizer step ``it``, counted from 1 like ``iter`` in metrics.jsonl.

        Warmup reaches ``lr`` at step ``warmup_iters``; the decay reaches ``min_lr`` at step
        ``decay_iters`` (so with decay_iters = train.iters the last step uses min_lr).
        """
        if self.warmup_iters > 0 and it <= self.warmup_iters:
            return self.lr * it / self.warmup_iters
        if self.decay == "constant":
            return self.lr
        if it >= self.decay_iters:
            return self.min_lr
        if self.decay == "wsd":
            decay_start = self.decay_iters - max(1, round(self.wsd_decay_fraction * self.decay_iters))
            decay_start = max(decay_start, self.warmup_iters)
            if it < decay_start:
                return self.lr
            progress = (it - decay_start) / max(1, self.decay_iters - decay_start)
            return self.min_lr + (self.lr - self.min_lr) * (1.0 - progress)
        progress = (it - self.warmup_iters) / max(1, self.decay_iters - self.warmup_iters)
        if self.decay == "linear":
            factor = 1.0 - progress
        else:  # cosine
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.lr - self.min_lr) * factor

    @classmethod
    def from_config(cls, cfg, decay_iters: int) -> LRSchedule:
        return cls(lr=cfg.optim.lr, min_lr=cfg.optim.min_lr, warmup_iters=cfg.schedule.warmup_iters,
                   decay_iters=decay_iters, decay=cfg.schedule.decay,
                   wsd_decay_fraction=cfg.schedule.wsd_decay_fraction)


def resolve_decay_iters(cfg: Config, iters: int) -> tuple[int, list[str]]:
    """The step the decay ends at (``schedule.decay_iters``, null: the run's ``iters`` steps),
    checked against the warmup, and the warnings a schedule deserves (a long warmup, a min_lr the
    run never reaches)."""
    s, o = cfg.schedule, cfg.optim
    decay_iters = s.decay_iters if s.decay_iters is not None else iters
    if decay_iters < s.warmup_iters:
        raise ConfigError(f"schedule.decay_iters={decay_iters} must be ≥ schedule.warmup_iters={s.warmup_iters}")
    if not 0 <= o.min_lr <= o.lr:
        raise ConfigError(f"optim.min_lr={o.min_lr} must be between 0 and optim.lr={o.lr}")
    warnings = []
    if s.warmup_iters > 0.05 * iters:
        warnings.append(f"schedule.warmup_iters={s.warmup_iters} is more than 5% of the run's {iters} steps")
    if s.decay != "constant" and decay_iters > iters and o.min_lr < o.lr:
        warnings.append(f"optim.min_lr={o.min_lr} is not reached: schedule.decay_iters={decay_iters} "
                        f"> the run's {iters} steps")
    return decay_iters, warnings
