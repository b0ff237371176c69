"""Two nodes on one machine: two run_scripts/launch.sh launchers (NNODES=2, one CPU process each,
a c10d rendezvous on 127.0.0.1), each in its own process session as on its own node. A crash on
either node, at any iteration and in any order, ends in a restart on the same losses as a run
without one, and every launcher exits by itself once the job is done or cannot go on."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "run_scripts", "launch.sh")
TINY = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_heads", "4",
        "--model.num_kv_heads", "2", "--model.ffn_hidden_size", "128", "--train.seq_length", "32",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "4",
        "--logging.tensorboard", "false", "--train.eval_interval", "0", "--train.iters", "8",
        "--checkpoint.interval", "2", "--schedule.warmup_iters", "2", "--logging.interval", "1",
        "--watchdog.timeout_s", "25"]
JOB_S = 300  # a job of this file, crashes and restarts included, on a loaded machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nodes:
    """The launchers of one two-node job, one process session each."""

    def __init__(self, run_dir, corpus, *extra, port: int | None = None, host: int | None = None,
                 **env):
        """``host``: the node started first, alone until its launcher holds the rendezvous's
        store (both launchers would hold it on MASTER_ADDR; the first to listen does)."""
        self.run_dir, self.port = run_dir, port or _free_port()
        base = {k: v for k, v in os.environ.items()
                if not k.startswith("SLURM_") and k not in ("NODE_RANK", "NPROC_PER_NODE")}
        base.update(PYTHON=sys.executable, PYTHONPATH=ROOT, NNODES="2", NPROC_PER_NODE="1",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port), MAX_RESTARTS="3",
                    OMP_NUM_THREADS="1", RDZV_ID=f"test{self.port}", **env)
        self.logs = [open(f"{run_dir}.node{n}.log", "a") for n in range(2)]  # (a relaunch: after)
        self.start = time.monotonic()
        self.procs: list[subprocess.Popen | None] = [None, None]
        for n in [0, 1] if host is None else [host, 1 - host]:
            self.procs[n] = subprocess.Popen(
                ["bash", LAUNCH, os.path.join(ROOT, "configs", "tiny.yaml"), "--run.dir",
                 str(run_dir), "--data.paths", f"[{corpus}]", *TINY, *extra], cwd=ROOT,
                env=dict(base, NODE_RANK=str(n)), stdout=self.logs[n], stderr=subprocess.STDOUT,
                start_new_session=True)
            if n == host:
                self._await_store(n)
        self.ended: dict[int, float] = {}

    def _await_store(self, node: int) -> None:
        """Wait until node ``node``'s launcher listens on the rendezvous's port."""
        deadline = time.monotonic() + JOB_S
        while time.monotonic() < deadline and self.procs[node].poll() is None:
            with socket.socket() as s, contextlib.suppress(OSError):
                s.connect(("127.0.0.1", self.port))
                return
            time.sleep(0.1)
        raise AssertionError(f"node {node} never held the rendezvous store:\n{self.log(node)}")

    def wait(self, node: int, timeout: float = JOB_S) -> int:
        """Node ``node``'s launcher's exit status (its exit time kept in ``ended``)."""
        try:
            rc = self.procs[node].wait(timeout=max(1.0, self.start + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"node {node} still running after {timeout} s:\n{self.log(node)}") from None
        self.ended.setdefault(node, time.monotonic())
        return rc

    def wait_all(self, timeout: float = JOB_S) -> list[int]:
        return [self.wait(n, timeout) for n in range(2)]

    def kill(self, node: int | None = None) -> None:
        """SIGKILL every process of node ``node`` (launcher, agent, workers): a lost node."""
        for n in range(2) if node is None else [node]:
            for pid in tree(self.procs[n].pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.procs[n].wait()

    def log(self, node: int) -> str:
        if not self.logs[node].closed:
            self.logs[node].flush()
        with open(self.logs[node].name) as fh:
            return fh.read()[-4000:]

    def close(self) -> None:
        self.kill()
        for log in self.logs:
            log.close()


def losses(run_dir) -> dict[int, float]:
    """Each iteration's loss (the later one where a restart trained it again)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    return {r["iter"]: r["loss"] for r in rows if "loss" in r and "event" not in r}


