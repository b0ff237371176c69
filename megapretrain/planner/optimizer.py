"""The optimizer's share of a step and of a rank's memory: AdamW, Muon (``optim/muon.py``) and
bf16 moments (``optim.moments_dtype``).

State per parameter of a rank's shard (over the ZeRO shard ranks from zero 1): the fp32 master
(bf16/fp16 weights only), then AdamW's two moments (4 bytes each, 2 under ``moments_dtype
bf16``) or, for a Muon matrix (a 2-D weight inside a decoder layer), one fp32 momentum.

Muon's step adds, per decoder matrix: ``ns_steps`` Newton–Schulz iterations on each logical matrix
(:func:`ns_flops`), computed on one rank of the ZeRO shard group (its owner: largest first to the
least loaded rank, as ``optim/muon.assign_owners``; zero 0 or one shard rank: every rank runs
every matrix), by every tp rank of the owner on the whole matrix; and its traffic: each matrix's
update sent to its owner and its result sent back over the shard group (zero ≥ 1: one all-to-all
each way per group of buckets, a rank moving about its shard's share, not every matrix), and each
owned matrix's tp shards all-gathered over tp, all in the iteration's dtype (bf16: 2 bytes, fp32:
4).
Its time is :func:`muon_step_seconds`: the program's own order of those collectives and
iterations, only what the iterations do not hide counted.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..model.build import one_layer_specs
from ..optim.muon import assign_owners, exchange_groups, is_muon_matrix


@dataclass(frozen=True)
class OptimizerSpec:
    """What the planner reads of ``optim``: the optimizer (``adamw`` | ``muon``), AdamW's moments'
    dtype (``fp32`` | ``bf16``), Muon's Newton–Schulz iterations, and whether the optimizer
    state lives in host memory (``optim.offload``)."""
    name: str = "adamw"
    moments_dtype: str = "fp32"
    ns_steps: int = 5
    offload: bool = False
    ns_precision: str = "bf16"  # Muon's iterations, and the dtype its updates travel in

    @classmethod
    def of(cls, optim) -> OptimizerSpec:
        """A config's ``optim`` section (:class:`~megapretrain.config.OptimConfig`)."""
        return cls(optim.optimizer, optim.moments_dtype, optim.muon_ns_steps, optim.offload,
                   optim.muon_ns_precision)

    @property
    def wire_bytes(self) -> int:
        """Bytes per element of Muon's collectives: the iteration's dtype."""
        return muon_wire_bytes(self.ns_precision)

    @property
    def muon(self) -> bool:
        return self.name == "muon"

    def muon_layer(self, model) -> int:
        """Parameters of one decoder layer Muon updates (whole, before tp): 0 under AdamW."""
        return muon_layer_params(model) if self.muon else 0


ADAMW = OptimizerSpec()  # the default: AdamW, fp32 moments, the state on the device


def muon_wire_bytes(ns_precision: str) -> int:
    """Bytes per element Muon's updates and results travel in (``optim/muon.py``: the iteration's
    dtype, which NS casts to first, so the same bits)."""
    return 4 if ns_precision == "fp32" else 2


def ns_flops(rows: int, cols: int, steps: int) -> float:
    """Matmul FLOPs of ``steps`` Newton–Schulz iterations on a (rows × cols) matrix, as
    ``optim/muon.newton_schulz`` (torch.optim.Muon) runs them on the wide orientation X (m × n,
    m = min(rows, cols), n = max): per iteration

        A = X Xᵀ                      2·m·m·n
        B = b·A + c·A·A (addmm)       2·m·m·m
        X = a·X + B·X   (addmm)       2·m·m·n

    so ``steps · (4·m²·n + 2·m³)`` (the scalings, the norm and the additions are elementwise:
    left out)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4.0 * m * m * n + 2.0 * m ** 3)


def layer_matrices(model) -> list[tuple[str, tuple[int, ...]]]:
    """(name, global shape) of one decoder layer's Muon parameters, fused ones as one."""
    return [(s.name, s.shape) for s in one_layer_specs(model).values()
            if s.layer == 0 and is_muon_matrix(s)]


