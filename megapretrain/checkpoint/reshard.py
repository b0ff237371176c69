"""Load a checkpoint saved under another parallel layout (tp, pp, dp, vpp, zero).

The per-rank files key everything by global parameter name: the fp32 master weights as whole
tensor-parallel shards (zero 0) or as ranges ``[start, end)`` of a flattened shard (zero ≥ 1), and
the Adam moments as such ranges. For every parameter it holds, a rank of the new layout rebuilds
its tp slice of the global tensor: it cuts it from the saved tp shards that overlap the slice along
the split dimension, each put together from the ranges its dp ranks saved. Vocabulary rows past
the real vocabulary are padding and zero, as at initialisation, whatever the saved layout padded
to. The optimizer then takes its own ZeRO ranges of the slice, as it does at the same layout.

Files are opened memory-mapped, so a rank reads only the pages it uses. What does not carry across
layouts are the random-number streams (they are per rank): dropout restarts from the seed, while
the weights, Adam moments and step, loss scale, iteration, learning-rate schedule and data position
continue exactly.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from .manager import CheckpointError

VOCAB_PARAMS = ("embed_tokens", "lm_head")


def rank_coords(layout: dict) -> list[tuple[int, int, int]]:
    """(pp_rank, dp_rank, tp_rank) of every rank of ``layout`` (ParallelState's grid order)."""
    grid = np.arange(layout["pp"] * layout["dp"] * layout["tp"]).reshape(layout["pp"], layout["dp"], layout["tp"])
    coords = [None] * grid.size
    for (p, d, t), rank in np.ndenumerate(grid):
        coords[int(rank)] = (p, d, t)
    return coords


class SavedShards:
    """The per-rank files of one checkpoint, opened on demand."""

    def __init__(self, path: str, meta: dict):
        self.path, self.layout = path, meta["layout"]
        self.coords = rank_coords(self.layout)
        if len(self.coords) != meta["world_size"]:
            raise CheckpointError(f"{path}/metadata.json: layout {self.layout} does not multiply out to "
                                  f"world_size={meta['world_size']}")
        self._states: dict[int, dict] = {}

    def state(self, rank: int) -> dict:
        if rank not in self._states:
            file = os.path.join(self.path, f"rank_{rank:05d}.pt")
            try:
                self._states[rank] = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint file {file} is missing: the checkpoint is incomplete") from None
            except Exception as exc:
                raise CheckpointError(f"checkpoint file {file} cannot be read ({type(exc).__name__}: {exc}); "
                                      "load an older checkpoint with --checkpoint.load") from None
        return self._states[rank]

    def flat_shard(self, name: str, key: str, tp_rank: int, numel: int) -> torch.Tensor:
        """The flattened tp shard ``tp_rank`` of parameter ``name``'s ``key`` ("master",
        "exp_avg" or "exp_avg_sq"), put together from every rank that saved part of it."""
        out = torch.zeros(numel, dtype=torch.float32)
        seen = torch.zeros(numel, dtype=torch.bool)
        stage = None  # a tied embedding lives on the first and the last stage: read one of them
        for rank, (pp_rank, _, t) in enumerate(self.coords):
            if t != tp_rank or (stage is not None and pp_rank != stage):
                continue
            state = self.state(rank)
            entry = state["model"].get(name) if key == "master" else state["optimizer"]["params"].get(name)
            if entry is None:
                continue
            stage = pp_rank
            if torch.is_tensor(entry):  # a whole shard (zero 0 masters)
                start, end, piece = 0, entry.numel(), entry.reshape(-1)
            elif key in entry:
                start, end, piece = int(entry["start"]), int(entry["end"]), entry[key].reshape(-1)
            else:
                continue  # saved before the first step: no moments yet (zeros)
            if end > numel or piece.numel() != end - start:
                raise CheckpointError(f"checkpoint {self.path}: '{name}' has {end} elements per tp shard in "
                                      f"rank {rank}'s file, this model expects {numel}: it was saved from "
                                      "another model (compare model.* with the config.yaml of the run that saved it)")
            out[start:end] = piece.float()
            seen[start:end] = True
        if stage is None:
            raise CheckpointError(f"checkpoint {self.path} has no '{name}': it was saved from another model "
                                  "(compare model.* with the config.yaml of the run that saved it)")
        if key == "master" and not bool(seen.all()):
            raise CheckpointError(f"checkpoint {self.path}: the saved ranges of '{name}' do not cover it; "
                                  "the checkpoint is incomplete")
        return out


def saved_padded_vocab(meta: dict, vocab_size: int, divisible_by: int) -> int:
    """Rows the saved layout padded the vocabulary to: recorded in the metadata, or (older
    checkpoints) what this config's ``make_vocab_size_divisible_by`` gives at the saved tp."""
    from ..config import padded_vocab_size
    return int(meta.get("padded_vocab") or padded_vocab_size(vocab_size, divisible_by, meta["layout"]["tp"]))


def tp_slice(saved: SavedShards, name: str, key: str, shape: list[int], dim: int | None, tp_rank: int,
             tp: int, vocab_rows: int | None, saved_padded: int | None) -> torch.Tensor:
    """Slice ``tp_rank`` of ``tp`` of parameter ``name``'s ``key``; ``shape`` is that slice's shape
    and ``dim`` the split dimension (None: replicated). For the embedding and output layer
    ``vocab_rows`` is the real vocabulary and ``saved_padded`` the saved layout's padded rows."""
    old_tp = saved.layout["tp"]
    full = list(shape)  # the global tensor, padded as this layout pads it
    if dim is not None:
        full[dim] *= tp
    old = list(full)  # one saved tp shard
    if vocab_rows is not None:
        old[0] = saved_padded
    if dim is not None:
        if old[dim] % old_tp:
            raise CheckpointError(f"checkpoint {saved.path}: '{name}' cannot have been split {old_tp} ways "
                                  f"along dimension {dim} (size {old[dim]}); it was saved from another model")
        old[dim] //= old_tp
    numel = int(np.prod(old))
    if dim is None:  # replicated over tp: any saved tp rank's copy
        return saved.flat_shard(name, key, 0, numel).view(old)
    lo, hi = tp_rank * shape[dim], (tp_rank + 1) * shape[dim]  # this slice of the global tensor,
    real = min(hi, vocab_rows) if vocab_rows is not None else hi  # rows past the vocabulary: zeros
    parts = []
    for t in range(old_tp):  # cut from the saved shards that overlap it
        start, end = max(lo, t * old[dim]), min(real, (t + 1) * old[dim])
        if start < end:
            part = saved.flat_shard(name, key, t, numel).view(old)
            parts.append(part.narrow(dim, start - t * old[dim], end - start))
    pad = list(shape)
    pad[dim] = shape[dim] - sum(x.shape[dim] for x in parts)
    return torch.cat(parts + [torch.zeros(pad)], dim)


def resharded_state(path: str, meta: dict, fragments: dict, tp_rank: int, tp: int,
                    vocab_size: int, divisible_by: int) -> dict:
    """This rank's state from a checkpoint of another layout, in the form the optimizer's loaders
    take: whole tp-slice tensors by name for the masters and the moments. ``fragments`` maps the
    names this rank holds to ``(shard, fragment)`` (the optimizer's ``fragments``)."""
    saved = SavedShards(path, meta)
    padded = saved_padded_vocab(meta, vocab_size, divisible_by)
    first = saved.state(0)
    model, params = {}, {}
    for name, (_, frag) in fragments.items():
        vocab = vocab_size if name.split(".")[0] in VOCAB_PARAMS else None
        state = {key: tp_slice(saved, name, key, list(frag.param.shape), getattr(frag.param, "tp_shard_dim", None),
                               tp_rank, tp, vocab, padded)
                 for key in ("master", "exp_avg", "exp_avg_sq")}
        model[name] = state["master"]
        params[name] = {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
    return {"iteration": first["iteration"], "consumed_samples": first["consumed_samples"], "model": model,
            "optimizer": {"step": first["optimizer"]["step"], "params": params,
                          "scaler": first["optimizer"].get("scaler")}}


def saved_config_path(checkpoint: str, explicit: str | None = None) -> str:
    """The config of the run that saved ``checkpoint`` (``RUN_DIR/checkpoints/iter_*``), or ``explicit``."""
    path = explicit or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(checkpoint))), "config.yaml")
    if not os.path.exists(path):
        raise CheckpointError(f"{path} not found: pass --config with the config of the run that saved "
                              f"{checkpoint} (for the architecture)")
    return path


def stage_parameters(cfg, plan, pp_rank: int, tp_rank: int) -> dict:
    """name -> (shape, split dim) of every parameter one (pp, tp) rank of ``plan`` holds, read off
    model chunks built on the meta device (nothing is allocated)."""
    from ..model.llama import LlamaModel
    from ..parallel.pipeline import chunk_layers
    from ..parallel.random import RNGTracker
    from ..parallel.state import Group
    from ..parallel.tensor import shard_dims_of
    from ..trainer import model_args

    args, p = model_args(cfg, plan), cfg.parallel
    tp = Group("tp", list(range(plan.tp)), None, tp_rank)
    out = {}
    for v, layer_ids in enumerate(chunk_layers(args.num_layers, p.pp, p.vpp, pp_rank, p.pipeline_layers)):
        with torch.device("meta"):  # shapes only
            chunk = LlamaModel(args, tp, layer_ids=layer_ids, pre_process=pp_rank == 0 and v == 0,
                               post_process=pp_rank == p.pp - 1 and v == p.vpp - 1,
                               rng=RNGTracker(0, 0, "cpu"), device="meta")
        dims = shard_dims_of(chunk)
        out.update({name: (list(param.shape), dims.get(name)) for name, param in chunk.named_parameters()})
    return out
