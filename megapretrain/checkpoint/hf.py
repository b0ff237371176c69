"""Hugging Face ⇄ megapretrain: streaming reads, the logits check, and the family's adapter picked.

Each model family's adapter (``model/llama_hf.py``, ``model/gpt_neox_hf.py``; the protocol in
``model/hf_adapter.py``) owns its tensor names and its ``config.json`` in both directions; every
chunk lays its tensors out as Hugging Face does, so a conversion renames, splits or concatenates
along the tp dimension and pads the vocabulary — nothing is permuted. What this module owns:

- :func:`hf_config` / :func:`model_overrides` / :func:`read_hf_config`: the adapter of the run's
  ``model.family``, or of the family a ``config.json`` names (its ``model_type``);
- :class:`HFWeights`: the tensors of a (sharded) safetensors directory, read by byte range one at a
  time (``tensorfile.py``), so host memory stays at about one tensor whatever the model's size;
- :func:`our_logits` / :func:`hf_logits`: both models on the same sequences, for ``--verify``.
"""

from __future__ import annotations

import json
import os

import torch

from ..config import Config
from ..errors import read_json_file
from ..model.build import model_args
from ..model.families import FAMILIES, family, family_of_hf
from ..model.hf_adapter import ConvertError, rope_from_hf
from .tensorfile import TensorFile, weight_dtype_problem

# defined with the adapters, importable from here as before
__all__ = ["ConvertError", "rope_from_hf"]

HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
IGNORED_SUFFIXES = tuple(sorted({s for fam in FAMILIES.values() for s in fam.hf.ignored_suffixes}))


def hf_name(name: str, model_family: str) -> str:
    """The Hugging Face name of parameter ``name`` in a ``model_family`` checkpoint."""
    return family(model_family).hf.hf_name(name)


def hf_config(cfg: Config, dtype: torch.dtype, bos: int | None, eos: int | None) -> dict:
    """``config.json`` of the Hugging Face model computing what ``cfg.model`` does (its family's
    architecture: Llama, Qwen2, Qwen3 or GPT-NeoX)."""
    fam = family(cfg.model.family)
    return fam.hf.hf_config(cfg, fam.args(model_args(cfg)), HF_DTYPE_NAMES[dtype], bos, eos)


def generation_config(bos: int | None, eos: int | None) -> dict:
    return {"_from_model_config": True, "bos_token_id": bos, "eos_token_id": eos}


def read_hf_config(hf_dir: str) -> dict:
    """The checked ``config.json`` of a Hugging Face directory of a family megapretrain converts."""
    path = os.path.join(hf_dir, "config.json")
    hf = read_json_file(path, ConvertError, "--hf must be a Hugging Face model directory")
    if not isinstance(hf, dict):
        raise ConvertError(f"{path} holds {type(hf).__name__}, not a JSON object; --hf must be a "
                           "Hugging Face model directory")
    family_of_hf(hf, path).hf.check(hf, path)
    return hf


def _flag(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, list):  # one shell word: [a,b] once the shell drops the quotes
        return json.dumps(value, separators=(",", ":"))
    return "null" if value is None else str(value)


def model_overrides(hf: dict, where: str) -> list[str]:
    """``--model.*`` overrides describing the HF config's architecture (its family inferred)."""
    flags = family_of_hf(hf, where).hf.model_flags(hf, where)
    return [x for k, v in flags.items() for x in (f"--model.{k}", _flag(v))]


class HFWeights:
    """The tensors of a Hugging Face safetensors directory (one file, or shards with an index),
    read by byte range: :meth:`narrow` reads only a slice's rows."""

    def __init__(self, hf_dir: str):
        self.dir = hf_dir
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            found = read_json_file(index, ConvertError, "re-save the model with save_pretrained")
            weight_map = found.get("weight_map") if isinstance(found, dict) else None
            if not (isinstance(weight_map, dict) and
                    all(isinstance(v, str) for v in weight_map.values())):
                raise ConvertError(f"{index}: no 'weight_map' of tensor names to file names; the "
                                   "index is damaged: re-save the model with save_pretrained")
        elif os.path.exists(os.path.join(hf_dir, "model.safetensors")):
            weight_map = None
        else:
            raise ConvertError(f"{hf_dir} has no model.safetensors or model.safetensors.index.json "
                               "(PyTorch .bin weights: load and re-save them with save_pretrained)")
        self._files: dict[str, TensorFile] = {}
        if weight_map is None:
            weight_map = dict.fromkeys(self._file("model.safetensors").keys(), "model.safetensors")
        self.file_of = {k: v for k, v in weight_map.items() if not k.endswith(IGNORED_SUFFIXES)}
        for name in self.file_of:  # headers only: no tensor is read
            problem = weight_dtype_problem(name, self.dtype(name))
            if problem:
                raise ConvertError(f"{os.path.join(hf_dir, self.file_of[name])}: {problem}")

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


# -- the logits check ------------------------------------------------------------------------------


def our_model(cfg: Config, weight):
    """A one-process fp32 model of ``cfg.model`` whose parameters ``weight(name)`` gives as global
    tensors (vocabulary unpadded)."""
    from ..model.decoder import DecoderModel
    from ..parallel.state import Group

    model = DecoderModel(model_args(cfg), Group("tp", [0], None, 0), dtype=torch.float32)
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
        raise MissingPackageError("--verify needs transformers: pip install "
                                  "'megapretrain[hf]'") from None
    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


@torch.no_grad()
def greedy(model, tokens: torch.Tensor, new: int) -> torch.Tensor:
    """``new`` greedy tokens after ``tokens`` from our model (no cache: recomputes the prefix)."""
    for _ in range(new):
        nxt = our_logits(model, tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens
