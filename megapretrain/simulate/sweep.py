"""The planner held to the program: layouts of Llama 3 8B, 70B and 405B simulated and set beside
the planner's estimate of the same rank — peak memory within 5%, traffic per group equal.

:data:`SWEEP` spans tp, pp, vpp, dp, ZeRO 0-3, hybrid sharding, recomputation none, selective and
full, context parallelism, the zero-bubble schedules and micro-batch sizes; each row names its
config, world size, overrides and the ranks to compare (a stage's first rank). :func:`compare`
turns one simulated rank and the planner's figures into a row of the table
``tools/check_planner.py`` prints.
"""

from __future__ import annotations

from dataclasses import dataclass

MEMORY_TOLERANCE = 0.05  # the planner's peak within 5% of the simulated one


@dataclass(frozen=True)
class Case:
    name: str
    config: str
    world_size: int
    overrides: tuple[str, ...]
    # which stages' first ranks: first, last, all roles ("roles")
    stages: tuple[str, ...] = ("first",)


def _p(**kw) -> tuple[str, ...]:
    """Overrides from keyword arguments: section__key=value -> --section.key value."""
    out = []
    for key, value in kw.items():
        out += [f"--{key.replace('__', '.')}", str(value).lower() if isinstance(value, bool)
                else str(value)]
    return tuple(out)


NO_RAMP = _p(train__rampup_batch_size="null")


def small(global_batch_size: int, **kw) -> tuple[str, ...]:
    """No ramp-up and a smaller global batch (fewer micro-batches to simulate, still ≥ pp of
    them)."""
    return NO_RAMP + _p(train__global_batch_size=global_batch_size, **kw)
B8, B70, B405 = "configs/llama3_8b.yaml", "configs/llama3_70b.yaml", "configs/llama3_405b.yaml"

