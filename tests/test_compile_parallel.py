"""``train.compile: true`` under the parallel layouts: tensor parallelism with sequence parallelism,
pipeline parallelism, and recomputation (with dropout) — the compiled run gives eager's losses.

fp32 on CPU (inductor's C++ backend): compiled and eager differ only by the order of floating
point operations, so 1e-4 relative over a few steps."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from helpers import losses_close, train_losses

SP = ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"]
COMPILE = ["--train.compile", "true"]


def _both(tmp_path, corpus, world: int, flags: list[str]) -> tuple[list, list]:
    eager = run_distributed(train_losses, world, str(tmp_path / "eager"), corpus, flags, timeout=600)
    compiled = run_distributed(train_losses, world, str(tmp_path / "compiled"), corpus, [*flags, *COMPILE], timeout=900)
    return eager, compiled


@pytest.mark.parametrize("flags", [
    pytest.param(SP, id="tp2-sp"),
    pytest.param(["--parallel.pp", "2"], id="pp2"),
])
def test_compile_trains_like_eager_in_parallel(tmp_path, corpus, flags):
    eager, compiled = _both(tmp_path, corpus, 2, flags)
    for got, want in zip(compiled, eager):
        assert losses_close(got, want, 1e-4), (got, want)


def _sp_graph_breaks(rank, world):
    """Dynamo's graph breaks over two steps of a 2-layer tp=2 sequence-parallel model, compiled."""
    from torch._dynamo.utils import counters

    from megapretrain.model.build import compile_layers
    from megapretrain.parallel.state import ParallelState

    from helpers import build, make_tokens, tiny_args

    torch._dynamo.reset()
    counters.clear()
    model = build(ParallelState(tp=2), tiny_args(num_layers=2), sequence_parallel=True)
    compile_layers(model, torch.device("cpu"))
    tokens = make_tokens(batch=2, seq=16, seed=0)
    for _ in range(2):
        model(tokens[:, :-1], tokens[:, 1:]).sum().backward()
    return dict(counters["graph_break"])


def test_sequence_parallel_collectives_are_traced():
    """The reduce-scatters and all-gathers of sequence parallelism are traced into the compiled
    layer as functional collectives (no break at an async handle, its wait, or the accounting);
    what still breaks the graph is where the gathered input is registered so that backward keeps
    only this rank's shard of it (parallel/tensor.py's SavedShards)."""
    breaks = run_distributed(_sp_graph_breaks, 2, timeout=600)[0]
    reasons = "\n".join(breaks)
    assert "async_op" not in reasons and "Work" not in reasons and "side effect" not in reasons, reasons
    assert all("data_ptr" in reason for reason in breaks), reasons


def test_compile_with_full_recompute_and_dropout(tmp_path, corpus):
    """Dropout inside the compiled layers draws inductor's random numbers, not eager's, so the
    losses are not eager's; what must hold is that the recomputation replays the same masks: the
    recomputed run's losses are those of the compiled run that keeps its activations."""
    flags = ["--model.attention_dropout", "0.1", "--model.hidden_dropout", "0.1", *COMPILE]
    kept = train_losses(0, 1, str(tmp_path / "kept"), corpus, flags)
    recomputed = train_losses(0, 1, str(tmp_path / "recomputed"), corpus, [*flags, "--parallel.recompute", "full"])
    assert losses_close(recomputed, kept, 1e-5), (recomputed, kept)


def test_compile_with_selective_recompute_and_attention_dropout(tmp_path, corpus):
    """Selective recomputation with attention dropout: the checkpointed attention core runs
    eagerly (its RNG-restoring context is outside what Dynamo traces), from the tracker's
    tensor-parallel stream as in eager mode, so compiled and eager give the same losses."""
    flags = ["--model.attention_dropout", "0.1", "--parallel.recompute", "selective"]
    eager = train_losses(0, 1, str(tmp_path / "eager"), corpus, flags)
    compiled = train_losses(0, 1, str(tmp_path / "compiled"), corpus, [*flags, *COMPILE])
    assert losses_close(compiled, eager, 1e-4), (compiled, eager)
