"""A Llama-style decoder built from tensor-parallel layers.

RMSNorm, rotary embeddings (rotate-half, as Hugging Face's Llama, so export needs no permutation),
grouped-query attention through ``scaled_dot_product_attention``, SwiGLU MLP, optional tied
embeddings. Parameter names follow Hugging Face's ``LlamaForCausalLM`` (without its ``model.``
prefix), and layers are keyed by their *global* index, so a pipeline stage holding layers 4..7
names them ``layers.4`` ... ``layers.7`` — names, and so initial values, are layout-invariant.

Under context parallelism (``cp``) a chunk holds its rank's share of every sequence
(``parallel/context.py``): attention all-gathers the keys and values over cp and masks by global
position; everything else is local to the rank's tokens.

Shapes in comments: b batch, s sequence (this rank's s/cp tokens under context parallelism, and
s/tp of them when sequence-parallel), h hidden, n heads, k kv heads, d head size, v vocabulary;
"/tp" marks a dimension split across tensor-parallel ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from torch.utils.checkpoint import checkpoint

from ..kernels.rmsnorm import rms_norm
from ..kernels.rope import rope
from ..kernels.swiglu import swiglu
from ..parallel.context import causal_mask, gather_kv_from_cp, local_positions, query_chunks
from ..parallel.cross_entropy import vocab_parallel_linear_cross_entropy
from ..parallel.random import RNGTracker
from ..parallel.specs import ParamSpec, Sharding, collect_specs
from ..parallel.state import Group
from ..parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    SavedShards,
    VocabParallelEmbedding,
    enter_tp_region,
    init_shard_,
)
from .args import ModelArgs
from .fused_loss import linear_cross_entropy_per_token

KERNELS = ("torch", "triton")  # model.kernels once resolved (model/build.py): today's torch ops, or kernels/


class _RMSNormFunction(torch.autograd.Function):
    """y = weight · x / rms(x), computed on an fp32 copy of x. Written out (rather than left to
    autograd) so that it saves only ``x`` and 1/rms, not four activation-sized temporaries, and
    converts each tensor between bf16 and fp32 once (mixed-dtype elementwise ops are slow on CPU)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        xf = x.to(torch.promote_types(x.dtype, torch.float32), copy=True)  # (..., h) fp32
        mean_sq = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().div_(x.shape[-1])
        rstd = mean_sq.add_(eps).rsqrt_()  # (..., 1) fp32
        ctx.save_for_backward(x, weight, rstd)
        return xf.mul_(rstd).to(x.dtype).mul_(weight)  # rounded to x's dtype, then scaled (as HF does)

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
        return g.sub_(x_hat.mul_(dot)).mul_(rstd).to(x.dtype), grad_weight, None


class RMSNorm(nn.Module):
    """x / rms(x) · weight, computed in fp32 whatever the input dtype. Under sequence parallelism
    each tp rank normalizes other positions, so the weight's grads are partial sums over tp."""

    def __init__(self, hidden: int, eps: float, *, sequence_parallel: bool = False, kernels: str = "torch",
                 dtype=torch.float32, device=None):
        super().__init__()
        self.eps, self.sequence_parallel, self.kernels = eps, sequence_parallel, kernels
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))

    def param_shardings(self) -> dict[str, Sharding]:
        return {"weight": Sharding(weight_decay=False, partial_grad_over_tp=self.sequence_parallel)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels == "triton":
            return rms_norm(x, self.weight, self.eps)  # one kernel each way (kernels/rmsnorm.py)
        return _RMSNormFunction.apply(x, self.weight, self.eps)


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int, **_) -> torch.Tensor:
    """Llama 3.1's rotary scaling, as transformers computes it: wavelengths longer than the original
    context / low_freq_factor are stretched by ``factor``, shorter than context / high_freq_factor
    kept, and those in between interpolated smoothly."""
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(seq: int, head_dim: int, theta: float, device, dtype,
                scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (s, d) for positions 0..seq-1 (the rotate-half layout); ``scaling``:
    ``model.rope_scaling`` (rope_type llama3, or none)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, **{k: v for k, v in scaling.items() if k not in ("rope_type", "type")})
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)  # (s, d/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (s, d)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


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
        dx[..., half:].addcmul_(grad[..., :half], sin[..., :half], value=-1.0)  # dx2 = g2 c2 - g1 s1
        return dx, None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels: str = "torch") -> torch.Tensor:
    """Rotate (b, n, s, d) query/key vectors by their position's angle; cos, sin: (s, d), or
    (b, 1, s, d) when each token has its own position (document masking). ``kernels="triton"``:
    the kernel of kernels/rope.py, for (s, d) tables (per-token tables take the torch ops)."""
    if kernels == "triton" and cos.dim() == 2:
        return rope(x, cos, sin)
    return _RoPEFunction.apply(x, cos, sin)


