"""The blend assignment: which dataset serves each global sample, in compiled code.

Sample ``i`` goes to the dataset whose count lags its target ``weight * t`` the most (ties to the
lowest index), Megatron-LM's greedy blending. Each choice depends on all earlier ones, so it is a
sequential loop: a few dozen C lines, compiled once per machine with the system C compiler into the
user's cache directory (``$XDG_CACHE_HOME`` or ``~/.cache``, ``megapretrain/``) and called through
ctypes: no build step at install, nothing new to install.

megatron-core's helper scans every dataset for every sample, in one branching pass. Up to 20
datasets this loop does the same; up to 128 it scans them all in two passes the compiler
vectorizes (the largest lag with SIMD max instructions, then the first dataset holding it): the
faster beyond about 20 (``tools/bench_data.py blend``). Beyond 128, it keeps the datasets sorted
by weight in blocks of 16 with an upper bound on each block's largest lag, and scans only the
blocks that can hold the largest (a block's lags grow by at most its largest weight per sample
until one of its datasets is chosen): with 1,000 datasets of unequal weights, a few blocks per
sample instead of 63. All lags are ``weight * t - count`` in double precision with two roundings
(``-ffp-contract=off``: no fused multiply-add), exactly as the Python reference below computes
them, and the bounds keep a margin over their roundings, so the choices are bit-for-bit the
reference's, ties included.

Without a working C compiler the reference loop runs instead (about 0.09 us per sample and
dataset), after one log line saying so.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import sysconfig
import tempfile
from array import array
from collections.abc import Iterator

import numpy as np

from ..errors import DataError

logger = logging.getLogger(__name__)

MAX_DATASETS = int(np.iinfo(np.int16).max)  # dataset ids are int16, as in Megatron's index

_SOURCE = r"""
#include <math.h>
#include <stdint.h>

#define BLOCK 16
#ifndef SMALL
#define SMALL 128  /* up to this many datasets, every sample scans them all */
#endif
#define FEW 20  /* up to this many, in one pass (Megatron's loop); beyond, two vectorized ones */
#define NONE 1e300  /* finite sentinels: built with -ffinite-math-only */

/* The largest lag among slots [lo, hi) at target t: a branch-free pass the compiler vectorizes. */
static inline double block_max(const double *w, const double *c, int64_t lo, int64_t hi, double t)
{
    double best = -NONE;
    for (int64_t s = lo; s < hi; ++s) {
        const double lag = w[s] * t - c[s];
        best = lag > best ? lag : best;
    }
    return best;
}

/* Slots hold the datasets by decreasing weight (id[slot]: the dataset), in blocks of BLOCK.
   bound[b] is block b's largest lag at target at[b]; until one of its datasets is chosen its
   lags grow by at most wmax[b] per unit of target, so a block whose bound stays below the best
   lag found so far is skipped. The bound carries a margin of several units in the last place over
   the roundings of weight * t - count, so a block is skipped only if none of its lags can equal
   the best: the choice (largest lag, lowest dataset id on ties) is exactly a full scan's.
   target(i) = max(i + offset, 1): offset 1 is megapretrain's (i + 1), 0 Megatron-LM's.
   Samples [start, stop) are written to dataset_index[i - start] etc.; c, bound, at and wmax carry
   the state from one call to the next (start 0 initializes them). */
