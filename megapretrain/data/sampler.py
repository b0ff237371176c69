"""Which samples each rank reads: a pure function of (consumed samples, global batch, dp, micro).

Global batch ``g`` is the ``global_batch_size`` consecutive (already shuffled) sample ids starting
at the number of samples consumed before it. Data-parallel rank ``r`` takes the r-th contiguous
slice of it, cut into micro-batches. The set of samples in a step therefore does not depend on dp
or the micro-batch size, and resuming from ``consumed_samples`` continues the exact sequence.
"""

from __future__ import annotations

import numpy as np
import torch


def micro_batch_ranges(consumed_samples: int, global_batch_size: int, micro_batch_size: int,
                       dp_rank: int, dp_size: int) -> list[range]:
    """Sample-id ranges of this rank's micro-batches for the global batch after ``consumed_samples``."""
    per_rank = global_batch_size // dp_size
    start = consumed_samples + dp_rank * per_rank
    return [range(s, s + micro_batch_size) for s in range(start, start + per_rank, micro_batch_size)]


def collate(dataset, ids: range, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack samples of ``seq_length + 1`` tokens into (inputs, targets), each (b, s) int64."""
    batch = torch.from_numpy(np.stack([np.asarray(dataset[i], dtype=np.int64) for i in ids]))
    batch = batch.to(device, non_blocking=True)
    return batch[:, :-1], batch[:, 1:]
