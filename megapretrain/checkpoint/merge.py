"""Weighted averages of checkpoints of one model, saved under any layouts, computed tensor by
tensor.

Each input is read through the layout-free reader of resharding (``reshard.tp_slice``): for a
target rank's place it cuts the rank's tp slice of a parameter's fp32 master weight out of
whatever tp shards and ZeRO ranges that input saved, with vocabulary rows past the real vocabulary
zero. The average of those slices, weighted, is that rank's slice of the merged weight. So host
memory holds one slice per input and the running sum, never a model, and every input may have
its own layout (tp, pp, vpp, dp, cp, zero).

What is averaged is the weights only. The iteration, the Adam moments and step, the loss scale,
the learning-rate schedule, the data position and the random streams of the inputs are not: there
is no meaningful average of a data position or of a schedule, and moments averaged across points
of a trajectory describe none of them. The merged checkpoint is a fine-tune start (iteration 0,
no optimizer state), as a checkpoint converted from Hugging Face is.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from ..config import load_config
from ..errors import CheckpointError, ConfigError, UserError
from ..parallel.specs import ParamSpec
from .directories import iter_dir_name
from .format import (
    check_shapes,
    read_metadata,
)
from .reshard import (
    SavedShards,
    global_shapes,
    saved_config_path,
    saved_padded_vocab,
    tp_slice,
    write_weights_checkpoint,
)

# model.* settings that change how a model trains or runs, not which function its weights compute:
# checkpoints that differ only in them are of one model. Every other model.* setting must agree.
TRAINING_ONLY = frozenset({"make_vocab_size_divisible_by", "init_std", "attention_dropout",
                           "hidden_dropout", "kernels", "attention", "z_loss", "fp8", "fp8_skip"})


def normalised_weights(weights: list[float] | None, count: int) -> list[float]:
    """The averaging weights of ``count`` checkpoints, summing to 1: uniform when ``weights`` is
    None, else ``weights`` (one per checkpoint, each finite and ≥ 0, their sum > 0) divided by
    their sum."""
    if weights is None:
        return [1.0 / count] * count
    if len(weights) != count:
        raise UserError(f"--weights has {len(weights)} value(s) for {count} checkpoints: give one "
                        "weight per checkpoint, in the order of --checkpoints (or none: uniform)")
    bad = [w for w in weights if not math.isfinite(w) or w < 0]
    if bad:
        raise UserError(f"--weights {bad[0]:g} is not a finite number >= 0: every weight must be "
                        "one (0 leaves that checkpoint out)")
    total = math.fsum(weights)
    if not total > 0:
        raise UserError(f"--weights sum to {total:g}: at least one weight must be above 0")
    return [w / total for w in weights]


@dataclasses.dataclass
class MergeInput:
    """One checkpoint to average: its directory, metadata, the config of the run that saved it
    (``model.vocab_size`` filled from the metadata when null), its rank files and the vocabulary
    rows its layout padded to."""

    path: str
    meta: dict
    cfg: object
    saved: SavedShards
    padded: int

    @classmethod
    def open(cls, path: str) -> MergeInput:
        meta = read_metadata(path)
        cfg = load_config(saved_config_path(path), [])
        m = cfg.model
        m.vocab_size = m.vocab_size or meta.get("vocab_size")
        if m.vocab_size is None:
            raise CheckpointError(f"model.vocab_size is null in the config of {path} and its "
                                  "metadata.json has none: it cannot be averaged (convert it with "
                                  "--config naming model.vocab_size first)")
        return cls(path, meta, cfg, SavedShards(path, meta),
                   saved_padded_vocab(meta, m.vocab_size, m.make_vocab_size_divisible_by))

    def close(self) -> None:
        self.saved.close()


def model_difference(a: MergeInput, b: MergeInput) -> str | None:
    """The first fact that makes ``a`` and ``b`` checkpoints of different models, or None: a
    ``model.*`` setting outside :data:`TRAINING_ONLY` (null — derived — on either side is left to
    the shapes), a tensor either lacks, or a tensor's shape."""
    for field in dataclasses.fields(a.cfg.model):
        x, y = getattr(a.cfg.model, field.name), getattr(b.cfg.model, field.name)
        if field.name in TRAINING_ONLY or x is None or y is None or x == y:
            continue
        return f"model.{field.name} is {x!r} in {a.path} and {y!r} in {b.path}"
    shapes = [a.meta.get("tensors") or global_shapes(a.cfg),
              b.meta.get("tensors") or global_shapes(b.cfg)]
    for name in list(shapes[0]) + [n for n in shapes[1] if n not in shapes[0]]:
        x, y = (tuple(s[name]) if name in s else None for s in shapes)
        if x != y:
            return (f"tensor '{name}' has shape {x} in {a.path} and {y} in {b.path}" if x and y
                    else f"tensor '{name}' is in {a.path if x else b.path} only")
    return None


