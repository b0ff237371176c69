"""Every collective and point-to-point op one rank issues in a training step, by group: the
planner's traffic model, in bytes and calls.

A count follows the program's own rules, so the bytes equal what ``tools/simulate.py`` counts
from the calls the trainer issues (``ParallelState.stats``; ``tests/test_simulate_planner.py``
holds them equal): an all-reduce, all-gather or send counts the tensor the rank gives, a
reduce-scatter its whole input, a receive the tensor it gets.

- tensor parallelism, per micro-batch and layer (``parallel/tensor.py``): with sequence
  parallelism two all-gathers of the rank's 1/tp of the tokens and two reduce-scatters of all of
  them forward, the reverse backward plus the two saved inputs gathered again for the weight
  gradients (not under full recomputation, which saves the gathered inputs themselves and runs
  the forward's collectives again); without it two all-reduces each way. The embedding, the
  output layer and its loss statistics (three all-reduces per chunk of tokens), and the norm
  weights' partial gradients (summed over tp as their bucket's reduction starts) add theirs;
- context parallelism: one all-gather of a layer's keys and values forward (again when fully
  recomputed), one reduce-scatter of their gradients backward (``parallel/context.py``);
- pipeline parallelism: each micro-batch chunk's activation received and sent forward, its
  gradient backward, unless the chunk embeds or holds the head or its neighbour chunk is on the
  same stage (ZB-V's turn); a zero-bubble schedule's W ops move nothing; the loss summed over the
  stages;
- data parallelism (``parallel/data.py``): the gradient buckets, cut as the buffers cut them —
  all-reduced (zero 0), reduce-scattered once (zero 1) or after every micro-batch (zero 2, 3;
  a bucket spanning two model chunks once per chunk), the shards all-reduced over the replicas
  with hybrid sharding, the parameters all-gathered after the step (zero 1, 2) or around each use
  (zero 3: twice per micro-batch and layer, the roots once per step; ``parallel/zero3.py``); the
  grad norm's and the loss's scalars;
- Muon (``optim/muon.py``): per group of the buckets holding decoder matrices, the shard's pieces
  of the updates sent to their owners and the owned matrices' results sent back, one all-to-all
  each way over the shard group (zero ≥ 1), and each matrix the rank owns (every one under zero 0)
  gathered whole over tp, all in the iteration's dtype (``optim.muon_ns_precision``).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from ..kernels.linear_cross_entropy import default_chunk_rows
from ..model.args import ModelArgs
from ..model.build import stage_parameters
from ..optim.muon import ExchangePlan, assign_owners, exchange_groups, is_muon_matrix
from ..parallel.data import bucket_split
from ..parallel.layout import Layout
from ..parallel.pipeline import Schedule, resolve_schedule
from .memory import chunk_layer_counts, chunk_placement, weight_bytes
from .optimizer import muon_wire_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Traffic:
    """Bytes and calls by group and op ({"tp": {"all_gather": ...}})."""

    def __init__(self):
        self.bytes: dict = defaultdict(lambda: defaultdict(int))
        self.calls: dict = defaultdict(lambda: defaultdict(int))

    def add(self, group: str, op: str, nbytes: float, calls: int = 1) -> None:
        if calls:
            self.bytes[group][op] += int(nbytes) * calls
            self.calls[group][op] += calls

    def as_dicts(self) -> tuple[dict, dict]:
        return ({g: dict(ops) for g, ops in self.bytes.items()},
                {g: dict(ops) for g, ops in self.calls.items()})


def group_names(layout: Layout) -> dict:
    """The names ``ParallelState`` gives the groups a layout's ranks reduce over."""
    dp_cp = "dp" if layout.cp == 1 else "dp_cp"
    return {"dp_cp": dp_cp, "shard": "dp_shard" if layout.shard else dp_cp}


def stage_traffic(model: ModelArgs, seq: int, layout: Layout, pp_rank: int, micro_batches: int, *,
                  precision: str = "bf16", schedule: str = "auto", device: str = "cuda",
                  bucket_mb: float = 32.0, keep_gathered: bool = False, optimizer: str = "adamw",
                  shard_rank: int = 0, ns_precision: str = "bf16") -> Traffic:
    """A rank of stage ``pp_rank``: ``micro_batches`` per step and dp rank; ``device``: the
    program's (its loss chunks); ``optimizer`` muon: its collectives too, ``shard_rank`` the
    rank's place in the ZeRO shard group (which matrices it owns), in ``ns_precision``."""
    out = Traffic()
    L, micro = layout, micro_batches
    kind = resolve_schedule(schedule, L.pp, L.vpp, micro, default=L.pp_schedule)
    by_chunk = stage_parameters(model, layout, pp_rank, DTYPES[precision])
    chunks = chunk_layer_counts(model, layout, pp_rank, kind)
    _tensor_parallel(out, model, seq, layout, pp_rank, chunks, micro, precision, device, kind)
    _context_parallel(out, model, seq, layout, chunks, micro_batches, precision)
    _pipeline(out, model, seq, layout, pp_rank, micro_batches, precision, kind)
    _data_parallel(out, layout, by_chunk, micro_batches, precision, bucket_mb, keep_gathered,
                   optimizer == "muon", shard_rank, muon_wire_bytes(ns_precision))
    return out


