"""torchrun with what a job of many nodes needs: ``python -m megapretrain.launcher ARGS``, where
ARGS are torchrun's (``run_scripts/launch.sh`` builds them).

It runs ``torch.distributed.run`` with its own agent, which adds two things:

- Each attempt is named by the rendezvous round it started in, the same number on every node
  (``MEGAPRETRAIN_RDZV_ROUND`` in the workers' environment; parallel/state.py names the attempt's
  store by it). torchrun's own ``TORCHELASTIC_RESTART_COUNT`` counts a restart only on the node
  whose worker failed, so after a crash the nodes would disagree on the attempt and wait for each
  other in different stores.
- A worker ended by a stop signal (SIGTERM, SIGUSR1) before the training's own handler was in
  place stops the job as the handler would have: no restart, every node exits 0.
- A worker's exit status that no restart can change (:data:`FINAL_EXITS`: bad input, recovery
  gave up, out of memory, a crash loop) ends the job on every node: the node where it happened
  records it in the rendezvous store and closes the rendezvous; every node's launcher stops its
  workers and exits with that status, without waiting for a join timeout. The node that ends the
  job keeps its launcher (which may hold the rendezvous's store) up until every node has read the
  end, for at most :data:`END_SEEN_TIMEOUT_S`.

A node that loses the rendezvous's store (the node that held it is lost) exits with one line
saying so, whichever of its calls to the store noticed first.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from .cli import ROUND_ENV, USER_ERROR_EXIT

# a worker's exit status -> what it means; the launcher restarts nothing after one of these
FINAL_EXITS = {
    USER_ERROR_EXIT: "bad input",
    3: "recovery gave up",  # train.py, on a RecoveryError
    4: "out of memory",  # oom.OOM_EXIT
    6: "a crash loop",  # the same failure at the same iteration on consecutive attempts
}

# a worker's exit status when a stop signal (launch.sh passes SIGTERM and SIGUSR1 on to the
# workers) ended it before the training's handler was in place -> the signal's name
STOP_EXITS = {-signal.SIGTERM: "SIGTERM", -signal.SIGUSR1: "SIGUSR1"}

# in the rendezvous's store: the status that ended the job; that a node's workers ended the
# training (finished it, or stopped on a signal);
# how many nodes know of the job's end (the ending node's launcher waits for all of them)
FINAL_KEY, FINISHED_KEY = "megapretrain/final_exit", "megapretrain/finished"
END_SEEN_KEY = "megapretrain/end_seen"
CLOSED_POLL_S = 1.0  # how often a node with running workers asks whether the job has ended
# how long a node that ended the job waits for the others to read the end (they poll every
# CLOSED_POLL_S, or read it as they stop their workers for a restart); a lost node costs this once
END_SEEN_TIMEOUT_S = 30.0


class FinalExit(Exception):
    """The job ended with a final worker exit status, here or on another node."""

    def __init__(self, status: int, where: str):
        super().__init__(f"exit status {status} ({FINAL_EXITS.get(status, 'final')}) {where}: "
                         "the job is not restarted")
        self.status = status


class JobFinished(Exception):
    """Another node's workers ended the training (finished it, or stopped) while this node was
    about to restart."""


def rendezvous_round(handler) -> int | None:
    """The round of the rendezvous ``handler`` last joined (the same on every node), or None
    where the handler does not keep one (another rendezvous backend, another torch)."""
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    value = getattr(state, "round", None)
    return value if isinstance(value, int) else None


def _job_store(store):
    """The store the whole job shares: the rendezvous's store without its per-round prefix."""
    return getattr(store, "underlying_store", store)


