"""Dropout RNG: per-tp-rank streams inside tp regions, and exact replay under recomputation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megapretrain.parallel.random import RNGTracker


def test_tp_streams_differ_by_rank_and_leave_the_default_stream_alone():
    torch.manual_seed(0)
    ref_default = torch.rand(4)
    torch.manual_seed(0)
    masks = []
    for tp_rank in (0, 1):
        tracker = RNGTracker(seed=5, tp_rank=tp_rank)
        with tracker.fork():
            masks.append(torch.rand(16))
    assert not torch.equal(masks[0], masks[1])
    assert torch.equal(torch.rand(4), ref_default)  # forking did not advance the default stream
    again = RNGTracker(seed=5, tp_rank=0)
    with again.fork():
        assert torch.equal(torch.rand(16), masks[0])  # deterministic per (seed, tp rank)


def test_stream_advances_between_forks():
    tracker = RNGTracker(seed=1, tp_rank=0)
    with tracker.fork():
        a = torch.rand(8)
    with tracker.fork():
        b = torch.rand(8)
    assert not torch.equal(a, b)


def _block(x, tracker):
    with tracker.fork():
        y = F.dropout(x, 0.5, training=True)
    return F.dropout(y * 2, 0.3, training=True)  # default stream


def test_recomputation_replays_both_streams():
    x = torch.randn(32, 16, requires_grad=True)
    torch.manual_seed(3)
    plain_tracker = RNGTracker(seed=9, tp_rank=1)
    out = _block(x, plain_tracker)
    out.sum().backward()
    want_out, want_grad = out.detach(), x.grad.clone()

    x.grad = None
    torch.manual_seed(3)
    tracker = RNGTracker(seed=9, tp_rank=1)
    out = checkpoint(_block, x, tracker, use_reentrant=False, context_fn=tracker.checkpoint_context)
    with tracker.fork():
        torch.rand(5)  # other work advances the tracker before the recomputation runs
    out.sum().backward()
    assert torch.equal(out.detach(), want_out)
    assert torch.equal(x.grad, want_grad)
