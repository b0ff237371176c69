"""Tensor and sequence parallelism: autograd mappings and the layers built from them.

Activations are (batch, seq, hidden). Each mapping is named by what it does forward and backward;
all return at once when the tp group has one rank, so the single-process path is the same code.

    copy_to_tp          forward: identity                backward: all-reduce
    reduce_from_tp      forward: all-reduce              backward: identity
    gather_from_sp      forward: all-gather along seq    backward: reduce-scatter along seq
    reduce_scatter_to_sp forward: reduce-scatter (seq)   backward: all-gather along seq

Every parallel layer declares how its parameters are laid out (``param_shardings``, see
``parallel/specs.py``); initialization, the optimizer, checkpointing and conversion read that
declaration through the model's parameter-spec table.
"""

from __future__ import annotations

import contextlib
import hashlib
import weakref
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .specs import ParamSpec, Sharding
from .state import Group
from .tp_overlap import RingStream

SEQ_DIM = 1


# ----------------------------------------------------------------------------------------------
# The seams a linear's GEMMs and a block's input gather plug into (parallel/fp8.py's FP8Linear and
# GatheredInputs): the linears here own them, so nothing here imports what plugs in


class LinearGEMMs(Protocol):
    """A linear's three GEMMs in another precision, called as the layer's ``x Wᵀ``."""

    weights: object | None  # ZeRO-3's weight gather in that precision, whose casts the GEMMs read

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...


