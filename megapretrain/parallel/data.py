"""Data parallelism: contiguous param and grad buffers, split into buckets that are reduced over dp
while the last micro-batch's backward is still running.

Layout (one buffer pair per parameter dtype)::

    params, reversed (≈ the order their grads become ready in backward)
    | bucket 0: p_n  p_n-1 ... pad | bucket 1: ... pad | ...      param buffer (model dtype): p.data
    |    rank 0's shard | rank 1's |                              grad buffer (fp32): p.main_grad

Every parameter starts at a multiple of ``ALIGN`` elements and every bucket is padded to a multiple
of ``ALIGN · dp``, so each dp rank owns an equal, aligned 1/dp slice (its *shard*) of every bucket.
Under ``zero=3`` the model arrives without parameter storage (``model/build.py``): each bucket's
full buffer is made, filled by ``initialize``, cut to this rank's shard and freed, one at a time.

Autograd's ``p.grad`` is folded into ``p.main_grad`` (fp32) as soon as it is accumulated, and freed;
micro-batches therefore sum in fp32. Inside ``grad_sync(last=True)`` (the last micro-batch's
backward), a bucket's collective is launched asynchronously the moment its last parameter is folded:

- ``zero=0`` all-reduce of the whole bucket (every rank steps every parameter);
- ``zero=1`` reduce-scatter: only this rank's shard of the sum is needed (distributed optimizer);
- ``zero=2`` as 1, but reduce-scattered after *every* micro-batch into a persistent shard-sized
  accumulator; the full-size bucket storage exists only while a micro-batch's grads are in flight:
  when a bucket's reduction starts, the one launched before it is waited for and freed, so one
  bucket's full gradients reduce while the next one fills. A micro-batch's last reduction is not
  waited for as its backward ends: it runs under what the rank does next (a forward, a pipeline
  transfer) and is waited for as the next backward starts, or by ``reduce_grads``. Each shard
  still adds the micro-batches' sums in their order, so the numbers do not depend on the waits;
- ``zero=3`` as 2, and the parameters too are kept only as this rank's shard: a bucket is one
  *unit* (a decoder layer, or a chunk's other parameters), whose full param buffer is all-gathered
  just before it is used and freed after (``parallel/zero3.py`` decides when). The weights of FP8
  linears with one scale per tensor (spec ``fp8_gather``) get a bucket of their own in each unit,
  gathered as FP8 and the scales (half the bytes) into ``fp8_weights``, where the linears read
  them (``parallel/fp8.py``); their bf16 values are gathered only to read the whole model.

What is special about a parameter comes from its spec (``parallel/specs.py``): a sequence-parallel
norm's grads are first summed over tp, and a tied embedding held by two pipeline stages gets a
bucket of its own whose reduced shard is then summed over the embedding group.

Grads are summed, not averaged: the trainer already divides the loss by the global token count.
After the optimizer has updated its shard of the param buffer, ``gather_params`` all-gathers each
bucket (zero ≥ 1), optionally overlapped with the next forward (``overlap_param_gather``).
"""

from __future__ import annotations

import collections
import contextlib
import time
from functools import partial

import torch
from torch import nn

from .fp8 import E4M3, Cast, WeightCasts, amax_to_scale, cast_fragments, fragment_amaxes
from .specs import ParamSpec
from .state import Group

