"""The OLMo family's Hugging Face adapter: ``Olmo2ForCausalLM`` (no sliding window) and
``Olmo3ForCausalLM`` (a sliding window on some layers: ``sliding_window``, ``layer_types``).

The chunk's names are Hugging Face's without the ``model.`` prefix (``post_attention_layernorm``
and ``post_feedforward_layernorm`` normalize the sublayers' outputs; ``q_norm`` and ``k_norm`` are
as wide as the whole projections, split over tp with their rows), rotary is rotate-half: no tensor
is permuted. OLMo 3 gives each layer type its own rotary settings (``rope_parameters`` keyed by
``sliding_attention`` / ``full_attention``); the chunk has one rotary table for all layers, so a
checkpoint whose types differ (the long-context OLMo 3 checkpoints: YaRN on the full layers) is
refused, as is any rotary scaling (not yet).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .args import FULL, SLIDING
from .hf_adapter import ConvertError, check_config_fields, refuse, rope_from_hf

if TYPE_CHECKING:
    from ..config import Config
    from .args import ModelArgs

ARCHITECTURES = {"olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM"}


class OlmoAdapter:
    model_types = tuple(ARCHITECTURES)
    architectures = tuple(ARCHITECTURES.values())
    ignored_suffixes = ("rotary_emb.inv_freq",)

    def hf_name(self, name: str) -> str:
        return name if name.startswith("lm_head.") else f"model.{name}"

    def hf_config(self, cfg: Config, args: ModelArgs, dtype_name: str, bos: int | None,
                  eos: int | None) -> dict:
        m = cfg.model
        if m.rope_scaling and m.rope_scaling.get("rope_type", m.rope_scaling.get("type")) \
                != "default":
            raise ConvertError(f"model.rope_scaling={m.rope_scaling}: rotary scaling in OLMo's "
                               "Hugging Face config is not yet written; nothing written")
        windowed = args.layer_types is not None and SLIDING in args.layer_types
        model_type = "olmo3" if windowed else "olmo2"
        rope = {"rope_type": "default", "rope_theta": m.rope_theta}
        out = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
               "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
               "intermediate_size": args.ffn_hidden_size, "num_hidden_layers": m.num_layers,
               "num_attention_heads": m.num_heads, "num_key_value_heads": args.num_kv_heads,
               "hidden_act": "silu", "max_position_embeddings": cfg.train.seq_length,
               "rms_norm_eps": m.norm_eps, "attention_bias": False,
               "tie_word_embeddings": bool(m.tie_embeddings),
               "attention_dropout": m.attention_dropout, "initializer_range": m.init_std,
               "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": None,
               "torch_dtype": dtype_name, "dtype": dtype_name}
        if windowed:  # each layer type its rotary settings: the same for both here
            out.update(sliding_window=args.sliding_window, layer_types=list(args.layer_types),
                       rope_parameters={SLIDING: dict(rope), FULL: dict(rope)})
        else:
            out.update(rope_parameters=rope, rope_theta=m.rope_theta)
        return out

    def _rope(self, hf: dict, where: str) -> float:
        """The one rotary base of a config.json's layers (OLMo 3: of each layer type it uses);
        a ConvertError for rotary scaling or types with different settings."""
        params = hf.get("rope_parameters") or {}
        types = set(hf.get("layer_types") or []) if hf.get("model_type") == "olmo3" else set()
        if types and any(isinstance(params.get(t), dict) for t in (SLIDING, FULL)):
            settings = {t: params.get(t) or {} for t in sorted(types)}
            if len({repr(sorted(v.items())) for v in settings.values()}) > 1:
                raise ConvertError(f"{where}: rope_parameters differ between layer types "
                                   f"({settings}); megapretrain's olmo family computes one rotary "
                                   "table for every layer (per-type rotary: not yet)")
            theta, scaling = rope_from_hf({**hf, "rope_scaling": None,
                                           "rope_parameters": next(iter(settings.values()))},
                                          where)
        else:
            theta, scaling = rope_from_hf(hf, where)
        if scaling:
            raise ConvertError(f"{where}: rotary scaling {scaling} in an OLMo checkpoint is not "
                               "yet supported by megapretrain's olmo family; the weights would "
                               "not compute the same function")
        return theta

    def check(self, hf: dict, where: str) -> None:
        check_config_fields(hf, where, ("vocab_size", "hidden_size", "intermediate_size",
                                        "num_hidden_layers", "num_attention_heads"),
                            ("num_key_value_heads", "sliding_window"), ("rms_norm_eps",),
                            ("tie_word_embeddings", "attention_bias"))
        unsupported = {k: hf[k] for k in ("attention_bias",) if hf.get(k)}
        if hf.get("hidden_act", "silu") != "silu":
            unsupported["hidden_act"] = hf["hidden_act"]
        head_dim = hf.get("head_dim")
        if head_dim and head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
            unsupported["head_dim"] = head_dim
        refuse(unsupported, where, "olmo")
        types = hf.get("layer_types")
        if types is not None and (not isinstance(types, list) or
                                  len(types) != hf["num_hidden_layers"] or
                                  not set(types) <= {SLIDING, FULL}):
            raise ConvertError(f"{where}: layer_types={types!r}: expected one of {SLIDING}, "
                               f"{FULL} per layer (num_hidden_layers={hf['num_hidden_layers']})")
        self._rope(hf, where)

    def model_flags(self, hf: dict, where: str) -> dict[str, object]:
        heads = hf["num_attention_heads"]
        flags = {"family": "olmo", "num_layers": hf["num_hidden_layers"],
                 "hidden_size": hf["hidden_size"], "num_heads": heads,
                 "num_kv_heads": hf.get("num_key_value_heads") or heads,
                 "ffn_hidden_size": hf["intermediate_size"], "vocab_size": hf["vocab_size"],
                 "rope_theta": self._rope(hf, where), "norm_eps": hf.get("rms_norm_eps", 1e-5),
                 "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "mlp": "swiglu",
                 "rotary_pct": 1.0, "parallel_residual": False, "qkv_bias": False,
                 "qk_norm": False}
        if hf.get("model_type") == "olmo3":
            layers = hf["num_hidden_layers"]
            # transformers' default: every fourth layer full
            types = hf.get("layer_types") or [FULL if (i + 1) % 4 == 0 else SLIDING
                                              for i in range(layers)]
            if SLIDING in types and hf.get("sliding_window"):
                flags["sliding_window"] = hf["sliding_window"]
                flags["layer_types"] = list(types)
        return flags


ADAPTER = OlmoAdapter()
