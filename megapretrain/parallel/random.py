"""RNG for dropout under tensor parallelism and activation recomputation.

Two streams matter. Dropout on activations that are *replicated* across tp ranks (the residual
stream without sequence parallelism) must draw the same mask on every tp rank, or the replicas
diverge: that is the default stream, seeded identically on them. Dropout inside a tp region (on
attention heads, which differ per rank) must draw *different* masks per rank: that is the
``tensor_parallel`` stream, seeded with the tp rank. :class:`RNGTracker` keeps the second stream's
state and swaps it in with ``fork()``.

Context-parallel ranks hold different tokens of the same sequences, so both streams also start at
a different seed on every cp rank (``CP_SEED_STRIDE`` apart): the same mask for different tokens
would correlate their dropout. As with tp, a run under cp > 1 and dropout then draws other masks
than one process does — the same distribution, not the same numbers.

Recomputation must replay the same masks. ``torch.utils.checkpoint`` restores the default stream by
itself; :meth:`RNGTracker.checkpoint_context` does the same for the tracker's streams, so dropout
inside a recomputed region reproduces the original forward exactly.
"""

from __future__ import annotations

import contextlib

import torch

TP_SEED_OFFSET = 2718
# seeds of cp rank c start c × this further on (above any tp rank and pp offset)
CP_SEED_STRIDE = 1 << 20


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """Named RNG states that can be swapped in for a region, on the device of the activations."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device | str = "cpu", *,
                 cp_rank: int = 0):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}
        self.add("tensor_parallel", seed + TP_SEED_OFFSET + tp_rank + CP_SEED_STRIDE * cp_rank)

    def add(self, name: str, seed: int) -> None:
        current = _get_state(self.device)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_state(self.device)
        _set_state(current, self.device)

    @contextlib.contextmanager
    def fork(self, name: str = "tensor_parallel"):
        """Run the block with stream ``name``; its advanced state is kept for the next fork."""
        outer = _get_state(self.device)
        _set_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(outer, self.device)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}

    def checkpoint_context(self):
        """A ``context_fn`` for ``torch.utils.checkpoint``: the recomputation sees the tracker's
        states as they were at the original forward, and leaves them as they are now."""
        saved: dict = {}

        @contextlib.contextmanager
        def forward():
            saved["states"] = self.get_states()
            yield

        @contextlib.contextmanager
        def recompute():
            now = self.get_states()
            self.set_states(saved["states"])
            try:
                yield
            finally:
                self.set_states(now)

        return forward(), recompute()
