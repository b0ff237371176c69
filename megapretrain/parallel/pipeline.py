"""Pipeline parallelism: stage partitioning, point-to-point transfers, and the schedules.

A schedule is only an *order*: the list of ``Op("F" | "B" | "W", micro, chunk)`` one stage runs
in one step. A :class:`Schedule` builds it and owns the rest of what is known of it (its
placement, whether its backward splits, the pipeline sizes it runs, its bubble formula); the
registry :data:`SCHEDULES` holds them by name (no pipelining, GPipe, 1F1B, interleaved 1F1B, and
the zero-bubble schedules ZB-H1 and ZB-V), :func:`resolve_schedule` looks one up once, and
:class:`PipelineExecutor` runs any valid set of orders. "B" is a chunk's whole backward, or —
where the order also holds "W" ops, as the zero-bubble schedules' do — only its input gradient:
the weight gradients of its linears are deferred, and the chunk's "W" of that micro-batch
computes them later, in what would otherwise be bubble (``parallel/tensor.py``'s
:class:`DeferredGrads`).

Transfers go in *rounds* (:func:`transfer_rounds`). Replaying every stage's order with unit
costs puts each op in a time slot; everything produced in slot t changes hands in round t + 1, in
one batched send/recv per stage that both the sender and the receiver join before slot t + 1. A
round's sends and receives therefore always meet in the same batch: no stage waits on a send that
its neighbour will only receive later (the NCCL deadlock of unbatched point-to-point), and between
two stages at most one tensor goes each way per round, so they match in order even where the
backend ignores tags. :func:`simulate` replays orders to check them and to measure the bubble.

Chunks: with ``pp`` stages and ``vpp`` virtual chunks per stage the layers form ``pp·vpp`` model
chunks. Interleaved placement (Megatron's): stage ``p`` holds chunks ``p, p + pp, p + 2·pp, ...``,
so activations travel 0 → 1 → ... → pp-1 → 0 (next chunk) → ... and gradients the reverse way.
V placement (ZB-V, vpp 2): stage ``p`` holds chunks ``p`` and ``2·pp − 1 − p``, so activations go
down the stages and back up: the last stage hands its first chunk's output to its second chunk
itself (no transfer), and the first stage holds both the embedding and the head.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.autograd import Variable

from ..errors import PipelineError
from .state import Group

if TYPE_CHECKING:
    from .layout import Layout

_TAGS = {"act": 1, "grad": 2}


@dataclass(frozen=True)
class Op:
    kind: str    # "F" forward, "B" backward (input gradient only when the order has W ops), "W"
    #              weight gradient
    micro: int   # micro-batch index
    chunk: int   # virtual chunk index on this stage (0..vpp-1)


@dataclass(frozen=True)
class Transfer:
    """One tensor between neighbouring stages: the activation ("act") or input gradient ("grad")
    of micro-batch ``micro`` that global chunk ``chunk`` consumes, from stage ``src`` to ``dst``
    (the same stage under V placement, where the last stage feeds its own second chunk)."""
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


@dataclass(frozen=True)
class Placement:
    """Which stage holds which of the ``pp·vpp`` global model chunks: interleaved, or V (ZB-V)."""
    pp: int
    vpp: int
    v_shape: bool = False

    @property
    def chunks(self) -> int:
        return self.pp * self.vpp

    def global_chunk(self, stage: int, chunk: int) -> int:
        """The global index of virtual chunk ``chunk`` of ``stage``."""
        if self.v_shape:
            return stage if chunk == 0 else 2 * self.pp - 1 - stage
        return chunk * self.pp + stage

    def stage_of(self, g: int) -> int:
        """The stage that holds global chunk ``g``."""
        if self.v_shape:
            return g if g < self.pp else 2 * self.pp - 1 - g
        return g % self.pp


# ----------------------------------------------------------------------------------------------
# Schedules (orders)


def _one_stage(pp_rank: int, pp: int, vpp: int, m: int) -> list[Op]:
    """No pipelining: each micro-batch's forward, then its backward."""
    return [op for i in range(m) for op in (Op("F", i, 0), Op("B", i, 0))]


