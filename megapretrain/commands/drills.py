"""The fault drills of ``tools/drill.py``: each a :class:`Drill` that injects one failure into a
job of launchers (:mod:`.drill_cluster`) and adds its own checks; a :class:`Rehearsal` plays one
and measures what every drill reports.

A drill's ``play`` launches the job (``r.launch()``), waits for its moment and strikes; it may
relaunch (a whole job after a stop or a lost node). Then the rehearsal waits for the last job's
launchers, reads the run's metrics and the launchers' timestamped lines, and judges: every
launcher's exit status (``Drill.exits``), the losses of every iteration against the straight
run's, bitwise, and the time the launchers took to exit after the last iteration.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

from .drill_cluster import Job, free_port, workers

ITER_LINE = re.compile(r"^iter\s+(\d+)/\d+ \|")
START_LINE = re.compile(r"^start-up: ")  # an attempt's first step begins
AGENT_FAILED = re.compile(r"failed \(exitcode")  # torchrun's agent: its worker group failed
AGENT_SAW = re.compile(r"failed \(exitcode|error: hang|crash loop|Rendezvous\w*Error")


def losses_of(run_dir: str) -> list[dict]:
    """The step rows of a run's metrics.jsonl, in the order written (a recomputed iteration
    twice)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as fh:
        for line in fh:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            if "loss" in row and "event" not in row:
                rows.append(row)
    return rows


