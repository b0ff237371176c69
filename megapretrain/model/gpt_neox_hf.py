"""The GPT-NeoX family's Hugging Face adapter: ``GPTNeoXForCausalLM`` (Pythia).

Hugging Face's fused ``query_key_value`` holds each head's query, key and value rows one after
the other ([q_h, k_h, v_h] per head) — the layout of the chunk's fused ``qkv_proj`` with one query
per kv head — so a tp rank's rows are a contiguous range of heads and no tensor is permuted; the
other tensors are renamed. Rotary is rotate-half on the first ``rotary_pct`` of each head's dims,
as the chunk computes it. ``config.json`` carries the rotary settings both as transformers 5 writes
them (``rope_parameters`` with ``partial_rotary_factor``) and as older checkpoints do
(``rotary_pct``, ``rotary_emb_base``); either is read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .args import SLIDING
from .hf_adapter import ConvertError, check_config_fields, refuse, rope_config, rope_from_hf

if TYPE_CHECKING:
    from ..config import Config
    from .args import ModelArgs

# the chunk's names -> GPT-NeoX's: outside the layers by prefix, inside them by the module's part
TOP = {"embed_tokens.": "gpt_neox.embed_in.", "norm.": "gpt_neox.final_layer_norm.",
       "lm_head.": "embed_out."}
IN_LAYER = {".self_attn.qkv_proj.": ".attention.query_key_value.",
            ".self_attn.o_proj.": ".attention.dense.", ".mlp.up_proj.": ".mlp.dense_h_to_4h.",
            ".mlp.down_proj.": ".mlp.dense_4h_to_h."}


class GPTNeoXAdapter:
    model_types = ("gpt_neox",)
    architectures = ("GPTNeoXForCausalLM",)
    ignored_suffixes = ("rotary_emb.inv_freq", ".attention.bias", ".attention.masked_bias")

    def hf_name(self, name: str) -> str:
        if not name.startswith("layers."):
            prefix = next(p for p in TOP if name.startswith(p))
            return TOP[prefix] + name[len(prefix):]
        for ours, theirs in IN_LAYER.items():
            name = name.replace(ours, theirs)
        return f"gpt_neox.{name}"

    def hf_config(self, cfg: Config, args: ModelArgs, dtype_name: str, bos: int | None,
                  eos: int | None) -> dict:
        m = cfg.model
        scaling, max_positions = rope_config(cfg)
        if scaling:
            raise ConvertError("model.rope_scaling: GPT-NeoX's Hugging Face model has no "
                               "rotary scaling; nothing written")
        if args.layer_types is not None and SLIDING in args.layer_types:
            raise ConvertError(f"model.sliding_window={args.sliding_window}: GPT-NeoX's Hugging "
                               "Face model has no sliding window; nothing written")
        return {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
                "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
                "intermediate_size": args.ffn_hidden_size, "num_hidden_layers": m.num_layers,
                "num_attention_heads": m.num_heads, "hidden_act": "gelu",
                # transformers < 5 reads these two
                "rotary_pct": m.rotary_pct, "rotary_emb_base": m.rope_theta,
                "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta,
                                    "partial_rotary_factor": m.rotary_pct},
                "max_position_embeddings": max_positions, "layer_norm_eps": m.norm_eps,
                "use_parallel_residual": args.parallel_residual, "attention_bias": True,
                "tie_word_embeddings": False, "attention_dropout": m.attention_dropout,
                "hidden_dropout": m.hidden_dropout, "initializer_range": m.init_std,
                "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": dtype_name,
                "dtype": dtype_name}

    def check(self, hf: dict, where: str) -> None:
        check_config_fields(hf, where, ("vocab_size", "hidden_size", "intermediate_size",
                                        "num_hidden_layers", "num_attention_heads"), (),
                            ("layer_norm_eps", "rotary_pct", "rotary_emb_base"),
                            ("tie_word_embeddings", "use_parallel_residual", "attention_bias"))
        # exact GELU only
        unsupported = {k: hf[k] for k in ("hidden_act",) if hf.get(k, "gelu") != "gelu"}
        if hf.get("attention_bias") is False:
            unsupported["attention_bias"] = False
        if hf.get("tie_word_embeddings"):
            unsupported["tie_word_embeddings"] = True
        refuse(unsupported, where, "gpt_neox")
        if rope_from_hf(hf, where)[1] is not None:
            raise ConvertError(f"{where}: rotary scaling "
                               f"{hf.get('rope_scaling') or hf.get('rope_parameters')} is not "
                               "supported by megapretrain's gpt_neox family; the weights would not "
                               "compute the same function")

    def model_flags(self, hf: dict, where: str) -> dict[str, object]:
        params = hf.get("rope_parameters") or {}
        # transformers' default
        rotary_pct = params.get("partial_rotary_factor") or hf.get("rotary_pct") or 0.25
        heads = hf["num_attention_heads"]
        return {"family": "gpt_neox", "num_layers": hf["num_hidden_layers"],
                "hidden_size": hf["hidden_size"], "num_heads": heads, "num_kv_heads": heads,
                "head_dim": None, "ffn_hidden_size": hf["intermediate_size"],
                "vocab_size": hf["vocab_size"], "rope_theta": rope_from_hf(hf, where)[0],
                "norm_eps": hf.get("layer_norm_eps", 1e-5), "tie_embeddings": False, "mlp": "gelu",
                "rotary_pct": float(rotary_pct),
                "parallel_residual": bool(hf.get("use_parallel_residual", True)), "qkv_bias": False,
                "qk_norm": False}


ADAPTER = GPTNeoXAdapter()