@dataclass
class Documents:
    """The documents packed into a micro-batch (``data.reset_position_ids`` / ``reset_attention_mask``):
    each token's position inside its document, and which tokens it may attend to. Under context
    parallelism both are this rank's share: its tokens' positions, its queries' rows of the mask."""
    position_ids: torch.Tensor | None  # (b, s) int64: positions restarting at each document, or None
    attn_mask: torch.Tensor | None     # (b, 1, s, s·cp) bool: causal and within the document, or None


def documents(tokens: torch.Tensor, eod: int, reset_attention_mask: bool, reset_position_ids: bool,
              cp: Group | None = None) -> Documents:
    """The document structure of (b, s) input ids: a document ends with its ``eod`` token, the next
    one starts after it (Megatron's ``get_ltor_masks_and_position_ids``). ``tokens`` are the whole
    sequence on every cp rank; with ``cp`` the result is this rank's share, each token judged by
    its global position and document: the mask of its queries against every key, in global order."""
    b, s = tokens.shape
    is_eod = tokens == eod
    doc = torch.cumsum(is_eod, dim=1) - is_eod.long()  # (b, s): EODs before each token (its document)
    keys = torch.arange(s, device=tokens.device)  # global positions of the mask's columns
    queries = local_positions(s, cp, tokens.device) if cp is not None else keys  # (s/cp,): its rows
    positions = mask = None
    if reset_position_ids:
        idx = torch.arange(s, device=tokens.device).expand(b, s)
        starts = torch.ones_like(is_eod)
        starts[:, 1:] = is_eod[:, :-1]  # a token after an EOD starts a document
        positions = idx - torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
        positions = positions[:, queries]  # (b, s/cp): this rank's tokens
    if reset_attention_mask:
        mask = causal_mask(queries, keys, doc[:, queries], doc[:, keys])  # (b, 1, s/cp, s)
    return Documents(positions, mask)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, tp: Group, *, sequence_parallel: bool, selective_recompute: bool,
                 rng: RNGTracker, saved: SavedShards | None, kernels: str = "torch", cp: Group | None = None,
                 dtype, device):
        super().__init__()
        self.rng, self.saved, self.kernels = rng, saved, kernels
        self.cp = cp if cp is not None else Group("cp", [0])
        d, out_std = args.head_dim, args.init_std / math.sqrt(2 * args.num_layers)
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.selective_recompute = selective_recompute
        self.n_local, self.k_local, self.d = args.num_heads // tp.size, args.num_kv_heads // tp.size, d
        self.dropout = args.attention_dropout
        kw = dict(dtype=dtype, device=device)
        self.q_proj = ColumnParallelLinear(args.hidden_size, args.num_heads * d, tp, init_std=args.init_std, **kw)
        self.k_proj = ColumnParallelLinear(args.hidden_size, args.num_kv_heads * d, tp, init_std=args.init_std, **kw)
        self.v_proj = ColumnParallelLinear(args.hidden_size, args.num_kv_heads * d, tp, init_std=args.init_std, **kw)
        self.o_proj = RowParallelLinear(args.num_heads * d, args.hidden_size, tp, init_std=out_std,
                                        sequence_parallel=sequence_parallel, **kw)

    def _core(self, q, k, v, mask=None):
        dropout = self.dropout if self.training else 0.0
        if not dropout:  # no random numbers drawn: no stream to fork (and no graph break under compile)
            return self._attend(q, k, v, mask, 0.0)
        with self.rng.fork():  # heads differ per tp (and cp) rank, so must their dropout masks
            return self._attend(q, k, v, mask, dropout)

    def _attend(self, q, k, v, mask, dropout: float):
        """Scaled dot-product attention of this rank's queries: under ``mask`` when given, else
        causal — over the whole sequence, or under context parallelism chunk by chunk, each of the
        rank's two query chunks against the keys up to its end (``parallel/context.py``)."""
        kw = dict(enable_gqa=True, dropout_p=dropout)
        if mask is not None or self.cp.size == 1:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, **kw)
        out = [F.scaled_dot_product_attention(q[:, :, rows], k[:, :, :keys], v[:, :, :keys],
                                              attn_mask=causal_lower_right(rows.stop - rows.start, keys), **kw)
               for rows, keys in query_chunks(q.shape[2], self.cp)]  # (b, n/tp, s/2, d) each
        return torch.cat(out, dim=2)  # (b, n/tp, s, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: (b, 1, s, s·cp) attention allowed (document masking), or None for plain causal."""
        x = enter_tp_region(x, self.tp, self.sequence_parallel, self.saved)  # (b, s, h): full sequence
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_local, self.d).transpose(1, 2)  # (b, n/tp, s, d)
        k = self.k_proj(x).view(b, s, self.k_local, self.d).transpose(1, 2)  # (b, k/tp, s, d)
        v = self.v_proj(x).view(b, s, self.k_local, self.d).transpose(1, 2)  # (b, k/tp, s, d)
        q, k = apply_rope(q, cos, sin, self.kernels), apply_rope(k, cos, sin, self.kernels)
        k, v = gather_kv_from_cp(k, v, self.cp)  # (b, k/tp, s·cp, d): every cp rank's keys, in global order
        if self.selective_recompute and self.training:
            # no dropout: no random stream to restore (and nothing for torch.compile to trace)
            context = self.rng.checkpoint_context if self.dropout else torch.utils.checkpoint.noop_context_fn
            y = checkpoint(self._core, q, k, v, mask, use_reentrant=False, context_fn=context)
        else:
            y = self._core(q, k, v, mask)  # (b, n/tp, s, d)
        y = y.transpose(1, 2).reshape(b, s, self.n_local * self.d)  # (b, s, n·d/tp)
        return self.o_proj(y)  # (b, s, h), or (b, s/tp, h) with SP


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, tp: Group, *, sequence_parallel: bool, saved: SavedShards | None,
                 kernels: str = "torch", dtype, device):
        super().__init__()
        out_std = args.init_std / math.sqrt(2 * args.num_layers)
        self.tp, self.sequence_parallel, self.saved, self.kernels = tp, sequence_parallel, saved, kernels
        kw = dict(dtype=dtype, device=device)
        h, f = args.hidden_size, args.ffn_hidden_size
        self.gate_proj = ColumnParallelLinear(h, f, tp, init_std=args.init_std, **kw)
        self.up_proj = ColumnParallelLinear(h, f, tp, init_std=args.init_std, **kw)
        self.down_proj = RowParallelLinear(f, h, tp, init_std=out_std, sequence_parallel=sequence_parallel, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_tp_region(x, self.tp, self.sequence_parallel, self.saved)  # (b, s, h)
        gate, up = self.gate_proj(x), self.up_proj(x)  # (b, s, f/tp)
        act = swiglu(gate, up) if self.kernels == "triton" else F.silu(gate) * up  # kernels/swiglu.py
        return self.down_proj(act)  # (b, s, h)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, tp: Group, *, sequence_parallel: bool, recompute: str,
                 rng: RNGTracker, saved: SavedShards | None, kernels: str = "torch", cp: Group | None = None,
                 dtype, device):
        super().__init__()
        kw = dict(kernels=kernels, dtype=dtype, device=device)
        self.rng, self.sequence_parallel = rng, sequence_parallel
        norm = dict(sequence_parallel=sequence_parallel, **kw)
        self.input_layernorm = RMSNorm(args.hidden_size, args.norm_eps, **norm)
        self.self_attn = Attention(args, tp, sequence_parallel=sequence_parallel,
                                   selective_recompute=recompute == "selective", rng=rng, saved=saved, cp=cp, **kw)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.norm_eps, **norm)
        self.mlp = MLP(args, tp, sequence_parallel=sequence_parallel, saved=saved, **kw)
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
                mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self._dropout(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self._dropout(self.mlp(self.post_attention_layernorm(x)))


class LlamaModel(nn.Module):
    """One pipeline chunk: optional embedding, the decoder layers ``layer_ids``, optional head.

    ``forward`` takes token ids (first chunk) or hidden states, and returns per-token losses (b, s)
    when the chunk has the head and ``targets`` are given, else hidden states. ``param_specs``
    declares how each of its parameters is laid out (see ``parallel/specs.py``). With a ``cp``
    group of several ranks the inputs are this rank's tokens (``parallel/context.py``'s
    ``split_to_cp``); the parameters are the same on every cp rank.
    """

    def __init__(self, args: ModelArgs, tp: Group, *, layer_ids: list[int] | None = None,
                 pre_process: bool = True, post_process: bool = True, sequence_parallel: bool = False,
                 recompute: str = "none", rng: RNGTracker | None = None, kernels: str = "torch",
                 z_loss: float = 0.0, cp: Group | None = None, dtype=torch.float32, device=None):
        super().__init__()
        if kernels not in KERNELS:
            raise ValueError(f"kernels={kernels!r} must be one of {KERNELS} (model/build.py resolves auto)")
        self.args, self.tp = args, tp
        self.cp = cp if cp is not None else Group("cp", [0])
        self.kernels, self.z_loss = kernels, z_loss
        self.grad_sink = None  # weakref to the buffers of the fp32 main grads (MixedPrecisionAdamW.hook_models)
        # dropout streams (see parallel/random.py); the trainer passes one seeded by train.seed
        self.rng = rng if rng is not None else RNGTracker(0, tp.rank, device or "cpu")
        self.sequence_parallel = sequence_parallel and tp.size > 1
        # what backward keeps of the column-parallel linears' gathered input: the seq shard
        self.saved_shards = SavedShards() if self.sequence_parallel else None
        self.recompute = recompute
        self.pre_process, self.post_process = pre_process, post_process
        layer_ids = list(range(args.num_layers)) if layer_ids is None else layer_ids
        kw = dict(dtype=dtype, device=device)
        padded_vocab = args.padded_vocab(tp.size)
        if pre_process or (post_process and args.tie_embeddings):
            self.embed_tokens = VocabParallelEmbedding(padded_vocab, args.hidden_size, tp,
                                                       init_std=args.init_std, real_vocab=args.vocab_size,
                                                       sequence_parallel=self.sequence_parallel, **kw)
        self.layers = nn.ModuleDict({
            str(i): DecoderLayer(args, tp, sequence_parallel=self.sequence_parallel, recompute=recompute,
                                 rng=self.rng, saved=self.saved_shards, kernels=kernels, cp=self.cp, **kw)
            for i in layer_ids})
        if post_process:
            self.norm = RMSNorm(args.hidden_size, args.norm_eps, sequence_parallel=self.sequence_parallel,
                                kernels=kernels, **kw)
            if not args.tie_embeddings:
                self.lm_head = ColumnParallelLinear(args.hidden_size, padded_vocab, tp, init_std=args.init_std,
                                                    vocab_rows=args.vocab_size, **kw)
        self._rope_cache: dict = {}
        self._context_cache: dict = {}  # context parallelism: this rank's rotary tables

    # -- layout and initialization -----------------------------------------------------------------

    def param_specs(self) -> dict[str, ParamSpec]:
        """Every parameter's spec, in ``named_parameters`` order. A tied embedding held by two
        chunks (first and last pipeline stage) is marked ``tied``; the last stage's copy is the
        ``duplicate``."""
        specs, tp = {}, self.tp.size
        for name, module in self.named_children():
            if name == "layers":
                for i, layer in self.layers.items():
                    specs.update(collect_specs(layer, tp, prefix=f"layers.{i}", layer=int(i)))
            elif name == "embed_tokens":
                tied = self.args.tie_embeddings and not (self.pre_process and self.post_process)
                specs.update(collect_specs(module, tp, prefix=name, tied=tied,
                                           duplicate=tied and not self.pre_process))
            else:
                specs.update(collect_specs(module, tp, prefix=name))
        return specs

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Give every parameter its layout-invariant initial value (see :meth:`init_parameter`)."""
        specs = self.param_specs()
        for name, param in self.named_parameters():
            self.init_parameter(name, param, seed, specs[name])

    @torch.no_grad()
    def init_parameter(self, name: str, out: torch.Tensor, seed: int, spec: ParamSpec) -> None:
        """Write parameter ``name``'s initial value (this rank's shard of it, ``init_shard_``, by its
        ``spec``) into ``out``, a tensor of its shape: norms 1, every other weight drawn with its layer's
        ``init_std``. ``out`` need not be the parameter itself (ZeRO-3 writes each unit straight into
        its gathered buffer: parallel/data.py)."""
        module_name, _, _ = name.rpartition(".")
        module = self.get_submodule(module_name)
        if isinstance(module, RMSNorm):
            out.fill_(1.0)
        else:
            init_shard_(out, spec, seed, module.init_std, self.tp)

    # -- forward ----------------------------------------------------------------------------------

    def _rope(self, seq: int, like: torch.Tensor):
        """cos, sin (s, d) for the global positions 0..seq-1."""
        key = (seq, like.device, like.dtype)
        if key not in self._rope_cache:
            scaling = dict(self.args.rope_scaling) if self.args.rope_scaling else None
            self._rope_cache = {key: rope_tables(seq, self.args.head_dim, self.args.rope_theta,
                                                 like.device, like.dtype, scaling)}
        return self._rope_cache[key]

    def _context_tables(self, seq: int, like: torch.Tensor):
        """Under context parallelism: cos, sin (s/cp, d) of this rank's tokens, rotated by their
        global positions."""
        key = (seq, like.device, like.dtype)
        if key not in self._context_cache:
            cos, sin = self._rope(seq, like)
            mine = local_positions(seq, self.cp, like.device)
            self._context_cache = {key: (cos[mine], sin[mine])}  # (s/cp, d) each
        return self._context_cache[key]

    def _positions(self, x: torch.Tensor, docs: Documents | None):
        """cos, sin of this rank's tokens — (s, d), or (b, 1, s, d) when positions restart per
        document — and the attention mask (None: causal by global position)."""
        seq = x.shape[1] * (self.tp.size if self.sequence_parallel else 1) * self.cp.size  # global length
        cos, sin = self._rope(seq, x)  # (s·cp, d): every global position
        if docs is not None and docs.position_ids is not None:
            cos, sin = cos[docs.position_ids].unsqueeze(1), sin[docs.position_ids].unsqueeze(1)  # (b, 1, s, d)
        elif self.cp.size > 1:
            cos, sin = self._context_tables(seq, x)  # (s, d)
        return cos, sin, docs.attn_mask if docs is not None else None

    def _layer(self, layer: DecoderLayer, x, cos, sin, mask=None):
        if self.recompute == "full" and self.training:
            return checkpoint(layer, x, cos, sin, mask, use_reentrant=False, context_fn=self.rng.checkpoint_context)
        return layer(x, cos, sin, mask)

    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.args.tie_embeddings else self.lm_head.weight

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                docs: Documents | None = None, *, loss_grad_scale: float | None = None) -> torch.Tensor:
        """``docs``: the micro-batch's document structure (positions, attention mask), the same on
        every pipeline chunk, or None for one causal stream per sample. ``loss_grad_scale``: the
        gradient the backward will bring to every per-token loss (the trainer backpropagates
        their sum times it), which lets the chunked loss add the output layer's weight gradient
        straight into its fp32 main grad in the forward (``model/fused_loss.py``)."""
        if self.saved_shards is None:
            return self._forward(x, targets, docs, loss_grad_scale)
        with self.saved_shards.hooks():  # backward keeps seq shards, not gathered sequences
            return self._forward(x, targets, docs, loss_grad_scale)

    def _grad_sink(self, weight: torch.Tensor):
        """The buffers that hold ``weight``'s fp32 main grad, for the loss to add its gradient into,
        or None: none, or the weight (tied) also gets a gradient from this chunk's embedding."""
        sink = self.grad_sink() if self.grad_sink is not None else None
        if sink is None or not sink.holds(weight) or (self.pre_process and self.args.tie_embeddings):
            return None
        return sink

    def _forward(self, x: torch.Tensor, targets: torch.Tensor | None, docs: Documents | None,
                 loss_grad_scale: float | None = None) -> torch.Tensor:
        if self.pre_process:
            x = self.embed_tokens(x)  # (b, s) ids -> (b, s, h)
        cos, sin, mask = self._positions(x, docs)
        for layer in self.layers.values():
            x = self._layer(layer, x, cos, sin, mask)  # (b, s, h)
        if not self.post_process:
            return x
        x = enter_tp_region(self.norm(x), self.tp, self.sequence_parallel, self.saved_shards)  # (b, s, h)
        weight = self.output_weight()  # (v/tp, h)
        if targets is None:
            return F.linear(x, weight)  # (b, s, v/tp) logits
        vocab_start = self.tp.rank * weight.shape[0]
        # chunks of tokens, no (b, s, v/tp) logits at all: the kernels' path, and on CPU the torch
        # reference of the same algorithm (a sixth of the one-buffer loss's working memory, as fast)
        if self.kernels == "triton" or self.z_loss or x.device.type == "cpu":
            return linear_cross_entropy_per_token(x, weight, targets, self.tp, vocab_start, self.args.vocab_size,
                                                  z_loss=self.z_loss, reference=self.kernels == "torch",
                                                  grad_sink=self._grad_sink(weight),
                                                  grad_scale=loss_grad_scale)  # (b, s)
        # output layer + loss in one op: the (b, s, v/tp) logits stay private, so their buffer can
        # hold their gradient
        return vocab_parallel_linear_cross_entropy(x, weight, targets, self.tp, vocab_start,
                                                   self.args.vocab_size)  # (b, s)


def num_parameters(args: ModelArgs, *, embeddings: bool = True) -> int:
    """Parameters of the whole (unpadded-vocabulary) model, independent of the layout."""
    h, f, d = args.hidden_size, args.ffn_hidden_size, args.head_dim
    attn = h * (args.num_heads * d) * 2 + h * (args.num_kv_heads * d) * 2
    layer = attn + (2 if args.mlp == "gelu" else 3) * h * f + 2 * h
    total = args.num_layers * layer + h
    if embeddings:
        total += args.vocab_size * h * (1 if args.tie_embeddings else 2)
    return total


def flops_per_token(args: ModelArgs, seq_length: int) -> float:
    """Training FLOPs per token: 6 × (matmul parameters, output layer included) + attention.

    Attention scores and weighted sums cost 12·layers·hidden·seq per token (forward + backward),
    counted as in PaLM's appendix B without the causal halving.
    """
    matmul_params = num_parameters(args, embeddings=False) + args.vocab_size * args.hidden_size
    return 6.0 * matmul_params + 12.0 * args.num_layers * args.hidden_size * seq_length
