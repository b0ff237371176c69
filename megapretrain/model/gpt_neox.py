"""The GPT-NeoX family (Pythia): LayerNorm with bias, attention and MLP from the same input added
to the residual together (``use_parallel_residual``; ``model.parallel_residual: false`` adds them
one after the other), rotary embeddings on the first ``model.rotary_pct`` of each head's dims, a
fused QKV projection, the exact-GELU MLP, biases on every linear, an untied head, no grouped-query
attention. Its Hugging Face adapter is ``HF`` (model/gpt_neox_hf.py).
"""

from __future__ import annotations

from .args import ModelArgs
from .gpt_neox_hf import ADAPTER as HF
from .layers import GeluMLP, LayerNorm, LayerSpec

NAME = "gpt_neox"


def layer_spec(args: ModelArgs) -> LayerSpec:
    return LayerSpec(norm=LayerNorm, mlp=GeluMLP, qkv_bias=True, dense_bias=True, fused_qkv=True,
                     parallel_residual=args.parallel_residual)


__all__ = ["HF", "NAME", "layer_spec"]
