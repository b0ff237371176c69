"""On-disk cache of dataset index arrays, shared by the ranks of a node.

A cache entry is named by a stem that carries a hash of everything the arrays depend on: the
arrays as ``STEM_NAME.npy`` files, then ``STEM.json``, a manifest written last (via a temporary name
and a rename) that records the full key and each array's shape and dtype. An entry counts only
when its manifest exists, matches the key, and every array matches the manifest; a crashed build
or a half-copied cache directory is therefore never read, and is rebuilt by the builder.

The builder streams the arrays into their files piece by piece (``cached_or_built``), so its memory
is one piece, not the index; what it must permute whole (an epoch's order) it reserves in the file
and permutes there, mapped. Afterwards it memory-maps the files like every other rank.

Protocol for a node with several ranks (see ``build_gpt_datasets``): the builder (local rank 0)
calls ``cached_or_built`` with ``build_indices=True``: it loads the entry or builds it, writing
``STEM.progress`` (how far, since when) as it goes; the other ranks wait for the manifest
(``build_indices=False``), printing the builder's progress and an estimate of the time left every
``WAIT_LOG_S`` seconds, and memory-map the same files, so every rank of the node shares one copy in
the page cache.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from ..errors import full_disk_guard

POLL_S = 0.05
PROGRESS_S = 1.0  # how often a builder rewrites its progress file
WAIT_LOG_S = 15.0  # how often a waiting rank prints the builder's progress


def load_indices(cache_dir: str | None, stem: str | None, key: str, names: Sequence[str],
                 wait_s: float = 0.0) -> dict[str, np.ndarray] | None:
    """Memory-map a complete cache entry, or None when caching is off or it is missing or stale.

    With ``wait_s > 0`` a missing entry is polled for until it appears (another rank builds it),
    printing the builder's progress every ``WAIT_LOG_S`` seconds. The wait ends ``wait_s`` seconds
    after the builder last reported progress (or after the wait began, if it never did): then
    TimeoutError names the manifest that never appeared. A long build that keeps reporting is
    waited for to its end.
    """
    if cache_dir is None or stem is None:
        return None
    manifest = os.path.join(cache_dir, f"{stem}.json")
    progress = os.path.join(cache_dir, f"{stem}.progress")
    deadline = time.monotonic() + wait_s
    next_log = time.monotonic() + min(WAIT_LOG_S, 2.0)
    reported = None
    while True:
        arrays = _read_entry(cache_dir, stem, key, names)
        if arrays is not None or wait_s <= 0:
            return arrays
        try:
            changed = os.stat(progress).st_mtime_ns
        except OSError:
            changed = None
        if changed is not None and changed != reported:
            reported, deadline = changed, time.monotonic() + wait_s
        if time.monotonic() >= next_log:
            next_log = time.monotonic() + WAIT_LOG_S
            # print, not logging: the trainer's ranks print, and this must reach the user
            print(f"waiting for the data index: {build_progress(cache_dir, stem) or stem}"
                  f"{'' if os.path.exists(progress) else ' (its builder has not begun it yet)'}",
                  file=sys.stderr, flush=True)
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {wait_s:.0f}s for {manifest}, which the node's local rank "
                               "0 builds (build_indices=True); is data.cache_dir the same "
                               "directory for every rank of the node, and did local rank 0 fail?")
        time.sleep(POLL_S)


Build = Callable[[Callable[..., "ArraySink"], Callable[[float], None]], None]


def cached_or_built(cache_dir: str | None, stem: str | None, key: str, names: Sequence[str],
                    build: Build, build_indices: bool, wait_s: float,
                    needed_bytes: int = 0) -> tuple[dict[str, np.ndarray], bool]:
    """(arrays, built): the cache entry if complete, else ``build`` written to it and mapped.

    ``build(open_array, report)`` makes the arrays piece by piece: ``open_array(name, dtype,
    row_shape=())`` gives a sink whose ``append(rows)`` adds rows in order (``reserve(count)``:
    rows to fill in place), and ``report(fraction done)`` says how far it is (ranks waiting for
    the entry print it). With a cache directory each piece goes straight to its file (reserved
    rows are the file, mapped), so the builder never holds a whole array: the arrays it returns
    are the files memory-mapped, like everyone else's. ``needed_bytes`` (the files' size,
    about) names the space a full disk lacked.

    ``build_indices=False`` never builds while a cache directory is set: it waits up to ``wait_s``
    for the builder's entry. Without a cache directory every caller builds, in memory (nothing to
    share).
    """
    if not build_indices and cache_dir is not None and stem is not None:
        return load_indices(cache_dir, stem, key, names, wait_s=max(wait_s, POLL_S)), False
    arrays = load_indices(cache_dir, stem, key, names)
    if arrays is not None:
        return arrays, False
    if cache_dir is None or stem is None:
        sinks: dict[str, _MemorySink] = {}

        def open_in_memory(name, dtype, row_shape=()):
            sinks[name] = _MemorySink(dtype, row_shape)
            return sinks[name]

        build(open_in_memory, lambda fraction: None)
        return {name: sinks[name].array() for name in names}, True
    _write_entry(cache_dir, stem, key, names, build, needed_bytes)
    return load_indices(cache_dir, stem, key, names), True


class ArraySink:
    """Where ``build`` appends the rows of one array (see ``cached_or_built``)."""

    def __init__(self, dtype, row_shape=()):
        self.dtype, self.row_shape, self.rows = np.dtype(dtype), tuple(row_shape), 0

    def append(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        if rows.shape[1:] != self.row_shape:
            raise ValueError(f"rows of shape {rows.shape[1:]} appended to an array of rows "
                             f"{self.row_shape}")
        self._write(rows)
        self.rows += rows.shape[0]

    def reserve(self, count: int) -> np.ndarray:
        """``count`` rows appended now, returned writable for the builder to fill in place (an
        epoch's order, shuffled where it lies). In a cache file they are a view of the file,
        mapped: page cache the kernel can write back, not the builder's own memory."""
        rows = self._reserve(int(count))
        self.rows += int(count)
        return rows

    def _write(self, rows: np.ndarray) -> None:
        raise NotImplementedError

    def _reserve(self, count: int) -> np.ndarray:
        raise NotImplementedError


class _MemorySink(ArraySink):
    def __init__(self, dtype, row_shape=()):
        super().__init__(dtype, row_shape)
        self.parts: list[np.ndarray] = []

    def _write(self, rows):
        self.parts.append(rows)

    def _reserve(self, count):
        self.parts.append(np.empty((count, *self.row_shape), dtype=self.dtype))
        return self.parts[-1]

    def array(self) -> np.ndarray:
        if len(self.parts) == 1:
            return self.parts[0]
        if not self.parts:
            return np.empty((0, *self.row_shape), dtype=self.dtype)
        return np.concatenate(self.parts)


class _FileSink(ArraySink):
    """One array streamed into a ``.npy`` file: rows written as they come, after room kept for
    the header, which holds the row count and so is written last (numpy reads any header padded
    with spaces to a multiple of 64 bytes)."""

    HEADER = 128

    def __init__(self, path: str, dtype, row_shape=()):
        super().__init__(dtype, row_shape)
        self.path, self.tmp = path, f"{path}.tmp.{os.getpid()}"
        self.file = open(self.tmp, "wb")
        self.file.seek(self.HEADER)

    def _write(self, rows):
        self.file.write(rows.data)

    def _reserve(self, count):
        row_bytes = self.dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64))
        start = self.HEADER + self.rows * row_bytes
        self.file.truncate(start + count * row_bytes)  # flushes what was written, then extends
        self.file.seek(start + count * row_bytes)
        if count == 0:
            return np.empty((0, *self.row_shape), dtype=self.dtype)
        # A plain ndarray view of the map (numpy's shuffle takes its fast path on no subclass).
        return np.asarray(np.memmap(self.tmp, dtype=self.dtype, mode="r+", offset=start,
                                    shape=(count, *self.row_shape)))

    def close(self) -> dict:
        """Write the header, rename into place; the manifest's description of the array."""
        shape = (self.rows, *self.row_shape)
        text = repr({"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                     "shape": shape}).encode("latin1")
        room = self.HEADER - 10 - len(text)  # magic 6, version 2, length 2
        self.file.seek(0)
        self.file.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", room + len(text)) + text
                        + b" " * (room - 1) + b"\n")
        self.file.close()
        os.replace(self.tmp, self.path)
        return {"shape": list(shape), "dtype": self.dtype.str}

    def discard(self) -> None:
        if not self.file.closed:
            self.file.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)


