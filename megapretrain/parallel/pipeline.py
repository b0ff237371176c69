"""Pipeline parallelism: stage partitioning, point-to-point transfers, and the schedules.

A schedule is only an *order*: the list of ``Op("F" | "B", micro, chunk)`` one stage runs in one
step. :func:`schedule_order` builds it (no pipelining, GPipe, 1F1B, interleaved 1F1B), and
:class:`PipelineExecutor` runs any valid set of orders.

Transfers go in *rounds* (:func:`transfer_rounds`). Replaying every stage's order with unit
costs puts each op in a time slot; everything produced in slot t changes hands in round t + 1, in
one batched send/recv per stage that both the sender and the receiver join before slot t + 1. A
round's sends and receives therefore always meet in the same batch: no stage waits on a send that
its neighbour will only receive later (the NCCL deadlock of unbatched point-to-point), and between
two stages at most one tensor goes each way per round, so they match in order even where the
backend ignores tags. :func:`simulate` replays orders to check them and to measure the bubble.

Chunks: with ``pp`` stages and ``vpp`` virtual chunks per stage the layers form ``pp·vpp`` model
chunks; stage ``p`` holds chunks ``p, p + pp, p + 2·pp, ...`` (Megatron's interleaving), so
activations travel 0 → 1 → ... → pp-1 → 0 (next chunk) → ... and gradients the reverse way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd import Variable

from ..errors import PipelineError
from .state import Group

_TAGS = {"act": 1, "grad": 2}


@dataclass(frozen=True)
class Op:
    kind: str    # "F" forward or "B" backward
    micro: int   # micro-batch index
    chunk: int   # virtual chunk index on this stage (0..vpp-1)


@dataclass(frozen=True)
class Transfer:
    """One tensor between neighbouring stages: the activation ("act") or input gradient ("grad")
    of micro-batch ``micro`` that global chunk ``chunk`` consumes, from stage ``src`` to ``dst``."""
    kind: str
    micro: int
    chunk: int
    src: int
    dst: int


@dataclass(frozen=True)
class Step:
    """One stage's part of communication round ``round``, then the op it computes (if any)."""
    round: int
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]
    op: Op | None


# ----------------------------------------------------------------------------------------------
# Schedules (orders)


SCHEDULES = ("auto", "none", "gpipe", "1f1b", "interleaved")


def resolve_schedule(kind: str, pp: int, vpp: int, num_micro: int) -> str:
    """The pipeline schedule ``parallel.pp_schedule`` names at this layout, checking that it fits
    (pp, vpp, micro-batches per step); :func:`schedule_order` builds its order."""
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


def replay(orders: list[list[Op]], pp: int, vpp: int, f_cost: float, b_cost: float) -> list[list[float]]:
    """Start time of every op of every stage, each starting once its stage is free and its input
    exists; raises PipelineError if the orders deadlock."""
    done: dict[tuple, float] = {}
    clock = [0.0] * pp
    starts: list[list[float]] = [[] for _ in range(pp)]
    last_chunk = pp * vpp - 1
    progressed = True
    while progressed:
        progressed = False
        for r in range(pp):
            while len(starts[r]) < len(orders[r]):
                op = orders[r][len(starts[r])]
                g = op.chunk * pp + r  # global chunk index
                if op.kind == "F":
                    dep = ("F", op.micro, g - 1) if g > 0 else None
                else:
                    dep = ("B", op.micro, g + 1) if g < last_chunk else ("F", op.micro, g)
                if dep is not None and dep not in done:
                    break
                starts[r].append(max(clock[r], done[dep] if dep is not None else 0.0))
                clock[r] = starts[r][-1] + (f_cost if op.kind == "F" else b_cost)
                done[(op.kind, op.micro, g)] = clock[r]
                progressed = True
    if any(len(starts[r]) < len(orders[r]) for r in range(pp)):
        stuck = {r: orders[r][len(starts[r])] for r in range(pp) if len(starts[r]) < len(orders[r])}
        raise PipelineError(f"schedule deadlocks: stages wait forever at {stuck}")
    return starts


