"""FP8 linears: the three GEMMs of a linear layer ``y = x Wᵀ`` — the forward, the data gradient
``dx = g W`` and the weight gradient ``dW = gᵀ x`` — in float8 through ``torch._scaled_mm``, with
current scaling (each cast's scale comes from the amax of the tensor it casts, this call), and the
FP8 all-gathers that feed them (sequence parallelism's input gather, ZeRO-3's parameter gather).

The recipes (``model.fp8``) compute what ``torchao.float8``'s recipes of the same name compute:

    recipe      x and W   g = dL/dy   scales
    tensorwise  e4m3      e5m2        one per tensor, fp32: max₈ / amax
    rowwise     e4m3      e4m3        one per row of each GEMM operand, rounded down to a power of
                                      two: forward x per token, W per output row; data gradient g
                                      per token, W per input column; weight gradient g and x per
                                      column (over the tokens)

A cast is ``x₈ = saturate(x · s)`` with ``s = max₈ / amax`` (448 for e4m3, 57344 for e5m2); the
GEMM dequantizes by ``1/s`` of each operand. Power-of-two scales make that exact, so the rowwise
recipe may scale after the GEMM (where a per-row kernel is slow or missing) and get the same bits.

Tensor parallelism splits W (column-parallel: its output rows, and so y's and g's features;
row-parallel: its input columns, and so x's features); context parallelism splits the tokens of
each sequence over cp ranks. Wherever a scale's amax runs over a split dimension it is all-reduced
(max) over that group — tp for features, cp for tokens, both for a whole activation's tensorwise
scale — so every rank casts with the scale one process would use and the run is layout-invariant
(as Megatron-Core reduces its amaxes over tp × cp). Sequence parallelism needs nothing: the
column-parallel input is gathered before its cast, the row-parallel output gradient too.

The GEMM choice is a seam of the linear (``parallel/tensor.py``): ``F.linear`` in bf16, or
:class:`FP8Linear` here, whose :meth:`~FP8Linear.forward`, :meth:`~FP8Linear.grad_input` and
:meth:`~FP8Linear.grad_weight` are separate, so a schedule that defers the weight gradient can call
the last one later.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from .state import Group

if TYPE_CHECKING:
    from .tensor import SavedShards

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)
AMAX_FLOOR = 1e-12  # an all-zero tensor casts with the scale of this amax, not a division by zero
SEQ_DIM = 1  # activations are (batch, seq, hidden)


@dataclass(frozen=True)
class Recipe:
    """How a linear's GEMM operands are cast (``model.fp8``)."""
    name: str
    grad_dtype: torch.dtype  # the output gradient's format (x and W are e4m3 in both recipes)
    rowwise: bool            # a scale per row of each GEMM operand; else one per tensor
    pow2_scales: bool        # scales rounded down to a power of two

    @property
    def gathers_weight(self) -> bool:
        """Whether a ZeRO-3 parameter gather can send the weight in FP8: only with one scale per
        tensor, the same in every GEMM (rowwise scales W per output row forward and per input
        column backward, so its backward needs the bf16 weight)."""
        return not self.rowwise


RECIPES = {"tensorwise": Recipe("tensorwise", E5M2, rowwise=False, pow2_scales=False),
           "rowwise": Recipe("rowwise", E4M3, rowwise=True, pow2_scales=True)}


class Cast(NamedTuple):
    """A tensor in FP8: ``data`` (float8, the source's shape) ≈ source · ``scale`` (fp32, shape ()
    for one scale, or the source's shape with 1 along the dimension the amax ran over)."""
    data: torch.Tensor
    scale: torch.Tensor

    def t(self) -> Cast:
        """The transpose of a 2-D cast (a view: data and per-row scales swap roles)."""
        return Cast(self.data.t(), self.scale.t())


# ----------------------------------------------------------------------------------------------
# Casts and the scaled GEMM


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """fp32 scale(s) mapping ``amax`` onto ``dtype``'s largest value. The division runs in fp64,
    as torchao's does, so eager and compiled code round it alike."""
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=AMAX_FLOOR)).float()
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``saturate(x · scale)`` in ``dtype``: the product in fp32, clamped to the format's range."""
    top = torch.finfo(dtype).max
    return (x.float() * scale).clamp_(-top, top).to(dtype)


