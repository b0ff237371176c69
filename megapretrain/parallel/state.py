"""Process groups: the groups of a :class:`~megapretrain.parallel.layout.Layout`'s rank grid,
built once and passed to whatever needs it.

Ranks are laid out tp-fastest, then cp (context parallel), then dp, then pp, so tensor-parallel
neighbours share a node and context-parallel ones sit next to them:

    grid = layout.grid()  # arange(world).reshape(pp, dp, cp, tp)
    tp group of (i, j, c): grid[i, j, c, :]     cp group of (i, j, k): grid[i, j, :, k]
    dp group of (i, c, k): grid[i, :, c, k]     pp group of (j, c, k): grid[:, j, c, k]
    dp_cp group of (i, k): grid[i, :, :, k]  (parameters are replicated over dp and cp alike)

Every communicator is a :class:`Group`, whose collectives return at once when it has one rank, so a
single process without ``torch.distributed`` runs the same code path.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..cli import ROUND_ENV
from ..errors import ConfigError
from .layout import Layout

# torch ≥ 2.13 renamed the flat collectives; older releases only have the old names
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)  # sent as their bytes (parallel/fp8.py)


class _CopyAfter:
    """A pending collective whose result ``src`` is copied into ``dst`` once it completes."""

    def __init__(self, work, src: torch.Tensor, dst: torch.Tensor):
        self.work, self.src, self.dst = work, src, dst

    def wait(self) -> None:
        self.work.wait()
        if self.dst.data_ptr() != self.src.data_ptr():
            self.dst.copy_(self.src)


class _AllOf:
    """Several pending operations waited for as one."""

    def __init__(self, works):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class HostClock:
    """Marks in host time: where the work runs on the host (CPU tensors, gloo), the time a rank is
    blocked is the time its host thread waits."""

    @staticmethod
    def mark() -> float:
        return time.perf_counter()

    @staticmethod
    def seconds(start: float, end: float) -> float:
        return end - start


class StreamClock:
    """Marks in a device stream's time: timing events recorded on the current stream, so the span
    between two marks is how long the compute stream stalled there (a ``wait()`` on NCCL returns at
    once on the host and makes the stream wait instead). Read lazily: :meth:`seconds` waits for the
    end mark, so CommStats resolves its spans only when read, never once per collective."""

    def __init__(self, event=None):
        """``event``: the event class (``torch.cuda.Event``, or one with the same methods)."""
        self.event = event or torch.cuda.Event

    def mark(self):
        mark = self.event(enable_timing=True)
        mark.record()  # on the current stream
        return mark

    @staticmethod
    def seconds(start, end) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1000.0  # milliseconds


def clock_for(device: torch.device | str) -> HostClock | StreamClock:
    """The clock that times blocking on ``device``: its stream's on CUDA, the host's elsewhere."""
    return StreamClock() if torch.device(device).type == "cuda" else HostClock()


@dataclass
class CommStats:
    """Per-collective call and byte counts (bytes = the tensor each rank contributes), and the
    seconds this rank was blocked on them (``exposed_s``): the whole of a synchronous collective,
    only the ``wait()`` of an asynchronous one — what overlapping communication with compute
    hides does not count. Blocked time is measured by ``clock`` (:func:`clock_for` the device:
    the compute stream's stall on CUDA, host time on CPU); its spans are resolved when read."""
    calls: dict = field(default_factory=lambda: defaultdict(int))
    bytes: dict = field(default_factory=lambda: defaultdict(int))
    clock: HostClock | StreamClock = field(default_factory=HostClock)
    # (kind, start mark, end mark) not yet resolved, and the seconds of those resolved
    _spans: list = field(default_factory=list, init=False, repr=False)
    _exposed: dict = field(default_factory=lambda: defaultdict(float), init=False, repr=False)

    def record(self, kind: str, tensor: torch.Tensor) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += tensor.numel() * tensor.element_size()

    def blocked(self, kind: str, start, end) -> None:
        """``kind`` blocked this rank from mark ``start`` to mark ``end`` (of ``clock``)."""
        self._spans.append((kind, start, end))

    @property
    def exposed(self) -> dict:
        """Seconds blocked, by collective (resolves the spans recorded since the last read)."""
        for kind, start, end in self._spans:
            self._exposed[kind] += self.clock.seconds(start, end)
        self._spans.clear()
        return self._exposed

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self._spans.clear()
        self._exposed.clear()

    def summary(self) -> dict:
        exposed = self.exposed
        return {k: {"calls": self.calls[k], "bytes": self.bytes[k], "exposed_s": exposed[k]}
                for k in sorted(self.calls)}


class _Timed:
    """An asynchronous collective's handle whose ``wait()`` counts as exposed time of ``kind``."""

    def __init__(self, work, stats: CommStats, kind: str):
        self.work, self.stats, self.kind = work, stats, kind

    def wait(self) -> None:
        start = self.stats.clock.mark()
        self.work.wait()
        self.stats.blocked(self.kind, start, self.stats.clock.mark())


class CommActivity:
    """The collective this rank entered last, for the hang watchdog's report."""

    def __init__(self):
        self._last: tuple | None = None  # (group, kind, elements, ranks): formatted only when read

    def enter(self, group: str, kind: str, tensor: torch.Tensor, ranks: list[int]) -> None:
        self._last = (group, kind, tensor.numel(), ranks)

    @property
    def last(self) -> str | None:
        if self._last is None:
            return None
        group, kind, numel, ranks = self._last
        return f"{group}.{kind} of {numel} elements with ranks {ranks}"


class Group:
    """A process group plus this rank's place in it; collectives are no-ops for one rank."""

    def __init__(self, name: str, ranks: list[int], pg=None, rank_in_group: int = 0,
                 stats: CommStats | None = None, activity: CommActivity | None = None):
        self.name = name
        self.ranks = ranks
        self.pg = pg
        self.size = len(ranks)
        self.rank = rank_in_group
        self.stats = stats
        self.activity = activity
        self._native_reduce_scatter: bool | None = None  # unknown until first tried

    def _record(self, kind: str, tensor: torch.Tensor) -> None:
        """Account a collective this rank enters (byte counts, the watchdog's last collective).
        Not inside a compiled layer: Dynamo cannot trace the side effect within autograd
        functions, and would break the graph at every tp collective."""
        if torch.compiler.is_compiling():
            return
        if self.stats is not None:
            self.stats.record(f"{self.name}.{kind}", tensor)
        if self.activity is not None:
            self.activity.enter(self.name, kind, tensor, self.ranks)

    @contextlib.contextmanager
    def _blocking(self, kind: str):
        """Around a synchronous collective: its whole time is exposed (CommStats.exposed)."""
        if self.stats is None or torch.compiler.is_compiling():
            yield
            return
        start = self.stats.clock.mark()
        yield
        self.stats.blocked(f"{self.name}.{kind}", start, self.stats.clock.mark())

    def _timed(self, work, kind: str):
        """An asynchronous collective's handle, its ``wait()`` counted as exposed time."""
        if work is None or self.stats is None or torch.compiler.is_compiling():
            return work
        return _Timed(work, self.stats, f"{self.name}.{kind}")

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place all-reduce; returns ``tensor``."""
        if self.size == 1:
            return tensor
        self._record("all_reduce", tensor)
        with self._blocking("all_reduce"):
            dist.all_reduce(tensor, op=op, group=self.pg)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim`` (in rank order)."""
        if self.size == 1:
            return tensor
        self._record("all_gather", tensor)
        tensor = tensor.contiguous()
        # gloo has no float8: send bytes
        wire = tensor.view(torch.uint8) if tensor.dtype in FLOAT8 else tensor
        parts = [torch.empty_like(wire) for _ in range(self.size)]
        with self._blocking("all_gather"):
            dist.all_gather(parts, wire, group=self.pg)
        return torch.cat(parts, dim=dim).view(tensor.dtype)

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """Slice ``i`` of ``tensor`` along dim 0 goes to rank ``i``; returns what every rank sent
        here, slice ``j`` from rank ``j`` (dim 0 must divide by the group's size)."""
        if self.size == 1:
            return tensor
        self._record("all_to_all", tensor)
        tensor = tensor.contiguous()
        out = torch.empty_like(tensor)
        with self._blocking("all_to_all"):
            dist.all_to_all_single(out, tensor, group=self.pg)
        return out

    def shift_async(self, sends: list[torch.Tensor], tag: int = 0,
                    into: list[torch.Tensor] | None = None):
        """Start sending each of ``sends`` to the next rank of the group (rank + 1, around) and
        receiving tensors of the same shapes from the previous one (into ``into``, or new
        buffers): one step of a ring. Returns (the receive buffers, a handle whose ``wait()``
        completes the step); the sends may not be modified until then. Both sides post their sends
        and receives in one batch, so two ranks that are each other's neighbours (a ring of 2)
        cannot deadlock."""
        nxt, prev = self.ranks[(self.rank + 1) % self.size], self.ranks[(self.rank - 1) % self.size]
        received = into if into is not None else [torch.empty_like(t) for t in sends]
        ops = []
        for i, (t, r) in enumerate(zip(sends, received)):
            self._record("send", t)
            ops.append(dist.P2POp(dist.isend, t.contiguous(), nxt, self.pg, tag + i))
            ops.append(dist.P2POp(dist.irecv, r, prev, self.pg, tag + i))
        works = dist.batch_isend_irecv(ops)
        return received, self._timed(_AllOf(works), "send")

    def reduce_scatter(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Sum over ranks, then keep this rank's 1/size slice along ``dim``."""
        if self.size == 1:
            return tensor
        # inside a compiled layer: a functional collective, traced
        if torch.compiler.is_compiling():
            return funcol.reduce_scatter_tensor(tensor.contiguous(), "sum", dim, self.pg)
        chunks = tensor.chunk(self.size, dim=dim)
        flat = torch.cat([c.reshape(-1) for c in chunks])  # the ranks' slices, one after another
        out = torch.empty_like(chunks[0], memory_format=torch.contiguous_format)
        work = self.reduce_scatter_async(out.view(-1), flat)
        if work is not None:
            work.wait()  # counted as exposed: the handle is timed
        return out

    # -- asynchronous flat collectives (data-parallel buckets); each returns a handle with
    # ``wait()``, or None when there is nothing to wait for ------------------------------------

    def all_reduce_async(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM):
        """Start an in-place all-reduce of ``tensor``."""
        if self.size == 1:
            return None
        self._record("all_reduce", tensor)
        return self._timed(dist.all_reduce(tensor, op=op, group=self.pg, async_op=True),
                           "all_reduce")

    def reduce_scatter_async(self, output: torch.Tensor, tensor: torch.Tensor):
        """Start summing flat ``tensor`` over ranks into ``output``, this rank's 1/size slice of it
        (``output`` may be that slice of ``tensor`` itself). ``tensor`` may be overwritten."""
        if self.size == 1:
            if output.data_ptr() != tensor.data_ptr():
                output.copy_(tensor)
            return None
        self._record("reduce_scatter", tensor)
        if self._native_reduce_scatter is not False:
            try:
                work = _reduce_scatter_single(output, tensor, group=self.pg, async_op=True)
                self._native_reduce_scatter = True
                return self._timed(work, "reduce_scatter")
            except (RuntimeError, NotImplementedError):
                # only gloo (older releases) lacks it; on NCCL a failure is real, and a rank that
                # switched to all-reduce alone would wait forever for ranks that did not
                if self._native_reduce_scatter or dist.get_backend(self.pg) != "gloo":
                    raise
                self._native_reduce_scatter = False  # older gloo: all-reduce, keep our slice
        work = dist.all_reduce(tensor, group=self.pg, async_op=True)
        return self._timed(_CopyAfter(work, tensor.chunk(self.size)[self.rank], output),
                           "reduce_scatter")

    def all_gather_async(self, output: torch.Tensor, shard: torch.Tensor):
        """Start gathering every rank's flat ``shard`` into ``output`` (rank order); ``shard`` may
        be this rank's slice of ``output`` itself."""
        if self.size == 1:
            if output.data_ptr() != shard.data_ptr():
                output.copy_(shard)
            return None
        self._record("all_gather", shard)
        if shard.dtype in FLOAT8:  # gloo has no float8 types: the same bytes as uint8
            output, shard = output.view(torch.uint8), shard.view(torch.uint8)
        return self._timed(_all_gather_single(output, shard, group=self.pg, async_op=True),
                           "all_gather")

    def all_to_all_async(self, output: torch.Tensor, tensor: torch.Tensor, output_sizes: list[int],
                         input_sizes: list[int]):
        """Start sending flat ``tensor``'s ``input_sizes[r]`` elements (in rank order) to rank r
        and receiving ``output_sizes[r]`` from rank r into flat ``output`` (in rank order)."""
        if self.size == 1:
            output.copy_(tensor)
            return None
        self._record("all_to_all", tensor)
        return self._timed(dist.all_to_all_single(output, tensor, output_sizes, input_sizes,
                                                  group=self.pg, async_op=True), "all_to_all")

    def barrier(self) -> None:
        """Wait until every rank of the group got here."""
        if self.size > 1:
            dist.barrier(group=self.pg)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """In place: every rank's ``tensor`` becomes group rank ``src``'s; returns ``tensor``."""
        if self.size > 1:
            dist.broadcast(tensor, self.ranks[src], group=self.pg)
        return tensor

    def split(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's 1/size slice of ``tensor`` along ``dim`` (no communication)."""
        if self.size == 1:
            return tensor
        return tensor.chunk(self.size, dim=dim)[self.rank].contiguous()

    def __repr__(self) -> str:
        return f"Group({self.name}, rank {self.rank}/{self.size}, ranks={self.ranks})"


def grid_groups(grid: np.ndarray) -> dict[str, list[np.ndarray]]:
    """The rank lists of every group of a (pp, dp, cp, tp) ``grid``, by group, in creation order:
    tp, cp, dp, pp, dp_cp (only when cp > 1), mp (pp × tp: cp and dp left out) and embedding (the
    first and last stage)."""
    pp, dp, cp, tp = grid.shape
    P, D, C, T = range(pp), range(dp), range(cp), range(tp)
    groups = {"tp": [grid[i, j, c, :] for i in P for j in D for c in C],
              "cp": [grid[i, j, :, k] for i in P for j in D for k in T],
              "dp": [grid[i, :, c, k] for i in P for c in C for k in T],
              "pp": [grid[:, j, c, k] for j in D for c in C for k in T]}
    if cp > 1:  # the ranks holding the same parameters: dp-major, cp-minor
        groups["dp_cp"] = [grid[i, :, :, k].ravel() for i in P for k in T]
    groups["mp"] = [grid[:, j, c, :].ravel() for j in D for c in C]
    groups["embedding"] = [np.unique([grid[0, j, c, k], grid[-1, j, c, k]]) for j in D for c in C
                           for k in T]
    return groups


def shard_groups(grid: np.ndarray, n: int) -> dict[str, list[np.ndarray]]:
    """Hybrid sharding's groups: ``dp_shard``, runs of ``n`` consecutive ranks of each dp_cp group,
    and ``dp_replicas``, the ranks at the same place in every run."""
    pp, _, _, tp = grid.shape
    replicas = grid.transpose(0, 3, 1, 2).reshape(pp, tp, -1)  # [i, k]: the dp_cp group's ranks
    P, T, runs = range(pp), range(tp), replicas.shape[-1] // n
    return {"dp_shard": [replicas[i, k, s * n:(s + 1) * n] for i in P for k in T
                         for s in range(runs)],
            "dp_replicas": [replicas[i, k, w::n] for i in P for k in T for w in range(n)]}


CHECKPOINT_TIMEOUT_S = 3600.0  # config.CheckpointConfig.timeout_s's default


def side_group(name: str, world_size: int, rank: int, timeout_s: float) -> Group:
    """A group of the whole world on gloo with its own ``timeout_s``, for agreement that waits on
    something slower than a collective (the file system a checkpoint is written to): a slow save
    then trips neither the training group's timeout nor, on NCCL, its watchdog, and its tensors
    stay on the host (reading them is no device sync). Collective: every rank creates it, in the
    same order as the other groups. Under the simulator's ``fake`` process group it is fake too
    (its collectives complete at once, as every other)."""
    ranks = list(range(world_size))
    pg = None
    if world_size > 1:
        backend = "fake" if dist.get_backend() == "fake" else "gloo"
        pg = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s), backend=backend)
    return Group(name, ranks, pg, rank)


class ParallelState:
    """The tp / cp / dp / pp groups of this rank, the model-parallel group, the embedding group, and
    ``checkpoint``: the whole world on gloo with a timeout of its own (:func:`side_group`), which
    checkpoint saves and loads agree on.

    Parameters are replicated over cp as over dp, so gradients are reduced (and ZeRO shards the
    optimizer) over ``dp_cp``, the dp × cp ranks holding the same parameters: the ``dp`` Group
    itself when cp = 1. The model-parallel group ``mp`` (pp × tp) leaves cp out, so that a sum over
    it (the grad norm) counts each parameter once.

    With ``zero_shard_size`` N (hybrid sharding), dp_cp is also cut into ``dp_shard`` groups of N
    consecutive dp_cp ranks (a node's, given tp-fastest ranks), which shard the optimizer state, and
    ``dp_replicas`` groups of the ranks holding the same shard in every one of them."""

    def __init__(self, tp: int = 1, pp: int = 1, *, cp: int = 1, device: torch.device | str = "cpu",
                 comm_stats: bool = False, zero_shard_size: int | None = None,
                 checkpoint_timeout_s: float = CHECKPOINT_TIMEOUT_S):
        """The groups of tp × cp × pp (× the dp that the world size leaves) ranks, and the
        ``checkpoint`` group (:func:`side_group`, ``checkpoint_timeout_s``); :meth:`of` builds them
        from a resolved :class:`Layout`."""
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        if self.world_size % (tp * cp * pp):
            raise ConfigError(f"parallel.tp={tp} × parallel.cp={cp} × parallel.pp={pp} must divide "
                              f"the world size {self.world_size}")
        dp = self.world_size // (tp * cp * pp)
        n = zero_shard_size or dp * cp
        if (dp * cp) % n:
            raise ConfigError(f"parallel.zero_shard_size={n} must divide dp × cp = {dp * cp}")
        self.layout = Layout(tp=tp, pp=pp, dp=dp, cp=cp, shard=n if n < dp * cp else None)
        self.device = torch.device(device)
        self.stats = CommStats(clock=clock_for(device)) if comm_stats else None
        self.activity = CommActivity()
        grid = self.layout.grid()
        self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank = self.layout.coords(self.rank)
        self._make_groups(grid)
        self._make_shards(grid, zero_shard_size)
        self.checkpoint = side_group("checkpoint", self.world_size, self.rank, checkpoint_timeout_s)

    @classmethod
    def of(cls, layout: Layout, *, device: torch.device | str = "cpu", comm_stats: bool = False,
           checkpoint_timeout_s: float = CHECKPOINT_TIMEOUT_S) -> ParallelState:
        """The groups of ``layout`` (which must span the world); ``self.layout`` is then that
        layout."""
        ps = cls(layout.tp, layout.pp, cp=layout.cp, device=device, comm_stats=comm_stats,
                 zero_shard_size=layout.shard, checkpoint_timeout_s=checkpoint_timeout_s)
        if ps.world_size != layout.world_size:
            raise ConfigError(f"the layout {layout.describe()} needs {layout.world_size} ranks, "
                              f"the world has {ps.world_size}")
        ps.layout = layout
        return ps

    def _make_groups(self, grid: np.ndarray) -> None:
        """Every group of the grid; every rank must create every group, in the same order
        (torch.distributed's rule)."""
        for name, rank_lists in grid_groups(grid).items():
            setattr(self, name, self._make(name, rank_lists))
        if grid.shape[2] == 1:
            self.dp_cp = self.dp  # cp = 1: the same ranks, the same Group

    def _make_shards(self, grid: np.ndarray, zero_shard_size: int | None) -> None:
        """``dp_shard`` and ``dp_replicas``: hybrid sharding's subdivision of dp_cp."""
        size = grid.shape[1] * grid.shape[2]
        n = zero_shard_size or size
        if n == size:  # plain sharding over all of dp_cp
            self.dp_shard, self.dp_replicas = self.dp_cp, Group("dp_replicas", [self.rank])
            return
        for name, rank_lists in shard_groups(grid, n).items():
            setattr(self, name, self._make(name, rank_lists))

    def _make(self, name: str, rank_lists: list) -> Group:
        mine = None
        for ranks in rank_lists:
            ranks = [int(r) for r in ranks]
            # a one-rank group never communicates: no process group (every rank skips the same).
            # Local synchronization: only the members meet in the store (not the whole world, for
            # each group); the others return at once. Its group names count the groups a rank has
            # made, so the members of a group must have made the same ones before it: every kind
            # but the embedding partitions the world, and the groups after it lie in one stage.
            pg = dist.new_group(ranks, use_local_synchronization=True) \
                if self.world_size > 1 and len(ranks) > 1 else None
            if self.rank in ranks:
                mine = Group(name, ranks, pg, ranks.index(self.rank), self.stats, self.activity)
        return mine

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp.size - 1

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp.size} "
                f"cp {self.cp_rank}/{self.cp.size} dp {self.dp_rank}/{self.dp.size} pp "
                f"{self.pp_rank}/{self.pp.size}")


