"""Megatron-LM ⇄ megapretrain: ``torch_dist`` checkpoints, read and written tensor by tensor.

A Megatron-LM run saved with ``--ckpt-format torch_dist`` holds
``latest_checkpointed_iteration.txt`` and ``iter_NNNNNNN/`` directories; each is a PyTorch
distributed checkpoint (``.metadata`` + ``__R_F.distcp`` files) plus ``common.pt`` (the pickled
non-tensor state: ``args``, ``iteration``, ``checkpoint_version``) and ``metadata.json``
(``{"sharded_backend": "torch_dist", ...}``). The ``.metadata`` records every tensor's global
shape and the chunks each rank wrote, so one process reads any part of any tensor, whatever
tp/pp the run had: :class:`MegatronCheckpoint` reads one layer of one tensor at a time
(:class:`_ChunkReader`), and :func:`write_megatron` writes one layer at a time
(:class:`_StreamingSavePlanner`), so memory stays at about one layer's
tensor.

Megatron-Core's GPT keys (``GPTModel.sharded_state_dict``) name a whole stack of layers: the
decoder's tensors carry a leading layer dimension
(``decoder.layers.self_attention.linear_qkv.weight`` is ``(L, (q + 2·kv)·d, h)``). Within a layer:

- ``linear_qkv`` interleaves per query group: for each of the ``kv`` groups, its ``q/kv`` query
  heads, then its key head, then its value head (the same for its bias);
- ``linear_fc1`` is ``[gate; up]`` (SwiGLU), ``linear_fc2`` the down projection;
- the norms are ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight`` (the names both
  the Transformer Engine and the local layer specs save under), or ``input_layernorm.weight`` /
  ``pre_mlp_layernorm.weight`` in checkpoints of specs that keep them apart (read either);
- ``output_layer.weight`` is absent when the output layer is tied to the embedding.

Rotary embeddings are rotate-half in both (Megatron's default ``rotary_interleaved=False``), so
nothing else is permuted. The embedding's rows are Megatron's padded vocabulary; the padding rows
are dropped on import when ``model.vocab_size`` is smaller, and written as zeros on export.

Megatron-Core's non-distributed optimizers save their state beside the model in model space
(``dist_checkpointing/optimizer.py``: ``make_sharded_optimizer_tensor`` reuses each model tensor's
sharding under the key ``optimizer.state.{state}.{model key}``): Adam's ``exp_avg`` and
``exp_avg_sq``, and with bf16/fp16 training (``Float16OptimizerWithFloat16Params``) the fp32 master
``fp32_param``; the step, one for all parameters, is ``common_step`` in ``common.pt`` (under
``optimizer.state``, or ``optimizer.optimizer.state`` for the fp16/bf16 one). The distributed
optimizer's ``fully_reshardable`` format writes the same model-space keys (its master is ``param``)
and its step in every param group of ``optimizer.optimizer.param_groups`` (``distrib_optimizer.py``,
``sharded_param_state_fully_reshardable`` and ``state_dict``). These are read through the same layer
reads and q/k/v, gate/up splits as the weights (:func:`reader_of` with ``state``). The distributed
optimizer's other formats (``dp_reshardable``'s per-bucket buffers, ``fully_sharded_model_space``'s
flattened shards) are not read: the optimizer starts fresh (:func:`adam_state` says why).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import pickle
import types
import warnings

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..errors import UserError
from ..model.args import kv_heads
from ..user_files import MEGATRON_ITER, check_kind

LATEST = "latest_checkpointed_iteration.txt"
COMMON = "common.pt"
CONFIG = "metadata.json"
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
           "common_backend": "torch", "common_backend_version": 1}
CHECKPOINT_VERSION = 3.0  # what Megatron-LM writes into common.pt

LAYERS = "decoder.layers."
TOP = {"embed_tokens.weight": "embedding.word_embeddings.weight",
       "norm.weight": "decoder.final_layernorm.weight",
       "lm_head.weight": "output_layer.weight"}
# our per-layer name (after "layers.{i}.") -> Megatron's stacked keys (the first is written; any
# is read), and which part of the stacked tensor it is (None: all of it)
PER_LAYER = {
    "input_layernorm.weight": (("self_attention.linear_qkv.layer_norm_weight",
                                "input_layernorm.weight"), None),
    "post_attention_layernorm.weight": (("mlp.linear_fc1.layer_norm_weight",
                                         "pre_mlp_layernorm.weight"), None),
    "self_attn.q_proj.weight": (("self_attention.linear_qkv.weight",), "q"),
    "self_attn.k_proj.weight": (("self_attention.linear_qkv.weight",), "k"),
    "self_attn.v_proj.weight": (("self_attention.linear_qkv.weight",), "v"),
    "self_attn.q_proj.bias": (("self_attention.linear_qkv.bias",), "q"),
    "self_attn.k_proj.bias": (("self_attention.linear_qkv.bias",), "k"),
    "self_attn.v_proj.bias": (("self_attention.linear_qkv.bias",), "v"),
    "self_attn.o_proj.weight": (("self_attention.linear_proj.weight",), None),
    "self_attn.q_norm.weight": (("self_attention.q_layernorm.weight",), None),
    "self_attn.k_norm.weight": (("self_attention.k_layernorm.weight",), None),
    "mlp.gate_proj.weight": (("mlp.linear_fc1.weight",), "gate"),
    "mlp.up_proj.weight": (("mlp.linear_fc1.weight",), "up"),
    "mlp.down_proj.weight": (("mlp.linear_fc2.weight",), None),
}
# the layers' modules whose (Transformer Engine) extra state Megatron-Core saves and loads
EXTRA_STATE = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
               "mlp.linear_fc2")


class MegatronError(UserError):
    """A Megatron-LM checkpoint that cannot be read or written as asked; the message names the
    file or flag and what to do."""


def megatron_place(name: str) -> tuple[tuple[str, ...], int | None, str | None]:
    """Where our parameter ``name`` lives in a Megatron checkpoint: its candidate keys, its layer
    in the stack (None: not a layer's), and its part of the key's tensor (q/k/v, gate/up)."""
    if name in TOP:
        return (TOP[name],), None, None
    _, layer, rest = name.split(".", 2)  # layers.{i}.{rest}
    if rest not in PER_LAYER:
        raise MegatronError(f"parameter '{name}' has no Megatron-Core GPT counterpart; only the "
                            "llama family (model.family=llama, model.mlp=swiglu) converts")
    keys, part = PER_LAYER[rest]
    return tuple(LAYERS + k for k in keys), int(layer), part


# -- reading ---------------------------------------------------------------------------------------


def iteration_dir(path: str) -> str:
    """The ``iter_*`` directory of ``path``: itself, or the one a Megatron-LM run directory's
    ``latest_checkpointed_iteration.txt`` names."""
    check_kind("--megatron", path, "a Megatron-LM torch_dist checkpoint", "pass a Megatron-LM "
               "run saved with --ckpt-format torch_dist or one of its iter_* directories",
               also=("a Megatron-LM checkpoint directory", MEGATRON_ITER))
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        with open(latest) as fh:
            text = fh.read().strip()
        if text == "release":
            return os.path.join(path, "release")
        if not text.isdigit():
            raise MegatronError(f"{latest} holds {text[:40]!r}, not an iteration number; pass "
                                "an iter_* directory as --megatron")
        path = os.path.join(path, f"iter_{int(text):07d}")
    found = _backend(path)
    if found != "torch_dist":
        what = "nothing" if found is None else f"sharded_backend {found!r}"
        raise MegatronError(f"--megatron {path}: not a Megatron-LM torch_dist checkpoint "
                            f"({os.path.join(path, CONFIG)} names {what}, and {LATEST} is not "
                            "there); pass a run saved with --ckpt-format torch_dist or one of its "
                            "iter_* directories")
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise MegatronError(f"--megatron {path}: no .metadata file; the checkpoint is incomplete "
                            "(its save did not finish): pass an earlier iter_* directory")
    return path


def _backend(path: str) -> str | None:
    try:
        with open(os.path.join(path, CONFIG)) as fh:
            found = json.load(fh)
    except (OSError, ValueError):
        return None
    return found.get("sharded_backend") if isinstance(found, dict) else None


def read_common(path: str) -> tuple[dict, str | None]:
    """``common.pt`` of ``path`` and, when it cannot be read, why. It is a pickle: loaded with
    ``weights_only`` (no code runs), allowing the argument namespace, and when that is not enough
    Megatron-Core's own safe classes (its enums in ``args``) if megatron-core is installed — as
    Megatron-Core loads it."""
    file = os.path.join(path, COMMON)
    if not os.path.isfile(file):
        return {}, f"{file} is missing"
    problem = ""
    for extra in (lambda: [], _megatron_safe_globals):
        safe = [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath] + extra()
        # the context removes what it added on exit: add only what is not allowed already
        # (importing megatron-core allows its classes for the whole process, and must stay so)
        safe = [g for g in safe if g not in torch.serialization.get_safe_globals()]
        try:
            with torch.serialization.safe_globals(safe):
                common = torch.load(file, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError,
                ModuleNotFoundError) as err:
            problem = f"{file} could not be read safely ({str(err).splitlines()[0][:120]})"
            continue
        return (common, None) if isinstance(common, dict) else ({}, f"{file} holds no dict")
    return {}, problem


def _megatron_safe_globals() -> list:
    """The classes megatron-core allows in its own pickles, when it is installed."""
    try:
        with warnings.catch_warnings():  # its import warns about optional packages
            warnings.simplefilter("ignore")
            from megatron.core.safe_globals import SAFE_GLOBALS
    except ImportError:
        return []
    return list(SAFE_GLOBALS)


class _ChunkReader(LoadPlanner):
    """A load planner that reads one box of one tensor (``offsets``, the shape of ``out``) into
    ``out``, from whichever saved chunks overlap it."""

    def __init__(self, key: str, offsets: tuple[int, ...], out: torch.Tensor):
        self.key, self.offsets, self.out = key, offsets, out

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        chunk = ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.out.shape)
        md = self.metadata.state_dict_metadata[self.key]
        return LoadPlan(create_read_items_for_chunk_list(self.key, md, [chunk]))

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        raise MegatronError(f"'{self.key}' is stored as bytes, not as a tensor")

    def resolve_tensor(self, read_item) -> torch.Tensor:
        view = self.out
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item, tensor) -> None:
        pass  # resolve_tensor gave a view of ``out``: the data is in place


class MegatronCheckpoint:
    """One ``iter_*`` directory of a Megatron-LM ``torch_dist`` checkpoint: its tensors' global
    shapes, any layer of any tensor read alone, and its ``common.pt`` (``args``, ``iteration``)."""

    def __init__(self, path: str):
        self.path = iteration_dir(path)
        self.reader = FileSystemReader(self.path)
        try:
            self.metadata = self.reader.read_metadata()
        except Exception as err:  # a damaged pickle raises anything
            raise MegatronError(f"{self.path}/.metadata cannot be read ({type(err).__name__}: "
                                f"{err}); the checkpoint is damaged") from None
        self.reader.set_up_storage_reader(self.metadata, True)
        self.common, self.common_problem = read_common(self.path)
        args = self.common.get("args")
        self.args = vars(args) if isinstance(args, argparse.Namespace) else None
        self._last: tuple | None = None  # (key, layer, tensor): q, k and v share one read

    @property
    def iteration(self) -> int:
        it = self.common.get("iteration")
        return it if isinstance(it, int) else 0

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's key and global shape (entries stored as bytes left out)."""
        return {k: tuple(md.size) for k, md in self.metadata.state_dict_metadata.items()
                if isinstance(md, TensorStorageMetadata)}

    def key_of(self, keys: tuple[str, ...]) -> str | None:
        """The first of ``keys`` this checkpoint has as a tensor."""
        found = self.tensors()
        return next((k for k in keys if k in found), None)

    def read(self, key: str, layer: int | None = None) -> torch.Tensor:
        """Tensor ``key`` (``layer``: that layer of a stacked one, without the layer dim)."""
        if self._last and self._last[:2] == (key, layer):
            return self._last[2]
        md = self.metadata.state_dict_metadata[key]
        shape = tuple(md.size)
        offsets = (0,) * len(shape)
        if layer is not None:
            shape, offsets = (1, *shape[1:]), (layer, *offsets[1:])
        out = torch.empty(shape, dtype=md.properties.dtype)
        planner = _ChunkReader(key, offsets, out)
        planner.set_up_planner({}, self.metadata, True)
        plan = self.reader.prepare_local_plan(planner.create_local_plan())
        plan = self.reader.prepare_global_plan([plan])[0]
        self.reader.read_data(plan, planner).wait()
        out = out[0] if layer is not None else out
        self._last = (key, layer, out)
        return out


def split_part(t: torch.Tensor, part: str | None, heads: int, groups: int) -> torch.Tensor:
    """Part ``part`` of a layer's Megatron tensor ``t``: q, k or v of the per-group interleaved
    ``linear_qkv`` (``heads`` query heads in ``groups`` groups), or gate / up of ``linear_fc1``."""
    if part is None:
        return t
    if part in ("gate", "up"):
        return t.chunk(2, 0)[part == "up"]
    per = heads // groups  # query heads per group
    grouped = t.view(groups, per + 2, -1, *t.shape[1:])  # (g, per + 2, d, ...)
    if part == "q":
        return grouped[:, :per].reshape(heads * grouped.shape[2], *t.shape[1:])
    return grouped[:, per + (part == "v")].reshape(groups * grouped.shape[2], *t.shape[1:])


def join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Megatron's ``linear_qkv`` of one layer from q, k and v (their biases too): per group, its
    query heads, its key head, its value head."""
    rest = q.shape[1:]
    q = q.reshape(groups, -1, k.shape[0] // groups, *rest)  # (g, per, d, ...)
    k = k.reshape(groups, 1, -1, *rest)  # (g, 1, d, ...)
    v = v.reshape(groups, 1, -1, *rest)
    return torch.cat([q, k, v], 1).reshape(-1, *rest)  # (g·(per + 2)·d, ...)


# -- the model's shape -----------------------------------------------------------------------------


def _flag(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def model_flags(ckpt: MegatronCheckpoint) -> dict[str, object]:
    """The ``model.*`` settings the checkpoint implies: sizes read off its tensors' shapes (the
    vocabulary: the embedding's rows, Megatron's padded vocabulary, unless ``args.vocab_size``
    gives the tokenizer's), the rest from Megatron's saved ``args`` when ``common.pt`` has them.
    Architectures megapretrain does not have (LayerNorm, GELU, learned positions, biases on every
    linear) are refused naming the argument."""
    shapes = ckpt.tensors()
    embed = shapes.get(TOP["embed_tokens.weight"])
    qkv = shapes.get(LAYERS + "self_attention.linear_qkv.weight")
    if embed is None or qkv is None:
        raise MegatronError(f"--megatron {ckpt.path}: no '{TOP['embed_tokens.weight']}' or "
                            f"'{LAYERS}self_attention.linear_qkv.weight' tensor: not a "
                            "Megatron-Core GPT checkpoint (or one saved with per-layer keys)")
    flags: dict[str, object] = {
        "family": "llama", "mlp": "swiglu", "vocab_size": embed[0], "hidden_size": embed[1],
        "num_layers": qkv[0], "tie_embeddings": TOP["lm_head.weight"] not in shapes,
        "qkv_bias": LAYERS + "self_attention.linear_qkv.bias" in shapes,
        "qk_norm": LAYERS + "self_attention.q_layernorm.weight" in shapes}
    fc1 = shapes.get(LAYERS + "mlp.linear_fc1.weight")
    if fc1 is not None:
        flags["ffn_hidden_size"] = fc1[1] // 2
    a = ckpt.args
    if a is None:
        return flags
    unsupported = {k: a[k] for k, ok in (("normalization", "RMSNorm"), ("swiglu", True),
                                         ("position_embedding_type", "rope"),
                                         ("rotary_interleaved", False), ("add_bias_linear", False),
                                         ("use_rope_scaling", False), ("num_experts", None),
                                         ("window_size", None))
                   if k in a and a[k] != ok}
    if unsupported:
        found = ", ".join(f"{k}={v}" for k, v in unsupported.items())
        raise MegatronError(f"{ckpt.path}/{COMMON}: args {found}: megapretrain's llama family "
                            "has RMSNorm, SwiGLU, rotate-half RoPE, no linear biases but QKV's, no "
                            "experts, no sliding window; this model cannot be converted")
    heads = a.get("num_attention_heads")
    if heads:
        flags["num_heads"] = heads
        flags["num_kv_heads"] = a.get("num_query_groups") if a.get("group_query_attention") \
            else heads
        d = a.get("kv_channels")
        flags["head_dim"] = d if d and d * heads != flags["hidden_size"] else None
    if a.get("vocab_size") and a["vocab_size"] <= embed[0]:  # the tokenizer's, before padding
        flags["vocab_size"] = a["vocab_size"]
    for ours, theirs in (("rope_theta", "rotary_base"), ("norm_eps", "norm_epsilon"),
                         ("rotary_pct", "rotary_percent")):
        if a.get(theirs) is not None:
            flags[ours] = a[theirs]
    return flags


def flag_list(flags: dict[str, object]) -> list[str]:
    return [x for k, v in flags.items() for x in (f"--model.{k}", "null" if v is None
                                                  else _flag(v))]


def expected_shapes(cfg, shapes: dict[str, tuple]) -> dict[str, tuple[int, ...]]:
    """The global shape of every Megatron tensor of a model with our global ``shapes``
    (vocabulary unpadded), layers stacked."""
    m = cfg.model
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        keys, layer, part = megatron_place(name)
        key = keys[0]
        if layer is None:
            out[key] = tuple(shape)
            continue
        if part in ("q", "k", "v"):
            heads, groups = m.num_heads, kv_heads(m)
            rows = shape[0] // (heads if part == "q" else groups) * (heads + 2 * groups)
            shape = (rows, *shape[1:])
        elif part in ("gate", "up"):
            shape = (2 * shape[0], *shape[1:])
        out[key] = (m.num_layers, *shape)
    return out


def check_against(ckpt: MegatronCheckpoint, cfg, shapes: dict[str, tuple], given: str) -> None:
    """Every tensor the model needs is in the checkpoint in the shape the model implies (the
    embedding and output layer may have more rows: Megatron's vocabulary padding); ``given`` says
    where the model's shape came from, for the message."""
    saved = ckpt.tensors()
    if cfg.model.tie_embeddings and TOP["lm_head.weight"] in saved:
        raise MegatronError(f"{ckpt.path} has its own '{TOP['lm_head.weight']}' (an untied output "
                            f"layer), but the model given by {given} has model.tie_embeddings="
                            "true: it would be dropped; pass --model.tie_embeddings false")
    for name in shapes:
        keys, _, _ = megatron_place(name)
        if ckpt.key_of(keys) is None:
            raise MegatronError(f"{ckpt.path}: no tensor '{keys[0]}' (for '{name}'), which the "
                                f"model given by {given} has; compare model.* with the run's "
                                "arguments")
    for key, want in expected_shapes(cfg, shapes).items():
        have = saved.get(key) or saved.get(ckpt.key_of(_alternatives(key)) or "")
        vocab_rows = key in (TOP["embed_tokens.weight"], TOP["lm_head.weight"])
        if vocab_rows and have and have[1:] == want[1:] and have[0] >= want[0]:
            continue
        if have != want:
            raise MegatronError(f"{ckpt.path}: Megatron tensor '{key}' has shape {have}, but the "
                                f"model given by {given} (model.num_layers={cfg.model.num_layers}, "
                                f"hidden_size={cfg.model.hidden_size}, num_heads="
                                f"{cfg.model.num_heads}, num_kv_heads={kv_heads(cfg.model)}, "
                                f"ffn_hidden_size={cfg.model.ffn_hidden_size}, vocab_size="
                                f"{cfg.model.vocab_size}) makes it {want}; fix those flags, or "
                                "pass none to use the checkpoint's")


def _alternatives(key: str) -> tuple[str, ...]:
    for keys, _ in PER_LAYER.values():
        if LAYERS + keys[0] == key:
            return tuple(LAYERS + k for k in keys)
    return (key,)


OPTIMIZER_STATE = "optimizer.state."
ADAM = ("exp_avg", "exp_avg_sq")
# the fp32 master of a bf16/fp16 run's weight: the fp16 optimizer's, the distributed optimizer's
MASTERS = ("fp32_param", "param")


def reader_of(ckpt: MegatronCheckpoint, cfg, state: str | None = None):
    """``weight(name)``: our parameter ``name`` as a global fp32 tensor (vocabulary unpadded),
    read from ``ckpt`` one layer at a time; ``state``: its optimizer state of that name
    (``exp_avg``, ``exp_avg_sq``, ``fp32_param``) instead, cut the same way."""
    m = cfg.model
    prefix = "" if state is None else f"{OPTIMIZER_STATE}{state}."

    def weight(name: str) -> torch.Tensor:
        keys, layer, part = megatron_place(name)
        t = ckpt.read(ckpt.key_of(tuple(prefix + k for k in keys)), layer)
        t = split_part(t, part, m.num_heads, kv_heads(m))
        if name in ("embed_tokens.weight", "lm_head.weight"):
            t = t[:m.vocab_size]  # Megatron's padding rows
        return t.float()
    return weight


def adam_state(ckpt: MegatronCheckpoint,
               shapes: dict[str, tuple]) -> tuple[int | None, str | None, str]:
    """What of a Megatron-Core Adam's model-space state ``ckpt`` holds for our parameters
    ``shapes``: (its step, or None when none is read; the state name of the fp32 masters, None
    when there are none; why nothing is read, for the one line that says the optimizer starts
    fresh)."""
    saved = ckpt.tensors()
    mine = [k for k in saved if k.startswith(OPTIMIZER_STATE)]
    if not mine:
        other = any(k.startswith(("optimizer.", "chained_")) for k in
                    ckpt.metadata.state_dict_metadata)
        return None, None, ("its optimizer state is in a distributed optimizer's own layout "
                            "(not read)" if other else "it holds no optimizer state")
    model_keys = {ckpt.key_of(megatron_place(n)[0]) for n in shapes}
    for state in ADAM:
        for key in sorted(model_keys):
            found = saved.get(f"{OPTIMIZER_STATE}{state}.{key}")
            if found != saved[key]:
                what = "none" if found is None else f"shape {found}"
                return None, None, (f"its '{OPTIMIZER_STATE}{state}.{key}' has {what}, not the "
                                    f"weight's {saved[key]} (a distributed optimizer's "
                                    "flattened shards, or not Adam: not read)")
    step = _saved_step(ckpt.common.get("optimizer"))
    if step is None:
        return None, None, (f"{ckpt.path}/{COMMON} records no single optimizer step "
                            "(common_step, or the param groups' step)")
    masters = next((m for m in MASTERS if all(
        saved.get(f"{OPTIMIZER_STATE}{m}.{k}") == saved[k] for k in model_keys)), None)
    return step, masters, ""


def _saved_step(optimizer) -> int | None:
    """Adam's step in a Megatron optimizer's common state: ``common_step`` under ``state`` (the
    fp32 optimizer's) or ``optimizer.state`` (the fp16/bf16 one's), or the step every param group
    of ``optimizer.param_groups`` carries (the distributed optimizer's)."""
    def whole(step):
        step = step.item() if torch.is_tensor(step) else step
        ok = isinstance(step, (int, float)) and step >= 0 and step == int(step)
        return int(step) if ok else None

    inner = optimizer.get("optimizer") if isinstance(optimizer, dict) else None
    for part in (optimizer, inner):
        if isinstance(part, dict) and isinstance(part.get("state"), dict) \
                and "common_step" in part["state"]:
            return whole(part["state"]["common_step"])
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    steps = {whole(g["step"]) for g in groups or () if isinstance(g, dict) and "step" in g}
    return steps.pop() if len(steps) == 1 else None


# -- writing ---------------------------------------------------------------------------------------


class _StreamingSavePlanner(DefaultSavePlanner):
    """A save planner whose items are made when written: ``items`` maps each write item to a
    function giving its data, so one layer's tensor is in memory at a time."""

    def __init__(self, items: list[tuple[WriteItem, object]]):
        super().__init__(flatten_state_dict=False)
        self.items = items
        self.produce = {item.index: fn for item, fn in items}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan([item for item, _ in self.items])
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        return self.produce[write_item.index]()


def tensor_item(key: str, size: tuple[int, ...], offsets: tuple[int, ...],
                sizes: tuple[int, ...], dtype: torch.dtype) -> WriteItem:
    """The write item of the box ``offsets`` + ``sizes`` of tensor ``key`` (global ``size``)."""
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
    return WriteItem(index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=chunk,
                                                 properties=TensorProperties(dtype=dtype),
                                                 size=torch.Size(size)))


def _no_extra_state() -> io.BytesIO:
    """A layer module's extra state as Megatron-Core stores a sharded object: the pickled list of
    its shards' values, here one empty (no FP8 scaling state: it starts fresh)."""
    buf = io.BytesIO()
    torch.save([None], buf)
    buf.seek(0)
    return buf


def megatron_args(cfg, padded_vocab: int) -> argparse.Namespace:
    """The Megatron-LM arguments describing ``cfg.model`` (for ``--use-checkpoint-args`` and
    for a later import)."""
    m = cfg.model
    heads, groups = m.num_heads, kv_heads(m)
    d = m.head_dim or m.hidden_size // heads
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=heads, group_query_attention=groups != heads,
        num_query_groups=groups, kv_channels=d, vocab_size=m.vocab_size,
        padded_vocab_size=padded_vocab,
        normalization="RMSNorm", norm_epsilon=m.norm_eps, swiglu=True, add_bias_linear=False,
        add_qkv_bias=bool(m.qkv_bias), qk_layernorm=bool(m.qk_norm),
        position_embedding_type="rope", rotary_base=m.rope_theta, rotary_percent=m.rotary_pct,
        rotary_interleaved=False, untie_embeddings_and_output_weights=not m.tie_embeddings,
        seq_length=cfg.train.seq_length, max_position_embeddings=cfg.train.seq_length,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, ckpt_format="torch_dist")


