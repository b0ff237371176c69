"""The communication that tensor parallelism costs, counted per collective, matches the analysis."""

from __future__ import annotations

import pytest

from megapretrain.parallel.state import ParallelState

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