class Rehearsal:
    """One drill played: the jobs it launched, the moment it struck, and the verdict."""

    def __init__(self, settings, drill: Drill, straight: dict[int, float]):
        self.s, self.drill, self.straight = settings, drill, straight
        self.run_dir = os.path.join(settings.output, drill.name)
        self.jobs: list[Job] = []
        self.failed_at: float | None = None  # the moment of the (first) failure
        self.checks: list[dict] = []
        self.notes: list[str] = []
        self.started = time.time()

    # -- what a drill's play uses -----------------------------------------------------------------

    def launch(self, extra: list[str] = (), ranks: list[int] | None = None,
               port: int | None = None, env: dict | None = None) -> Job:
        """The job's launchers (NODE_RANK ``ranks``, default 0..N-1) on ``port`` (default: a
        free one), each with the drill's overrides and ``extra``."""
        ranks = list(range(self.s.nodes)) if ranks is None else ranks
        job = Job(ranks, self.s.nproc, port or free_port(), self.s.config,
                  self.s.argv(self.run_dir, [*self.drill.overrides(self.s), *extra]),
                  os.path.join(self.s.output, f"{self.drill.name}.attempt{len(self.jobs)}"),
                  {**self.s.env, **(env or {})})
        self.jobs.append(job)
        return job

    def until(self, ready, timeout: float | None = None, poll: float = 0.05) -> bool:
        """Wait until ``ready()`` is true (True), or the last job's launchers all ended or
        ``timeout`` (default: the drill's) passed (False)."""
        deadline = time.time() + (timeout or self.s.timeout)
        job = self.jobs[-1]
        while time.time() < deadline:
            if ready():
                return True
            if all(n.poll() is not None for n in job.nodes):
                return ready()
            time.sleep(poll)
        return False

    def record(self, fault: str, rank: int) -> dict | None:
        """The record of fault ``fault`` that global rank ``rank`` fired, if it did."""
        path = os.path.join(self.run_dir, "faults", f"{fault}.rank{rank}.json")
        try:
            with open(path) as fh:
                return json.load(fh)
        except (OSError, json.JSONDecodeError):
            return None  # not yet, or being written

    def last_iter(self, before: float | None = None) -> int:
        """The last iteration a launcher printed (before ``before``), 0 when none."""
        found = [int(m.group(1)) for when, line in self.lines()
                 if (before is None or when < before) and (m := ITER_LINE.match(line))]
        return max(found, default=0)

    def lines(self) -> list[tuple[float, str]]:
        """Every launcher's lines, every attempt, by time."""
        return sorted(item for job in self.jobs for n in job.nodes for item in n.lines)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append({"check": name, "ok": bool(ok), "detail": detail})
        return ok

    # -- the rehearsal ----------------------------------------------------------------------------

    def perform(self) -> dict:
        try:
            self.drill.play(self)
            statuses = self.jobs[-1].wait(max(self.s.timeout - (time.time() - self.started), 1))
        finally:
            for job in self.jobs:
                job.kill()
        self.check("ended by itself", None not in statuses,
                   f"launchers still running {self.s.timeout:.0f} s after the start: killed")
        expected = self.drill.exits
        self.check(f"every launcher exits {expected}",
                   all(s == expected for s in statuses), f"exit statuses {statuses}")
        failed = sum(len(AGENT_FAILED.findall(n.text())) for job in self.jobs for n in job.nodes)
        allowed = self.drill.failures * self.s.nodes
        self.check("one restart per failure", failed <= allowed,
                   f"{failed} worker-group failures for {self.drill.failures} injected on "
                   f"{self.s.nodes} nodes (at most {allowed}): restarts that did not come up")
        rows = losses_of(self.run_dir)
        result = self._measure(rows, statuses)
        self.drill.judge(self, rows)
        result.update(passed=all(c["ok"] for c in self.checks), checks=self.checks,
                      notes=self.notes)
        return result

    def _measure(self, rows: list[dict], statuses: list) -> dict:
        lines = self.lines()
        last = [when for when, line in lines if ITER_LINE.match(line)]
        final = self.jobs[-1].nodes
        exit_after = None
        if last and None not in statuses:
            exit_after = max(n.ended for n in final) - last[-1]
            self.check(f"launchers exit within {self.s.exit_within:.0f} s of the last iteration",
                       exit_after <= self.s.exit_within,
                       f"the last launcher exited {exit_after:.1f} s after it")
        bitwise = None
        if self.drill.trains_to_end:
            kept = {r["iter"]: r["loss"] for r in rows}
            missing = sorted(set(self.straight) - set(kept))
            differ = [r["iter"] for r in rows if self.straight.get(r["iter"]) != r["loss"]]
            bitwise = not missing and not differ
            self.check("losses equal the straight run's bitwise at every iteration", bitwise,
                       f"missing iterations {missing}, different at {differ}")
        detection = restart = None
        if self.failed_at is not None:
            seen = [w for w, line in lines if self.drill.noticed and w >= self.failed_at
                    and self.drill.noticed.search(line)]
            detection = seen[0] - self.failed_at if seen else None
            began = [w for w, line in lines if w >= self.failed_at and START_LINE.match(line)]
            stepped = [w for w, line in lines if began and w > began[0] and ITER_LINE.match(line)]
            restart = stepped[0] - self.failed_at if stepped else None
        ended = [n.ended for job in self.jobs for n in job.nodes if n.ended is not None]
        wall = (max(ended) if ended else time.time()) - self.started
        productive = sum(r["step_time"] for r in {r["iter"]: r for r in rows}.values())
        return {"drill": self.drill.name, "what": self.drill.what,
                "detection_s": _round(detection), "restart_s": _round(restart),
                "iterations_lost": lost_iterations(self.run_dir), "losses_bitwise": bitwise,
                "exit_statuses": statuses, "exit_after_s": _round(exit_after),
                "attempts_launched": len(self.jobs), "wall_s": _round(wall),
                "goodput": round(productive / wall, 4) if wall > 0 else None,
                "logs": [n.log for j in self.jobs for n in j.nodes]}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def lost_iterations(run_dir: str) -> int:
    """Iterations trained again: at each attempt's start (a ``first_step`` record after the
    first), the iterations done so far past the one it resumed after."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    lost, done, attempts = 0, 0, 0
    with open(path) as fh:
        for line in fh:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("event") == "first_step":
                attempts += 1
                if attempts > 1:
                    lost += max(done - (row["iter"] - 1), 0)
            elif "loss" in row and "event" not in row:
                done = max(done, row["iter"])
    return lost


# -- the drills ------------------------------------------------------------------------------------


class Drill:
    """A named failure. Subclasses set ``name``, ``what`` and ``play``; ``exits`` is every final
    launcher's expected status, ``noticed`` the line that shows the job saw the failure,
    ``failures`` how many it injects (each may fail every node's worker group once: more means
    restarts that did not come up) and ``trains_to_end``: the run ends on every iteration of the
    straight run. What a drill needs to fire at all: ``min_nodes`` nodes (``needs_nodes`` says
    why), and ``after`` the iteration its moment follows, when it strikes from outside the run
    (its ``faults.*`` overrides are checked as the trainer checks them)."""

    name = ""
    what = ""
    exits = 0
    failures = 1
    min_nodes = 1
    needs_nodes = ""
    after: int | None = None
    noticed: re.Pattern | None = AGENT_SAW  # None: no moment to notice (all nodes gone at once)
    trains_to_end = True

    def overrides(self, s) -> list[str]:
        return []

    def play(self, r: Rehearsal) -> None:
        raise NotImplementedError

    def judge(self, r: Rehearsal, rows: list[dict]) -> None:
        """Checks of this drill's own, beyond the exit statuses and the losses."""


