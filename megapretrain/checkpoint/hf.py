"""Hugging Face ⇄ megapretrain: streaming reads, the logits check, and the family's adapter picked.

Each model family's adapter (``model/llama_hf.py``, ``model/gpt_neox_hf.py``; the protocol in
``model/hf_adapter.py``) owns its tensor names and its ``config.json`` in both directions; every
chunk lays its tensors out as Hugging Face does, so a conversion renames, splits or concatenates
along the tp dimension and pads the vocabulary — nothing is permuted. What this module owns:

- :func:`hf_config` / :func:`model_overrides` / :func:`read_hf_config`: the adapter of the run's
  ``model.family``, or of the family a ``config.json`` names (its ``model_type``);
- :class:`HFWeights`: the tensors of a (sharded) safetensors directory, read by byte range one at a
  time (``tensorfile.py``), so host memory stays at about one tensor whatever the model's size;
- :func:`our_logits_by_layer` / :func:`hf_logits_by_layer`: both models on the same sequences,
  for ``--verify``, each holding one decoder layer (or the embedding, or the final norm and head)
  in memory at a time; :func:`check_verify_fits` refuses up front a check the host cannot hold;
- :func:`our_model` / :func:`our_logits`: our whole model, for tests of small models.
"""

from __future__ import annotations

import contextlib
import json
import os
import re

import torch
from torch import nn

from ..config import Config
from ..errors import read_json_file, size_text
from ..host_memory import available_bytes
from ..model.build import model_args
from ..model.families import FAMILIES, family, family_of_hf
from ..model.hf_adapter import ConvertError, rope_from_hf
from ..user_files import check_kind
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
    check_kind("--hf", hf_dir, "a Hugging Face model directory", "give the directory holding "
               "config.json and *.safetensors (a megapretrain checkpoint converts with to-hf)",
               also=("a Hugging Face model directory",))
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
def greedy(model, tokens: torch.Tensor, new: int) -> torch.Tensor:
    """``new`` greedy tokens after ``tokens`` from our model (no cache: recomputes the prefix)."""
    for _ in range(new):
        nxt = our_logits(model, tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens


# -- the logits check, one layer at a time ---------------------------------------------------------
#
# Both models run in fp32 on the same token sequences, as whole models would, but each is built
# with its parameters on the meta device (no memory) and given the weights of one part at a time:
# the embedding, then each decoder layer, then the final norm and the output layer. A part's
# weights are read from the files just before it runs and dropped right after, so the host holds
# one part (and the activations of a few sequences), never a model: at Llama 3 8B's shape the
# largest part is the embedding (2.1 GB in fp32), where two whole fp32 models took 64 GB.

VERIFY_BATCH, VERIFY_SEQ = 3, 64  # the sequences both models run: 3 of at most 64 tokens


def verify_parts(shapes: dict[str, tuple]) -> dict[str, int]:
    """Elements of each part the check holds at once, from the model's global ``shapes``: each
    decoder layer, the embedding, and the final norm with the output layer."""
    parts: dict[str, int] = {}
    for name, shape in shapes.items():
        part = ".".join(name.split(".")[:2]) if name.startswith("layers.") else \
            "the embedding" if name.startswith("embed_tokens.") else "the final norm and head"
        parts[part] = parts.get(part, 0) + int(torch.Size(shape).numel())
    if "the final norm and head" in parts and "lm_head.weight" not in shapes:  # tied: the embedding
        parts["the final norm and head"] += parts.get("the embedding", 0)
    return parts


def verify_bytes(shapes: dict[str, tuple], vocab: int, seq: int) -> tuple[int, str]:
    """(host bytes ``--verify`` needs, at most, and its largest part's name): the largest part in
    fp32 three times (its parameters, a weight read from the files, its rounding through the
    export's dtype), both models' logits and their difference, and room for the activations and
    transformers' modules."""
    name, numel = max(verify_parts(shapes).items(), key=lambda kv: kv[1])
    logits = VERIFY_BATCH * seq * vocab * 4
    return 3 * 4 * numel + 3 * logits + 512 * 2**20, name


def check_verify_fits(cfg, available: int | None = None) -> None:
    """Refuse, before anything is written, a ``--verify`` the host memory cannot hold."""
    from .reshard import global_shapes

    available = available_bytes() if available is None else available
    seq = min(cfg.train.seq_length, VERIFY_SEQ)
    needed, part = verify_bytes(global_shapes(cfg), cfg.model.vocab_size, seq)
    if available is not None and needed > available:
        raise ConvertError(f"--verify needs about {size_text(needed)} of host memory (a model "
                           f"part at a time: the largest, {part}, in fp32), "
                           f"{size_text(available)} is available: convert without --verify, or "
                           "on a machine with more memory (nothing written)")


def verify_tokens(cfg) -> torch.Tensor:
    """The token sequences ``--verify`` runs through both models (fixed: seed 0)."""
    seq = min(cfg.train.seq_length, VERIFY_SEQ)
    return torch.randint(0, cfg.model.vocab_size, (VERIFY_BATCH, seq),
                         generator=torch.Generator().manual_seed(0))


def _set_parameters(module: nn.Module, tensor_of) -> None:
    """Give every parameter of ``module`` the tensor ``tensor_of(name, param)`` (a meta parameter
    of the shape wanted), without copying it."""
    for name, param in list(module.named_parameters()):
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        value = tensor_of(name, param)
        if tuple(value.shape) != tuple(param.shape):
            raise ConvertError(f"--verify: '{name}' has shape {tuple(value.shape)} in the files, "
                               f"the model expects {tuple(param.shape)}")
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)