def _logical_shapes(model) -> dict[str, list[tuple[int, int]]]:
    """Each Muon parameter of a layer: the (rows, cols) of its logical matrices (a fused QKV's q,
    k and v parts, as ``optim/muon.logical_parts``)."""
    out = {}
    for s in one_layer_specs(model).values():
        if s.layer != 0 or not is_muon_matrix(s):
            continue
        rows, cols = s.shape
        if s.row_parts is None:
            out[s.name] = [(rows, cols)]
        else:
            groups = rows // sum(s.row_parts)
            out[s.name] = [(groups * p, cols) for p in s.row_parts]
    return out


@functools.cache
def muon_layer_params(model) -> int:
    """Parameters of one decoder layer that Muon updates (whole, before tp)."""
    return sum(math.prod(shape) for _, shape in layer_matrices(model))


def state_bytes(params: float, muon_params: float, precision: str = "bf16",
                optimizer: str = "adamw", moments_dtype: str = "fp32",
                fused_adamw: bool = False) -> float:
    """Optimizer-state bytes of ``params`` parameters of which ``muon_params`` are Muon's (under
    ``optimizer muon``; ignored under adamw): fp32 masters for 2-byte weights, AdamW's two moments
    of ``moments_dtype`` on the rest, one fp32 momentum on Muon's; ``fused_adamw``: the Triton
    AdamW's bit of weight decay per AdamW parameter."""
    muon = muon_params if optimizer == "muon" else 0.0
    master = 4.0 if precision in ("bf16", "fp16") else 0.0
    moment = 2.0 if moments_dtype == "bf16" else 4.0
    adam = params - muon
    return params * master + adam * (2 * moment + (1 / 8 if fused_adamw else 0.0)) + muon * 4.0


def checkpoint_state_bytes(params: float, muon_params: float, spec: OptimizerSpec) -> float:
    """Bytes a checkpoint writes of the optimizer state of ``params`` parameters, ``muon_params``
    of them Muon's (``checkpoint/manager.py``'s ``optimizer_views``): every parameter's fp32
    master (fp32 weights: the weight itself, 4 bytes too), then AdamW's two moments in their dtype
    or Muon's one fp32 momentum — :func:`state_bytes` of 2-byte weights, without the fused
    AdamW's decay mask (not saved)."""
    return state_bytes(params, muon_params, "bf16", spec.name, spec.moments_dtype)


def _ns_cost(model, ns_steps: int, flops_s: float, gemm_seconds=None) -> dict[str, float]:
    """Seconds of the iterations on each Muon parameter of a layer (all its logical matrices):
    its FLOPs at ``flops_s``, or ``gemm_seconds(m, n, k)`` per matmul where given."""
    def seconds(parts: list[tuple[int, int]]) -> float:
        total = 0.0
        for rows, cols in parts:
            if gemm_seconds is None:
                total += ns_flops(rows, cols, ns_steps) / flops_s
            else:
                m, n = min(rows, cols), max(rows, cols)
                total += ns_steps * (2 * gemm_seconds(m, m, n) + gemm_seconds(m, m, m))
        return total
    return {name: seconds(parts) for name, parts in _logical_shapes(model).items()}


def _owners(model, layers: int, shard_ranks: int) -> dict[str, int]:
    """The owner of each of a stage's Muon parameters (``"{layer}.{name}"``), as the optimizer
    assigns them by the whole matrix's size."""
    shapes = dict(layer_matrices(model))
    return assign_owners({f"{i}.{name}": math.prod(shape) for i in range(layers)
                          for name, shape in shapes.items()}, shard_ranks)


