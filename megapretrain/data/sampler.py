"""Which samples each rank reads, and a loader that has them ready before the step asks.

Data order is a pure function of (seed, consumed samples): the dataset's sample ``i`` is fixed by
the seed, and the global batch of a step is the ``global_batch_size`` consecutive sample ids
starting at the number of samples consumed before it. Data-parallel rank ``r`` takes the r-th
contiguous slice of it, cut into micro-batches. So the samples of a step do not depend on dp, tp, pp
or the micro-batch size; resuming from ``consumed_samples`` continues the exact sequence; and a
global batch size that changes between steps (a ramp-up) only moves where the next batch starts.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import require

if TYPE_CHECKING:
    from ..config import TrainConfig


def micro_batch_ranges(consumed_samples: int, global_batch_size: int, micro_batch_size: int,
                       dp_rank: int, dp_size: int) -> list[range]:
    """Sample-id ranges of this rank's micro-batches for the global batch after
    ``consumed_samples``."""
    per_rank = global_batch_size // dp_size
    start = consumed_samples + dp_rank * per_rank
    return [range(s, s + micro_batch_size)
            for s in range(start, start + per_rank, micro_batch_size)]


def collate(dataset, ids: range, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack samples of ``seq_length + 1`` tokens into (inputs, targets), each (b, s) int64."""
    batch = torch.from_numpy(np.stack([np.asarray(dataset[i], dtype=np.int64) for i in ids]))
    batch = batch.to(device, non_blocking=True)
    return batch[:, :-1], batch[:, 1:]


