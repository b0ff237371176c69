"""One run directory, one owner: a lock file held by global rank 0 while a training runs.

Two trainings on one ``run.dir`` would interleave their ``metrics.jsonl`` and race to move
``checkpoints/latest``. The first holds ``RUN_DIR/.lock`` (JSON: PID, host, start time); the
trainer touches it every step, so its modification time is a heartbeat. A second start is refused
with one line naming the owner — unless the lock is stale: its process is gone (same host), or its
heartbeat is older than ``STALE_S`` (another host, where the process cannot be looked up), as after
a crash or ``kill -9``; then it is taken over with a warning.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

from .errors import ConfigError

STALE_S = 1800.0  # a lock from another host is stale after this long without a heartbeat


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunLock:
    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, ".lock")
        self.held = False

    def acquire(self) -> None:
        """Take the lock, or raise a ConfigError naming the run that holds it."""
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