def _tensor_parallel(out: Traffic, model: ModelArgs, seq: int, L: Layout, pp_rank: int,
                     chunks: list[int], micro: int, precision: str, device: str,
                     schedule: Schedule) -> None:
    if L.tp == 1:
        return
    place = chunk_placement(L, schedule)
    w, h = weight_bytes(precision), model.hidden_size
    tokens = L.micro_batch * seq // L.cp
    full, shard = tokens * h * w, tokens * h * w // L.tp
    layers = sum(chunks) * micro
    full_recompute = L.recompute == "full"
    # a full recomputation stops once it has remade what the backward needs
    # (torch.utils.checkpoint's early stop): not the MLP's output, so the MLP's reduce-scatter (or
    # all-reduce) is not run again
    if L.sequence_parallel:
        # forward 2, backward 2, then the 2 inputs gathered again (redone, or for the weight grads)
        gathers = 6
        scatters = 2 + 2 + (1 if full_recompute else 0)
        out.add("tp", "all_gather", shard, gathers * layers)
        out.add("tp", "reduce_scatter", full, scatters * layers)
    else:
        out.add("tp", "all_reduce", full, (4 + (1 if full_recompute else 0)) * layers)
    # the embedding: partial rows summed forward (its backward is a gather under SP)
    if place.stage_of(0) == pp_rank:
        if L.sequence_parallel:
            out.add("tp", "reduce_scatter", full, micro)
            out.add("tp", "all_gather", shard, micro)
        else:
            out.add("tp", "all_reduce", full, micro)
    # the output layer's input: gathered (and again for its
    if place.stage_of(place.chunks - 1) == pp_rank:
        # backward), or its grad summed
        if L.sequence_parallel:
            out.add("tp", "all_gather", shard, 2 * micro)
            out.add("tp", "reduce_scatter", full, micro)
        else:
            out.add("tp", "all_reduce", full, micro)
        vocab = model.padded_vocab(L.tp) // L.tp
        rows = default_chunk_rows(tokens, vocab, DTYPES[precision], torch.device(device))
        # the loss statistics of each chunk: max, sum of exp, target
        for start in range(0, tokens, rows):
            out.add("tp", "all_reduce", 4 * min(rows, tokens - start), 3 * micro)


