"""CPU training: keep freed host memory for reuse instead of handing it back to the OS every step.

glibc's malloc serves every block above its mmap threshold (at most 32 MB) with a fresh ``mmap``
and unmaps it on ``free``. A training step allocates such blocks again each step — the output
layer's weight gradient, the embedding's, the loss's chunk of logits at larger vocabularies — and
the kernel then zero-fills every 4 KB page of each on first touch. :func:`keep_freed_host_memory`
turns mmap off for malloc (every block comes from the heap) and raises the trim threshold, so a
freed block is reused by the next step. The resident set then stays at the run's peak rather
than dropping between steps (the heap's alignment padding adds a few percent to it).

Measured on 2 CPU cores, ``tools/bench_train.py --config configs/bench_cpu.yaml --steps 8``, four
interleaved pairs: 734–841 tokens/s with this, 696–816 without (``GLIBC_TUNABLES`` naming malloc),
faster in every pair, by 1–14%; 8× fewer page faults in tests/test_host_memory.py's step pattern.

Nothing is changed when malloc is not glibc's, or when the user has tuned it already
(``GLIBC_TUNABLES`` naming malloc, or one of glibc's ``MALLOC_*_`` variables): their choice stands.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters (malloc.h)
# bytes of free heap top kept before any is returned (mallopt takes an int)
TRIM_THRESHOLD = 2**31 - 1


def user_tuned_malloc(environ=os.environ) -> bool:
    """Whether the environment already sets glibc's malloc parameters."""
    return "malloc" in environ.get("GLIBC_TUNABLES", "") or any(
        k.startswith("MALLOC_") and k.endswith("_") for k in environ)


def keep_freed_host_memory() -> bool:
    """Serve large host allocations from the heap and keep what is freed (see the module
    docstring). Returns whether the setting was applied."""
    if user_tuned_malloc():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 -- glibc's malloc only: musl has no such function
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def available_bytes() -> int | None:
    """Host memory a new allocation can still get without swapping (Linux's MemAvailable), or
    the free physical pages elsewhere; None when the platform cannot say."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None
