"""Hugging Face Llama ⇄ megapretrain: configs, tensor names, streaming reads, and the logits check.

The layers already follow Hugging Face's names (without its ``model.`` prefix) and its rotary
convention (rotate-half), so no weight is permuted: a conversion is a mapping of names, a split or
a concatenation along the tp dimension, and the vocabulary padding. What this module owns:

- :func:`hf_config` / :func:`model_overrides`: ``config.json`` from a run's config and back, with
  Llama 3.1's rotary scaling written both as transformers 5 does (``rope_parameters``) and as older
  checkpoints carry it (``rope_scaling`` + ``rope_theta``), and read from either;
- :class:`HFWeights`: the tensors of a (sharded) safetensors directory, read by byte range one at a
  time (``tensorfile.py``), so host memory stays at about one tensor whatever the model's size;
- :func:`our_logits` / :func:`hf_logits`: both models on the same sequences, for ``--verify``.
"""

from __future__ import annotations

import json
import os

import torch

from ..config import Config
from ..errors import ConfigError, UserError, read_json_file
from ..model.args import ROPE_LLAMA3_KEYS, check_rope_scaling
from ..model.build import model_args
from .tensorfile import TensorFile

HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old exports carry: recomputed, not weights


class ConvertError(UserError):
    """Bad input to a conversion; the message names the file or flag and what to do."""


def hf_name(name: str) -> str:
    """The Hugging Face name of parameter ``name``."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def _rope_scaling(cfg: Config) -> dict | None:
    rs = cfg.model.rope_scaling
    if not rs or rs.get("rope_type", rs.get("type")) == "default":
        return None
    return {"rope_type": "llama3", **{k: rs[k] for k in ROPE_LLAMA3_KEYS}}


def hf_config(cfg: Config, dtype: torch.dtype, bos: int | None, eos: int | None) -> dict:
    """``config.json`` of a ``LlamaForCausalLM`` computing what ``cfg.model`` does."""
    m, args = cfg.model, model_args(cfg)
    scaling = _rope_scaling(cfg)
    max_positions = cfg.train.seq_length
    if scaling:
        max_positions = max(max_positions, int(scaling["original_max_position_embeddings"] * scaling["factor"]))
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": m.vocab_size,
            "hidden_size": m.hidden_size, "intermediate_size": args.ffn_hidden_size,
            "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
            "num_key_value_heads": args.num_kv_heads, "head_dim": args.head_dim, "hidden_act": "silu",
            "max_position_embeddings": max_positions, "rms_norm_eps": m.norm_eps,
            "rope_theta": m.rope_theta, "rope_scaling": scaling,  # transformers < 5 reads these two
            "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": m.rope_theta},
            "tie_word_embeddings": bool(m.tie_embeddings), "attention_bias": False, "mlp_bias": False,
            "initializer_range": m.init_std, "bos_token_id": bos, "eos_token_id": eos,
            "torch_dtype": HF_DTYPE_NAMES[dtype], "dtype": HF_DTYPE_NAMES[dtype]}


def generation_config(bos: int | None, eos: int | None) -> dict:
    return {"_from_model_config": True, "bos_token_id": bos, "eos_token_id": eos}


def read_hf_config(hf_dir: str) -> dict:
    """The checked ``config.json`` of a Hugging Face Llama directory."""
    path = os.path.join(hf_dir, "config.json")
    hf = read_json_file(path, ConvertError, "--hf must be a Hugging Face model directory")
    if not isinstance(hf, dict):
        raise ConvertError(f"{path} holds {type(hf).__name__}, not a JSON object; --hf must be a Hugging Face "
                           "model directory")
    if hf.get("model_type") != "llama":
        raise ConvertError(f"{path}: model_type={hf.get('model_type')!r}; only Llama models convert")
    unsupported = {k: hf[k] for k in ("attention_bias", "mlp_bias") if hf.get(k)}
    if hf.get("hidden_act", "silu") != "silu":
        unsupported["hidden_act"] = hf["hidden_act"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    if head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
        unsupported["head_dim"] = head_dim
    if unsupported:
        raise ConvertError(f"{path}: {unsupported} is not supported by megapretrain's Llama; the weights "
                           "would not compute the same function")
    return hf


def rope_from_hf(hf: dict, where: str) -> tuple[float, dict | None]:
    """(rope_theta, model.rope_scaling) of an HF config: ``rope_scaling`` (older checkpoints; it
    wins, as in transformers) or ``rope_parameters`` (transformers 5)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    theta = float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else scaling
    if kind == "default":
        return theta, None
    scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = kind
    if kind == "llama3":
        scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
        extra = sorted(set(scaling) - {"rope_type", *ROPE_LLAMA3_KEYS})
        if extra:
            raise ConvertError(f"{where}: rope_scaling keys {extra} are not part of rope_type llama3; the weights "
                               "would not compute the same function")
    try:
        check_rope_scaling(scaling, f"{where}: rope_scaling")
    except ConfigError as exc:
        raise ConvertError(str(exc)) from None
    return theta, scaling