def _release(module: nn.Module) -> None:
    """Drop ``module``'s weights: its parameters go back to the meta device."""
    _set_parameters(module, lambda name, p: torch.empty(p.shape, dtype=p.dtype, device="meta"))


@torch.no_grad()
def our_logits_by_layer(cfg, weight, tokens: torch.Tensor) -> torch.Tensor:
    """Our model's fp32 logits (vocabulary unpadded) for ``tokens``, its weights given by
    ``weight(name)`` (global tensors, vocabulary unpadded), built and run one part at a time: the
    embedding, each decoder layer, the final norm and head (see above)."""
    from ..model.decoder import DecoderModel
    from ..parallel.random import RNGTracker
    from ..parallel.state import Group

    args = model_args(cfg)
    tp = Group("tp", [0], None, 0)

    def run(x: torch.Tensor, layer_ids: list[int], first: bool, last: bool) -> torch.Tensor:
        part = DecoderModel(args, tp, layer_ids=layer_ids, pre_process=first, post_process=last,
                            rng=RNGTracker(0, 0, "cpu"), dtype=torch.float32, device="meta")
        specs = part.param_specs()

        def tensor_of(name: str, param) -> torch.Tensor:
            w = weight(name).float()
            if not specs[name].vocab:
                return w.contiguous()
            padded = torch.zeros(param.shape)  # the padding rows stay zero
            padded[:w.shape[0]] = w
            return padded

        _set_parameters(part, tensor_of)
        return part.eval()(x)

    x = run(tokens, [], True, False)
    for i in range(args.num_layers):
        x = run(x, [i], False, False)
    return run(x, [], False, True)[..., :args.vocab_size].float()


@contextlib.contextmanager
def _parameters_on_meta():
    """Inside the block, every parameter a module registers is moved to the meta device (buffers
    stay where they are made: rotary tables are computed at construction): a model of any size is
    built without memory. Each parameter exists on the CPU, untouched, only until it is
    registered."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"),
                                                    requires_grad=param.requires_grad)
    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _parts(module: nn.Module, prefix: str = ""):
    """(name prefix, module) of the parts a model is run by: each member of a list of layers, and
    each other module holding parameters of its own (embedding, final norm, head)."""
    for name, child in module.named_children():
        here = f"{prefix}{name}."
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) or \
                any(True for _ in child.parameters(recurse=False)):
            yield here, child
        else:
            yield from _parts(child, here)


def _renamings(model: nn.Module) -> list[tuple[str, str]]:
    """The (regex, replacement) renamings transformers applies to a stored tensor's name when it
    loads ``model`` (e.g. GPT-NeoX's ``embed_out.`` -> ``lm_head.`` in transformers 5), or none
    where this version of transformers has no such table."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
        transforms = get_model_conversion_mapping(model, add_legacy=False)
    except (ImportError, TypeError, AttributeError):
        return []
    return [(a, b) for t in transforms if type(t) is WeightRenaming
            for a, b in zip(t.source_patterns, t.target_patterns)]


def _hf_sources(model: nn.Module, weights: HFWeights, hf_dir: str) -> dict[str, str]:
    """Which stored tensor each of ``model``'s parameters takes: the one whose name transformers
    loads into it (renamed as transformers renames), or for a tied one (the output layer of a tied
    model) the stored tensor of the parameter it is tied to."""
    stored = {}
    renamings = _renamings(model)
    for key in weights.file_of:
        name = key
        for pattern, replacement in renamings:
            name = re.sub(pattern, replacement, name)
        stored[name] = key
    tied_to = {}
    if getattr(model.config, "tie_word_embeddings", False):
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        full = {id(m): n for n, m in model.named_modules()}
        if out is not None and inp is not None:
            tied_to[f"{full[id(out)]}.weight"] = f"{full[id(inp)]}.weight"
    names: dict[int, list[str]] = {}  # parameters shared under several names: tied
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    sources = {}
    for group in names.values():
        found = [stored[n] for n in group if n in stored]
        for name in group:
            source = found[0] if found else stored.get(tied_to.get(name, ""))
            if source is None:
                raise ConvertError(f"--verify: {hf_dir} has no tensor for '{name}', which "
                                   f"transformers' {type(model).__name__} needs")
            sources[name] = source
    return sources


@torch.no_grad()
def hf_logits_by_layer(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits for ``tokens`` from the model in ``hf_dir`` (its own classes and
    forward), built with its parameters on the meta device and run one part at a time: each part's
    weights are read from the safetensors files when it starts and dropped when it ends."""
    from ..errors import MissingPackageError
    try:
        import transformers
    except ImportError:
        raise MissingPackageError("--verify needs transformers: pip install "
                                  "'megapretrain[hf]'") from None
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    with _parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    weights = HFWeights(hf_dir)
    try:
        sources = _hf_sources(model, weights, hf_dir)
        for prefix, part in _parts(model):
            def load(module, _inputs, prefix=prefix):
                _set_parameters(module, lambda name, p: weights.narrow(
                    sources[prefix + name], None, 0, 0).float().contiguous())
            part.register_forward_pre_hook(load)
            part.register_forward_hook(lambda module, _inputs, _output: _release(module))
        return model(tokens, use_cache=False).logits.float()
    finally:
        weights.close()
