"""The attempts of a training on one run directory: what each did, what its failure cost, and when
the same failure keeps coming back.

Every start of a training on a run directory — a launch, torchrun's restart after a failure, a
relaunch by hand — is an attempt. Global rank 0 keeps their ledger, ``RUN_DIR/attempts.jsonl``
(one JSON object per line, appended): per attempt a ``start`` record (when its process started,
when its process group was up, which launch it belongs to), ``loaded`` (the iteration it resumed
from, the checkpoint and the seconds reading it took), ``training`` (its training loop starts),
``first_step`` (its first step ended) and ``end`` (how it ended: ``finished``, ``stopped`` by a
signal, ``interrupted``, ``exception``, ``recovery``, ``oom``, ``crash_loop``, ``hang``, ``crash``).
Its last sign of life — the last step it completed and when — is
``RUN_DIR/attempts.alive.json``, overwritten in place at every step's end (one small write, no
read of the device: on a GPU the host's step end, which runs ahead of the device up to the next
read point). A crash (``os._exit``, SIGKILL, a lost node) writes no ``end`` record: the next
attempt writes it for it (``inferred``) from that file and the watchdog's hang reports.

From the ledger come the ``restart`` event of each attempt after the first (its lost time split
into detection, restart, reload and recomputed iterations), the run's effective training time
(:func:`goodput`), and the crash-loop stop (:func:`crash_loop`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import socket
import sys
import time

from .cli import CRASH_LOOP_EXIT
from .errors import UserError
from .recovery import RecoveryError

# (what the training side needs — torch, the start-up clock, the out-of-memory status — is
# imported where it is used: the readers of the ledger, tools/plot_run.py, import no torch)

LEDGER = "attempts.jsonl"
FORMAT = "megapretrain-attempts-v1"  # in each start record
ALIVE = "attempts.alive.json"
ALIVE_BYTES = 256  # the sign-of-life record, padded: each write replaces the whole of it
# endings that are no failure: they never make a crash loop
CLEAN = ("finished", "stopped", "interrupted")


@dataclasses.dataclass
class Attempt:
    """One attempt as its ledger records tell (times: seconds since the epoch)."""
    number: int
    launch: str = ""  # the launcher that started it (see :func:`launch_id`)
    restart_count: int = 0  # TORCHELASTIC_RESTART_COUNT: > 0 when its launcher restarted it
    process_start: float | None = None
    group_up: float | None = None
    resumed_iter: int | None = None  # where it resumed from (0: a fresh start)
    load_s: float = 0.0  # reading the checkpoint
    training: float | None = None  # its training loop started
    last_iter: int | None = None  # the last step it completed
    trained: int | None = None  # the steps it trained (a rollback's trained again among them)
    last_alive: float | None = None  # when
    end: float | None = None  # when it ended, or when its end was noticed
    reason: str | None = None  # how it ended (None: not yet)
    noticed_by: str | None = None  # what ``end`` is: "end_record", "hang_report", "next_start"
    detail: str | None = None  # of the reason: the exception, the crash loop

    @property
    def failed(self) -> bool:
        return self.reason is not None and self.reason not in CLEAN + ("crash_loop",)

    @property
    def phase(self) -> str:
        """Where it got to: its training loop, or only its start-up (building, loading)."""
        return "start-up" if self.training is None else "training"

    @property
    def sign_of_life(self) -> float | None:
        """When it was last known alive: its last step's end, else the latest start-up mark."""
        marks = [t for t in (self.last_alive, self.training, self.group_up, self.process_start)
                 if t is not None]
        return max(marks) if marks else None

    @property
    def reached(self) -> int | None:
        """The last iteration it completed (where it resumed from, when it completed none)."""
        return self.last_iter if self.last_iter is not None else self.resumed_iter

    @property
    def step_s(self) -> float | None:
        """Its mean wall time per step in the training loop (evaluations and saves among them, as
        a straight run has them), or None before two marks."""
        steps = self.trained or (self.last_iter or 0) - (self.resumed_iter or 0)
        if self.training is None or self.last_alive is None or steps <= 0:
            return None
        return max(0.0, self.last_alive - self.training) / steps

    def update(self, record: dict) -> None:
        kind = record.get("record")
        if kind == "start":
            self.launch, self.restart_count = record.get("launch", ""), \
                record.get("restart_count", 0)
            self.process_start, self.group_up = record.get("process_start"), record.get("time")
        elif kind == "loaded":
            self.resumed_iter, self.load_s = record.get("iter"), record.get("load_s", 0.0)
        elif kind == "training":
            self.training = record.get("time")
        elif kind == "first_step":
            self.last_iter, self.last_alive = record.get("iter"), record.get("time")
            self.trained = 1
        elif kind == "end":
            self.reason, self.end = record.get("reason"), record.get("time")
            self.noticed_by = record.get("noticed_by", "end_record")
            self.detail = record.get("detail")
            if record.get("last_iter") is not None:
                self.last_iter, self.last_alive = record["last_iter"], record.get("last_alive")
                self.trained = record.get("trained")

    def take_alive(self, alive: dict | None) -> None:
        """Its last sign of life from ``RUN_DIR/attempts.alive.json``, when that is this
        attempt's."""
        if alive and alive.get("attempt") == self.number:
            self.last_iter, self.last_alive = alive.get("iter"), alive.get("time")
            self.trained = alive.get("trained")


