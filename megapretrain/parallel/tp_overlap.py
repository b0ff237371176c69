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
``Group.shift_async`` (one batched send/receive per step: NCCL on GPU, gloo on CPU, the same code);
the comm stats count the time a rank waits on them as exposed.

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


def _rows(t: torch.Tensor, chunk: int, size: int) -> torch.Tensor:
    """Sequence chunk ``chunk`` of ``t`` (b, s, ...) cut into ``size``."""
    return t.narrow(SEQ_DIM, chunk * size, size)


def _ring_gather(shard: torch.Tensor, tp: Group, each) -> None:
    """Pass ``shard`` (b, s/tp, ...) around the tp ring; ``each(chunk, tensor)`` runs on every rank's
    shard as it is held, while the next one travels."""
    cur = shard.contiguous()
    for k in range(tp.size):
        if k < tp.size - 1:
            (nxt,), handle = tp.shift_async([cur])
        each((tp.rank - k) % tp.size, cur)
        if k < tp.size - 1:
            handle.wait()
            cur = nxt


def _ring_reduce_scatter(partial, tp: Group) -> torch.Tensor:
    """Sum over tp of ``partial(chunk)`` (this rank's partial sums of sequence chunk ``chunk``) for
    this rank's own chunk, each chunk's partial computed while the previous sums travel."""
    received, handle = None, None
    for k in range(tp.size):
        acc = partial((tp.rank - 1 - k) % tp.size)
        if handle is not None:
            handle.wait()
            acc = acc + received
        if k == tp.size - 1:
            return acc
        (received,), handle = tp.shift_async([acc])
    raise AssertionError("unreachable")


class _GatherColumnLinears(torch.autograd.Function):
    """[all-gather(x) @ Wᵢᵀ + bᵢ for each i] with the gather in ring steps under the GEMMs."""

    @staticmethod
    def forward(ctx, x, tp, deferred, n, *params):
        weights, biases = params[:n], params[n:]
        b, s_local = x.shape[0], x.shape[SEQ_DIM]
        outs = [x.new_empty(b, s_local * tp.size, w.shape[0]) for w in weights]  # (b, s, oᵢ/tp)

        def each(chunk, x_chunk):
            for out, w, bias in zip(outs, weights, biases):
                _rows(out, chunk, s_local).copy_(F.linear(x_chunk, w, bias))
        _ring_gather(x, tp, each)
        ctx.save_for_backward(x, *weights)
        ctx.tp, ctx.deferred, ctx.n, ctx.params = tp, deferred, n, weights
        ctx.has_bias = [bias is not None for bias in biases]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        tp, s_local = ctx.tp, x.shape[SEQ_DIM]
        need_x = ctx.needs_input_grad[0]
        need_w = [ctx.needs_input_grad[4 + i] for i in range(ctx.n)]
        defer = ctx.deferred is not None and ctx.deferred.capturing()
        grad_w = [torch.zeros_like(w) if need and not defer else None for w, need in zip(weights, need_w)]
        full = x.new_empty(x.shape[0], s_local * tp.size, x.shape[2]) if defer else None  # (b, s, h)

        def each(chunk, x_chunk):  # the weight gradients, one sequence chunk at a time
            if defer:
                _rows(full, chunk, s_local).copy_(x_chunk)
                return
            for gw, g in zip(grad_w, grads):
                if gw is not None:
                    g_rows = _rows(g, chunk, s_local)
                    gw.add_(g_rows.reshape(-1, g.shape[-1]).t().mm(x_chunk.reshape(-1, x.shape[-1])))  # (oᵢ/tp, h)
        _ring_gather(x, tp, each)
        if defer:
            for w, g, need in zip(ctx.params, grads, need_w):
                if need:
                    ctx.deferred.defer(w, full, g)

        def partial(chunk):  # (b, s/tp, h) this rank's share of the input gradient of one chunk
            return sum(_rows(g, chunk, s_local).matmul(w) for g, w in zip(grads, weights))
        grad_x = _ring_reduce_scatter(partial, tp) if need_x else None
        grad_b = [g.reshape(-1, g.shape[-1]).sum(0) if has and ctx.needs_input_grad[4 + ctx.n + i] else None
                  for i, (g, has) in enumerate(zip(grads, ctx.has_bias))]
        return (grad_x, None, None, None, *grad_w, *grad_b)


class _RowLinearReduceScatter(torch.autograd.Function):
    """reduce-scatter over seq of (x @ Wᵀ), each chunk's GEMM under the previous chunk's transfer."""

    @staticmethod
    def forward(ctx, x, weight, tp, deferred):
        s_local = x.shape[SEQ_DIM] // tp.size
        ctx.save_for_backward(x, weight)
        ctx.tp, ctx.deferred, ctx.param = tp, deferred, weight
        return _ring_reduce_scatter(lambda chunk: F.linear(_rows(x, chunk, s_local), weight), tp)  # (b, s/tp, h)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        tp, s_local = ctx.tp, grad.shape[SEQ_DIM]
        defer = ctx.needs_input_grad[1] and ctx.deferred is not None and ctx.deferred.capturing()
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None  # (b, s, f/tp)
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] and not defer else None
        full = grad.new_empty(grad.shape[0], s_local * tp.size, grad.shape[2]) if defer else None  # (b, s, h)

        def each(chunk, g):  # the output gradient of one sequence chunk, gathered
            if grad_x is not None:
                _rows(grad_x, chunk, s_local).copy_(g.matmul(weight))
            if grad_w is not None:
                grad_w.add_(g.reshape(-1, g.shape[-1]).t().mm(_rows(x, chunk, s_local).reshape(-1, x.shape[-1])))
            if full is not None:
                _rows(full, chunk, s_local).copy_(g)
        _ring_gather(grad, tp, each)
        if defer:
            ctx.deferred.defer(ctx.param, x, full)
        return grad_x, grad_w, None, None


def gather_column_linears(x: torch.Tensor, linears: list, tp: Group, deferred=None) -> list[torch.Tensor]:
    """Each column-parallel linear of ``linears`` (sharing the input) applied to the sequence-
    parallel ``x`` (b, s/tp, h) gathered over tp, the gather overlapped with their GEMMs: a list
    of (b, s, outᵢ/tp)."""
    weights = [m.weight for m in linears]
    biases = [m.bias for m in linears]
    return list(_GatherColumnLinears.apply(x, tp, deferred, len(weights), *weights, *biases))


def row_linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, tp: Group, deferred=None) -> torch.Tensor:
    """(x @ Wᵀ) summed over tp and split along the sequence, (b, s, f/tp) -> (b, s/tp, h), the
    reduce-scatter overlapped with the GEMM."""
    return _RowLinearReduceScatter.apply(x, weight, tp, deferred)
