"""Muon for the decoder layers' matrices, composed with tensor parallelism and ZeRO.

Muon (``optim.optimizer: muon``) updates every 2-D weight inside the decoder layers; AdamW the rest
(``optim/optimizer.py``). Per logical matrix W with gradient G, momentum μ and learning rate γ —
the same steps, in the same precision and order, as ``torch.optim.Muon``::

    B ← B + (1 − μ)(G − B)                    (B.lerp_(G, 1 − μ))
    U ← G + μ(B − G) if nesterov else B       (G.lerp(B, μ))
    O ← NS_k(U)                               k quintic Newton–Schulz steps in bf16 (or fp32)
    W ← W · (1 − γλ) − γ · adjust(shape) · O

A fused weight is orthogonalized per logical matrix (its spec's ``row_parts``: GPT-NeoX's QKV,
rows grouped per kv head, gives q, k and v), as separate linears would be.

Momentum and U are elementwise, so each rank computes them on its own fragments (its ZeRO shard:
flat ranges that may cut a matrix anywhere). Only NS needs whole matrices, and only on one rank:

1. each matrix has an *owner* among the ``dp_shard`` ranks: assigned greedily by size, largest
   first, to the least loaded rank (zero 0: every rank holds every gradient and computes every
   matrix, as a replicated optimizer would, and nothing below is sent);
2. the buckets holding Muon matrices are cut into at most ``EXCHANGE_GROUPS`` runs
   (:func:`exchange_groups`); per run, one all-to-all over ``dp_shard`` sends each piece of a
   rank's shard to its matrix's owner, in the iteration's dtype (NS casts to it first: the same
   bits, half the bytes in bf16). Every run's all-to-all is started before any is waited for. A
   rank sends its shard and receives the matrices it owns: about 1/dp of what all-gathering
   every update on every rank would move;
3. run by run, as its all-to-all completes, each owner assembles its matrices whole and
   orthogonalizes them (under tp the owner's tp group all-gathers the matrix's column or row
   shards and each of its tp ranks runs NS on the whole matrix and keeps its own shard), then
   starts the run's second all-to-all, which sends each piece of O back to the rank whose shard
   holds it, while the next run computes; once every return has completed, the update applies
   elementwise.

So the all-to-alls to the owners run under the first runs' iterations and the returns under the
later ones'; each rank waits only for what its iterations did not hide (``planner/optimizer.py``'s
``muon_step_seconds`` replays this order). What a rank holds meanwhile is its shards' U and O and
the matrices it owns, in the iteration's dtype — after the backward has freed its activations.

A step whose grad norm is not finite changes nothing (masked where the state lives, as AdamW's).

Under ``optim.offload`` the momentum lives with the fp32 masters in host memory, where the
elementwise work runs (momentum, U, and the update); each bucket's U shard is copied to the device
for steps 2–3 (the collectives and NS, where the matrices are) and O copied back: the same
operations on the same values, so on CPU the numbers are those without offload, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..parallel.specs import ParamSpec

# torch.optim.Muon's (Keller Jordan's) quintic coefficients and epsilon
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def is_muon_matrix(spec: ParamSpec) -> bool:
    """Whether Muon updates this parameter: a 2-D weight inside a decoder layer."""
    return spec.layer is not None and len(spec.shape) == 2


def newton_schulz(u: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The orthogonalized ``u`` (2-D), in ``dtype``: ``steps`` quintic Newton–Schulz iterations on
    the wide orientation, after dividing by the Frobenius norm — torch.optim.Muon's operations in
    its order, so in bf16 the result is the same bit for bit. (The iteration maps small singular
    values up steeply — slope a⁵ ≈ 480 at 0 — so in bf16 an input differing in its last fp32 bit
    can round differently and move the output by far more than a bf16 ulp.)"""
    a, b, c = NS_COEFFICIENTS
    x = u.to(dtype, copy=True)  # (fp32: not the caller's tensor, which the iteration would change)
    tall = u.size(0) > u.size(1)
    if tall:
        x = x.T  # (cols, rows): the Gram matrix is the smaller side
    x.div_(x.norm().clamp(min=NS_EPS))  # spectral norm ≤ Frobenius norm ≤ 1
    for _ in range(steps):
        gram = x @ x.T  # (r, r)
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b·A + c·A²
        x = torch.addmm(x, poly, x, beta=a)  # a·X + (b·A + c·A²)·X
    return x.T if tall else x


