"""What one rank's training steps hold, move and compute, measured on the trainer itself.

:class:`Measurement` runs ``Trainer.train_step`` under a :class:`ProgramTrace` — the memory
timeline of ``monitor/memtrace.py``, plus the FLOPs of every dispatched op and, on fake tensors,
an answer to every host read — after marking what it needs to explain the timeline: the storages
of the parameters, gradient buffers and optimizer state; which allocations a collective, a
pipeline transfer, a ZeRO-3 gather or a ZeRO-2 gradient bucket made; and the *region* the program
is in (the forward or backward of which micro-batch and model chunk, which layer, a layer's
recomputation, the gradient reduction, the optimizer). It changes nothing the trainer does: it
wraps methods of the trainer's own objects (process groups, the pipeline's transfers and
backward context, the optimizer's buffers) and adds module hooks that only record.

At the peak every live allocation falls in one category (:func:`breakdown`):

- ``parameters``, ``gradients``, ``optimizer``: the optimizer's buffers (the model's weights in
  its dtype; fp32 gradient buffers or shards, and a ZeRO-2 bucket's transient full gradients; fp32
  masters and Adam moments or Muon's momentum — under ``optim.offload`` host memory, counted
  apart as ``Measurement.host_optimizer`` with what the host's step allocates, as the planner
  counts them);
- ``zero3_gathered``: ZeRO-3 layers gathered in full; ``comm_buffers``: what a collective
  allocated (gathered pieces, reduce-scatter inputs) and has not freed yet;
- ``pipeline_in_flight``: activations received from the neighbouring stage, and what the forward
  of *another* micro-batch chunk than the one computing keeps for its backward;
- ``activations``: what the forward (or recomputation) of the micro-batch chunk computing at the
  peak keeps for its backward;
- ``temporary``: made and freed within one forward, backward or optimizer region;
- ``other``: kept from one step to the next outside those buffers (rotary tables, RNG states).
"""

from __future__ import annotations

import contextlib
import traceback
from collections import defaultdict
from dataclasses import dataclass
from functools import partial

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.flop_counter import flop_registry

from ..monitor.memtrace import MemoryTrace, Segment
from ..parallel.state import Group

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "pipeline_in_flight",
              "zero3_gathered", "comm_buffers", "temporary", "other")
_TAGGED = {"parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer",
           "zero3": "zero3_gathered", "comm": "comm_buffers", "pipeline": "pipeline_in_flight"}
_FORWARD = ("forward", "recompute")


@dataclass
class Region:
    """A stretch of one step, from event ``start`` to ``end``: the forward or backward of
    micro-batch ``micro`` on model chunk ``chunk`` (inside it, a ``layer``, or a layer's
    ``recompute``), or the step's ``data``, ``grad_sync``, ``optimizer`` part."""
    step: int
    kind: str
    start: int
    micro: int | None = None
    chunk: int | None = None
    layer: str | None = None
    parent: Region | None = None  # the op a layer's region is part of
    previous: Region | None = None  # the region the program returns to after this one
    end: int | None = None

    @property
    def op(self) -> Region:
        """The forward or backward op (or step part) this region belongs to."""
        return self if self.parent is None else self.parent.op

    def where(self) -> dict:
        op = self.op
        return {"step": self.step, "phase": self.kind, "micro_batch": op.micro, "chunk": op.chunk,
                "layer": self.layer}


# -- FLOPs of the ops that torch's counter has no formula for --------------------------------------


def _attention_flops(q, k, v, backward: bool) -> int:
    """Scores and weighted sum (b, hq, sq, sk) at 2 FLOPs per multiply-add, as torch's counter
    counts them (causal masking not halved); grouped-query keys counted at the query heads. A
    backward computes the scores again and three products: 2.5 times the forward."""
    b, hq, sq, d = q.shape
    sk, dv = k.shape[-2], v.shape[-1]
    forward = 2 * b * hq * sq * sk * (d + dv)
    return forward * 5 // 2 if backward else forward


def _attention_fwd(q, k, v, *args, out_val=None, **kwargs) -> int:
    return _attention_flops(q, k, v, backward=False)


