"""Goodput of a run that fails and restarts, and the checkpoint interval that maximises it.

At scale failure is the normal case: Llama 3's pre-training (Dubey et al. 2024, "The Llama 3 Herd
of Models", arXiv 2407.21783, section 3.3.4) had 419 unexpected interruptions in 54 days on
16,384 H100 GPUs — :data:`LLAMA3_FAILURES_PER_GPU_HOUR`, about one every 3 hours for the job.

The model (Young 1974, "A first order approximation to the optimum checkpoint interval"; Daly
2006 to first order): failures of the job arrive at random, a mean time ``M`` apart (``M = 1 /
(gpus × failures per GPU-hour)``); a checkpoint every ``τ`` seconds costs ``δ`` (its bytes over the
file system's write rate); each failure costs the restart ``R`` (detection, restart, reload) and,
on average, half an interval of steps computed again. The fraction of wall-clock time lost is

    lost(τ) = δ / τ + (τ / 2 + R) / M,        goodput = 1 − lost(τ),

least at Young's interval ``τ* = sqrt(2 δ M)`` (d lost / d τ = −δ / τ² + 1 / (2M) = 0). It holds
while δ and R are small against M (first order: a failure during a save or a restart is not
counted again). ``δ`` is the synchronous save's write time — an upper bound: with
``checkpoint.async`` training blocks only while the state is copied to host memory, and the write
overlaps the next steps, so the real cost is smaller and the best interval shorter.

What a checkpoint holds is ``checkpoint/manager.py``'s (``optimizer_views``): every rank writes its
fp32 master weights and the optimizer's moments — the whole tp/pp shard under zero 0, its ZeRO
share otherwise: AdamW's two (fp32, 12 bytes a parameter with the master; ``optim.moments_dtype
bf16``: 8), Muon's one fp32 momentum on its matrices (8) —
:func:`~.optimizer.checkpoint_state_bytes`, which ``tools/simulate.py``'s ``checkpoint_bytes``
measures on the trainer's own state (``tests/test_planner.py`` holds the two together).
"""

from __future__ import annotations

import math

from ..model.args import ModelArgs
from ..parallel.layout import Layout
from ..parallel.pipeline import layout_schedule
from .memory import stage_params
from .model import layer_params
from .optimizer import ADAMW, OptimizerSpec, checkpoint_state_bytes

# Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4: 419 unexpected interruptions
# during a 54-day snapshot of pre-training on 16,384 H100 GPUs
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16_384
LLAMA3_FAILURES_PER_GPU_HOUR = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)
# the same paper, section 3.3.1: Meta's Tectonic file system sustains 2 TB/s of throughput (7 TB/s
# peak) for the 16,384-GPU cluster — an aggregate parallel-file-system rate
CHECKPOINT_WRITE_GBPS = 2000.0
# detection (a hang: the watchdog's floor, watchdog.floor_s = 300 s; a crash: seconds) plus
# relaunch, rendezvous, communicator set-up and the checkpoint's reload: minutes
RESTART_MINUTES = 10.0
def checkpoint_bytes(model: ModelArgs, layout: Layout,
                     optimizer: OptimizerSpec = ADAMW) -> tuple[int, int]:
    """(the largest rank's file, the whole checkpoint) in bytes, less the files' small headers and
    RNG state: each rank's share of its stage's parameters' optimizer state as ``optimizer``
    keeps it (:func:`~.optimizer.checkpoint_state_bytes`: the master and the moments), summed
    over every rank (replicas of a zero-0 or hybrid-sharded layout each write theirs)."""
    layer = layer_params(model)
    place = layout_schedule(layout)
    muon_layer = optimizer.muon_layer(model) / layout.tp
    per_stage = [checkpoint_state_bytes(stage_params(model, layout, s, layer),
                                        sum(layout.chunk_sizes(model.num_layers, s, place.v_shape))
                                        * muon_layer, optimizer) / layout.shard_ranks
                 for s in range(layout.pp)]
    ranks_per_stage = layout.tp * layout.cp * layout.dp
    return int(max(per_stage)), int(sum(per_stage) * ranks_per_stage)


def lost_fraction(interval_s: float, checkpoint_s: float, restart_s: float,
                  mtbf_s: float) -> float:
    """The fraction of wall-clock time lost to checkpoints and failures (the module docstring)."""
    return checkpoint_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's checkpoint interval ``sqrt(2 δ M)``, seconds: the least :func:`lost_fraction`."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def plan_goodput(gpus: int, step_s: float, checkpoint: int, *,
                 failures_per_gpu_hour: float = LLAMA3_FAILURES_PER_GPU_HOUR,
                 write_gbps: float = CHECKPOINT_WRITE_GBPS,
                 restart_minutes: float = RESTART_MINUTES) -> dict:
    """The expected goodput of a run of ``gpus`` GPUs stepping every ``step_s`` seconds that saves
    ``checkpoint`` bytes at ``write_gbps`` GB/s (aggregate), checkpointing every Young interval
    rounded to whole steps (at least one): the figures ``tools/plan.py`` prints."""
    mtbf_s = 3600 / (gpus * failures_per_gpu_hour)
    checkpoint_s = checkpoint / (write_gbps * 1e9)
    restart_s = restart_minutes * 60
    best_s = young_interval(checkpoint_s, mtbf_s)
    iters = max(1, round(best_s / step_s))
    return {"failures_per_gpu_hour": failures_per_gpu_hour, "mtbf_hours": mtbf_s / 3600,
            "checkpoint_bytes": checkpoint, "checkpoint_write_gbps": write_gbps,
            "checkpoint_s": checkpoint_s, "restart_s": restart_s, "interval_s": best_s,
            "interval_iters": iters,
            "goodput": max(0.0, 1 - lost_fraction(iters * step_s, checkpoint_s, restart_s,
                                                  mtbf_s))}
