"""A checkpoint saved under one parallel layout resumes under another: the run continues with the
losses a single process gets when it trains straight through (the same model, data and seed)."""

from __future__ import annotations

import os

import pytest
import torch

from megapretrain.errors import CheckpointError

from helpers import BASE, NEOX, PART_ITERS, PART_SPLIT, QWEN, launch_part, train_part

LAYOUTS = {
    "single": (1, []),
    "tp2_pp2_vpp2": (4, ["--parallel.tp", "2", "--parallel.pp", "2", "--parallel.vpp", "2",
                         "--parallel.sequence_parallel", "true"]),
    "tp2_dp2_zero1": (4, ["--parallel.tp", "2", "--parallel.zero", "1", "--parallel.sequence_parallel", "true"]),
    "dp2_zero2": (2, ["--parallel.zero", "2"]),
    "pp2": (2, ["--parallel.pp", "2"]),
    "dp2_zero0": (2, []),
    "dp4_zero1_shard2": (4, ["--parallel.zero", "1", "--parallel.zero_shard_size", "2"]),
    "dp2_zero3": (2, ["--parallel.zero", "3"]),
}
CASES = [("tp2_pp2_vpp2", "single", ()), ("single", "tp2_dp2_zero1", ()),
         ("dp2_zero2", "pp2", ("--model.tie_embeddings", "true")), ("tp2_dp2_zero1", "dp2_zero2", ()),
         # the same layout, another cut of the optimizer state (ZeRO stage, hybrid shard groups)
         ("dp2_zero2", "dp2_zero0", ()), ("dp4_zero1_shard2", "single", ()),
         ("dp2_zero3", "tp2_dp2_zero1", ("--model.tie_embeddings", "true")),
         # the other families reshard through the same spec table
         ("tp2_dp2_zero1", "single", NEOX), ("pp2", "dp2_zero3", QWEN)]


FAMILY = {NEOX: "-gpt_neox", QWEN: "-qwen"}


@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed, model_flags", CASES,
                         ids=[f"{a}-to-{b}{FAMILY.get(m, '')}" for a, b, m in CASES])
