"""One run directory, one owner: a lock file held by global rank 0 while a training runs.

Two trainings on one ``run.dir`` would interleave their ``metrics.jsonl`` and race to move
``checkpoints/latest``. The first holds ``RUN_DIR/.lock`` (JSON: PID, host, start time); the
trainer touches it every step, so its modification time is a heartbeat. A second start is refused
with one line naming the owner — unless the lock is stale: its process is gone (same host), or its
heartbeat is older than ``STALE_S`` (another host, where the process cannot be looked up), as after
a crash or ``kill -9``; then it is taken over with a warning.

A run directory inside another live run's directory, or holding one, is refused as well: the two
would write into each other's files (a retention pass of the outer run deleting the inner run's
checkpoints, its ``checkpoints/latest`` pointing into the other).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

from .errors import ConfigError

STALE_S = 1800.0  # a lock from another host is stale after this long without a heartbeat
NESTED_DEPTH = 4  # how deep below a run directory another run's lock is looked for
# what a run writes below its directory in bulk: never another run's home, not walked
_OWN = frozenset({"checkpoints", "tensorboard", "data_cache", "hang", "wandb"})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _live(lock: str) -> str | None:
    """Who holds ``lock`` ("PID 12 on host"), if a training that is alive does; else None."""
    try:
        with open(lock) as fh:
            owner = json.load(fh)
        pid, host = int(owner["pid"]), str(owner["host"])
        age = time.time() - os.path.getmtime(lock)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if pid == os.getpid() and host == socket.gethostname():
        return None
    alive = _alive(pid) if host == socket.gethostname() else age <= STALE_S
    return f"PID {pid} on {host}" if alive else None


def _nested_runs(run_dir: str):
    """(directory, owner) of each live run whose directory holds ``run_dir`` or lies inside it."""
    here = os.path.realpath(run_dir)
    parent = os.path.dirname(here)
    while parent != os.path.dirname(parent):
        owner = _live(os.path.join(parent, ".lock"))
        if owner:
            yield parent, owner
        parent = os.path.dirname(parent)
    if not os.path.isdir(here):
        return
    for top, dirs, files in os.walk(here):
        depth = top[len(here):].count(os.sep)
        dirs[:] = [] if depth >= NESTED_DEPTH else [d for d in dirs if d not in _OWN]
        if top != here and ".lock" in files:
            owner = _live(os.path.join(top, ".lock"))
            if owner:
                yield top, owner


def check_not_nested(run_dir: str) -> None:
    """Refuse ``run_dir`` when a live training's directory holds it or lies inside it."""
    for other, owner in _nested_runs(run_dir):
        inside = os.path.realpath(run_dir).startswith(other + os.sep)
        raise ConfigError(f"run.dir {run_dir} {'is inside' if inside else 'holds'} {other}, the "
                          f"run directory of a live training ({owner}): the two would write into "
                          "each other's files; choose a --run.dir outside it and not holding it")


class RunLock:
    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, ".lock")
        self.held = False

    def acquire(self) -> None:
        """Take the lock, or raise a ConfigError naming the run that holds it (or a live run
        whose directory holds this one, or lies inside it)."""
        check_not_nested(os.path.dirname(self.path))
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "started": time.time()})
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as fh:
                fh.write(mine + "\n")
            self.held = True
            return
        raise ConfigError(f"{self.path}: could not be taken; remove it if no training uses this "
                          "run.dir")

    def _take_over_if_stale(self) -> None:
        try:
            with open(self.path) as fh:
                owner = json.load(fh)
            pid, host = int(owner["pid"]), str(owner["host"])
        except (OSError, ValueError, KeyError, TypeError):
            owner, pid, host = None, None, None  # damaged or half-written: judged by its age alone
        try:
            age = time.time() - os.path.getmtime(self.path)
        except FileNotFoundError:
            return  # released meanwhile
        here = socket.gethostname()
        if host == here and pid is not None:
            stale = not _alive(pid) or pid == os.getpid()
        else:
            stale = age > STALE_S
        if not stale:
            where = f"PID {pid} on {host}" if owner else "another process"
            raise ConfigError(f"run.dir {os.path.dirname(self.path)} is in use by a training "
                              f"({where}, last active {age:.0f} s ago): wait for it, stop it, or "
                              "choose another --run.dir (if it is not running, remove "
                              f"{self.path})")
        print(f"warning: taking over the stale lock {self.path} "
              f"({f'PID {pid} on {host}' if owner else 'unreadable'}, last active {age:.0f} s ago)",
              file=sys.stderr)
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass

    def heartbeat(self) -> None:
        if self.held:
            try:
                os.utime(self.path)
            except FileNotFoundError:  # removed by hand: take it again
                self.held = False
                self.acquire()

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
