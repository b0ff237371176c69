"""Every valid (pp, vpp, micro-batches) combination runs to completion on real ranks: no deadlock."""

from __future__ import annotations

import pytest
import torch

from megapretrain.errors import PipelineError
from megapretrain.parallel.layout import chunk_layers
from megapretrain.parallel.pipeline import P2P, SCHEDULES, PipelineExecutor, resolve_schedule
from megapretrain.parallel.state import ParallelState

from distributed import run_distributed
from helpers import build, make_tokens, tiny_args

SEQ, MBS = 16, 2


def _grid(rank, world, combos):
    ps = ParallelState(pp=world)
    tokens = make_tokens(batch=8 * MBS, seq=SEQ)
    completed = []
    for vpp, m, kind in combos:
        args = tiny_args(num_layers=world * vpp)
        chunks = []
        for v, ids in enumerate(chunk_layers(args.num_layers, world, vpp, ps.pp_rank)):
            model = build(ps, args)
            # keep only this chunk's layers (build() makes a whole model): the same module, trimmed
            model.layers = torch.nn.ModuleDict({str(i): model.layers[str(i)] for i in ids})
            model.pre_process = ps.is_first_stage and v == 0
            model.post_process = ps.is_last_stage and v == vpp - 1
            chunks.append(model)
        p2p = P2P(ps.pp, (MBS, SEQ, args.hidden_size), torch.float32, torch.device("cpu"))
        executor = PipelineExecutor(ps.pp_rank, world, vpp, p2p,
                                    lambda last, split=None: torch.enable_grad(), SCHEDULES[kind])
        losses, outputs = [], []

        def forward(chunk, micro, hidden, chunks=chunks, losses=losses, outputs=outputs):
            model = chunks[chunk]
            batch = tokens[micro * MBS:(micro + 1) * MBS]
            out = model(batch[:, :-1] if model.pre_process else hidden,
                        batch[:, 1:] if model.post_process else None)
            if model.post_process:
                losses.append(out.detach().mean())
                return out.mean()
            outputs.append(out)
            return out

        executor.run(SCHEDULES[kind].orders(world, vpp, m), m, forward)
        # every activation sent on was released once the next stage had it
        completed.append((vpp, m, kind, len(losses), [o.numel() for o in outputs] == [1] * len(outputs)))
    return completed


@pytest.mark.parametrize("pp", [2, 4])
def test_every_valid_combination_completes(pp):
    combos = []
    for vpp in (1, 2):
        for m in range(1, 9):
            # every schedule whose backward runs whole (tests/test_zero_bubble.py runs the others)
            for kind in (s.name for s in SCHEDULES.values() if not s.split_backward):
                try:
                    if resolve_schedule(kind, pp, vpp, m).name == kind:
                        combos.append((vpp, m, kind))
                except PipelineError:
                    continue
    results = run_distributed(_grid, pp, combos, timeout=240)
    assert results[0] == [(vpp, m, kind, 0, True) for vpp, m, kind in combos]
    assert results[-1] == [(vpp, m, kind, m, True) for vpp, m, kind in combos]  # the last stage saw every loss