def _context_parallel(out: Traffic, model: ModelArgs, seq: int, L: Layout, chunks: list[int],
                      micro: int, precision: str) -> None:
    if L.cp == 1:
        return
    kv = L.micro_batch * 2 * model.num_kv_heads // L.tp * seq * model.head_dim * weight_bytes(
        precision)
    layers = sum(chunks) * micro
    out.add("cp", "all_gather", kv // L.cp, layers * (2 if L.recompute == "full" else 1))
    out.add("cp", "reduce_scatter", kv, layers)


def _pipeline(out: Traffic, model: ModelArgs, seq: int, L: Layout, pp_rank: int, micro: int,
              precision: str, schedule: Schedule) -> None:
    if L.pp == 1:
        return
    tokens = L.micro_batch * seq // L.cp // (L.tp if L.sequence_parallel else 1)
    act = tokens * model.hidden_size * weight_bytes(precision)
    place = chunk_placement(L, schedule)
    last = place.chunks - 1

    # global chunk g exists and sits on another stage (V's turn stays here)
    def remote(g: int) -> bool:
        return 0 <= g <= last and place.stage_of(g) != pp_rank
    for op in schedule.order(pp_rank, L.pp, L.vpp, micro):
        if op.kind == "W":  # weight gradients: nothing moves
            continue
        g = place.global_chunk(pp_rank, op.chunk)
        takes, gives = (remote(g - 1), remote(g + 1)) if op.kind == "F" \
            else (remote(g + 1), remote(g - 1))
        out.add("pp", "recv", act, int(takes))
        out.add("pp", "send", act, int(gives))
    out.add("pp", "all_reduce", 4)  # the step's loss, held by the last stage


def _data_parallel(out: Traffic, L: Layout, by_chunk: list, micro: int, precision: str,
                   bucket_mb: float, keep_gathered: bool, muon: bool = False,
                   shard_rank: int = 0, muon_wire: int = 2) -> None:
    names, w = group_names(L), weight_bytes(precision)
    replicated = L.dp * L.cp  # ranks holding the same parameters
    n = L.shard or replicated  # buckets are padded for this many shards, whatever the ZeRO stage
    bucket_numel = bucket_mb * 2**20 / 4 if bucket_mb > 0 and L.zero < 3 else float("inf")
    params = [ps for chunk in by_chunk for ps in chunk]
    # as the buffers cut them
    buckets = bucket_split(list(reversed(params)), bucket_numel, n, by_unit=L.zero == 3)
    chunk_of = {id(p): c for c, chunk in enumerate(by_chunk) for p, _ in chunk}
    spec_of = {id(p): s for p, s in params}
    reduce = "all_reduce" if L.zero == 0 else "reduce_scatter"
    group = names["dp_cp"] if L.zero == 0 else names["shard"]
    size = replicated if L.zero == 0 else n
    for bucket, _, numel in buckets:
        # reductions of this bucket per step: once (zero 0, 1), per micro-batch (2, 3), and under
        # zero 2 a bucket spanning two chunks once per chunk in all but the last micro-batch
        spans = len({chunk_of[id(p)] for p in bucket})
        launches = 1 if L.zero < 2 else micro + (spans - 1) * (micro - 1) * (L.zero == 2)
        if size > 1:
            out.add(group, reduce, numel * 4, launches)
        if L.zero and L.shard and replicated > n:
            out.add("dp_replicas", "all_reduce", numel // n * 4, launches)
        for p in bucket:  # grads of the sequence-parallel norms: partial sums over tp
            if spec_of[id(p)].partial_grad_over_tp and L.tp > 1:
                out.add("tp", "all_reduce", p.numel() * 4, launches)
        if spec_of[id(bucket[0])].tied and L.pp > 1:
            out.add("embedding", "all_reduce", numel // (n if L.zero else 1) * 4)
        if L.zero in (1, 2) and n > 1:
            out.add(names["shard"], "all_gather", numel // n * w)
        if L.zero == 3 and n > 1:
            out.add(names["shard"], "all_gather", numel // n * w,
                    _zero3_gathers(bucket, spec_of, L, micro, keep_gathered))
    if muon:
        _muon(out, L, buckets, spec_of, names["shard"], n, shard_rank, muon_wire)
    if L.zero and n > 1:
        out.add(names["shard"], "all_reduce", 4)  # the grad norm's sum of squares
    if L.pp * L.tp > 1:
        out.add("mp", "all_reduce", 4)
    if replicated > 1:
        out.add(names["dp_cp"], "all_reduce", 4)  # the step's loss


def _muon(out: Traffic, L: Layout, buckets: list, spec_of: dict, shard_group: str, n: int,
          shard_rank: int, wire: int) -> None:
    """Muon's step (``optim/muon.py``): zero ≥ 1, per group of the buckets holding decoder
    matrices (``exchange_groups``), one all-to-all sending the pieces of the rank's shard to their
    matrices' owners and one sending the results of the matrices it owns back; each matrix the
    rank owns (every one, unsharded) gathered whole over tp; ``wire`` bytes an element."""
    sharded = L.zero >= 1 and n > 1
    layout = [(numel, [(off, p.numel(), spec_of[id(p)]) for p, off in zip(bucket, offsets)
                       if is_muon_matrix(spec_of[id(p)])]) for bucket, offsets, numel in buckets]
    layout = [(numel, matrices) for numel, matrices in layout if matrices]
    sizes = {s.name: math.prod(s.shape) for _, matrices in layout for _, _, s in matrices}
    owner = assign_owners(sizes, n) if sharded else {}
    for group in exchange_groups([sum(k for _, k, _ in m) for _, m in layout]) if sharded else []:
        # out: the shard's pieces to their owners; back: the owned matrices' pieces to theirs
        plan = ExchangePlan(layout, group, owner, n, shard_rank)
        for way in (plan.out, plan.into):
            out.add(shard_group, "all_to_all", sum(hi - lo for p in way for _, lo, hi in p) * wire)
    for _, matrices in layout:
        for _, k, s in matrices:
            if L.tp > 1 and s.tp_dim is not None and owner.get(s.name, shard_rank) == shard_rank:
                out.add("tp", "all_gather", k * wire)


def _zero3_gathers(bucket: list, spec_of: dict, L: Layout, micro: int, keep_gathered: bool) -> int:
    """Gathers of a ZeRO-3 unit per step: a chunk's root once; a layer for its forward and again for
    its backward, every micro-batch (once per step if kept gathered; the last layer of a model of
    one chunk without pipelining once per micro-batch: kept from its forward to its backward)."""
    layer = spec_of[id(bucket[0])].layer
    if layer is None or keep_gathered:
        return 1
    last_kept = L.vpp == 1 and L.pp == 1 and layer == max(s.layer for s in spec_of.values()
                                                          if s.layer is not None)
    return micro * (1 if last_kept else 2)

