"""The planner's model of a pipeline schedule: where its chunks sit, how long its bubble is and
how many micro-batches' activations a stage holds — read off the real orders
(``parallel/pipeline.py``), replayed with the estimated forward, backward and weight-gradient
times of the busiest stage.

The zero-bubble schedules (``zb_h1``, ``zbv``) run each backward's weight gradients as separate W
ops later, in what would be bubble. Between a chunk's B and its W a stage keeps what the W reads:
each linear's input and its output's gradient, a fraction of the layer's activations
(:func:`deferred_bytes_per_token`). A stage's activation memory is therefore the peak, over its
order, of ``(chunks between F and B) + (chunks between B and W) × that fraction``, in chunks'
worth of activations (``planner/memory.py`` counts the same for a stage's peak).
"""

from __future__ import annotations

import functools

from ..model.args import ModelArgs
from ..parallel.layout import Layout
from ..parallel.pipeline import SCHEDULES, Op, Schedule, simulate

BF16 = 2.0


def layers_per_stage(model: ModelArgs, layout: Layout, schedule: Schedule) -> tuple[list[int], int]:
    """Layers on each stage (its chunks together) under ``schedule``'s placement, and the most in
    one chunk, as :meth:`Layout.chunk_sizes` counts them."""
    stages = [layout.chunk_sizes(model.num_layers, r, schedule.v_shape) for r in range(layout.pp)]
    return [sum(sizes) for sizes in stages], max(max(sizes) for sizes in stages)


def head_stage(layout: Layout, schedule: Schedule) -> int:
    """The stage holding the output layer and the loss: the last, or the first under V placement."""
    place = schedule.placement(layout.pp, layout.vpp)
    return place.stage_of(place.chunks - 1)


def deferred_bytes_per_token(model: ModelArgs, tp: int, bytes_per_value: float = BF16) -> float:
    """Bytes per token one decoder layer keeps from its B to its W: every linear's input and its
    output's gradient (``parallel/tensor.py``'s DeferredGrads). The (b, s, h) ones are whole under
    sequence parallelism too: the B has gathered the column-parallel linears' saved input shard
    (once for the linears sharing it) and the row-parallel linear's output gradient, and the W
    reads them so."""
    h, d, f = model.hidden_size, model.head_dim, model.ffn_hidden_size
    n, kv = model.num_heads / tp, model.num_kv_heads / tp
    fc1 = f if model.mlp == "gelu" else 2 * f
    # attention's and the MLP's (shared), the output projection's, down's
    inputs = 2 * h + n * d + f / tp
    # q/k/v's, the output projection's, gate/up's, down's
    grads = (n + 2 * kv) * d + h + fc1 / tp + h
    return bytes_per_value * (inputs + grads)


def weighted_peak(order: list[Op], deferred: float) -> float:
    """The most chunks' worth of activations ``order`` holds at once: a chunk between its F and B
    counts 1, between its B and W ``deferred`` (the fraction the W keeps); without W ops a B ends
    it."""
    split = any(op.kind == "W" for op in order)
    full = waiting = peak = 0
    for op in order:
        if op.kind == "F":
            full += 1
        elif op.kind == "B":
            full -= 1
            waiting += split
        else:
            waiting -= 1
        peak = max(peak, full + deferred * waiting)
    return peak


@functools.cache
def pipeline_model(schedule: Schedule, pp: int, vpp: int, m: int, b_cost: float, w_cost: float,
                   deferred: float) -> tuple[float, float]:
    """(step time over busy time, peak chunks' worth of activations on any stage) of ``schedule``,
    replayed with a chunk's forward costing 1, its backward ``b_cost`` of which the weight
    gradient is ``w_cost``. Past 2·pp micro-batches the idle time and the peak no longer grow
    (steady state), so at most that many are replayed — unless the schedule runs groups of pp
    and the step ends in a shorter one (:meth:`Schedule.bubble_micro`), which is replayed whole."""
    ms = schedule.bubble_micro(pp, m)
    orders = schedule.orders(pp, vpp, ms)
    sim = simulate(orders, pp, vpp, 1.0, b_cost, w_cost, v_shape=schedule.v_shape)
    idle = sim["makespan"] - ms * vpp * (1.0 + b_cost)
    peak = max(weighted_peak(order, deferred) for order in orders)
    return 1.0 + max(0.0, idle) / (m * vpp * (1.0 + b_cost)), peak


def schedules(pp: int, vpp: int) -> tuple[str, ...]:
    """The schedules worth estimating for (pp, vpp): those the search weighs (``planned``) that
    run it — at vpp 1 those made for one chunk per stage (1F1B, ZB-H1), not those for any count
    (interleaved); ``auto`` for one stage."""
    if pp == 1:
        return ("auto",)
    return tuple(s.name for s in SCHEDULES.values()
                 if s.planned and s.accepts(pp, vpp) and (vpp > 1 or s.vpp == 1))