def model_overrides(hf: dict, where: str) -> list[str]:
    """``--model.*`` overrides describing the HF config's architecture."""
    theta, scaling = rope_from_hf(hf, where)
    flags = {"num_layers": hf["num_hidden_layers"], "hidden_size": hf["hidden_size"],
             "num_heads": hf["num_attention_heads"],
             "num_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
             "ffn_hidden_size": hf["intermediate_size"], "vocab_size": hf["vocab_size"], "rope_theta": theta,
             "norm_eps": hf.get("rms_norm_eps", 1e-6),
             "tie_embeddings": str(bool(hf.get("tie_word_embeddings", False))).lower()}
    out = [x for k, v in flags.items() for x in (f"--model.{k}", str(v))]
    if scaling:
        out += ["--model.rope_scaling", json.dumps(scaling)]
    return out


class HFWeights:
    """The tensors of a Hugging Face safetensors directory (one file, or shards with an index),
    read by byte range: :meth:`narrow` reads only a slice's rows."""

    def __init__(self, hf_dir: str):
        self.dir = hf_dir
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            weight_map = read_json_file(index, ConvertError, "re-save the model with save_pretrained")["weight_map"]
        elif os.path.exists(os.path.join(hf_dir, "model.safetensors")):
            weight_map = None
        else:
            raise ConvertError(f"{hf_dir} has no model.safetensors or model.safetensors.index.json "
                               "(PyTorch .bin weights: load and re-save them with save_pretrained)")
        self._files: dict[str, TensorFile] = {}
        if weight_map is None:
            weight_map = dict.fromkeys(self._file("model.safetensors").keys(), "model.safetensors")
        self.file_of = {k: v for k, v in weight_map.items() if not k.endswith(IGNORED_SUFFIXES)}

    def _file(self, name: str) -> TensorFile:
        if name not in self._files:
            self._files[name] = TensorFile(os.path.join(self.dir, name))
        return self._files[name]

    def names(self) -> list[str]:
        return list(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(self.file_of[name]).shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self._file(self.file_of[name]).dtype(name)

    def narrow(self, name: str, dim: int | None, start: int, length: int) -> torch.Tensor:
        f = self._file(self.file_of[name])
        return f.get(name) if dim is None else f.narrow(name, dim, start, length)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


# -- the logits check -------------------------------------------------------------------------------


def our_model(cfg: Config, weight):
    """A one-process fp32 ``LlamaModel`` of ``cfg.model`` whose parameters ``weight(name)`` gives as
    global tensors (vocabulary unpadded)."""
    from ..model.llama import LlamaModel
    from ..parallel.state import Group

    model = LlamaModel(model_args(cfg), Group("tp", [0], None, 0), dtype=torch.float32)
    specs = model.param_specs()
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = weight(name).float()
            if specs[name].vocab:  # the padding rows stay zero
                p.zero_()[:w.shape[0]].copy_(w)
            else:
                p.copy_(w)
    return model.eval()


@torch.no_grad()
def our_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    vocab = model.args.vocab_size
    return model(tokens)[..., :vocab].float()  # (b, s, v) without the padding columns


@torch.no_grad()
def hf_logits(hf_model, tokens: torch.Tensor) -> torch.Tensor:
    return hf_model(tokens).logits.float()


def load_hf_model(hf_dir: str):
    from ..errors import MissingPackageError
    try:
        import transformers
    except ImportError:
        raise MissingPackageError("--verify needs transformers: pip install 'megapretrain[hf]'") from None
    return transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


@torch.no_grad()
def greedy(model, tokens: torch.Tensor, new: int) -> torch.Tensor:
    """``new`` greedy tokens after ``tokens`` from our model (no cache: recomputes the prefix)."""
    for _ in range(new):
        nxt = our_logits(model, tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens
