"""Per-rank checkpoints: atomic, durable, optionally asynchronous, checked, with retention.

Layout under ``RUN_DIR/checkpoints``::

    iter_0000100/metadata.json            written last: its presence marks the checkpoint complete
    iter_0000100/rank_00000.safetensors   one file per rank (model, optimizer, RNG, data position)
    latest                                the name of the newest complete checkpoint

Saving: every rank writes its file into ``.iter_0000100`` (fsynced), then a small
``rank_NNNNN.done.json`` with the file's size and CRC-32 (or the error that stopped it). Rank 0,
once every rank's ``done`` file is there, writes ``metadata.json`` (with every size and checksum),
fsyncs, renames the directory into place, moves ``latest`` and applies retention. A synchronous
save publishes after the ranks agreed (one collective) that each wrote its record, so that a rank
lost mid-save fails that collective on the others rather than leave rank 0 waiting for its record.
With ``checkpoint.async`` the publication happens
on a background thread as soon as the last rank finished writing, while training goes on: the thread
first copies the live state into host buffers (:class:`SnapshotBuffers`) while the next forward and
backward run — they only read it — and the training loop waits, if at all, only before its next
optimizer step would change it (:meth:`CheckpointManager.wait_snapshot`). At every step boundary the
ranks agree (one small all-reduce of a host value, only while a save is in flight: no device sync)
whether every rank's writer is done, and then finish the save together (errors raised on every
rank); at most one save is in flight (the next one waits for it). All of the ranks' agreement runs
on their ``checkpoint`` group (``ParallelState.checkpoint``: gloo, with ``checkpoint.timeout_s``),
never on the training's: a save slowed by its file system cannot trip the training collectives'
timeout. A crash at any point leaves either the previous checkpoint or the new one, never a
half-written one under a final name; an existing directory of the same name is moved aside, not
overwritten. A save that fails on any rank (a full disk, say) removes its temporary directory and
raises on every rank — a full disk as one line naming the directory, the bytes needed and free.
Leftovers of an interrupted save are removed when the next run starts.

Loading: :meth:`CheckpointManager.choose` checks candidates newest first (metadata, every rank's
file present at its recorded size, the checksums — each rank checks a share of the files) and falls
back past unusable ones with a warning naming what was wrong. What the files hold, and how they are
written and read, is ``checkpoint/format.py``'s.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from ..errors import FULL_DISK, CheckpointError, DiskFullError, disk_full
from ..optim.optimizer import FragmentState, MixedPrecisionAdamW
from ..parallel.state import Group
from .directories import candidates, iter_dir_name, iteration_of, latest_checkpoint
from .format import (
    METADATA,
    MOMENTS,
    MUON_MOMENTS,
    WEIGHT,
    Entry,
    fsync_dir,
    metadata,
    planned_size,
    problem,
    rank_file,
    read_entries,
    read_metadata,
    read_rank_state,
    write_metadata,
    write_rank_state,
    write_text,
)

_DONE = ".done.json"
_FAILED = ".failed"  # beside a rank file whose done record could not be written


def _failure(errors: list) -> float:
    """A save's outcome on this rank: 0 saved, 1 failed, 2 found no space (every rank then
    says so in one line)."""
    return 2.0 if any(isinstance(e, DiskFullError) for e in errors) else 1.0 if errors else 0.0


def _reduced(group: Group, value: float, op=dist.ReduceOp.MAX) -> float:
    """Every rank's ``value`` reduced by ``op`` (collective over ``group``, a gloo one): the
    collective writes host memory, read here without a tensor read, so this waits for the other
    ranks' hosts and never for a device."""
    host = np.array([value], dtype=np.float64)
    group.all_reduce(torch.from_numpy(host), op=op)
    return float(host[0])


class SnapshotBuffers:
    """Host buffers an async save copies the state into, kept from one save to the next: copying
    into memory already faulted in is several times faster than into fresh allocations, and that
    copy is all the training loop waits for. Pinned when the source is on an accelerator (the
    device-to-host copy is then asynchronous, synchronized once). Safe because at most one save is
    in flight: the next snapshot happens after the previous write finished."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, obj, path: str = ""):
        """``obj`` (a state tree) with every tensor copied into this pool."""
        if torch.is_tensor(obj):
            buf = self._buffers.get(path)
            if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
                buf = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=obj.device.type == "cuda")
                self._buffers[path] = buf
            return buf.copy_(obj.detach(), non_blocking=obj.device.type == "cuda")
        if isinstance(obj, dict):
            return {k: self.copy(v, f"{path}/{k}") for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.copy(v, f"{path}/{i}") for i, v in enumerate(obj))
        return obj


def optimizer_views(optimizer: MixedPrecisionAdamW) -> tuple[dict, dict]:
    """(weights, moments) of ``optimizer`` as checkpoint entries (:class:`~.format.Entry`) that are
    views of its fp32 masters and Adam moments (no copies), for a save that copies them at most once
    (into :class:`SnapshotBuffers`, or straight to the file): a rank that steps a whole tp shard
    (zero 0) stores its weight whole, every other weight and moment as its range."""
    weights, moments = {}, {}
    for fragment in optimizer.fragment_states():
        weights[fragment.name] = Entry.of(fragment, WEIGHT, whole=fragment.whole).tree()
        # Adam's two moments, or Muon's momentum (optim.optimizer muon)
        kept = tuple(k for k in fragment.tensors if k not in WEIGHT)
        moments[fragment.name] = Entry.of(fragment, kept).tree()
    return weights, moments


def restore_optimizer(optimizer: MixedPrecisionAdamW, state: dict, *, moments: bool = True,
                      where: str | None = None) -> None:
    """Set ``optimizer``'s masters (and so the model's parameters) from a loaded rank ``state``'s
    entries (its own layout's, or resharded: whole tp shards), and unless ``moments`` is false its
    Adam moments, step and loss scale. ``where`` names the checkpoint in errors."""
    fix = "compare model.* and parallel.* with the config.yaml of the run that saved it"
    at, checkpoint = (f" ({where})", f"checkpoint {where}") if where else ("", "checkpoint")
    sections = [("model", WEIGHT, read_entries(state["model"], checkpoint))]
    if moments:
        params = state["optimizer"]["params"]
        sections.append(("optimizer", MOMENTS + MUON_MOMENTS, read_entries(params, checkpoint)))
    pieces = []
    for f in optimizer.fragment_states():
        tensors = {}
        for section, keys, entries in sections:
            entry = entries.get(f.name)
            if entry is None and section == "model":
                raise CheckpointError(f"checkpoint has no weight '{f.name}' for this rank{at}: it "
                                      "was saved from another model, or with another parallel.zero "
                                      f"or parallel.bucket_size_mb ({fix})")
            if entry is None:
                raise CheckpointError(f"checkpoint has no optimizer state for '{f.name}'{at}: it "
                                      f"was saved from another model ({fix})")
            # (an entry without moments: saved before the first step)
            if section == "optimizer":
                _check_same_optimizer(f, entry, optimizer, at)
            tensors.update({k: entry.cut(k, f.start, f.end, f.shape, checkpoint)
                            for k in keys if k in entry.values})
        pieces.append(FragmentState(f.name, f.shape, f.start, f.end, tensors))
    optimizer.load_fragments(pieces)
    if moments:
        saved = state["optimizer"]
        # the oldest checkpoints kept torch.optim.AdamW's step per parameter
        step = saved["step"] if "step" in saved else next(
            (int(e["step"]) for e in saved["params"].values()
             if isinstance(e, dict) and "step" in e), 0)
        optimizer.load_counters(step, saved.get("scaler"))  # None: converted from other weights


def _check_same_optimizer(f: FragmentState, entry: Entry, optimizer: MixedPrecisionAdamW,
                          at: str) -> None:
    """A Muon matrix's state is a momentum, AdamW's two moments: a checkpoint whose state is the
    other optimizer's is refused (its moments would be read as zeros)."""
    saved = [k for k in MOMENTS + MUON_MOMENTS if k in entry.values]
    wanted = [k for k in f.tensors if k not in WEIGHT]
    if not saved or set(saved) == set(wanted):
        return
    ours = optimizer.cfg.optimizer
    theirs = "muon" if "momentum" in saved else "adamw"
    raise CheckpointError(
        f"checkpoint{at} holds {'Muon' if theirs == 'muon' else 'AdamW'} state for '{f.name}' "
        f"(saved with optim.optimizer={theirs}), this run has optim.optimizer={ours}: resume with "
        f"optim.optimizer={theirs}, or set --checkpoint.finetune true to start the optimizer "
        "fresh from its weights")


def retained(iterations: list[int], keep_last: int, keep_every: int = 0,
             milestones: list[float] = ()) -> set[int]:
    """The checkpoints to keep among ``iterations``: the ``keep_last`` newest (0: all), those at a
    multiple of ``keep_every``, and for each milestone (an iteration, e.g. every 10% of the run)
    the newest checkpoint at or before it."""
    done = sorted(iterations)
    keep = set(done if keep_last <= 0 else done[-keep_last:])
    keep.update(i for i in done if keep_every and i % keep_every == 0)
    for m in milestones:
        before = [i for i in done if i <= m]
        if before:
            keep.add(before[-1])
    return keep


def milestone_iterations(fraction: float, iters: int) -> list[float]:
    """The iterations at every ``fraction`` of a run of ``iters`` (0: none), e.g. 0.1 → 10%, 20%,
    ..."""
    if fraction <= 0:
        return []
    return [k * fraction * iters for k in range(1, int(1 / fraction + 1e-9) + 1)]


class CheckpointManager:
    def __init__(self, run_dir: str, *, rank: int, world_size: int, layout: dict, vocab_size: int,
                 padded_vocab: int, keep_last: int = 3, keep_every: int = 0,
                 milestones: list[float] = (), async_save: bool = False,
                 tensors: dict | None = None, device: torch.device | str = "cpu",
                 prune_rolled_back: bool = True, sharding: dict | None = None,
                 group: Group | None = None):
        """``layout`` ({tp, pp, dp, cp}; cp 1 when absent), the vocabulary (real and padded) and
        ``tensors`` (every parameter's global shape) go into ``metadata.json``; ``milestones`` are
        iterations whose newest checkpoint at or before them retention keeps (see :func:`retained`);
        ``prune_rolled_back``: retention also removes set-aside checkpoints past the newest
        ``keep_last`` of them (false: they are all kept); ``sharding``: how the optimizer state was
        cut into ZeRO ranges (loading under another one takes the resharding path); ``group``: the
        whole world's group the ranks agree on (``ParallelState.checkpoint``; one process: none).
        """
        if group is None and world_size > 1:
            raise TypeError("a CheckpointManager of several ranks needs their group "
                            "(ParallelState.checkpoint)")
        self.group = group or Group("checkpoint", [rank], rank_in_group=0)
        self.device = torch.device(device)
        self.root = os.path.join(run_dir, "checkpoints")
        self.rank, self.world_size = rank, world_size
        self.layout = {**layout, "cp": layout.get("cp", 1)}  # as read_metadata() reads it back
        self.vocab_size, self.padded_vocab, self.tensors = vocab_size, padded_vocab, tensors
        self.keep_last, self.keep_every, self.milestones = keep_last, keep_every, list(milestones)
        self.async_save, self.prune_rolled_back, self.sharding = \
            async_save, prune_rolled_back, sharding
        # (iteration, the async writer or None, its errors, set once this rank's record is written)
        self._pending: tuple[int, threading.Thread | None, list, threading.Event] | None = None
        self._copied: threading.Event | None = None  # set once the async save's snapshot is taken
        self._snapshot = SnapshotBuffers()
        os.makedirs(self.root, exist_ok=True)
        if rank == 0:
            self.cleanup()
        self.group.barrier()

    def cleanup(self) -> list[str]:
        """Remove what interrupted saves left behind (``.iter_*`` directories, ``*.part`` files,
        the temporary directories of an interrupted ``checkpoint.average_last``). Nothing complete
        is touched. Returns what was removed."""
        removed = []
        for name in os.listdir(self.root):
            path = os.path.join(self.root, name)
            if name.startswith((".iter_", ".average_last_")) and os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            elif name.endswith(".part") or name == ".latest":
                os.remove(path)
            else:
                continue
            removed.append(name)
        return removed

    # -- saving -----------------------------------------------------------------------------------

    def save(self, iteration: int, state: dict) -> None:
        """Write this rank's ``state`` for ``iteration`` (collective: every rank calls it); its
        tensors may be views of live training state (see :func:`optimizer_views`). Synchronous:
        written straight from them. Async: returns once they are copied to host buffers."""
        self.finalize()  # at most one save in flight
        tmp = os.path.join(self.root, "." + iter_dir_name(iteration))
        if self.rank == 0:
            if os.path.exists(tmp):
                shutil.rmtree(tmp)  # leftovers of an interrupted save; never a complete checkpoint
            os.makedirs(tmp)
        self.group.barrier()
        errors: list = []
        recorded = threading.Event()
        if self.async_save:
            self._copied = threading.Event()
            thread = threading.Thread(target=self._write,
                                      args=(iteration, state, tmp, errors, recorded, self._copied),
                                      daemon=True, name=f"checkpoint-{iteration}")
            thread.start()
            self._pending = (iteration, thread, errors, recorded)
        else:
            self._write(iteration, state, tmp, errors, recorded)
            self._pending = (iteration, None, errors, recorded)
            self.finalize()

    def _take_snapshot(self, state: dict) -> dict:
        """``state`` copied into the host buffers (async saves, on the writer thread). On CUDA the
        copies run on a side stream after the work queued so far, and are complete on return."""
        if self.device.type != "cuda":
            return self._snapshot.copy(state)
        stream = torch.cuda.Stream(self.device)
        # the optimizer step that made the state
        stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.cuda.stream(stream):
            state = self._snapshot.copy(state)
        stream.synchronize()
        return state

    def wait_snapshot(self) -> float:
        """Block until an async save in flight has copied the live state — call it before anything
        changes that state (the optimizer step); returns the seconds waited."""
        if self._copied is None or self._copied.is_set():
            return 0.0
        start = time.perf_counter()
        self._copied.wait()
        return time.perf_counter() - start

    def step_boundary(self) -> None:
        """Between training steps (collective: every rank calls it): while an async save is in
        flight, agree whether every rank's writer is done, and if so finish it (see finalize())."""
        if self._pending is None:
            return
        if _reduced(self.group, 0.0 if self.poll() else 1.0) == 0:  # 1: a rank is still writing
            self.finalize()

    def _write(self, iteration: int, state: dict, tmp: str, errors: list,
               recorded: threading.Event, copied: threading.Event | None = None) -> None:
        """This rank's file and its ``done`` record (``recorded`` set once written). Async
        (``copied`` given): take the snapshot first and say when it is taken; on rank 0 then the
        publication (a synchronous save's is finalize()'s)."""
        path = rank_file(tmp, self.rank)
        record: dict = {}
        try:
            if copied is not None:
                try:
                    # training may change the originals from now on
                    state = self._take_snapshot(state)
                finally:
                    copied.set()
            size, crc = write_rank_state(path, state)
            record = {"file": os.path.basename(path), "bytes": size, "crc32": crc}
        except Exception as exc:  # reported by finalize() on the training thread
            errors.append(_as_full_disk(exc, iteration, self.root,
                                        planned_size(state) * self.world_size))
            record = {"error": f"{type(exc).__name__}: {exc}", "errno": getattr(exc, "errno", None)}
        finally:
            self._write_done(path, record, errors, iteration)
            recorded.set()
        if self.rank == 0 and copied is not None:
            self._publish_or_record(iteration, tmp, errors)

    def _publish_or_record(self, iteration: int, tmp: str, errors: list) -> None:
        try:
            self._publish(iteration, tmp, own_failed=bool(errors))
        except Exception as exc:
            errors.append(_as_full_disk(exc, iteration, self.root))

    def _write_done(self, path: str, record: dict, errors: list, iteration: int) -> None:
        """This rank's ``done`` record; where even that cannot be written (a full disk), an empty
        ``.failed`` marker (it needs no data block), so that rank 0 never waits for it in vain."""
        stem = path[:-len(".safetensors")]
        try:
            write_text(stem + _DONE, json.dumps(record))
        except OSError as exc:
            if not errors:
                errors.append(_as_full_disk(exc, iteration, self.root))
            try:
                os.close(os.open(stem + _FAILED, os.O_CREAT | os.O_WRONLY, 0o644))
            except OSError:
                pass

    def _publish(self, iteration: int, tmp: str, own_failed: bool = False) -> None:
        """Rank 0: wait for every rank's ``done`` record, then write the metadata, rename the
        directory into place, move ``latest`` and apply retention — each step durable first.
        ``own_failed``: rank 0's file failed, nothing will be published (finalize() cleans up)."""
        if own_failed:
            return
        records, delay = {}, 0.002
        while len(records) < self.world_size:
            for r in range(self.world_size):
                stem = rank_file(tmp, r)[:-len(".safetensors")]
                if r not in records and os.path.exists(stem + _DONE):
                    with open(stem + _DONE) as fh:
                        records[r] = json.load(fh)
                elif r not in records and os.path.exists(stem + _FAILED):
                    records[r] = {"error": "its record could not be written", "errno": errno.ENOSPC}
            if len(records) < self.world_size:
                time.sleep(delay)
                delay = min(2 * delay, 0.1)
        failed = {r: rec for r, rec in records.items() if "error" in rec}
        if failed:
            first = next(iter(failed.values()))
            message = f"rank(s) {sorted(failed)} failed to write: {first['error']}"
            raise OSError(first["errno"], message) if first.get("errno") else RuntimeError(message)
        files = {rec["file"]: (rec["bytes"], rec["crc32"]) for rec in records.values()}
        write_metadata(tmp, metadata(iteration=iteration, world_size=self.world_size,
                                     layout=self.layout, vocab_size=self.vocab_size,
                                     padded_vocab=self.padded_vocab, files=files,
                                     tensors=self.tensors, time=time.time(),
                                     **({"sharding": self.sharding} if self.sharding else {})))
        for r in range(self.world_size):
            os.remove(rank_file(tmp, r)[:-len(".safetensors")] + _DONE)
        fsync_dir(tmp)
        name = iter_dir_name(iteration)
        final = os.path.join(self.root, name)
        if os.path.exists(final):
            os.rename(final, f"{final}.replaced-{int(time.time())}")
        os.rename(tmp, final)
        fsync_dir(self.root)
        self._point_latest(name)
        self._apply_retention()

    def _point_latest(self, name: str) -> None:
        write_text(os.path.join(self.root, ".latest"), name + "\n")
        os.replace(os.path.join(self.root, ".latest"), os.path.join(self.root, "latest"))
        fsync_dir(self.root)

    def poll(self) -> bool:
        """Whether no save is in flight any more (a finished async save was published by rank 0's
        writer as soon as every rank was done); not collective."""
        return self._pending is None or self._pending[1] is None or not self._pending[1].is_alive()

    def finalize(self) -> str | None:
        """Wait for a pending save and make sure it was published (collective); raises on every
        rank when any rank failed to write it."""
        if self._pending is None:
            return None
        iteration, thread, errors, recorded = self._pending
        self._pending = None
        recorded.wait()
        # every rank has written its record (or is gone, and this collective fails): only now
        # may rank 0 wait for the records, publishing a synchronous save here, an async one on
        # its writer thread
        failed = _reduced(self.group, _failure(errors))
        if failed == 0 and thread is None and self.rank == 0:
            tmp = os.path.join(self.root, "." + iter_dir_name(iteration))
            self._publish_or_record(iteration, tmp, errors)
        if thread is not None:
            thread.join()
        if failed == 0:  # the publication's outcome (it may have failed on rank 0)
            failed = _reduced(self.group, _failure(errors))
        if failed > 0:
            self.group.barrier()  # every rank's writer is done with the temporary directory
            if self.rank == 0:
                shutil.rmtree(os.path.join(self.root, "." + iter_dir_name(iteration)),
                              ignore_errors=True)
            self.group.barrier()
            if failed == 2:
                raise next((e for e in errors if isinstance(e, DiskFullError)), None) or \
                    _as_full_disk(OSError(errno.ENOSPC, "on another rank"), iteration, self.root)
            reason = errors[0] if errors else "another rank failed"
            raise RuntimeError(f"checkpoint {iteration} was not saved: {reason}")
        return iter_dir_name(iteration)

    def complete(self) -> list[int]:
        """Iterations of the complete checkpoints of this run, oldest first."""
        return sorted(i for d in os.listdir(self.root) if (i := iteration_of(d)) is not None
                      and os.path.exists(os.path.join(self.root, d, METADATA)))

    def _apply_retention(self) -> None:
        done = self.complete()
        keep = retained(done, self.keep_last, self.keep_every, self.milestones)
        for i in done:
            if i not in keep:
                shutil.rmtree(os.path.join(self.root, iter_dir_name(i)), ignore_errors=True)
        # set-aside checkpoints of rollbacks: the newest keep_last
        if self.keep_last > 0 and self.prune_rolled_back:
            aside = sorted((int(d.rsplit("-", 1)[1]), d) for d in os.listdir(self.root)
                           if ".rolled-back-" in d and d.rsplit("-", 1)[1].isdigit())
            for _, d in aside[:-self.keep_last]:
                shutil.rmtree(os.path.join(self.root, d), ignore_errors=True)

    # -- loading ----------------------------------------------------------------------------------

    def latest(self) -> str | None:
        """Path of the newest complete checkpoint in this run, or None (unchecked: see
        :meth:`choose`)."""
        return latest_checkpoint(self.root)

    def newest_before(self, iteration: int) -> str | None:
        """The newest complete checkpoint of this run saved before ``iteration``, or None."""
        done = [i for i in self.complete() if i < iteration]
        return os.path.join(self.root, iter_dir_name(max(done))) if done else None

    def set_aside_from(self, iteration: int, keep: str) -> list[str]:
        """After a rollback to ``keep``: rename the checkpoints saved at ``iteration`` or later to
        ``NAME.rolled-back-TIME`` (kept until retention drops them: the newest ``keep_last``) and
        point ``latest`` at ``keep`` (collective). Returns the names set aside."""
        self.finalize()
        moved = sorted(d for d in os.listdir(self.root) if (i := iteration_of(d)) is not None and
                       i >= iteration)
        self.group.barrier()  # every rank has read what it needs before anything moves
        if self.rank == 0:
            stamp = int(time.time())
            for d in moved:
                os.rename(os.path.join(self.root, d),
                          os.path.join(self.root, f"{d}.rolled-back-{stamp}"))
            fsync_dir(self.root)
            self._point_latest(os.path.basename(keep))
        self.group.barrier()
        return moved

    def usable(self, path: str) -> str | None:
        """None when checkpoint ``path`` passes every check on every rank, else the first problem
        found (collective: each rank checksums every world_size-th file of it)."""
        try:
            saved_world = read_metadata(path)["world_size"]
        except CheckpointError as exc:
            found = str(exc)
        else:
            found = problem(path, range(self.rank, saved_world, self.world_size))
        return _first_problem(found, self.group)

    def choose(self, explicit: str | None = None) -> tuple[str | None, list[str]]:
        """The checkpoint to resume from, and warnings about unusable ones passed over (collective):
        this run's newest usable checkpoint (``latest`` first), else ``explicit`` (an ``iter_*``
        directory, or a run directory: its newest usable). Raises when checkpoints exist but none
        can be used. An ``explicit`` one passed over for the run's own is named in a warning."""
        warnings: list[str] = []
        path = self._first_usable(self.root, warnings)
        own = {os.path.realpath(p)
               for p in (self.root, os.path.dirname(self.root), path or self.root)}
        if path is not None and explicit and os.path.realpath(explicit) not in own:
            warnings.append(f"resuming from {path}, this run's own newest checkpoint: "
                            f"checkpoint.load={explicit} is read only while run.dir has none (to "
                            "start from it instead, use a new run.dir)")
        if path is None and explicit:
            if os.path.exists(os.path.join(explicit, METADATA)):
                found = self.usable(explicit)
                if found:
                    raise CheckpointError(f"--checkpoint.load {explicit} cannot be used: {found}")
                path = explicit
            else:
                roots = [r for r in (os.path.join(explicit, "checkpoints"), explicit)
                         if os.path.isdir(r)]
                for root in roots:
                    path = path or self._first_usable(root, warnings)
                if path is None:
                    raise CheckpointError(f"--checkpoint.load {explicit} is not a complete "
                                          f"checkpoint (no {METADATA}) nor a run directory with a "
                                          "usable one"
                                          + (f" ({'; '.join(warnings)})" if warnings else ""))
        if path is None and warnings:
            raise CheckpointError(f"no usable checkpoint in {self.root}: {'; '.join(warnings)}; "
                                  "repair or move them aside, or start from another with "
                                  "--checkpoint.load")
        return path, warnings

    def _first_usable(self, root: str, warnings: list[str]) -> str | None:
        paths, note = candidates(root)
        skipped = []
        for path in paths:
            found = self.usable(path)
            if found is None:
                warnings += ([f"{note}; using {path}"] if note else []) + skipped
                return path
            skipped.append(f"skipped {path}: {found}")
        warnings += ([f"{note}; no usable checkpoint in {root}"] if note else []) + skipped
        return None

    def load(self, path: str) -> dict:
        """This rank's state from checkpoint directory ``path``, checked against the layout."""
        meta = read_metadata(path)
        if meta["world_size"] != self.world_size or meta["layout"] != self.layout:
            raise CheckpointError(
                f"checkpoint {path} was saved with world_size={meta['world_size']} "
                f"layout={meta['layout']}, but this run has world_size={self.world_size} "
                f"layout={self.layout}; relaunch with the saved layout")
        return read_rank_state(path, self.rank, meta.get("format_version", 1))


def _as_full_disk(exc: BaseException, iteration: int, root: str,
                  needed: int | None = None) -> BaseException:
    """``exc`` as the one line of a save that found no room (a DiskFullError naming the directory,
    this rank's bytes and the bytes free), or ``exc`` itself when it is another failure."""
    if not (isinstance(exc, OSError) and exc.errno in FULL_DISK):
        return exc
    return disk_full(root, needed,
                     f"checkpoint {iteration} was not saved (its partial files were removed; the "
                     "newest complete checkpoint is kept): free space there, lower "
                     "checkpoint.keep_last, or move run.dir")


def _first_problem(found: str | None, group: Group) -> str | None:
    """The problem of the lowest rank of ``group`` that found one (every rank returns the same), or
    None."""
    if group.size == 1:
        return found
    src = int(_reduced(group, group.rank if found else group.size, dist.ReduceOp.MIN))
    if src == group.size:
        return None
    text = torch.zeros(1024, dtype=torch.uint8)
    if group.rank == src:
        raw = found.encode()[:1024]
        text[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    group.broadcast(text, src)
    return bytes(text.tolist()).rstrip(b"\0").decode(errors="replace")
