"""The planner's model of communication that can hide under compute: context parallelism's three
ways to reach the other ranks' keys (``parallel.cp_comm``).

Each function takes the link it runs over as ``(bus bandwidth in bytes/s, latency in s)``, which
:func:`megapretrain.planner.model.estimate` reads off the rank grid, and returns seconds (or
bytes) for one decoder layer and one micro-batch on one rank.

Context parallelism (per layer and micro-batch; ``kv`` = this tp rank's kv heads, ``b·s`` the
micro-batch's tokens, bf16 values):

==========  ======================================  =================================
============== cp_comm     forward traffic                         backward traffic
K/V kept
==========  ======================================  =================================
============== allgather   all-gather of K, V: 2·b·s·kv·d          reduce-scatter of their grads
all s positions ring        cp − 1 blocks of 2·b·(s/cp)·kv·d        cp − 1 blocks + cp fp32 grad
blocks own s/cp a2a         all-to-all of q, k, v + one of the out  the same two, reversed
own share
==========  ======================================  =================================
==============

The all-gather and the all-to-alls sit on the critical path; the ring's exchanges run under the
previous block's attention, so only what a step's transfer takes beyond its block's attention
shows, plus the backward's last hop home.
"""

from __future__ import annotations

from ..model.args import ModelArgs
from ..parallel.layout import Layout

Link = tuple[float, float]  # (bus bandwidth, bytes/s; latency, s)

BF16 = 2.0


def kv_block_bytes(model: ModelArgs, layout: Layout, seq: int) -> float:
    """One rank's K and V for one layer and micro-batch: 2·b·(s/cp)·kv·d values in bf16."""
    kv_heads = model.num_kv_heads // layout.tp
    return 2.0 * layout.micro_batch * seq // layout.cp * kv_heads * model.head_dim * BF16


def context_traffic_bytes(model: ModelArgs, layout: Layout, seq: int) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends over the cp group for one layer and micro-batch."""
    cp = layout.cp
    if cp == 1:
        return 0.0, 0.0
    block = kv_block_bytes(model, layout, seq)
    if layout.cp_comm == "ring":
        return (cp - 1) * block, (cp - 1) * block + cp * 2 * block  # gradient blocks travel in fp32
    if layout.cp_comm == "a2a":
        heads, kv = model.num_heads // layout.tp, model.num_kv_heads // layout.tp
        tokens = layout.micro_batch * seq // cp
        qkv, out = tokens * (
            heads + 2 * kv) * model.head_dim * BF16, tokens * heads * model.head_dim * BF16
        moved = (qkv + out) * (cp - 1) / cp  # a rank keeps 1/cp of what it all-to-alls
        return moved, moved
    gathered = (cp - 1) * block  # an all-gather's ring sends every other rank's block on
    return gathered, gathered


def context_step_bytes(model: ModelArgs, layout: Layout, seq: int, global_batch: int) -> float:
    """Bytes one rank sends over the cp group in one optimizer step: every layer it holds, forward
    and backward, for each of its micro-batches (full recompute: the forward's again)."""
    forward, backward = context_traffic_bytes(model, layout, seq)
    layers = model.num_layers / layout.pp
    micro_batches = global_batch // (layout.micro_batch * layout.dp)
    redo = forward if layout.recompute == "full" else 0.0
    return layers * micro_batches * (forward + backward + redo)


def kv_copies(layout: Layout) -> int:
    """How many ranks' K/V a layer's attention keeps for the backward, per local token: all cp of
    them after an all-gather, its own under ring and all-to-all attention."""
    return layout.cp if layout.cp_comm == "allgather" else 1


def context_comm_s(model: ModelArgs, layout: Layout, seq: int, attn_f: float, attn_b: float,
                   link: Link) -> tuple[float, float]:
    """(forward, backward) seconds of cp communication one layer exposes for one micro-batch;
    ``attn_f`` / ``attn_b``: its attention's own time on this rank (what the ring hides under)."""
    cp = layout.cp
    if cp == 1:
        return 0.0, 0.0
    bw, latency = link
    block = kv_block_bytes(model, layout, seq)
    if layout.cp_comm == "ring":
        hop, grad_hop = block / bw + latency, 2 * block / bw + latency
        step_f, step_b = attn_f / cp, attn_b / cp  # a block's share of the attention
        forward = (cp - 1) * max(0.0, hop - step_f)
        # the last hop home shows
        backward = (cp - 1) * max(0.0, hop + grad_hop - step_b) + grad_hop
        return forward, backward
    forward, backward = context_traffic_bytes(model, layout, seq)
    collectives = 2 if layout.cp_comm == "a2a" else 1
    return forward / bw + collectives * latency, backward / bw + collectives * latency


def context_modes(model: ModelArgs, tp: int, cp: int) -> tuple[str, ...]:
    """The ``parallel.cp_comm`` values worth estimating at (tp, cp): all three, a2a only where the
    heads and kv heads divide by tp × cp (``parallel/context.py``: check_cp_comm)."""
    if cp == 1:
        return ("allgather",)
    a2a = model.num_heads % (tp * cp) == 0 and model.num_kv_heads % (tp * cp) == 0
    return ("allgather", "ring", "a2a") if a2a else ("allgather", "ring")
