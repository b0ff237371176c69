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

from ..config import padded_vocab_size
from ..errors import CheckpointError
from ..optim.optimizer import entry_range
from ..parallel.specs import ParamSpec
from .format import rank_state, read_rank_state


def rank_coords(layout: dict) -> list[tuple[int, int, int]]:
    """(pp_rank, dp_rank, tp_rank) of every rank of ``layout`` (ParallelState's grid order)."""
    grid = np.arange(layout["pp"] * layout["dp"] * layout["tp"]).reshape(layout["pp"], layout["dp"], layout["tp"])
    coords = [None] * grid.size
    for (p, d, t), rank in np.ndenumerate(grid):
        coords[int(rank)] = (p, d, t)
    return coords


class SavedShards:
    """The per-rank files of one checkpoint, opened (memory-mapped) on demand."""

    def __init__(self, path: str, meta: dict):
        self.path, self.layout = path, meta["layout"]
        self.coords = rank_coords(self.layout)
        if len(self.coords) != meta["world_size"]:
            raise CheckpointError(f"{path}/metadata.json: layout {self.layout} does not multiply out to "
                                  f"world_size={meta['world_size']}")
        self._states: dict[int, dict] = {}

    def state(self, rank: int) -> dict:
        if rank not in self._states:
            self._states[rank] = read_rank_state(self.path, rank, mmap=True)
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
            found = entry_range(entry, key, numel, f"checkpoint {self.path}, '{name}' in rank {rank}'s file")
            if found is None:
                continue  # saved before the first step: no moments yet (zeros)
            start, end, piece = found
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
    return int(meta.get("padded_vocab") or padded_vocab_size(vocab_size, divisible_by, meta["layout"]["tp"]))


def tp_slice(saved: SavedShards, spec: ParamSpec, key: str, tp_rank: int, tp: int, saved_padded: int) -> torch.Tensor:
    """Slice ``tp_rank`` of ``tp`` (of shape ``spec.local_shape``) of parameter ``spec.name``'s
    ``key``, cut from the saved tp shards; ``saved_padded`` is the saved layout's vocabulary rows."""
    old_tp, dim, shape = saved.layout["tp"], spec.tp_dim, list(spec.local_shape)
    full = list(shape)  # the global tensor, padded as this layout pads it
    if dim is not None:
        full[dim] *= tp
    old = list(full)  # one saved tp shard
    if spec.vocab:
        old[0] = saved_padded
    if dim is not None:
        if old[dim] % old_tp:
            raise CheckpointError(f"checkpoint {saved.path}: '{spec.name}' cannot have been split {old_tp} ways "
                                  f"along dimension {dim} (size {old[dim]}); it was saved from another model")
        old[dim] //= old_tp
    numel = int(np.prod(old))
    if dim is None:  # replicated over tp: any saved tp rank's copy
        return saved.flat_shard(spec.name, key, 0, numel).view(old)
    lo, hi = tp_rank * shape[dim], (tp_rank + 1) * shape[dim]  # this slice of the global tensor,
    real = min(hi, spec.shape[0]) if spec.vocab else hi  # rows past the vocabulary: zeros
    parts = []
    for t in range(old_tp):  # cut from the saved shards that overlap it
        start, end = max(lo, t * old[dim]), min(real, (t + 1) * old[dim])
        if start < end:
            part = saved.flat_shard(spec.name, key, t, numel).view(old)
            parts.append(part.narrow(dim, start - t * old[dim], end - start))
    pad = list(shape)
    pad[dim] = shape[dim] - sum(x.shape[dim] for x in parts)
    return torch.cat(parts + [torch.zeros(pad)], dim)


def resharded_state(saved: SavedShards, specs: dict[str, ParamSpec], tp_rank: int, tp: int,
                    saved_padded: int) -> dict:
    """The state of a rank of another layout that holds the parameters ``specs`` (its table) at
    ``tp_rank`` of ``tp``: whole tp slices of the masters and moments (any ZeRO stage takes its
    ranges from them); iteration, data position, Adam step and loss scale from the checkpoint.
    Random streams are per rank: not carried."""
    model, moments = {}, {}
    for name, spec in specs.items():
        piece = {key: tp_slice(saved, spec, key, tp_rank, tp, saved_padded)
                 for key in ("master", "exp_avg", "exp_avg_sq")}
        model[name] = piece["master"]
        moments[name] = {"exp_avg": piece["exp_avg"], "exp_avg_sq": piece["exp_avg_sq"]}
    first = saved.state(0)
    return rank_state(iteration=first["iteration"], consumed_samples=first["consumed_samples"], model=model,
                      optimizer_step=first["optimizer"]["step"], moments=moments,
                      scaler=first["optimizer"].get("scaler"))


def saved_config_path(checkpoint: str, explicit: str | None = None) -> str:
    """The config of the run that saved ``checkpoint`` (``RUN_DIR/checkpoints/iter_*``), or ``explicit``."""
    path = explicit or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(checkpoint))), "config.yaml")
    if not os.path.exists(path):
        raise CheckpointError(f"{path} not found: pass --config with the config of the run that saved "
                              f"{checkpoint} (for the architecture)")
    return path
