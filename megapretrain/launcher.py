"""torchrun with what a job of many nodes needs: ``python -m megapretrain.launcher ARGS``, where
ARGS are torchrun's (``run_scripts/launch.sh`` builds them).

It runs ``torch.distributed.run`` with its own agent, which names each attempt by the rendezvous
round it started in, the same number on every node (``MEGAPRETRAIN_RDZV_ROUND`` in the workers'
environment; parallel/state.py names the attempt's store by it). torchrun's own
``TORCHELASTIC_RESTART_COUNT`` counts a restart only on the node whose worker failed, so after a
crash the nodes would disagree on the attempt and wait for each other in different stores.
"""

from __future__ import annotations

import os
import sys

ROUND_ENV = "MEGAPRETRAIN_RDZV_ROUND"  # the rendezvous round of this attempt, for the workers


def rendezvous_round(handler) -> int | None:
    """The round of the rendezvous ``handler`` last joined (the same on every node), or None
    where the handler does not keep one (another rendezvous backend, another torch)."""
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    value = getattr(state, "round", None)
    return value if isinstance(value, int) else None


def _agent_class():
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class Agent(LocalElasticAgent):
        """torchrun's agent, naming each attempt by its rendezvous round."""

        def _rendezvous(self, worker_group) -> None:
            super()._rendezvous(worker_group)
            round_ = rendezvous_round(worker_group.spec.rdzv_handler)
            if round_ is None:  # the workers fall back on torchrun's restart count
                os.environ.pop(ROUND_ENV, None)
            else:  # the workers' environment is a copy of the agent's
                os.environ[ROUND_ENV] = str(round_)

    return Agent


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.launcher import api

    if not hasattr(api, "LocalElasticAgent"):  # a torch that builds its agent elsewhere
        print("launcher: warning: this torch's launcher has no LocalElasticAgent to extend; "
              "running plain torchrun (attempts named by restart count)", file=sys.stderr)
    else:
        api.LocalElasticAgent = _agent_class()
    torchrun.main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