class WorkerCrash(Drill):
    name, what = "worker-crash", "a worker on a non-zero node exits (status 1) at iteration 6"
    at = 6
    min_nodes, needs_nodes = 2, "the worker that fails is on a node other than node 0"

    def overrides(self, s) -> list[str]:
        return ["--faults.exit_at", str(self.at), "--faults.rank", str(s.nproc)]

    def play(self, r: Rehearsal) -> None:
        r.launch()
        if r.until(lambda: r.record("exit_at", r.s.nproc) is not None):
            r.failed_at = r.record("exit_at", r.s.nproc)["time"]

    def judge(self, r: Rehearsal, rows: list[dict]) -> None:
        r.check("the fault fired", r.failed_at is not None, "faults.exit_at never fired")


class CrashTwice(WorkerCrash):
    name = "crash-twice"
    what = ("a worker exits at iteration 4 on one node, after the restart one is killed at "
            "iteration 8 on another")
    at = 4
    failures = 2
    after = 7  # the second crash, on another node

    def play(self, r: Rehearsal) -> None:
        job = r.launch()
        fired = f"faults.exit_at={self.at}: exiting"
        if not r.until(lambda: any(fired in n.text() for n in job.nodes)):
            return
        r.failed_at = r.record("exit_at", r.s.nproc)["time"]
        crashed = next(n for n in job.nodes if fired in n.text())
        other = next(n for n in job.nodes if n is not crashed)
        if not r.until(lambda: r.last_iter() >= 7):
            r.check("the second crash", False, "the job never reached iteration 7 after the first")
            return
        killed = workers(other.proc.pid)
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        r.notes.append(f"second crash: {len(killed)} worker(s) of node {other.rank} killed after "
                       f"iteration {r.last_iter()}")


class NodeLoss(Drill):
    name = "node-loss"
    what = ("a node's whole process tree is killed after iteration 5 (one that does not host the "
            "rendezvous); once the others are out, the job is relaunched")
    margin = 90.0  # the survivors' workers failing, the join timeout's own slack, a loaded machine
    min_nodes, needs_nodes = 2, "it loses a node that does not host the rendezvous"
    after = 5

    def play(self, r: Rehearsal) -> None:
        job = r.launch()
        if not r.until(lambda: r.last_iter() >= 5):
            return
        # on a cluster the store lives on MASTER_ADDR's node; here on whichever bound it first
        host = next((n for n in job.nodes if n.listens_on(job.port)), job.nodes[0])
        lost = next(n for n in reversed(job.nodes) if n is not host)
        r.failed_at = time.time()
        lost.lose()
        survivors = [n for n in job.nodes if n is not lost]
        within = r.s.join_timeout + self.margin
        deadline = time.time() + within
        statuses = [n.wait(deadline - time.time()) for n in survivors]
        r.notes.append(f"lost node {lost.rank} (node {host.rank} hosts the rendezvous); survivors "
                       f"exited {statuses}" + "".join(f", node {n.rank} after "
                                                      f"{n.ended - r.failed_at:.1f} s"
                                                      for n in survivors if n.ended))
        if not r.check(f"the surviving nodes exit within {within:.0f} s of the loss (join "
                       f"timeout {r.s.join_timeout} s)", None not in statuses,
                       "still running: killed"):
            job.kill()
        r.launch()