def simulate(orders: list[list[Op]], pp: int, vpp: int, f_cost: float = 1.0, b_cost: float = 1.0) -> dict:
    """Replay every stage's order with the given costs and true data dependencies.

    Returns the makespan and each stage's idle fraction; raises PipelineError on deadlock."""
    starts = replay(orders, pp, vpp, f_cost, b_cost)
    cost = [[f_cost if op.kind == "F" else b_cost for op in order] for order in orders]
    makespan = max(s + c for r in range(pp) for s, c in zip(starts[r], cost[r]))
    return {"makespan": makespan, "idle_fraction": [1 - sum(cost[r]) / makespan for r in range(pp)]}


def input_transfer(op: Op, stage: int, pp: int, vpp: int) -> Transfer | None:
    """What ``op`` on ``stage`` receives: the previous chunk's activation for a forward, the next
    chunk's gradient for a backward; None for the first chunk's forward and the last one's backward."""
    g = op.chunk * pp + stage
    if op.kind == "F":
        return Transfer("act", op.micro, g, (g - 1) % pp, stage) if g > 0 else None
    return Transfer("grad", op.micro, g, (g + 1) % pp, stage) if g < pp * vpp - 1 else None


def output_transfer(op: Op, stage: int, pp: int, vpp: int) -> Transfer | None:
    """What ``op`` on ``stage`` sends: a forward's output to the next chunk (none from the head),
    a backward's input gradient to the previous chunk (none from the embedding's chunk)."""
    g = op.chunk * pp + stage
    if op.kind == "F":
        return Transfer("act", op.micro, g + 1, stage, (g + 1) % pp) if g < pp * vpp - 1 else None
    return Transfer("grad", op.micro, g - 1, stage, (g - 1) % pp) if g > 0 else None


def transfer_rounds(orders: list[list[Op]], pp: int, vpp: int) -> list[list[Step]]:
    """Every stage's steps: the round's batched sends and receives, then the op to compute.

    With unit costs each stage runs one op per slot, so a stage sends at most one tensor and
    receives at most one from each neighbour per round; a stage joins only the rounds it has a
    part in. Each op's input arrives in a round no later than its slot (asserted by the tests)."""
    starts = replay(orders, pp, vpp, 1.0, 1.0)
    slots = [{int(t): op for t, op in zip(starts[r], orders[r])} for r in range(pp)]
    rounds = 1 + max((max(s, default=-1) for s in slots), default=-1)

    def produced(stage: int, t: int) -> Transfer | None:
        op = slots[stage].get(t)
        return output_transfer(op, stage, pp, vpp) if op is not None else None

    per_stage: list[list[Step]] = []
    for r in range(pp):
        steps = []
        for t in range(rounds + 1):
            send = produced(r, t - 1)
            recvs = tuple(x for x in (produced(src, t - 1) for src in sorted({(r - 1) % pp, (r + 1) % pp}))
                          if x is not None and x.dst == r)
            op = slots[r].get(t)
            if send is not None or recvs or op is not None:
                steps.append(Step(t, (send,) if send is not None else (), recvs, op))
        per_stage.append(steps)
    return per_stage


# ----------------------------------------------------------------------------------------------
# Execution


