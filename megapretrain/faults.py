"""Fault injection for tests and drills (``faults.*``, all off by default).

Each fault happens at one iteration (counted from 1, like ``iter`` in metrics.jsonl) on the global
rank ``faults.rank`` (-1: every rank), so the reaction to it — a skipped step, a rollback, a
watchdog exit, the out-of-memory guidance — can be rehearsed on purpose:

    nan_at        NaN in the grads (reduced to every rank): the step is skipped, the parameters
                  unchanged
    spike_at      the batch of that iteration is corrupt (targets shifted): a loss spike; the
                  corruption belongs to that data position, so a rollback that skips it trains clean
                  data
    exit_at       the rank exits at once (status 1), as a crashed node
    hang_at       the rank blocks forever, as one stuck in a collective
    slow_data_at  the step waits faults.slow_data_s for its data (and the faults.slow_data_steps - 1
                  after it)
    oom_at        an out-of-memory error at the step

A drill that could never fire is refused before any work, in one line naming the field, the rule
and the fix (:func:`check_faults` as the config is resolved, :func:`check_resumed_faults` once the
iteration a run resumes from is known): an iteration past the run's end, a rank outside the world,
a NaN or a spike on a rank whose stage computes no loss, a data wait of no time, a hang on one rank
with the watchdog off (nothing would ever end it), an iteration a resumed run has passed.

A drill fires once per run directory: as it fires, the rank records it in
``RUN_DIR/faults/NAME.rankR.json``, and a later process on the same run directory — a restart by
the launcher after the drill's exit or hang, a resume — does not inject it again (it says so). So a
restarted run goes on past its drill, as it would past a real fault. Inside one process a drill
stays what it is (a rollback that trains the spiked batch again sees it spiked). With
``faults.every_attempt`` a drill is neither recorded nor looked up: it fires again in every process
on the run directory, after each restart — the same failure at the same iteration every attempt, a
crash loop.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch

from .errors import ConfigError


class Faults:
    NAMES = ("nan_at", "spike_at", "exit_at", "hang_at", "slow_data_at", "oom_at")

    def __init__(self, cfg, rank: int, run_dir: str):
        """``cfg``: the ``faults`` config section; ``rank``: this process's global rank;
        ``run_dir``: where the drills that fired are recorded."""
        self.cfg, self.rank = cfg, rank
        self.mine = cfg.rank in (-1, rank)
        self.corrupt_sample: int | None = None  # where the corrupt batch starts in the data
        self.dir = os.path.join(run_dir, "faults")
        self.fired = set() if cfg.every_attempt else \
            {name for name in self.NAMES
             if getattr(cfg, name) is not None and os.path.exists(self._record(name))}
        self.now: set[str] = set()  # the drills this process fired (they stay in force for it)

    def already_fired(self) -> list[str]:
        """The drills asked for that fired in an earlier process on this run directory: not
        again."""
        return [f"faults.{name}={getattr(self.cfg, name)}" for name in sorted(self.fired)]

    def _record(self, name: str) -> str:
        return os.path.join(self.dir, f"{name}.rank{self.rank}.json")

    def _at(self, name: str, iteration: int, steps: int = 1) -> bool:
        at = getattr(self.cfg, name)
        if not self.mine or name in self.fired or at is None or not at <= iteration < at + steps:
            return False
        # recorded before it strikes: an exit or a hang leaves no later chance
        if name not in self.now and not self.cfg.every_attempt:
            os.makedirs(self.dir, exist_ok=True)
            with open(self._record(name), "w") as fh:
                json.dump({"fault": name, "iter": iteration, "rank": self.rank,
                           "time": time.time()}, fh)
                fh.flush()
                os.fsync(fh.fileno())
        self.now.add(name)
        return True

    def before_step(self, iteration: int) -> None:
        """Faults that strike as step ``iteration`` starts: exit, hang, out-of-memory."""
        if self._at("exit_at", iteration):
            print(f"faults.exit_at={iteration}: exiting", file=sys.stderr, flush=True)
            os._exit(1)
        if self._at("hang_at", iteration):
            print(f"faults.hang_at={iteration}: blocking forever", file=sys.stderr, flush=True)
            threading.Event().wait()
        if self._at("oom_at", iteration):
            raise torch.OutOfMemoryError(f"faults.oom_at={iteration}: an injected out-of-memory "
                                         "error")

    def data_delay(self, iteration: int) -> None:
        """The injected data wait of step ``iteration`` (counted as the step's data time)."""
        if self._at("slow_data_at", iteration, self.cfg.slow_data_steps):
            time.sleep(self.cfg.slow_data_s)

    def corrupt(self, iteration: int, consumed_samples: int, batches: list,
                vocab_size: int) -> list:
        """The micro-batches of step ``iteration`` (after ``consumed_samples``), their targets
        shifted when they are the corrupt batch: the one spike_at first read."""
        if self._at("spike_at", iteration) and self.corrupt_sample is None:
            self.corrupt_sample = consumed_samples
        if consumed_samples != self.corrupt_sample:
            return batches
        return [(tokens, None if targets is None else _shifted(targets, vocab_size)) for tokens,
                targets in batches]

    def grad_factor(self, iteration: int) -> float:
        """What step ``iteration`` multiplies its backward by: NaN at nan_at (on this rank, so the
        data-parallel reduction carries it to every rank, as a real overflow would), else 1."""
        return float("nan") if self._at("nan_at", iteration) else 1.0


def _fault_fields(cfg) -> list[tuple[str, int]]:
    """``(name, iteration)`` of every drill ``cfg`` (the ``faults`` section) asks for."""
    return [(name, getattr(cfg, name)) for name in Faults.NAMES if getattr(cfg, name) is not None]


def _last_iter(name: str, cfg) -> int:
    """The last iteration at which drill ``name`` strikes (a data wait lasts slow_data_steps)."""
    steps = cfg.slow_data_steps if name == "slow_data_at" else 1
    return getattr(cfg, name) + steps - 1


# the drills whose effect goes through the loss: a rank whose pipeline stage has no loss head
# computes none (its backward starts from the next stage's gradient, its targets are unread)
_THROUGH_THE_LOSS = ("nan_at", "spike_at")


def check_faults(cfg, iters: int, world_size: int, head_ranks: list[int], length: str) -> None:
    """Refuse a drill of ``cfg`` (the whole config) that can never fire in a run of ``iters``
    steps (``length``: the field that sets it) on ``world_size`` ranks, where ``head_ranks`` are
    the ranks of the pipeline stage with the loss head."""
    f = cfg.faults
    asked = _fault_fields(f)
    for name, at in asked:
        if at > iters:
            raise ConfigError(f"faults.{name}={at} can never fire: the run ends at iteration "
                              f"{iters} ({length}); use --faults.{name} {iters} or less, or drop "
                              "it")
    if asked and f.rank >= world_size:
        raise ConfigError(f"faults.rank={f.rank} can never fire: the run has {world_size} "
                          f"rank(s), 0..{world_size - 1}; use --faults.rank {world_size - 1} or "
                          "less, or -1 (every rank)")
    for name, at in asked:
        if name in _THROUGH_THE_LOSS and f.rank != -1 and f.rank not in head_ranks:
            raise ConfigError(f"faults.{name}={at} can never fire on faults.rank={f.rank}: only "
                              f"the pipeline stage with the loss ({_ranks(head_ranks)}) computes "
                              f"it; use --faults.rank {head_ranks[0]} (or -1: every rank)")
    if f.slow_data_at is not None and f.slow_data_s == 0:
        raise ConfigError(f"faults.slow_data_at={f.slow_data_at} with faults.slow_data_s=0 waits "
                          "no time: set --faults.slow_data_s to the wait (seconds), or drop "
                          "faults.slow_data_at")
    if f.hang_at is not None and cfg.watchdog.timeout_s == 0 and world_size == 1:
        raise ConfigError(f"faults.hang_at={f.hang_at} with watchdog.timeout_s=0 (the watchdog "
                          "off) on one rank: nothing would ever end the hang; set "
                          "--watchdog.timeout_s null (or a limit in seconds), or drop "
                          "faults.hang_at")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}" \
        if len(ranks) <= 8 else f"ranks {ranks[0]}..{ranks[-1]}"