SWEEP = (
    Case("8b-config", B8, 64, NO_RAMP),
    Case("8b-z1-sel", B8, 64, NO_RAMP + _p(parallel__zero=1, parallel__recompute="selective")),
    Case("8b-z3-full-mb2", B8, 64, NO_RAMP + _p(parallel__zero=3, parallel__recompute="full",
                                                train__micro_batch_size=2)),
    Case("8b-tp2-sp", B8, 64, NO_RAMP + _p(parallel__tp=2, parallel__sequence_parallel=True,
                                           parallel__zero=1)),
    Case("8b-tp2-no-sp", B8, 64, NO_RAMP + _p(parallel__tp=2, parallel__sequence_parallel=False,
                                              parallel__zero=1)),
    Case("8b-tp4-pp2", B8, 64,
         small(64, parallel__tp=4, parallel__pp=2, parallel__sequence_parallel=True,
               parallel__zero=1), ("first", "last")),
    Case("8b-pp4-1f1b", B8, 64, small(64, parallel__pp=4, parallel__zero=1), ("first", "last")),
    Case("8b-pp4-zb_h1", B8, 64, small(64, parallel__pp=4, parallel__pp_schedule="zb_h1",
                                       parallel__zero=1), ("first", "last")),
    Case("8b-pp4-zbv", B8, 64,
         small(64, parallel__pp=4, parallel__vpp=2, parallel__pp_schedule="zbv", parallel__zero=1),
         ("first", "last")),
    Case("8b-tp2-pp2-vpp2-sel", B8, 64, small(64, parallel__tp=2, parallel__pp=2, parallel__vpp=2,
                                              parallel__sequence_parallel=True, parallel__zero=1,
                                              parallel__recompute="selective")),
    Case("8b-cp2", B8, 64, NO_RAMP + _p(parallel__cp=2, parallel__zero=1)),
    Case("8b-hybrid8", B8, 64, NO_RAMP + _p(parallel__zero=1, parallel__zero_shard_size=8)),
    Case("8b-z0-full", B8, 64, NO_RAMP + _p(parallel__zero=0, parallel__recompute="full")),
    Case("8b-tp8-mb4-z2", B8, 64, NO_RAMP + _p(parallel__tp=8, parallel__sequence_parallel=True,
                                               train__micro_batch_size=4, parallel__zero=2)),
    Case("70b-config", B70, 512, NO_RAMP, ("first", "last")),
    Case("70b-tp8-pp4-vpp5-sel", B70, 512,
         NO_RAMP + _p(parallel__tp=8, parallel__zero=1, parallel__recompute="selective")),
    Case("70b-tp8-pp8-full", B70, 512, small(64, parallel__tp=8, parallel__pp=8, parallel__vpp=1,
                                             parallel__zero=1, parallel__recompute="full"),
         ("first", "last")),
    Case("70b-tp4-pp8-z2", B70, 512, small(128, parallel__pp=8, parallel__vpp=1)),
    Case("70b-tp8-pp2-z3-full", B70, 512,
         NO_RAMP + _p(parallel__tp=8, parallel__pp=2, parallel__vpp=1, parallel__zero=3,
                      parallel__recompute="full")),
    Case("70b-tp8-cp2-pp4-sel", B70, 512, small(64, parallel__tp=8, parallel__cp=2, parallel__vpp=1,
                                                parallel__zero=1, parallel__recompute="selective")),
    Case("70b-hybrid8-vpp2", B70, 512,
         NO_RAMP + _p(parallel__vpp=2, parallel__zero=1, parallel__zero_shard_size=8)),
    Case("70b-tp8-z3-full", B70, 512, NO_RAMP + _p(parallel__tp=8, parallel__pp=1, parallel__vpp=1,
                                                   parallel__zero=3, parallel__recompute="full")),
    Case("70b-tp8-pp8-vpp2", B70, 512, small(64, parallel__tp=8, parallel__pp=8, parallel__vpp=2,
                                             parallel__zero=1)),
    Case("70b-z0-full", B70, 512,
         NO_RAMP + _p(parallel__zero=0, parallel__recompute="full", parallel__vpp=1)),
    Case("70b-mb2-full", B70, 512,
         NO_RAMP + _p(train__micro_batch_size=2, parallel__recompute="full", parallel__zero=1,
                      parallel__vpp=1)), Case("405b-llama3-16k", B405, 16384, NO_RAMP, ("roles",)),
    Case("405b-config-2k", B405, 2048, small(256), ("first", "last")),
    Case("405b-2k-z2", B405, 2048, small(256, parallel__zero=2)),
    Case("405b-pp6-z3", B405, 1536,
         NO_RAMP + _p(parallel__pp=6, parallel__vpp=1, parallel__pipeline_layers="null",
                      parallel__zero=3, train__global_batch_size=192)),
    Case("405b-pp14-sel", B405, 1792,
         NO_RAMP + _p(parallel__pp=14, parallel__vpp=1, parallel__pipeline_layers="null",
                      parallel__recompute="selective", train__global_batch_size=224)),
    Case("405b-cp2", B405, 2048, NO_RAMP + _p(parallel__cp=2, train__global_batch_size=128)),
    Case("405b-16k-hybrid8", B405, 16384, NO_RAMP + _p(parallel__zero_shard_size=8)),
    Case("405b-pp7", B405, 1792,
         NO_RAMP + _p(parallel__pp=7, parallel__vpp=1, parallel__pipeline_layers="null",
                      train__global_batch_size=224)),
    Case("405b-pp18", B405, 1152,
         NO_RAMP + _p(parallel__pp=18, parallel__vpp=1, parallel__pipeline_layers="null",
                      train__global_batch_size=144)),
    Case("405b-tp4-pp18-z1", B405, 1152,
         NO_RAMP + _p(parallel__tp=4, parallel__pp=18, parallel__vpp=1,
                      parallel__pipeline_layers="null", train__global_batch_size=288)), )