def adjusted_lr(lr: float, mode: str, shape: tuple[int, ...]) -> float:
    """The learning rate of a (rows, cols) matrix, torch.optim.Muon's ``adjust_lr_fn``: original
    scales by sqrt(max(1, rows/cols)), match_rms_adamw by 0.2·sqrt(max(rows, cols))."""
    rows, cols = shape[:2]
    if mode == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1, rows / cols))


def logical_parts(matrix: torch.Tensor, row_parts: tuple[int, ...] | None) -> list[torch.Tensor]:
    """The logical matrices of a (global) weight: itself, or for a fused one (``row_parts``: the
    rows of each part within every repeating group of rows) each part's rows of every group, in
    group order (copies)."""
    if row_parts is None:
        return [matrix]
    group = sum(row_parts)
    grouped = matrix.view(matrix.shape[0] // group, group, matrix.shape[1])  # (groups, group, cols)
    return [p.reshape(-1, matrix.shape[1]) for p in grouped.split(list(row_parts), dim=1)]


def join_parts(parts: list[torch.Tensor], row_parts: tuple[int, ...] | None) -> torch.Tensor:
    """The inverse of :func:`logical_parts`: the fused weight of its parts."""
    if row_parts is None:
        return parts[0]
    groups = parts[0].shape[0] // row_parts[0]
    return torch.cat([p.view(groups, -1, p.shape[1]) for p in parts], dim=1).view(
        -1, parts[0].shape[1])


def part_runs(spec: ParamSpec, start: int, end: int) -> list[tuple[int, int, tuple[int, int]]]:
    """Elements ``[start, end)`` of the flattened tp shard of ``spec``'s weight as runs of one
    logical matrix each: (lo, hi, that matrix's global shape), ``lo``/``hi`` from ``start``. A
    tp shard holds whole row groups, so a local row's part is its place in its group."""
    if spec.row_parts is None:
        return [(0, end - start, spec.shape)]
    cols, group = spec.local_shape[1], sum(spec.row_parts)
    groups = spec.shape[0] // group
    bounds, row = [], 0  # (first local row of a run, its part) over one group
    for i, rows in enumerate(spec.row_parts):
        bounds.append((row, i))
        row += rows
    runs = []
    for g in range(spec.local_shape[0] // group):
        for j, (first, part) in enumerate(bounds):
            last = bounds[j + 1][0] if j + 1 < len(bounds) else group
            lo, hi = max((g * group + first) * cols, start), min((g * group + last) * cols, end)
            if lo < hi:
                runs.append((lo - start, hi - start, (spec.row_parts[part] * groups, cols)))
    return runs


@dataclass(frozen=True)
class MuonSettings:
    """Muon's fields of ``optim.*``, resolved (null learning rate and decay: AdamW's)."""
    lr_ratio: float      # optim.muon_lr / optim.lr: the schedule's rate times this
    momentum: float
    nesterov: bool
    ns_steps: int
    ns_dtype: torch.dtype
    adjust_lr: str
    weight_decay: float

    @classmethod
    def of(cls, o) -> MuonSettings:
        muon_lr = o.lr if o.muon_lr is None else o.muon_lr
        wd = o.weight_decay if o.muon_weight_decay is None else o.muon_weight_decay
        ns_dtype = torch.float32 if o.muon_ns_precision == "fp32" else torch.bfloat16
        return cls(muon_lr / o.lr, o.muon_momentum, o.muon_nesterov, o.muon_ns_steps, ns_dtype,
                   o.muon_adjust_lr, wd)


def assign_owners(sizes: dict[str, int], ranks: int) -> dict[str, int]:
    """Each matrix's owner among ``ranks``: largest first, to the least loaded rank so far (ties:
    the lowest rank) — the same answer on every rank."""
    load = [0] * ranks
    owners = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += sizes[name]
    return owners


EXCHANGE_GROUPS = 4  # all-to-alls each way per step: only the first's gather, last's return wait


def exchange_groups(sizes: list[int], groups: int = EXCHANGE_GROUPS) -> list[list[int]]:
    """The buckets (their Muon elements ``sizes``, in order) as at most ``groups`` runs of
    consecutive buckets, each closed once the runs so far hold their share of the total: one
    all-to-all each way per run, so that every owner has matrices in each."""
    total, runs, held = sum(sizes), [[]], 0
    for i, n in enumerate(sizes):
        if runs[-1] and held >= total * len(runs) / groups:
            runs.append([])
        runs[-1].append(i)
        held += n
    return runs


def shard_pieces(buckets: list, group: list[int], ranks: int, rank: int):
    """(bucket, matrix offset, elements, spec, lo, hi) for each Muon matrix of the buckets
    ``group`` (indices into ``buckets``: each (padded elements, [(offset, elements, spec)])) that
    the ZeRO shard of ``rank`` among ``ranks`` holds part of: elements ``[lo, hi)`` of its
    bucket."""
    for i in group:
        numel, matrices = buckets[i]
        first, last = rank * (numel // ranks), (rank + 1) * (numel // ranks)
        for off, n, spec in matrices:
            lo, hi = max(off, first), min(off + n, last)
            if lo < hi:
                yield i, off, n, spec, lo, hi


class ExchangePlan:
    """One group's two all-to-alls as seen by shard rank ``rank`` (of ``ranks``), worked out once:
    ``out[r]``, the (bucket, lo, hi) slices of this rank's shards that owner r's matrices hold (sent
    to r, and where r's results land); ``into[q]``, the (matrix, lo, hi) slices of the matrices
    this rank owns that rank q's shard holds (received from q, and sent back to it); ``owned``,
    those matrices ((bucket, offset): (elements, spec)). Slices in group order, so sender and
    receiver agree."""

    def __init__(self, buckets: list, group: list[int], owner: dict[str, int], ranks: int,
                 rank: int):
        self.out = [[] for _ in range(ranks)]
        for i, _, _, spec, lo, hi in shard_pieces(buckets, group, ranks, rank):
            first = rank * (buckets[i][0] // ranks)
            self.out[owner[spec.name]].append((i, lo - first, hi - first))
        self.into = [[((i, off), lo - off, hi - off)
                      for i, off, _, spec, lo, hi in shard_pieces(buckets, group, ranks, q)
                      if owner[spec.name] == rank] for q in range(ranks)]
        self.owned = {(i, off): (n, spec) for i in group for off, n, spec in buckets[i][1]
                      if owner[spec.name] == rank}


class MuonStep:
    """Muon's step over the Muon fragments of an optimizer's shards (``ShardState``s): momentum
    per fragment (fp32, the fragment's size), and the assembly of whole matrices for NS (module
    docstring). ``shards``' fragments that :func:`is_muon_matrix` picks are this step's.
    ``offload`` (``optim.offload``): momenta and masters are host memory; each bucket's U crosses
    to the device for NS and its collectives, and O back."""

    def __init__(self, shards, spec_of: dict[int, ParamSpec], settings: MuonSettings, ps,
                 zero: int, offload: bool = False):
        self.settings, self.ps, self.spec_of, self.offload = settings, ps, spec_of, offload
        self.sharded = zero >= 1 and ps.dp_shard.size > 1
        # per bucket holding a Muon matrix, whether or not this rank's shard holds part of it (its
        # collectives need every rank): (shard state, this rank's Muon fragments)
        self.work = [(s, [f for f in s.fragments if is_muon_matrix(f.spec)]) for s in shards
                     if any(is_muon_matrix(spec_of[id(p)]) for p in s.bucket.params)]
        # each fragment's momentum, held by its shard (checkpoints read it there)
        self.momentum = {name: t for s, _ in self.work for name, t in s.momentum.items()}
        # each bucket's padded elements and Muon matrices (offset in the bucket, elements, spec)
        self.layout = [(s.bucket.numel, [(off, shape.numel(), self.spec_of[id(p)])
                                         for p, shape, off in zip(s.bucket.params, s.bucket.shapes,
                                                                  s.bucket.offsets)
                                         if is_muon_matrix(self.spec_of[id(p)])])
                       for s, _ in self.work]
        # owners by the global matrix's size; every rank of dp_shard sees every matrix of its
        # buckets (a bucket's parameters are the same on every dp rank)
        sizes = {name: math.prod(spec.shape) for name, spec in self.matrices().items()}
        self.owner = assign_owners(sizes, ps.dp_shard.size) if self.sharded else {}
        self.groups = exchange_groups([sum(n for _, n, _ in m) for _, m in self.layout]) \
            if self.sharded else []
        self.plans = [ExchangePlan(self.layout, g, self.owner, ps.dp_shard.size, ps.dp_shard.rank)
                      for g in self.groups]

    def matrices(self) -> dict[str, ParamSpec]:
        """Every Muon matrix of this rank's buckets (whether or not its shard holds part of it)."""
        return {spec.name: spec for _, matrices in self.layout for _, _, spec in matrices}

    @torch.no_grad()
    def step(self, lr: float, found_inf: torch.Tensor) -> None:
        """One Muon step at the schedule's rate ``lr`` (AdamW's: scaled by ``lr_ratio``), skipped
        where ``found_inf`` (0-d bool) is set. Sharded, its collectives overlap its iterations:
        every group's gather to the owners is started first; each group's matrices are
        orthogonalized as its gather completes and the return of its results started at once; the
        updates apply once all have completed. Under ``optim.offload`` the momentum and the
        masters are host memory: the momentum and the update run there, NS and its collectives on
        the device."""
        if not self.work:
            return
        lr = lr * self.settings.lr_ratio
        skip = found_inf.to(self.work[0][0].master.device)  # (the host's copy when offloaded)
        # 1. momentum and the update to orthogonalize; sharded, every group's gather in flight
        if not self.sharded:  # each rank holds whole buckets: every matrix, orthogonalized here
            o = [self._orthogonalize_whole(i, self._momenta(s, frags, skip))
                 for i, (s, frags) in enumerate(self.work)]
        else:
            dtype = self.settings.ns_dtype  # NS casts to it first: the same bits, fewer bytes
            wire = [self._momenta(s, frags, skip).to(dtype) for s, frags in self.work]
            gathers = [self._start_gather(plan, wire) for plan in self.plans]
            # 2. whole (tp-local) matrices, orthogonalized by their owners group by group, each
            #    group's results on their way back while the next one computes
            returns = [self._orthogonalize_group(plan, *gathered)
                       for plan, gathered in zip(self.plans, gathers)]
            # 3. each rank's O for its fragments, once every return has completed
            o = [torch.zeros_like(t) for t in wire]
            for plan, returned in zip(self.plans, returns):
                self._place_returned(plan, *returned, o)
        for (s, frags), o_shard in zip(self.work, o):
            self._apply(s, frags, o_shard, lr, skip)

    def _momenta(self, s, frags: list, skip: torch.Tensor) -> torch.Tensor:
        """Each fragment's momentum, stepped (kept where ``skip``), and the update U it gives, in a
        shard-sized fp32 buffer (other elements 0) — on the device, where the matrices are
        assembled, under ``optim.offload``."""
        m = self.settings
        u_shard = torch.zeros_like(s.master)  # (shard,) fp32
        for f in frags:
            g, buf = f.of(s.grad), self.momentum[f.name]
            new = buf.lerp(g, 1 - m.momentum)
            f.of(u_shard).copy_(g.lerp(new, m.momentum) if m.nesterov else new)
            buf.copy_(torch.where(skip, buf, new))
        if self.offload:
            u_shard = u_shard.to(s.bucket.grad_shard.device, copy=True)
        return u_shard

    def _orthogonalize_whole(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """Unsharded: O of every Muon matrix of bucket ``i``, whose whole U is ``full``."""
        out = torch.zeros_like(full)
        for off, n, spec in self.layout[i][1]:
            o = self._orthogonalize(full[off:off + n].view(spec.local_shape), spec)
            out[off:off + n].copy_(o.reshape(-1))
        return out

    # -- sharded: each matrix's pieces to its owner and O's pieces back, one all-to-all each way
    #    per group of buckets ----------------------------------------------------------------------

    def _start_gather(self, plan: ExchangePlan, wire: list[torch.Tensor]):
        """Start sending each piece of the group's matrices that this rank's shard holds to the
        matrix's owner; returns (the receive buffer, the handle)."""
        sends = [[wire[i][lo:hi] for i, lo, hi in pieces] for pieces in plan.out]
        return self._exchange(sends, [sum(hi - lo for _, lo, hi in p) for p in plan.into], wire[0])

    def _exchange(self, sends: list[list[torch.Tensor]], recv: list[int], like: torch.Tensor):
        """Start an all-to-all over ``dp_shard``: ``sends[r]`` (pieces, concatenated) to rank r;
        ``recv[r]`` elements from rank r. Returns (the receive buffer, the handle)."""
        flat = [t for pieces in sends for t in pieces]
        send = torch.cat(flat) if flat else like.new_empty(0)
        out = like.new_empty(sum(recv))
        sizes = [sum(t.numel() for t in pieces) for pieces in sends]
        work = self.ps.dp_shard.all_to_all_async(out, send, recv, sizes)
        return out, work

    def _orthogonalize_group(self, plan: ExchangePlan, received: torch.Tensor, work):
        """Once ``received`` (rank by rank, the pieces of this rank's matrices) has come: each
        matrix this rank owns assembled whole, orthogonalized, and its pieces started back to the
        ranks whose shards hold them. Returns what :meth:`_exchange` does."""
        if work is not None:
            work.wait()
        whole = {key: received.new_empty(n) for key, (n, _) in plan.owned.items()}
        at = 0
        for pieces in plan.into:
            for key, lo, hi in pieces:
                whole[key][lo:hi].copy_(received[at:at + hi - lo])
                at += hi - lo
        done = {key: self._orthogonalize(whole[key].view(spec.local_shape), spec).reshape(-1)
                for key, (_, spec) in plan.owned.items()}
        sends = [[done[key][lo:hi] for key, lo, hi in pieces] for pieces in plan.into]
        return self._exchange(sends, [sum(hi - lo for _, lo, hi in p) for p in plan.out], received)

    def _place_returned(self, plan: ExchangePlan, received: torch.Tensor, work,
                        o: list[torch.Tensor]) -> None:
        """Once ``received`` (owner by owner, the pieces of this rank's shards) has come: each
        piece into its bucket's O shard."""
        if work is not None:
            work.wait()
        at = 0
        for pieces in plan.out:
            for i, lo, hi in pieces:
                o[i][lo:hi].copy_(received[at:at + hi - lo])
                at += hi - lo

    def _apply(self, s, frags: list, o_shard: torch.Tensor, lr: float, skip: torch.Tensor) -> None:
        """W ← W · (1 − γλ) − γ · adjust(shape) · O on each fragment's master (kept where
        ``skip``), ``o_shard`` O over the shard (copied to the host first when offloaded)."""
        m = self.settings
        if self.offload:
            o_shard = o_shard.to(s.master.device, copy=True)
        for f in frags:
            w, o = f.of(s.master), f.of(o_shard).float()  # (bf16 values: exact)
            new = w.mul(1 - lr * (m.weight_decay if f.spec.weight_decay else 0.0))
            for lo, hi, shape in part_runs(f.spec, f.start, f.end):
                new[lo:hi].add_(o[lo:hi], alpha=-adjusted_lr(lr, m.adjust_lr, shape))
            w.copy_(torch.where(skip, w, new))

    def _orthogonalize(self, local: torch.Tensor, spec: ParamSpec) -> torch.Tensor:
        """NS of each logical matrix of the parameter whose tp shard of U is ``local``; returns
        this rank's tp shard of O, in the iteration's dtype."""
        tp = self.ps.tp
        local = local.to(self.settings.ns_dtype)  # NS casts first: the same bits, fewer bytes
        whole = tp.all_gather(local, spec.tp_dim) if spec.tp_dim is not None else local
        parts = logical_parts(whole, spec.row_parts)
        ns = self.settings
        o = join_parts([newton_schulz(p, ns.ns_steps, ns.ns_dtype) for p in parts], spec.row_parts)
        return tp.split(o, spec.tp_dim) if spec.tp_dim is not None else o