def _write_entry(cache_dir: str, stem: str, key: str, names: Sequence[str], build: Build,
                 needed_bytes: int) -> None:
    """Stream ``build`` into the entry's files, then the manifest; a failure leaves none of them
    (and no progress file)."""
    os.makedirs(cache_dir, exist_ok=True)
    sinks: dict[str, _FileSink] = {}
    progress = os.path.join(cache_dir, f"{stem}.progress")
    started, last = time.time(), [0.0]

    def open_file(name, dtype, row_shape=()):
        sinks[name] = _FileSink(os.path.join(cache_dir, f"{stem}_{name}.npy"), dtype, row_shape)
        return sinks[name]

    def report(fraction: float) -> None:
        now = time.time()
        if now - last[0] >= PROGRESS_S:
            last[0] = now
            blob = json.dumps({"fraction": float(fraction), "started": started, "pid": os.getpid(),
                               "host": socket.gethostname()}).encode()
            _atomic_write(progress, lambda f: f.write(blob))

    try:
        with full_disk_guard(cache_dir, needed_bytes or None,
                             "free space there, or set data.cache_dir to a disk with room"):
            report(0.0)  # waiting ranks see that the build began
            build(open_file, report)
            missing = set(names) - set(sinks)
            if missing:
                raise ValueError(f"the build of {stem} wrote no {sorted(missing)}")
            described = {name: sinks[name].close() for name in names}
            blob = json.dumps({"key": key, "arrays": described}, indent=1).encode()
            _atomic_write(os.path.join(cache_dir, f"{stem}.json"), lambda f: f.write(blob))
    finally:
        for sink in sinks.values():
            sink.discard()
        if os.path.exists(progress):
            os.remove(progress)


