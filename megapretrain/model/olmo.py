"""The OLMo family (OLMo 2, OLMo 3): post-norm blocks — RMSNorm on each sublayer's output before it
is added to the residual stream, no input norms — RMSNorm over the whole query and key projections
before RoPE (not per head: under tensor parallelism its statistics are summed over the tp ranks'
heads, ``layers.SpanningRMSNorm``), SwiGLU, rotary embeddings on every head dim, an untied head by
default. OLMo 3 adds sliding-window attention on three layers of four (``model.sliding_window``
with ``model.sliding_window_pattern: 4``, or ``model.layer_types``), the shared window option of
the attention paths.

``FAMILY`` is its :class:`~.family.Family`; its Hugging Face adapter (``Olmo2ForCausalLM``,
``Olmo3ForCausalLM``) is model/olmo_hf.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import require
from .args import ModelArgs
from .family import Family
from .layers import LayerSpec, SwiGLU, WeightFirstRMSNorm
from .olmo_hf import ADAPTER

if TYPE_CHECKING:
    from ..config import ModelConfig

__all__ = ["FAMILY", "check", "layer_spec"]


def layer_spec(args: ModelArgs) -> LayerSpec:
    """Post-norm RMSNorm layers with full-width QK-norm and SwiGLU; the norms' weights multiply
    in fp32, before the rounding to bf16 (HF's OLMo order)."""
    return LayerSpec(norm=WeightFirstRMSNorm, mlp=SwiGLU, full_qk_norm=True, post_norm=True)


def check(m: ModelConfig) -> None:
    """What its layers implement: SwiGLU, no biases, its own QK-norm, every head dim rotated,
    attention and MLP one after the other, heads hidden_size/num_heads wide."""
    require(m.mlp == "swiglu", f"model.mlp={m.mlp}: OLMo's MLP is swiglu; set --model.mlp swiglu")
    require(not m.qkv_bias, "model.qkv_bias=true is a llama-family option (Qwen2); OLMo has no "
                            "biases: set --model.qkv_bias false")
    require(not m.qk_norm, "model.qk_norm=true is the llama family's per-head QK-norm; the olmo "
                           "family always normalizes the whole q and k projections: set "
                           "--model.qk_norm false")
    require(m.rotary_pct == 1.0, f"model.rotary_pct={m.rotary_pct}: the olmo family rotates every "
                                 "head dim; set 1.0")
    require(not m.parallel_residual, "model.parallel_residual=true is GPT-NeoX's; the olmo family "
                                     "adds attention and MLP one after the other: set it to null "
                                     "or false")
    require(m.head_dim in (None, m.hidden_size // m.num_heads),
            f"model.head_dim={m.head_dim}: OLMo's heads are hidden_size/num_heads wide; set it "
            "to null")


FAMILY = Family(name="olmo", build_spec=layer_spec, hf=ADAPTER, check=check,
                defaults={"parallel_residual": False})