def test_resume_under_another_layout_continues_the_single_process_run(saved, resumed, model_flags, corpus,
                                                                       tmp_path):
    straight = launch_part(1, str(tmp_path / "straight"), corpus, PART_ITERS, list(model_flags))[0]
    run = str(tmp_path / "run")
    launch_part(LAYOUTS[saved][0], run, corpus, PART_SPLIT, [*LAYOUTS[saved][1], *model_flags])
    results = launch_part(LAYOUTS[resumed][0], run, corpus, PART_ITERS, [*LAYOUTS[resumed][1], *model_flags])
    record = results[0]
    assert [r["iter"] for r in record["resumed"]] == [PART_SPLIT]
    assert ("resharded_from" in record["resumed"][0]) == (LAYOUTS[saved] != LAYOUTS[resumed])
    for it in range(1, PART_ITERS + 1):  # before the split from the first run, after it from the resumed one
        assert record["losses"][it] == pytest.approx(straight["losses"][it], rel=1e-5), it
    # weights to 5e-5: elements whose gradient is ~0 take Adam steps that hinge on summation order
    merged = {k: v for r in results for k, v in r["params"].items()}
    assert set(merged) == set(straight["params"])
    for name, ref in straight["params"].items():
        torch.testing.assert_close(merged[name], ref, rtol=1e-4, atol=5e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_a_checkpoint_of_another_model_is_refused(corpus, tmp_path):
    run = str(tmp_path / "run")
    launch_part(1, run, corpus, 1, [])
    with pytest.raises(ValueError, match=r"checkpoint has no weight 'layers\.[45]\..*another model"):
        train_part(0, 1, run, corpus, 2, ["--model.num_layers", "6"])


def test_reshard_reports_a_missing_parameter(corpus, tmp_path):
    from megapretrain.checkpoint.format import read_metadata, read_rank_state
    from megapretrain.checkpoint.reshard import SavedShards
    run = str(tmp_path / "run")
    launch_part(1, run, corpus, 1, [])
    path = os.path.join(run, "checkpoints", "iter_0000001")
    saved = SavedShards(path, read_metadata(path))
    with pytest.raises(CheckpointError, match="has no 'layers.9.mlp.up_proj.weight'"):
        saved.flat_shard("layers.9.mlp.up_proj.weight", "master", 0, 10)
    numel = read_rank_state(path, 0)["model"]["norm.weight"].numel()
    with pytest.raises(CheckpointError, match="saved from another model"):
        saved.flat_shard("norm.weight", "master", 0, numel - 1)


def test_slices_are_cut_from_the_overlapping_saved_shards(tmp_path):
    """tp 4 → 2 and → 1 on synthetic files: a vocabulary-padded row-split weight (zero 0 whole shards)
    and a column-split weight saved as ZeRO ranges spread over two dp ranks."""
    from megapretrain.checkpoint.reshard import SavedShards, resharded_state
    from megapretrain.model.args import padded_vocab_size
    from megapretrain.parallel.specs import Sharding, make_spec

    vocab, hidden, cols, div = 50, 6, 8, 4
    gen = torch.Generator().manual_seed(0)
    emb = torch.randn(vocab, hidden, generator=gen)            # split along rows (vocabulary)
    down = torch.randn(hidden, cols, generator=gen)            # split along columns
    moments = {k: (emb * i, down * i) for i, k in ((2.0, "exp_avg"), (3.0, "exp_avg_sq"))}
    old_tp, dp = 4, 2
    padded = padded_vocab_size(vocab, div, old_tp)
    rows = padded // old_tp
    path = tmp_path / "iter_0000007"
    path.mkdir()
    for rank in range(old_tp * dp):  # grid (pp, dp, tp): rank = dp_rank * tp + tp_rank
        d, t = divmod(rank, old_tp)
        emb_pad = torch.cat([emb, torch.zeros(padded - vocab, hidden)])
        shard = lambda full, dim, t=t: full.chunk(old_tp, dim)[t].contiguous()
        flat = shard(down, 1).reshape(-1)
        half = flat.numel() // 2
        rng = (0, half) if d == 0 else (half, flat.numel())  # ZeRO: each dp rank saved half of it
        params = {"embed_tokens.weight": {"start": 0, "end": rows * hidden,
                                          **{k: shard(torch.cat([m[0], torch.zeros(padded - vocab, hidden)]), 0)
                                             .reshape(-1) for k, m in moments.items()}},
                  "layers.0.mlp.down_proj.weight": {"start": rng[0], "end": rng[1],
                                                    **{k: shard(m[1], 1).reshape(-1)[rng[0]:rng[1]]
                                                       for k, m in moments.items()}}}
        state = {"iteration": 7, "consumed_samples": 56,
                 "model": {"embed_tokens.weight": shard(emb_pad, 0),
                           "layers.0.mlp.down_proj.weight": {"start": rng[0], "end": rng[1],
                                                             "master": flat[rng[0]:rng[1]].clone()}},
                 "optimizer": {"step": 7, "params": params, "scaler": {"scale": 1.0, "clean_steps": 0}}}
        torch.save(state, path / f"rank_{rank:05d}.pt")
    meta = {"world_size": old_tp * dp, "layout": {"tp": old_tp, "pp": 1, "dp": dp}}
    saved = SavedShards(str(path), meta)
    for tp in (1, 2):
        new_rows = padded_vocab_size(vocab, div, tp) // tp
        for tp_rank in range(tp):
            specs = {"embed_tokens.weight": make_spec("embed_tokens.weight", torch.empty(new_rows, hidden),
                                                      Sharding(tp_dim=0, vocab_rows=vocab), tp, layer=None),
                     "layers.0.mlp.down_proj.weight": make_spec("layers.0.mlp.down_proj.weight",
                                                                torch.empty(hidden, cols // tp), Sharding(tp_dim=1),
                                                                tp, layer=0)}
            out = resharded_state(saved, specs, tp_rank, tp, padded)
            emb_new = torch.cat([emb, torch.zeros(new_rows * tp - vocab, hidden)]).chunk(tp, 0)[tp_rank]
            torch.testing.assert_close(out["model"]["embed_tokens.weight"], emb_new, rtol=0, atol=0)
            torch.testing.assert_close(out["model"]["layers.0.mlp.down_proj.weight"], down.chunk(tp, 1)[tp_rank],
                                       rtol=0, atol=0)
            torch.testing.assert_close(out["optimizer"]["params"]["layers.0.mlp.down_proj.weight"]["exp_avg_sq"],
                                       (down * 3.0).chunk(tp, 1)[tp_rank], rtol=0, atol=0)
            assert out["iteration"] == 7 and out["optimizer"]["step"] == 7


def test_offline_reshard_writes_a_checkpoint_the_target_layout_loads_as_its_own(corpus, tmp_path):
    from megapretrain.commands import reshard_checkpoint as tool
    straight = launch_part(1, str(tmp_path / "straight"), corpus, PART_ITERS, [])[0]
    run = str(tmp_path / "run")
    launch_part(1, run, corpus, PART_SPLIT, [])
    out = str(tmp_path / "tp2pp2")
    layout = ["--parallel.tp", "2", "--parallel.pp", "2", "--parallel.vpp", "2", "--parallel.sequence_parallel", "true"]
    assert tool.main(["--checkpoint", run, "--output", out, "--world-size", "4", *BASE, *layout]) == 0
    results = launch_part(4, str(tmp_path / "target"), corpus, PART_ITERS, [*layout, "--checkpoint.load", out])
    resumed = results[0]["resumed"]
    assert [r["iter"] for r in resumed] == [PART_SPLIT] and "resharded_from" not in resumed[0]  # loaded as is
    for it in range(PART_SPLIT + 1, PART_ITERS + 1):
        assert results[0]["losses"][it] == pytest.approx(straight["losses"][it], rel=1e-5), it

    replicas = str(tmp_path / "dp2")
    assert tool.main(["--checkpoint", run, "--output", replicas, "--world-size", "2", *BASE, "--parallel.zero",
                      "1"]) == 0
    a, b = (os.stat(os.path.join(replicas, f"rank_0000{i}.safetensors")) for i in (0, 1))
    assert (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev)  # dp replicas share one file
    assert tool.main(["--checkpoint", run, "--output", replicas, "--world-size", "2", *BASE]) == 2  # not empty
    assert tool.main(["--checkpoint", run, "--output", str(tmp_path / "x"), "--world-size", "3", *BASE,
                      "--parallel.tp", "2"]) == 2  # 2 does not divide 3