class P2P:
    """Activations forward and gradients backward between neighbouring stages, with the fixed
    shape every transfer has (no shape exchange), one batched send/recv per round."""

    def __init__(self, pp: Group, shape: tuple, dtype: torch.dtype, device: torch.device):
        self.pp, self.shape, self.dtype, self.device = pp, shape, dtype, device
        # NCCL sets a communicator up on a group's first collective, which every member must join;
        # a round may involve only two stages, so make that first call here, on all of them.
        pp.all_reduce(torch.zeros(1, device=device))

    def exchange(self, sends: list[tuple[Transfer, torch.Tensor]], recvs: tuple[Transfer, ...]) -> dict:
        """Post this stage's part of a round in one batch, wait for all of it, return what arrived."""
        ops, arrived = [], {}
        for t, tensor in sends:
            tensor = tensor.detach().contiguous()
            self.pp._record("send", tensor)
            ops.append(dist.P2POp(dist.isend, tensor, self.pp.ranks[t.dst], self.pp.pg, _TAGS[t.kind]))
        for t in recvs:
            arrived[t] = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            self.pp._record("recv", arrived[t])
            ops.append(dist.P2POp(dist.irecv, arrived[t], self.pp.ranks[t.src], self.pp.pg, _TAGS[t.kind]))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return arrived


@dataclass
class PipelineExecutor:
    """Runs every stage's order of ops; this stage computes its own and joins the rounds of
    :func:`transfer_rounds`.

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
    _rounds: dict = field(default_factory=dict, repr=False)

    def steps_for(self, orders: list[list[Op]]) -> list[Step]:
        """This stage's steps for ``orders`` (one per stage), computed once per distinct schedule."""
        key = tuple(map(tuple, orders))
        if key not in self._rounds:
            self._rounds[key] = transfer_rounds(orders, self.pp, self.vpp)[self.pp_rank]
        return self._rounds[key]

    def run(self, orders: list[list[Op]], num_micro: int, forward_fn: Callable, backward: bool = True) -> None:
        stage, pp, vpp = self.pp_rank, self.pp, self.vpp
        saved: dict[tuple, tuple] = {}      # (micro, chunk) -> (input, output) kept for the backward
        inbox: dict[Transfer, torch.Tensor] = {}
        outbox: dict[Transfer, torch.Tensor] = {}
        self.trace = list(orders[stage]) if self.record else []
        for step in self.steps_for(orders):
            if step.sends or step.recvs:
                sent = [(t, outbox.pop(t)) for t in step.sends]
                inbox.update(self.p2p.exchange(sent, step.recvs))
                if backward:  # the next stage has its copy; the backward needs only the graph
                    for t, tensor in sent:
                        if t.kind == "act":
                            _release(tensor)
            op = step.op
            if op is None:
                continue
            key, source, sink = (op.micro, op.chunk), input_transfer(op, stage, pp, vpp), output_transfer(op, stage,
                                                                                                          pp, vpp)
            if op.kind == "F":
                inp = inbox.pop(source).requires_grad_(backward) if source is not None else None
                with torch.set_grad_enabled(backward):
                    out = forward_fn(op.chunk, op.micro, inp)
                if sink is not None:
                    outbox[sink] = out
                if backward:
                    saved[key] = (inp, out)
            else:
                inp, out = saved.pop(key)
                grad = inbox.pop(source) if source is not None else None
                with self.grad_sync(op.micro == num_micro - 1):
                    _backward(out, grad)
                if sink is not None:
                    outbox[sink] = inp.grad
        assert not (inbox or outbox or saved), "pipeline step ended with transfers or activations left over"


def _release(activation: torch.Tensor) -> None:
    """Free a sent activation's storage but keep the tensor, and so its autograd graph: a stage
    otherwise holds one (micro_batch, seq, hidden) output per in-flight micro-batch and chunk that
    nothing reads again. A view shares its base's storage and is left alone."""
    if activation._base is None and activation.grad_fn is not None:
        activation.data = torch.empty((1,), dtype=activation.dtype, device=activation.device)


def _backward(out: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Backpropagate ``grad`` from ``out`` (the loss when None). Calls the autograd engine directly:
    ``torch.autograd.backward`` would compare ``grad`` with the released ``out``'s shape, while
    the graph itself checks ``grad`` against the shape ``out`` had when it was made."""
    if grad is None:
        torch.autograd.backward(out)
    else:
        Variable._execution_engine.run_backward((out,), (grad,), False, False, (), True, True)
