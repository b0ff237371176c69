"""torchtitan Llama 3 checkpoints (``torch.distributed.checkpoint``, DCP) ⇄ megapretrain weights.

A torchtitan checkpoint is a ``step-N/`` directory holding ``.metadata`` and ``__R_I.distcp``
files. Its metadata records every tensor's global shape, so one process reads any tensor whole,
whatever the layout (FSDP, tp, pp) that saved it: :class:`DCPTensors` loads a one-key state dict
at a time, and host memory stays near the largest tensor. The model's keys are torchtitan's module
names, at the top level (model-only exports and full checkpoints of recent torchtitan) or under
``model.`` (older full checkpoints); two spellings exist and both are read:

- ``released`` (torchtitan ≤ 0.2): ``layers.{i}.attention.wq.weight`` ... and ``output.weight``;
- ``main`` (torchtitan's main branch since mid-2026): ``layers.{i}.attention.qkv_linear.wq.weight``
  ... and ``lm_head.weight``.

torchtitan's rotary embedding rotates adjacent pairs of a head's dims (``view_as_complex``), ours
(and Hugging Face's) the two halves: ``wq`` and ``wk`` rows are permuted within each head on the
way in and out, so both models compute the same logits. Every other tensor is renamed only.

A full checkpoint also holds torchtitan's optimizer, as
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` gives it with flattened keys
under ``optimizer``: AdamW's ``optimizer.state.{fqn}.exp_avg``, ``.exp_avg_sq`` and ``.step`` (a 0-d
tensor per parameter) by the model's key ``fqn`` (no ``model.`` prefix), and its hyperparameters
under ``optimizer.param_groups.{fqn}.*`` (pickled objects, not read: ours come from the config).
The moments are elementwise, so they take the weights' renaming and q/k row permutation
(:meth:`TorchtitanWeights.moment`). The rest (``lr_scheduler``, ``dataloader``, ``train_state``)
is not read.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings

import torch

from ..errors import UserError
from ..model.hf_adapter import ConvertError
from ..user_files import check_kind
from .tensorfile import weight_dtype_problem

METADATA = ".metadata"
STEP = re.compile(r"step-(\d+)$")
# torchtitan's Llama 3 rotary: theta 500000 and Llama 3.1 scaling with these factors, in every
# Llama 3 model it ships (its released versions apply the scaling unconditionally)
ROPE_THETA = 500000.0
ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
STYLES = ("released", "main")
MODEL_ROOTS = ("tok_embeddings", "layers", "norm", "output", "lm_head")
IGNORED = ("freqs_cis",)  # a buffer some torchtitan versions save: recomputed, never read
OPTIMIZER_STATE = "optimizer.state."  # AdamW's state by parameter (flattened optimizer keys)
ADAM = ("exp_avg", "exp_avg_sq")
_TOP = {"embed_tokens.weight": "tok_embeddings.weight", "norm.weight": "norm.weight"}
_HEAD = {"released": "output.weight", "main": "lm_head.weight"}
_LAYER = {"input_layernorm.weight": "attention_norm.weight",
          "self_attn.q_proj.weight": "attention.wq.weight",
          "self_attn.k_proj.weight": "attention.wk.weight",
          "self_attn.v_proj.weight": "attention.wv.weight",
          "self_attn.o_proj.weight": "attention.wo.weight",
          "post_attention_layernorm.weight": "ffn_norm.weight",
          "mlp.gate_proj.weight": "feed_forward.w1.weight",
          "mlp.up_proj.weight": "feed_forward.w3.weight",
          "mlp.down_proj.weight": "feed_forward.w2.weight"}
_ROTATED = {"self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k"}


def check_model(cfg) -> None:
    """torchtitan's Llama 3 is the llama family without options: refuse what it cannot hold."""
    m = cfg.model
    wrong = [(f, v, ok) for f, v, ok in (("family", m.family, "llama"), ("mlp", m.mlp, "swiglu"),
                                         ("qkv_bias", m.qkv_bias, False),
                                         ("qk_norm", m.qk_norm, False),
                                         ("rotary_pct", m.rotary_pct, 1.0),
                                         ("sliding_window", m.sliding_window, None),
                                         ("parallel_residual", bool(m.parallel_residual), False))
             if v != ok]
    kind = (m.rope_scaling or {}).get("rope_type", (m.rope_scaling or {}).get("type", "llama3"))
    if kind not in ("llama3", "default"):
        wrong.append(("rope_scaling", m.rope_scaling, "llama3 or null"))
    if wrong:
        f, v, ok = wrong[0]
        raise ConvertError(f"model.{f}={v}: torchtitan's Llama 3 has {f}={ok}; only models of its "
                           "architecture convert to and from torchtitan")


