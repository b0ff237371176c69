"""The NCCL flight recorder: each rank keeps its last collectives (op, sizes, sequence number,
state) in a ring buffer and writes it to a file when a collective times out, so that a hang can be
read afterwards — which rank never entered which collective.

:func:`environment` says which variables turn it on (the buffer size, the dump on timeout, the
files under ``RUN_DIR/flight_recorder/``); they must be set before the NCCL process group is
created, and a user's own settings are kept. The hang watchdog, which stops a rank before NCCL's
own timeout, writes the buffer itself (:func:`dump`) and names the files in its report
(:func:`read_hint`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

TRACE_BUFFER_SIZE = 2000  # collectives kept per rank
DIRECTORY = "flight_recorder"  # under the run directory
# the dump files' prefix (the rank is appended): torch's current name first, then its older one
PREFIX_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
READER = "python -m torch.distributed.flight_recorder.fr_trace"


def environment(backend: str, run_dir: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to ``environ`` for a process group on ``backend`` (the resolved one:
    "nccl", "gloo"): none but on NCCL, and none the user already set (under either name)."""
    if backend != "nccl":
        return {}
    wanted = {}
    if not any(v in environ for v in BUFFER_VARS):
        wanted[BUFFER_VARS[1]] = str(TRACE_BUFFER_SIZE)
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in environ:
        wanted["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    if not any(v in environ for v in PREFIX_VARS):
        wanted[PREFIX_VARS[0]] = os.path.join(run_dir, DIRECTORY, "rank_")
    return wanted


def enable(backend: str, device_type: str, run_dir: str) -> dict[str, str]:
    """Set :func:`environment`'s variables in this process (before ``init_process_group``) and
    create the dump directory; ``backend`` as ``parallel.backend`` gives it ("auto": NCCL on CUDA).
    Returns what was set."""
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    added = environment(backend, run_dir, os.environ)
    os.environ.update(added)
    prefix = _prefix(os.environ)
    if added and prefix:
        os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    return added


def _prefix(environ: Mapping[str, str]) -> str | None:
    """The dump files' prefix when the recorder is on (a buffer and a prefix set), else None."""
    size = next((environ[v] for v in BUFFER_VARS if v in environ), "0")
    if not size.strip().isdigit() or int(size) <= 0:
        return None
    return next((environ[v] for v in PREFIX_VARS if v in environ), None)


def read_hint(environ: Mapping[str, str]) -> str | None:
    """One line naming where the ranks' flight recorder files are and how to read them, or None
    when the recorder is off."""
    prefix = _prefix(environ)
    if prefix is None:
        return None
    where = os.path.dirname(prefix) or "."
    return (f"NCCL flight recorder: each rank's last collectives are in {prefix}<rank> (written on "
            f"a collective timeout, and by this watchdog); read them together with: {READER} "
            f"{where}")


def dump(rank: int, environ: Mapping[str, str]) -> str | None:
    """Write this rank's flight recorder buffer to its file now (the hang watchdog exits before
    NCCL's timeout would); returns the path, or None when there is nothing to write (the recorder
    off, no NCCL in this build) or writing failed."""
    prefix = _prefix(environ)
    read = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    if prefix is None or read is None:
        return None
    path = f"{prefix}{rank}"
    try:
        data = read()
        with open(path, "wb") as fh:
            fh.write(data)
    except Exception:  # a report without the dump beats no report
        return None
    return path