def amax(x: torch.Tensor, dim: int | None = None,
         groups: tuple[Group | None, ...] = ()) -> torch.Tensor:
    """max |x| in fp32, over all of ``x`` or along ``dim`` (kept, size 1); ``groups``: all-reduced
    (max) over each one's ranks, which hold other parts of the reduced dimensions (None: none)."""
    found = torch.linalg.vector_norm(x, float("inf"), dim=dim, keepdim=dim is not None).float()
    for group in groups:
        if group is not None and group.size > 1:
            group.all_reduce(found, op=dist.ReduceOp.MAX)
    return found


def cast(x: torch.Tensor, dtype: torch.dtype, *, dim: int | None = None, pow2: bool = False,
         groups: tuple[Group | None, ...] = ()) -> Cast:
    """``x`` in ``dtype`` with current scaling: one scale (``dim`` None) or one per slice along
    ``dim`` (``dim=-1``: per row), from the amax of this ``x`` (all-reduced over ``groups``)."""
    scale = amax_to_scale(amax(x, dim, groups), dtype, pow2)
    return Cast(to_fp8(x, scale, dtype), scale)


def column_major(c: Cast) -> Cast:
    """The same 2-D cast with its data laid out column-major (``_scaled_mm``'s second operand)."""
    return Cast(c.data.t().contiguous().t(), c.scale)