class Hang(Drill):
    name, what = "hang", "a worker on a non-zero node blocks at iteration 6 (watchdog 10 s)"
    noticed = re.compile(r"error: hang")
    min_nodes, needs_nodes = 2, "the worker that hangs is on a node other than node 0"

    def overrides(self, s) -> list[str]:
        return ["--faults.hang_at", "6", "--faults.rank", str(s.nproc), "--watchdog.timeout_s",
                "10"]

    def play(self, r: Rehearsal) -> None:
        r.launch()
        if r.until(lambda: r.record("hang_at", r.s.nproc) is not None):
            r.failed_at = r.record("hang_at", r.s.nproc)["time"]


class Stop(Drill):
    """A stop signal to every launcher (SLURM's pre-emption warning, a scancel) at ``moment``:
    the job saves, exits 0 and trains nothing after it; a relaunch resumes and finishes."""

    failures = 0

    def __init__(self, sig: signal.Signals, moment: str):
        self.sig, self.moment = sig, moment
        self.name = f"{sig.name.lower()}-{moment}"
        self.what = f"{sig.name} to every launcher " + {
            "startup": "0.5 s after the workers start (importing, before the first step)",
            "mid-step": "during step 5 (a 4 s data wait)",
            "mid-save": "while a checkpoint is being written"}[moment]
        self.noticed = re.compile(rf"^(?!launch:).*({sig.name}|a stop signal)")
        self.signalled_after = 0

    def overrides(self, s) -> list[str]:
        if self.moment == "mid-step":
            return ["--faults.slow_data_at", "5", "--faults.slow_data_s", "4"]
        return []

    def play(self, r: Rehearsal) -> None:
        first = r.launch()
        ready = {"startup": lambda: all(n.workers_up() for n in first.nodes),
                 "mid-step": lambda: r.record("slow_data_at", 0) is not None,
                 "mid-save": lambda: self._saving(r)}[self.moment]
        if not r.until(ready, poll=0.001 if self.moment == "mid-save" else 0.05):
            r.check(f"{self.moment} reached", False, "the job ended before the moment came")
            return
        if self.moment == "startup":
            time.sleep(0.5)  # past the interpreter's own start: in the imports
        r.failed_at = time.time()
        for n in first.nodes:
            n.signal(self.sig)
        if self.moment == "mid-save" and not self._saving(r):
            r.notes.append("the save finished before the signal reached the workers")
        self.signalled_after = r.last_iter(before=r.failed_at)
        statuses = first.wait(r.s.timeout)
        first.kill()
        r.check("the stopped job exits 0 on every node", statuses == [0] * len(statuses),
                f"exit statuses {statuses}")
        stopped_at = r.last_iter()
        r.check("no training after the stop", stopped_at <= self.signalled_after + 1,
                f"signalled after iteration {self.signalled_after}, trained to {stopped_at}")
        restarted = sum(bool(START_LINE.match(line)) for n in first.nodes for _, line in n.lines)
        died = sorted({m.group(1) for n in first.nodes
                       for m in re.finditer(r"failed \(exitcode: (-?\d+)\)", n.text())})
        r.check("no restart after the stop", restarted <= 1 and not died,
                f"{restarted} attempts began; workers exited {', '.join(died) or '-'} and were "
                "restarted" + (f" (-{int(self.sig)}: killed by {self.sig.name}, before a handler "
                               "was installed)" if f"-{int(self.sig)}" in died else ""))
        if stopped_at >= r.s.iters:
            r.notes.append("trained to the end despite the stop: nothing to relaunch")
            return
        r.notes.append(f"stopped after iteration {stopped_at}; relaunched")
        r.launch()

    def _saving(self, r: Rehearsal) -> bool:
        root = os.path.join(r.run_dir, "checkpoints")
        return os.path.isdir(root) and any(n.startswith(".iter_") for n in os.listdir(root))


