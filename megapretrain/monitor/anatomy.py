"""What a step costs the host, counted at the dispatcher: every op dispatched, the new tensors
ops return (allocations), and the host syncs — reads of a tensor's value on the host.

Every ``.item()``, ``float(t)``, ``bool(t)`` reaches the dispatcher as ``aten._local_scalar_dense``;
``.cpu()`` / ``.to("cpu")`` / ``copy_`` from an accelerator into host memory (``.tolist()`` and
``.numpy()`` of a GPU tensor among them) as a copy whose source is not on the CPU. ``.tolist()`` and
``.numpy()`` of a CPU tensor read its memory with no op at all, so the counter also wraps those two
methods while it is active (on the thread that entered it) and counts each such call as a scalar
read: the read a GPU run makes there. On a GPU each of those waits for every kernel
queued before it; on CPU they are cheap, but they are the same calls in the same code, so a CPU
run counts the syncs a GPU run would make. :class:`DispatchCounter` is a ``TorchDispatchMode``:
it sees the ops of autograd's backward too, and the collectives (``c10d.*``) of the process groups.

    with DispatchCounter() as counter:
        trainer.train_step()
    counter.syncs, counter.ops, counter.allocations
"""

from __future__ import annotations

import functools
import os
import threading
import time
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SCALAR_READ = torch.ops.aten._local_scalar_dense.default
COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default,
          torch.ops.aten.to.dtype_layout)
# Tensor methods reading a CPU tensor's values without dispatching an op
HOST_READS = ("tolist", "numpy")


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _device_to_host(func, args, out) -> bool:
    """Whether the copy ``func(args) -> out`` moves data from an accelerator into host memory."""
    if func not in COPIES:
        return False
    src = args[1] if func is torch.ops.aten.copy_.default else args[0]
    dst = args[0] if func is torch.ops.aten.copy_.default else out
    return (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and
            src.device.type != "cpu"
            and dst.device.type == "cpu")


class DispatchCounter(TorchDispatchMode):
    """Counts, while active, the ops dispatched (``ops``, by name in ``by_op``), the tensors they
    return with storage of their own (``allocations``), and the host syncs (``syncs``: scalar
    reads plus device-to-host copies). With ``where=True`` each sync also records the source line
    that made it (``sync_sites``), for finding one."""

    def __init__(self, where: bool = False):
        super().__init__()
        self.where = where
        self.reset()

    def __enter__(self):
        self._thread = threading.get_ident()
        # each method as torch.Tensor's own dict holds it (None: inherited from its C base)
        self._unwrapped = {name: torch.Tensor.__dict__.get(name) for name in HOST_READS}
        for name in HOST_READS:
            setattr(torch.Tensor, name, self._counting(getattr(torch.Tensor, name)))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._unwrapped.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def _counting(self, method):
        """``method`` (``Tensor.tolist`` or ``Tensor.numpy``), counting a call on a CPU tensor from
        the counting thread as a scalar read (a GPU tensor's dispatches its device-to-host copy)."""
        @functools.wraps(method)
        def read(tensor, *args, **kwargs):
            if threading.get_ident() == self._thread and tensor.device.type == "cpu":
                self.scalar_reads += 1
                if self.where:
                    self.sync_sites[_caller()] += 1
            return method(tensor, *args, **kwargs)
        return read

    def reset(self) -> None:
        self.ops = self.allocations = self.scalar_reads = self.host_copies = 0
        # inside the ops themselves (kernels and their own dispatch below this mode)
        self.op_seconds = 0.0
        self.scoped_ops = 0  # ops while ``scope`` > 0 (see :func:`count_in_module`)
        self.scope = 0
        self.by_op: Counter = Counter()
        self.sync_sites: Counter = Counter()

    @property
    def syncs(self) -> int:
        return self.scalar_reads + self.host_copies

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.op_seconds += time.perf_counter() - start
        self.ops += 1
        self.scoped_ops += self.scope > 0
        self.by_op[func.__name__] += 1
        sync = func is SCALAR_READ or _device_to_host(func, args, out)
        if sync:
            self.scalar_reads += func is SCALAR_READ
            self.host_copies += func is not SCALAR_READ
            if self.where:
                self.sync_sites[_caller()] += 1
        inputs = {t.untyped_storage()._cdata for t in _tensors((args, kwargs))}
        self.allocations += sum(1 for t in _tensors(out)
                                if t.untyped_storage()._cdata not in inputs)
        return out


def _caller() -> str:
    """The innermost frame of this project's code (else torch's) that led to the current op."""
    frames = [f for f in traceback.extract_stack()[:-2] if "anatomy.py" not in f.filename]
    ours = [f for f in frames if "megapretrain" in f.filename or "/kernels/" in f.filename]
    f = (ours or frames)[-1]
    return f"{f.filename.rsplit('/', 2)[-2:][-1]}:{f.lineno} {f.line}"


def count_in_module(counter: DispatchCounter, module: torch.nn.Module) -> list:
    """Make ``counter`` count in ``scoped_ops`` the ops of ``module``'s forward and backward (its
    own and its children's); returns the hook handles (``.remove()`` each when done)."""
    def enter(*_):
        counter.scope += 1

    def leave(*_):
        counter.scope -= 1

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave),
            module.register_full_backward_pre_hook(enter),
            module.register_full_backward_hook(leave)]


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: from /proc, to 10 ms), or None elsewhere: the
    start-up to the first step includes the interpreter and every import before any of our code."""
    try:
        with open("/proc/self/stat") as fh:
            started_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - started_ticks / os.sysconf("SC_CLK_TCK")