ALIGN = 64  # elements; keeps parameter views and shard boundaries aligned for vectorized kernels


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class Bucket:
    """Consecutive parameters whose grads are reduced by one collective.

    Offsets are in elements from the bucket's start; this rank owns ``[shard_start, shard_end)``.
    """

    def __init__(self, index: int, params: list[nn.Parameter], offsets: list[int], numel: int,
                 shard_start: int, shard_end: int, fp8_gather: bool = False):
        self.index, self.params, self.offsets, self.numel = index, params, offsets, numel
        # zero=3: FP8 linears' weights, gathered as FP8 (spec fp8_gather)
        self.fp8_gather = fp8_gather
        self.fp8_data: torch.Tensor | None = None  # (numel,) e4m3 while gathered as FP8
        self.shapes = [p.shape for p in params]  # fixed here: a zero=3 param's storage may be freed
        self.shard_start, self.shard_end = shard_start, shard_end
        self.param_data: torch.Tensor | None = None  # (numel,) model dtype; params' .data are views
        # (shard,) model dtype, what the optimizer writes: a view of param_data, or under zero=3 the
        # only persistent copy (param_data's storage then exists only while gathered)
        self.param_shard: torch.Tensor | None = None
        # param_data holds the full, current parameters (zero=3: or is being gathered)
        self.gathered = True
        self.grad_data: torch.Tensor | None = None   # (numel,) fp32; transient under zero=2
        self.grad_shard: torch.Tensor | None = None  # (shard,) fp32: what the optimizer steps on
        self.launched = False       # the reduction of the current grads has started
        self.work = None            # its handle while in flight
        # param id -> folds still to come in a last micro-batch (a param may get its gradient from
        # two backwards: ParamSpec.uses), and -> folds in the current micro-batch (zero=2)
        self.final: dict[int, int] = {}
        self.fresh: dict[int, int] = {}
        self.param_work = None      # pending all-gather of the param buffer
        self.launch_time: float | None = None  # time.perf_counter() of the latest reduction launch

    @property
    def shard_size(self) -> int:
        return self.shard_end - self.shard_start

    def fragments(self) -> list[tuple[nn.Parameter, int, int, int]]:
        """This rank's pieces of parameters: (param, start, end, offset) — elements ``[start, end)``
        of the flattened param live at ``offset`` in the shard."""
        out = []
        for p, shape, off in zip(self.params, self.shapes, self.offsets):
            lo, hi = max(off, self.shard_start), min(off + shape.numel(), self.shard_end)
            if lo < hi:
                out.append((p, lo - off, hi - off, lo - self.shard_start))
        return out

    def set_main_grads(self) -> None:
        for p, shape, off in zip(self.params, self.shapes, self.offsets):
            p.main_grad = None if self.grad_data is None \
                else self.grad_data[off:off + shape.numel()].view(shape)


def bucket_split(params: list[tuple[nn.Parameter, ParamSpec]], bucket_numel: float,
                 dp: int, by_unit: bool = False) -> list[tuple[list, list, int]]:
    """Split ``params`` (in layout order) into buckets of about ``bucket_numel`` elements:
    (params, offsets, padded size) each. A tied embedding gets a bucket of its own. ``by_unit``
    (zero=3): a bucket also ends wherever the next parameter belongs to another decoder layer (or
    to none), so that each bucket is gathered and freed as one unit, or is gathered otherwise
    (``fp8_gather``)."""
    splits, current, offsets, size = [], [], [], 0
    unit = None
    for p, spec in params:
        if spec.tied:
            splits.append(([p], [0], round_up(round_up(p.numel(), ALIGN), ALIGN * dp)))
            continue
        if by_unit and current and (spec.layer, spec.fp8_gather) != unit:
            splits.append((current, offsets, round_up(size, ALIGN * dp)))
            current, offsets, size = [], [], 0
        unit = spec.layer, spec.fp8_gather
        current.append(p)
        offsets.append(size)
        size = round_up(size + p.numel(), ALIGN)
        if size >= bucket_numel:
            splits.append((current, offsets, round_up(size, ALIGN * dp)))
            current, offsets, size = [], [], 0
    if current:
        splits.append((current, offsets, round_up(size, ALIGN * dp)))
    return splits


def fp8_first(params: list[nn.Parameter], spec_of: dict[int, ParamSpec]) -> list[nn.Parameter]:
    """``params`` with, inside each decoder layer (a run of the same ``spec.layer``), the weights
    gathered as FP8 first: one FP8 bucket and one other per unit, not alternating runs."""
    out, run = [], []
    for p in params + [None]:
        if run and (p is None or spec_of[id(p)].layer != spec_of[id(run[0])].layer):
            out += sorted(run, key=lambda q: not spec_of[id(q)].fp8_gather)  # stable
            run = []
        if p is not None:
            run.append(p)
    return out