def check_resumed_faults(cfg, iteration: int, run_dir: str) -> None:
    """Refuse a drill of ``cfg`` (the ``faults`` section) that a run resuming after ``iteration``
    has passed without it ever firing in ``run_dir`` (no record of it in ``faults/``): it was
    added on a resume, too late. A drill that fired before is recorded, and goes by as a real
    fault would; with ``faults.every_attempt`` nothing is recorded and a run that went on past its
    drill (a NaN, a spike, a slow step) may be restarted past it, so nothing is refused."""
    if cfg.every_attempt or iteration == 0:
        return
    folder = os.path.join(run_dir, "faults")
    recorded = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    for name, at in _fault_fields(cfg):
        if _last_iter(name, cfg) > iteration:
            continue
        if any(entry.startswith(f"{name}.rank") for entry in recorded):
            continue
        raise ConfigError(f"faults.{name}={at} can never fire: this run resumes after iteration "
                          f"{iteration} and it never fired in {run_dir} (faults/ has no record "
                          f"of it); use --faults.{name} {iteration + 1} or later, a new run.dir, "
                          "or drop it")


def _shifted(targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Every target id moved half the vocabulary on (wrong, but still valid ids); targets left
    out of the loss (negative: ``data.eod_mask_loss``) stay left out."""
    return torch.where(targets >= 0, (targets + vocab_size // 2) % vocab_size, targets)
