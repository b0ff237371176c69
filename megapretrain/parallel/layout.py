"""The parallel layout: how a run's ranks divide the work, as one value.

A :class:`Layout` holds every choice that decides what a rank computes and holds — tensor (tp),
context (cp), pipeline (pp, with vpp virtual chunks per stage and the layers of each chunk) and
data parallelism (dp, with the ZeRO stage and hybrid sharding's shard size), sequence parallelism,
activation recomputation and the micro-batch. It is built once from the config and the world size
(:meth:`Layout.from_config`, which checks every rule of its own), and it is what the trainer's
process groups, checkpoints, resharding, the planner and the OOM advice read: nothing else in the
code turns a config into a layout.

Ranks are laid out tp-fastest, then cp, then dp, then pp (tp neighbours share a node's links)::

    grid = arange(world).reshape(pp, dp, cp, tp)      rank r sits at grid[coords(r)]

This module is plain arithmetic (numpy, no torch), so tools and the planner use it freely.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ..errors import PipelineError, divisors, require

if TYPE_CHECKING:
    from ..config import Config

class Coords(NamedTuple):
    """A rank's place in the grid."""
    pp: int
    dp: int
    cp: int
    tp: int



@dataclass(frozen=True)
class Layout:
    """One parallel layout; ``tp × cp × pp × dp`` ranks. Frozen: a changed layout is a new value
    (``dataclasses.replace``), so the planner can search over them and compare them."""
    tp: int
    pp: int
    dp: int
    vpp: int = 1
    micro_batch: int = 1
    zero: int = 1
    recompute: str = "none"  # none | selective | full
    # layers per chunk (pp × vpp, chunk order); None: an even split
    pipeline_layers: tuple | None = None
    sp: bool = True  # sequence parallelism whenever tp > 1 (False: Megatron 2021's all-reduces)
    cp: int = 1  # context parallel: ranks that split each sequence
    shard: int | None = None  # hybrid sharding: ZeRO over groups of this many of the dp × cp ranks
    # how attention meets the other cp ranks' keys: allgather | ring | a2a
    cp_comm: str = "allgather"
    tp_comm_overlap: bool = False  # sequence-parallel collectives chunked under their GEMMs
    # the pipeline schedule asked for (parallel/pipeline.py resolves auto)
    pp_schedule: str = "auto"

    # -- built from a config ----------------------------------------------------------------------

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> Layout:
        """The layout ``cfg.parallel`` (and ``train.micro_batch_size``) asks for on ``world_size``
        ranks, after checking that it can run: sizes that divide, a ZeRO stage and shard size that
        fit dp, a pipeline split of ``model.num_layers``, sequence lengths that cp and sequence
        parallelism can cut. Raises :class:`ConfigError` with one line naming the fields."""
        p, m, t = cfg.parallel, cfg.model, cfg.train
        mp = p.tp * p.cp * p.pp
        named = (f"parallel.tp={p.tp} × " + (f"parallel.cp={p.cp} × " if p.cp > 1 else "")
                 + f"parallel.pp={p.pp}")
        require(world_size % mp == 0,
                f"{named} = {mp} must divide the world size {world_size} (launch {mp}·k processes "
                f"with torchrun, or pick tp×{'cp×' if p.cp > 1 else ''}pp from: "
                f"{divisors(world_size)})")
        dp = world_size // mp
        require(p.zero in (0, 1, 2, 3), f"parallel.zero={p.zero} must be 0, 1, 2 or 3")
        require(p.zero_shard_size is None or p.zero >= 1,
                f"parallel.zero_shard_size={p.zero_shard_size} shards the optimizer: it needs "
                "parallel.zero 1, 2 or 3")
        require(p.zero_shard_size is None or (dp * p.cp) % p.zero_shard_size == 0,
                f"parallel.zero_shard_size={p.zero_shard_size} must divide dp × cp = {dp * p.cp} "
                f"(valid: {divisors(dp * p.cp)})")
        shard = p.zero_shard_size if p.zero_shard_size and p.zero_shard_size < dp * p.cp else None
        layout = cls(tp=p.tp, pp=p.pp, dp=dp, vpp=p.vpp, micro_batch=t.micro_batch_size,
                     zero=p.zero, recompute=p.recompute,
                     pipeline_layers=tuple(p.pipeline_layers) if p.pipeline_layers else None,
                     sp=p.sequence_parallel, cp=p.cp, shard=shard, cp_comm=p.cp_comm,
                     tp_comm_overlap=p.tp_comm_overlap, pp_schedule=p.pp_schedule)
        require(not p.tp_comm_overlap or layout.sequence_parallel,
                "parallel.tp_comm_overlap overlaps the sequence-parallel all-gathers and "
                f"reduce-scatters with their GEMMs: it needs parallel.tp > 1 (is {p.tp}) and "
                f"parallel.sequence_parallel true (is {str(p.sequence_parallel).lower()}); set "
                "them, or parallel.tp_comm_overlap false")
        layout.check_pipeline_split(m.num_layers)
        layout.check_sequence(t.seq_length)
        return layout

    def check_pipeline_split(self, num_layers: int) -> None:
        """``num_layers`` split over the pp × vpp model chunks: evenly, or as ``pipeline_layers``
        lists."""
        chunks = self.chunks
        if self.pipeline_layers is None:
            require(num_layers % chunks == 0,
                    f"parallel.pp={self.pp} × parallel.vpp={self.vpp} = {chunks} must divide "
                    f"model.num_layers={num_layers} (valid pp×vpp: {divisors(num_layers)})")
        else:
            pl = list(self.pipeline_layers)
            require(all(isinstance(n, int) for n in pl)
                    and valid_chunk_split(pl, chunks, num_layers),
                    chunk_split_rule(pl, chunks, num_layers))

    def check_sequence(self, seq: int) -> None:
        """A sequence of ``seq`` tokens cut as the layout cuts it: over tp by sequence parallelism,
        and under cp into 2·cp equal chunks (each cp rank takes two: the causal load balance),
        each split again over tp when sequence-parallel."""
        require(not (self.sp and self.tp > 1 and seq % self.tp),
                f"parallel.sequence_parallel needs parallel.tp={self.tp} to divide "
                f"train.seq_length={seq}")
        if self.cp == 1:
            return
        unit = 2 * self.cp * (self.tp if self.sequence_parallel else 1)
        require(seq % unit == 0,
                f"train.seq_length={seq} must be a multiple of 2 × parallel.cp"
                + (" × parallel.tp" if self.sequence_parallel else "")
                + f" = {unit} (each cp rank takes 2 of {2 * self.cp} equal chunks"
                + (", split again over tp by sequence parallelism" if self.sequence_parallel
                   else "")
                + f"); e.g. train.seq_length={unit * max(1, round(seq / unit))}")

    # -- sizes ------------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def chunks(self) -> int:
        """Model chunks of the whole pipeline (pp × vpp)."""
        return self.pp * self.vpp

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1 and self.sp

    @property
    def shard_ranks(self) -> int:
        """Ranks the ZeRO state is sharded over (1 under zero 0)."""
        return 1 if self.zero == 0 else self.shard or self.dp * self.cp

    def replace(self, **change) -> Layout:
        return dataclasses.replace(self, **change)

    # -- the rank grid ----------------------------------------------------------------------------

    def grid(self) -> np.ndarray:
        """Every rank at its place: ``grid[pp, dp, cp, tp]``."""
        return np.arange(self.world_size).reshape(self.pp, self.dp, self.cp, self.tp)

    def coords(self, rank: int) -> Coords:
        """Where ``rank`` sits in the grid."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        rest, tp = divmod(rank, self.tp)
        rest, cp = divmod(rest, self.cp)
        pp, dp = divmod(rest, self.dp)
        return Coords(pp, dp, cp, tp)

    def all_coords(self) -> list[Coords]:
        """Every rank's coordinates, by rank."""
        return [self.coords(r) for r in range(self.world_size)]

    def chunk_layers(self, num_layers: int, pp_rank: int, v_shape: bool) -> list[list[int]]:
        """Global layer ids of each of stage ``pp_rank``'s ``vpp`` chunks (chunk ``v`` of stage
        ``i`` is global chunk ``v·pp + i``; under ZB-V ``i`` and ``2·pp − 1 − i``). ``v_shape``:
        the schedule places its chunks in a V (``parallel/pipeline.py``'s ``Schedule``: the
        layout holds only the schedule's name)."""
        uneven = list(self.pipeline_layers) if self.pipeline_layers else None
        return chunk_layers(num_layers, self.pp, self.vpp, pp_rank, uneven, v_shape=v_shape)

    def chunk_sizes(self, num_layers: int, pp_rank: int, v_shape: bool) -> tuple[int, ...]:
        """How many layers each of stage ``pp_rank``'s chunks holds, as :meth:`chunk_layers`
        places them (without listing them: the planner asks this for every layout it weighs)."""
        uneven = tuple(self.pipeline_layers) if self.pipeline_layers else None
        spans = _chunk_spans(num_layers, self.pp, self.vpp, pp_rank, uneven, v_shape)
        return tuple(count for _, count in spans)

    # -- as a checkpoint records it ----------------------------------------------------------------

    def meta(self, *, v_shape: bool) -> dict:
        """The layout as checkpoint metadata records it: what decides which tensors a rank file
        holds (tp, pp, dp, cp; ZeRO ranges are recorded beside it). Under pp, which layers a
        stage holds also depends on its chunks (vpp, their placement: interleaved, or ZB-V's V)
        and an uneven split: recorded where they differ from one even chunk per stage, so that a
        run placing its layers otherwise reshards instead of reading another stage's layers.
        ``v_shape``: the run's schedule places its chunks in a V (its ``Schedule.v_shape``)."""
        meta = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "cp": self.cp}
        if self.pp > 1 and self.vpp > 1:
            meta["vpp"] = self.vpp
            if v_shape:
                meta["placement"] = "v"
        if self.pp > 1 and self.pipeline_layers:
            meta["pipeline_layers"] = list(self.pipeline_layers)
        return meta

    @classmethod
    def from_meta(cls, meta: dict) -> Layout:
        """The layout a checkpoint's metadata records (cp 1 where absent: saved before cp
        existed)."""
        return cls(tp=int(meta["tp"]), pp=int(meta["pp"]), dp=int(meta["dp"]),
                   cp=int(meta.get("cp", 1)))

    # -- as text -----------------------------------------------------------------------------------

    def flags(self) -> str:
        """The command-line overrides that give this layout."""
        # always said: a config's own uneven split would not fit another pp × vpp
        uneven = (f" --parallel.pipeline_layers '[{', '.join(map(str, self.pipeline_layers))}]'"
                  if self.pipeline_layers else " --parallel.pipeline_layers null")
        return (f"--parallel.tp {self.tp} --parallel.cp {self.cp} --parallel.pp {self.pp} "
                f"--parallel.vpp {self.vpp}{uneven} "
                f"--parallel.sequence_parallel {str(self.sequence_parallel).lower()} "
                f"--parallel.zero {self.zero} "
                + (f"--parallel.zero_shard_size {self.shard} " if self.shard else "")
                + (f"--parallel.cp_comm {self.cp_comm} " if self.cp > 1 else "")
                + ("--parallel.tp_comm_overlap true " if self.tp_comm_overlap else "")
                + (f"--parallel.pp_schedule {self.pp_schedule} "
                   if self.pp_schedule != Layout.pp_schedule else "")  # said unless the default
                + f"--parallel.recompute {self.recompute} --train.micro_batch_size "
                  f"{self.micro_batch}")

    def describe(self) -> str:
        cp = f" cp={self.cp}" + (f":{self.cp_comm}" if self.cp_comm != "allgather" else "") \
            if self.cp > 1 else ""
        return f"world={self.world_size} (tp={self.tp}{cp} pp={self.pp} dp={self.dp})"