def init_distributed(backend: str = "auto", device_type: str = "cpu",
                     timeout_s: float | None = None) -> None:
    """Join the process group torchrun describes through its environment (no-op for one process).
    ``timeout_s``: a collective that never completes fails after this long instead of hanging."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # bound to its GPU: the communicators are made here, not lazily inside the first step
        kwargs["device_id"] = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, **kwargs, **_restart_store())


def _restart_store() -> dict:
    """Under torchrun, the store of this attempt: torchrun keeps one store for the whole job and
    restarts the processes in it, so a restarted rank would read the keys of the attempt before
    (the dead ranks' addresses, the barrier counts) as its own — gloo connects to a process that
    is gone, or waits forever. A prefix per attempt keeps the attempts apart: the rendezvous round
    megapretrain.launcher gives the workers (the same on every node), else torchrun's restart count
    (which counts only the restarts of the node whose worker failed: right on one node only).
    Elsewhere: none (init_process_group's own env:// rendezvous)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    world_size = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False)
    if os.environ.get(ROUND_ENV):
        attempt = f"round_{os.environ[ROUND_ENV]}"
    else:
        attempt = f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return {"store": dist.PrefixStore(f"megapretrain/{attempt}", store),
            "rank": int(os.environ["RANK"]), "world_size": world_size}