def scaled_mm(a: Cast, b: Cast, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """``a`` (m, k) row-major @ ``b`` (k, n) column-major, dequantized: scales () and (), or
    (m, 1) and (1, n). Per-row scales go to the kernel only for its fast path (bf16 output, fast
    accumulation: the forward); otherwise the GEMM runs unscaled and the power-of-two scales are
    applied to its output, exactly (a per-row kernel without fast accumulation is slow on H100,
    and some have none for other outputs)."""
    inv_a, inv_b = a.scale.reciprocal(), b.scale.reciprocal()
    if a.scale.dim() == 0 or (fast_accum and out_dtype == torch.bfloat16):
        return torch._scaled_mm(a.data, b.data, scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    one = inv_a.new_ones(())
    out = torch._scaled_mm(a.data, b.data, scale_a=one, scale_b=one, out_dtype=out_dtype,
                           use_fast_accum=fast_accum)
    return out.mul_(inv_a).mul_(inv_b)


# ----------------------------------------------------------------------------------------------
# One linear's GEMMs


class Saved(NamedTuple):
    """What a linear's backward reads: the input, as its hp tensor or its FP8 cast (tensorwise
    saves the cast it was given, e.g. a gathered one); the weight (the parameter: no copy); the
    per-tensor scales the forward used (tensorwise), so the backward recasts without another
    all-reduce."""
    x: torch.Tensor              # (m, k) hp input, or the FP8 data of its cast
    x_scale: torch.Tensor | None  # tensorwise: the input's scale
    weight: torch.Tensor         # (n, k)
    w_scale: torch.Tensor | None  # tensorwise: the weight's scale


class FP8Linear:
    """The FP8 GEMMs of one tensor-parallel linear under ``recipe``. ``split``: what tp splits —
    ``"out"`` (column-parallel: W's rows) or ``"in"`` (row-parallel: W's columns). ``inputs``:
    the block's FP8 sequence-parallel gather, whose casts the forward takes instead of casting its
    input again; ``weights``: ZeRO-3's weights gathered in FP8, whose casts replace the weight's;
    ``cp``: the context-parallel group, whose ranks hold the sequence's other tokens."""

    def __init__(self, recipe: Recipe, tp: Group, split: str, *,
                 inputs: GatheredInputs | None = None, weights: WeightCasts | None = None,
                 cp: Group | None = None):
        if split not in ("in", "out"):
            raise ValueError(f"split={split!r}: 'out' (column-parallel) or 'in' (row-parallel)")
        self.recipe, self.tp, self.split, self.cp = recipe, tp, split, cp
        self.inputs, self.weights = inputs, weights

    def _over(self, split: str) -> Group | None:
        """The group an amax over W's ``split`` dimension ("in" or "out") is all-reduced over."""
        return self.tp if self.split == split and self.tp.size > 1 else None

    def _activation(self, split: str) -> tuple[Group | None, ...]:
        """The groups an activation's amax is all-reduced over: tp where its features are W's
        ``split`` dimension, split over tp; and, for a tensorwise scale (over the tokens too),
        cp."""
        return (self._over(split), None if self.recipe.rowwise else self.cp)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ``: (..., k) @ (n, k)ᵀ -> (..., n), in x's dtype."""
        pre = self.inputs.lookup(x) if self.inputs is not None else None
        data, scale = (pre.data, pre.scale) if pre is not None else (None, None)
        return _FP8LinearFunction.apply(x, weight, self, data, scale)

    # -- casts ------------------------------------------------------------------------------------

    def cast_input(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> Cast:
        """x (m, k) for the forward: per token (rowwise) or whole; ``scale``: the one to use."""
        if scale is not None:
            return Cast(to_fp8(x, scale, E4M3), scale)
        r = self.recipe
        return cast(x, E4M3, dim=-1 if r.rowwise else None, pow2=r.pow2_scales,
                    groups=self._activation("in"))

    def cast_weight(self, weight: torch.Tensor, scale: torch.Tensor | None = None) -> Cast:
        """W (n, k) for the forward: per output row (rowwise) or whole (every tp rank's shard:
        all-reduced); ``scale``: the one to use. ZeRO-3's FP8 gather's cast when it has one."""
        # ZeRO-3 gathers it as FP8: the bf16 parameter has no storage now
        if self.weights is not None:
            gathered = self.weights.get(weight)
            if gathered is None:
                raise RuntimeError(f"an FP8 weight {tuple(weight.shape)} was used outside its "
                                   "ZeRO-3 unit's gather (parallel/zero3.py gathers a layer around "
                                   "its forward and backward)")
            return gathered
        if scale is not None:
            return Cast(to_fp8(weight, scale, E4M3), scale)
        # rowwise: per output row, over the input columns; tensorwise: all of this rank's shard
        r = self.recipe
        return cast(weight, E4M3, dim=-1 if r.rowwise else None, pow2=r.pow2_scales,
                    groups=(self._over("in" if r.rowwise else self.split),))

    # -- the three GEMMs ---------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, weight: torch.Tensor,
                pre: Cast | None) -> tuple[torch.Tensor, Saved]:
        """y (m, n) of x (m, k) and W (n, k); ``pre``: x's cast already made (a gathered input)."""
        xc = pre if pre is not None else self.cast_input(x)
        wc = self.cast_weight(weight)
        y = scaled_mm(xc, wc.t(), x.dtype, fast_accum=True)  # (m, n)
        if self.recipe.rowwise:  # the weight gradient casts x per column: it needs x itself
            return y, Saved(x, None, weight, None)
        kept = (xc.data, xc.scale) if pre is not None else (x, xc.scale)
        return y, Saved(*kept, weight, wc.scale)

    def _input_for_grad(self, saved: Saved) -> Cast:
        """x (m, k) as the weight gradient's second operand (column-major)."""
        if self.recipe.rowwise:
            # per column, over tokens
            return column_major(cast(saved.x, E4M3, dim=0, pow2=True, groups=(self.cp,)))
        if saved.x.dtype in FP8_DTYPES:
            return column_major(Cast(saved.x, saved.x_scale))
        return column_major(self.cast_input(saved.x, saved.x_scale))

    def cast_grad(self, g: torch.Tensor) -> Cast:
        """g (m, n) for the data gradient: per token (rowwise) or whole; features split over tp
        for a column-parallel linear."""
        r = self.recipe
        return cast(g, r.grad_dtype, dim=-1 if r.rowwise else None, pow2=r.pow2_scales,
                    groups=self._activation("out"))

    def grad_input(self, g: torch.Tensor, saved: Saved, gc: Cast | None = None) -> torch.Tensor:
        """dx (m, k) = g (m, n) W (n, k); ``gc``: g's cast when the caller has it."""
        gc = gc if gc is not None else self.cast_grad(g)
        if self.recipe.rowwise:  # W per input column: its amax runs over the output rows
            # scale (1, k)
            wc = cast(saved.weight, E4M3, dim=0, pow2=True, groups=(self._over("out"),))
        else:
            wc = self.cast_weight(saved.weight, saved.w_scale)
        return scaled_mm(gc, column_major(wc), g.dtype, fast_accum=False)  # (m, k)

    def grad_weight(self, g: torch.Tensor, saved: Saved, gc: Cast | None = None) -> torch.Tensor:
        """dW (n, k) = gᵀ (n, m) x (m, k); ``gc``: g's per-tensor cast when the caller has it
        (rowwise casts g again, per column)."""
        if self.recipe.rowwise:
            # per column, over the tokens: scale (1, n)
            gc = cast(g, E4M3, dim=0, pow2=True, groups=(self.cp,))
        elif gc is None:
            gc = self.cast_grad(g)
        a = Cast(gc.data.t().contiguous(), gc.scale.t())  # (n, m) row-major
        return scaled_mm(a, self._input_for_grad(saved), g.dtype, fast_accum=False)  # (n, k)


class _FP8LinearFunction(torch.autograd.Function):
    """``x Wᵀ`` through :class:`FP8Linear`'s GEMMs; the backward's data and weight gradients
    are its two separate methods. ``pre_data``/``pre_scale``: a cast of x made before (None)."""

    @staticmethod
    def forward(ctx, x, weight, linear: FP8Linear, pre_data, pre_scale):
        k = x.shape[-1]
        pre = Cast(pre_data.reshape(-1, k), pre_scale.reshape(-1, 1) if pre_scale.dim()
                   else pre_scale) \
            if pre_data is not None else None
        y, saved = linear.forward(x.reshape(-1, k), weight, pre)  # (m, n)
        ctx.linear, ctx.shape = linear, x.shape
        # ZeRO-3's FP8 weights are found by the parameter itself, which a saved tensor is not once
        # saved-tensor hooks (SavedShards) repack it: keep the parameter (its value is not read)
        ctx.weight = weight if linear.weights is not None else None
        if ctx.weight is not None:
            saved = saved._replace(weight=None)
        ctx.has = tuple(t is not None for t in saved)
        ctx.save_for_backward(*(t for t in saved if t is not None))
        return y.view(*x.shape[:-1], y.shape[-1])  # (..., n)

    @staticmethod
    def backward(ctx, grad):
        tensors = iter(ctx.saved_tensors)
        saved = Saved(*(next(tensors) if has else None for has in ctx.has))
        if ctx.weight is not None:
            saved = saved._replace(weight=ctx.weight)
        linear = ctx.linear
        g = grad.reshape(-1, grad.shape[-1])  # (m, n)
        # tensorwise: one cast serves both
        gc = None if linear.recipe.rowwise else linear.cast_grad(g)
        dx = linear.grad_input(g, saved, gc).view(ctx.shape) if ctx.needs_input_grad[0] else None
        dw = linear.grad_weight(g, saved, gc) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None


# ----------------------------------------------------------------------------------------------
# FP8 communication


class _FromGathered(torch.autograd.Function):
    """forward: the dequantized values of an FP8 all-gather of ``x``'s sequence shards (what the
    FP8 linears see of it); backward: reduce-scatter along the sequence, as for a bf16 gather."""

    @staticmethod
    def forward(ctx, x, data, scale, group: Group):
        ctx.group = group
        return (data.float() / scale).to(x.dtype)  # (b, s, h)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.reduce_scatter(grad, SEQ_DIM), None, None, None


class GatheredInputs:
    """Sequence parallelism's all-gather of a block's input (the column-parallel linears' x),
    sent as FP8 and scales: half the bytes of bf16. The block's linears find the cast by their
    input and skip casting it again; the returned tensor holds the dequantized values (for
    autograd, and any other reader).

    tensorwise: the amax of the shard is all-reduced over tp first (one scale for the whole
    sequence, as one process computes it); the backward's weight gradient reads the saved FP8
    input, which :class:`~megapretrain.parallel.tensor.SavedShards` keeps as the FP8 shard and
    gathers again (in FP8). rowwise: per-token scales are local; the backward needs x itself
    (the weight gradient scales it per column), which SavedShards gathers again in bf16."""

    def __init__(self, recipe: Recipe, cp: Group | None = None):
        self.recipe, self.cp = recipe, cp  # cp: the ranks holding the sequence's other tokens
        # storage of a live gathered input -> its cast
        self._casts: dict[int, tuple[weakref.ref, Cast]] = {}

    def gather(self, x: torch.Tensor, tp: Group, saved: SavedShards | None) -> torch.Tensor:
        """The full-sequence (b, s, h) input from this rank's (b, s/tp, h) shard."""
        r = self.recipe
        shard = cast(x.detach(), E4M3, dim=-1 if r.rowwise else None, pow2=r.pow2_scales,
                     groups=() if r.rowwise else (tp, self.cp))
        data = tp.all_gather(shard.data, SEQ_DIM)  # (b, s, h) float8
        scale = tp.all_gather(shard.scale, SEQ_DIM) if r.rowwise else shard.scale  # (b, s, 1) or ()
        full = _FromGathered.apply(x, data, scale, tp)
        self._register(full, Cast(data, scale))
        # backward keeps shards (SavedShards) of what it reads
        if saved is not None and torch.is_grad_enabled():
            if r.rowwise:
                saved.register(x.detach(), tp, full)
            else:
                saved.register(shard.data, tp, data)
        return full

    def _register(self, full: torch.Tensor, c: Cast) -> None:
        ptr = full.untyped_storage().data_ptr()
        self._casts[ptr] = (weakref.ref(full), c)
        weakref.finalize(full, self._casts.pop, ptr, None)

    def lookup(self, x: torch.Tensor) -> Cast | None:
        """The cast of ``x`` if ``x`` is an input this gathered (not a view of one)."""
        found = self._casts.get(x.untyped_storage().data_ptr())
        if found is None or found[0]() is None:
            return None
        full = found[0]()
        return found[1] if x.shape == full.shape and x.stride() == full.stride() and \
            x.storage_offset() == full.storage_offset() else None


class WeightCasts:
    """ZeRO-3's weights gathered in FP8 (tensorwise): each parameter's cast, from its unit's
    gather until its free (``parallel/data.py`` writes them; :class:`FP8Linear` reads them)."""

    def __init__(self):
        self._casts: dict[int, Cast] = {}

    def put(self, weight: torch.Tensor, c: Cast) -> None:
        self._casts[id(weight)] = c

    def drop(self, weight: torch.Tensor) -> None:
        self._casts.pop(id(weight), None)

    def get(self, weight: torch.Tensor) -> Cast | None:
        return self._casts.get(id(weight))


def cast_fragments(shard: torch.Tensor, fragments: list[tuple[int, int, int]],
                   amaxes: torch.Tensor) -> torch.Tensor:
    """A ZeRO-3 bucket's shard (flat, hp) in e4m3, each parameter's elements with its scale from
    its global ``amaxes`` (fp32, one per parameter); ``fragments``: (parameter index, offset in
    the shard, length). Elements of no parameter (padding) are zero."""
    out = torch.zeros(shard.numel(), dtype=E4M3, device=shard.device)
    scales = amax_to_scale(amaxes, E4M3, pow2=False)
    for i, off, n in fragments:
        out[off:off + n] = to_fp8(shard[off:off + n], scales[i], E4M3)
    return out


def fragment_amaxes(shard: torch.Tensor, fragments: list[tuple[int, int, int]],
                    count: int) -> torch.Tensor:
    """max |x| (fp32) of each of ``count`` parameters over its elements in ``shard`` (0 where it
    has none here), to be all-reduced (max) over the ranks holding the other shards."""
    out = torch.zeros(count, dtype=torch.float32, device=shard.device)
    for i, off, n in fragments:
        if n:
            out[i] = amax(shard[off:off + n])
    return out
