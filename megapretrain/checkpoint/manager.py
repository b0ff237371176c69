"""Per-rank checkpoints: atomic, optionally asynchronous, with retention and a ``latest`` pointer.

Layout under ``RUN_DIR/checkpoints``::

    iter_0000100/metadata.json      written last: its presence marks the checkpoint complete
    iter_0000100/rank_00000.pt      one file per rank (model, optimizer, RNG, data position)
    latest                          the name of the newest complete checkpoint

Every rank writes into ``.iter_0000100``; once all have finished, rank 0 writes the metadata,
renames the directory into place and then moves ``latest`` — a crash at any point leaves either the
previous checkpoint or the new one, never a half-written one under a final name. An existing
directory of the same name is moved aside, not overwritten. What the files hold, and how they are
written and read, is ``checkpoint/format.py``'s.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from .format import METADATA, metadata, rank_file, read_metadata, read_rank_state, write_metadata, write_rank_state


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _to_cpu(obj):
    """Deep-copy the tensors of a state tree to CPU, so training may go on while it is written."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


class CheckpointManager:
    def __init__(self, run_dir: str, *, rank: int, world_size: int, layout: dict, vocab_size: int,
                 padded_vocab: int, keep_last: int = 3, keep_every: int = 0, async_save: bool = False,
                 device: torch.device | str = "cpu"):
        """``layout`` ({tp, pp, dp}) and the vocabulary (real and padded) go into ``metadata.json``."""
        self.device = torch.device(device)
        self.root = os.path.join(run_dir, "checkpoints")
        self.rank, self.world_size, self.layout = rank, world_size, layout
        self.vocab_size, self.padded_vocab = vocab_size, padded_vocab
        self.keep_last, self.keep_every, self.async_save = keep_last, keep_every, async_save
        self._pending: tuple[int, threading.Thread, list] | None = None
        os.makedirs(self.root, exist_ok=True)

    # -- saving -----------------------------------------------------------------------------------

    def save(self, iteration: int, state: dict) -> None:
        """Write this rank's ``state`` for ``iteration`` (collective: every rank calls it)."""
        self.finalize()
        tmp = os.path.join(self.root, "." + iter_dir_name(iteration))
        if self.rank == 0:
            if os.path.exists(tmp):
                shutil.rmtree(tmp)  # leftovers of an interrupted save; never a complete checkpoint
            os.makedirs(tmp)
        _barrier()
        path = rank_file(tmp, self.rank)
        errors: list = []
        if self.async_save:
            cpu_state = _to_cpu(state)
            thread = threading.Thread(target=self._write, args=(cpu_state, path, errors), daemon=True)
            thread.start()
            self._pending = (iteration, thread, errors)
        else:
            self._write(state, path, errors)
            self._pending = (iteration, None, errors)
            self.finalize()

    @staticmethod
    def _write(state: dict, path: str, errors: list) -> None:
        try:
            write_rank_state(path, state)
        except Exception as exc:  # reported by finalize() on the training thread
            errors.append(exc)

    def finalize(self) -> str | None:
        """Wait for a pending write, then publish it (rank 0 renames and moves ``latest``)."""
        if self._pending is None:
            return None
        iteration, thread, errors = self._pending
        self._pending = None
        if thread is not None:
            thread.join()
        failed = torch.tensor([1.0 if errors else 0.0], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(failed)
        if failed.item() > 0:
            reason = errors[0] if errors else "another rank failed"
            raise RuntimeError(f"checkpoint {iteration} was not saved: {reason}")
        name = iter_dir_name(iteration)
        if self.rank == 0:
            tmp, final = os.path.join(self.root, "." + name), os.path.join(self.root, name)
            write_metadata(tmp, metadata(iteration=iteration, world_size=self.world_size, layout=self.layout,
                                         vocab_size=self.vocab_size, padded_vocab=self.padded_vocab,
                                         time=time.time()))
            if os.path.exists(final):
                os.rename(final, f"{final}.replaced-{int(time.time())}")
            os.rename(tmp, final)
            latest_tmp = os.path.join(self.root, ".latest")
            with open(latest_tmp, "w") as fh:
                fh.write(name + "\n")
            os.replace(latest_tmp, os.path.join(self.root, "latest"))
            self._apply_retention()
        _barrier()
        return name

    def _apply_retention(self) -> None:
        if self.keep_last <= 0:
            return
        done = sorted(d for d in os.listdir(self.root)
                      if d.startswith("iter_") and d[5:].isdigit()
                      and os.path.exists(os.path.join(self.root, d, METADATA)))
        for d in done[:-self.keep_last]:
            if self.keep_every and int(d[5:]) % self.keep_every == 0:
                continue  # a milestone
            shutil.rmtree(os.path.join(self.root, d), ignore_errors=True)

    # -- loading ----------------------------------------------------------------------------------

    def latest(self) -> str | None:
        """Path of the newest complete checkpoint in this run, or None."""
        return latest_checkpoint(self.root)

    def newest_before(self, iteration: int) -> str | None:
        """The newest complete checkpoint of this run saved before ``iteration``, or None."""
        done = [d for d in os.listdir(self.root) if d.startswith("iter_") and d[5:].isdigit()
                and int(d[5:]) < iteration and os.path.exists(os.path.join(self.root, d, METADATA))]
        return os.path.join(self.root, max(done)) if done else None

    def set_aside_from(self, iteration: int, keep: str) -> list[str]:
        """After a rollback to ``keep``: rename the checkpoints saved at ``iteration`` or later to
        ``NAME.rolled-back-TIME`` (kept, never deleted) and point ``latest`` at ``keep``
        (collective). Returns the names set aside."""
        self.finalize()
        moved = sorted(d for d in os.listdir(self.root) if d.startswith("iter_") and d[5:].isdigit()
                       and int(d[5:]) >= iteration)
        _barrier()  # every rank has read what it needs before anything moves
        if self.rank == 0:
            stamp = int(time.time())
            for d in moved:
                os.rename(os.path.join(self.root, d), os.path.join(self.root, f"{d}.rolled-back-{stamp}"))
            latest_tmp = os.path.join(self.root, ".latest")
            with open(latest_tmp, "w") as fh:
                fh.write(os.path.basename(keep) + "\n")
            os.replace(latest_tmp, os.path.join(self.root, "latest"))
        _barrier()
        return moved

    def load(self, path: str) -> dict:
        """This rank's state from checkpoint directory ``path``, checked against the layout."""
        path = resolve_checkpoint(path)
        meta = read_metadata(path)
        if meta["world_size"] != self.world_size or meta["layout"] != self.layout:
            raise CheckpointError(
                f"checkpoint {path} was saved with world_size={meta['world_size']} layout={meta['layout']}, "
                f"but this run has world_size={self.world_size} layout={self.layout}; "
                "relaunch with the saved layout")
        return read_rank_state(path, self.rank)


def latest_checkpoint(root: str) -> str | None:
    pointer = os.path.join(root, "latest")
    if not os.path.exists(pointer):
        return None
    with open(pointer) as fh:
        name = fh.read().strip()
    path = os.path.join(root, name)
    if not os.path.exists(os.path.join(path, METADATA)):
        raise CheckpointError(f"{pointer} names '{name}', which is missing or incomplete; "
                              "point it at a complete iter_* directory or remove it")
    return path


def resolve_checkpoint(path: str) -> str:
    """A complete checkpoint directory from ``path``: itself, or the latest under a run directory
    or its ``checkpoints/`` folder."""
    if os.path.exists(os.path.join(path, METADATA)):
        return path
    for root in (path, os.path.join(path, "checkpoints")):
        found = latest_checkpoint(root) if os.path.isdir(root) else None
        if found:
            return found
    raise CheckpointError(f"{path} is not a complete checkpoint (no metadata.json) nor a run "
                          "directory with one; pass an iter_* directory")


@contextlib.contextmanager
def new_directory(path: str):
    """Write the new directory ``path`` through a temporary one beside it: yields the temporary
    path, which takes the final name (with the usual permissions) when the block ends and is removed
    if it fails. ``path`` must not exist, or be empty: nothing is ever overwritten."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise CheckpointError(f"--output {path} exists and is not empty; choose a new directory "
                              "(nothing is ever overwritten)")
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(path))}.tmp-", dir=parent)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    for name in os.listdir(tmp):
        os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
    if os.path.isdir(path):
        os.rmdir(path)  # empty, checked above
    os.rename(tmp, path)