def _attention_bwd(grad, q, k, v, *args, out_val=None, **kwargs) -> int:
    return _attention_flops(q, k, v, backward=True)


_aten = torch.ops.aten
_DEVICE = torch.ops.prim.device.default
FLOPS = dict(flop_registry)
FLOPS.update({  # the flash kernels, GQA included (torch's formulas need equal heads)
    _aten._scaled_dot_product_flash_attention_for_cpu: _attention_fwd,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_bwd,
    _aten._scaled_dot_product_flash_attention: _attention_fwd,
    _aten._scaled_dot_product_flash_attention_backward: _attention_bwd,
    _aten._scaled_dot_product_efficient_attention: _attention_fwd,
    _aten._scaled_dot_product_efficient_attention_backward: _attention_bwd,
})


def _caller() -> str:
    """The package's innermost frame that led here: where a host read happens."""
    for frame in reversed(traceback.extract_stack(limit=40)):
        if "/megapretrain/" in frame.filename and "/simulate/" not in frame.filename \
                and "/monitor/memtrace" not in frame.filename:
            return f"{frame.filename.rsplit('/megapretrain/', 1)[1]}:{frame.lineno} ({frame.name})"
    return "outside the package"


class ProgramTrace(MemoryTrace):
    """The memory timeline, the FLOPs of the ops dispatched, and for fake tensors an answer to a
    read of a device value on the host (``.item()``, ``bool()``): a fake tensor has no value, so
    the step goes on as if a check passed — ``True``, 1 or 1.0 — and the place is recorded in
    ``host_reads`` (the step the trainer runs reads none on a GPU)."""

    def __init__(self, device: torch.device | str = "cpu"):
        super().__init__(device)
        self.flops = 0
        self.host_reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE and isinstance(args[0], FakeTensor):
            # asked of fake tensors at every op (most calls): answered here
            return args[0].fake_device
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default and isinstance(args[0], FakeTensor) \
                and args[0].constant is None:  # (a constant, from torch.tensor(3.0), has its value)
            self.host_reads.append(_caller())
            return {torch.bool: True}.get(args[0].dtype, 1.0 if args[0].is_floating_point() else 1)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        formula = FLOPS.get(func.overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        return out


@dataclass
class StepRecord:
    """One measured step: its events, FLOPs, collectives, and host reads."""
    start: int
    end: int
    flops: int
    comm: dict
    host_reads: list


class Measurement:
    """Instruments ``trainer`` (built inside ``trace``) and runs its training steps."""

    def __init__(self, trainer, trace: ProgramTrace):
        self.trainer, self.trace = trainer, trace
        self.step = 0
        self.region: Region | None = None
        self._ops: list = []  # this step's remaining ops of this stage's order
        # optim.offload: the optimizer state's bytes, host memory (not in the peak)
        self.host_optimizer = 0
        self._label_buffers()
        self._wrap_communication()
        self._hook_model()

    # -- marking ---------------------------------------------------------------------------------

    def _label_buffers(self) -> None:
        opt, trace = self.trainer.optimizer, self.trace
        for t in opt.buffers.param_buffers:
            trace.label(t, "parameters")
        for t in opt.buffers.grad_buffers:
            trace.label(t, "gradients")
        for s in opt.shards:
            for t in (s.exp_avg, s.exp_avg_sq, s.grad_staging, s.decay_mask,
                      None if s.master is s.param_shard else s.master, *s.momentum.values()):
                if t is None:
                    continue
                if opt.offload:  # optim.offload: host memory, and the step runs there
                    self.host_optimizer += trace.to_host(t)
                else:
                    trace.label(t, "optimizer")
        if opt.offload:  # the elementwise steps run on the host (Muon's NS on the device)
            opt._adamw = self._on_host(opt._adamw)
            if opt.muon is not None:
                opt.muon._momenta = self._on_host(opt.muon._momenta)
                opt.muon._apply = self._on_host(opt.muon._apply)
        buffers = opt.buffers
        buffers.gather = self._tagging(buffers.gather, "zero3")
        buffers.main_grad_for = self._tagging(buffers.main_grad_for, "gradients")

    def _on_host(self, method):
        trace = self.trace

        def on_host(*args, **kwargs):
            with trace.host():
                return method(*args, **kwargs)
        return on_host

    def _tagging(self, method, tag: str):
        trace = self.trace

        def tagged(*args, **kwargs):
            with trace.tagged(tag):
                return method(*args, **kwargs)
        return tagged

    def _wrap_communication(self) -> None:
        ps, seen = self.trainer.ps, set()
        for group in vars(ps).values():
            if isinstance(group, Group) and id(group) not in seen:
                seen.add(id(group))
                for name in ("all_reduce", "all_gather", "reduce_scatter", "all_reduce_async",
                             "reduce_scatter_async", "all_gather_async", "all_to_all_async"):
                    setattr(group, name, self._tagging(getattr(group, name), "comm"))
        pipeline = self.trainer.pipeline
        if pipeline.p2p is not None:
            pipeline.p2p.exchange = self._tagging(pipeline.p2p.exchange, "pipeline")
        pipeline.grad_sync = self._backward_op(pipeline.grad_sync)
        opt = self.trainer.optimizer
        opt.reduce_grads = self._part(opt.reduce_grads, "grad_sync")
        opt.step_on_device = self._part(opt.step_on_device, "optimizer")

    def _hook_model(self) -> None:
        for c, chunk in enumerate(self.trainer.model_chunks):
            chunk.register_forward_pre_hook(partial(self._chunk_forward, chunk=c))
            chunk.register_forward_hook(self._chunk_done)
            for name, layer in chunk.layers.items():
                layer.register_forward_pre_hook(partial(self._layer_start, name=f"layers.{name}"))
                # always: a recomputation stops with an exception once it has what the backward
                # needs
                layer.register_forward_hook(partial(self._layer_done, name=f"layers.{name}"),
                                            always_call=True)

    # -- regions ---------------------------------------------------------------------------------

    def _enter(self, kind: str, parent: Region | None = None, **where) -> Region:
        region = Region(self.step, kind, self.trace.clock, parent=parent, previous=self.region,
                        **where)
        self.region = self.trace.phase = region
        return region

    def _leave(self, region: Region) -> None:
        region.end = self.trace.clock
        self.region = self.trace.phase = region.previous

    def _next_op(self, kind: str, chunk: int | None = None) -> tuple[int, int]:
        """(micro, chunk) of this stage's next ``kind`` op in the schedule's order."""
        for i, op in enumerate(self._ops):
            if op.kind == kind and (chunk is None or op.chunk == chunk):
                del self._ops[i]
                return op.micro, op.chunk
        raise RuntimeError(f"the trainer ran a {kind} op its schedule does not have")

    def _chunk_forward(self, module, args, chunk: int) -> None:
        if not torch.is_grad_enabled():
            return
        micro, _ = self._next_op("F", chunk)
        self._enter("forward", micro=micro, chunk=chunk)

    def _chunk_done(self, module, args, output) -> None:
        region = self.region
        if region is not None and region.op.kind == "forward":
            # a layer left open (none normally)
            while region is not None and region is not region.op:
                self._leave(region)
                region = self.region
            self._leave(region)

    def _layer_start(self, layer, args, name: str) -> None:
        region = self.region
        if region is None or region.op.kind not in ("forward", "backward"):
            return
        kind = "recompute" if region.op.kind == "backward" else "forward"
        self._enter(kind, parent=region.op, layer=name)

    def _layer_done(self, layer, args, output, name: str) -> None:
        region = self.region
        if region is None or region.layer != name or region.kind not in _FORWARD:
            return
        self._leave(region)
        if region.kind == "forward" and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(partial(self._backward_layer, name=name))

    def _backward_layer(self, grad, name: str) -> None:
        region = self.region
        if region is not None and region.op.kind == "backward":
            if region.parent is not None:  # the previous layer's backward is done
                self._leave(region)
            self._enter("backward", parent=self.region.op, layer=name)

    def _backward_op(self, grad_sync):
        @contextlib.contextmanager
        def measured(last: bool, split: tuple | None = None):
            # a zero-bubble schedule's W op (split ("W", key)) is a backward region of its own
            micro, chunk = self._next_op(split[0] if split is not None else "B")
            region = self._enter("backward", micro=micro, chunk=chunk)
            try:
                with grad_sync(last, split):
                    yield
            finally:
                while self.region is not region:
                    self._leave(self.region)
                self._leave(region)
        return measured

    def _part(self, method, kind: str):
        def measured(*args, **kwargs):
            region = self._enter(kind)
            try:
                return method(*args, **kwargs)
            finally:
                self._leave(region)
        return measured

    # -- steps -----------------------------------------------------------------------------------

    def run(self, steps: int) -> list[StepRecord]:
        """``steps`` training steps, each measured (the peak: over all of them)."""
        t, ps, records = self.trainer, self.trainer.ps, []
        self.trace.reset_peak()
        for _ in range(steps):
            self.step += 1
            batch = t._batch_size(t.consumed_samples)
            num_micro = batch // (t.cfg.train.micro_batch_size * ps.dp.size)
            self._ops = t.pipeline_schedule.order(ps.pp_rank, ps.pp.size, t.cfg.parallel.vpp,
                                                  num_micro)
            step_region = self._enter("step")
            start, flops, reads = self.trace.clock, self.trace.flops, len(self.trace.host_reads)
            t.train_step()
            while self.region is not None and self.region is not step_region:
                self._leave(self.region)
            self._leave(step_region)
            t.iteration += 1
            t.consumed_samples += batch
            records.append(StepRecord(start, self.trace.clock, self.trace.flops - flops,
                                      ps.stats.summary() if ps.stats is not None else {},
                                      self.trace.host_reads[reads:]))
        return records


def breakdown(trace: MemoryTrace, clock: int, now: Region | None, steps: list[StepRecord]) -> dict:
    """Bytes alive at event ``clock``, in region ``now``, by category (see the module docstring)."""
    out = dict.fromkeys(CATEGORIES, 0)
    current = now.op if now is not None else None
    for segment in trace.alive_at(clock):
        out[_category(segment, current, steps)] += segment.bytes
    return out


def largest(trace: MemoryTrace, clock: int, now: Region | None, steps: list[StepRecord],
            n: int = 8) -> list[dict]:
    """The ``n`` largest allocations alive at event ``clock``: bytes, category, and where made."""
    current = now.op if now is not None else None
    alive = sorted(trace.alive_at(clock), key=lambda s: -s.bytes)[:n]
    return [{"bytes": s.bytes, "category": _category(s, current, steps),
             "made_in": s.phase.where() if isinstance(s.phase, Region) else "before the first step",
             "by": s.tag} for s in alive]


def _category(s: Segment, current: Region | None, steps: list[StepRecord]) -> str:
    if s.tag in _TAGGED:
        return _TAGGED[s.tag]
    region: Region | None = s.phase
    if region is None:
        return "other"
    step_end = steps[region.step - 1].end if 0 < region.step <= len(steps) else None
    if step_end is None or s.end is None or s.end > step_end:
        return "other"  # outlives its step: a cache, not a step's working memory
    scope = region if region.kind == "recompute" else region.op
    if scope.kind not in _FORWARD:
        return "temporary"
    if scope.end is not None and s.end is not None and s.end <= scope.end:
        return "temporary"
    op = scope.op if scope.kind != "recompute" else scope.parent
    same = current is not None and (op.step, op.micro, op.chunk) == (current.step, current.micro,
                                                                     current.chunk)
    return "activations" if same else "pipeline_in_flight"


def comm_by_group(summary: dict) -> tuple[dict, dict]:
    """``CommStats.summary()`` ({"tp.all_gather": {calls, bytes}}) as bytes and calls by group and
    op."""
    nbytes, calls = defaultdict(dict), defaultdict(dict)
    for key, value in summary.items():
        group, op = key.split(".", 1)
        nbytes[group][op], calls[group][op] = value["bytes"], value["calls"]
    return dict(nbytes), dict(calls)
