"""ZeRO-3: fully sharded parameters, gathered one unit at a time around its use.

Under ``parallel.zero 3`` each rank keeps only its 1/dp shard of the parameters (the buckets of
:mod:`megapretrain.parallel.data`, cut so that a bucket never spans two units). A *unit* is one
decoder layer, or a model chunk's other parameters (embedding, final norm, head: the *root*).
Around every use, a layer's full parameters are all-gathered into its bucket's own buffer and
released again; its gradients are reduce-scattered into the shard as soon as its backward is done::

    forward of layer i     wait gather(i) · start gather(i+1) (prefetch) · compute · free(i)
                           (the last layer is kept for its backward when that comes next)
    backward of layer i    wait gather(i) · start gather(i-1) · compute · reduce-scatter(i) ·
                           free(i)

The backward gather is started by a hook on the layer's output, which fires when the gradient
w.r.t. that output exists — just before the layer's own backward. Full recomputation re-runs the
layer's forward inside that backward, on the parameters gathered for it. The root is gathered as
the chunk's forward starts and kept until the step's last backward is done (the head and the
embedding are used at both ends of the chunk). With ``zero3_keep_gathered`` every unit stays
gathered from its first use to the step's last backward: no re-gather between forward and
backward or between micro-batches, at the memory cost of the whole chunk's parameters.
``keep_last`` (a model of one chunk, without pipeline parallelism, whose backward starts right
after its forward) keeps the last layer from its forward to its backward, as nothing runs in
between but the head: one gather fewer per micro-batch, and no wait for it when backward starts.

At most three layer units are gathered at any moment — the one computing, the one prefetched,
and in backward the previous one while its last gradients arrive — plus every chunk's root
(``max_gathered`` counts them).
"""

from __future__ import annotations

import time
from functools import partial

import torch
from torch import nn

from .data import Bucket, DataParallelBuffers

LAYER_UNITS_ALIVE = 3  # the design's bound on gathered decoder layers (see the module docstring)


class Unit:
    """A decoder layer's bucket(s), or a chunk's root buckets."""

    def __init__(self, name: str, buckets: list[Bucket], root: bool):
        self.name, self.buckets, self.root = name, buckets, root
        self.backward = False  # between its backward's start and its grads' reduction
        self.prev: Unit | None = None  # the layer before in forward order (None: the first)
        self.next: Unit | None = None


