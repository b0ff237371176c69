"""Pipeline parallelism: stage partitioning, point-to-point transfers, and the schedules.

A schedule is only an *order*: the list of ``Op("F" | "B", micro, chunk)`` one stage runs in one
step. :func:`schedule_order` builds it (no pipelining, GPipe, 1F1B, interleaved 1F1B), and
:class:`PipelineExecutor` runs any order: it receives a chunk's input just before its forward,
sends outputs and input-gradients without waiting, and keeps what each backward needs. Because
sends never block and receives wait only for data a neighbour really produces, a valid order cannot
deadlock; :func:`simulate` replays orders with unit costs to check that and to measure the bubble.

Chunks: with ``pp`` stages and ``vpp`` virtual chunks per stage the layers form ``pp·vpp`` model
chunks; stage ``p`` holds chunks ``p, p + pp, p + 2·pp, ...`` (Megatron's interleaving), so
activations travel 0 → 1 → ... → pp-1 → 0 (next chunk) → ... and gradients the reverse way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from .state import Group

SCHEDULES = ("auto", "none", "gpipe", "1f1b", "interleaved")
_FORWARD_TAG, _BACKWARD_TAG = 1, 2


class PipelineError(ValueError):
    """An impossible pipeline configuration; the message says what to change."""


@dataclass(frozen=True)
class Op:
    kind: str    # "F" forward or "B" backward
    micro: int   # micro-batch index
    chunk: int   # virtual chunk index on this stage (0..vpp-1)


# ----------------------------------------------------------------------------------------------
# Partitioning


def chunk_layers(num_layers: int, pp: int, vpp: int, pp_rank: int,
                 layers_per_chunk: list[int] | None = None) -> list[list[int]]:
    """Global layer ids of each of this stage's ``vpp`` chunks.

    Even split by default; ``layers_per_chunk`` (length pp·vpp, in global chunk order) lets the
    first and last chunks hold fewer layers to balance the embedding and output layer.
    """
    n_chunks = pp * vpp
    if layers_per_chunk is None:
        if num_layers % n_chunks:
            raise PipelineError(f"parallel.pp={pp} × parallel.vpp={vpp} = {n_chunks} must divide "
                                f"model.num_layers={num_layers}")
        layers_per_chunk = [num_layers // n_chunks] * n_chunks
    if len(layers_per_chunk) != n_chunks or sum(layers_per_chunk) != num_layers or min(layers_per_chunk) < 1:
        raise PipelineError(f"parallel.pipeline_layers={layers_per_chunk} must list {n_chunks} positive "
                            f"layer counts (pp × vpp) summing to model.num_layers={num_layers}")
    starts = [sum(layers_per_chunk[:i]) for i in range(n_chunks)]
    return [list(range(starts[c], starts[c] + layers_per_chunk[c]))
            for c in (v * pp + pp_rank for v in range(vpp))]


# ----------------------------------------------------------------------------------------------
# Schedules (orders)


def resolve_schedule(kind: str, pp: int, vpp: int, num_micro: int) -> str:
    """The schedule to run, checking that it fits (pp, vpp, micro-batches)."""
    if kind not in SCHEDULES:
        raise PipelineError(f"parallel.pp_schedule={kind!r} is not one of: {', '.join(SCHEDULES)}")
    if vpp > 1 and pp == 1:
        raise PipelineError(f"parallel.vpp={vpp} needs parallel.pp > 1 (virtual chunks interleave stages)")
    if kind == "auto":
        kind = "none" if pp == 1 else ("interleaved" if vpp > 1 else "1f1b")
    if vpp > 1 and kind != "interleaved":
        raise PipelineError(f"parallel.vpp={vpp} needs parallel.pp_schedule=interleaved (or auto), not {kind!r}")
    if kind == "interleaved":
        if pp == 1:
            raise PipelineError("parallel.pp_schedule=interleaved needs parallel.pp > 1")
        if num_micro % pp:
            raise PipelineError(f"the interleaved schedule needs the micro-batches per step ({num_micro} = "
                                f"global_batch_size / (micro_batch_size × dp)) to be a multiple of "
                                f"parallel.pp={pp}; change train.global_batch_size or train.micro_batch_size")
    if kind == "none" and pp > 1:
        raise PipelineError("parallel.pp_schedule=none runs one stage; use gpipe, 1f1b or auto with parallel.pp > 1")
    return kind


def schedule_order(kind: str, pp_rank: int, pp: int, vpp: int, num_micro: int) -> list[Op]:
    """The ordered forward/backward ops of stage ``pp_rank`` for one step."""
    m = num_micro
    if kind == "none":
        return [op for i in range(m) for op in (Op("F", i, 0), Op("B", i, 0))]
    if kind == "gpipe":
        return [Op("F", i, 0) for i in range(m)] + [Op("B", i, 0) for i in range(m)]
    if kind == "1f1b":
        warmup = min(pp - pp_rank - 1, m)
        order = [Op("F", i, 0) for i in range(warmup)]                       # warmup: forwards only
        for i in range(m - warmup):                                           # steady: one F, one B
            order += [Op("F", warmup + i, 0), Op("B", i, 0)]
        order += [Op("B", i, 0) for i in range(m - warmup, m)]                # cooldown: backwards
        return order
    if kind == "interleaved":
        return _interleaved(pp_rank, pp, vpp, m)
    raise PipelineError(f"unknown schedule {kind!r}")


def _interleaved_op(kind: str, k: int, pp: int, vpp: int) -> Op:
    """The k-th forward (or backward) of the interleaved schedule: groups of pp micro-batches
    go through chunk 0, then chunk 1, ... (backwards through the chunks in reverse)."""
    chunk = (k // pp) % vpp
    micro = (k // (pp * vpp)) * pp + k % pp
    return Op(kind, micro, chunk if kind == "F" else vpp - 1 - chunk)


def _interleaved(pp_rank: int, pp: int, vpp: int, m: int) -> list[Op]:
    total = m * vpp
    warmup = min((pp - pp_rank - 1) * 2 + (vpp - 1) * pp, total)
    order = [_interleaved_op("F", k, pp, vpp) for k in range(warmup)]        # warmup
    for k in range(total - warmup):                                          # steady 1F1B
        order += [_interleaved_op("F", warmup + k, pp, vpp), _interleaved_op("B", k, pp, vpp)]
    order += [_interleaved_op("B", k, pp, vpp) for k in range(total - warmup, total)]  # cooldown
    return order


def forward_only_order(pp: int, vpp: int, num_micro: int) -> list[Op]:
    """Evaluation: every forward, in the interleaved (or plain) order, no backward."""
    if vpp == 1:
        return [Op("F", i, 0) for i in range(num_micro)]
    return [_interleaved_op("F", k, pp, vpp) for k in range(num_micro * vpp)]


def peak_in_flight(order: list[Op]) -> int:
    """Most micro-batch chunks whose forward ran but backward did not yet (activation memory)."""
    live = peak = 0
    for op in order:
        live += 1 if op.kind == "F" else -1
        peak = max(peak, live)
    return peak


def simulate(orders: list[list[Op]], pp: int, vpp: int, f_cost: float = 1.0, b_cost: float = 1.0) -> dict:
    """Replay every stage's order with unit costs and true data dependencies.

    Returns the makespan and each stage's idle fraction; raises PipelineError on deadlock."""
    done: dict[tuple, float] = {}
    clock = [0.0] * pp
    pos = [0] * pp
    last_chunk = pp * vpp - 1
    progressed = True
    while progressed:
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                op = orders[r][pos[r]]
                g = op.chunk * pp + r  # global chunk index
                if op.kind == "F":
                    dep = ("F", op.micro, g - 1) if g > 0 else None
                else:
                    dep = ("B", op.micro, g + 1) if g < last_chunk else ("F", op.micro, g)
                if dep is not None and dep not in done:
                    break
                start = max(clock[r], done[dep] if dep is not None else 0.0)
                clock[r] = start + (f_cost if op.kind == "F" else b_cost)
                done[(op.kind, op.micro, g)] = clock[r]
                pos[r] += 1
                progressed = True
    if any(pos[r] < len(orders[r]) for r in range(pp)):
        stuck = {r: orders[r][pos[r]] for r in range(pp) if pos[r] < len(orders[r])}
        raise PipelineError(f"schedule deadlocks: stages wait forever at {stuck}")
    makespan = max(clock)
    busy = [sum(f_cost if op.kind == "F" else b_cost for op in orders[r]) for r in range(pp)]
    return {"makespan": makespan, "idle_fraction": [1 - b / makespan for b in busy]}