def titan_name(name: str, style: str = "released", prefix: str = "") -> str:
    """torchtitan's key for our parameter ``name`` in key ``style``, under ``prefix``."""
    layer = re.match(r"layers\.(\d+)\.(.+)$", name)
    if layer is None:
        return prefix + (_HEAD[style] if name == "lm_head.weight" else _TOP[name])
    part = _LAYER[layer.group(2)]
    if style == "main" and part.startswith(("attention.wq", "attention.wk", "attention.wv")):
        part = part.replace("attention.", "attention.qkv_linear.")
    return f"{prefix}layers.{layer.group(1)}.{part}"


def to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k projection from rotate-half order (dims i and i + d/2 rotate together) to
    torchtitan's adjacent pairs (dims 2i and 2i + 1), within each of ``heads`` heads."""
    rows, cols = w.shape
    d = rows // heads
    return w.reshape(heads, 2, d // 2, cols).transpose(1, 2).reshape(rows, cols)  # (h·d, hidden)


def from_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`to_pairs`."""
    rows, cols = w.shape
    d = rows // heads
    return w.reshape(heads, d // 2, 2, cols).transpose(1, 2).reshape(rows, cols)  # (h·d, hidden)


def find_dcp(path: str) -> str:
    """The DCP directory ``path`` names: itself when it holds ``.metadata``, else the newest
    ``step-N/`` with one in it or in its ``checkpoint/`` folder (a torchtitan run's layout)."""
    if os.path.isfile(os.path.join(path, METADATA)):
        return path
    check_kind("--dcp", path, "a torchtitan checkpoint", "pass a torchtitan checkpoint's step-N "
               "directory (.metadata + *.distcp files), or the run directory holding them")
    if not os.path.isdir(path):
        raise ConvertError(f"--dcp {path} is not a directory: pass a torchtitan checkpoint's "
                           "step-N directory (.metadata + *.distcp files)")
    for root in (path, os.path.join(path, "checkpoint")):
        if not os.path.isdir(root):
            continue
        steps = sorted((int(m.group(1)), name) for name in os.listdir(root)
                       if (m := STEP.match(name)) and
                       os.path.isfile(os.path.join(root, name, METADATA)))
        if steps:
            return os.path.join(root, steps[-1][1])
    raise ConvertError(f"--dcp {path} is not a torch.distributed.checkpoint directory (no "
                       f"{METADATA}) and holds no step-N/ with one: pass a torchtitan "
                       "checkpoint's step-N directory")


class DCPTensors:
    """The tensors of a DCP directory by key: global shapes from its metadata, each tensor read
    whole by one process (no process group), one at a time."""

    def __init__(self, path: str):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = path
        try:
            meta = self._metadata = FileSystemReader(path).read_metadata()
        except Exception as exc:  # unpickling a damaged file raises anything
            raise ConvertError(f"{path}/{METADATA} cannot be read ({type(exc).__name__}: {exc}); "
                               "it is damaged or not a torch.distributed.checkpoint") from None
        found = getattr(meta, "state_dict_metadata", None)
        if not isinstance(found, dict):
            raise ConvertError(f"{path}/{METADATA} is not a torch.distributed.checkpoint's "
                               "metadata; pass a torchtitan checkpoint's step-N directory")
        self.keys = list(found)
        self.shapes = {k: tuple(m.size) for k, m in found.items()
                       if isinstance(m, TensorStorageMetadata)}
        self.dtypes = {k: m.properties.dtype for k, m in found.items() if k in self.shapes}

    def read(self, key: str) -> torch.Tensor:
        """Tensor ``key`` whole, in its saved dtype, put together from every file holding part."""
        import torch.distributed.checkpoint as dcp

        out = torch.empty(self.shapes[key], dtype=self.dtypes[key])
        try:
            with _one_process():
                dcp.load({key: out}, storage_reader=_known_metadata(self.path, self._metadata),
                         no_dist=True)
        except (Exception, dcp.CheckpointException) as exc:  # a missing or truncated file
            raise ConvertError(f"{self.path}: tensor '{key}' cannot be read ({type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''}); the checkpoint "
                               "is incomplete or damaged") from None
        return out


def _known_metadata(path: str, metadata):
    """A ``FileSystemReader`` of ``path`` whose metadata is read already: a read of one tensor does
    not unpickle the whole ``.metadata`` again (a full checkpoint's lists every tensor)."""
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(path)
    reader.read_metadata = lambda *args, **kwargs: metadata
    return reader


class TorchtitanWeights:
    """A torchtitan Llama 3 checkpoint's weights as our parameters: global fp32 tensors by our
    names, q/k rows put in rotate-half order (:meth:`check` first: it binds the model's heads)."""

    def __init__(self, tensors: DCPTensors):
        self.dcp = tensors
        self.heads = (0, 0)  # (query heads, key/value heads), from check()
        roots = {k.split(".")[0] for k in tensors.keys}
        self.prefix = "model." if "tok_embeddings.weight" not in tensors.shapes and \
            "model.tok_embeddings.weight" in tensors.shapes else ""
        if self.prefix + "tok_embeddings.weight" not in tensors.shapes:
            raise ConvertError(f"{tensors.path} holds no 'tok_embeddings.weight' (its keys: "
                               f"{', '.join(sorted(roots)[:6])}): it is not a torchtitan Llama "
                               "checkpoint")
        self.style = "main" if any(".attention.qkv_linear." in k for k in tensors.keys) \
            else "released"
        self.head = next((self.prefix + h for h in _HEAD.values()
                          if self.prefix + h in tensors.shapes), None)
        # what else the checkpoint holds (optimizer, lr_scheduler, dataloader, train_state)
        self.others = sorted(roots - set(MODEL_ROOTS) - {"model"} - set(IGNORED))

    def key(self, name: str) -> str:
        if name == "lm_head.weight" and self.head is not None:
            return self.head
        return titan_name(name, self.style, self.prefix)

    def model_keys(self) -> list[str]:
        """The checkpoint's model tensors (every key under a model root, buffers aside)."""
        n = len(self.prefix)
        return [k for k in self.dcp.keys if k.startswith(self.prefix)
                and k[n:].split(".")[0] in MODEL_ROOTS and not k.endswith(IGNORED)]

    def check(self, shapes: dict[str, tuple], tied: bool, heads: tuple[int, int]) -> None:
        """Every one of our parameters (``shapes``: global shapes from the flags) has its tensor, of
        its shape, and every model tensor of the checkpoint has a place: one line naming both.
        ``heads``: the model's (query heads, key/value heads), which q/k rows are permuted by."""
        self.heads = heads
        for key in self.model_keys():
            problem = weight_dtype_problem(key, self.dcp.dtypes.get(key, torch.float32))
            if problem:
                raise ConvertError(f"{self.dcp.path}: {problem}")
        fix = "set --model.* (or --config) to the checkpoint's model"
        mine = {self.key(n): n for n in shapes}
        for key in self.model_keys():
            if key == self.head and tied:
                continue
            if key not in mine:
                raise ConvertError(f"{self.dcp.path}: tensor '{key}' {self.dcp.shapes.get(key)} "
                                   f"has no place in the model the flags describe "
                                   f"(model.num_layers={_layers(shapes)}); {fix}")
        for key, name in mine.items():
            if key not in self.dcp.shapes:
                hint = ("it ties the output layer to the embedding: pass --model.tie_embeddings "
                        "true" if name == "lm_head.weight" else fix)
                raise ConvertError(f"{self.dcp.path} has no '{key}' (the flags' '{name}' "
                                   f"{tuple(shapes[name])}); {hint}")
            if self.dcp.shapes[key] != tuple(shapes[name]):
                raise ConvertError(f"{self.dcp.path}: tensor '{key}' has shape "
                                   f"{self.dcp.shapes[key]}, but the flags give "
                                   f"{tuple(shapes[name])} for it; {fix}")
        if tied and self.head is not None:
            embed = self.dcp.read(self.key("embed_tokens.weight"))
            if self.dcp.shapes[self.head] != tuple(embed.shape) or \
                    not torch.equal(self.dcp.read(self.head), embed):
                raise ConvertError(f"{self.dcp.path}: '{self.head}' differs from the embedding, "
                                   "but --model.tie_embeddings is true (one would be dropped): "
                                   "pass --model.tie_embeddings false")

    def get(self, name: str) -> torch.Tensor:
        """Our parameter ``name``, global, fp32."""
        return self._ours(name, self.key(name))

    def _ours(self, name: str, key: str) -> torch.Tensor:
        """Tensor ``key`` as parameter ``name`` (or its state) is held here: fp32, finite, q/k
        rows in rotate-half order."""
        w = self.dcp.read(key).float()
        if not torch.isfinite(w).all():
            raise ConvertError(f"{self.dcp.path}: '{key}' holds NaN or infinite values; these "
                               "weights cannot be trained from (nothing written)")
        part = name.split(".", 2)[-1]
        if part in _ROTATED:
            return from_pairs(w, self.heads[0] if _ROTATED[part] == "q" else self.heads[1])
        return w

    def state_key(self, name: str, key: str) -> str:
        """torchtitan's optimizer-state key ``key`` (``exp_avg``, ``exp_avg_sq``, ``step``) of our
        parameter ``name``: a tied output layer's state is the embedding's."""
        if name == "lm_head.weight" and self.head is None:
            name = "embed_tokens.weight"
        fqn = self.key(name)[len(self.prefix):]
        return f"{OPTIMIZER_STATE}{fqn}.{key}"

    def adam_step(self, shapes: dict[str, tuple]) -> int | None:
        """The AdamW step of the checkpoint's optimizer state for our parameters ``shapes``
        (global shapes), checked: every parameter's moments of its shape and one step for all;
        None when the checkpoint holds no AdamW state (a model-only export)."""
        held = [k for k in self.dcp.shapes if k.startswith(OPTIMIZER_STATE)]
        if not any(k.endswith(".exp_avg") for k in held):
            return None
        steps = {}
        for name, shape in shapes.items():
            for key in ADAM:
                found = self.dcp.shapes.get(self.state_key(name, key))
                if found != tuple(shape):
                    what = "has none" if found is None else f"holds {found}"
                    raise ConvertError(f"{self.dcp.path}: the optimizer state "
                                       f"'{self.state_key(name, key)}' {what}, the weight's shape "
                                       f"is {tuple(shape)}: its optimizer state is not AdamW's "
                                       "for this model; convert its weights only with "
                                       "--weights-only")
            step = self.state_key(name, "step")
            if self.dcp.shapes.get(step) not in ((), (1,)):
                raise ConvertError(f"{self.dcp.path} has no AdamW step '{step}': the checkpoint is "
                                   "incomplete; convert its weights only with --weights-only")
            steps[step] = float(self.dcp.read(step).item())
        values = sorted(set(steps.values()))
        if len(values) > 1 or values[0] != int(values[0]) or values[0] < 0:
            raise ConvertError(f"{self.dcp.path}: AdamW's steps differ between parameters or are "
                               f"not whole ({', '.join(f'{v:g}' for v in values[:3])}); one step "
                               "count is kept here: convert its weights only with --weights-only")
        return int(values[0])

    def moment(self, name: str, key: str) -> torch.Tensor:
        """AdamW's ``key`` (``exp_avg`` or ``exp_avg_sq``) of our parameter ``name``, global,
        fp32, permuted as the weight is."""
        return self._ours(name, self.state_key(name, key))


def _layers(shapes: dict) -> int:
    return len({n.split(".")[1] for n in shapes if n.startswith("layers.")})


def global_slice(read, spec, tp_rank: int) -> torch.Tensor:
    """Rank ``tp_rank``'s fp32 slice (``spec.local_shape``) of ``spec``'s weight (or state),
    cut from the one global tensor ``read(name)`` gives; rows past the vocabulary are zero."""
    local, dim = tuple(spec.local_shape), spec.tp_dim
    w = read(spec.name)
    if dim is not None:
        lo = tp_rank * local[dim]
        hi = min(lo + local[dim], spec.shape[dim])  # rows past the vocabulary: zeros
        w = w.narrow(dim, min(lo, w.shape[dim]), max(0, hi - lo))
        if w.shape[dim] < local[dim]:
            pad = list(local)
            pad[dim] -= w.shape[dim]
            w = torch.cat([w, torch.zeros(pad)], dim)
    return w.contiguous()


def save_dcp(directory: str, tensors: dict[str, tuple[tuple, torch.dtype]], produce) -> None:
    """A DCP checkpoint in ``directory`` (one process, no process group) of the tensors
    ``tensors`` (key -> (shape, dtype)), each made by ``produce(key)`` only when it is written:
    the planner sees shapes only (meta tensors), and each tensor is its own file, so about one
    tensor is in memory at a time."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class LazySavePlanner(DefaultSavePlanner):
        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            return produce(write_item.index.fqn)

    state = {k: torch.empty(shape, dtype=dtype, device="meta")
             for k, (shape, dtype) in tensors.items()}
    try:
        with _one_process():
            # a file per tensor: DCP's writer keeps every tensor of a file until the file ends
            writer = dcp.FileSystemWriter(directory, single_file_per_rank=False, thread_count=1)
            dcp.save(state, storage_writer=writer, planner=LazySavePlanner(), no_dist=True)
    except dcp.CheckpointException as exc:  # what a rank raised, wrapped: a refusal stays one line
        cause = _user_error_in(exc)
        if cause is None:
            raise
        raise cause from None


@contextlib.contextmanager
def _one_process():
    """Silence DCP's warning that no process group exists: one process is what is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _user_error_in(exc: BaseException) -> UserError | None:
    """The :class:`UserError` a DCP save raised inside its writer (DCP reports it wrapped in a
    ``CheckpointException``: rank -> (error, frames)), if that is what failed."""
    if isinstance(exc, UserError):
        return exc
    for failure in getattr(exc, "failures", {}).values():
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, UserError):
            return error
    return None