def check_same_model(inputs: list[MergeInput], target_shapes: dict[str, tuple]) -> None:
    """Refuse, in one line naming both checkpoints and what differs, inputs that are not all
    checkpoints of one model, and any input whose tensors do not fit the output's model."""
    for other in inputs[1:]:
        found = model_difference(inputs[0], other)
        if found:
            raise CheckpointError(f"cannot average checkpoints of different models: {found}")
    for one in inputs:
        check_shapes(one.path, one.meta, target_shapes)


def merged_slice(inputs: list[MergeInput], weights: list[float], spec: ParamSpec, tp_rank: int,
                 tp: int) -> torch.Tensor:
    """Slice ``tp_rank`` of ``tp`` (``spec.local_shape``) of the weighted average of parameter
    ``spec.name``'s fp32 master weights over ``inputs``: each input's slice is cut from its own
    layout's shards, one input at a time. NaN or infinite values are refused naming the input."""
    total = torch.zeros(spec.local_shape, dtype=torch.float32)
    for one, weight in zip(inputs, weights):
        if weight == 0:
            continue  # weight 0: left out, not read
        part = tp_slice(one.saved, spec, "master", tp_rank, tp, one.padded)  # (local_shape)
        if not torch.isfinite(part).all():
            raise CheckpointError(f"{one.path}: '{spec.name}' holds NaN or infinite values: the "
                                  "run diverged before this checkpoint; average earlier ones "
                                  "(nothing written)")
        total.add_(part, alpha=weight)
    return total


def write_average(inputs: list[MergeInput], weights: list[float], cfg, sizes, world: int,
                  output: str, on_bytes=None) -> dict:
    """Write the average of ``inputs`` with ``weights`` (normalised) as the new checkpoint
    ``output`` for the layout ``sizes`` (resolve's, of ``cfg`` at ``world`` ranks): every rank file
    holds the fp32 weights of its place and no optimizer state, at iteration 0; data-parallel
    replicas are hard links; ``cfg`` is saved beside them. ``on_bytes(n)`` is told the bytes of
    each slice as it is computed. Returns the metadata written."""
    check_same_model(inputs, global_shapes(cfg))
    sources = [{"path": os.path.abspath(one.path), "iteration": one.meta["iteration"], "weight": w}
               for one, w in zip(inputs, weights)]
    meta, _ = write_weights_checkpoint(
        output, cfg, sizes, world,
        lambda spec, tp_rank: merged_slice(inputs, weights, spec, tp_rank, sizes.layout.tp),
        record={"merged_from": sources}, on_bytes=on_bytes)
    return meta


# -- the average of a run's last checkpoints (checkpoint.average_last) ---------------------------


def average_dir_name(count: int, iteration: int) -> str:
    """Where the average of the last ``count`` checkpoints, the newest at ``iteration``, goes
    beside them: ``average_last_4_iter_0001000``. Not an ``iter_*`` name, so resuming, retention
    and ``latest`` never take it for one of the run's own checkpoints."""
    return f"average_last_{count}_{iter_dir_name(iteration)}"


def check_average_last(checkpoint) -> None:
    """``checkpoint.average_last`` (a ``CheckpointConfig``) averages two or more checkpoints, all
    of which retention keeps."""
    k, keep = checkpoint.average_last, checkpoint.keep_last
    if k == 1:
        raise ConfigError("checkpoint.average_last=1 averages a single checkpoint: set 2 or more "
                          "(or 0: off)")
    if k and keep and k > keep:
        raise ConfigError(f"checkpoint.average_last={k} > checkpoint.keep_last={keep}: retention "
                          f"keeps only {keep} checkpoints to average; raise keep_last to {k} or "
                          "more (or 0: keep all)")