class DataParallelBuffers:
    """Param and grad buffers of a model's parameters, bucketed and reduced over ``dp``;
    ``specs`` is the parameter-spec table, by name. ``shard`` (default: dp) is the group ZeRO
    shards over, ``replicas`` the groups holding the same shard (hybrid sharding), over which the
    reduce-scattered shard is then all-reduced."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], specs: dict[str, ParamSpec],
                 dp: Group, tp: Group, embedding: Group | None = None, *, zero: int = 0,
                 bucket_size_mb: float = 32.0, overlap: bool = True, shard: Group | None = None,
                 replicas: Group | None = None, initialize=None):
        self.dp, self.tp, self.embedding, self.zero, self.overlap = dp, tp, embedding, zero, overlap
        # (param, out) -> None: the initial value of a storage-less param
        self.initialize = initialize
        self.shard = shard or dp
        self.replicas = replicas
        self.names = {id(p): n for n, p in named_params}
        self.spec_of = {id(p): specs[n] for n, p in named_params}
        self.buckets: list[Bucket] = []
        self.param_buffers: list[torch.Tensor] = []
        self.grad_buffers: list[torch.Tensor] = []  # persistent fp32 grads: full (zero<2) or shards
        self._bucket_of: dict[int, Bucket] = {}
        self._context: str | None = None  # None, "last" or "accumulate" inside grad_sync
        self._gathers: collections.deque = collections.deque()  # buckets with a pending all-gather
        # zero >= 2: launched, not completed yet
        self._reducing: collections.deque = collections.deque()
        self._learning: dict[int, set] = {}  # model -> modules called in its first forward so far
        self._early_of: dict[int, list[Bucket]] = {}  # model -> buckets used without a module call
        self._early: set[Bucket] = set()  # gathered first
        # zero=3: one bucket per unit, whatever its size (a unit is gathered whole anyway)
        bucket_numel = bucket_size_mb * 2**20 / 4 if bucket_size_mb > 0 and zero < 3 \
            else float("inf")
        # zero=3: called with a bucket once a micro-batch's grads are all folded
        self.after_grads = None
        # a list when the caller's backward always brings the gradient it announced to a fused loss
        # (model/fused_loss.py): each backward's check that it did lands here, a device flag, for
        # the caller to read with the step's other values instead of waiting for the device there
        # and then
        self.grad_scale_checks: list[torch.Tensor] | None = None
        # a split backward's key -> what its B folded, per bucket (grad_sync)
        self._split_folds: dict = {}
        # zero=3: called as a split backward's B ends (its W needs no params)
        self.after_split_backward = None
        # zero=3: where FP8-gathered weights go (hook_models)
        self.fp8_weights: WeightCasts | None = None
        layout = [p for _, p in reversed(named_params)]
        if zero == 3:
            layout = fp8_first(layout, self.spec_of)
        for dtype in dict.fromkeys(p.dtype for p in layout):
            self._build(dtype, [(p, self.spec_of[id(p)]) for p in layout if p.dtype == dtype],
                        bucket_numel)
        for _, p in named_params:
            p.register_post_accumulate_grad_hook(self._on_grad)
        self.zero_grad()

    @torch.no_grad()
    def _build(self, dtype: torch.dtype, params: list[tuple[nn.Parameter, ParamSpec]],
               bucket_numel: float) -> None:
        splits = bucket_split(params, bucket_numel, self.shard.size, by_unit=self.zero == 3)
        total = sum(numel for _, _, numel in splits)
        device = params[0][0].device
        # zero=3: no shared buffer; each bucket has its own full buffer, freed once its shard is cut
        param_buffer = torch.zeros(total, dtype=dtype, device=device) if self.zero < 3 else None
        grad_buffer = torch.zeros(total // (self.shard.size if self.zero >= 2 else 1),
                                  dtype=torch.float32, device=device)
        param_shards = torch.empty(total // self.shard.size, dtype=dtype, device=device) \
            if self.zero == 3 else None
        start = shard_start = 0
        for bucket_params, offsets, numel in splits:
            shard = numel // self.shard.size if self.zero >= 1 else numel
            lo = self.shard.rank * shard if self.zero >= 1 else 0
            b = Bucket(len(self.buckets), bucket_params, offsets, numel, lo, lo + shard,
                       fp8_gather=self.zero == 3 and self.spec_of[id(bucket_params[0])].fp8_gather)
            b.param_data = (param_buffer[start:start + numel] if param_buffer is not None
                            else torch.zeros(numel, dtype=dtype, device=device))
            for p, off in zip(bucket_params, offsets):
                view = b.param_data[off:off + p.numel()].view(p.shape)
                # a ZeRO-3 placeholder (model/build.py)
                if p.untyped_storage().nbytes() == 0 and p.numel():
                    if self.initialize is None:
                        raise ValueError(f"parameter '{self.names[id(p)]}' has no storage and no "
                                         "initializer was given (model/build.py: "
                                         "deferred_initializer)")
                    self.initialize(p, view)
                else:
                    view.copy_(p.data)
                p.data = view
                self._bucket_of[id(p)] = b
            if self.zero == 3:  # the full buffer exists only while gathered from now on
                b.param_shard = param_shards[shard_start:shard_start + shard]
                b.param_shard.copy_(b.param_data[b.shard_start:b.shard_end])
                self.free(b)
            else:
                b.param_shard = b.param_data[b.shard_start:b.shard_end]
            if self.zero >= 2:
                b.grad_shard = grad_buffer[shard_start:shard_start + shard]
            else:
                b.grad_data = grad_buffer[start:start + numel]
                b.grad_shard = b.grad_data[b.shard_start:b.shard_end]
            b.set_main_grads()
            self.buckets.append(b)
            start += numel
            shard_start += shard
        self.param_buffers.append(param_buffer if param_buffer is not None else param_shards)
        self.grad_buffers.append(grad_buffer)

    # -- gradients --------------------------------------------------------------------------------

    def zero_grad(self) -> None:
        self._split_folds.clear()
        self._reducing.clear()
        for b in self.buckets:
            if b.work is not None:  # never free or zero what a collective still writes
                b.work.wait()
            b.launched, b.work = False, None
            b.final = {id(p): self.spec_of[id(p)].uses for p in b.params}
            if self.zero >= 2 and b.grad_data is not None:
                b.grad_data = None
                b.set_main_grads()
        for buf in self.grad_buffers:
            buf.zero_()

    @contextlib.contextmanager
    def grad_sync(self, last: bool, split: tuple | None = None):
        """Context for one micro-batch's backward (per model chunk); inside ``last=True`` buckets
        are reduced as they become ready. Under zero=2 every micro-batch's buckets are, and the one
        left in flight as a backward ends is waited for as the next one starts.

        A zero-bubble schedule splits a backward in two: ``split=("B", key)`` for the input-gradient
        part, whose linears' weight gradients wait for ``("W", key)``, the part that computes them.
        A bucket is ready only once its W ran: the counts of what the B folded are kept for the W
        (``key`` names the micro-batch and chunk), and zero=2 reduces after the W."""
        part, key = split if split is not None else (None, None)
        self.wait_params()  # normally a no-op: the forward has waited for what it used
        if self.zero >= 2:  # the reduction a previous backward left in flight, before this one
            self._drain()   # fills buckets of its own
        self._context = "last" if last else "accumulate"
        folded_in_b = self._split_folds.pop(key, {}) if part == "W" else {}
        for b in self.buckets:
            b.fresh = folded_in_b.get(b.index, {})
        try:
            yield
        finally:
            self._context = None
        if part == "B":
            self._split_folds[key] = {b.index: b.fresh for b in self.buckets if b.fresh}
            for b in self.buckets:  # zero ≥ 2: a bucket the B completed (no linears) is reduced now
                if b.launched and not last and self.zero >= 2:
                    self._complete(b)
            if self.after_split_backward is not None:
                self.after_split_backward()
        elif self.zero >= 2 and not last:
            # only the shard accumulators outlive a micro-batch; the last bucket's reduction
            # is still running (waited for as the next backward starts: _drain)
            self._launch_rest()

    def _on_grad(self, p: nn.Parameter) -> None:
        """Fold autograd's ``p.grad`` into ``p.main_grad``; launch the bucket once it is
        complete."""
        if p.grad is None:  # the op added it itself (main_grad_for) and has said so (grad_added)
            return
        self.main_grad_for(p).add_(p.grad)
        p.grad = None
        self.grad_added(p)

    def main_grad_for(self, p: nn.Parameter) -> torch.Tensor:
        """``p.main_grad`` (fp32), to add a gradient into; under zero=2 made on the bucket's first
        gradient of a micro-batch. An op that adds its gradient for ``p`` here itself (the output
        layer's chunked loss, given these buffers by ``MixedPrecisionAdamW.hook_models``) instead
        of returning it to autograd then calls :meth:`grad_added`."""
        b = self._bucket_of[id(p)]
        if b.launched and self._context is None and any(r is b for r in self._reducing):
            # zero ≥ 2: a previous micro-batch's reduction of this bucket is still in flight (left
            # so as its backward ended); an op that adds its gradient outside a backward (the
            # chunked loss, in its forward) completes it first, as the next backward would
            self._drain()
        if b.launched:
            raise RuntimeError(f"parameter '{self.names[id(p)]}' received a gradient after its "
                               "bucket's data-parallel reduction started: was it used after its "
                               "last micro-batch, or was zero_grad() not called after "
                               "reduce_grads()?")
        if b.grad_data is None:  # zero=2: the bucket's first grad of this micro-batch
            b.grad_data = torch.zeros(b.numel, dtype=torch.float32, device=p.device)
            b.set_main_grads()
        return p.main_grad

    def holds(self, p: nn.Parameter) -> bool:
        """Whether ``p`` itself (not a copy of a model built on these buffers) is one of ours."""
        b = self._bucket_of.get(id(p))
        return b is not None and any(q is p for q in b.params)

    def grad_added(self, p: nn.Parameter) -> None:
        """``p``'s gradient of this backward is in its main grad: launch its bucket if complete."""
        b = self._bucket_of[id(p)]
        if self._context is None:
            return
        key = id(p)
        if self._context == "last":
            b.final[key] = b.final.get(key, 1) - 1
            if b.final[key] <= 0:
                del b.final[key]
            ready = not b.final
        else:
            b.fresh[key] = b.fresh.get(key, 0) + 1
            ready = self.zero >= 2 and self.folded(b, last=False)
        if ready and self.overlap:
            self._launch(b)
        if ready and self.after_grads is not None:
            self.after_grads(b, self._context == "last")

    def folded(self, b: Bucket, last: bool) -> bool:
        """Whether bucket ``b``'s grads of the current micro-batch are all folded (``last``: of the
        step's last micro-batch)."""
        return not b.final if last else all(b.fresh.get(id(p), 0) >= self.spec_of[id(p)].uses
                                            for p in b.params)

    def _launch(self, b: Bucket) -> None:
        if self.zero >= 2:  # free the full gradients of all but the latest reduction in flight
            self._drain()
            self._reducing.append(b)
        b.launched = True
        b.launch_time = time.perf_counter()
        for p in b.params:  # sequence-parallel norm weights: each tp rank saw part of the sequence
            if self.spec_of[id(p)].partial_grad_over_tp:
                self.tp.all_reduce(p.main_grad)
        if self.zero == 0:
            b.work = self.dp.all_reduce_async(b.grad_data)
        else:  # in place: our shard of the sum lands in our slice of the bucket
            b.work = self.shard.reduce_scatter_async(b.grad_data[b.shard_start:b.shard_end],
                                                     b.grad_data)

    def _complete(self, b: Bucket) -> None:
        if b.work is not None:
            b.work.wait()
            b.work = None
        # hybrid: the shard's sum over the other replicas
        if self.zero >= 1 and self.replicas is not None:
            self.replicas.all_reduce(b.grad_data[b.shard_start:b.shard_end])
        if self.zero >= 2:
            b.grad_shard.add_(b.grad_data[b.shard_start:b.shard_end])
            b.grad_data = None
            b.set_main_grads()
            b.launched = False

    def _drain(self) -> None:
        """zero ≥ 2: complete the reductions in flight, in the order they were launched (each
        shard adds the micro-batches' sums in their order)."""
        while self._reducing:
            done = self._reducing.popleft()
            if done.launched:
                self._complete(done)

    def _launch_rest(self) -> None:
        """Launch every bucket not launched yet that holds grads (in bucket order, the same on
        every rank)."""
        for b in self.buckets:
            if not b.launched and b.grad_data is not None:
                self._launch(b)

    def _reduce_all(self) -> None:
        """Launch every bucket not launched yet, then wait for all of them."""
        self._launch_rest()
        self._drain()
        for b in self.buckets:
            if b.launched:
                self._complete(b)

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Finish the step's reduction: afterwards every bucket's ``grad_shard`` holds the sum over
        dp of this rank's shard. A tied embedding's copies on the first and last pipeline stage
        (spec ``tied``) are then summed over the embedding group: alone in their buckets, they are
        sharded the same way on both stages."""
        self.wait_params()
        self._reduce_all()
        if self.embedding is not None:
            for b in self.buckets:
                if self.spec_of[id(b.params[0])].tied:
                    self.embedding.all_reduce(b.grad_shard)

    # -- parameters -------------------------------------------------------------------------------

    def gather_params(self, async_op: bool = False) -> None:
        """All-gather every bucket's param buffer from the shards (zero ≥ 1) in the order the next
        forward needs them; with ``async_op`` the forward's pre-hooks wait (see
        ``overlap_param_gather``)."""
        if self.zero in (0, 3) or self.shard.size == 1:  # zero=3: each unit gathers as it is used
            return
        self.wait_params()
        forward_order = list(reversed(self.buckets))  # the first layers' bucket first
        for b in [b for b in forward_order if b in self._early] + [b for b in forward_order
                                                                   if b not in self._early]:
            b.param_work = self.shard.all_gather_async(b.param_data,
                                                       b.param_data[b.shard_start:b.shard_end])
            self._gathers.append(b)
        if not async_op:
            self.wait_params()

    def wait_params(self, upto: Bucket | None = None) -> None:
        """Wait for pending all-gathers: those launched up to and including ``upto``, or all."""
        if upto is not None and upto.param_work is None:
            return  # already complete
        while self._gathers:
            b = self._gathers.popleft()
            if b.param_work is not None:
                b.param_work.wait()
                b.param_work = None
            if b is upto:
                break

    def overlap_param_gather(self, model: nn.Module) -> None:
        """Let the post-step all-gathers run under ``model``'s next forward.

        Each module with parameters waits, as its forward starts, for its own parameters' buckets.
        Parameters the forward uses without calling their module (an output layer applied
        functionally, a tied embedding) are found during the first forward, which waits for
        everything; from then on their buckets are gathered first and waited for as ``model``'s
        own forward starts."""
        owned = {}
        for module in model.modules():
            buckets = list(dict.fromkeys(self._bucket_of[id(p)]
                                         for p in module.parameters(recurse=False)
                                         if id(p) in self._bucket_of))
            if buckets:
                owned[id(module)] = buckets
                module.register_forward_pre_hook(partial(self._wait_for_module, buckets=buckets))
        called: set[int] = set()
        self._learning[id(model)] = called
        model.register_forward_pre_hook(self._wait_for_model)
        model.register_forward_hook(partial(self._learn_uncalled, owned=owned, called=called))

    def _wait_for_module(self, module: nn.Module, args, buckets: list[Bucket]) -> None:
        for called in self._learning.values():
            called.add(id(module))
        for b in buckets:
            self.wait_params(b)

    def _wait_for_model(self, model: nn.Module, args) -> None:
        if id(model) in self._learning:
            self.wait_params()  # first forward: everything
        for b in self._early_of.get(id(model), ()):
            self.wait_params(b)

    def _learn_uncalled(self, model: nn.Module, args, output, owned: dict, called: set) -> None:
        if self._learning.pop(id(model), None) is None:
            return
        early = [b for m, buckets in owned.items() if m not in called for b in buckets]
        self._early_of[id(model)] = early
        self._early.update(early)

    # -- zero=3: a bucket's full parameters exist only between gather() and free() ----------------

    def gather(self, b: Bucket, full_precision: bool = False) -> None:
        """Start all-gathering bucket ``b``'s parameters from the shards into its full buffer
        (re-allocated); ``wait(b)`` before reading them. A no-op when gathered or in flight. An
        FP8 bucket is gathered as FP8 for the FP8 linears, unless ``full_precision`` (to read the
        parameters themselves)."""
        if b.fp8_gather and not full_precision:
            if b.fp8_data is None:
                self._gather_fp8(b)
            b.gathered = True
            return
        if b.param_data.untyped_storage().nbytes() or not b.numel:
            b.gathered = True
            return
        self.wait(b)  # an FP8 gather of the same bucket may still be writing
        b.param_data.untyped_storage().resize_(b.numel * b.param_data.element_size())
        b.gathered = True
        b.param_work = self.shard.all_gather_async(b.param_data, b.param_shard)

    def _gather_fp8(self, b: Bucket) -> None:
        """Start gathering FP8 bucket ``b`` as e4m3 with one scale per weight: the amaxes of the
        shards' pieces of each weight are all-reduced (max) over the shard group and then over tp
        (one scale for the whole weight, as one process casts it), each rank casts its shard, the
        bytes are all-gathered, and each weight's cast is published in ``fp8_weights``."""
        if self.fp8_weights is None:
            raise RuntimeError("an FP8 bucket was gathered before hook_models() gave the buffers "
                               "the model's fp8_weights")
        index = {id(p): i for i, p in enumerate(b.params)}
        pieces = [(index[id(p)], off, end - start) for p, start, end, off in b.fragments()]
        amaxes = fragment_amaxes(b.param_shard, pieces, len(b.params))
        self.shard.all_reduce(amaxes, op=torch.distributed.ReduceOp.MAX)
        # the weights are split over tp
        self.tp.all_reduce(amaxes, op=torch.distributed.ReduceOp.MAX)
        b.fp8_data = torch.empty(b.numel, dtype=E4M3, device=b.param_shard.device)
        b.param_work = self.shard.all_gather_async(b.fp8_data,
                                                   cast_fragments(b.param_shard, pieces, amaxes))
        scales = amax_to_scale(amaxes, E4M3, pow2=False)
        for i, (p, shape, off) in enumerate(zip(b.params, b.shapes, b.offsets)):
            self.fp8_weights.put(p, Cast(b.fp8_data[off:off + shape.numel()].view(shape),
                                         scales[i]))

    def wait(self, b: Bucket) -> None:
        if b.param_work is not None:
            b.param_work.wait()
            b.param_work = None

    def free(self, b: Bucket) -> None:
        """Release bucket ``b``'s full parameters (its params keep their shapes, over no storage:
        reading one before the next gather() fails loudly), and its FP8 copy."""
        self.wait(b)
        b.param_data.untyped_storage().resize_(0)
        if b.fp8_data is not None:
            for p in b.params:
                self.fp8_weights.drop(p)
            b.fp8_data = None
        b.gathered = False

    def gathered_bytes(self) -> int:
        """Bytes of full parameter buffers (and FP8 copies) alive now (zero=3)."""
        if self.zero != 3:
            return 0
        return sum(b.param_data.untyped_storage().nbytes() + (b.numel if b.fp8_data is not None
                                                              else 0)
                   for b in self.buckets)

    def gathered_element_size(self, b: Bucket) -> int:
        """Bytes per element of bucket ``b`` while a forward uses it (zero=3): 1 for FP8 ones."""
        return 1 if b.fp8_gather else b.param_shard.element_size()

    # -- accounting -------------------------------------------------------------------------------

    def padded_numel(self) -> int:
        return sum(b.numel for b in self.buckets)
