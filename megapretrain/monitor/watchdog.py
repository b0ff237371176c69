"""Hang watchdog: a thread per rank that notices an iteration taking far too long.

A rank stuck in a collective (a peer died, a link flapped) or in a deadlocked data worker shows no
error; the job just stops making progress. The trainer calls :meth:`Watchdog.beat` as each phase
starts (a training step, an evaluation, a checkpoint save) and :meth:`Watchdog.done` when a step
ends. If a phase outlasts its limit, the watchdog writes every thread's Python stack
(``faulthandler``) and the last collective this rank entered to ``RUN_DIR/hang/rankN.txt`` — on NCCL
with the flight recorder's file of this rank, and how to read every rank's together — and exits the
process with :data:`HANG_EXIT`, so a launcher restarts the job from its last checkpoint.

The limit is ``watchdog.timeout_s`` when set, else ``watchdog.multiple`` × the rolling median step
time, never below ``watchdog.floor_s``; the first steps, evaluations and saves get at least
``watchdog.startup_s``. ``timeout_s: 0`` turns it off.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import statistics
import threading
import time
from collections import deque

from ..parallel import flight_recorder

HANG_EXIT = 5  # the exit status of a rank the watchdog stopped
STARTUP_STEPS = 3


class Watchdog:
    def __init__(self, cfg, run_dir: str, rank: int, activity=None, poll_s: float = 1.0):
        """``cfg``: the ``watchdog`` config section; ``activity``: an object whose ``last`` names
        the collective this rank entered last (``ParallelState.activity``)."""
        self.cfg, self.rank, self.activity, self.poll_s = cfg, rank, activity, poll_s
        self.path = os.path.join(run_dir, "hang", f"rank{rank}.txt")
        self.step_times: deque[float] = deque(maxlen=50)
        self.phase, self.iteration, self.started = "start-up", 0, time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.cfg.timeout_s != 0

    def start(self) -> None:
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="megapretrain-watchdog",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def beat(self, phase: str, iteration: int) -> None:
        """``phase`` ("step", "eval", "save") of ``iteration`` starts now."""
        with self._lock:
            self.phase, self.iteration, self.started = phase, iteration, time.monotonic()

    def done(self, step_seconds: float) -> None:
        """A training step finished in ``step_seconds``; until the next beat nothing is timed."""
        with self._lock:
            self.step_times.append(step_seconds)
            self.phase = "between steps"
            self.started = time.monotonic()

    def limit(self) -> float:
        """Seconds the current phase may take."""
        c = self.cfg
        if c.timeout_s:
            base = c.timeout_s
        elif self.step_times:
            base = max(c.floor_s, c.multiple * statistics.median(self.step_times))
        else:
            base = c.startup_s
        if self.phase != "step" or len(self.step_times) < STARTUP_STEPS:
            return max(base, c.startup_s) if not c.timeout_s else base
        return base

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                elapsed, limit, phase, it = \
                    time.monotonic() - self.started, self.limit(), self.phase, self.iteration
            if elapsed > limit:
                self.report(phase, it, elapsed, limit)
                os._exit(HANG_EXIT)

    def report(self, phase: str, iteration: int, elapsed: float, limit: float) -> None:
        """Write this rank's hang report: what it was doing, its last collective, where the NCCL
        flight recorder's files are (when it is on), every stack."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        last = getattr(self.activity, "last", None)  # the collective tracker is optional
        facts = {"event": "hang", "rank": self.rank, "host": socket.gethostname(),
                 "pid": os.getpid(), "phase": phase, "iter": iteration,
                 "elapsed_s": round(elapsed, 1), "limit_s": round(limit, 1),
                 "last_collective": last, "time": time.time()}
        recorder = flight_recorder.read_hint(os.environ)
        if recorder:
            facts["flight_recorder"] = flight_recorder.dump(self.rank, os.environ)
        with open(self.path, "w") as fh:
            fh.write(json.dumps(facts) + "\n\n")
            fh.write(f"rank {self.rank} on {facts['host']}: {phase} of iteration {iteration} has "
                     f"run {elapsed:.0f} s (limit {limit:.0f} s); last collective entered: "
                     f"{last or 'none recorded'}\n\n")
            if recorder:
                fh.write(recorder + "\n\n")
            fh.flush()
            faulthandler.dump_traceback(file=fh, all_threads=True)
        print(f"error: hang: rank {self.rank} ({phase} of iteration {iteration}) ran {elapsed:.0f} "
              f"s, past the watchdog's {limit:.0f} s; stacks in {self.path}; exiting with status "
              f"{HANG_EXIT} so the launcher restarts from the last checkpoint", flush=True)
