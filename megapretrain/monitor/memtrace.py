"""Every byte of tensor storage a program allocates, from the tensors themselves: a timeline.

:class:`MemoryTrace` is a ``TorchDispatchMode``: after each op it looks at the storages of the op's
outputs; one it has not seen is an allocation of ``storage.nbytes()`` bytes, and a weak reference
to the storage says when it is freed (the last tensor or autograd node holding it went away).
``UntypedStorage.resize_`` does not go through the dispatcher (ZeRO-3 allocates and frees a
gathered layer that way), so while the trace is active it is wrapped: a resize closes the
storage's current allocation and opens one of the new size. The result is a list of
:class:`Segment` — bytes, the event at which they were allocated and the one at which they were
freed, a ``tag`` and the ``phase`` the caller had set at the time — and the peak of their sum.

It counts what the program holds in tensors, on real tensors (a gloo run on CPU) and on fake ones
(``torch._subclasses.FakeTensorMode``: storages without data still have their size) alike, so a
simulated rank and a real one are measured by the same accounting. It does not see an
allocator's rounding and caching, a library's workspaces (cuBLAS, NCCL), or tensors made outside
the dispatcher (``torch.from_numpy``); those are the allowance a planner adds on top.

Why not ``torch.distributed._tools.mem_tracker.MemTracker``: it files a storage under the module
phase it was made in (activation in forward, temporary in backward, optimizer state inside an
``optim.Optimizer.step``), cannot tell a forward's temporaries from what autograd keeps, stops at
a root module's second forward (the micro-batches of a pipeline) and does not know the
optimizer here (flat buffers of its own). The timeline here is classified afterwards, by
lifetime, which answers those questions (``megapretrain/simulate/measure.py``).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass
class Segment:
    """One allocation: ``bytes`` from event ``start`` until event ``end`` (None: still alive)."""
    bytes: int
    start: int
    end: int | None
    tag: str | None
    phase: Any

    def alive_at(self, clock: int) -> bool:
        return self.start <= clock and (self.end is None or self.end > clock)


class MemoryTrace(TorchDispatchMode):
    """Allocations and frees of tensor storage while active (see the module docstring).

    ``phase`` (any value; the caller sets it as the program moves on) and the innermost
    :meth:`tagged` tag are recorded with each allocation. ``peak`` / ``peak_clock`` /
    ``peak_phase``: the most bytes alive at once since the last :meth:`reset_peak`, the event at
    which they were, and the phase then."""

    def __init__(self, device: torch.device | str = "cpu"):
        """``device``: the device whose tensors count (those on others, meta ones among them, do
        not)."""
        super().__init__()
        self.device_type = torch.device(device).type
        self.segments: list[Segment] = []
        self.clock = 0                  # events so far (an allocation or a free is one)
        self.live_bytes = 0
        self.peak = 0
        self.peak_clock = 0
        self.phase: Any = None
        self.peak_phase: Any = None
        self._tags: list[str] = []
        self._current: dict[int, Segment | None] = {}  # storage address -> its live allocation
        self._host: set[int] = set()  # storages that are host memory (to_host)
        self._in_host = 0  # inside host(): new storages are host memory
        self._resize = None

    # -- what the caller says about the program ----------------------------------------------------

    @contextlib.contextmanager
    def tagged(self, tag: str):
        """Allocations inside are tagged ``tag`` (the innermost tag wins)."""
        self._tags.append(tag)
        try:
            yield
        finally:
            self._tags.pop()

    def label(self, tensor: torch.Tensor, tag: str) -> None:
        """Tag the live allocation behind ``tensor`` (persistent buffers, named after they are
        made)."""
        segment = self._current.get(tensor.untyped_storage()._cdata)
        if segment is not None:
            segment.tag = tag

    @contextlib.contextmanager
    def host(self):
        """What is allocated inside is host memory (see :meth:`to_host`): an offloaded optimizer's
        step computes there."""
        self._in_host += 1
        try:
            yield
        finally:
            self._in_host -= 1

    def to_host(self, tensor: torch.Tensor) -> int:
        """The allocation behind ``tensor`` is host memory, although on the traced device type (a
        simulation's CPU tensors stand for a GPU's and the host's alike): it no longer counts, nor
        does any later size of its storage. Returns its bytes."""
        key = tensor.untyped_storage()._cdata
        nbytes = tensor.untyped_storage().nbytes()
        self._close(key)
        self._host.add(key)
        return nbytes

    def reset_peak(self) -> None:
        self.peak, self.peak_clock, self.peak_phase = self.live_bytes, self.clock, self.phase

    def alive_at(self, clock: int) -> list[Segment]:
        return [s for s in self.segments if s.alive_at(clock)]

    # -- the accounting ----------------------------------------------------------------------------

    def _open(self, key: int, nbytes: int) -> None:
        self.clock += 1
        segment = Segment(nbytes, self.clock, None, self._tags[-1] if self._tags else None,
                          self.phase)
        self.segments.append(segment)
        self._current[key] = segment
        self.live_bytes += nbytes
        if self.live_bytes > self.peak:
            self.peak, self.peak_clock, self.peak_phase = self.live_bytes, self.clock, self.phase

    def _close(self, key: int) -> None:
        segment = self._current.get(key)
        if segment is None:
            return
        self.clock += 1
        segment.end = self.clock
        self._current[key] = None
        self.live_bytes -= segment.bytes

    def _freed(self, key: int) -> None:
        self._close(key)
        self._current.pop(key, None)
        self._host.discard(key)

    def _see(self, storage: torch.UntypedStorage) -> None:
        """A storage an op returned: a new allocation, or a known one whose size changed."""
        key, nbytes = storage._cdata, storage.nbytes()
        if key in self._host:
            return
        if self._in_host and key not in self._current:
            self._host.add(key)
            weakref.finalize(storage, self._host.discard, key)
            return
        if key not in self._current:
            self._current[key] = None
            weakref.finalize(storage, self._freed, key)
            if nbytes:
                self._open(key, nbytes)
            return
        segment = self._current[key]
        if (segment.bytes if segment is not None else 0) != nbytes:
            self._close(key)
            if nbytes:
                self._open(key, nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided \
                    and t.device.type == self.device_type:
                self._see(t.untyped_storage())
        return out

    def __enter__(self):
        self._resize = torch.UntypedStorage.resize_
        original, trace = self._resize, self

        def resize_(storage, size):  # not a dispatched op: watched here while the trace is active
            result = original(storage, size)
            trace._see(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)