class InputGather(Protocol):
    """A block's sequence-parallel all-gather of its column-parallel linears' input, sent in
    another precision: (b, s/tp, h) -> (b, s, h)."""

    def gather(self, x: torch.Tensor, tp: Group, saved: SavedShards | None) -> torch.Tensor: ...


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_reduce(grad.contiguous()), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return group.all_reduce(x.contiguous())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return group.all_gather(x, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.reduce_scatter(grad, SEQ_DIM), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return group.reduce_scatter(x, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_gather(grad, SEQ_DIM), None


def _mapping(fn):
    def apply(x: torch.Tensor, group: Group) -> torch.Tensor:
        return x if group.size == 1 else fn.apply(x, group)
    apply.__doc__ = fn.__doc__
    return apply


copy_to_tp = _mapping(_CopyToTP)
reduce_from_tp = _mapping(_ReduceFromTP)
gather_from_sp = _mapping(_GatherFromSP)
reduce_scatter_to_sp = _mapping(_ReduceScatterToSP)


# ----------------------------------------------------------------------------------------------
# Layout-invariant initialization


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed that depends only on the run seed and the parameter's global name."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_shard_(param: torch.Tensor, spec: ParamSpec, seed: int, std: float, group: Group) -> None:
    """Fill ``param`` (this rank's tensor of ``spec``) with its slice of the global normal(0, std)
    tensor named ``spec.name``.

    The global tensor is drawn on the CPU from a generator seeded by (seed, name), so its values do
    not depend on tp, pp, dp or the device. Vocabulary padding rows (past ``spec.shape[0]``, their
    number depends on tp) are zero.
    """
    padded = list(spec.local_shape)  # the global tensor as this layout pads it
    if spec.tp_dim is not None:
        padded[spec.tp_dim] *= group.size
    gen = torch.Generator(device="cpu").manual_seed(name_seed(seed, spec.name))
    full = torch.empty(spec.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
    if padded[0] > spec.shape[0]:
        full = torch.cat([full, full.new_zeros([padded[0] - spec.shape[0]] + padded[1:])])
    if spec.tp_dim is not None:
        full = full.chunk(group.size, dim=spec.tp_dim)[group.rank]
    with torch.no_grad():
        param.copy_(full)


# ----------------------------------------------------------------------------------------------
# Layers


def enter_tp_region(x: torch.Tensor, tp: Group, sequence_parallel: bool,
                    saved: SavedShards | None = None) -> torch.Tensor:
    """Make the input of column-parallel linears: all-gather the seq shards (SP) or mark the
    replicated input so its gradient is all-reduced. Called once per block for all its linears.

    With ``saved`` (the model's :class:`SavedShards`, whose hooks are active during its forward),
    what backward keeps of the gathered input is the local shard: the all-gather runs again when
    the weight gradients need the full sequence. A block whose linears all run in FP8 is given a
    ``saved`` with FP8 gathers (:meth:`SavedShards.with_fp8`): the shards are sent as FP8."""
    if not sequence_parallel:
        return copy_to_tp(x, tp)
    if saved is not None and saved.fp8 is not None and tp.size > 1:
        return saved.fp8.gather(x, tp, saved)  # parallel/fp8.py: half the bytes
    full = gather_from_sp(x, tp)
    if saved is not None and tp.size > 1 and torch.is_grad_enabled():
        saved.register(x.detach(), tp, full)
    return full


class _Regather:
    """The local shard behind a sequence-parallel all-gather, gathered again on backward's demand;
    one gather serves every saved view of it (q, k and v, or gate and up, share one input)."""

    def __init__(self, shard: torch.Tensor, group: Group, full: torch.Tensor):
        self.shard, self.group = shard, group
        self.full = weakref.ref(full)
        self.cached: torch.Tensor | None = None
        self.pending = 0  # saved views not unpacked yet

    def unpack(self, shape, stride, offset) -> torch.Tensor:
        if self.cached is None:
            self.cached = self.group.all_gather(self.shard, SEQ_DIM)
        view = self.cached.as_strided(shape, stride, offset)
        self.pending -= 1
        if self.pending <= 0:
            self.cached = None
        return view


def _storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage while it lives: its address, not its data pointer (which is
    0 for every tensor without data: the fake tensors of a simulation would all look alike). Under
    torch.compile the data pointer, which Dynamo traces (the address would break the graph)."""
    storage = t.untyped_storage()
    return storage.data_ptr() if torch.compiler.is_compiling() else storage._cdata


class SavedShards:
    """Saves the column-parallel linears' gathered input as the 1/tp shard it came from
    (Megatron's memory layout for sequence parallelism).

    A model with sequence parallelism owns one: :func:`enter_tp_region` registers each gathered
    input (keyed by its storage, until it is freed), and inside :meth:`hooks` autograd saves any
    tensor viewing a registered storage as (shard, view geometry) instead."""

    def __init__(self):
        self._live: dict[int, _Regather] = {}  # storage of a live gathered input -> its shard
        self.fp8: InputGather | None = None  # a block's FP8 all-gather (see with_fp8)

    def with_fp8(self, gathered: InputGather) -> SavedShards:
        """The same saved shards (one registry), for a block whose column-parallel linears all
        run in FP8: :func:`enter_tp_region` then all-gathers its input as FP8 (``gathered``)."""
        view = SavedShards()
        view._live, view.fp8 = self._live, gathered
        return view

    def register(self, shard: torch.Tensor, group: Group, full: torch.Tensor) -> None:
        key = _storage_key(full)
        self._live[key] = _Regather(shard, group, full)
        weakref.finalize(full, self._live.pop, key, None)

    def hooks(self):
        """Context for the model's forward: autograd's saved-tensor hooks that swap in the
        shards."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        regather = self._live.get(_storage_key(t))
        if regather is None or regather.full() is None:
            return t
        regather.pending += 1
        return regather, t.shape, t.stride(), t.storage_offset()

    @staticmethod
    def _unpack(saved):
        return saved if isinstance(saved, torch.Tensor) else saved[0].unpack(*saved[1:])


# ----------------------------------------------------------------------------------------------
# Split backward: weight gradients deferred to a zero-bubble schedule's W op


class DeferredGrads:
    """The weight gradients of a model's linears, kept back from a backward and computed later.

    A zero-bubble pipeline schedule splits each chunk's backward into B (input gradients: what
    the previous stage waits for) and W (weight gradients: what only the optimizer waits for), and
    runs W in what would be bubble (``parallel/pipeline.py``). Inside :meth:`capture` the linears
    of :func:`defer_weight_grads` queue their weight gradient's operands — the saved input and the
    output gradient — under the micro-batch's key instead of computing it, and the output layer
    its own recipe (``model/fused_loss.py``: the chunks of logits made again from the saved
    input); :meth:`flush` computes them, frees the operands and adds each gradient where the whole
    backward would have put it: into the parameter's fp32 main grad through ``sink`` (the
    data-parallel buffers, which count it towards its bucket's readiness), or into ``.grad``
    where no buffers hold the parameter."""

    def __init__(self, sink=None):
        self.sink = sink
        self._key: tuple | None = None
        self._queued: dict[tuple, list[tuple[nn.Parameter, Callable]]] = {}

    @contextlib.contextmanager
    def capture(self, key: tuple):
        """Context for the input-gradient backward of micro-batch (and chunk) ``key``."""
        if key in self._queued:
            raise RuntimeError(f"weight gradients of {key} are already waiting for their W")
        self._key, self._queued[key] = key, []
        try:
            yield
        finally:
            self._key = None

    def defer(self, weight: nn.Parameter, x: torch.Tensor, grad_out: torch.Tensor) -> bool:
        """Queue d loss / d ``weight`` = ``grad_out``ᵀ ``x`` if a capture is open; False
        otherwise."""
        return self.defer_call(weight, partial(_weight_grad, x, grad_out))

    def defer_call(self, weight: nn.Parameter, make: Callable) -> bool:
        """Queue ``weight``'s gradient as ``make(main)``, if a capture is open (False otherwise):
        ``make`` adds the gradient into ``main`` (the fp32 main grad) and returns None, or, given
        None, returns the gradient."""
        if self._key is None:
            return False
        self._queued[self._key].append((weight, make))
        return True

    def capturing(self) -> bool:
        """Whether a B is running whose weight gradients wait for a W."""
        return self._key is not None

    def pending(self) -> int:
        """Micro-batches whose weight gradients wait for their W."""
        return len(self._queued)

    @torch.no_grad()
    def flush(self, key: tuple) -> None:
        """The W of ``key``: compute its queued weight gradients, in the order their B made them."""
        queue = deque(self._queued.pop(key))
        sink = self.sink() if isinstance(self.sink, weakref.ref) else self.sink
        while queue:
            # the last reference to its operands: freed once it has run
            weight, make = queue.popleft()
            if sink is not None and sink.holds(weight):
                main = sink.main_grad_for(weight)
                grad = make(main)
                if grad is not None:
                    main.add_(grad)
                del make, grad
                sink.grad_added(weight)
                continue
            grad = make(None)
            del make
            if weight.grad is None:
                weight.grad = grad.to(weight.dtype)
            else:
                weight.grad.add_(grad)


def _weight_grad(x: torch.Tensor, grad_out: torch.Tensor,
                 main: torch.Tensor | None) -> torch.Tensor:
    """A linear's weight gradient ``grad_out``ᵀ ``x`` in the operands' dtype, as autograd makes it
    (a wider ``main`` then adds it)."""
    return grad_out.reshape(-1, grad_out.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))  # (out, in)


class _DeferrableLinear(torch.autograd.Function):
    """y = x Wᵀ (+ b) whose backward hands W's gradient to ``deferred`` when it is capturing."""

    @staticmethod
    def forward(ctx, x, weight, bias, deferred):
        ctx.save_for_backward(x, weight)
        ctx.deferred, ctx.param, ctx.has_bias = deferred, weight, bias is not None
        return F.linear(x, weight, bias)  # (..., out)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None  # (..., in)
        grad_w = None
        if ctx.needs_input_grad[1] and not ctx.deferred.defer(ctx.param, x, grad):
            grad_w = _weight_grad(x, grad, None)  # (out, in)
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) \
            if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           deferred: DeferredGrads | None = None) -> torch.Tensor:
    """``F.linear``, whose weight gradient ``deferred`` may keep back for a W op."""
    if deferred is None:
        return F.linear(x, weight, bias)  # (..., out)
    return _DeferrableLinear.apply(x, weight, bias, deferred)  # (..., out)


def overlap_tp_comm(chunks: list[nn.Module], on: bool) -> None:
    """``parallel.tp_comm_overlap``: every column- and row-parallel linear of ``chunks`` runs its
    sequence-parallel all-gather or reduce-scatter in chunks under its GEMM, the transfers on one
    side stream that they share (parallel/tp_overlap.py)."""
    stream = RingStream() if on else None
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.comm_overlap = stream


def defer_weight_grads(chunks: list[nn.Module], deferred: DeferredGrads | None) -> int:
    """Route the weight gradients of every column- and row-parallel linear of ``chunks``, and of
    each chunk's output layer (the chunk's own ``deferred``, which its loss reads), through
    ``deferred`` (None: back to the whole backward); returns how many linears."""
    n = 0
    for chunk in chunks:
        chunk.deferred = deferred
        for module in chunk.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.deferred = deferred
                n += 1
    return n


def fp8_gathered(linear: ColumnParallelLinear | RowParallelLinear) -> bool:
    """Whether ZeRO-3 may all-gather ``linear``'s weight in FP8: its GEMMs are FP8 with one scale
    per weight tensor (the spec's ``fp8_gather``)."""
    return linear.fp8 is not None and linear.fp8.weights is not None


class ColumnParallelLinear(nn.Module):
    """y = x Aᵀ with A's output rows split across tp; the output stays split (no gather).

    ``x`` must already be in the tp region (:func:`enter_tp_region`), so that linears sharing one
    input (q, k, v; gate, up) share one communication.
    """

    def __init__(self, in_features: int, out_features: int, tp: Group, *, init_std: float,
                 vocab_rows: int | None = None, dtype=torch.float32, device=None):
        super().__init__()
        self.tp, self.init_std, self.vocab_rows = tp, init_std, vocab_rows
        self.weight = nn.Parameter(torch.empty(out_features // tp.size, in_features, dtype=dtype,
                                               device=device))
        # a zero-bubble schedule's W computes the weight gradient
        self.deferred: DeferredGrads | None = None
        # parallel.tp_comm_overlap: the sequence-parallel collective in GEMM chunks, sent on this
        # side stream
        self.comm_overlap: RingStream | None = None
        self.bias: nn.Parameter | None = None
        # its GEMMs in FP8 (model/fp8.py sets it), else F.linear
        self.fp8: LinearGEMMs | None = None

    def param_shardings(self) -> dict[str, Sharding]:
        """Output rows split over tp; an output layer's rows are the (padded) vocabulary."""
        return {"weight": Sharding(tp_dim=0, vocab_rows=self.vocab_rows,
                                   fp8_gather=fp8_gathered(self))}

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x Wᵀ: the layer's GEMMs, bf16 (F.linear) or FP8 (``self.fp8``, parallel/fp8.py)."""
        return F.linear(x, self.weight) if self.fp8 is None else self.fp8(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return self.matmul(x)  # (b, s, out/tp)
        return linear(x, self.weight, None, self.deferred)  # (b, s, out/tp)


class RowParallelLinear(nn.Module):
    """y = x Aᵀ with A's input columns split across tp; partial outputs are summed over tp.

    With sequence parallelism the sum is a reduce-scatter that leaves the output seq-sharded.
    """

    def __init__(self, in_features: int, out_features: int, tp: Group, *, init_std: float,
                 sequence_parallel: bool = False, dtype=torch.float32, device=None):
        super().__init__()
        self.tp, self.sequence_parallel, self.init_std = tp, sequence_parallel, init_std
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size, dtype=dtype,
                                               device=device))
        # a zero-bubble schedule's W computes the weight gradient
        self.deferred: DeferredGrads | None = None
        # parallel.tp_comm_overlap: the sequence-parallel collective in GEMM chunks, sent on this
        # side stream
        self.comm_overlap: RingStream | None = None
        self.bias: nn.Parameter | None = None
        # its GEMMs in FP8 (model/fp8.py sets it), else F.linear
        self.fp8: LinearGEMMs | None = None

    def param_shardings(self) -> dict[str, Sharding]:
        # input columns split over tp
        return {"weight": Sharding(tp_dim=1, fp8_gather=fp8_gathered(self))}

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x Wᵀ: the layer's GEMMs, bf16 (F.linear) or FP8 (``self.fp8``, parallel/fp8.py)."""
        return F.linear(x, self.weight) if self.fp8 is None else self.fp8(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (b, s, out)
        y = self.matmul(x) if self.fp8 is not None else linear(x, self.weight, None, self.deferred)
        return reduce_scatter_to_sp(y, self.tp) if self.sequence_parallel \
            else reduce_from_tp(y, self.tp)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split across tp; each rank looks up the ids it owns."""

    def __init__(self, padded_vocab: int, hidden: int, tp: Group, *, init_std: float,
                 real_vocab: int, sequence_parallel: bool = False, dtype=torch.float32,
                 device=None):
        super().__init__()
        self.tp, self.sequence_parallel, self.init_std = tp, sequence_parallel, init_std
        self.real_vocab = real_vocab
        self.rows = padded_vocab // tp.size
        self.vocab_start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden, dtype=dtype, device=device))

    def param_shardings(self) -> dict[str, Sharding]:
        # vocabulary rows split over tp
        return {"weight": Sharding(tp_dim=0, vocab_rows=self.real_vocab)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)  # (b, s, h)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # (b, s, h) partial: only owned ids
        return reduce_scatter_to_sp(out, self.tp) if self.sequence_parallel \
            else reduce_from_tp(out, self.tp)
