"""Load a checkpoint saved under another parallel layout (tp, cp, pp, dp, vpp, zero).

The per-rank files key everything by global parameter name: the fp32 master weights as whole
tensor-parallel shards (zero 0) or as ranges ``[start, end)`` of a flattened shard (zero ≥ 1), and
the Adam moments as such ranges. For every parameter it holds, a rank of the new layout rebuilds
its tp slice of the global tensor: it cuts it from the saved tp shards that overlap the slice along
the split dimension, each put together from the ranges its dp ranks saved. Vocabulary rows past
the real vocabulary are padding and zero, as at initialisation, whatever the saved layout padded
to. The optimizer then takes its own ZeRO ranges of the slice, as it does at the same layout.

Entries are read through ``format.Entry``, their tensors by element range (``format.RankFile``),
so a rank reads only the bytes of the rows it keeps. What does not carry across
layouts are the random-number streams (they are per rank): dropout restarts from the seed, while
the weights, Adam moments and step, loss scale, iteration, learning-rate schedule and data position
continue exactly.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable

import numpy as np
import torch

from ..cli import progress_bar
from ..config import save_config
from ..errors import CheckpointError
from ..model.args import padded_vocab_size
from ..model.build import rank_param_specs
from ..parallel.layout import Layout
from ..parallel.specs import ParamSpec
from ..user_files import check_kind
from .directories import new_directory
from .format import (
    MOMENTS,
    MUON_MOMENTS,
    Entry,
    LazyTensor,
    RankFile,
    metadata,
    rank_file,
    rank_state,
    rank_state_size,
    read_metadata,
    write_metadata,
    write_rank_state,
)


class SavedShards:
    """The per-rank files of one checkpoint, opened on demand; tensors are read by element range,
    so a rank reads only the bytes of the slices it needs."""

    def __init__(self, path: str, meta: dict):
        self.path, self.layout = path, meta["layout"]
        self.version = meta.get("format_version", 1)
        # (pp, dp, cp, tp) of every saved rank
        self.coords = Layout.from_meta(self.layout).all_coords()
        if len(self.coords) != meta["world_size"]:
            raise CheckpointError(f"{path}/metadata.json: layout {self.layout} does not multiply "
                                  f"out to world_size={meta['world_size']}")
        self._files: dict[int, RankFile] = {}

    def file(self, rank: int) -> RankFile:
        if rank not in self._files:
            self._files[rank] = RankFile(self.path, rank, self.version)
        return self._files[rank]

    def state(self, rank: int) -> dict:
        """Rank ``rank``'s small state (iteration, data position, optimizer step, scaler), its
        tensors unread."""
        return self.file(rank).skeleton

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def has_moments(self) -> bool:
        """Whether the checkpoint holds optimizer moments (Adam's, or Muon's momentum): any saved
        place (tp, pp) whose first rank's file lists moment values. Headers only are read. A
        checkpoint saved before the first step, or written by a conversion or a merge, holds the
        weights only."""
        seen = set()
        for rank, (pp_rank, _, _, tp_rank) in enumerate(self.coords):
            if (pp_rank, tp_rank) in seen:
                continue
            seen.add((pp_rank, tp_rank))
            entries = self.file(rank).entries["optimizer"].values()
            if any(key in e.values for e in entries for key in MOMENTS + MUON_MOMENTS):
                return True
        return False

    def moment_keys(self, name: str) -> tuple[str, ...]:
        """The optimizer state saved for parameter ``name``: Adam's two moments, or Muon's
        momentum (optim.optimizer muon); Adam's where none is saved yet."""
        for rank in range(len(self.coords)):
            entry = self.file(rank).entries["optimizer"].get(name)
            saved = tuple(k for k in MOMENTS + MUON_MOMENTS
                          if entry is not None and k in entry.values)
            if saved:
                return saved
        return MOMENTS

    def flat_shard(self, name: str, key: str, tp_rank: int, numel: int, lo: int = 0,
                   hi: int | None = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` (default: all) of the flattened tp shard ``tp_rank`` of parameter
        ``name``'s ``key`` ("master", "exp_avg" or "exp_avg_sq"), put together from every rank
        that saved part of them; only those elements are read."""
        hi = numel if hi is None else hi
        out = torch.zeros(hi - lo, dtype=torch.float32)
        covered = 0
        stage = None  # a tied embedding lives on the first and the last stage: read one of them
        for rank, (pp_rank, _, _, t) in enumerate(self.coords):
            if t != tp_rank or (stage is not None and pp_rank != stage):
                continue
            file = self.file(rank)
            entry = file.entry(name, key, numel)
            if entry is None:
                continue
            stage = pp_rank
            a, b = max(entry.start, lo), min(entry.end, hi)
            if key not in entry.values or a >= b:
                continue  # saved before the first step (no moments yet: zeros), or another part
            out[a - lo:b - lo] = file.flat(entry, key, a, b).float()
            covered += b - a
        if stage is None:
            raise CheckpointError(f"checkpoint {self.path} has no '{name}': it was saved from "
                                  "another model (compare model.* with the config.yaml of the run "
                                  "that saved it)")
        if key == "master" and covered < hi - lo:
            raise CheckpointError(f"checkpoint {self.path}: the saved ranges of '{name}' do not "
                                  "cover it; the checkpoint is incomplete")
        return out


def saved_padded_vocab(meta: dict, vocab_size: int, divisible_by: int) -> int:
    """Rows the saved layout padded the vocabulary to: recorded in the metadata, or (older
    checkpoints) what this config's ``make_vocab_size_divisible_by`` gives at the saved tp."""
    return int(meta.get("padded_vocab") or
               padded_vocab_size(vocab_size, divisible_by, meta["layout"]["tp"]))


def tp_slice(saved: SavedShards, spec: ParamSpec, key: str, tp_rank: int, tp: int,
             saved_padded: int) -> torch.Tensor:
    """Slice ``tp_rank`` of ``tp`` (of shape ``spec.local_shape``) of parameter ``spec.name``'s
    ``key``, cut from the saved tp shards; ``saved_padded`` is the saved layout's vocabulary
    rows."""
    old_tp, dim, shape = saved.layout["tp"], spec.tp_dim, list(spec.local_shape)
    full = list(shape)  # the global tensor, padded as this layout pads it
    if dim is not None:
        full[dim] *= tp
    old = list(full)  # one saved tp shard
    if spec.vocab:
        old[0] = saved_padded
    if dim is not None:
        if old[dim] % old_tp:
            raise CheckpointError(f"checkpoint {saved.path}: '{spec.name}' cannot have been split "
                                  f"{old_tp} ways along dimension {dim} (size {old[dim]}); it was "
                                  "saved from another model")
        old[dim] //= old_tp
    numel = int(np.prod(old))
    if dim is None:  # replicated over tp: any saved tp rank's copy
        return saved.flat_shard(spec.name, key, 0, numel).view(old)
    row = numel // old[0]  # elements per row of a saved shard
    lo, hi = tp_rank * shape[dim], (tp_rank + 1) * shape[dim]  # this slice of the global tensor,
    real = min(hi, spec.shape[0]) if spec.vocab else hi  # rows past the vocabulary: zeros
    # Filled shard by shard: one saved shard's part held beside it, not all of them and their
    # concatenation (twice the tensor: 4.2 GB for Llama 3 8B's fp32 output layer).
    out = torch.empty(shape)
    filled = 0
    for t in range(old_tp):  # cut from the saved shards that overlap it
        start, end = max(lo, t * old[dim]), min(real, (t + 1) * old[dim])
        if start < end and dim == 0:  # whole rows: read just them
            a, b = start - t * old[0], end - t * old[0]
            part = saved.flat_shard(spec.name, key, t, numel, a * row,
                                    b * row).view(b - a, *old[1:])
        elif start < end:
            part = saved.flat_shard(spec.name, key, t, numel).view(old)
            part = part.narrow(dim, start - t * old[dim], end - start)
        else:
            continue
        out.narrow(dim, filled, end - start).copy_(part)
        filled += end - start
        del part
    out.narrow(dim, filled, shape[dim] - filled).zero_()
    return out


def resharded_state(saved: SavedShards, specs: dict[str, ParamSpec], tp_rank: int, tp: int,
                    saved_padded: int, *, moments: bool = True, lazy: bool = False) -> dict:
    """The state of a rank of another layout that holds the parameters ``specs`` (its table) at
    ``tp_rank`` of ``tp``: whole tp slices of the masters and moments (any ZeRO stage takes its
    ranges from them); iteration, data position, Adam step, loss scale and LR schedule from the
    checkpoint. Random streams are per rank: not carried. ``moments=False``: the weights only (no
    moments read). ``lazy``: :class:`LazyTensor` entries, each read when it is written (one tensor
    in memory)."""
    def cut(spec: ParamSpec, key: str):
        if not lazy:
            return tp_slice(saved, spec, key, tp_rank, tp, saved_padded)
        return LazyTensor(torch.float32, tuple(spec.local_shape),
                          lambda: tp_slice(saved, spec, key, tp_rank, tp, saved_padded))

    model, saved_moments = {}, {}
    for name, spec in specs.items():
        model[name] = Entry.shards(name, {"master": cut(spec, "master")}).tree()
        kept = {key: cut(spec, key) for key in saved.moment_keys(name)} if moments else {}
        saved_moments[name] = Entry.shards(name, kept).tree()
    first = saved.state(0)
    return rank_state(iteration=first["iteration"], consumed_samples=first["consumed_samples"],
                      model=model, optimizer_step=first["optimizer"]["step"], moments=saved_moments,
                      scaler=first["optimizer"].get("scaler"), lr_scale=first.get("lr_scale", 1.0),
                      schedule=first.get("schedule"))


def layout_bytes(cfg, layout: Layout, moments: bool) -> int:
    """The bytes of the distinct rank files a checkpoint of ``layout`` holds (data-parallel replicas
    are hard links): each pipeline and tensor place's fp32 weights, and their two Adam moments."""
    total = 0
    for pp_rank in range(layout.pp):
        for tp_rank in range(layout.tp):
            total += sum(math.prod(s.local_shape)
                         for s in rank_param_specs(cfg, pp_rank, tp_rank).values())
    return total * 4 * (3 if moments else 1)


def global_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every parameter's global shape (vocabulary unpadded) under ``cfg``'s model, in the model's
    order: embedding, layers, final norm, head (read off every pipeline stage's spec table)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for pp_rank in range(cfg.parallel.pp):
        for name, spec in rank_param_specs(cfg, pp_rank, 0).items():
            shapes.setdefault(name, spec.shape)
    return shapes


class GlobalWeights:
    """The weights of checkpoint ``path`` as global fp32 tensors (tp shards and ZeRO ranges put
    together, vocabulary padding dropped), read one at a time; ``cfg`` is the run's config (its
    layout is reset to one process; ``model.vocab_size`` filled from the metadata when null)."""

    def __init__(self, path: str, cfg):
        meta = read_metadata(path)
        m = cfg.model
        m.vocab_size = m.vocab_size or meta.get("vocab_size")
        # one process holds everything: its spec table names every weight once (every parallel
        # field at its default, so none is left that needs a dimension of the saved layout)
        cfg.parallel = type(cfg.parallel)()
        self.specs = rank_param_specs(cfg, 0, 0)
        self.saved = SavedShards(path, meta)
        self.padded = saved_padded_vocab(meta, m.vocab_size, m.make_vocab_size_divisible_by)

    def get(self, name: str):
        spec = self.specs[name]
        weight = tp_slice(self.saved, spec, "master", 0, 1, self.padded)
        return weight[:spec.shape[0]] if spec.vocab else weight

    def close(self) -> None:
        self.saved.close()


def saved_config_path(checkpoint: str, explicit: str | None = None) -> str:
    """``explicit``, or the config a tool wrote beside ``checkpoint``'s files
    (``CHECKPOINT/config.yaml``), or the config of the training run that saved it when it is one
    of that run's own checkpoints (``RUN_DIR/checkpoints/<name>``: ``RUN_DIR/config.yaml``). The
    lookup stops there: a ``config.yaml`` further up, or beside a checkpoint that is not inside a
    run's ``checkpoints/`` folder, belongs to something else and is never taken."""
    if explicit:
        check_kind("--config", explicit, "a config", "pass the config (YAML) of the run that "
                   f"saved {checkpoint}", also=("a YAML file", "a JSON file"))
        if not os.path.exists(explicit):
            raise CheckpointError(f"--config {explicit} not found: pass the config of the run "
                                  f"that saved {checkpoint}")
        return explicit
    beside = os.path.join(os.path.abspath(checkpoint), "config.yaml")
    if os.path.exists(beside):
        return beside
    folder = os.path.dirname(os.path.abspath(checkpoint))
    if os.path.basename(folder) == "checkpoints":
        run = os.path.join(os.path.dirname(folder), "config.yaml")
        if os.path.exists(run):
            return run
        where = f"neither {beside} nor {run} exists"
    else:
        where = f"{beside} not found, and {checkpoint} is not in a run's checkpoints/ folder"
    raise CheckpointError(f"{where}: pass --config with the config of the run that saved "
                          f"{checkpoint} (for the architecture)")


def write_layout(directory: str, layout: Layout, state_at) -> tuple[dict, int]:
    """Write a rank file for every rank of ``layout`` into ``directory``: ``state_at(pp_rank,
    tp_rank)`` gives the state of the ranks at that place, whose data- and context-parallel
    replicas are hard links to the first one's file (copies where the file system has no links).
    Returns the files' records for the metadata (name -> (bytes, crc32)) and how many distinct files
    were written."""
    written: dict[tuple[int, int], tuple[str, tuple]] = {}
    files = {}
    for rank, (pp_rank, _, _, tp_rank) in enumerate(layout.all_coords()):
        file = rank_file(directory, rank)
        if (pp_rank, tp_rank) in written:  # a data-parallel replica: the same content
            first, record = written[(pp_rank, tp_rank)]
            try:
                os.link(first, file)
            except OSError:
                shutil.copyfile(first, file)
        else:
            record = write_rank_state(file, state_at(pp_rank, tp_rank))
            written[(pp_rank, tp_rank)] = (file, record)
        files[os.path.basename(file)] = record
    return files, len(written)


def planned_bytes(layout: Layout, state_at) -> int:
    """The bytes of the rank files :func:`write_layout` writes for ``state_at`` (headers
    included; data-parallel replicas are links), computed from the states' shapes: no tensor is
    read (``state_at``'s tensors are lazy)."""
    places = {(pp_rank, tp_rank) for pp_rank, _, _, tp_rank in layout.all_coords()}
    return sum(rank_state_size(state_at(pp_rank, tp_rank)) for pp_rank, tp_rank in places)


def write_weights_checkpoint(output: str, cfg, sizes, world: int,
                             tensor: Callable[[ParamSpec, int], torch.Tensor], *,
                             label: str | None = None, record: dict | None = None,
                             on_bytes: Callable[[int], None] | None = None,
                             before_publish: Callable[[str], object] | None = None,
                             moments: Callable[[ParamSpec, int, str], torch.Tensor] | None = None,
                             step: int = 0, iteration: int | None = None):
    """Write the new checkpoint ``output`` of weights: every rank file of the layout ``sizes``
    (resolve's, of ``cfg`` at ``world`` ranks) holds its place's fp32 master weights,
    ``tensor(spec, tp_rank)`` giving each tp slice (of ``spec.local_shape``, vocabulary padding
    rows zero) when it is written, one at a time. Without ``moments``: no Adam moments (none are
    invented: training from it starts the optimizer fresh), iteration 0. With them (an import of
    another stack's AdamW state): ``moments(spec, tp_rank, key)`` gives each tp slice of
    ``exp_avg`` and ``exp_avg_sq`` the same way, ``step`` is Adam's step count and ``iteration``
    (default: ``step``) the iteration (the data position starts at 0). Data-parallel replicas are
    hard links;
    ``config.yaml`` beside the files, so to-hf and inspection need no ``--config``; the
    metadata with ``record``'s extra fields (where it came from). The free-space check counts
    exactly these bytes and runs before anything is read. ``label``: a progress bar of that name;
    ``on_bytes(n)``: told each slice's bytes. ``before_publish(tmp)`` runs on the complete
    temporary directory before it takes its name (a check that refuses leaves nothing).
    Returns (the metadata written, what ``before_publish`` returned)."""
    shapes = global_shapes(cfg)
    layout = sizes.layout.meta(v_shape=sizes.schedule.v_shape)
    counters = [on_bytes] if on_bytes is not None else []
    iteration = step if iteration is None else iteration

    def counted(out: torch.Tensor) -> torch.Tensor:
        for count in counters:
            count(out.numel() * out.element_size())
        return out

    def read(spec: ParamSpec, tp_rank: int) -> torch.Tensor:
        return counted(tensor(spec, tp_rank))

    def state_at(pp_rank: int, tp_rank: int) -> dict:
        specs = rank_param_specs(cfg, pp_rank, tp_rank)
        model = {n: Entry.shards(n, {"master": LazyTensor(
            torch.float32, tuple(s.local_shape), lambda s=s: read(s, tp_rank))}).tree()
            for n, s in specs.items()}
        kept = MOMENTS if moments is not None else ()
        saved = {n: Entry.shards(n, {k: LazyTensor(
            torch.float32, tuple(s.local_shape), lambda s=s, k=k: counted(moments(s, tp_rank, k)))
            for k in kept}).tree() for n, s in specs.items()}
        return rank_state(iteration=iteration, consumed_samples=0, optimizer_step=step, scaler=None,
                          model=model, moments=saved)

    size = planned_bytes(sizes.layout, state_at)
    with new_directory(output, needed=size) as tmp, \
            progress_bar(size, label or "writing", enabled=None if label else False) as bar:
        counters.append(bar.update)
        files, _ = write_layout(tmp, sizes.layout, state_at)
        save_config(cfg, os.path.join(tmp, "config.yaml"))  # the architecture, for to-hf
        meta = metadata(iteration=iteration, world_size=world, layout=layout,
                        vocab_size=cfg.model.vocab_size, padded_vocab=sizes.padded_vocab,
                        files=files, tensors=shapes, **(record or {}))
        write_metadata(tmp, meta)
        checked = before_publish(tmp) if before_publish is not None else None
    return meta, checked
