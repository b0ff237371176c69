"""Tensor-parallel communication overlapped with the GEMMs around it (``parallel.tp_comm_overlap``).

Under sequence parallelism each tp rank holds 1/tp of the sequence between blocks; a block's
column-parallel linears need the whole sequence (an all-gather before the GEMM) and its row-parallel
linear's partial sums are reduce-scattered back (after the GEMM). Synchronously, the GEMM waits for
the whole collective. Here both are decomposed into tp steps of a ring (a *collective matmul*):

    all-gather + GEMM     step k: pass the sequence chunk held on to the next rank while computing
                          the GEMM of the chunk that arrived in step k − 1 (of rank r − k)
    GEMM + reduce-scatter step k: compute this rank's partial sums of the chunk rank r − 1 − k owns,
                          add the partial sums that arrived, pass them on; after tp steps each rank
                          holds the sum of its own chunk

so each step's transfer runs while the previous (or next) chunk computes. Backward is the same two
rings the other way round: the row linear's output gradient is gathered chunk by chunk under the
input- and weight-gradient GEMMs; the column linears' input gradient is reduce-scattered under its
own GEMMs, with the saved input shard passed around again for the weight gradients. Transfers are
``Group.shift_async`` (one batched send/receive per step: NCCL on GPU, gloo on CPU, the same code),
issued and waited for on one side stream per rank (:class:`RingStream`) while the GEMMs run on the
current one; the comm stats count the time a rank waits on them as exposed.

The chunks' products are the whole GEMM's rows, so the forward equals the synchronous path; the
sums over chunks (the reduce-scatter, the weight gradients) run in ring order, not the collective's,
so they agree to rounding. Split backward (``DeferredGrads``) is kept: the W gets the gathered
operands.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .state import Group

SEQ_DIM = 1


class RingStream:
    """The stream a rank's tp rings send and receive on: a side stream of the tensors' device
    (``torch.get_device_module``), one per rank, shared by every overlapped linear of its model.

    Each ring step: the side stream waits for the current stream (which made what is sent), the
    send/receive is issued on the side stream, and when the step is waited for the side stream
    waits for the transfer and the current stream for the side stream, before it reads what
    arrived. The receive buffers are allocated on the current stream, and the step's handle keeps
    every tensor it sends or receives referenced until that wait: the caching allocator can only
    reuse their memory for kernels queued after the transfer (what ``record_stream`` would ensure,
    done the same way on every device). On CPU ``torch.cpu.Stream`` is a stream in name only, its
    waits return at once and gloo's ``wait()`` blocks the host: the same code, the same results.
    """

    def __init__(self):
        self._side = None  # made at the first step, on the current device of the tensors' type

    def shift(self, tp: Group, sends: list[torch.Tensor]) -> tuple[list[torch.Tensor], _RingStep]:
        """``tp.shift_async(sends)`` on the side stream: (the receive buffers, the step's
        handle)."""
        device = sends[0].device
        module = torch.get_device_module(device)
        if self._side is None:
            self._side = module.Stream()
        current = module.current_stream(device)
        received = [torch.empty_like(t) for t in sends]  # on the current stream, which reads them
        self._side.wait_stream(current)  # what is sent was made there
        with module.stream(self._side):
            _, work = tp.shift_async(sends, into=received)
        return received, _RingStep(work, module, current, self._side, (sends, received))


class _RingStep:
    """One ring step in flight on the side stream, and the tensors it uses, kept until it is waited
    for."""

    def __init__(self, work, module, current, side, keep: tuple):
        self.work, self.module, self.current, self.side, self.keep = \
            work, module, current, side, keep

    def wait(self) -> None:
        with self.module.stream(self.side):
            self.work.wait()  # NCCL: the side stream waits for the transfer; gloo: the host does
        self.current.wait_stream(self.side)
        # what the step used may be freed: later kernels on the current stream run after it
        self.keep = None


def _rows(t: torch.Tensor, chunk: int, size: int) -> torch.Tensor:
    """Sequence chunk ``chunk`` of ``t`` (b, s, ...) cut into ``size``."""
    return t.narrow(SEQ_DIM, chunk * size, size)


def _ring_gather(shard: torch.Tensor, tp: Group, stream: RingStream, each) -> None:
    """Pass ``shard`` (b, s/tp, ...) around the tp ring; ``each(chunk, tensor)`` runs on every
    rank's shard as it is held, while the next one travels (on ``stream``)."""
    cur = shard.contiguous()
    for k in range(tp.size):
        if k < tp.size - 1:
            (nxt,), handle = stream.shift(tp, [cur])
        each((tp.rank - k) % tp.size, cur)
        if k < tp.size - 1:
            handle.wait()
            cur = nxt


def _ring_reduce_scatter(partial, tp: Group, stream: RingStream) -> torch.Tensor:
    """Sum over tp of ``partial(chunk)`` (this rank's partial sums of sequence chunk ``chunk``) for
    this rank's own chunk, each chunk's partial computed while the previous sums travel (on
    ``stream``)."""
    received, handle = None, None
    for k in range(tp.size):
        acc = partial((tp.rank - 1 - k) % tp.size)
        if handle is not None:
            handle.wait()
            acc = acc + received
        if k == tp.size - 1:
            return acc
        (received,), handle = stream.shift(tp, [acc])
    raise AssertionError("unreachable")


