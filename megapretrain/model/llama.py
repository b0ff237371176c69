"""The Llama family: RMSNorm, rotary embeddings on every head dim, grouped-query attention,
SwiGLU, optional tied embeddings — and its two options, biases on q, k, v (``model.qkv_bias``,
Qwen2/2.5) and RMSNorm over each head's q and k before RoPE (``model.qk_norm``, Qwen3, with its
own ``model.head_dim``). ``model.mlp=gelu`` gives the two-matrix GELU MLP without biases (GPT-3's
shape, which the planner models; it has no Hugging Face architecture).

A family is one :class:`~.family.Family` (``FAMILY``): its layer choices (:func:`layer_spec`, from
the shared layers of ``model/layers.py`` assembled by ``model/decoder.py``'s chunk), its Hugging
Face adapter (model/llama_hf.py), its rules (:func:`check`) and its defaults.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import require
from .args import ModelArgs
from .family import Family
from .layers import GeluMLP, LayerSpec, RMSNorm, SwiGLU
from .llama_hf import ADAPTER

if TYPE_CHECKING:
    from ..config import ModelConfig

__all__ = ["FAMILY", "check", "layer_spec"]


def layer_spec(args: ModelArgs) -> LayerSpec:
    """Pre-norm RMSNorm layers, SwiGLU (or GELU), one after the other; Qwen's options."""
    return LayerSpec(norm=RMSNorm, mlp=SwiGLU if args.mlp == "swiglu" else GeluMLP,
                     qkv_bias=args.qkv_bias, qk_norm=args.qk_norm)


def check(m: ModelConfig) -> None:
    """Every head dim rotated; attention and MLP one after the other."""
    require(m.rotary_pct == 1.0,
            f"model.rotary_pct={m.rotary_pct}: the llama family rotates every head dim; "
            "set 1.0 (partial rotary is model.family=gpt_neox's)")
    require(not m.parallel_residual,
            "model.parallel_residual=true is GPT-NeoX's; the llama family adds its "
            "attention and MLP one after the other: set it to null or false")


FAMILY = Family(name="llama", build_spec=layer_spec, hf=ADAPTER, check=check,
                defaults={"parallel_residual": False})
