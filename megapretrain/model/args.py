"""The model's shape: :class:`ModelArgs` (``model.*`` with its nulls resolved, independent of the
layout) and the rules that belong to it — heads against the hidden size, grouped-query heads,
the FFN width, the padded vocabulary, rotary scaling, and what tensor parallelism may split.

The config's schema (``config.py``) declares the fields; this module is where their meaning as a
model lives, so the trainer, the tools and the planner derive the same sizes from one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import divisors, require

if TYPE_CHECKING:
    from ..config import Config, ModelConfig


def default_ffn_hidden_size(hidden_size: int) -> int:
    """Llama's rule: 2/3 of 4·hidden, rounded up to a multiple of 256."""
    return 256 * math.ceil(int(8 * hidden_size / 3) / 256)


def kv_heads(m: ModelConfig) -> int:
    """``model.num_kv_heads`` resolved (null: multi-head attention)."""
    return m.num_heads if m.num_kv_heads is None else m.num_kv_heads


def ffn_hidden_size(m: ModelConfig) -> int:
    """``model.ffn_hidden_size`` resolved (null: Llama's rule)."""
    return default_ffn_hidden_size(m.hidden_size) if m.ffn_hidden_size is None \
        else m.ffn_hidden_size


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Round the vocabulary up so every tp rank holds an equal, aligned slice of it."""
    multiple = divisible_by * tp
    return multiple * math.ceil(vocab_size / multiple)


@dataclass(frozen=True)
class ModelArgs:
    """The architecture, resolved (the config's nulls filled in, but for the ``FAMILY_DEFAULTS``
    its family's layer spec fills) and independent of the layout: the one model-shape type of the
    trainer, the tools and the planner."""
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    vocab_divisible_by: int = 128  # the vocabulary is padded to a multiple of this × tp
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    # model.rope_scaling as sorted (key, value) pairs (hashable); None: none
    rope_scaling: tuple | None = None
    mlp: str = "swiglu"  # or "gelu": the two-matrix MLP with exact GELU (GPT-NeoX, GPT-3)
    # the decoder's layer choices and its Hugging Face adapter (model/families.py)
    family: str = "llama"
    qkv_bias: bool = False  # llama family: biases on q, k, v (Qwen2)
    qk_norm: bool = False  # llama family: RMSNorm over each head's q and k before RoPE (Qwen3)
    kv_channels: int | None = None  # per-head size when not hidden/heads (model.head_dim)
    rotary_pct: float = 1.0  # the first rotary_pct of each head's dims are rotated
    parallel_residual: bool | None = None  # x + attn(ln1(x)) + mlp(ln2(x)); None: the family's
    # default, which its layer spec fills in (model/family.py: read it off the spec, not from here)
    sliding_window: int = 0  # keys a windowed layer's query sees, itself included; 0: none
    # per layer "sliding_attention" or "full_attention" (model.layer_types resolved); None: no
    # window anywhere
    layer_types: tuple[str, ...] | None = None
    # model.sliding_rope as sorted (key, value) pairs, rope_theta filled in: the rotary settings
    # of the sliding layers when they differ from the others' (OLMo 3); None: every layer's
    sliding_rope: tuple | None = None

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (all of them but for partial rotary), as HF counts
        them."""
        return int(self.head_dim * self.rotary_pct)

    def window(self, layer: int) -> int:
        """The sliding window of decoder layer ``layer`` (global index), 0 for full attention."""
        if self.layer_types is None or self.layer_types[layer] == FULL:
            return 0
        return self.sliding_window

    def rope(self, layer: int) -> tuple[float, tuple | None]:
        """(rotary base, rotary scaling as sorted pairs or None) of decoder layer ``layer``: the
        sliding layers' own settings where ``model.sliding_rope`` gives them, else
        ``model.rope_theta`` and ``model.rope_scaling``. Hashable: layers with equal settings
        share one table."""
        if self.sliding_rope is None or self.window(layer) == 0:
            return self.rope_theta, self.rope_scaling
        own = dict(self.sliding_rope)
        theta = float(own.pop("rope_theta"))
        if own.get("rope_type", own.get("type")) == "default":
            return theta, None
        return theta, tuple(sorted(own.items()))

    def attention_fraction(self, seq: int) -> float:
        """The share of causal (query, key) pairs the layers compute on sequences of ``seq``
        tokens, averaged over the layers: 1 without a window (see :func:`window_fraction`)."""
        return sum(window_fraction(self.window(i), seq)
                   for i in range(self.num_layers)) / self.num_layers

    def padded_vocab(self, tp: int) -> int:
        """Rows of the embedding and output layer under ``tp``: every tp rank an equal, aligned
        slice."""
        return padded_vocab_size(self.vocab_size, self.vocab_divisible_by, tp)


SLIDING, FULL = "sliding_attention", "full_attention"  # model.layer_types' entries (HF's names)


def window_fraction(window: int, seq: int) -> float:
    """Of the s(s+1)/2 causal (query, key) pairs of a sequence of ``seq`` tokens, the share that a
    sliding window of ``window`` keys keeps: query i sees min(window, i + 1) keys. 1 for no
    window (0) or one of at least ``seq``."""
    if not window or window >= seq:
        return 1.0
    kept = window * (window + 1) // 2 + (seq - window) * window
    return kept / (seq * (seq + 1) // 2)


def layer_types(m: ModelConfig) -> tuple[str, ...] | None:
    """``model.layer_types`` resolved (:func:`check_window` has passed): each layer's attention
    kind, from the list, or from ``sliding_window_pattern`` (every N-th layer full), or every
    layer windowed; None without a window."""
    if not m.sliding_window:
        return None
    if m.layer_types is not None:
        return tuple(m.layer_types)
    every = m.sliding_window_pattern
    return tuple(FULL if every and (i + 1) % every == 0 else SLIDING
                 for i in range(m.num_layers))


def model_args(cfg: Config) -> ModelArgs:
    """The architecture of ``cfg.model`` with its nulls resolved (``model.vocab_size`` must be
    set)."""
    m = cfg.model
    return ModelArgs(num_layers=m.num_layers, hidden_size=m.hidden_size, num_heads=m.num_heads,
                     num_kv_heads=kv_heads(m), ffn_hidden_size=ffn_hidden_size(m),
                     vocab_size=m.vocab_size, vocab_divisible_by=m.make_vocab_size_divisible_by,
                     rope_theta=m.rope_theta, norm_eps=m.norm_eps, tie_embeddings=m.tie_embeddings,
                     init_std=m.init_std, attention_dropout=m.attention_dropout,
                     hidden_dropout=m.hidden_dropout, mlp=m.mlp,
                     rope_scaling=tuple(sorted(m.rope_scaling.items())) if m.rope_scaling else None,
                     family=m.family, qkv_bias=m.qkv_bias, qk_norm=m.qk_norm,
                     kv_channels=m.head_dim, rotary_pct=m.rotary_pct,
                     parallel_residual=m.parallel_residual, sliding_window=m.sliding_window or 0,
                     layer_types=layer_types(m), sliding_rope=sliding_rope(m))


def sliding_rope(m: ModelConfig) -> tuple | None:
    """``model.sliding_rope`` resolved: its settings with ``rope_theta`` filled in (null there:
    ``model.rope_theta``), as sorted pairs; None where it is unset."""
    if not m.sliding_rope:
        return None
    own = {k: v for k, v in m.sliding_rope.items() if v is not None}
    return tuple(sorted({"rope_theta": m.rope_theta, **own}.items()))


# the fields whose null means "the family's value": each family's Family.defaults gives them all
FAMILY_DEFAULTS = ("parallel_residual",)


def head_dim(m: ModelConfig) -> int:
    """``model.head_dim`` resolved (null: hidden_size / num_heads)."""
    return m.head_dim or m.hidden_size // m.num_heads


ROPE_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings")
# YaRN (rope_type yarn): the keys it needs, and those it may have (transformers' defaults: the
# attention factor from factor and mscale, beta_fast 32, beta_slow 1)
ROPE_YARN_KEYS = ("factor", "original_max_position_embeddings")
ROPE_YARN_OPTIONAL = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
ROPE_KEYS = {"llama3": (ROPE_LLAMA3_KEYS, ()), "yarn": (ROPE_YARN_KEYS, ROPE_YARN_OPTIONAL)}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) and value > 0


def check_rope_scaling(rs: Any, where: str) -> None:
    """Rotary scaling the model implements: null, Llama 3.1's ``llama3`` with its four numbers,
    or YaRN's ``yarn`` (factor, original_max_position_embeddings; optionally attention_factor,
    beta_fast, beta_slow, mscale, mscale_all_dim)."""
    if rs is None:
        return
    kind = rs.get("rope_type", rs.get("type")) if isinstance(rs, dict) else None
    require(kind in ("default", *ROPE_KEYS),
            f"{where}={rs!r}: rope_type must be llama3 (Llama 3.1+) or yarn (OLMo 3, Qwen); other "
            "variants would not compute the same function")
    if kind == "default":
        return
    needed, optional = ROPE_KEYS[kind]
    missing = [k for k in needed if not _number(rs.get(k))]
    require(not missing, f"{where}: rope_type {kind} needs positive numbers {', '.join(missing)}")
    extra = sorted(set(rs) - {"rope_type", "type", *needed, *optional})
    require(not extra, f"{where}: keys {extra} are not part of rope_type {kind} (it takes "
                       f"{', '.join(needed + optional)}); remove them")
    wrong = [k for k in optional if rs.get(k) is not None and not _number(rs[k])]
    require(not wrong, f"{where}: {', '.join(wrong)} must be positive numbers")
    if kind == "llama3":
        require(rs["low_freq_factor"] < rs["high_freq_factor"],
                f"{where}: low_freq_factor={rs['low_freq_factor']} must be below "
                f"high_freq_factor={rs['high_freq_factor']}")


def check_sliding_rope(m: ModelConfig) -> None:
    """``model.sliding_rope``: a rotary setting (rope_type, an optional positive rope_theta and
    the type's keys) for layers that exist: some layer must have the window."""
    rs = m.sliding_rope
    if not rs:
        return
    require(isinstance(rs, dict), f"model.sliding_rope={rs!r}: expected a mapping like "
                                  "{rope_type: default, rope_theta: 500000}")
    types = layer_types(m)
    require(types is not None and SLIDING in types,
            f"model.sliding_rope={rs}: no layer has a sliding window (model.sliding_window="
            f"{m.sliding_window}); set the window, or set model.sliding_rope to null")
    require(rs.get("rope_theta") is None or _number(rs["rope_theta"]),
            f"model.sliding_rope: rope_theta={rs.get('rope_theta')!r} must be a positive number")
    require(rs.get("rope_type", rs.get("type")) is not None,
            f"model.sliding_rope={rs}: name its rope_type (default, llama3 or yarn)")
    check_rope_scaling({k: v for k, v in rs.items() if k != "rope_theta"}, "model.sliding_rope")


def check_window(m: ModelConfig) -> None:
    """Sliding-window attention's fields: a window of at least one key (the config's range check
    refuses a negative one), a layer list of ``num_layers`` known kinds, one way of choosing the
    windowed layers."""
    types = m.layer_types
    if types is not None:
        require(isinstance(types, list) and len(types) == m.num_layers,
                f"model.layer_types has {len(types) if isinstance(types, list) else types!r} "
                f"entries; it needs one per layer (model.num_layers={m.num_layers}), each "
                f"{SLIDING} or {FULL}")
        for i, kind in enumerate(types):
            require(kind in (SLIDING, FULL), f"model.layer_types[{i}]={kind!r} is not a layer "
                                             f"type; use {SLIDING} or {FULL}")
        require(m.sliding_window or SLIDING not in types,
                f"model.layer_types names {SLIDING} layers but model.sliding_window is "
                f"{m.sliding_window}: set the window's size in tokens")
        require(m.sliding_window_pattern is None,
                f"model.layer_types and model.sliding_window_pattern={m.sliding_window_pattern} "
                "both choose the windowed layers: set one of them")


def check_shape(m: ModelConfig, tp: int) -> None:
    """The shape's rules for every family, and what tensor parallelism over ``tp`` ranks may split
    of it: heads, grouped-query heads and the FFN width split over tp; the rotated head dims even
    for RoPE. (model/families.py's ``check_model`` runs the family's own rules, then these.)"""
    kv = kv_heads(m)
    if m.head_dim is None:
        require(m.hidden_size % m.num_heads == 0,
                f"model.num_heads={m.num_heads} must divide model.hidden_size={m.hidden_size} "
                f"(valid: {divisors(m.hidden_size)}), or set model.head_dim")
    require(0 < m.rotary_pct <= 1, f"model.rotary_pct={m.rotary_pct} must be in (0, 1]")
    rotary = int(head_dim(m) * m.rotary_pct)
    require(rotary >= 2 and rotary % 2 == 0,
            f"rotary dims head_dim·rotary_pct={head_dim(m)}·{m.rotary_pct} → {rotary} must be even "
            "and at least 2 for RoPE (change model.rotary_pct or the head size)")
    require(m.num_heads % kv == 0,
            f"model.num_kv_heads={kv} must divide model.num_heads={m.num_heads} "
            f"(valid: {divisors(m.num_heads)})")
    require(m.num_heads % tp == 0,
            f"parallel.tp={tp} must divide model.num_heads={m.num_heads} (valid: "
            f"{divisors(m.num_heads)})")
    require(kv % tp == 0, f"parallel.tp={tp} must divide model.num_kv_heads={kv} (valid: "
                          f"{divisors(kv)})")
    ffn = ffn_hidden_size(m)
    require(ffn % tp == 0, f"parallel.tp={tp} must divide model.ffn_hidden_size={ffn} (valid: "
                           f"{divisors(ffn)})")
    require(m.vocab_size is not None and m.vocab_size >= 1,
            "model.vocab_size is unset: set it, or set data.tokenizer so it can be read from the "
            "tokenizer")
    for name in ("attention_dropout", "hidden_dropout"):
        require(0 <= getattr(m, name) < 1, f"model.{name}={getattr(m, name)} must be in [0, 1)")
    check_rope_scaling(m.rope_scaling, "model.rope_scaling")
    check_window(m)
    check_sliding_rope(m)