class _GatherColumnLinears(torch.autograd.Function):
    """[all-gather(x) @ Wᵢᵀ + bᵢ for each i] with the gather in ring steps under the GEMMs."""

    @staticmethod
    def forward(ctx, x, tp, stream, deferred, n, *params):
        weights, biases = params[:n], params[n:]
        b, s_local = x.shape[0], x.shape[SEQ_DIM]
        outs = [x.new_empty(b, s_local * tp.size, w.shape[0]) for w in weights]  # (b, s, oᵢ/tp)

        def each(chunk, x_chunk):
            for out, w, bias in zip(outs, weights, biases):
                _rows(out, chunk, s_local).copy_(F.linear(x_chunk, w, bias))
        _ring_gather(x, tp, stream, each)
        ctx.save_for_backward(x, *weights)
        ctx.tp, ctx.stream, ctx.deferred, ctx.n, ctx.params = tp, stream, deferred, n, weights
        ctx.has_bias = [bias is not None for bias in biases]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        tp, s_local = ctx.tp, x.shape[SEQ_DIM]
        need_x = ctx.needs_input_grad[0]
        need_w = [ctx.needs_input_grad[5 + i] for i in range(ctx.n)]
        defer = ctx.deferred is not None and ctx.deferred.capturing()
        grad_w = [torch.zeros_like(w) if need and not defer else None for w,
                  need in zip(weights, need_w)]
        # (b, s, h)
        full = x.new_empty(x.shape[0], s_local * tp.size, x.shape[2]) if defer else None

        def each(chunk, x_chunk):  # the weight gradients, one sequence chunk at a time
            if defer:
                _rows(full, chunk, s_local).copy_(x_chunk)
                return
            for gw, g in zip(grad_w, grads):
                if gw is not None:
                    g_rows = _rows(g, chunk, s_local)
                    # (oᵢ/tp, h)
                    gw.add_(g_rows.reshape(-1,
                                           g.shape[-1]).t().mm(x_chunk.reshape(-1, x.shape[-1])))
        _ring_gather(x, tp, ctx.stream, each)
        if defer:
            for w, g, need in zip(ctx.params, grads, need_w):
                if need:
                    ctx.deferred.defer(w, full, g)

        def partial(chunk):  # (b, s/tp, h) this rank's share of the input gradient of one chunk
            return sum(_rows(g, chunk, s_local).matmul(w) for g, w in zip(grads, weights))
        grad_x = _ring_reduce_scatter(partial, tp, ctx.stream) if need_x else None
        grad_b = [g.reshape(-1, g.shape[-1]).sum(0) if has and ctx.needs_input_grad[5 + ctx.n + i]
                  else None
                  for i, (g, has) in enumerate(zip(grads, ctx.has_bias))]
        return (grad_x, None, None, None, None, *grad_w, *grad_b)


class _RowLinearReduceScatter(torch.autograd.Function):
    """reduce-scatter over seq of (x @ Wᵀ), each chunk's GEMM under the previous chunk's
    transfer."""

    @staticmethod
    def forward(ctx, x, weight, tp, stream, deferred):
        s_local = x.shape[SEQ_DIM] // tp.size
        ctx.save_for_backward(x, weight)
        ctx.tp, ctx.stream, ctx.deferred, ctx.param = tp, stream, deferred, weight
        def partial(chunk):  # (b, s/tp, h) this rank's partial sums of sequence chunk ``chunk``
            return F.linear(_rows(x, chunk, s_local), weight)
        return _ring_reduce_scatter(partial, tp, stream)  # (b, s/tp, h)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        tp, s_local = ctx.tp, grad.shape[SEQ_DIM]
        defer = ctx.needs_input_grad[1] and ctx.deferred is not None and ctx.deferred.capturing()
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None  # (b, s, f/tp)
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] and not defer else None
        # (b, s, h)
        full = grad.new_empty(grad.shape[0], s_local * tp.size, grad.shape[2]) if defer else None

        def each(chunk, g):  # the output gradient of one sequence chunk, gathered
            if grad_x is not None:
                _rows(grad_x, chunk, s_local).copy_(g.matmul(weight))
            if grad_w is not None:
                grad_w.add_(g.reshape(-1,
                                      g.shape[-1]).t().mm(_rows(x, chunk,
                                                                s_local).reshape(-1, x.shape[-1])))
            if full is not None:
                _rows(full, chunk, s_local).copy_(g)
        _ring_gather(grad, tp, ctx.stream, each)
        if defer:
            ctx.deferred.defer(ctx.param, x, full)
        return grad_x, grad_w, None, None, None


def gather_column_linears(x: torch.Tensor, linears: list, tp: Group, stream: RingStream,
                          deferred=None) -> list[torch.Tensor]:
    """Each column-parallel linear of ``linears`` (sharing the input) applied to the sequence-
    parallel ``x`` (b, s/tp, h) gathered over tp, the gather overlapped with their GEMMs (its
    steps on ``stream``): a list of (b, s, outᵢ/tp)."""
    weights = [m.weight for m in linears]
    biases = [m.bias for m in linears]
    return list(_GatherColumnLinears.apply(x, tp, stream, deferred, len(weights), *weights,
                                           *biases))


def row_linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, tp: Group, stream: RingStream,
                              deferred=None) -> torch.Tensor:
    """(x @ Wᵀ) summed over tp and split along the sequence, (b, s, f/tp) -> (b, s/tp, h), the
    reduce-scatter overlapped with the GEMM (its steps on ``stream``)."""
    return _RowLinearReduceScatter.apply(x, weight, tp, stream, deferred)