class BatchLoader:
    """This rank's micro-batches for a step, read in a background thread one step ahead.

    ``get(consumed_samples, global_batch_size)`` returns the step's micro-batches as a list of
    ``(tokens, targets)``, each (micro_batch_size, seq_length) int64 on ``device``, and starts
    reading the next step's (assumed to follow with the same global batch size). If the caller asks
    for anything else (a resume, an evaluation, a changed global batch size), the prefetched step is
    dropped and the asked one read at once: the order never depends on what was prefetched.

    On CUDA the host batches are pinned and copied with ``non_blocking=True``, so the copy overlaps
    the previous work on the stream. ``wait_s`` is the time the last ``get`` blocked (reading
    synchronously, or waiting for the prefetch to finish); ``total_wait_s`` sums them.
    """

    def __init__(self, dataset, dp_rank: int, dp_size: int, micro_batch_size: int, device,
                 prefetch: bool = True):
        if not 0 <= dp_rank < dp_size or micro_batch_size < 1:
            raise ValueError(f"BatchLoader: dp_rank={dp_rank} must lie in [0, dp_size={dp_size}) "
                             f"and micro_batch_size={micro_batch_size} must be >= 1")
        self.dataset, self.dp_rank, self.dp_size = dataset, dp_rank, dp_size
        self.micro_batch_size, self.device = micro_batch_size, torch.device(device)
        self.pin = self.device.type == "cuda" and torch.cuda.is_available()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="batch-prefetch") if prefetch \
            else None
        self._pending: tuple[tuple[int, int], Future] | None = None
        self.wait_s = 0.0
        self.total_wait_s = 0.0

    def get(self, consumed_samples: int,
            global_batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The micro-batches of the step that starts after ``consumed_samples`` samples."""
        key = (int(consumed_samples), int(global_batch_size))
        start = time.perf_counter()
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == key:
            host = pending[1].result()
        else:
            if pending is not None:
                pending[1].cancel()
            host = self._read(*key)
        self.prefetch(key[0] + key[1], key[1])
        batches = [self._to_device(batch) for batch in host]
        self.wait_s = time.perf_counter() - start
        self.total_wait_s += self.wait_s
        return batches

    def prefetch(self, consumed_samples: int, global_batch_size: int) -> None:
        """Start reading the step after ``consumed_samples`` (a no-op past the dataset's end)."""
        if self._executor is None or consumed_samples + global_batch_size > len(self.dataset):
            return
        key = (int(consumed_samples), int(global_batch_size))
        if self._pending is not None and self._pending[0] == key:
            return
        if self._pending is not None:
            self._pending[1].cancel()
        self._pending = (key, self._executor.submit(self._read, *key))

    def close(self) -> None:
        """Stop the background thread (pending reads are dropped)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self._pending = None

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read(self, consumed_samples: int, global_batch_size: int) -> list[torch.Tensor]:
        """Host batches of (micro_batch_size, seq_length + 1) tokens, pinned when going to CUDA."""
        per_rank = global_batch_size // self.dp_size
        if global_batch_size % self.dp_size or per_rank % self.micro_batch_size:
            raise ValueError(f"global_batch_size={global_batch_size} must be a multiple of "
                             f"micro_batch_size={self.micro_batch_size} x dp={self.dp_size}")
        if consumed_samples + global_batch_size > len(self.dataset):
            raise IndexError(f"the step after {consumed_samples} samples needs samples up to "
                             f"{consumed_samples + global_batch_size}, but the dataset has "
                             f"{len(self.dataset)}")
        host = []
        for ids in micro_batch_ranges(consumed_samples, global_batch_size, self.micro_batch_size,
                                      self.dp_rank, self.dp_size):
            batch = torch.from_numpy(np.stack([self.dataset[i] for i in ids]).astype(np.int64,
                                                                                     copy=False))
            host.append(batch.pin_memory() if self.pin else batch)
        return host

    def _to_device(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch = batch.to(self.device, non_blocking=True)  # (b, s + 1)
        return batch[:, :-1], batch[:, 1:]  # (b, s) inputs and (b, s) targets


# ----------------------------------------------------------------------------------------------
# Batch sizes over the run: the global batch, its ramp-up, the run's length


def batch_size_at(consumed_samples: int, global_batch: int, rampup: list | None) -> int:
    """The global batch of the step after ``consumed_samples`` samples: ``global_batch``, or under
    ``rampup`` = [start, increment, ramp_samples] start + increment per ramp_samples/increments
    samples consumed (Megatron's rule), up to ``global_batch``."""
    if not rampup or consumed_samples >= rampup[2]:
        return global_batch
    start, increment, ramp_samples = rampup
    increments = (global_batch - start) // increment
    per_increment = ramp_samples / increments
    return min(global_batch, start + int(consumed_samples / per_increment) * increment)


def run_length(t: TrainConfig) -> tuple[int, int]:
    """(steps, samples) of the run: train.iters steps, or as many as train.train_tokens take."""
    _check_length(t)
    if t.rampup_batch_size is None and t.train_tokens is None:
        return t.iters, t.iters * t.global_batch_size
    steps = samples = 0
    while (samples * t.seq_length < t.train_tokens) if t.train_tokens is not None \
            else steps < t.iters:
        samples += batch_size_at(samples, t.global_batch_size, t.rampup_batch_size)
        steps += 1
    return steps, samples


def _check_length(t: TrainConfig) -> None:
    """The run's length is set once: train.iters, or train.train_tokens (train.iters null, or left
    at its default where no config sets it)."""
    require(t.iters is not None or t.train_tokens is not None,
            "train.iters and train.train_tokens are both null: set one (e.g. --train.iters 1000 or "
            "--train.train_tokens 2_000_000_000)")
    require(t.train_tokens is None or t.iters is None or t.iters == type(t).iters,
            f"set one of train.iters={t.iters} and train.train_tokens={t.train_tokens}: the other "
            "is derived (over a config that sets train.iters: --train.iters null "
            f"--train.train_tokens {t.train_tokens})")


def check_batches(t: TrainConfig, dp: int) -> list[int]:
    """Every global batch the run steps with — the full one, and each of a ramp-up's — as a whole
    number of micro-batches on every one of ``dp`` ranks; returns them, the full batch first
    (for the pipeline schedule's own check). Also: one of train.iters and train.train_tokens."""
    per_step = t.micro_batch_size * dp
    require(t.global_batch_size % per_step == 0,
            f"train.global_batch_size={t.global_batch_size} must be a multiple of "
            f"train.micro_batch_size={t.micro_batch_size} × dp={dp} = {per_step} "
            f"(e.g. {per_step * max(1, round(t.global_batch_size / per_step))})")
    _check_length(t)
    r = t.rampup_batch_size
    if r is None:
        return [t.global_batch_size]
    require(len(r) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
            and r[0] >= 1 and r[1] >= 1 and r[2] >= 0,
            f"train.rampup_batch_size={r} must be three integers [start >= 1, increment >= 1, "
            "ramp_samples >= 0]")
    start, increment, _ = r
    require(start <= t.global_batch_size and (t.global_batch_size - start) % increment == 0,
            f"train.rampup_batch_size={r}: train.global_batch_size={t.global_batch_size} minus "
            f"start={start} must be a non-negative multiple of increment={increment}")
    ramp = list(range(start, t.global_batch_size, increment))
    for batch in ramp:
        require(batch % per_step == 0, f"train.rampup_batch_size={r}: the ramp's batch {batch} is "
                                       f"not a multiple of micro_batch_size × dp = {per_step}; "
                                       "choose start and increment as multiples")
    return [t.global_batch_size, *ramp]