def _gpipe(pp_rank: int, pp: int, vpp: int, m: int) -> list[Op]:
    """GPipe: every forward, then every backward."""
    return [Op("F", i, 0) for i in range(m)] + [Op("B", i, 0) for i in range(m)]


def _1f1b(pp_rank: int, pp: int, vpp: int, m: int) -> list[Op]:
    """1F1B (PipeDream-Flush): pp − 1 − pp_rank forwards, then one forward and one backward."""
    warmup = min(pp - pp_rank - 1, m)
    order = [Op("F", i, 0) for i in range(warmup)]                       # warmup: forwards only
    for i in range(m - warmup):                                           # steady: one F, one B
        order += [Op("F", warmup + i, 0), Op("B", i, 0)]
    order += [Op("B", i, 0) for i in range(m - warmup, m)]                # cooldown: backwards
    return order


def _interleaved_op(kind: str, k: int, pp: int, vpp: int) -> Op:
    """The k-th forward (or backward) of the interleaved schedule: groups of pp micro-batches
    go through chunk 0, then chunk 1, ... (backwards through the chunks in reverse)."""
    chunk = (k // pp) % vpp
    micro = (k // (pp * vpp)) * pp + k % pp
    return Op(kind, micro, chunk if kind == "F" else vpp - 1 - chunk)


def _interleaved(pp_rank: int, pp: int, vpp: int, m: int) -> list[Op]:
    """Stage ``pp_rank``'s interleaved order for ``m`` micro-batches. When pp does not divide m, it
    is the order of the next multiple of pp with the missing micro-batches' ops left out (the last
    group shorter, any m at all): leaving every op of some micro-batches out on every stage keeps
    each stage's order and every dependency among the rest — a micro-batch depends on nothing of
    another — so any wait of the shorter orders would be one of the full ones: no deadlock."""
    full = -(-m // pp) * pp
    total = full * vpp
    warmup = min((pp - pp_rank - 1) * 2 + (vpp - 1) * pp, total)
    order = [_interleaved_op("F", k, pp, vpp) for k in range(warmup)]        # warmup
    for k in range(total - warmup):                                          # steady 1F1B
        order += [_interleaved_op("F", warmup + k, pp, vpp), _interleaved_op("B", k, pp, vpp)]
    order += [_interleaved_op("B", k, pp, vpp) for k in range(total - warmup, total)]  # cooldown
    return [op for op in order if op.micro < m]


def _zb_h1(pp_rank: int, pp: int, vpp: int, m: int) -> list[Op]:
    """ZB-H1 (Qi et al., 2024): 1F1B's forwards and input-gradient backwards, each weight gradient
    deferred by ``pp_rank`` micro-batches: a stage's last ``pp_rank`` W ops fill the cooldown that
    1F1B leaves idle there, where the gradient has yet to travel back to the earlier stages. Every
    stage holds at most ``pp`` micro-batches whose W has not run: 1F1B's peak (its first
    stage's)."""
    warmup, lag = min(pp - pp_rank - 1, m), min(pp_rank, m)
    # warmup: forwards only
    order = [Op("F", i, 0) for i in range(warmup)]
    deferred = 0  # W ops issued so far, in micro-batch order
    # steady: F, B, then a W
    for i in range(m - warmup):
        order += [Op("F", warmup + i, 0), Op("B", i, 0)]
        if i >= lag:
            order.append(Op("W", deferred, 0))
            deferred += 1
    # cooldown: B, then a W
    for i in range(m - warmup, m):
        order.append(Op("B", i, 0))
        if i >= lag:
            order.append(Op("W", deferred, 0))
            deferred += 1
    # the deferred W ops fill the tail
    return order + [Op("W", i, 0) for i in range(deferred, m)]


def _zbv(pp_rank: int, pp: int, vpp: int, m: int) -> list[Op]:
    """ZB-V (Qi et al., 2024): two chunks per stage in a V (chunk 0 going down the stages, chunk 1
    coming back up, the head on stage 0), each backward split into B and W. Built for at least
    2·pp − 1 micro-batches and cut down to ``m`` (the ops of micro-batches past ``m`` dropped:
    the order stays valid, with a longer bubble). Every stage holds at most 2·pp chunks'
    activations without their W: the layers of pp micro-batches, 1F1B's peak."""
    n, r = max(m, 2 * pp - 1), pp_rank
    order: list[Op] = []
    count = {(kind, c): 0 for kind in "FBW" for c in (0, 1)}

    def run(*ops: tuple[str, int]) -> None:
        for kind, c in ops:
            order.append(Op(kind, count[kind, c], c))
            count[kind, c] += 1

    # warmup: chunk 0 fills the V
    for _ in range(2 * (pp - r) - 1):
        run(("F", 0))
    # chunk 1's first forwards join
    for _ in range(r):
        run(("F", 1), ("F", 0))
    for _ in range(pp - r):                                                   # chunk 1 turns around
        run(("F", 1), ("B", 1), ("W", 1))
    # steady: both chunks, F B W
    while count["F", 1] < count["F", 0] or count["F", 0] < n:
        if count["F", 0] < n:
            run(("F", 0))
        run(("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1))
    # cooldown: backwards first,
    for _ in range(r):
        run(("B", 0), ("B", 1))
    # their W ops in the gaps
    for _ in range(pp - r):
        run(("B", 0), ("W", 0))
    run(*[("W", 1)] * (count["B", 1] - count["W", 1]),
        *[("W", 0)] * (count["B", 0] - count["W", 0]))
    return [op for op in order if op.micro < m]


def forward_only_order(pp: int, vpp: int, num_micro: int, v_shape: bool = False) -> list[Op]:
    """Evaluation: every forward, in the interleaved (or plain) order, no backward; under V
    placement every micro-batch through the first chunk, then through the second."""
    if vpp == 1:
        return [Op("F", i, 0) for i in range(num_micro)]
    if v_shape:
        return [Op("F", i, c) for c in range(vpp) for i in range(num_micro)]
    full = -(-num_micro // pp) * pp  # as in the training order: the missing micro-batches left out
    return [op for op in (_interleaved_op("F", k, pp, vpp) for k in range(full * vpp))
            if op.micro < num_micro]


def has_weight_ops(orders: list[list[Op]]) -> bool:
    """Whether ``orders`` split each backward into B and W."""
    return any(op.kind == "W" for order in orders for op in order)


def peak_in_flight(order: list[Op]) -> int:
    """Most micro-batch chunks whose forward ran but backward did not yet finish — its W, where
    the order has them (activation memory)."""
    split = any(op.kind == "W" for op in order)
    live = peak = 0
    for op in order:
        live += 1 if op.kind == "F" else -1 if op.kind == ("W" if split else "B") else 0
        peak = max(peak, live)
    return peak


def op_costs(orders: list[list[Op]], f_cost: float, b_cost: float,
             w_cost: float = 0.0) -> dict[str, float]:
    """Seconds (or units) of each op kind: ``b_cost`` is a chunk's whole backward and ``w_cost``
    the weight-gradient part of it, which a W op runs where the orders have them (their B the
    rest)."""
    if has_weight_ops(orders):
        return {"F": f_cost, "B": b_cost - w_cost, "W": w_cost}
    return {"F": f_cost, "B": b_cost, "W": 0.0}


def _dependency(op: Op, g: int, chunks: int) -> tuple | None:
    """The (kind, micro, global chunk) an op waits for: the previous chunk's forward, the next
    chunk's backward (the loss's own forward at the head), its own backward for a W."""
    if op.kind == "F":
        return ("F", op.micro, g - 1) if g > 0 else None
    if op.kind == "B":
        return ("B", op.micro, g + 1) if g < chunks - 1 else ("F", op.micro, g)
    return ("B", op.micro, g)


def replay(orders: list[list[Op]], pp: int, vpp: int, f_cost: float, b_cost: float,
           w_cost: float = 0.0, v_shape: bool = False) -> list[list[float]]:
    """Start time of every op of every stage, each starting once its stage is free and its input
    exists; raises PipelineError if the orders deadlock."""
    place, cost = Placement(pp, vpp, v_shape), op_costs(orders, f_cost, b_cost, w_cost)
    done: dict[tuple, float] = {}
    clock = [0.0] * pp
    starts: list[list[float]] = [[] for _ in range(pp)]
    progressed = True
    while progressed:
        progressed = False
        for r in range(pp):
            while len(starts[r]) < len(orders[r]):
                op = orders[r][len(starts[r])]
                g = place.global_chunk(r, op.chunk)
                dep = _dependency(op, g, place.chunks)
                if dep is not None and dep not in done:
                    break
                starts[r].append(max(clock[r], done[dep] if dep is not None else 0.0))
                clock[r] = starts[r][-1] + cost[op.kind]
                done[(op.kind, op.micro, g)] = clock[r]
                progressed = True
    if any(len(starts[r]) < len(orders[r]) for r in range(pp)):
        stuck = {r: orders[r][len(starts[r])] for r in range(pp) if len(starts[r]) < len(orders[r])}
        raise PipelineError(f"schedule deadlocks: stages wait forever at {stuck}")
    return starts


def simulate(orders: list[list[Op]], pp: int, vpp: int, f_cost: float = 1.0, b_cost: float = 1.0,
             w_cost: float = 0.0, v_shape: bool = False) -> dict:
    """Replay every stage's order with the given costs (``b_cost`` a whole backward, ``w_cost`` the
    weight-gradient part of it) and true data dependencies.

    Returns the makespan and each stage's idle fraction; raises PipelineError on deadlock."""
    starts = replay(orders, pp, vpp, f_cost, b_cost, w_cost, v_shape)
    kinds = op_costs(orders, f_cost, b_cost, w_cost)
    cost = [[kinds[op.kind] for op in order] for order in orders]
    makespan = max((s + c for r in range(pp) for s, c in zip(starts[r], cost[r])), default=0.0)
    return {"makespan": makespan, "idle_fraction": [1 - sum(cost[r]) / makespan if makespan else 0.0
                                                    for r in range(pp)]}


# Each stage's idle time in one step of ``m`` micro-batches, by formula, for chunk costs ``f``
# (forward), ``b`` (whole backward) and ``w`` (its weight-gradient part); :func:`simulate`
# measures the same on the real orders (the tests check they agree).


def _bubble_1f1b(pp: int, vpp: int, m: int, f: float, b: float, w: float) -> float:
    """GPipe and 1F1B: (pp − 1)(f + b)."""
    return (pp - 1) * (f + b)


def _bubble_interleaved(pp: int, vpp: int, m: int, f: float, b: float, w: float) -> float:
    """Interleaved (m a multiple of pp): 1F1B's over the vpp chunks' shorter ops, (pp − 1)(f + b)
    with chunk costs."""
    if m % pp:
        raise ValueError("the interleaved formula holds for a multiple of pp micro-batches (a "
                         "last, shorter group idles more)")
    return (pp - 1) * (f + b)


def _bubble_zb_h1(pp: int, vpp: int, m: int, f: float, b: float, w: float) -> float:
    """ZB-H1: (pp − 1)(f + b − w) − (min(m, pp) − 1)·w, i.e. (pp − 1)(f + b − 2w) from pp
    micro-batches on: a third of 1F1B's bubble when f = b − w = w (for w ≤ f and w ≤ b − w)."""
    if w > min(f, b - w):
        raise ValueError("the ZB-H1 formula holds for a weight gradient no longer than the "
                         "forward or the input gradient")
    return (pp - 1) * (f + b - w) - (min(m, pp) - 1) * w


def _bubble_zbv(pp: int, vpp: int, m: int, f: float, b: float, w: float) -> float:
    """ZB-V, for f = b − w = w (= c): max(pp − 1, 2(2·pp − 1 − m))·c: pp − 1 chunk forwards from
    ⌊3·pp/2⌋ micro-batches on, a sixth of 1F1B's (pp − 1)·6c."""
    if not f == b - w == w:
        raise ValueError("the ZB-V formula holds for equal forward, input-gradient and "
                         "weight-gradient times")
    return max(pp - 1, 2 * (2 * pp - 1 - m)) * f


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: everything the code asks about one, looked up once by name
    (:func:`resolve_schedule`) and asked from then on — nothing compares schedule names.

    - ``build(pp_rank, pp, vpp, micro_batches)``: the stage's ops of one step (:meth:`order`);
    - ``v_shape``: its chunks sit in a V (ZB-V), else interleaved (:class:`Placement`);
    - ``split_backward``: each backward runs as a B (input gradient) and a later W (weights):
      its orders hold W ops, and the trainer defers the linears' weight gradients for them;
    - ``stages``: the pipeline sizes it runs: ``"one"`` (pp 1), ``"many"`` (pp > 1) or ``"any"``,
      ``stages_note`` said with its refusal;
    - ``vpp``: the virtual chunks per stage it runs (None: any), ``vpp_note`` said with a refusal
      of another count (where it runs more than one);
    - ``memory_plateau``: past 2·pp micro-batches its peak of activations no longer grows (the
      planner replays no more); ``whole_groups``: it runs micro-batches in groups of pp, a step
      whose last group is short idling more (the planner replays such a step whole);
    - ``bubble``: its idle time by formula (None: it has none), ``planned``: the planner's search
      weighs it, ``description``: one line for help texts.
    """
    name: str
    build: Callable[[int, int, int, int], list[Op]] = field(repr=False, compare=False)
    description: str = ""
    v_shape: bool = False
    split_backward: bool = False
    stages: str = "many"
    stages_note: str = ""
    vpp: int | None = 1
    vpp_note: str = ""
    memory_plateau: bool = False
    whole_groups: bool = False
    bubble: Callable[..., float] | None = field(default=None, repr=False, compare=False)
    planned: bool = True

    def __post_init__(self) -> None:
        if self.stages not in ("one", "many", "any"):
            raise ValueError(f"schedule {self.name}: stages={self.stages!r} is not one, many, any")
        if self.vpp is not None and self.vpp > 1 and not self.vpp_note:
            raise ValueError(f"schedule {self.name}: a fixed vpp={self.vpp} needs the vpp_note its "
                             "refusal of another count says")

    def __str__(self) -> str:
        return self.name

    def order(self, pp_rank: int, pp: int, vpp: int, num_micro: int) -> list[Op]:
        """The ordered forward/backward(/weight-gradient) ops of stage ``pp_rank`` for one step."""
        return self.build(pp_rank, pp, vpp, num_micro)

    def orders(self, pp: int, vpp: int, num_micro: int) -> list[list[Op]]:
        """Every stage's order of one step."""
        return [self.order(r, pp, vpp, num_micro) for r in range(pp)]

    def forward_order(self, pp: int, vpp: int, num_micro: int) -> list[Op]:
        """Evaluation's order (every forward, no backward) under this schedule's placement."""
        return forward_only_order(pp, vpp, num_micro, self.v_shape)

    def placement(self, pp: int, vpp: int) -> Placement:
        """Where this schedule's chunks sit."""
        return Placement(pp, vpp, self.v_shape)

    def check(self, pp: int, vpp: int, num_micro: int) -> None:
        """Raise PipelineError, one line, unless the schedule runs ``pp`` stages of ``vpp``
        chunks (any number of micro-batches: an order is cut down to fewer)."""
        named = f"parallel.pp_schedule={self.name}"
        if self.stages == "many" and pp == 1:
            raise PipelineError(f"{named} needs parallel.pp > 1{self.stages_note}")
        if self.vpp is not None and vpp != self.vpp and self.vpp > 1:
            raise PipelineError(f"{named} {self.vpp_note}: it needs parallel.vpp={self.vpp} "
                                f"(is {vpp})")
        if self.vpp is not None and vpp != self.vpp:
            chunked = [s.name if s.vpp is None else f"{s.name} with vpp {s.vpp}"
                       for s in SCHEDULES.values() if s.vpp != 1]
            others = "".join(f", or {c}" for c in chunked[1:])
            raise PipelineError(f"parallel.vpp={vpp} needs parallel.pp_schedule={chunked[0]} "
                                f"(or auto{others}), not {self.name!r}")
        if self.stages == "one" and pp > 1:
            raise PipelineError(f"{named} runs one stage{self.stages_note}")

    def accepts(self, pp: int, vpp: int, num_micro: int = 1) -> bool:
        """Whether :meth:`check` lets it run at this size."""
        try:
            self.check(pp, vpp, num_micro)
        except PipelineError:
            return False
        return True

    @property
    def pipelines(self) -> bool:
        """Whether it runs more than one stage."""
        return self.stages != "one"

    @property
    def shown_vpp(self) -> int:
        """The chunks per stage the tools draw and benchmark it with: its own count, 2 where any."""
        return 2 if self.vpp is None else self.vpp

    def idle(self, pp: int, vpp: int, m: int, f: float, b: float, w: float = 0.0) -> float:
        """Each stage's idle time in one step of ``m`` micro-batches by the schedule's formula, for
        chunk costs ``f`` (forward), ``b`` (whole backward) and ``w`` (its weight-gradient part);
        ValueError where it has none, or the costs are outside the formula's."""
        if self.bubble is None:
            raise ValueError(f"no bubble formula for schedule {self.name!r}")
        return self.bubble(pp, vpp, m, f, b, w)

    def memory_micro(self, pp: int, m: int) -> int:
        """Micro-batches whose order holds as many activations at its peak as ``m``'s (the
        planner's memory model replays that many)."""
        return min(m, 2 * pp) if self.memory_plateau else m

    def bubble_micro(self, pp: int, m: int) -> int:
        """Micro-batches whose replay idles as long as ``m``'s (the steady state from 2·pp on)."""
        return m if self.whole_groups and m % pp else min(m, 2 * pp)


_BUBBLE_NOTE = " (it fills a pipeline's bubble)"

#: Every schedule ``parallel.pp_schedule`` names, by name (``auto`` chooses among them:
#: :func:`named_schedule`). A new schedule is one entry here (docs/contributing.md).
SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("none", _one_stage, "no pipelining: one stage, each micro-batch's forward, backward",
             stages="one", stages_note="; use gpipe, 1f1b or auto with parallel.pp > 1",
             planned=False),
    Schedule("gpipe", _gpipe, "GPipe: every forward, then every backward (every micro-batch held)",
             stages="any", bubble=_bubble_1f1b, planned=False),
    Schedule("1f1b", _1f1b, "1F1B: a warmup of forwards, then one forward and one backward",
             stages="any", memory_plateau=True, bubble=_bubble_1f1b),
    Schedule("interleaved", _interleaved, "interleaved 1F1B: vpp chunks per stage, a vpp-th of "
             "the bubble", vpp=None, memory_plateau=True, whole_groups=True,
             bubble=_bubble_interleaved),
    Schedule("zb_h1", _zb_h1, "ZB-H1: 1F1B with weight gradients deferred into the bubble",
             split_backward=True, stages_note=_BUBBLE_NOTE, bubble=_bubble_zb_h1),
    Schedule("zbv", _zbv, "ZB-V: two chunks per stage in a V, weight gradients in the bubble",
             v_shape=True, split_backward=True, stages_note=_BUBBLE_NOTE, vpp=2,
             vpp_note="runs two chunks per stage in a V", bubble=_bubble_zbv),
)}
AUTO = "auto"  # parallel.pp_schedule's default: the schedule :func:`named_schedule` picks
NAMES = (AUTO, *SCHEDULES)  # what parallel.pp_schedule may say


def named_schedule(name: str, pp: int, vpp: int) -> Schedule:
    """The schedule ``name`` stands for at ``pp`` stages of ``vpp`` chunks (``auto``: none for
    one stage, interleaved with virtual chunks, else 1F1B), its rules not checked."""
    if name == AUTO:
        return SCHEDULES["none" if pp == 1 else ("interleaved" if vpp > 1 else "1f1b")]
    if name not in SCHEDULES:
        raise PipelineError(f"parallel.pp_schedule={name!r} is not one of: {', '.join(NAMES)}")
    return SCHEDULES[name]


def layout_schedule(layout: Layout) -> Schedule:
    """The schedule a layout's ``pp_schedule`` names at its pp and vpp (``auto`` chosen), its
    rules not checked: the layout holds only the name."""
    return named_schedule(layout.pp_schedule, layout.pp, layout.vpp)


def resolve_schedule(name: str | Schedule, pp: int, vpp: int, num_micro: int,
                     default: str = AUTO) -> Schedule:
    """The pipeline schedule ``parallel.pp_schedule`` names at this layout, checking that it fits
    (pp, vpp, micro-batches per step); a Schedule stands for itself. ``default``: what ``auto``
    stands for first (a layout's own schedule, itself possibly ``auto``)."""
    if isinstance(name, Schedule):
        name = name.name
    if name == AUTO:
        name = default
    if name not in NAMES:
        raise PipelineError(f"parallel.pp_schedule={name!r} is not one of: {', '.join(NAMES)}")
    if vpp > 1 and pp == 1:
        raise PipelineError(f"parallel.vpp={vpp} needs parallel.pp > 1 (virtual chunks interleave "
                            "stages)")
    schedule = named_schedule(name, pp, vpp)
    schedule.check(pp, vpp, num_micro)
    return schedule


def input_transfer(op: Op, stage: int, pp: int, vpp: int, v_shape: bool = False) -> Transfer | None:
    """What ``op`` on ``stage`` receives: the previous chunk's activation for a forward, the next
    chunk's gradient for a backward; None for the first chunk's forward, the last one's backward
    and every W."""
    place = Placement(pp, vpp, v_shape)
    g = place.global_chunk(stage, op.chunk)
    if op.kind == "F":
        return Transfer("act", op.micro, g, place.stage_of(g - 1), stage) if g > 0 else None
    if op.kind == "B":
        return Transfer("grad", op.micro, g, place.stage_of(g + 1), stage) if g < place.chunks - 1 \
            else None
    return None


def output_transfer(op: Op, stage: int, pp: int, vpp: int,
                    v_shape: bool = False) -> Transfer | None:
    """What ``op`` on ``stage`` sends: a forward's output to the next chunk (none from the head),
    a backward's input gradient to the previous chunk (none from the embedding's chunk), nothing
    from a W."""
    place = Placement(pp, vpp, v_shape)
    g = place.global_chunk(stage, op.chunk)
    if op.kind == "F":
        return Transfer("act", op.micro, g + 1, stage, place.stage_of(g + 1)) \
            if g < place.chunks - 1 else None
    if op.kind == "B":
        return Transfer("grad", op.micro, g - 1, stage, place.stage_of(g - 1)) if g > 0 else None
    return None


def transfer_rounds(orders: list[list[Op]], pp: int, vpp: int,
                    v_shape: bool = False) -> list[list[Step]]:
    """Every stage's steps: the round's batched sends and receives, then the op to compute.

    With unit costs each stage runs one op per slot, so a stage sends at most one tensor and
    receives at most one from each neighbour per round; a stage joins only the rounds it has a
    part in. Each op's input arrives in a round no later than its slot (asserted by the tests).
    A transfer from a stage to itself (V placement's turn) is no communication: it is left out."""
    # every op one slot
    starts = replay(orders, pp, vpp, 1.0, 1.0 + has_weight_ops(orders), 1.0, v_shape)
    slots = [{int(t): op for t, op in zip(starts[r], orders[r])} for r in range(pp)]
    rounds = 1 + max((max(s, default=-1) for s in slots), default=-1)

    def produced(stage: int, t: int) -> Transfer | None:
        op = slots[stage].get(t)
        out = output_transfer(op, stage, pp, vpp, v_shape) if op is not None else None
        return out if out is not None and out.dst != out.src else None

    per_stage: list[list[Step]] = []
    for r in range(pp):
        steps = []
        for t in range(rounds + 1):
            send = produced(r, t - 1)
            recvs = tuple(x for x in (produced(src, t - 1)
                                      for src in sorted({(r - 1) % pp, (r + 1) % pp} - {r}))
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

    def exchange(self, sends: list[tuple[Transfer, torch.Tensor]],
                 recvs: tuple[Transfer, ...]) -> dict:
        """Post this stage's part of a round in one batch, wait for all of it, return what
        arrived."""
        ops, arrived = [], {}
        for t, tensor in sends:
            tensor = tensor.detach().contiguous()
            self.pp._record("send", tensor)
            ops.append(dist.P2POp(dist.isend, tensor, self.pp.ranks[t.dst], self.pp.pg,
                                  _TAGS[t.kind]))
        for t in recvs:
            arrived[t] = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            self.pp._record("recv", arrived[t])
            ops.append(dist.P2POp(dist.irecv, arrived[t], self.pp.ranks[t.src], self.pp.pg,
                                  _TAGS[t.kind]))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return arrived


@dataclass
class PipelineExecutor:
    """Runs every stage's order of ops; this stage computes its own and joins the rounds of
    :func:`transfer_rounds`.

    ``forward_fn(chunk, micro, input)`` returns the chunk's output activation, or — on the chunk
    that holds the head — the scalar to backpropagate. ``input`` is None on the chunk holding the
    embedding. ``grad_sync(last, split)`` wraps every backward and weight-gradient op (the
    data-parallel overlap hook); ``last`` is true for each chunk's ops of the final micro-batch,
    ``split`` is ("B" | "W", (micro, chunk)) for the two halves of a split backward, else None. A
    schedule whose backward splits needs ``deferred`` (``parallel/tensor.py``'s
    :class:`DeferredGrads` of this stage's chunks): a B runs inside ``deferred.capture((micro,
    chunk))``, which keeps its linears' weight gradients back, and the W runs them,
    ``deferred.flush((micro, chunk))``. With ``record`` set, ``trace`` keeps the ops of the latest
    run.
    """
    pp_rank: int
    pp: int
    vpp: int
    p2p: P2P | None
    grad_sync: Callable
    schedule: Schedule  # the orders' schedule: where its chunks sit, whether it runs W ops
    record: bool = False
    deferred: object | None = None
    trace: list = field(default_factory=list)
    _rounds: dict = field(default_factory=dict, repr=False)

    @property
    def v_shape(self) -> bool:
        return self.schedule.v_shape

    def steps_for(self, orders: list[list[Op]]) -> list[Step]:
        """This stage's steps for ``orders`` (one per stage), computed once per distinct
        schedule."""
        key = tuple(map(tuple, orders))
        if key not in self._rounds:
            self._rounds[key] = transfer_rounds(orders, self.pp, self.vpp,
                                                self.v_shape)[self.pp_rank]
        return self._rounds[key]

    def run(self, orders: list[list[Op]], num_micro: int, forward_fn: Callable,
            backward: bool = True) -> None:
        stage = self.pp_rank
        # (micro, chunk) -> (input, output) kept for the backward
        saved: dict[tuple, tuple] = {}
        inbox: dict[Transfer, torch.Tensor] = {}
        outbox: dict[Transfer, torch.Tensor] = {}
        split = self.schedule.split_backward
        if split and self.deferred is None:
            raise ValueError("orders with W ops need the executor's deferred weight gradients")
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
            key = (op.micro, op.chunk)
            source = input_transfer(op, stage, self.pp, self.vpp, self.v_shape)
            sink = output_transfer(op, stage, self.pp, self.vpp, self.v_shape)
            # V placement's turn stays on this stage: the output is the next chunk's input at once
            box = inbox if sink is not None and sink.dst == stage else outbox
            last = op.micro == num_micro - 1
            if op.kind == "F":
                inp = inbox.pop(source).requires_grad_(backward) if source is not None else None
                with torch.set_grad_enabled(backward):
                    out = forward_fn(op.chunk, op.micro, inp)
                if sink is not None:
                    box[sink] = out.detach() if box is inbox else out
                if backward:
                    saved[key] = (inp, out)
            elif op.kind == "B":
                inp, out = saved.pop(key)
                grad = inbox.pop(source) if source is not None else None
                with (self.grad_sync(last, ("B", key)) if split else self.grad_sync(last)), \
                        (self.deferred.capture(key) if split else contextlib.nullcontext()):
                    _backward(out, grad)
                if sink is not None:
                    box[sink] = inp.grad
            else:
                with self.grad_sync(last, ("W", key)):
                    self.deferred.flush(key)
        assert not (inbox or outbox or saved), "pipeline step ended with transfers or " \
                                               "activations left over"


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