def _agent_class():
    from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.rendezvous import RendezvousClosedError

    class Agent(LocalElasticAgent):
        """torchrun's agent, naming attempts by rendezvous round and ending the job on a final
        exit status (see the module's docstring)."""

        _next_poll = 0.0

        def run(self, role: str = DEFAULT_ROLE) -> RunResult:
            try:
                return super().run(role)
            except JobFinished:  # (its workers are stopped): the others wait at the barrier
                self._exit_barrier()
                return self._succeeded()

        def _rendezvous(self, worker_group) -> None:
            try:
                super()._rendezvous(worker_group)
            except RendezvousClosedError:
                self._raise_if_final()
                if self._finished():
                    raise JobFinished() from None
                raise
            round_ = rendezvous_round(worker_group.spec.rdzv_handler)
            if round_ is None:  # the workers fall back on torchrun's restart count
                os.environ.pop(ROUND_ENV, None)
            else:  # the workers' environment is a copy of the agent's
                os.environ[ROUND_ENV] = str(round_)

        def _monitor_workers(self, worker_group) -> RunResult:
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.SUCCEEDED:
                self._end_job(None)  # nothing to restart for: no node waits for this one
                return result
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
                statuses = [f.exitcode for f in result.failures.values()]
                final = next((s for s in statuses if s in FINAL_EXITS), None)
                if final is not None:
                    self._end_job(final)
                    self._await_end_seen(worker_group.group_world_size)
                    raise FinalExit(final, "on this node")
                stopped = [s for s in statuses if s in STOP_EXITS]
                if stopped and len(stopped) == len(statuses):
                    # a stop signal came before the training's handler was in place (the
                    # interpreter's own start): the job stops as it would with the handler, before
                    # its first step, on every node (they read it as the job's end), no restart
                    names = ", ".join(sorted({STOP_EXITS[s] for s in stopped}))
                    print(f"launch: a worker on this node was stopped by {names} as it started: "
                          "the job stops, not restarted", file=sys.stderr, flush=True)
                    self._end_job(None)
                    return self._succeeded()
                if self._finished():  # failed on the way out, the training done
                    print(f"launch: a worker on this node failed (exit statuses {statuses}) "
                          "after another node's ended the training: not restarted",
                          file=sys.stderr, flush=True)
                    return self._succeeded()
            if result.state in (WorkerState.HEALTHY, WorkerState.FAILED,
                                WorkerState.UNHEALTHY) and time.monotonic() >= self._next_poll:
                self._next_poll = time.monotonic() + CLOSED_POLL_S
                if worker_group.spec.rdzv_handler.is_closed():
                    self._raise_if_final()
            return result

        def _succeeded(self) -> RunResult:
            """The result of a job whose training is done, whatever this node's workers did."""
            workers = self._worker_group.workers
            return RunResult(state=WorkerState.SUCCEEDED,
                             return_values={w.global_rank: None for w in workers})

        def _end_job(self, status: int | None) -> None:
            """Record the final status (None: that this node's workers finished the training)
            for the other nodes and close the rendezvous, so that none of them waits for this
            node in a next round."""
            if self._store is not None:
                key, value = (FINISHED_KEY, "1") if status is None else (FINAL_KEY, str(status))
                _job_store(self._store).set(key, value)
                if status is not None:
                    _job_store(self._store).add(END_SEEN_KEY, 1)
            self._worker_group.spec.rdzv_handler.set_closed()

        def _await_end_seen(self, nodes: int) -> None:
            """Wait until every node has read the job's end, so that the store (which this
            node's launcher may hold) outlives their reading it; at most END_SEEN_TIMEOUT_S."""
            if self._store is None:
                return
            from torch.distributed import DistError

            store, deadline = _job_store(self._store), time.monotonic() + END_SEEN_TIMEOUT_S
            try:
                while store.add(END_SEEN_KEY, 0) < nodes and time.monotonic() < deadline:
                    time.sleep(0.05)
            except DistError:  # the store's holder is gone: nobody is left to read the end here
                pass

        def _finished(self) -> bool:
            """Whether a node's workers ended the training: every rank took the last step, or a
            stop signal stopped them."""
            return self._store is not None and _job_store(self._store).check([FINISHED_KEY])

        def _raise_if_final(self) -> None:
            """Raise :class:`FinalExit` when another node ended the job with a final status."""
            if self._store is None:
                return
            store = _job_store(self._store)
            if store.check([FINAL_KEY]):
                status = int(store.get(FINAL_KEY))
                store.add(END_SEEN_KEY, 1)  # the last use of the store: its holder may now go
                raise FinalExit(status, "on another node")

    return Agent


STORE_LOST = ("launch: the rendezvous store (on MASTER_ADDR:MASTER_PORT) is gone: the node that "
              "held it is lost; launch the job again on healthy nodes (it resumes from its latest "
              "checkpoint)")


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )
    from torch.distributed.launcher import api

    if not hasattr(api, "LocalElasticAgent"):  # a torch that builds its agent elsewhere
        print("launcher: warning: this torch's launcher has no LocalElasticAgent to extend; "
              "running plain torchrun (attempts named by restart count)", file=sys.stderr)
    else:
        api.LocalElasticAgent = _agent_class()
    try:
        torchrun.main(argv)
    except FinalExit as exc:
        print(f"launch: {exc}", file=sys.stderr, flush=True)
        return exc.status
    except RendezvousTimeoutError:  # (the agent's log above has the details)
        print("launch: the nodes did not all join the rendezvous within its join timeout "
              "(launch.sh: RDZV_JOIN_TIMEOUT): a node is lost or did not start; launch the job "
              "again on healthy nodes (it resumes from its latest checkpoint)", file=sys.stderr)
        return 1
    except (RendezvousConnectionError, DistNetworkError, DistStoreError):
        # (the rendezvous's own calls raise the first; the agent's own calls to the store, the
        # others)
        print(STORE_LOST, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
