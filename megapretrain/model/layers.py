"""The decoder's layers, shared by the model families: norms, rotary embeddings, attention, MLPs
and the decoder block, all tensor-parallel (column/row-parallel linears from
``parallel/tensor.py``), sequence-parallel aware and context-parallel aware.

A family chooses among them with a :class:`LayerSpec` (model/llama.py, model/gpt_neox.py): which
norm, which MLP, which biases, QK-norm, a fused QKV projection, the residual form. Every layer
declares its parameters' layout and initialization (``param_shardings``, ``parallel/specs.py``),
so nothing downstream tells a norm from a linear by its type.

The Triton kernels (kernels/) serve RMSNorm, RoPE and SwiGLU when ``kernels="triton"``; LayerNorm
and GELU are torch's ops on every device.

Shapes in comments: b batch, s sequence (this rank's s/cp tokens under context parallelism, and
s/tp of them when sequence-parallel), h hidden, n heads, k kv heads, d head size, r rotated dims,
f FFN width; "/tp" marks a dimension split across tensor-parallel ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..kernels.rmsnorm import rms_norm
from ..kernels.rope import rope
from ..kernels.swiglu import swiglu
from ..parallel.context import gather_kv_from_cp, heads_from_cp, heads_to_cp, query_chunks
from ..parallel.random import RNGTracker
from ..parallel.specs import ONES, ZEROS, Init, Sharding
from ..parallel.state import Group
from ..parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    SavedShards,
    VocabParallelEmbedding,
    enter_tp_region,
    fp8_gathered,
    linear,
    reduce_from_tp,
    reduce_scatter_to_sp,
)
from ..parallel.tp_overlap import gather_column_linears, row_linear_reduce_scatter
from .args import ModelArgs
from .attention import PreparedMask, causal_attention

# model.kernels once resolved (model/build.py): today's torch ops, or kernels/
KERNELS = ("torch", "triton")


@dataclass(frozen=True)
class LayerSpec:
    """A family's choice of parts for its decoder layers (Megatron-Core's layer submodules, as
    data)."""
    norm: type[nn.Module]          # RMSNorm | LayerNorm (the final norm too)
    mlp: type[nn.Module]           # SwiGLU | GeluMLP
    qkv_bias: bool = False         # biases on the query, key and value projections
    dense_bias: bool = False       # biases on the attention output and on the MLP's linears
    qk_norm: bool = False          # RMSNorm over each head's q and k before RoPE (Qwen3)
    fused_qkv: bool = False        # one projection, rows grouped per kv head: [q·n/k, k, v]
    #                                (GPT-NeoX)
    parallel_residual: bool = False  # x + attn(ln1(x)) + mlp(ln2(x)) (GPT-NeoX)
    full_qk_norm: bool = False     # RMSNorm over the whole q and k projections, before RoPE: its
    #                                statistics span the tp ranks' heads (OLMo 2/3)
    post_norm: bool = False        # x + norm(attn(x)), then x + norm(mlp(x)): no input norms
    #                                (OLMo 2/3)


# -- linears with biases, embedding: the parallel layers with their initialization declared --------


class ColumnLinear(ColumnParallelLinear):
    """:class:`ColumnParallelLinear` with an optional bias, split over tp with the output rows."""

    def __init__(self, in_features: int, out_features: int, tp: Group, *, init_std: float,
                 bias: bool = False, vocab_rows: int | None = None, dtype=torch.float32,
                 device=None, row_parts: tuple[int, ...] | None = None):
        super().__init__(in_features, out_features, tp, init_std=init_std, vocab_rows=vocab_rows,
                         dtype=dtype, device=device)
        self.row_parts = row_parts  # a fused weight's logical matrices (parallel/specs.py)
        self.bias = nn.Parameter(torch.empty(out_features // tp.size, dtype=dtype, device=device)) \
            if bias else None

    def param_shardings(self) -> dict[str, Sharding]:
        out = {"weight": Sharding(tp_dim=0, vocab_rows=self.vocab_rows,
                                  init=Init.normal(self.init_std), fp8_gather=fp8_gathered(self),
                                  row_parts=self.row_parts)}
        if self.bias is not None:
            out["bias"] = Sharding(tp_dim=0, weight_decay=False, init=ZEROS)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is None:
            return linear(x, self.weight, self.bias, self.deferred)  # (b, s, out/tp)
        y = self.matmul(x)  # (b, s, out/tp)
        return y if self.bias is None else y + self.bias


class RowLinear(RowParallelLinear):
    """:class:`RowParallelLinear` with an optional bias, replicated and added once, after the sum
    over tp. Under sequence parallelism each rank adds it to its own positions, so its gradient is
    a partial sum over tp."""

    def __init__(self, in_features: int, out_features: int, tp: Group, *, init_std: float,
                 bias: bool = False, sequence_parallel: bool = False, dtype=torch.float32,
                 device=None):
        super().__init__(in_features, out_features, tp, init_std=init_std,
                         sequence_parallel=sequence_parallel, dtype=dtype, device=device)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias \
            else None

    def param_shardings(self) -> dict[str, Sharding]:
        # input columns split over tp
        out = {"weight": Sharding(tp_dim=1, init=Init.normal(self.init_std),
                                  fp8_gather=fp8_gathered(self))}
        if self.bias is not None:
            out["bias"] = Sharding(weight_decay=False, partial_grad_over_tp=self.sequence_parallel,
                                   init=ZEROS)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:  # FP8 GEMMs: the collective after the whole GEMM
            y = self.matmul(x)  # (b, s, out) partial sums
            y = reduce_scatter_to_sp(y, self.tp) if self.sequence_parallel \
                else reduce_from_tp(y, self.tp)
        # the reduce-scatter under the GEMM's chunks
        elif self.sequence_parallel and self.comm_overlap:
            # (b, s/tp, out)
            y = row_linear_reduce_scatter(x, self.weight, self.tp, self.comm_overlap, self.deferred)
        else:
            y = linear(x, self.weight, None, self.deferred)  # (b, s, out) partial sums
            y = reduce_scatter_to_sp(y, self.tp) if self.sequence_parallel \
                else reduce_from_tp(y, self.tp)
        return y if self.bias is None else y + self.bias


class Embedding(VocabParallelEmbedding):
    """:class:`VocabParallelEmbedding` declaring its normal(init_std) initialization."""

    def param_shardings(self) -> dict[str, Sharding]:
        return {"weight": Sharding(tp_dim=0, vocab_rows=self.real_vocab,
                                   init=Init.normal(self.init_std))}


def column_outputs(x: torch.Tensor, linears: list[ColumnParallelLinear], tp: Group,
                   sequence_parallel: bool, saved: SavedShards | None) -> list[torch.Tensor]:
    """The outputs (b, s, outᵢ/tp) of the column-parallel ``linears`` sharing the block's input
    ``x``: entering the tp region once (the sequence-parallel all-gather) and then each GEMM, or
    under ``parallel.tp_comm_overlap`` the gather in ring steps under the GEMMs
    (parallel/tp_overlap.py)."""
    if sequence_parallel and tp.size > 1 and linears[0].comm_overlap and linears[0].fp8 is None:
        return gather_column_linears(x, linears, tp, linears[0].comm_overlap, linears[0].deferred)
    x = enter_tp_region(x, tp, sequence_parallel, saved)  # (b, s, h): the full sequence
    return [m(x) for m in linears]


# -- norms -----------------------------------------------------------------------------------------


class _RMSNormFunction(torch.autograd.Function):
    """y = weight · x / rms(x), computed on an fp32 copy of x. Written out (rather than left to
    autograd) so that it saves only ``x`` and 1/rms, not four activation-sized temporaries, and
    converts each tensor between bf16 and fp32 once (mixed-dtype elementwise ops are slow on
    CPU)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, weight_in_fp32: bool = False):
        xf = x.to(torch.promote_types(x.dtype, torch.float32), copy=True)  # (..., h) fp32
        mean_sq = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().div_(x.shape[-1])
        rstd = mean_sq.add_(eps).rsqrt_()  # (..., 1) fp32
        ctx.save_for_backward(x, weight, rstd)
        if weight_in_fp32:  # scaled in fp32, then rounded once (HF's OLMo 2/3)
            return xf.mul_(rstd).mul_(weight).to(torch.promote_types(x.dtype, weight.dtype))
        # rounded to x's dtype, then scaled (as HF's Llama does)
        return xf.mul_(rstd).to(x.dtype).mul_(weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.to(rstd.dtype, copy=True).mul_(rstd)  # (..., h) fp32
        g = grad.to(rstd.dtype, copy=True)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (g * x_hat).flatten(0, -2).sum(0).to(weight.dtype)  # (h,)
        g.mul_(weight.to(rstd.dtype))  # d loss / d x_hat
        # d x_hat / d x = rstd · (I - x_hat x_hatᵀ / h)
        dot = torch.linalg.vecdot(g, x_hat).unsqueeze(-1).div_(x.shape[-1])
        return g.sub_(x_hat.mul_(dot)).mul_(rstd).to(x.dtype), grad_weight, None, None


class RMSNorm(nn.Module):
    """x / rms(x) · weight, computed in fp32 whatever the input dtype, x / rms(x) rounded to the
    input's dtype before the weight multiplies it (HF's Llama order). ``partial_grad``: each tp
    rank normalizes other rows (other positions under sequence parallelism, other heads for
    QK-norm), so the weight's grads are partial sums over tp."""

    weight_in_fp32 = False  # the product x / rms(x) · weight taken in fp32, rounded once after

    def __init__(self, hidden: int, eps: float, *, partial_grad: bool = False,
                 kernels: str = "torch", dtype=torch.float32, device=None):
        super().__init__()
        self.eps, self.partial_grad, self.kernels = eps, partial_grad, kernels
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))

    def param_shardings(self) -> dict[str, Sharding]:
        return {"weight": Sharding(weight_decay=False, partial_grad_over_tp=self.partial_grad,
                                   init=ONES)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels == "triton":  # one kernel each way (kernels/rmsnorm.py)
            return rms_norm(x, self.weight, self.eps, self.weight_in_fp32)
        return _RMSNormFunction.apply(x, self.weight, self.eps, self.weight_in_fp32)


class WeightFirstRMSNorm(RMSNorm):
    """:class:`RMSNorm` with the weight multiplying x / rms(x) in fp32 before one rounding to the
    output dtype (HF's Olmo2RMSNorm / Olmo3RMSNorm order; in bf16 it differs from Llama's)."""

    weight_in_fp32 = True


class LayerNorm(nn.Module):
    """(x - mean) / std · weight + bias (GPT-NeoX), torch's op (no Triton kernel: the same on every
    device). Grads partial over tp under sequence parallelism, as for :class:`RMSNorm`."""

    def __init__(self, hidden: int, eps: float, *, partial_grad: bool = False,
                 kernels: str = "torch", dtype=torch.float32, device=None):
        super().__init__()
        self.eps, self.partial_grad = eps, partial_grad
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden, dtype=dtype, device=device))

    def param_shardings(self) -> dict[str, Sharding]:
        kw = dict(weight_decay=False, partial_grad_over_tp=self.partial_grad)
        return {"weight": Sharding(init=ONES, **kw), "bias": Sharding(init=ZEROS, **kw)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class _SumOverTP(torch.autograd.Function):
    """Every tp rank's ``x`` summed, on every rank, where each rank then uses the sum for its own
    shard (not a replicated computation, unlike ``reduce_from_tp``): the backward sums the ranks'
    gradients as well."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return group.all_reduce(x.clone())

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_reduce(grad.clone()), None


class SpanningRMSNorm(nn.Module):
    """RMSNorm over a vector whose ``width`` entries are split over the tp ranks (OLMo's QK-norm
    over a whole q or k projection, of which each rank holds its heads' columns): the sum of
    squares is summed over tp (an all-reduce forward and backward), the weight is split over tp
    with the entries. With one tp rank, :class:`WeightFirstRMSNorm`'s computation: the weight
    multiplies in fp32, one rounding after (HF's OLMo order)."""

    def __init__(self, width: int, eps: float, tp: Group, *, kernels: str = "torch",
                 dtype=torch.float32, device=None):
        super().__init__()
        self.eps, self.tp, self.kernels, self.width = eps, tp, kernels, width
        self.weight = nn.Parameter(torch.ones(width // tp.size, dtype=dtype, device=device))

    def param_shardings(self) -> dict[str, Sharding]:
        return {"weight": Sharding(tp_dim=0, weight_decay=False, init=ONES)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            if self.kernels == "triton":
                return rms_norm(x, self.weight, self.eps, True)
            return _RMSNormFunction.apply(x, self.weight, self.eps, True)
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # (..., width/tp)
        sum_sq = _SumOverTP.apply(xf.square().sum(-1, keepdim=True), self.tp)  # (..., 1)
        rstd = torch.rsqrt(sum_sq / self.width + self.eps)
        return (xf * rstd * self.weight).to(torch.promote_types(x.dtype, self.weight.dtype))


# -- rotary embeddings -----------------------------------------------------------------------------


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_max_position_embeddings: int,
                    **_) -> torch.Tensor:
    """Llama 3.1's rotary scaling, as transformers computes it: wavelengths longer than the original
    context / low_freq_factor are stretched by ``factor``, shorter than context / high_freq_factor
    kept, and those in between interpolated smoothly."""
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor
                                                                               - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1·mscale·ln(factor) + 1 (1 without stretching)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(inv_freq: torch.Tensor, theta: float, rotary_dim: int, factor: float,
                  original_max_position_embeddings: int, beta_fast: float | None = None,
                  beta_slow: float | None = None, attention_factor: float | None = None,
                  mscale: float | None = None, mscale_all_dim: float | None = None,
                  **_) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071), as transformers computes it: frequencies that turn fewer than
    ``beta_slow`` times over the original context are divided by ``factor`` (interpolated), those
    turning more than ``beta_fast`` times kept (extrapolated), a linear ramp between them over
    the dims (bounds floored and ceiled); and the factor that scales cos and sin (the attention
    temperature), given or from ``factor`` and ``mscale``."""
    if attention_factor is None:
        attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim) \
            if mscale and mscale_all_dim else _yarn_mscale(factor)

    def dim_of(rotations: float) -> float:  # the dim whose frequency turns that often
        return rotary_dim * math.log(original_max_position_embeddings /
                                     (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_of(beta_fast or 32)), 0)
    high = min(math.ceil(dim_of(beta_slow or 1)), rotary_dim - 1)
    high = high + 0.001 if low == high else high  # no zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp  # (r/2,) the share of each frequency kept as it is
    inv_freq = inv_freq / factor * (1 - extrapolated) + inv_freq * extrapolated
    return inv_freq, float(attention_factor)


def rope_tables(seq: int, rotary_dim: int, theta: float, device, dtype,
                scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (s, r) for positions 0..seq-1 (the rotate-half layout) over the
    ``rotary_dim`` = r rotated dims of a head (all d of them but for partial rotary); ``scaling``:
    ``model.rope_scaling`` (rope_type llama3 or yarn, or none)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2,
                                             dtype=torch.int64).float() / rotary_dim))
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    factors = {k: v for k, v in (scaling or {}).items() if k not in ("rope_type", "type")}
    attention_factor = 1.0
    if kind == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, **factors)
    elif kind == "yarn":
        inv_freq, attention_factor = yarn_inv_freq(inv_freq, theta, rotary_dim, **factors)
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)  # (s, r/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (s, r)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:  # YaRN: q·k scaled by its square, through both rotations
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


class _RoPEFunction(torch.autograd.Function):
    """x·cos + rotate_half(x)·sin with rotate_half(x) = (-x2, x1), as three fused multiply-adds
    (no rotated copy of x, and nothing saved but the tables)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        half = x.shape[-1] // 2
        ctx.save_for_backward(cos, sin)
        y = x * cos
        y[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1.0)  # y1 = x1 c1 - x2 s1
        y[..., half:].addcmul_(x[..., :half], sin[..., half:])  # y2 = x2 c2 + x1 s2
        return y

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        half = grad.shape[-1] // 2
        dx = grad * cos
        dx[..., :half].addcmul_(grad[..., half:], sin[..., half:])  # dx1 = g1 c1 + g2 s2
        # dx2 = g2 c2 - g1 s1
        dx[..., half:].addcmul_(grad[..., :half], sin[..., :half], value=-1.0)
        return dx, None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kernels: str = "torch") -> torch.Tensor:
    """Rotate (b, n, s, d) query/key vectors by their position's angle; cos, sin: (s, r), or
    (b, 1, s, r) when each token has its own position (document masking). With r < d (partial
    rotary, GPT-NeoX) the first r dims of each head turn and the rest pass through.
    ``kernels="triton"``: the kernel of kernels/rope.py, for (s, r) tables (per-token tables take
    the torch ops)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        # (b, n, s, d)
        return torch.cat([apply_rope(x[..., :r], cos, sin, kernels), x[..., r:]], dim=-1)
    if kernels == "triton" and cos.dim() == 2:
        return rope(x, cos, sin)
    return _RoPEFunction.apply(x, cos, sin)


# -- attention -------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Grouped-query attention: q, k, v projections (or one fused projection), optional QK-norm,
    RoPE on the first r dims of each head, the output projection. Heads are split over tp; under
    context parallelism (``parallel/context.py``, ``cp_comm``) the keys and values are all-gathered
    over cp, or passed around the cp ranks (ring: the micro-batch's prepared mask is a
    ``RingMask``, ``model/context_attention.py``), or heads and sequence are swapped by
    all-to-alls (a2a). Causal attention runs ``model/attention.py``'s :func:`causal_attention`;
    under document masking the kernel the micro-batch's prepared mask stands for
    (``model/attention.py``: flex, blockwise or sdpa), with the kv heads unexpanded either way."""

    def __init__(self, args: ModelArgs, spec: LayerSpec, tp: Group, *, sequence_parallel: bool,
                 selective_recompute: bool, rng: RNGTracker, saved: SavedShards | None,
                 kernels: str = "torch", cp: Group | None = None, cp_comm: str = "allgather", dtype,
                 device):
        super().__init__()
        self.rng, self.saved, self.kernels = rng, saved, kernels
        self.cp = cp if cp is not None else Group("cp", [0])
        self.cp_comm = cp_comm if self.cp.size > 1 else "allgather"  # one rank: nothing to exchange
        d, out_std = args.head_dim, args.init_std / math.sqrt(2 * args.num_layers)
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.selective_recompute = selective_recompute
        self.n_local, self.k_local, self.d = \
            args.num_heads // tp.size, args.num_kv_heads // tp.size, d
        self.dropout = args.attention_dropout
        self.fused = spec.fused_qkv
        kw = dict(dtype=dtype, device=device)
        h, n, k = args.hidden_size, args.num_heads, args.num_kv_heads
        lin = dict(init_std=args.init_std, bias=spec.qkv_bias, **kw)
        # rows per kv head: its n/k queries, its key, its value (tp splits whole groups)
        if self.fused:
            self.qkv_proj = ColumnLinear(h, (n + 2 * k) * d, tp, row_parts=(n // k * d, d, d),
                                         **lin)
        else:
            self.q_proj = ColumnLinear(h, n * d, tp, **lin)
            self.k_proj = ColumnLinear(h, k * d, tp, **lin)
            self.v_proj = ColumnLinear(h, k * d, tp, **lin)
        self.o_proj = RowLinear(n * d, h, tp, init_std=out_std, bias=spec.dense_bias,
                                sequence_parallel=sequence_parallel, **kw)
        if spec.qk_norm:  # one weight for every head, and tp ranks hold other heads: partial grads
            norm = dict(partial_grad=tp.size > 1, kernels=kernels, **kw)
            self.q_norm, self.k_norm = RMSNorm(d, args.norm_eps, **norm), RMSNorm(d, args.norm_eps,
                                                                                  **norm)
        elif spec.full_qk_norm:  # over all n·d (k·d) dims, split over tp with the heads
            norm = dict(kernels=kernels, **kw)
            self.q_norm = SpanningRMSNorm(n * d, args.norm_eps, tp, **norm)
            self.k_norm = SpanningRMSNorm(k * d, args.norm_eps, tp, **norm)
        else:
            self.q_norm = self.k_norm = None
        self.full_qk_norm = spec.full_qk_norm

    def _core(self, q, k, v, mask=None):
        dropout = self.dropout if self.training else 0.0
        # no random numbers drawn: no stream to fork (and no graph break under compile)
        if not dropout:
            return self._attend(q, k, v, mask, 0.0)
        with self.rng.fork():  # heads differ per tp (and cp) rank, so must their dropout masks
            return self._attend(q, k, v, mask, dropout)

    def _attend(self, q, k, v, mask, dropout: float):
        """Scaled dot-product attention of this rank's queries: under the document ``mask`` when
        given (its own kernel: ``model/attention.py``), else causal — over the whole sequence, or
        under context parallelism chunk by chunk, each of the rank's two query chunks against the
        keys up to its end (``parallel/context.py``)."""
        if mask is not None:
            return mask.attend(q, k, v, dropout)  # (b, n/tp, s, d)
        if self.cp.size == 1 or self.cp_comm == "a2a":  # the whole sequence, in order
            return causal_attention(q, k, v, dropout)
        out = [causal_attention(q[:, :, rows], k[:, :, :keys], v[:, :, :keys], dropout)
               for rows, keys in query_chunks(q.shape[2], self.cp)]  # (b, n/tp, s/2, d) each
        return torch.cat(out, dim=2)  # (b, n/tp, s, d)

    def _project(self, x: torch.Tensor):
        """q (b, s, n/tp, d), k and v (b, s, k/tp, d) of the block's input x (b, s, h), or its
        sequence shard (b, s/tp, h) under sequence parallelism (gathered here)."""
        if not self.fused:
            q, k, v = column_outputs(x, [self.q_proj, self.k_proj, self.v_proj], self.tp,
                                     self.sequence_parallel,
                                     self.saved)  # (b, s, n/tp·d), (b, s, k/tp·d) × 2
            b, s, _ = q.shape
            return (q.view(b, s, self.n_local, self.d), k.view(b, s, self.k_local, self.d),
                    v.view(b, s, self.k_local, self.d))
        (qkv,) = column_outputs(x, [self.qkv_proj], self.tp, self.sequence_parallel, self.saved)
        b, s, _ = qkv.shape
        group = self.n_local // self.k_local
        qkv = qkv.view(b, s, self.k_local, (group + 2) * self.d)  # (b, s, k/tp, (n/k + 2)·d)
        q, k, v = qkv.split([group * self.d, self.d, self.d], dim=-1)
        return q.reshape(b, s, self.n_local, self.d), k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: PreparedMask | None = None) -> torch.Tensor:
        """``mask``: the micro-batch's document mask, prepared for the model's attention kernel
        (``DocumentMask.prepare``), or None for plain causal."""
        q, k, v = self._project(x)  # (b, s, n/tp, d), (b, s, k/tp, d) × 2: the full sequence
        b, s = q.shape[:2]
        if self.full_qk_norm:  # over the whole projection, before RoPE (OLMo 2/3)
            q, k = self.q_norm(q.flatten(2)).view_as(q), self.k_norm(k.flatten(2)).view_as(k)
        elif self.q_norm is not None:  # over each head's d dims, before RoPE (Qwen3)
            q, k = self.q_norm(q), self.k_norm(k)
        # (b, n/tp, s, d), (b, k/tp, s, d)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin, self.kernels), apply_rope(k, cos, sin, self.kernels)
        if self.cp_comm == "ring":
            # the ring's own function saves only q, k, v, the output and the log-sum-exp, which is
            # what selective recomputation would keep: nothing to recompute
            y = mask.attend(q, k, v, 0.0)  # (b, n/tp, s, d): mask is the micro-batch's RingMask
        else:
            # (b, n/(tp·cp), s·cp, d), (b, k/(tp·cp), s·cp, d): the whole sequence
            if self.cp_comm == "a2a":
                q, k, v = heads_from_cp(q, k, v, self.cp)
            else:  # (b, k/tp, s·cp, d): every cp rank's keys, in global order
                k, v = gather_kv_from_cp(k, v, self.cp)
            y = self._attention(q, k, v, mask)
            y = heads_to_cp(y, self.cp) if self.cp_comm == "a2a" else y  # (b, n/tp, s, d)
        y = y.transpose(1, 2).reshape(b, s, self.n_local * self.d)  # (b, s, n·d/tp)
        return self.o_proj(y)  # (b, s, h), or (b, s/tp, h) with SP

    def _attention(self, q, k, v, mask):
        """The attention core, checkpointed under selective recomputation."""
        if self.selective_recompute and self.training:
            # no dropout: no random stream to restore, and no context_fn argument at all
            # (torch.compile traces a checkpoint only without one, even the no-op)
            context = dict(context_fn=self.rng.checkpoint_context) if self.dropout else {}
            return checkpoint(self._core, q, k, v, mask, use_reentrant=False, **context)
        return self._core(q, k, v, mask)  # (b, n/tp, s, d)


# -- MLPs ------------------------------------------------------------------------------------------


class SwiGLU(nn.Module):
    """down(silu(gate(x)) · up(x)) (Llama)."""

    def __init__(self, args: ModelArgs, tp: Group, *, bias: bool = False, sequence_parallel: bool,
                 saved: SavedShards | None, kernels: str = "torch", dtype, device):
        super().__init__()
        out_std = args.init_std / math.sqrt(2 * args.num_layers)
        self.tp, self.sequence_parallel, self.saved, self.kernels = \
            tp, sequence_parallel, saved, kernels
        kw = dict(bias=bias, dtype=dtype, device=device)
        h, f = args.hidden_size, args.ffn_hidden_size
        self.gate_proj = ColumnLinear(h, f, tp, init_std=args.init_std, **kw)
        self.up_proj = ColumnLinear(h, f, tp, init_std=args.init_std, **kw)
        self.down_proj = RowLinear(f, h, tp, init_std=out_std, sequence_parallel=sequence_parallel,
                                   **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = column_outputs(x, [self.gate_proj, self.up_proj], self.tp,
                                  self.sequence_parallel,
                                  self.saved)  # (b, s, f/tp) each
        # kernels/swiglu.py
        act = swiglu(gate, up) if self.kernels == "triton" else F.silu(gate) * up
        return self.down_proj(act)  # (b, s, h)


class GeluMLP(nn.Module):
    """down(gelu(up(x))) with exact (erf) GELU: GPT-NeoX's dense_h_to_4h → gelu → dense_4h_to_h,
    GPT-3's MLP. torch's GELU on every device (no Triton kernel)."""

    def __init__(self, args: ModelArgs, tp: Group, *, bias: bool = False, sequence_parallel: bool,
                 saved: SavedShards | None, kernels: str = "torch", dtype, device):
        super().__init__()
        out_std = args.init_std / math.sqrt(2 * args.num_layers)
        self.tp, self.sequence_parallel, self.saved = tp, sequence_parallel, saved
        kw = dict(bias=bias, dtype=dtype, device=device)
        h, f = args.hidden_size, args.ffn_hidden_size
        self.up_proj = ColumnLinear(h, f, tp, init_std=args.init_std, **kw)
        self.down_proj = RowLinear(f, h, tp, init_std=out_std, sequence_parallel=sequence_parallel,
                                   **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (b, s, f/tp)
        (up,) = column_outputs(x, [self.up_proj], self.tp, self.sequence_parallel, self.saved)
        return self.down_proj(F.gelu(up))  # (b, s, h)


# -- the decoder block -----------------------------------------------------------------------------


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream one after the other, or both
    from the same input (``spec.parallel_residual``, GPT-NeoX), or post-norm (``spec.post_norm``,
    OLMo 2/3: each sublayer's output normalized before it is added, no input norms). ``window``:
    the layer's sliding window (0: full attention), which picks the micro-batch's mask the model
    hands it; ``rope``: its rotary settings (``ModelArgs.rope``), which pick its cos and sin
    tables."""

    def __init__(self, args: ModelArgs, spec: LayerSpec, tp: Group, *, sequence_parallel: bool,
                 recompute: str, rng: RNGTracker, saved: SavedShards | None, kernels: str = "torch",
                 cp: Group | None = None, cp_comm: str = "allgather", window: int = 0,
                 rope: tuple | None = None, dtype, device):
        super().__init__()
        self.window = window
        self.rope = rope if rope is not None else (args.rope_theta, args.rope_scaling)
        kw = dict(kernels=kernels, dtype=dtype, device=device)
        self.rng, self.sequence_parallel = rng, sequence_parallel
        self.parallel_residual, self.post_norm = spec.parallel_residual, spec.post_norm
        norm = dict(partial_grad=sequence_parallel, **kw)
        if not self.post_norm:
            self.input_layernorm = spec.norm(args.hidden_size, args.norm_eps, **norm)
        self.self_attn = Attention(args, spec, tp, sequence_parallel=sequence_parallel,
                                   selective_recompute=recompute == "selective", rng=rng,
                                   saved=saved, cp=cp, cp_comm=cp_comm, **kw)
        self.post_attention_layernorm = spec.norm(args.hidden_size, args.norm_eps, **norm)
        self.mlp = spec.mlp(args, tp, bias=spec.dense_bias, sequence_parallel=sequence_parallel,
                            saved=saved, **kw)
        if self.post_norm:
            self.post_feedforward_layernorm = spec.norm(args.hidden_size, args.norm_eps, **norm)
        self.dropout = args.hidden_dropout

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """Residual-branch dropout: the residual is replicated over tp (same mask everywhere: the
        default stream) unless sequence-parallel, where each rank holds other positions."""
        if not (self.training and self.dropout):
            return x
        if self.sequence_parallel:
            with self.rng.fork():
                return F.dropout(x, self.dropout, True)
        return F.dropout(x, self.dropout, True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: PreparedMask | None = None) -> torch.Tensor:
        if self.post_norm:
            x = x + self._dropout(self.post_attention_layernorm(self.self_attn(x, cos, sin, mask)))
            return x + self._dropout(self.post_feedforward_layernorm(self.mlp(x)))
        attn = self._dropout(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        if self.parallel_residual:
            return x + attn + self._dropout(self.mlp(self.post_attention_layernorm(x)))
        x = x + attn
        return x + self._dropout(self.mlp(self.post_attention_layernorm(x)))
