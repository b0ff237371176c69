"""The checkpoint file format: one module writes and reads it, whoever saves or loads.

A checkpoint is a directory::

    metadata.json        JSON: format name and version, iteration, world size, layout, vocabulary
    rank_00000.pt        one tensor-only state file per rank (loaded with weights_only=True: no
    rank_00001.pt        code is ever unpickled)
    ...

A rank's state (:func:`rank_state`) holds the iteration, the consumed samples, the fp32 master
weights and the optimizer state, both keyed by global parameter name, and (when saved by training)
the rank's random-number states. Each weight or moment entry is one of

- a tensor: the parameter's whole tp shard (zero 0 masters, converted or resharded weights);
- ``{"start": s, "end": e, KEY: flat}``: elements [s, e) of the flattened tp shard (zero >= 1);
- ``{KEY: tensor, ...}``: whole tp shards by key (the moments of a resharded checkpoint);
- ``{}``: nothing yet (optimizer state saved before the first step);

and ``optim/optimizer.py``'s ``entry_range`` (beside the code that writes them) reads any of them.
``FORMAT_VERSION`` grows when this changes; a checkpoint of a newer version is refused with a message that says so.
"""

from __future__ import annotations

import json
import os

import torch

from ..errors import CheckpointError, read_json_file

FORMAT = "megapretrain-per-rank-v1"
FORMAT_VERSION = 1
METADATA = "metadata.json"
_LAYOUT_KEYS = ("tp", "pp", "dp")


# -- a rank's state --------------------------------------------------------------------------------


def rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank_{rank:05d}.pt")


def rank_state(*, iteration: int, consumed_samples: int, model: dict, optimizer_step: int, moments: dict,
               scaler: dict | None, rng: dict | None = None) -> dict:
    """One rank's checkpoint state. ``model`` and ``moments`` map parameter names to entries (see
    the module docstring; moments carry ``exp_avg`` and ``exp_avg_sq``); ``scaler`` is the loss
    scaler's state (None: a fresh one); ``rng`` the rank's random states (None: not carried)."""
    state = {"iteration": int(iteration), "consumed_samples": int(consumed_samples), "model": model,
             "optimizer": {"step": int(optimizer_step), "params": moments, "scaler": scaler}}
    if rng is not None:
        state["rng"] = rng
    return state


def write_rank_state(path: str, state: dict) -> None:
    """Write ``state`` to ``path`` through ``path.part``, flushed to disk before the rename."""
    with open(path + ".part", "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(path + ".part", path)


def read_rank_state(directory: str, rank: int, *, mmap: bool = False) -> dict:
    """Rank ``rank``'s state from checkpoint ``directory`` (``mmap``: pages read on use)."""
    file = rank_file(directory, rank)
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {file} is missing: the checkpoint is incomplete") from None
    except Exception as exc:
        raise CheckpointError(f"checkpoint file {file} cannot be read ({type(exc).__name__}: {exc}); "
                              "load an older checkpoint with --checkpoint.load") from None


# -- metadata --------------------------------------------------------------------------------------


def metadata(*, iteration: int, world_size: int, layout: dict, vocab_size: int | None, padded_vocab: int,
             **extra) -> dict:
    """The metadata of a checkpoint saved under ``layout`` ({tp, pp, dp}) at ``world_size``;
    ``extra`` adds facts (where it was converted or resharded from, the time)."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "iteration": int(iteration),
            "world_size": int(world_size), "layout": {k: int(layout[k]) for k in _LAYOUT_KEYS},
            "vocab_size": vocab_size, "padded_vocab": int(padded_vocab), **extra}


def write_metadata(directory: str, meta: dict) -> None:
    """Write ``metadata.json`` (its presence marks the checkpoint complete), flushed to disk."""
    path = os.path.join(directory, METADATA)
    with open(path + ".part", "w") as fh:
        json.dump(meta, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(path + ".part", path)


def read_metadata(directory: str) -> dict:
    """The checked metadata of checkpoint ``directory``: every failure names the file and the fix."""
    path = os.path.join(directory, METADATA)
    meta = read_json_file(path, CheckpointError, "load another checkpoint with --checkpoint.load",
                          missing=f"not found: {directory} is not a complete checkpoint")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} holds {type(meta).__name__}, not a JSON object; load another checkpoint")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r} is not {FORMAT!r}; it was not written by "
                              "megapretrain (or by an incompatible version)")
    version = meta.get("format_version", 1)  # checkpoints before the version field are version 1
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {version!r} is newer than this megapretrain reads "
                              f"({FORMAT_VERSION}); upgrade megapretrain to load it")
    layout = meta.get("layout")
    problems = [k for k in ("iteration", "world_size") if not isinstance(meta.get(k), int)]
    if not isinstance(layout, dict) or not all(isinstance(layout.get(k), int) and layout[k] >= 1
                                               for k in _LAYOUT_KEYS):
        problems.append("layout")
    if problems:
        raise CheckpointError(f"{path}: {', '.join(problems)} missing or of the wrong type; the file is "
                              "damaged: load another checkpoint with --checkpoint.load")
    return meta