void blend(const double *w, const int16_t *id, int64_t num_datasets, int64_t start, int64_t stop,
           int64_t offset, double *c, double *bound, double *at, double *wmax,
           int16_t *dataset_index, int64_t *dataset_sample_index)
{
    if (num_datasets <= SMALL) {  /* slots in id order: the first slot holding the max wins */
        for (int64_t i = start; i < stop; ++i) {
            const double t = (double)(i + offset > 1 ? i + offset : 1);
            int64_t chosen = 0;
            if (num_datasets <= FEW) {
                double best = w[0] * t - c[0];
                for (int64_t s = 1; s < num_datasets; ++s) {
                    const double lag = w[s] * t - c[s];
                    if (lag > best) {
                        best = lag;
                        chosen = s;
                    }
                }
            } else {
                const double best = block_max(w, c, 0, num_datasets, t);
                while (w[chosen] * t - c[chosen] != best)
                    ++chosen;
            }
            dataset_index[i - start] = id[chosen];
            dataset_sample_index[i - start] = (int64_t)c[chosen];
            c[chosen] += 1.0;
        }
        return;
    }
    const int64_t blocks = (num_datasets + BLOCK - 1) / BLOCK;
    for (int64_t b = 0; b < blocks && start == 0; ++b) {
        wmax[b] = w[b * BLOCK];  /* weights decrease along the slots */
        bound[b] = NONE;
        at[b] = 1.0;
    }
    for (int64_t i = start; i < stop; ++i) {
        const double t = (double)(i + offset > 1 ? i + offset : 1);
        double best = -NONE;
        int64_t chosen = 0;  /* a slot */
        for (int64_t b = 0; b < blocks; ++b) {
            const double margin = (t + fabs(bound[b]) + 64.0) * 0x1p-49;
            if (bound[b] + wmax[b] * (t - at[b]) + margin < best)
                continue;
            const int64_t lo = b * BLOCK;
            const int64_t hi = lo + BLOCK < num_datasets ? lo + BLOCK : num_datasets;
            const double top = block_max(w, c, lo, hi, t);
            bound[b] = top;
            at[b] = t;
            if (top < best)
                continue;
            for (int64_t s = lo; s < hi; ++s)  /* the lowest dataset id holding the top lag */
                if (w[s] * t - c[s] == top && (top > best || id[s] < id[chosen])) {
                    best = top;
                    chosen = s;
                }
        }
        dataset_index[i - start] = id[chosen];
        dataset_sample_index[i - start] = (int64_t)c[chosen];
        c[chosen] += 1.0;
        bound[chosen / BLOCK] = NONE;  /* its lags changed: scan it next time */
    }
}
"""
# No fused multiply-add (the choices must equal the reference's); lags are never NaN, infinite or
# -0.0, which lets the compiler turn the max into SIMD max instructions.
_BLOCK, _SMALL = 16, 128  # BLOCK and SMALL in the source
_FLAGS = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-ffinite-math-only", "-fno-signed-zeros"]
_library: ctypes.CDLL | None | bool = False  # False: not tried yet; None: no compiler


def greedy_blend(weights: np.ndarray, num_samples: int,
                 offset: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of the greedy blend (module docstring).

    ``offset`` sets the target of sample ``i`` to ``weights * max(i + offset, 1)``: 1 is this
    project's assignment (the count after the sample is taken), 0 Megatron-LM's helper's.
    """
    parts = list(greedy_blend_chunks(weights, num_samples, max(num_samples, 1), offset))
    if len(parts) == 1:
        return parts[0]
    return (np.empty(0, dtype=np.int16), np.empty(0, dtype=np.int64))


