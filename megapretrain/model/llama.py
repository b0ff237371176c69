"""The Llama family: RMSNorm, rotary embeddings on every head dim, grouped-query attention,
SwiGLU, optional tied embeddings — and its two options, biases on q, k, v (``model.qkv_bias``,
Qwen2/2.5) and RMSNorm over each head's q and k before RoPE (``model.qk_norm``, Qwen3, with its
own ``model.head_dim``). ``model.mlp=gelu`` gives the two-matrix GELU MLP without biases (GPT-3's
shape, which the planner models; it has no Hugging Face architecture).

A family is its layer choices (:func:`layer_spec`, from the shared layers of ``model/layers.py``
assembled by ``model/decoder.py``'s chunk) and its Hugging Face adapter (``HF``, model/llama_hf.py).
"""

from __future__ import annotations

from .args import ModelArgs
from .layers import GeluMLP, LayerSpec, RMSNorm, SwiGLU
from .llama_hf import ADAPTER as HF

__all__ = ["HF", "NAME", "layer_spec"]

NAME = "llama"


def layer_spec(args: ModelArgs) -> LayerSpec:
    """Pre-norm RMSNorm layers, SwiGLU (or GELU), one after the other; Qwen's options."""
    return LayerSpec(norm=RMSNorm, mlp=SwiGLU if args.mlp == "swiglu" else GeluMLP, qkv_bias=args.qkv_bias,
                     qk_norm=args.qk_norm)

