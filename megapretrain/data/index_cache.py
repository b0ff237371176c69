"""On-disk cache of dataset index arrays, shared by the ranks of a node.

A cache entry is named by a stem that carries a hash of everything the arrays depend on: the
arrays as ``STEM_NAME.npy`` files, then ``STEM.json``, a manifest written last (via a temporary name
and a rename) that records the full key and each array's shape and dtype. An entry counts only
when its manifest exists, matches the key, and every array matches the manifest; a crashed build
or a half-copied cache directory is therefore never read, and is rebuilt by the builder.

Protocol for a node with several ranks (see ``build_gpt_datasets``): the builder (local rank 0)
calls ``load_indices`` and, on a miss, builds and ``save_indices``; the other ranks wait for the
manifest with ``wait_s > 0`` and memory-map the same files, so every rank of the node shares one
copy in the page cache.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from ..errors import full_disk_guard

POLL_S = 0.05


def load_indices(cache_dir: str | None, stem: str | None, key: str, names: Sequence[str],
                 wait_s: float = 0.0) -> dict[str, np.ndarray] | None:
    """Memory-map a complete cache entry, or None when caching is off or it is missing or stale.

    With ``wait_s > 0`` a missing entry is polled for until it appears (another rank builds it);
    after ``wait_s`` seconds without it, TimeoutError names the manifest that never appeared.
    """
    if cache_dir is None or stem is None:
        return None
    manifest = os.path.join(cache_dir, f"{stem}.json")
    deadline = time.monotonic() + wait_s
    while True:
        arrays = _read_entry(cache_dir, stem, key, names)
        if arrays is not None or wait_s <= 0:
            return arrays
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {wait_s:.0f}s for {manifest}, which the node's local rank "
                               "0 builds (build_indices=True); is data.cache_dir the same "
                               "directory for every rank of the node, and did local rank 0 fail?")
        time.sleep(POLL_S)


def save_indices(cache_dir: str | None, stem: str | None, key: str,
                 arrays: dict[str, np.ndarray]) -> None:
    """Write each array under a temporary name and rename it, then the manifest last."""
    if cache_dir is None or stem is None:
        return
    os.makedirs(cache_dir, exist_ok=True)
    described = {}
    needed = sum(arr.nbytes for arr in arrays.values())
    with full_disk_guard(cache_dir, needed,
                         "free space there, or set data.cache_dir to a disk with room"):
        for name, arr in arrays.items():
            _atomic_write(os.path.join(cache_dir, f"{stem}_{name}.npy"),
                          lambda f, a=arr: np.save(f, a, allow_pickle=False))
            described[name] = {"shape": list(arr.shape), "dtype": arr.dtype.str}
        blob = json.dumps({"key": key, "arrays": described}, indent=1).encode()
        _atomic_write(os.path.join(cache_dir, f"{stem}.json"), lambda f: f.write(blob))


def cached_or_built(cache_dir: str | None, stem: str | None, key: str, names: Sequence[str],
                    build: Callable[[], dict[str, np.ndarray]], build_indices: bool,
                    wait_s: float) -> tuple[dict[str, np.ndarray], bool]:
    """(arrays, built): the cache entry if complete, else ``build()`` saved to the cache.

    ``build_indices=False`` never builds while a cache directory is set: it waits up to ``wait_s``
    for the builder's entry. Without a cache directory every caller builds (nothing to share).
    """
    if not build_indices and cache_dir is not None and stem is not None:
        return load_indices(cache_dir, stem, key, names, wait_s=max(wait_s, POLL_S)), False
    arrays = load_indices(cache_dir, stem, key, names)
    if arrays is not None:
        return arrays, False
    arrays = build()
    save_indices(cache_dir, stem, key, arrays)
    return arrays, True


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