# ----------------------------------------------------------------------------------------------
# Execution


class P2P:
    """Activations forward and gradients backward between neighbouring stages (fixed shapes)."""

    def __init__(self, pp: Group, shape: tuple, dtype: torch.dtype, device: torch.device):
        self.pp, self.shape, self.dtype, self.device = pp, shape, dtype, device
        self.next = pp.ranks[(pp.rank + 1) % pp.size]
        self.prev = pp.ranks[(pp.rank - 1) % pp.size]
        self._pending: list = []

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        if self.pp.stats is not None:
            self.pp.stats.record("pp.send", tensor)
        self._pending.append((dist.isend(tensor, dst, group=self.pp.pg, tag=tag), tensor))

    def _recv(self, src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        dist.irecv(buf, src, group=self.pp.pg, tag=tag).wait()
        return buf

    def send_forward(self, t: torch.Tensor) -> None:
        self._send(t, self.next, _FORWARD_TAG)

    def recv_forward(self) -> torch.Tensor:
        return self._recv(self.prev, _FORWARD_TAG)

    def send_backward(self, t: torch.Tensor) -> None:
        self._send(t, self.prev, _BACKWARD_TAG)

    def recv_backward(self) -> torch.Tensor:
        return self._recv(self.next, _BACKWARD_TAG)

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


@dataclass
class PipelineExecutor:
    """Runs an order of ops on this stage's chunks.

    ``forward_fn(chunk, micro, input)`` returns the chunk's output activation, or — on the chunk
    that holds the head — the scalar to backpropagate. ``input`` is None on the chunk holding the
    embedding. ``grad_sync(last)`` wraps every backward (the data-parallel overlap hook); ``last``
    is true for each chunk's backward of the final micro-batch. With ``record`` set, ``trace``
    keeps the ops of the latest run.
    """
    pp_rank: int
    pp: int
    vpp: int
    p2p: P2P | None
    grad_sync: Callable
    record: bool = False
    trace: list = field(default_factory=list)

    def _is_first(self, chunk: int) -> bool:
        return self.pp_rank == 0 and chunk == 0

    def _is_last(self, chunk: int) -> bool:
        return self.pp_rank == self.pp - 1 and chunk == self.vpp - 1

    def run(self, order: list[Op], num_micro: int, forward_fn: Callable, backward: bool = True) -> None:
        saved: dict[tuple, tuple] = {}
        self.trace = list(order) if self.record else []
        for op in order:
            key = (op.micro, op.chunk)
            if op.kind == "F":
                inp = None
                if not self._is_first(op.chunk):
                    inp = self.p2p.recv_forward().requires_grad_(backward)
                with torch.set_grad_enabled(backward):
                    out = forward_fn(op.chunk, op.micro, inp)
                if not self._is_last(op.chunk):
                    self.p2p.send_forward(out)
                if backward:
                    saved[key] = (inp, out)
            else:
                inp, out = saved.pop(key)
                grad = None if self._is_last(op.chunk) else self.p2p.recv_backward()
                with self.grad_sync(op.micro == num_micro - 1):
                    torch.autograd.backward(out, grad_tensors=grad)
                if inp is not None:
                    self.p2p.send_backward(inp.grad)
        if self.p2p is not None:
            self.p2p.wait_sends()