class RankSwap(Drill):
    name = "rank-swap"
    what = "every node is lost after iteration 5; the job comes back with NODE_RANKs swapped"
    noticed = None  # nothing of the job is left to notice: the relaunch is at once
    min_nodes, needs_nodes = 2, "one node has no other to swap NODE_RANK with"
    after = 5

    def play(self, r: Rehearsal) -> None:
        job = r.launch()
        if not r.until(lambda: r.last_iter() >= 5):
            return
        r.failed_at = time.time()
        for n in job.nodes:
            n.lose()
        r.launch(ranks=list(reversed(range(r.s.nodes))))


class CrashLoop(Drill):
    name = "crash-loop"
    what = "a worker exits at iteration 6 on every attempt (faults.every_attempt)"
    exits = 6
    failures = 3  # two crashes at the same iteration, then the stop
    trains_to_end = False
    fired_line = re.compile(r"^faults\.exit_at=6: exiting")
    min_nodes, needs_nodes = 2, "the worker that fails is on a node other than node 0"

    def overrides(self, s) -> list[str]:
        return ["--faults.exit_at", "6", "--faults.rank", str(s.nproc),
                "--faults.every_attempt", "true"]

    def play(self, r: Rehearsal) -> None:
        r.launch()
        if r.until(lambda: any(self.fired_line.match(line) for _, line in r.lines())):
            r.failed_at = next(w for w, line in r.lines() if self.fired_line.match(line))

    def judge(self, r: Rehearsal, rows: list[dict]) -> None:
        fired = sum(bool(self.fired_line.match(line)) for _, line in r.lines())
        r.check("stopped before burning every restart", 1 < fired < 4,
                f"the crash happened on {fired} attempts (MAX_RESTARTS=3)")
        text = "\n".join(line for _, line in r.lines())
        r.check("one clear crash-loop line", re.search(r"crash.loop", text, re.I) is not None,
                "no line names the crash loop")
        differ = [x["iter"] for x in rows if r.straight.get(x["iter"]) != x["loss"]]
        r.check("the losses trained equal the straight run's", not differ,
                f"different at {differ}")


class CorruptCheckpoint(WorkerCrash):
    name = "corrupt-checkpoint"
    what = ("a worker exits at iteration 6; the latest checkpoint (4) is corrupted before the "
            "restart, which falls back to 2")

    def play(self, r: Rehearsal) -> None:
        super().play(r)
        if r.failed_at is None:
            return
        root = os.path.join(r.run_dir, "checkpoints")
        with open(os.path.join(root, "latest")) as fh:
            latest = os.path.join(root, fh.read().strip())
        file = os.path.join(latest, "rank_00000.safetensors")
        with open(file, "r+b") as fh:  # flip bytes in the middle of the tensor data
            fh.seek(os.path.getsize(file) // 2)
            chunk = fh.read(64)
            fh.seek(-len(chunk), os.SEEK_CUR)
            fh.write(bytes(b ^ 0xFF for b in chunk))
        self.corrupted = os.path.basename(latest)
        r.notes.append(f"corrupted {file} before the restart")

    def judge(self, r: Rehearsal, rows: list[dict]) -> None:
        super().judge(r, rows)
        text = "\n".join(line for _, line in r.lines())
        corrupted = getattr(self, "corrupted", "?")
        r.check("the corrupt checkpoint is passed over",
                re.search(rf"skipped \S*{corrupted}", text) is not None,
                f"no 'skipped ...{corrupted}' warning")
        r.check("resumed from the one before", re.search(r"resumed from \S*iter_0000002", text)
                is not None, "no 'resumed from ...iter_0000002' line")


DRILLS: dict[str, Drill] = {d.name: d for d in (
    WorkerCrash(), CrashTwice(), NodeLoss(), Hang(),
    *(Stop(sig, moment) for moment in ("startup", "mid-step", "mid-save")
      for sig in (signal.SIGTERM, signal.SIGUSR1)),
    RankSwap(), CrashLoop(), CorruptCheckpoint())}