def events(run_dir, name: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if r.get("event") == name]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus) -> dict[int, float]:
    """The losses of the two-node job without a failure."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    nodes = Nodes(run_dir, corpus)
    try:
        assert nodes.wait_all() == [0, 0], nodes.log(0) + nodes.log(1)
    finally:
        nodes.close()
    assert sorted(losses(run_dir)) == list(range(1, 9))
    return losses(run_dir)


def _finishes_on(nodes: Nodes, straight) -> None:
    """Both launchers exit 0, close together (neither waits out a barrier), on the straight
    run's losses."""
    assert nodes.wait_all() == [0, 0], nodes.log(0) + "\n----\n" + nodes.log(1)
    assert abs(nodes.ended[0] - nodes.ended[1]) < 30, nodes.log(0) + nodes.log(1)
    assert losses(nodes.run_dir) == straight


def _children() -> dict[int, list[int]]:
    """Each process's children."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    return children


def tree(pid: int) -> list[int]:
    """``pid`` and every process under it (torchrun starts each worker in a session of its own)."""
    children, out = _children(), [pid]
    for p in out:
        out.extend(children.get(p, []))
    return out


def _worker_pids(launcher: int) -> list[int]:
    """The training processes under the launcher ``launcher`` (not the launcher's check)."""
    pids = []
    for pid in tree(launcher):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if b"megapretrain.train" in argv and b"--check" not in argv \
                and b"megapretrain.launcher" not in argv:
            pids.append(pid)
    return pids


def _kill_worker_after_resume(nodes: Nodes) -> None:
    """SIGKILL the worker of the node the first crash was not on (the rendezvous, not NODE_RANK,
    places the ranks) once the job has resumed from that crash."""
    deadline = time.monotonic() + JOB_S
    while time.monotonic() < deadline:
        resumed = os.path.exists(os.path.join(nodes.run_dir, "metrics.jsonl")) \
            and events(nodes.run_dir, "resumed")
        node = 1 if "exit_at=3: exiting" in nodes.log(0) else 0
        pids = _worker_pids(nodes.procs[node].pid) if resumed else []
        if pids:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.05)
    raise AssertionError(f"the job never resumed:\n{nodes.log(0)}")


# a crash on rank 1's node (whose restart count alone goes up), early and late; a crash on one
# node, then one on the other (restart counts 1 and 0, then 1 and 1: one number for different
# attempts)
@pytest.mark.parametrize("crash", ["rank1_at3", "rank1_at6", "one_node_then_the_other"])
def test_a_crash_on_any_node_restarts_every_node_on_the_same_losses(tmp_path, corpus, straight,
                                                                     crash):
    at, rank = {"rank1_at3": ("3", "1"), "rank1_at6": ("6", "1"),
                "one_node_then_the_other": ("3", "0")}[crash]
    nodes = Nodes(tmp_path / "run", corpus, "--faults.exit_at", at, "--faults.rank", rank)
    try:
        if crash == "one_node_then_the_other":
            _kill_worker_after_resume(nodes)
        _finishes_on(nodes, straight)
    finally:
        nodes.close()
    assert events(tmp_path / "run", "resumed")


def _launcher_pid(node_launcher: int) -> int:
    """The agent's process (``python -m megapretrain.launcher``) under a node's launch.sh."""
    deadline = time.monotonic() + JOB_S
    while time.monotonic() < deadline:
        for pid in tree(node_launcher):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as fh:
                if b"megapretrain.launcher" in fh.read().split(b"\0"):
                    return pid
        time.sleep(0.05)
    raise AssertionError("no megapretrain.launcher process")