def read_ledger(run_dir: str) -> list[Attempt]:
    """The attempts of ``run_dir`` in order (none before the first training); a line cut short by
    a crash is passed over."""
    path = os.path.join(run_dir, LEDGER)
    attempts: dict[int, Attempt] = {}
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        for line in fh:
            try:
                record = json.loads(line)
                number = int(record["attempt"])
            except (ValueError, KeyError, TypeError):
                continue
            attempts.setdefault(number, Attempt(number)).update(record)
    return [attempts[n] for n in sorted(attempts)]


def read_alive(run_dir: str) -> dict | None:
    """The last sign of life an attempt left (None: none, or unreadable)."""
    try:
        with open(os.path.join(run_dir, ALIVE), "rb") as fh:
            record = json.loads(fh.read().strip(b" \n\0") or b"null")
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def run_goodput(run_dir: str) -> dict | None:
    """The effective training time of the attempts ``run_dir`` records (a run still going, or one
    whose last attempt crashed: to its last sign of life), or None before any."""
    attempts = read_ledger(run_dir)
    if not attempts:
        return None
    if attempts[-1].reason is None:
        attempts[-1].take_alive(read_alive(run_dir))
    return goodput(attempts)


def hang_report_time(run_dir: str, after: float | None) -> float | None:
    """The earliest watchdog report (``RUN_DIR/hang/rankN.txt``) written after ``after``: when a
    rank noticed the hang."""
    times = []
    for path in glob.glob(os.path.join(run_dir, "hang", "rank*.txt")):
        try:
            with open(path) as fh:
                written = float(json.loads(fh.readline())["time"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if after is None or written >= after:
            times.append(written)
    return min(times) if times else None


def same_launch(earlier: Attempt, later: Attempt) -> bool:
    """Whether ``later`` was started by the launcher of ``earlier`` (a restart, not a new launch):
    the same launcher process, or one that counts it as a restart."""
    return bool(later.launch) and (later.launch == earlier.launch or later.restart_count > 0)


def launch_id() -> str:
    """The launcher this process belongs to: under torchrun its agent — the parent process (host,
    PID and start time), which restarts the workers of every attempt it runs; a new torchrun is a
    new launch. Without one (a run by hand) "": every run is a launch of its own."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return ""
    pid = os.getppid()
    try:
        with open(f"/proc/{pid}/stat") as fh:
            started = fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "?"
    return f"{socket.gethostname()}:{pid}:{started}"


def restart_lost(prev: Attempt, cur: Attempt) -> dict:
    """What the restart from ``prev`` to ``cur`` cost, in seconds: ``detection_s`` (prev's last
    sign of life → its end noticed), ``restart_s`` (→ cur's process group up), ``reload_s``
    (→ its training loop starts: building, reading the checkpoint), and the
    ``recomputed_iters`` that prev had completed past cur's checkpoint, ``recomputed_s`` at
    prev's step time."""
    alive = prev.sign_of_life or 0.0
    noticed = max(alive, prev.end if prev.end is not None else alive)
    up = max(noticed, cur.group_up if cur.group_up is not None else noticed)
    loop = max(up, cur.training if cur.training is not None else up)
    recomputed = max(0, (prev.reached or 0) - (cur.resumed_iter or 0))
    step_s = prev.step_s
    parts = {"detection_s": noticed - alive, "restart_s": up - noticed, "reload_s": loop - up,
             "recomputed_s": recomputed * (step_s or 0.0)}
    return {**{k: round(v, 3) for k, v in parts.items()}, "recomputed_iters": recomputed,
            "lost_s": round(sum(parts.values()), 3)}


def goodput(attempts: list[Attempt], now: float | None = None) -> dict:
    """The effective training time of a run's ``attempts``: productive step time (each attempt's
    training loop, for the steps whose results were kept — not those a later attempt or a rollback
    trained again) over the wall time (every attempt from its process start to its end, and the time
    between attempts of one launch; not the time between launches). ``now``: the end of an
    attempt still running."""
    productive = wall = lost = 0.0
    restarts = 0
    previous_end = None
    for i, a in enumerate(attempts):
        after = attempts[i + 1] if i + 1 < len(attempts) else None
        # a crash's end is its last sign of life (the next start only bounds when it was noticed)
        end = a.end if a.noticed_by in ("end_record", "hang_report") else a.sign_of_life
        if a.reason is None and now is not None:
            end = now
        start = a.process_start if a.process_start is not None else a.group_up
        if previous_end is not None and (start is None or start < previous_end
                                         or same_launch(attempts[i - 1], a)):
            start = previous_end  # the wait for a restart of the same launch is the run's time
        if start is not None and end is not None:
            wall += max(0.0, end - start)
            previous_end = max(end, start)
        if a.step_s is not None:
            kept_to = a.last_iter if after is None or after.resumed_iter is None \
                else min(a.last_iter, after.resumed_iter)
            productive += a.step_s * max(0, kept_to - (a.resumed_iter or 0))
        if after is not None and a.reason != "crash_loop" and (a.failed or a.reason is None):
            restarts += 1
            lost += restart_lost(a, after)["lost_s"]
    return {"attempts": len(attempts), "restarts": restarts, "restart_lost_s": round(lost, 3),
            "productive_s": round(productive, 3), "wall_s": round(wall, 3),
            "effective_training": round(productive / wall, 4) if wall > 0 else None}


def crash_loop(attempts: list[Attempt], cur: Attempt) -> str | None:
    """Why ``cur`` must not train, or None. A crash loop: the two attempts before it, restarts of
    one launch as ``cur`` is, both failed at the same iteration (the last one they completed) in
    the same phase (training, or start-up), and either resumed from the same checkpoint or ended
    the same way — the same failure again, which a third attempt would repeat. Failures at
    different iterations never make one, nor a failed start-up after a failed step, nor clean
    ends; a new launch (a new torchrun, a run by hand) starts afresh."""
    if not attempts or not same_launch(attempts[-1], cur):
        return None
    last = attempts[-1]
    if last.reason == "crash_loop":  # its launcher restarted it all the same
        return last.detail or f"attempt {last.number} stopped as a crash loop"
    if len(attempts) < 2:
        return None
    before = attempts[-2]
    if not (before.failed and last.failed and same_launch(before, last)) \
            or (before.reached, before.phase) != (last.reached, last.phase):
        return None
    if before.resumed_iter != last.resumed_iter and before.reason != last.reason:
        return None
    how = last.reason if before.reason == last.reason else f"{before.reason}, then {last.reason}"
    where = f"after iteration {last.reached}" if last.phase == "training" \
        else f"starting at iteration {last.reached}"
    return (f"attempts {before.number} and {last.number} both failed {where} ({how}; resumed "
            f"from iteration {before.resumed_iter} and {last.resumed_iter})")


def end_reason(exc: BaseException | None, stop: str | None) -> tuple[str, str | None]:
    """How a training that returned (``exc`` None: finished, or ``stop``: stopped by that signal)
    or raised ``exc`` ended, and a detail."""
    from .oom import OOM_EXIT

    if exc is None:
        return ("stopped", stop) if stop else ("finished", None)
    if isinstance(exc, SystemExit):
        code = exc.code
        return ("oom" if code == OOM_EXIT else "crash_loop" if code == CRASH_LOOP_EXIT
                else "exit", f"status {code}")
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", None
    if isinstance(exc, RecoveryError):
        return "recovery", str(exc)[:300]
    if isinstance(exc, UserError):
        return "user_error", str(exc)[:300]
    return "exception", f"{type(exc).__name__}: {exc}"[:300]


class AttemptLog:
    """This process's attempt: global rank 0 writes its records to the ledger; every rank takes
    part in the crash-loop decision. Made as the trainer starts, after the process group is up;
    stops the process (exit :data:`~megapretrain.cli.CRASH_LOOP_EXIT`) when the attempt would
    repeat a crash loop."""

    def __init__(self, run_dir: str, ps):
        self.run_dir, self.writes = run_dir, ps.rank == 0
        self.attempts: list[Attempt] = []
        self.cur = Attempt(0)
        self._alive_fd: int | None = None
        self._load_started = time.time()
        loop = None
        ledger = os.path.join(run_dir, LEDGER)
        # the ledger's size before this attempt wrote to it (None: there was none): withdraw()
        self._ledger_size = os.path.getsize(ledger) if os.path.exists(ledger) else None
        if self.writes:
            from .monitor.anatomy import process_age_s

            age = process_age_s()
            self.attempts = read_ledger(run_dir)
            number = self.attempts[-1].number + 1 if self.attempts else 1
            self.cur = Attempt(number, launch=launch_id(),
                               restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
                                                 or 0),
                               process_start=None if age is None else time.time() - age,
                               group_up=time.time())
            self._close_previous()
            self._write({"record": "start", "format": FORMAT, "launch": self.cur.launch,
                         "restart_count": self.cur.restart_count, "host": socket.gethostname(),
                         "pid": os.getpid(), "process_start": self.cur.process_start,
                         "time": self.cur.group_up})
            loop = crash_loop(self.attempts, self.cur)
        if _from_rank0(loop is not None, ps):
            self._stop(loop)

    def _write(self, record: dict, sync: bool = True) -> None:
        with open(os.path.join(self.run_dir, LEDGER), "a") as fh:
            fh.write(json.dumps({"attempt": self.cur.number, **record}) + "\n")
            fh.flush()
            if sync:
                os.fsync(fh.fileno())

    def _close_previous(self) -> None:
        """Write the end record a crashed previous attempt could not, from its last sign of life
        and the watchdog's reports; the end is noticed at the latest when this attempt started."""
        if not self.attempts or self.attempts[-1].reason is not None:
            return
        prev = self.attempts[-1]
        prev.take_alive(read_alive(self.run_dir))
        hang = hang_report_time(self.run_dir, prev.sign_of_life)
        start = self.cur.process_start if self.cur.process_start is not None else self.cur.group_up
        prev.reason, prev.noticed_by, prev.end = ("hang", "hang_report", hang) if hang \
            else ("crash", "next_start", max(start, prev.sign_of_life or start))
        record = {"attempt": prev.number, "record": "end", "reason": prev.reason,
                  "time": prev.end, "noticed_by": prev.noticed_by, "inferred": True,
                  "last_iter": prev.last_iter, "last_alive": prev.last_alive,
                  "trained": prev.trained}
        with open(os.path.join(self.run_dir, LEDGER), "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def _stop(self, why: str | None) -> None:
        """Record and say that this attempt does not start (rank 0), and exit 6 (every rank)."""
        if self.writes:
            self._write({"record": "end", "reason": "crash_loop", "detail": why,
                         "time": time.time()})
            print(f"error: crash loop: {why}; attempt {self.cur.number} does not start, the next "
                  "would fail there again: inspect the failed attempts' output (the launcher's "
                  f"log; {os.path.join(self.run_dir, 'hang')} after a hang), fix the cause or "
                  "change the config, then relaunch (a new torchrun or launch.sh starts afresh; "
                  f"{os.path.join(self.run_dir, LEDGER)} lists the attempts)", file=sys.stderr,
                  flush=True)
        sys.exit(CRASH_LOOP_EXIT)

    def withdraw(self) -> None:
        """Bad input refused this start before it loaded anything (a user error): the ledger
        becomes again what it was, byte for byte, as every file the user has."""
        if not self.writes:
            return
        ledger = os.path.join(self.run_dir, LEDGER)
        if self._ledger_size is None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(ledger)
        else:
            os.truncate(ledger, self._ledger_size)

    def loading(self) -> None:
        """The checkpoint is read from now."""
        self._load_started = time.time()

    def loaded(self, iteration: int, checkpoint: str | None) -> None:
        """The attempt resumed at ``iteration`` (from ``checkpoint``; None: a fresh start)."""
        self.cur.resumed_iter, self.cur.load_s = iteration, time.time() - self._load_started
        if self.writes:
            self._write({"record": "loaded", "iter": iteration, "checkpoint": checkpoint,
                         "load_s": round(self.cur.load_s, 3), "time": time.time()})

    def training(self, iteration: int, metrics) -> None:
        """The training loop starts at ``iteration``; after an earlier attempt, its ``restart``
        event goes to ``metrics``."""
        self.cur.training = time.time()
        if not self.writes:
            return
        self._write({"record": "training", "iter": iteration, "time": self.cur.training})
        if self.attempts:
            prev = self.attempts[-1]
            metrics.event("restart", iteration, attempt=self.cur.number, resumed_iter=iteration,
                          after=prev.reason, detected_by=prev.noticed_by,
                          previous_last_iter=prev.reached, same_launch=same_launch(prev, self.cur),
                          checkpoint_load_s=round(self.cur.load_s, 3),
                          step_time_s=None if prev.step_s is None else round(prev.step_s, 4),
                          **restart_lost(prev, self.cur))

    def alive(self, iteration: int) -> None:
        """Step ``iteration`` ended (on the host): the attempt's sign of life, replaced in place
        (the first step's end also goes to the ledger)."""
        if not self.writes:
            return
        now = time.time()
        first = self.cur.last_iter is None
        self.cur.last_iter, self.cur.last_alive = iteration, now
        self.cur.trained = (self.cur.trained or 0) + 1
        record = {"attempt": self.cur.number, "iter": iteration, "time": now,
                  "trained": self.cur.trained}
        if self._alive_fd is None:
            self._alive_fd = os.open(os.path.join(self.run_dir, ALIVE), os.O_WRONLY | os.O_CREAT,
                                     0o644)
        os.pwrite(self._alive_fd, json.dumps(record).encode().ljust(ALIVE_BYTES), 0)
        if first:
            self._write({"record": "first_step", "iter": iteration, "time": now}, sync=False)

    def ended(self, iteration: int, exc: BaseException | None = None,
              stop: str | None = None) -> None:
        """The training ended at ``iteration`` (see :func:`end_reason`)."""
        if not self.writes or self.cur.reason is not None:
            return
        self.cur.reason, detail = end_reason(exc, stop)
        self.cur.end = time.time()
        self._write({"record": "end", "reason": self.cur.reason, "detail": detail,
                     "time": self.cur.end, "last_iter": self.cur.last_iter,
                     "last_alive": self.cur.last_alive, "trained": self.cur.trained,
                     "iter": iteration})
        if self._alive_fd is not None:
            os.close(self._alive_fd)
            self._alive_fd = None

    def goodput(self) -> dict:
        """The run's effective training time over every attempt so far, this one to now."""
        if not self.writes:
            return {}
        return goodput(self.attempts + [self.cur], now=time.time())


def _from_rank0(flag: bool, ps) -> bool:
    """Rank 0's ``flag`` on every rank (a simulation's fake process group: this rank's)."""
    import torch
    import torch.distributed as dist

    if ps.world_size == 1 or not dist.is_initialized() or dist.get_backend() == "fake":
        return flag
    device = torch.device(ps.device)
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.broadcast(value, src=0)
    return bool(value.item())