def chunk_layers(num_layers: int, pp: int, vpp: int, pp_rank: int,
                 layers_per_chunk: list[int] | None = None,
                 v_shape: bool = False) -> list[list[int]]:
    """Global layer ids of each of stage ``pp_rank``'s ``vpp`` chunks: global chunks ``v·pp +
    pp_rank``, or with ``v_shape`` (ZB-V's placement, vpp 2) ``pp_rank`` and ``2·pp − 1 − pp_rank``.

    Even split by default; ``layers_per_chunk`` (length pp·vpp, in global chunk order) lets the
    first and last chunks hold fewer layers to balance the embedding and output layer.
    """
    uneven = tuple(layers_per_chunk) if layers_per_chunk is not None else None
    spans = _chunk_spans(num_layers, pp, vpp, pp_rank, uneven, v_shape)
    return [list(range(start, start + count)) for start, count in spans]


@functools.cache
def _chunk_spans(num_layers: int, pp: int, vpp: int, pp_rank: int,
                 layers_per_chunk: tuple[int, ...] | None,
                 v_shape: bool) -> tuple[tuple[int, int], ...]:
    """(first layer, layer count) of each of stage ``pp_rank``'s chunks (see
    :func:`chunk_layers`)."""
    n_chunks = pp * vpp
    if layers_per_chunk is None:
        if num_layers % n_chunks:
            raise PipelineError(f"parallel.pp={pp} × parallel.vpp={vpp} = {n_chunks} must divide "
                                f"model.num_layers={num_layers}")
        layers_per_chunk = (num_layers // n_chunks,) * n_chunks
    if not valid_chunk_split(layers_per_chunk, n_chunks, num_layers):
        raise PipelineError(chunk_split_rule(layers_per_chunk, n_chunks, num_layers))
    starts = [sum(layers_per_chunk[:i]) for i in range(n_chunks)]
    mine = (pp_rank, 2 * pp - 1 - pp_rank) if v_shape else (v * pp + pp_rank for v in range(vpp))
    return tuple((starts[c], layers_per_chunk[c]) for c in mine)


def valid_chunk_split(layers_per_chunk, chunks: int, num_layers: int) -> bool:
    """Whether ``layers_per_chunk`` splits ``num_layers`` over ``chunks`` model chunks: a count
    per chunk, each at least one layer but the first and the last chunk's, which may hold none
    (the embedding alone, the output layer alone: Llama 3 405B's 126 layers over 128 chunks)."""
    counts = list(layers_per_chunk)
    return (len(counts) == chunks and sum(counts) == num_layers and min(counts) >= 0
            and all(n >= 1 for n in counts[1:-1]) and num_layers >= 1)


def chunk_split_rule(layers_per_chunk, chunks: int, num_layers: int) -> str:
    """The error line of a ``parallel.pipeline_layers`` that :func:`valid_chunk_split` refuses."""
    return (f"parallel.pipeline_layers={list(layers_per_chunk)} must list {chunks} layer counts "
            f"(pp × vpp) summing to model.num_layers={num_layers}, each at least 1 but the "
            "first and the last chunk's (0: the embedding or the output layer alone)")


def split_layers(layers: int, chunks: int) -> tuple | None:
    """Layers per pipeline chunk when ``chunks`` does not divide ``layers``: as even as possible,
    the first and last chunk (which also hold the embedding and the output layer) the lighter
    ones."""
    if layers % chunks == 0:
        return None
    base, extra = divmod(layers, chunks)
    # middle chunks take the extra layers first
    order = list(range(1, chunks - 1)) + [0, chunks - 1]
    counts = [base] * chunks
    for i in order[:extra]:
        counts[i] += 1
    return tuple(counts)
