"""Nodes on one machine for the fault drills (``tools/drill.py``): one ``run_scripts/launch.sh`` per
node, each in its own process session, with every line it prints timestamped as it arrives.

A :class:`Job` is the launchers of one attempt at a run directory: they share it and one
rendezvous port. A node is lost by killing every process of its tree at once (the launcher, its
torchrun agent and the workers torchrun starts in sessions of their own), as a machine that
loses power; a stop signal goes to the launcher, as SLURM's does.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

# the checkout: run_scripts/ and configs/ beside the package
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH = os.path.join(ROOT, "run_scripts", "launch.sh")
# what a node's environment must not inherit: it would make launch.sh a SLURM batch script, or
# name another node
DROPPED = ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "RDZV_ID")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first found through /proc), ``pid`` first."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue  # gone meanwhile
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def workers(pid: int) -> list[int]:
    """The training processes below launcher ``pid``: those whose first ``-m`` module is the
    trainer (not the launcher's agent, which names it later), without ``--check``."""
    found = []
    for p in descendants(pid)[1:]:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        module = argv[argv.index(b"-m") + 1] if b"-m" in argv[:-1] else b""
        if module == b"megapretrain.train" and b"--check" not in argv:
            found.append(p)
    return found


def listening(port: int) -> set[str]:
    """The sockets (``socket:[INODE]``, as /proc/PID/fd names them) listening on TCP ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                found.add(f"socket:[{fields[9]}]")
    return found


class Node:
    """One node's launcher: ``bash run_scripts/launch.sh CONFIG ARGS`` in a session of its own,
    its output appended to ``log`` and kept as ``(time, line)`` pairs."""

    def __init__(self, rank: int, nnodes: int, nproc: int, port: int, config: str,
                 args: list[str], log: str, env: dict[str, str]):
        self.rank, self.log = rank, log
        node_env = {k: v for k, v in os.environ.items()
                    if not k.startswith("SLURM_") and k not in DROPPED}
        node_env.update(PYTHON=sys.executable, PYTHONPATH=ROOT, NNODES=str(nnodes),
                        NODE_RANK=str(rank), NPROC_PER_NODE=str(nproc), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port), OMP_NUM_THREADS="1", **env)
        self.lines: list[tuple[float, str]] = []
        self.started = time.time()
        self.ended: float | None = None
        self.proc = subprocess.Popen(["bash", LAUNCH, config, *args], cwd=ROOT, env=node_env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     errors="replace", start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with open(self.log, "a") as out:
            out.write(f"=== node {self.rank}: launched at {self.started:.3f}\n")
            for line in self.proc.stdout:
                now = time.time()
                self.lines.append((now, line.rstrip("\n")))
                out.write(f"{now:.3f} {line}")
                out.flush()

    def poll(self) -> int | None:
        status = self.proc.poll()
        if status is not None and self.ended is None:
            self.ended = time.time()
        return status

    def wait(self, timeout: float) -> int | None:
        """The launcher's exit status, or None when it still runs after ``timeout`` seconds."""
        try:
            self.proc.wait(timeout=max(timeout, 0.01))
        except subprocess.TimeoutExpired:
            return None
        status = self.poll()
        self._reader.join(timeout=5)
        return status

    def signal(self, sig: int) -> None:
        """``sig`` to the launcher itself (SLURM's ``--signal=B:``, a pre-emption's SIGTERM)."""
        if self.poll() is None:
            os.kill(self.proc.pid, sig)

    def lose(self) -> None:
        """The node is gone: every process of its tree killed at once (SIGKILL)."""
        tree = descendants(self.proc.pid)
        for p in tree:  # stopped first, so none of them reacts to the others' deaths
            _kill(p, signal.SIGSTOP)
        for p in tree:
            _kill(p, signal.SIGKILL)
        self.wait(30)

    def kill(self) -> None:
        """Clean-up: whatever of this node still runs (a drill that did not end by itself)."""
        if self.proc.poll() is None:
            self.lose()

    def listens_on(self, port: int) -> bool:
        """Whether a process of this node listens on ``port``: the one whose agent hosts the
        rendezvous's store (on one machine, whichever bound the port first)."""
        sockets = listening(port)
        for p in descendants(self.proc.pid):
            try:
                fds = os.listdir(f"/proc/{p}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    if os.readlink(f"/proc/{p}/fd/{fd}") in sockets:
                        return True
                except OSError:
                    continue
        return False

    def workers_up(self) -> bool:
        return bool(workers(self.proc.pid))

    def first(self, pattern, after: float) -> float | None:
        """When the first line matching regex ``pattern`` printed at or after ``after`` came."""
        for when, line in list(self.lines):
            if when >= after and pattern.search(line):
                return when
        return None

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


class Job:
    """The launchers of one attempt: node ``r`` for each ``r`` in ``ranks`` (NODE_RANK), each
    node's log ``logs/node{i}.log`` by its place ``i``."""

    def __init__(self, ranks: list[int], nproc: int, port: int, config: str, args: list[str],
                 log_prefix: str, env: dict[str, str] | None = None):
        self.port = port
        self.nodes = [Node(r, len(ranks), nproc, port, config, args, f"{log_prefix}.node{i}.log",
                           env or {}) for i, r in enumerate(ranks)]

    def wait(self, timeout: float) -> list[int | None]:
        """Every launcher's exit status (None: still running ``timeout`` seconds from now)."""
        deadline = time.time() + timeout
        return [n.wait(deadline - time.time()) for n in self.nodes]

    def kill(self) -> None:
        for n in self.nodes:
            n.kill()