def test_a_final_exit_status_ends_the_job_on_every_node_without_a_restart(tmp_path, corpus):
    """Out of memory (status 4, like 2, 3 and 6) cannot be fixed by a restart: both launchers
    exit 4 at once, the job is not started again. The OOM is on rank 0, on node 1 (started
    first: its agent sorts first in the rendezvous), which holds the rendezvous's store; node 0's
    agent is held stopped until node 1's worker is gone and a little more (a slow, loaded node):
    node 1's launcher stays up until node 0 has read the end."""
    nodes = Nodes(tmp_path / "run", corpus, "--faults.oom_at", "5", "--faults.rank", "0", host=1)
    try:
        _wait_for_iteration(nodes, 3)
        agent = _launcher_pid(nodes.procs[0].pid)
        os.kill(agent, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + JOB_S
            while _worker_pids(nodes.procs[1].pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(3)  # (a launcher that does not wait for the others is gone by now)
        finally:
            os.kill(agent, signal.SIGCONT)
        statuses = nodes.wait_all()
    finally:
        nodes.close()
    assert statuses == [4, 4], nodes.log(0) + "\n----\n" + nodes.log(1)
    assert abs(nodes.ended[0] - nodes.ended[1]) < 30  # no join timeout on either node
    logs = nodes.log(0) + nodes.log(1)
    assert "exit status 4 (out of memory) on this node" in logs and "on another node" in logs
    assert not events(tmp_path / "run", "resumed") and max(losses(tmp_path / "run")) == 4


def _wait_for_iteration(nodes: Nodes, iteration: int) -> None:
    metrics = os.path.join(nodes.run_dir, "metrics.jsonl")
    deadline = time.monotonic() + JOB_S
    while time.monotonic() < deadline:
        if os.path.exists(metrics) and max(losses(nodes.run_dir), default=0) >= iteration:
            return
        time.sleep(0.05)
    raise AssertionError(f"iteration {iteration} never logged:\n{nodes.log(0)}\n{nodes.log(1)}")


@pytest.mark.slow  # (CI runs the node-loss drill: tests/test_drills.py)
def test_a_lost_node_ends_the_other_within_the_join_timeout_and_a_relaunch_resumes(
        tmp_path, corpus, straight):
    """Node 1 lost as a whole (launcher, agent and worker killed) mid-training, with the
    rendezvous's store it held: node 0's launcher exits non-zero within RDZV_JOIN_TIMEOUT and a
    little, with one line saying what to do; launching both again resumes from the latest
    checkpoint and ends on the straight run's losses."""
    join_s = 20
    nodes = Nodes(tmp_path / "run", corpus, RDZV_JOIN_TIMEOUT=str(join_s), host=1)
    try:
        _wait_for_iteration(nodes, 3)
        agent = _launcher_pid(nodes.procs[0].pid)
        os.kill(agent, signal.SIGSTOP)  # (node 0's agent meets the lost store in any of its calls)
        try:
            nodes.kill(1)
            lost = time.monotonic()
            while _worker_pids(nodes.procs[0].pid) and time.monotonic() < lost + JOB_S:
                time.sleep(0.05)
        finally:
            os.kill(agent, signal.SIGCONT)
        status = nodes.wait(0)
        took = nodes.ended[0] - lost
    finally:
        nodes.close()
    assert status != 0, nodes.log(0)
    assert "launch the job again on healthy nodes" in nodes.log(0)
    assert nodes.log(0).strip().splitlines()[-1].startswith("launch: "), nodes.log(0)
    # the failure seen (seconds), the workers stopped, the join timeout: never torch's 600 s
    assert took < join_s + 90, f"node 0 out {took:.0f} s after node 1 was lost\n{nodes.log(0)}"
    print(f"node 0 out {took:.1f} s after node 1 was lost (join timeout {join_s} s)")
    again = Nodes(tmp_path / "run", corpus)
    try:
        _finishes_on(again, straight)
    finally:
        again.close()
    assert events(tmp_path / "run", "resumed")


def _launchers(script, port: int, **env) -> list[subprocess.Popen]:
    """Two nodes of megapretrain.launcher running ``script`` (one process each)."""
    base = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **env)
    return [subprocess.Popen(
        [sys.executable, "-m", "megapretrain.launcher", "--nnodes", "2", "--nproc_per_node", "1",
         "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--rdzv-id", f"test{port}", "--rdzv-conf", "join_timeout=60", str(script)],
        cwd=ROOT, env=base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True) for _ in range(2)]


def _run_job(script) -> tuple[list[int], list[str], float]:
    """Run ``script`` as a two-node job to its end: each launcher's status and output, and the
    seconds the job took."""
    start = time.monotonic()
    procs = _launchers(script, _free_port())
    try:
        outs = [p.communicate(timeout=JOB_S)[0] for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    return [p.returncode for p in procs], outs, time.monotonic() - start


def test_a_node_whose_worker_fails_after_the_other_finished_ends_the_job(tmp_path):
    """Rank 0's worker finishes, rank 1's fails on its way out (its first attempt only): the job
    is done: rank 1's node does not restart into a rendezvous its peer never joins (that peer
    waits at torch's exit barrier, 300 s), both launchers exit 0 at once."""
    script = tmp_path / "worker.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1' and os.environ['TORCHELASTIC_RESTART_COUNT'] "
                      "== '0':\n"
                      "    time.sleep(3)\n"
                      "    sys.exit(1)\n")
    statuses, outs, took = _run_job(script)
    assert statuses == [0, 0], "\n----\n".join(outs)
    assert took < 55, f"{took:.0f} s: a barrier or a join timeout was waited out"  # (60, 300)
    assert "after another node's ended the training: not restarted" in "".join(outs)


def test_a_worker_killed_by_a_stop_signal_before_its_handler_stops_the_job(tmp_path):
    """A SIGTERM that reaches a worker before the training's handler is in place (the
    interpreter's start) kills it: the job stops as it would with the handler, with no restart
    on either node, and both launchers exit 0 at once."""
    script = tmp_path / "worker.py"
    script.write_text("import os, signal, sys, time\n"
                      f"open(os.path.join({str(tmp_path)!r}, 'started_' + os.environ['RANK'] + '_' "
                      "+ os.environ['TORCHELASTIC_RESTART_COUNT']), 'w').close()\n"
                      "time.sleep(3)\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    os.kill(os.getpid(), signal.SIGTERM)  # (no handler: the default action)\n"
                      "time.sleep(3)\n"
                      "sys.exit(1)  # rank 0: its peer is gone (a collective would fail)\n")
    statuses, outs, took = _run_job(script)
    assert statuses == [0, 0], "\n----\n".join(outs)
    assert sorted(f.name for f in tmp_path.glob("started_*")) == ["started_0_0", "started_1_0"]
    assert took < 55, f"{took:.0f} s: a barrier or a join timeout was waited out"  # (60, 300)
    assert "was stopped by SIGTERM as it started: the job stops" in "".join(outs)


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (its SigCgt mask)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            caught = next(line for line in fh if line.startswith("SigCgt:")).split()[1]
    except (OSError, StopIteration):
        return False
    return bool(int(caught, 16) >> (signum - 1) & 1)


def test_a_stop_signal_during_start_up_stops_the_job_before_its_first_step(tmp_path, corpus):
    """SIGTERM to node 0's launcher while its worker is still setting up (its early handler in
    place, no step taken): every worker stops before the first step, nothing restarts, both
    launchers exit 0."""
    nodes = Nodes(tmp_path / "run", corpus)
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline, worker = time.monotonic() + JOB_S, None
        while worker is None and time.monotonic() < deadline:
            worker = next((p for p in _worker_pids(nodes.procs[0].pid)
                           if _catches(p, signal.SIGTERM)), None)
            time.sleep(0.02)
        assert worker is not None, nodes.log(0)
        assert not (metrics.exists() and losses(tmp_path / "run")), "too late: a step was taken"
        nodes.procs[0].send_signal(signal.SIGTERM)  # launch.sh hands it to its workers
        statuses = nodes.wait_all()
    finally:
        nodes.close()
    logs = nodes.log(0) + "\n----\n" + nodes.log(1)
    assert statuses == [0, 0], logs
    assert "during start-up: stopping before the first step" in logs
    assert "failed (exitcode" not in logs and "fired already" not in logs  # no restart
    assert not (metrics.exists() and losses(tmp_path / "run"))  # no training step
