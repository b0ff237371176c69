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

from ..errors import PipelineError
from ..model.args import ModelArgs
from ..parallel.layout import Layout
from ..parallel.pipeline import Op, placement, schedule_order, simulate

BF16 = 2.0


def stage_layers(model: ModelArgs, layout: Layout, kind: str) -> tuple[list[int], int]:
    """Layers on each stage (its chunks together) under schedule ``kind``'s placement, and the most
    in one chunk."""
    pp, vpp, n = layout.pp, layout.vpp, model.num_layers
    chunks = layout.pipeline_layers or [n // (pp * vpp)] * (pp * vpp)
    if len(chunks) != pp * vpp or sum(chunks) != n or min(chunks) < 1 or (
            layout.pipeline_layers is None and n % (pp * vpp)):
        raise PipelineError(f"{n} layers do not split into pp {pp} × vpp {vpp} chunks (give pipeline_layers)")
    place = placement(kind, pp, vpp)
    return [sum(chunks[place.global_chunk(r, v)] for v in range(vpp)) for r in range(pp)], max(chunks)


def head_stage(layout: Layout, kind: str) -> int:
    """The stage holding the output layer and the loss: the last, or the first under V placement."""
    place = placement(kind, layout.pp, layout.vpp)
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
    inputs = 2 * h + n * d + f / tp  # attention's and the MLP's (shared), the output projection's, down's
    grads = (n + 2 * kv) * d + h + fc1 / tp + h  # q/k/v's, the output projection's, gate/up's, down's
    return bytes_per_value * (inputs + grads)


def weighted_peak(order: list[Op], deferred: float) -> float:
    """The most chunks' worth of activations ``order`` holds at once: a chunk between its F and B
    counts 1, between its B and W ``deferred`` (the fraction the W keeps); without W ops a B ends it."""
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
def pipeline_model(kind: str, pp: int, vpp: int, m: int, b_cost: float, w_cost: float,
                   deferred: float) -> tuple[float, float]:
    """(step time over busy time, peak chunks' worth of activations on any stage) of schedule
    ``kind``, replayed with a chunk's forward costing 1, its backward ``b_cost`` of which the
    weight gradient is ``w_cost``. Past 2·pp micro-batches the idle time and the peak no longer
    grow (steady state), so at most that many are replayed — unless an interleaved step ends in a
    group shorter than pp (pp does not divide m), which is replayed whole."""
    ms = m if kind == "interleaved" and m % pp else min(m, 2 * pp)
    orders = [schedule_order(kind, r, pp, vpp, ms) for r in range(pp)]
    sim = simulate(orders, pp, vpp, 1.0, b_cost, w_cost, v_shape=placement(kind, pp, vpp).v_shape)
    idle = sim["makespan"] - ms * vpp * (1.0 + b_cost)
    peak = max(weighted_peak(order, deferred) for order in orders)
    return 1.0 + max(0.0, idle) / (m * vpp * (1.0 + b_cost)), peak


def schedules(pp: int, vpp: int) -> tuple[str, ...]:
    """The schedules worth estimating for (pp, vpp): 1F1B and ZB-H1 without virtual chunks,
    interleaved with them, and ZB-V (vpp 2)."""
    if pp == 1:
        return ("auto",)
    if vpp == 1:
        return ("1f1b", "zb_h1")
    return ("interleaved", "zbv") if vpp == 2 else ("interleaved",)