def build_progress(cache_dir: str, stem: str) -> str | None:
    """A line on another process's build of the entry: how far, for how long, about how long
    left; None while it has not reported."""
    try:
        with open(os.path.join(cache_dir, f"{stem}.progress"), encoding="utf-8") as f:
            state = json.load(f)
        fraction, elapsed = float(state["fraction"]), max(time.time() - float(state["started"]),
                                                          0.0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    left = f"about {elapsed * (1 - fraction) / fraction:.0f}s left" if fraction > 0 \
        else "no estimate yet"
    return (f"{stem} is being built by pid {state.get('pid')} on {state.get('host')}: "
            f"{100 * fraction:.0f}% after {elapsed:.0f}s, {left}")


def _read_entry(cache_dir: str, stem: str, key: str,
                names: Sequence[str]) -> dict[str, np.ndarray] | None:
    try:
        with open(os.path.join(cache_dir, f"{stem}.json"), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    if manifest.get("key") != key or set(manifest.get("arrays", {})) != set(names):
        return None
    arrays = {}
    for name in names:
        path = os.path.join(cache_dir, f"{stem}_{name}.npy")
        expected = manifest["arrays"][name]
        try:  # an empty array cannot be memory-mapped: read it
            arr = np.load(path, mmap_mode="r" if np.prod(expected["shape"]) else None,
                          allow_pickle=False)
        except (OSError, ValueError):
            return None
        if list(arr.shape) != expected["shape"] or arr.dtype.str != expected["dtype"]:
            return None
        # A plain ndarray view of the map: indexing a np.memmap subclass costs a Python call each
        # time.
        arrays[name] = np.asarray(arr)
    return arrays


def _atomic_write(path: str, write: Callable) -> None:
    """``write(file)`` into a temporary name, renamed to ``path`` when whole; removed if it
    fails."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