def write_megatron(tmp: str, cfg, shapes: dict[str, tuple], weight, dtype: torch.dtype,
                   padded_vocab: int, iteration: int) -> int:
    """Write a Megatron-LM run directory into ``tmp``: ``iter_NNNNNNN/`` (the distributed
    checkpoint of every weight, ``common.pt``, ``metadata.json``) and
    ``latest_checkpointed_iteration.txt``. ``weight(name)`` gives our global fp32 tensors; each
    layer of each stacked tensor is made when it is written. Returns the bytes of tensors
    written."""
    m = cfg.model
    groups = kv_heads(m)
    items: list[tuple[WriteItem, object]] = []
    total = 0
    for key, size in expected_shapes(cfg, shapes).items():
        if key in (TOP["embed_tokens.weight"], TOP["lm_head.weight"]):
            size = (padded_vocab, *size[1:])
        layered = key.startswith(LAYERS)
        for layer in range(m.num_layers) if layered else [None]:
            box = (1, *size[1:]) if layered else size
            offsets = (layer if layered else 0,) + (0,) * (len(size) - 1)
            item = tensor_item(key, size, offsets, box, dtype)
            items.append((item, lambda k=key, i=layer, b=box: _layer_tensor(
                k, i, b, cfg, weight, groups).to(dtype)))
            total += torch.Size(box).numel() * dtype.itemsize
    for module in EXTRA_STATE:
        for layer in range(m.num_layers):
            key = f"{LAYERS}{module}._extra_state/shard_{layer}_{m.num_layers}"
            items.append((WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO),
                          _no_extra_state))
    folder = os.path.join(tmp, f"iter_{iteration:07d}")
    os.makedirs(folder)
    writer = FileSystemWriter(folder, single_file_per_rank=True, thread_count=1)
    with warnings.catch_warnings():  # that one process writes it all is the intent
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp_save({}, storage_writer=writer, planner=_StreamingSavePlanner(items), no_dist=True)
    torch.save({"args": megatron_args(cfg, padded_vocab), "checkpoint_version": CHECKPOINT_VERSION,
                "iteration": iteration}, os.path.join(folder, COMMON))
    with open(os.path.join(folder, CONFIG), "w") as fh:
        json.dump(BACKEND, fh)
    with open(os.path.join(tmp, LATEST), "w") as fh:
        fh.write(str(iteration))
    return total


_PARTS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj"}


def _layer_tensor(key: str, layer: int | None, box: tuple[int, ...], cfg, weight,
                  groups: int) -> torch.Tensor:
    """Megatron tensor ``key`` (``layer``: that layer, with a leading dim of 1) from ours."""
    if layer is None:
        ours = next(n for n, k in TOP.items() if k == key)
        t = weight(ours)
        if t.shape[0] < box[0]:  # the vocabulary padding: zero rows
            t = torch.cat([t, t.new_zeros(box[0] - t.shape[0], *t.shape[1:])])
        return t.contiguous()
    members = {part: rest for rest, (keys, part) in PER_LAYER.items() if LAYERS + keys[0] == key}
    prefix = f"layers.{layer}."
    if None in members:
        t = weight(prefix + members[None])
    elif "q" in members:
        suffix = members["q"].rsplit(".", 1)[1]  # weight or bias
        t = join_qkv(*(weight(f"{prefix}{_PARTS[p]}.{suffix}") for p in "qkv"), groups)
    else:
        t = torch.cat([weight(prefix + members["gate"]), weight(prefix + members["up"])])
    return t.unsqueeze(0).contiguous()  # (1, ...)