class ShardedUnits:
    """Gathers and frees the units of ``chunks`` (whose parameters ``buffers`` holds, with
    ``zero=3``) through module hooks. ``trace``: record (time, event, unit) for tests."""

    def __init__(self, buffers: DataParallelBuffers, chunks: list[nn.Module], *,
                 keep_gathered: bool = False, prefetch: bool = True, keep_last: bool = False,
                 trace: bool = False):
        self.buffers, self.keep, self.prefetch, self.keep_last = \
            buffers, keep_gathered, prefetch, keep_last
        self.events: list[tuple[float, str, str]] | None = [] if trace else None
        self.units: list[Unit] = []
        self._unit_of: dict[int, Unit] = {}  # bucket index -> unit
        self.max_gathered = {"layers": 0, "roots": 0, "bytes": 0}  # the most alive at once so far
        self.wait_s = 0.0  # seconds spent waiting for gathers to arrive (exposed communication)
        for c, chunk in enumerate(chunks):
            self._hook_chunk(c, chunk)
        buffers.after_grads = self._after_grads
        buffers.after_split_backward = self._after_split_backward

    def _buckets(self, params) -> list[Bucket]:
        return list(dict.fromkeys(self.buffers._bucket_of[id(p)] for p in params
                                  if id(p) in self.buffers._bucket_of))

    def _hook_chunk(self, c: int, chunk: nn.Module) -> None:
        layers = dict(chunk.layers.items()) if hasattr(chunk, "layers") else {}
        in_layers = {id(p) for layer in layers.values() for p in layer.parameters()}
        root = Unit(f"chunk{c}.root",
                    self._buckets(p for p in chunk.parameters() if id(p) not in in_layers), True)
        previous = None
        for name, layer in layers.items():
            unit = Unit(f"layers.{name}", self._buckets(layer.parameters()), False)
            unit.prev = previous
            if previous is not None:
                previous.next = unit
            previous = unit
            self._add(unit)
            layer.register_forward_pre_hook(partial(self._before_layer, unit=unit))
            layer.register_forward_hook(partial(self._after_layer, unit=unit))
        first = self.units[-len(layers)] if layers else None
        self._add(root)
        chunk.register_forward_pre_hook(partial(self._before_chunk, root=root, first=first))
        chunk.register_forward_hook(partial(self._after_chunk, root=root))

    def _add(self, unit: Unit) -> None:
        self.units.append(unit)
        for b in unit.buckets:
            self._unit_of[b.index] = unit

    # -- gather / free ----------------------------------------------------------------------------

    def _record(self, event: str, unit: Unit) -> None:
        if self.events is not None:
            self.events.append((time.perf_counter(), event, unit.name))

    def _start(self, unit: Unit | None, full_precision: bool = False) -> None:
        """Start gathering ``unit`` (FP8 buckets as FP8, unless ``full_precision``)."""
        if unit is None or (all(b.gathered for b in unit.buckets) and not full_precision):
            return
        self._record("gather", unit)
        for b in unit.buckets:
            self.buffers.gather(b, full_precision)
        self._count()

    def _ready(self, unit: Unit, full_precision: bool = False) -> None:
        self._start(unit, full_precision)
        start = time.perf_counter()
        for b in unit.buckets:
            self.buffers.wait(b)
        self.wait_s += time.perf_counter() - start

    def _free(self, unit: Unit) -> None:
        if any(b.gathered for b in unit.buckets):
            self._record("free", unit)
        for b in unit.buckets:
            self.buffers.free(b)

    def _count(self) -> None:
        alive = [u for u in self.units if u.buckets and any(b.gathered for b in u.buckets)]
        layers = sum(not u.root for u in alive)
        self.max_gathered["layers"] = max(self.max_gathered["layers"], layers)
        self.max_gathered["roots"] = max(self.max_gathered["roots"], len(alive) - layers)
        self.max_gathered["bytes"] = max(self.max_gathered["bytes"], self.buffers.gathered_bytes())

    def gather_all(self) -> None:
        """Gather every unit and wait for it (reading the whole model outside its forward: FP8
        buckets in their own precision too)."""
        for unit in self.units:
            self._ready(unit, full_precision=True)

    def free_all(self) -> None:
        """Release every unit (after the optimizer step: the shards hold new values)."""
        for unit in self.units:
            unit.backward = False
            self._free(unit)

    # -- hooks ------------------------------------------------------------------------------------

    def _before_chunk(self, chunk, args, root: Unit, first: Unit | None) -> None:
        self._ready(root)
        if self.prefetch:
            self._start(first)

    def _after_chunk(self, chunk, args, output, root: Unit) -> None:
        if not torch.is_grad_enabled():  # evaluation: no backward will need the root
            self._free(root)

    def _before_layer(self, layer, args, unit: Unit) -> None:
        self._ready(unit)
        self._record("forward", unit)
        if self.prefetch and not unit.backward:  # (in backward: a recompute, already prefetched)
            self._start(unit.next)

    def _after_layer(self, layer, args, output, unit: Unit) -> None:
        if unit.backward:  # the recomputation inside this unit's backward
            return
        self._record("forward_done", unit)
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(partial(self._before_backward, unit=unit))
            if self.keep or (self.keep_last and unit.next is None):
                return
        self._free(unit)

    def _before_backward(self, grad: torch.Tensor, unit: Unit) -> None:
        unit.backward = True
        self._ready(unit)
        self._record("backward", unit)
        if self.prefetch:
            self._start(unit.prev)

    def _after_split_backward(self) -> None:
        """A zero-bubble schedule's B is over: its layers' weight gradients, deferred to the W,
        need no parameters (``parallel/tensor.py``: DeferredGrads), so every layer whose input
        gradients are done is released now rather than after its W; its grads are still
        reduce-scattered when the W has folded them (``_after_grads``)."""
        for unit in self.units:
            if unit.backward and not unit.root:
                unit.backward = False
                if not self.keep:
                    self._free(unit)

    def _after_grads(self, bucket: Bucket, last: bool) -> None:
        """``buffers``: every grad of ``bucket`` in this micro-batch is folded (and its reduction
        launched); ``last``: in the step's last micro-batch."""
        unit = self._unit_of.get(bucket.index)
        if unit is None or not all(self.buffers.folded(b, last) for b in unit.buckets):
            return
        self._record("reduce", unit)
        unit.backward = False
        if last or not (unit.root or self.keep):
            self._free(unit)

