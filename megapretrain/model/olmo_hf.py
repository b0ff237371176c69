"""The OLMo family's Hugging Face adapter: ``Olmo2ForCausalLM`` (no sliding window) and
``Olmo3ForCausalLM`` (a sliding window on some layers: ``sliding_window``, ``layer_types``).

The chunk's names are Hugging Face's without the ``model.`` prefix (``post_attention_layernorm``
and ``post_feedforward_layernorm`` normalize the sublayers' outputs; ``q_norm`` and ``k_norm`` are
as wide as the whole projections, split over tp with their rows), rotary is rotate-half: no tensor
is permuted. OLMo 3 gives each layer type its own rotary settings (``rope_parameters`` keyed by
``sliding_attention`` / ``full_attention``; the long-context checkpoints: YaRN on the full layers
only): the full layers' are ``model.rope_theta`` and ``model.rope_scaling``, the sliding layers'
``model.sliding_rope`` where they differ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .args import FULL, SLIDING
from .hf_adapter import (
    ConvertError,
    check_config_fields,
    hf_rope_scaling,
    max_positions,
    refuse,
    rope_from_hf,
)

if TYPE_CHECKING:
    from ..config import Config
    from .args import ModelArgs

ARCHITECTURES = {"olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM"}
OLMO3_THETA = 500000.0  # transformers' Olmo3Config: the rotary base of a type that names none


def _rope_entry(theta: float, scaling: dict | tuple | None) -> dict:
    """One layer type's ``rope_parameters`` entry."""
    return {**(hf_rope_scaling(scaling) or {"rope_type": "default"}), "rope_theta": theta}


class OlmoAdapter:
    model_types = tuple(ARCHITECTURES)
    architectures = tuple(ARCHITECTURES.values())
    ignored_suffixes = ("rotary_emb.inv_freq",)

    def hf_name(self, name: str) -> str:
        return name if name.startswith("lm_head.") else f"model.{name}"

    def hf_config(self, cfg: Config, args: ModelArgs, dtype_name: str, bos: int | None,
                  eos: int | None) -> dict:
        m = cfg.model
        windowed = args.layer_types is not None and SLIDING in args.layer_types
        model_type = "olmo3" if windowed else "olmo2"
        full = _rope_entry(m.rope_theta, m.rope_scaling)
        out = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
               "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
               "intermediate_size": args.ffn_hidden_size, "num_hidden_layers": m.num_layers,
               "num_attention_heads": m.num_heads, "num_key_value_heads": args.num_kv_heads,
               "hidden_act": "silu", "rms_norm_eps": m.norm_eps, "attention_bias": False,
               "tie_word_embeddings": bool(m.tie_embeddings),
               "attention_dropout": m.attention_dropout, "initializer_range": m.init_std,
               "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": None,
               "torch_dtype": dtype_name, "dtype": dtype_name}
        if windowed:  # each layer type its rotary settings (a sliding layer's: args.rope)
            sliding = _rope_entry(*args.rope(args.layer_types.index(SLIDING)))
            out.update(sliding_window=args.sliding_window, layer_types=list(args.layer_types),
                       rope_parameters={SLIDING: sliding, FULL: full})
        else:
            sliding = None
            out.update(rope_parameters=full, rope_theta=m.rope_theta)
        out["max_position_embeddings"] = max_positions(cfg, hf_rope_scaling(full),
                                                       hf_rope_scaling(sliding))
        return out

    def _rope(self, hf: dict, where: str) -> dict[str, object]:
        """The ``model.*`` rotary settings of a config.json: rope_theta and rope_scaling, and for
        OLMo 3 sliding layers whose settings differ from the full layers' sliding_rope."""
        if hf.get("model_type") != "olmo3":
            theta, scaling = rope_from_hf(hf, where)
            return {"rope_theta": theta, "rope_scaling": scaling}
        # as transformers' Olmo3Config reads it: a top-level rope_scaling and rope_theta (the
        # released checkpoints' form) set the full layers'; a type without its own rope_theta
        # takes OLMo 3's default base (the sliding type even beside a top-level rope_theta)
        params = hf.get("rope_parameters") or {}
        nested = {t: dict(params.get(t) or {"rope_type": "default"}) for t in (FULL, SLIDING)}
        if hf.get("rope_scaling"):
            nested[FULL].update(hf["rope_scaling"])
        nested[FULL].setdefault("rope_theta", hf.get("rope_theta") or OLMO3_THETA)
        nested[SLIDING].setdefault("rope_theta", OLMO3_THETA)
        (theta, scaling), (own_theta, own) = (rope_from_hf(hf, where, nested[t])
                                              for t in (FULL, SLIDING))
        flags = {"rope_theta": theta, "rope_scaling": scaling}
        types = hf.get("layer_types") or ()
        if (own_theta, own) != (theta, scaling) and (not types or SLIDING in types):
            flags["sliding_rope"] = {"rope_theta": own_theta, **(own or {"rope_type": "default"})}
        return flags

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
        for t, params in ((hf.get("rope_parameters") or {}).items()
                          if hf.get("model_type") == "olmo3" else ()):
            if isinstance(params, dict) and params.get("truncate", True) is not True:
                unsupported[f"rope_parameters.{t}.truncate"] = params["truncate"]
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
                 "norm_eps": hf.get("rms_norm_eps", 1e-5),
                 "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "mlp": "swiglu",
                 "rotary_pct": 1.0, "parallel_residual": False, "qkv_bias": False,
                 "qk_norm": False}
        rope = self._rope(hf, where)
        flags.update({k: v for k, v in rope.items() if v is not None})
        if hf.get("model_type") == "olmo3":
            layers = hf["num_hidden_layers"]
            # transformers' default: every fourth layer full
            types = hf.get("layer_types") or [FULL if (i + 1) % 4 == 0 else SLIDING
                                              for i in range(layers)]
            if SLIDING in types and hf.get("sliding_window"):
                flags["sliding_window"] = hf["sliding_window"]
                flags["layer_types"] = list(types)
            elif SLIDING in types and "sliding_rope" in flags:
                raise ConvertError(f"{where}: sliding_attention layers without a sliding_window "
                                   "have their own rotary settings; megapretrain's layers take "
                                   "theirs from their window: set sliding_window, or give both "
                                   "types the same rope_parameters")
            else:  # no sliding layer: the full layers' settings on every layer
                flags.pop("sliding_rope", None)
        return flags


ADAPTER = OlmoAdapter()