def ns_seconds(model, layers: int, shard_ranks: int, ns_steps: int, flops_s: float,
               gemm_seconds=None) -> float:
    """Seconds of the Newton–Schulz work on the busiest rank of a stage with ``layers`` decoder
    layers: its matrices owned over ``shard_ranks`` ranks as ``optim/muon.assign_owners`` does
    (largest first to the least loaded rank; 1: every matrix on every rank), each matrix's
    seconds its FLOPs at ``flops_s`` — or ``gemm_seconds(m, n, k)`` per matmul where given."""
    cost = _ns_cost(model, ns_steps, flops_s, gemm_seconds)
    if shard_ranks <= 1:
        return layers * sum(cost.values())
    load = [0.0] * shard_ranks
    for key, rank in _owners(model, layers, shard_ranks).items():
        load[rank] += cost[key.split(".", 1)[1]]
    return max(load)


def muon_step_seconds(model, layers: int, shard_ranks: int, tp: int, per_layer_bucket: bool,
                      ns_steps: int, wire: int, gemm_seconds, shard_a2a, tp_ring
                      ) -> tuple[float, float]:
    """(Newton–Schulz seconds of the busiest rank, seconds of the whole Muon step) on a stage of
    ``layers`` decoder layers, replaying ``optim/muon.MuonStep.step``'s order: the buckets in
    groups (``optim/muon.exchange_groups``), every group's updates sent to their owners in one
    all-to-all, one after another, all started at once; each rank then goes through the groups
    in order, waiting for each one's all-to-all and orthogonalizing the matrices it owns (after a
    synchronous tp all-gather of each: ``tp_ring(bytes)``); each group's return all-to-all,
    started by every rank once it has passed that group, runs after the gathers and the previous
    returns (one group: in the order issued). An all-to-all takes ``shard_a2a(bytes)`` for the
    most bytes one rank sends or receives (its own share of a matrix stays): its shard of the
    matrices others own, or the others' shares of those it owns. The step ends with the last
    return. Buckets: one per parameter, in the buffers' order (the last layer first) — at the
    planner's sizes every decoder matrix fills a 32 MB bucket by itself — or one per layer
    (``per_layer_bucket``: ZeRO-3's units). Unsharded (``shard_ranks`` 1, or zero 0): every rank
    runs every matrix, nothing to exchange over dp."""
    cost = _ns_cost(model, ns_steps, 0.0, gemm_seconds)
    specs = [s for s in one_layer_specs(model).values() if s.layer == 0 and is_muon_matrix(s)]
    local = {s.name: math.prod(s.shape) / (tp if s.tp_dim is not None else 1) for s in specs}
    gather = {s.name: tp_ring(local[s.name] * tp * wire) if tp > 1 and s.tp_dim is not None else 0.0
              for s in specs}
    names = [s.name for s in reversed(specs)]  # the buffers' order: reversed
    if shard_ranks <= 1:
        ns = layers * sum(cost.values())
        return ns, ns + layers * sum(gather.values())
    owner = _owners(model, layers, shard_ranks)
    buckets = [[(i, n) for n in names] for i in reversed(range(layers))] if per_layer_bucket \
        else [[(i, n)] for i in reversed(range(layers)) for n in names]
    groups = [[m for b in g for m in buckets[b]]
              for g in exchange_groups([sum(local[n] for _, n in b) for b in buckets])]

    def exchange(group) -> float:
        owned = [0.0] * shard_ranks
        for i, n in group:
            owned[owner[f"{i}.{n}"]] += local[n]
        total, d = sum(owned), shard_ranks
        return shard_a2a(max(max((total - mine) / d, mine * (d - 1) / d) for mine in owned) * wire)

    comm, gathered = 0.0, []  # the gathers, back to back
    for g in groups:
        comm += exchange(g)
        gathered.append(comm)
    free, load, passed = [0.0] * shard_ranks, [0.0] * shard_ranks, []
    for g, ready in zip(groups, gathered):
        for i, n in g:
            r = owner[f"{i}.{n}"]
            free[r] = max(free[r], ready) + gather[n] + cost[n]
            load[r] += cost[n]
        passed.append(max(ready, *free))  # every rank past this group: its return starts
    for g, start in zip(groups, passed):
        comm = max(comm, start) + exchange(g)
    return max(load), comm
