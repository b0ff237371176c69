"""The Llama family's Hugging Face adapter: ``LlamaForCausalLM``, and with the family's options
``Qwen2ForCausalLM`` (``model.qkv_bias``) and ``Qwen3ForCausalLM`` (``model.qk_norm``, its own
``head_dim``). Qwen2 and Qwen3 carry sliding-window attention (``use_sliding_window``,
``sliding_window``, ``layer_types``, or ``max_window_layers``: the layers from it on windowed), read
into ``model.sliding_window`` / ``model.layer_types`` and written back; Llama has none.

The chunk's names are Hugging Face's without the ``model.`` prefix and its rotary convention is
rotate-half, so no tensor is permuted: a conversion renames, splits or concatenates along the tp
dimension and pads the vocabulary. Llama 3.1's rotary scaling is written both as transformers 5
does (``rope_parameters``) and as older checkpoints carry it (``rope_scaling`` + ``rope_theta``),
and read from either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .args import FULL, SLIDING
from .hf_adapter import ConvertError, check_config_fields, refuse, rope_config, rope_from_hf

if TYPE_CHECKING:
    from ..config import Config
    from .args import ModelArgs

# model_type -> (architecture, what the family's options must be)
VARIANTS = {"llama": ("LlamaForCausalLM", dict(qkv_bias=False, qk_norm=False)),
            "qwen2": ("Qwen2ForCausalLM", dict(qkv_bias=True, qk_norm=False)),
            "qwen3": ("Qwen3ForCausalLM", dict(qkv_bias=False, qk_norm=True))}


class LlamaAdapter:
    model_types = tuple(VARIANTS)
    architectures = tuple(arch for arch, _ in VARIANTS.values())
    ignored_suffixes = ("rotary_emb.inv_freq",)

    def hf_name(self, name: str) -> str:
        return name if name.startswith("lm_head.") else f"model.{name}"

    def variant(self, cfg: Config) -> str:
        m = cfg.model
        if m.mlp != "swiglu":
            raise ConvertError(f"model.mlp={m.mlp}: no Hugging Face Llama-family architecture has "
                               f"a {m.mlp} MLP; only model.mlp=swiglu converts")
        for model_type, (_, options) in VARIANTS.items():
            if options == dict(qkv_bias=m.qkv_bias, qk_norm=m.qk_norm):
                return model_type
        raise ConvertError("model.qkv_bias=true with model.qk_norm=true matches no Hugging Face "
                           "architecture (Qwen2 has the biases, Qwen3 the QK-norm); nothing "
                           "written")

    def hf_config(self, cfg: Config, args: ModelArgs, dtype_name: str, bos: int | None,
                  eos: int | None) -> dict:
        m = cfg.model
        model_type = self.variant(cfg)
        scaling, max_positions = rope_config(cfg)
        out = {"architectures": [VARIANTS[model_type][0]], "model_type": model_type,
               "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
               "intermediate_size": args.ffn_hidden_size, "num_hidden_layers": m.num_layers,
               "num_attention_heads": m.num_heads, "num_key_value_heads": args.num_kv_heads,
               "head_dim": args.head_dim, "hidden_act": "silu",
               "max_position_embeddings": max_positions, "rms_norm_eps": m.norm_eps,
               # transformers < 5 reads these two
               "rope_theta": m.rope_theta, "rope_scaling": scaling,
               "rope_parameters": {**(scaling or {"rope_type": "default"}),
                                   "rope_theta": m.rope_theta},
               "tie_word_embeddings": bool(m.tie_embeddings),
               "attention_dropout": m.attention_dropout, "initializer_range": m.init_std,
               "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": dtype_name,
               "dtype": dtype_name}
        windowed = args.layer_types is not None and SLIDING in args.layer_types
        if args.sliding_rope is not None:
            raise ConvertError(f"model.sliding_rope={dict(args.sliding_rope)}: "
                               f"{VARIANTS[model_type][0]} has one rotary setting for every "
                               "layer; set it to null (nothing written)")
        if model_type == "llama":
            if windowed:
                raise ConvertError(f"model.sliding_window={args.sliding_window}: "
                                   "LlamaForCausalLM has no sliding window (Qwen2/Qwen3 have: "
                                   "model.qkv_bias or model.qk_norm); nothing written")
            out.update(attention_bias=False, mlp_bias=False)
        elif windowed:
            out.update(use_sliding_window=True, sliding_window=args.sliding_window,
                       max_window_layers=m.num_layers, layer_types=list(args.layer_types))
        else:
            out.update(use_sliding_window=False, sliding_window=None,
                       max_window_layers=m.num_layers)
            if model_type == "qwen3":
                out["attention_bias"] = False
        return out

    def model_type(self, hf: dict) -> str:
        """The variant of a config.json (its model_type, or the one of its architecture)."""
        return hf.get("model_type") \
            or self.model_types[self.architectures.index(hf["architectures"][0])]

    def check(self, hf: dict, where: str) -> None:
        check_config_fields(hf, where, ("vocab_size", "hidden_size", "intermediate_size",
                                        "num_hidden_layers", "num_attention_heads"),
                            ("num_key_value_heads", "head_dim"), ("rms_norm_eps", "rope_theta"),
                            ("tie_word_embeddings", "attention_bias", "mlp_bias"))
        model_type = self.model_type(hf)
        unsupported = {}
        if hf.get("hidden_act", "silu") != "silu":
            unsupported["hidden_act"] = hf["hidden_act"]
        if hf.get("mlp_bias"):
            unsupported["mlp_bias"] = True
        if model_type in ("llama", "qwen3") and hf.get("attention_bias"):
            # on q, k, v and o: the family has q, k, v biases only
            unsupported["attention_bias"] = True
        if hf.get("use_sliding_window") and model_type == "llama":
            unsupported["use_sliding_window"] = True
        refuse(unsupported, where, "llama")
        rope_from_hf(hf, where)

    def model_flags(self, hf: dict, where: str) -> dict[str, object]:
        theta, scaling = rope_from_hf(hf, where)
        heads = hf["num_attention_heads"]
        d = hf.get("head_dim") or hf["hidden_size"] // heads
        model_type = self.model_type(hf)
        flags = {"family": "llama", "num_layers": hf["num_hidden_layers"],
                 "hidden_size": hf["hidden_size"], "num_heads": heads,
                 "num_kv_heads": hf.get("num_key_value_heads") or heads, "head_dim": d
                 if d * heads != hf["hidden_size"] else None,
                 "ffn_hidden_size": hf["intermediate_size"], "vocab_size": hf["vocab_size"],
                 "rope_theta": theta, "norm_eps": hf.get("rms_norm_eps", 1e-6),
                 "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "mlp": "swiglu",
                 "rotary_pct": 1.0, "parallel_residual": False, **VARIANTS[model_type][1]}
        if scaling:
            flags["rope_scaling"] = scaling
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        if window:  # without use_sliding_window transformers runs every layer in full
            layers = hf["num_hidden_layers"]
            first = hf.get("max_window_layers", layers)
            flags["sliding_window"] = window
            flags["layer_types"] = list(hf.get("layer_types") or
                                        [SLIDING if i >= first else FULL for i in range(layers)])
        return flags


ADAPTER = LlamaAdapter()
