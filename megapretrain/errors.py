"""The one family of user-facing errors.

Anything the user controls — a config field, a data file, a checkpoint, a layout, a tool's flag —
raises a :class:`UserError` whose message is one line naming the field or file, the rule and the
fix. Entry points and tools catch ``UserError`` alone and print that line (exit status 2); every
other exception is a bug and keeps its traceback.

``UserError`` derives from ``ValueError`` so code that already catches ``ValueError`` around a
library call keeps working; the converse does not hold: a plain ``ValueError`` is never shown as
bad input.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil


class UserError(ValueError):
    """Bad input; the message is one line that says what is wrong and what to do."""


class ConfigError(UserError):
    """A config field (or a combination of fields) that cannot work."""


class DataError(UserError):
    """A dataset, tokenizer or input file that cannot be used."""


class MissingFileError(DataError, FileNotFoundError):
    """A file or directory the user named does not exist."""


class WrongKindError(ConfigError):
    """A path of another kind than its flag or field takes: a dataset where a checkpoint belongs,
    a run directory where a config belongs (the message names what the path is)."""


class MissingPackageError(UserError, ImportError):
    """An optional package the chosen feature needs is not installed."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used."""


class PipelineError(UserError):
    """An impossible pipeline layout or schedule."""


class DiskFullError(UserError):
    """No space left (or a quota reached) where something is being written."""


FULL_DISK = (errno.ENOSPC, errno.EDQUOT)  # the errors of a write that found no room


def require(ok: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``ok``: a config rule, stated where it
    lives."""
    if not ok:
        raise ConfigError(message)


def divisors(n: int) -> str:
    """``n``'s divisors, as a message offers them: ``parallel.tp=3 must divide 32 (valid: 1, 2, 4,
    ...)``."""
    # pairs (d, n // d) up to the square root: a field of 1e9 is listed at once, not after 1e9 tries
    small = [d for d in range(1, math.isqrt(max(n, 0)) + 1) if n % d == 0]
    return ", ".join(str(d) for d in sorted(set(small) | {n // d for d in small}))


def read_json_file(path: str, error: type[UserError], fix: str, missing: str = "not found"):
    """The JSON value in ``path``; a missing or unreadable file raises ``error`` naming it, what is
    wrong (``missing`` for an absent file) and ``fix``."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise error(f"{path} {missing}; {fix}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{path} cannot be read as JSON ({exc}); {fix}") from None


def size_text(n: float) -> str:
    """``n`` bytes for a person: ``512 B``, ``3.2 MiB``, ``1.50 TiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def free_bytes(path: str) -> int | None:
    """Bytes free to an ordinary user on the file system ``path`` is (or would be) on; None when
    nothing of it exists or the platform cannot say."""
    here = os.path.abspath(path)
    while not os.path.exists(here):
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent
    try:
        return shutil.disk_usage(here).free
    except OSError:
        return None


def disk_full(path: str, needed: int | None = None,
              fix: str = "free space or write elsewhere") -> DiskFullError:
    """The one line for a write that found no room: the path, the bytes needed and free, the fix."""
    free = free_bytes(path)
    sizes = ", ".join(([f"needs about {size_text(needed)}"] if needed else [])
                      + ([f"{size_text(free)} free"] if free is not None else []))
    return DiskFullError(f"no space left writing {path}" + (f" ({sizes})" if sizes else "")
                         + f"; {fix}")


def check_free_space(path: str, needed: int, fix: str = "free space or write elsewhere") -> None:
    """Refuse, before any work, a write of ``needed`` bytes under ``path`` that cannot fit."""
    free = free_bytes(path)
    if free is not None and needed > free:
        raise disk_full(path, needed, fix)


@contextlib.contextmanager
def full_disk_guard(path: str, needed: int | None = None,
                    fix: str = "free space or write elsewhere"):
    """Inside the block, a write that finds no room (ENOSPC, EDQUOT) raises :func:`disk_full`'s
    one line instead of a traceback; the caller's own cleanup (``finally``, ``except``) still
    runs."""
    try:
        yield
    except OSError as exc:
        if exc.errno in FULL_DISK:
            raise disk_full(exc.filename or path, needed, fix) from None
        raise