def greedy_blend_chunks(weights: np.ndarray, num_samples: int, chunk: int, offset: int = 1,
                        start: int = 0, counts: np.ndarray | None = None
                        ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """:func:`greedy_blend` in pieces of ``chunk`` samples, in order: what a caller writing the
    index to disk holds at a time. From sample ``start`` on, given ``counts`` (each dataset's
    samples among the first ``start``): the pieces of samples ``[start, num_samples)``, equal to
    the same samples of a build from 0 (the loop's only state is the counts; its block bounds
    start over, scanning every block once)."""
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    if weights.size > MAX_DATASETS:
        raise DataError(f"data.paths has {weights.size:,} datasets; a blend takes at most "
                        f"{MAX_DATASETS:,} (dataset ids are int16): merge prefixes first")
    counts = np.zeros(weights.size) if counts is None else np.asarray(counts, dtype=np.float64)
    library = _compiled()
    if library is None:
        whole = greedy_blend_reference(weights, num_samples, offset, start, counts)
        for first in range(0, num_samples - start, chunk):
            yield whole[0][first: first + chunk], whole[1][first: first + chunk]
        return
    # Slots by decreasing weight (equal ones by id) for the blocks' bounds; in id order for a scan.
    order = np.argsort(-weights, kind="stable") if weights.size > _SMALL \
        else np.arange(weights.size)
    sorted_weights = np.ascontiguousarray(weights[order])
    ids = order.astype(np.int16)
    blocks = -(-weights.size // _BLOCK)
    counts = np.ascontiguousarray(counts[order], dtype=np.float64)  # by slot
    # The blocks' state as the loop sets it at sample 0 (it does so itself when start is 0).
    bound, at = np.full(blocks, 1e300), np.ones(blocks)  # 1e300: the source's NONE, scan it
    wmax = np.ascontiguousarray(sorted_weights[::_BLOCK])
    for first in range(start, num_samples, chunk):
        stop = min(first + chunk, num_samples)
        dataset_index = np.empty(stop - first, dtype=np.int16)
        dataset_sample_index = np.empty(stop - first, dtype=np.int64)
        library.blend(sorted_weights.ctypes.data, ids.ctypes.data, weights.size, first, stop,
                      offset, counts.ctypes.data, bound.ctypes.data, at.ctypes.data,
                      wmax.ctypes.data, dataset_index.ctypes.data, dataset_sample_index.ctypes.data)
        yield dataset_index, dataset_sample_index


def greedy_blend_reference(weights, num_samples: int, offset: int = 1, start: int = 0,
                           counts=None) -> tuple[np.ndarray, np.ndarray]:
    """The same assignment as a plain Python loop: the definition the compiled loop is tested
    against, and what runs where no C compiler is (samples ``[start, num_samples)`` given the
    ``counts`` before ``start``, as in :func:`greedy_blend_chunks`)."""
    weights = [float(w) for w in weights]
    counts = [0] * len(weights) if counts is None else [int(c) for c in counts]
    chosen = array("h", bytes(2 * (num_samples - start)))
    taken = array("q", bytes(8 * (num_samples - start)))
    rest = range(1, len(weights))
    for i in range(start, num_samples):
        t = float(max(i + offset, 1))
        best, best_lag = 0, weights[0] * t - counts[0]
        for d in rest:
            lag = weights[d] * t - counts[d]
            if lag > best_lag:
                best, best_lag = d, lag
        chosen[i - start], taken[i - start] = best, counts[best]
        counts[best] += 1
    return (np.frombuffer(chosen, dtype=np.int16).copy(),
            np.frombuffer(taken, dtype=np.int64).copy())


def _compiled() -> ctypes.CDLL | None:
    """The compiled loop, built on first use (once per machine: the file is named by a hash of the
    source, flags and platform, and written under a temporary name then renamed, so ranks racing to
    build it are harmless); None, logged once, where no C compiler works."""
    global _library
    if _library is not False:
        return _library
    compiler = os.environ.get("CC", "cc")
    tag = hashlib.sha256("\0".join([_SOURCE, compiler, *_FLAGS, sysconfig.get_platform()])
                         .encode()).hexdigest()[:16]
    folder = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                          "megapretrain")
    path = os.path.join(folder, f"blend_{tag}.so")
    try:
        if not os.path.exists(path):
            os.makedirs(folder, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                source = os.path.join(tmp, "blend.c")
                with open(source, "w", encoding="utf-8") as f:
                    f.write(_SOURCE)
                subprocess.run([compiler, *_FLAGS, "-o", os.path.join(tmp, "blend.so"), source],
                               check=True, capture_output=True, timeout=120)
                os.replace(os.path.join(tmp, "blend.so"), path)
        library = ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("blend index: no working C compiler (%s: %s); building it in Python, about "
                       "0.09 us per sample and dataset (set CC to a C compiler to speed it up)",
                       compiler, str(e).splitlines()[0] if str(e) else type(e).__name__)
        _library = None
        return None
    library.blend.restype = None
    library.blend.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                              ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 6
    _library = library
    return library
