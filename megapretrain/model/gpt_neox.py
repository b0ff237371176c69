"""The GPT-NeoX family (Pythia): LayerNorm with bias, attention and MLP from the same input added
to the residual together (``use_parallel_residual``; ``model.parallel_residual: false`` adds them
one after the other), rotary embeddings on the first ``model.rotary_pct`` of each head's dims, a
fused QKV projection, the exact-GELU MLP, biases on every linear, an untied head, no grouped-query
attention. ``FAMILY`` is its :class:`~.family.Family`; its Hugging Face adapter is in
model/gpt_neox_hf.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import require
from .args import ModelArgs, kv_heads
from .family import Family
from .gpt_neox_hf import ADAPTER
from .layers import GeluMLP, LayerNorm, LayerSpec

if TYPE_CHECKING:
    from ..config import ModelConfig

__all__ = ["FAMILY", "check", "layer_spec"]


def layer_spec(args: ModelArgs) -> LayerSpec:
    return LayerSpec(norm=LayerNorm, mlp=GeluMLP, qkv_bias=True, dense_bias=True, fused_qkv=True,
                     parallel_residual=args.parallel_residual)


def check(m: ModelConfig) -> None:
    """What its layers implement of the options: LayerNorm, GELU, biases, no GQA, an untied head."""
    require(m.mlp == "gelu", f"model.mlp={m.mlp}: GPT-NeoX's MLP is gelu; set --model.mlp gelu")
    for name in ("qkv_bias", "qk_norm"):
        require(not getattr(m, name),
                f"model.{name}=true is a llama-family option; GPT-NeoX has biases on every "
                f"linear and no QK-norm: set --model.{name} false")
    kv = kv_heads(m)
    require(kv == m.num_heads,
            f"model.num_kv_heads={kv}: GPT-NeoX has no grouped-query attention; set it to "
            f"model.num_heads={m.num_heads} (or null)")
    require(not m.tie_embeddings,
            "model.tie_embeddings=true: GPT-NeoX's head (embed_out) is its own; set "
            "--model.tie_embeddings false")
    require(m.head_dim in (None, m.hidden_size // m.num_heads),
            f"model.head_dim={m.head_dim}: GPT-NeoX's heads are hidden_size/num_heads wide; "
            "set it to null")


# use_parallel_residual: Hugging Face's and Pythia's default
FAMILY = Family(name="gpt_neox", build_spec=layer_spec, hf=ADAPTER, check=check,
                defaults={"parallel_residual": True})
