"""The communication that tensor parallelism costs, counted per collective, matches the analysis;
the time a rank is blocked on it is measured by the device's clock."""

from __future__ import annotations

import time

import pytest
import torch

from megapretrain.parallel.state import (
    CommStats,
    Group,
    HostClock,
    ParallelState,
    StreamClock,
    clock_for,
)

from distributed import run_distributed
from helpers import build, make_tokens, tiny_args

B, S, H = 2, 32, 64


def _count(rank, world, sequence_parallel):
    ps = ParallelState(tp=world, comm_stats=True)
    args = tiny_args()
    model = build(ps, args, sequence_parallel=sequence_parallel)
    tokens = make_tokens(batch=B, seq=S)
    ps.stats.reset()
    model(tokens[:, :-1], tokens[:, 1:]).sum().backward()
    return ps.stats.summary(), args.num_layers, args.padded_vocab(world)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_collectives_per_layer_match_analysis(sequence_parallel):
    world = 2
    stats, layers, _ = run_distributed(_count, world, sequence_parallel)[0]
    act = B * S * H * 4                      # bytes of one full (b, s, h) fp32 activation
    ce = 3                                   # cross entropy: max, sum-exp, target logit
    if not sequence_parallel:
        # per layer: 2 all-reduces forward (attention out, MLP out) + 2 backward (their inputs);
        # plus the embedding's forward all-reduce and the head input's backward all-reduce.
        assert stats["tp.all_reduce"]["calls"] == 4 * layers + 2 + ce
        assert "tp.all_gather" not in stats and "tp.reduce_scatter" not in stats
        assert stats["tp.all_reduce"]["bytes"] == (4 * layers + 2) * act + ce * B * S * 4
    else:
        # per layer: forward 2 all-gathers + 2 reduce-scatters, backward the reverse; plus the
        # embedding (reduce-scatter fwd, all-gather bwd) and the head (all-gather fwd, reduce-scatter bwd).
        # Backward also gathers each of the 2 + 2 + 1 saved input shards again for the weight
        # gradients: autograd keeps the 1/tp shard, not the gathered sequence (as Megatron's SP).
        gathers = 4 * layers + 2 + (2 * layers + 1)
        assert stats["tp.all_gather"]["calls"] == gathers
        assert stats["tp.reduce_scatter"]["calls"] == 4 * layers + 2
        assert stats["tp.all_reduce"]["calls"] == ce
        assert stats["tp.all_gather"]["bytes"] == gathers * act // world   # each rank sends its shard
        assert stats["tp.reduce_scatter"]["bytes"] == (4 * layers + 2) * act       # each rank sends the whole


class FakeEvent:
    """A stand-in for ``torch.cuda.Event``: a mark on a fake stream whose clock is ``now`` (ms)."""
    now, log = 0.0, []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self):
        self.at = FakeEvent.now
        FakeEvent.log.append("record")

    def synchronize(self):
        FakeEvent.log.append("synchronize")

    def elapsed_time(self, end):
        return end.at - self.at


class _Work:
    """An asynchronous collective whose ``wait()`` stalls the stream for ``ms`` and returns at once
    on the host (as NCCL's)."""

    def __init__(self, ms):
        self.ms = ms

    def wait(self):
        FakeEvent.now += self.ms


def test_exposed_time_is_the_streams_stall_read_lazily():
    """On CUDA a wait() is timed by events on the current stream around it, resolved only when the
    stats are read (one synchronize per span then, none per collective)."""
    FakeEvent.now, FakeEvent.log = 0.0, []
    stats = CommStats(clock=StreamClock(FakeEvent))
    group = Group("dp", [0, 1], rank_in_group=0, stats=stats)
    for ms in (3.0, 5.0):
        group._record("all_reduce", torch.zeros(2))
        group._timed(_Work(ms), "all_reduce").wait()
    group._record("all_gather", torch.zeros(4))
    with group._blocking("all_gather"):
        FakeEvent.now += 2.0
    assert "synchronize" not in FakeEvent.log  # nothing waited for until read
    assert FakeEvent.log == ["record"] * 6
    summary = stats.summary()
    approx = pytest.approx
    assert summary == {"dp.all_gather": {"calls": 1, "bytes": 16, "exposed_s": approx(0.002)},
                       "dp.all_reduce": {"calls": 2, "bytes": 16, "exposed_s": approx(0.008)}}
    assert FakeEvent.log.count("synchronize") == 3  # one per span, when read
    assert stats.summary() == summary  # read again: the same, nothing resolved twice


def test_exposed_time_on_the_host_is_host_time():
    """On CPU (gloo) the same spans are host time around the wait."""
    stats = CommStats(clock=clock_for("cpu"))
    assert isinstance(stats.clock, HostClock)
    group = Group("tp", [0, 1], rank_in_group=0, stats=stats)

    class Sleep:
        def wait(self):
            time.sleep(0.02)

    group._timed(Sleep(), "all_gather").wait()
    stats.record("tp.all_gather", torch.zeros(4))
    summary = stats.summary()
    assert summary["tp.all_gather"]["calls"] == 1 and summary["tp.all_gather"]["bytes"] == 16
    assert 0.02 <= summary["tp.all_gather"]["exposed_s"] < 10  # at least the wait
    stats.reset()
    assert stats.summary() == {} and stats.exposed == {}


def test_the_clock_follows_the_device():
    assert isinstance(clock_for("cpu"), HostClock)
    assert isinstance(clock_for(torch.device("cuda", 0)), StreamClock)  # made without a GPU
