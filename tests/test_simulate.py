"""tools/simulate.py: the trainer's own program for one rank of a large world on fake tensors — its
result's contract, the figures it must get right by construction, the GPU step reading nothing
back, Llama 3 8B at its config's layout, and what real shapes and fake tensors revealed."""

from __future__ import annotations

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megapretrain.commands import simulate as command
from megapretrain.config import load_config
from megapretrain.model.decoder import num_parameters
from megapretrain.parallel.state import Group
from megapretrain.parallel.tensor import SavedShards
from megapretrain.resolve import resolve
from megapretrain.simulate.measure import CATEGORIES
from megapretrain.simulate.report import role_ranks
from megapretrain.simulate.run import planned, simulate_rank

TINY = ["--model.vocab_size", "300", "--model.num_layers", "4", "--model.hidden_size", "64", "--model.num_heads", "4",
        "--model.num_kv_heads", "2", "--model.ffn_hidden_size", "128", "--train.seq_length", "64",
        "--train.precision", "bf16"]


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = command.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_contract_for_every_role(capsys, tmp_path):
    """--roles --json: one object, a rank per distinct stage, every part of the breakdown, the
    parts adding up to the peak, traffic per group and op, FLOPs, checkpoint bytes; --output
    writes the same object and a Markdown report."""
    code, out, _ = _cli(capsys, "--config", "configs/tiny.yaml", "--world-size", "16", "--roles", "--steps", "1",
                        "--json", "--output", str(tmp_path), *TINY, "--parallel.tp", "2", "--parallel.pp", "4",
                        "--parallel.sequence_parallel", "true", "--parallel.zero", "1", "--train.micro_batch_size", "1",
                        "--train.global_batch_size", "8")
    assert code == 0
    doc = json.loads(out)
    assert doc == json.loads((tmp_path / "report.json").read_text())
    assert "# Simulated ranks" in (tmp_path / "report.md").read_text()
    assert doc["world_size"] == 16 and doc["layout"]["pp"] == 4 and doc["layout"]["dp"] == 2
    assert [r["coords"]["pp"] for r in doc["ranks"]] == [0, 1, 2, 3]
    for r in doc["ranks"]:
        assert set(r["breakdown"]) == set(CATEGORIES)
        assert sum(r["breakdown"].values()) == r["peak_bytes"] > 0
        assert r["planned_peak_bytes"] > 0 and r["flops"] > 0 and r["checkpoint_bytes"] > 0
        assert r["comm_bytes"]["pp"]["send"] == r["comm_bytes"]["pp"]["recv"] > 0
        assert r["comm_bytes"]["tp"]["all_gather"] > 0 and r["comm_bytes"]["dp"]["reduce_scatter"] > 0
    first, last = doc["ranks"][0], doc["ranks"][-1]
    assert first["breakdown"]["pipeline_in_flight"] > last["breakdown"]["pipeline_in_flight"]  # 1F1B's warmup


def test_a_stage_s_ranks_hold_and_move_the_same_whatever_their_tp_dp_place():
    """What --roles rests on: the ranks of a pipeline stage differ by their stage, not their tp or
    dp place — here with a vocabulary (301) that tp pads and ZeRO-3 shards of every parameter over
    dp × cp — so one rank per stage tells them all (its checkpoint file to a few header bytes). (cp
    places: the next test.)"""
    cfg = load_config("configs/tiny.yaml", TINY + ["--model.vocab_size", "301", "--parallel.tp", "2", "--parallel.cp",
                                                   "2", "--parallel.pp", "2", "--parallel.sequence_parallel", "true",
                                                   "--parallel.zero", "3", "--train.micro_batch_size", "1",
                                                   "--train.global_batch_size", "4"])
    world = 16
    grid = resolve(cfg, world).layout.grid()  # [pp, dp, cp, tp]
    for stage in (0, 1):
        ranks = [grid[stage, 0, 0, 0], grid[stage, 1, 0, 1], grid[stage, 1, 0, 0], grid[stage, 0, 0, 1]]
        results = [simulate_rank(cfg, world, int(r), steps=1) for r in ranks]
        for r in results[1:]:
            assert (r.peak_bytes, r.breakdown) == (results[0].peak_bytes, results[0].breakdown), (stage, r.coords)
            assert (r.comm_bytes, r.comm_calls) == (results[0].comm_bytes, results[0].comm_calls), (stage, r.coords)
            assert r.flops == results[0].flops, (stage, r.coords)
            # the file's header names each parameter its ZeRO shard cuts: which ones, by its dp place
            assert abs(r.checkpoint_bytes - results[0].checkpoint_bytes) < 4096, (stage, r.coords)


def test_cp_places_move_the_same_and_peak_highest_at_an_end():
    """What --roles rests on for context parallelism: every cp place issues the same collectives,
    and its attention reads key ranges affine in the place, so the peaks — which may differ — are
    largest at place 0 or cp − 1 (simulate/report.py's docstring). Every place of cp 4, simulated."""
    cfg = load_config("configs/tiny.yaml", TINY + ["--parallel.cp", "4", "--train.seq_length", "2048",
                                                   "--parallel.zero", "1", "--train.micro_batch_size", "1",
                                                   "--train.global_batch_size", "2"])
    world = 8  # cp 4 × dp 2
    grid = resolve(cfg, world).layout.grid()  # [pp, dp, cp, tp]
    results = [simulate_rank(cfg, world, int(grid[0, 0, c, 0]), steps=1) for c in range(4)]
    for r in results[1:]:
        assert (r.comm_bytes, r.comm_calls) == (results[0].comm_bytes, results[0].comm_calls), r.coords
        assert r.flops == results[0].flops, r.coords
    peaks = [r.peak_bytes for r in results]
    assert max(peaks) == max(peaks[0], peaks[-1]), peaks
    assert [c for _, c in role_ranks(resolve(cfg, world).layout)] == ["the only stage, cp 0", "the only stage, cp 3"]


def test_a_cp_rank_simulated_as_a_gpu_holds_no_attention_mask():
    """A GPU runs each context-parallel query chunk's lower-right causal attention in its flash
    kernel, with no mask; on CPU tensors torch materializes a (s/2cp, keys) mask per chunk and
    keeps it for the backward. Simulated as a GPU, a cp 2 rank at 8,192 tokens holds nothing the
    size of a chunk's mask at its peak, and its peak is under the CPU program's by masks it
    never made."""
    cfg = load_config("configs/tiny.yaml", TINY + ["--parallel.cp", "2", "--train.seq_length", "8192",
                                                   "--train.micro_batch_size", "1", "--train.global_batch_size", "1"])
    chunk = 8192 // 4
    mask = chunk * 2 * chunk  # bytes of the smallest chunk mask as bools: 2,048 queries × 4,096 keys
    gpu = simulate_rank(cfg, 2, 0, steps=1, device="cuda")
    cpu = simulate_rank(cfg, 2, 0, steps=1, device="cpu")
    assert max(a["bytes"] for a in gpu.peak_allocations) < mask, gpu.peak_allocations
    assert max(a["bytes"] for a in cpu.peak_allocations) >= mask  # the CPU program's masks, kept for backward
    assert gpu.peak_bytes < cpu.peak_bytes - mask
    assert gpu.comm_bytes == cpu.comm_bytes


def test_bad_flags_are_one_line(capsys, tmp_path):
    code, _, err = _cli(capsys, "--config", "configs/tiny.yaml", "--world-size", "4", "--rank", "4", *TINY)
    assert code == 2 and "--rank: 4 is not a rank of a world of 4" in err and err.count("\n") == 1
    code, _, err = _cli(capsys, "--config", "configs/tiny.yaml", "--world-size", "4", "--rank", "-1", *TINY)
    assert code == 2 and "--rank: -1 is not a non-negative integer" in err and err.count("\n") == 1
    code, _, err = _cli(capsys, "--config", "configs/tiny.yaml", "--world-size", "nan", *TINY)
    assert code == 2 and "--world-size: 'nan' is not a positive integer" in err
    code, _, err = _cli(capsys, "--config", "configs/tiny.yaml", "--world-size", "4", "--data.tokenizer.type",
                        "HuggingFaceTokenizer", "--data.tokenizer.model", str(tmp_path / "none"))
    assert code == 2 and "model.vocab_size is null" in err and "128256" not in err
    code, _, err = _cli(capsys, "--config", "configs/tiny.yaml", "--world-size", "6", *TINY, "--parallel.tp", "4")
    assert code == 2 and "must divide the world size 6" in err
    (tmp_path / "report.md").write_text("mine")
    code, _, err = _cli(capsys, "--config", "configs/tiny.yaml", "--world-size", "1", "--output", str(tmp_path), *TINY)
    assert code == 2 and "exists; pass --overwrite" in err and (tmp_path / "report.md").read_text() == "mine"


def test_a_rampup_the_world_size_refuses_is_a_warning_and_the_full_batch_is_simulated(capsys):
    """A ramp-up whose first batch, 2 samples, is less than one a rank at dp 4: train.py refuses it
    on 8 ranks, the full batch is not refused. The tool simulates the full batch's steps and says, in
    a warning, what train.py refuses."""
    ramp = ["--parallel.pp", "2", "--train.micro_batch_size", "1", "--train.global_batch_size", "8",
            "--train.rampup_batch_size", "[2, 2, 100]"]
    code, out, err = _cli(capsys, "--config", "configs/tiny.yaml", "--world-size", "8", "--json", *TINY, *ramp)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["layout"]["micro_batches"] == 2 and doc["ranks"][0]["peak_bytes"] > 0
    [warning] = doc["warnings"]
    assert "train.rampup_batch_size=[2, 2, 100]" in warning and "train.py refuses" in warning, warning
    code, out, err = _cli(capsys, "--config", "configs/tiny.yaml", "--world-size", "8", "--json", *TINY, *ramp[:-2])
    assert code == 0 and json.loads(out)["warnings"] == []


def test_llama3_405b_ramp_up_resolves_at_16384_gpus():
    """The shipped 405B config at Llama 3's 16,384-GPU layout (tp 8 × pp 16 × dp 128): its
    ramp-up's first batch, 512 samples, is 4 micro-batches a rank on 16 interleaved stages, which
    the interleaved schedule runs (one group shorter than pp), so train.py takes it and the
    simulation warns of nothing."""
    from megapretrain.simulate.run import rampup_refusal

    cfg = load_config("configs/llama3_405b.yaml", [])
    assert cfg.train.rampup_batch_size[0] == 512
    run = resolve(cfg, 16384)
    assert (run.layout.tp, run.layout.pp, run.layout.dp, run.layout.vpp) == (8, 16, 128, 2)
    assert run.sizes.schedule.name == "interleaved" and rampup_refusal(cfg, 16384) is None


@pytest.mark.parametrize("layout", [
    ["--parallel.pp", "2", "--parallel.vpp", "2", "--parallel.zero", "1", "--parallel.recompute", "full"],
    ["--parallel.tp", "2", "--parallel.sequence_parallel", "true", "--parallel.zero", "3"],
    ["--parallel.cp", "2", "--parallel.zero", "2", "--parallel.recompute", "selective"],
])
def test_the_gpu_step_reads_nothing_back_from_the_device(layout):
    """The GPU program's training step (loss, grad norm, clipping, the skip of a non-finite step)
    stays on the device: the simulation answers no host read."""
    cfg = load_config("configs/tiny.yaml", TINY + layout + ["--train.micro_batch_size", "1",
                                                             "--train.global_batch_size", "8"])
    world = 4
    for rank, _ in role_ranks(resolve(cfg, world).layout):
        assert simulate_rank(cfg, world, rank, steps=1, device="cuda").host_reads == []


def test_saved_shards_tell_fake_storages_apart():
    """Sequence parallelism saves a gathered input as its shard, keyed by the input's storage:
    fake tensors all have data pointer 0, so it is the storage itself that tells them apart."""
    group = Group("tp", [0, 1], None, 0)
    saved = SavedShards()
    with FakeTensorMode():
        shards = [torch.empty(2, 4, 8), torch.empty(2, 4, 8)]
        fulls = [torch.empty(2, 8, 8), torch.empty(2, 8, 8)]
        other = torch.empty(2, 8, 8)
        for shard, full in zip(shards, fulls):
            saved.register(shard, group, full)
        packed = [saved._pack(full[:, :3]) for full in fulls]
        assert saved._pack(other) is other  # not a gathered input: saved as it is
    assert [p[0].shard for p in packed] == shards


@pytest.mark.slow  # the whole 8B model at 8,192 tokens: 40-80 s of CPU
@pytest.mark.ci  # the one full-size rank CI simulates
def test_llama3_8b_rank_at_its_layout():
    """Llama 3 8B at its config's layout (64 GPUs, dp 64, ZeRO-2): one rank's weights are the
    model's parameters in bf16, its optimizer state 1/64 of its fp32 bytes,
    and every micro-batch's gradients are reduce-scattered (ZeRO-2) in fp32."""
    cfg = load_config("configs/llama3_8b.yaml", [])
    run = resolve(cfg, 64)
    r = simulate_rank(cfg, 64, 0, steps=1)
    params = num_parameters(run.model)  # 8.03B: no vocabulary padding at tp 1
    assert params * 2 <= r.breakdown["parameters"] <= params * 2 * 1.0001  # + 64-element alignment
    adam = 4 + 8 + 1 / 8  # fp32 master, two moments, the Triton AdamW's weight-decay bit mask
    assert params * adam / 64 <= r.breakdown["optimizer"] <= params * adam / 64 * 1.001
    assert r.comm_calls["dp"]["all_gather"] > 0
    micro = run.sizes.grad_accum
    assert params * 4 * micro <= r.comm_bytes["dp"]["reduce_scatter"] <= params * 4 * micro * 1.001
    assert r.host_reads == [] and sum(r.breakdown.values()) == r.peak_bytes
    plan = planned(cfg, run, 0)
    assert abs(plan["planned_peak_bytes"] - r.peak_bytes) <= 0.05 * r.peak_bytes, (plan, r.breakdown)


def test_zero2_frees_each_bucket_s_full_gradients_as_the_next_reduction_starts():
    """ZeRO-2 keeps a bucket's full fp32 gradients only while its reduce-scatter is in flight: at a
    fully recomputed 8B rank's peak, the shard plus the output layer's own gradients and a bucket or
    two — not the whole model's fp32 gradients, which it held until each backward's end before."""
    cfg = load_config("configs/llama3_8b.yaml", ["--model.num_layers", "4", "--parallel.recompute", "full",
                                                  "--train.global_batch_size", "128", "--train.rampup_batch_size",
                                                  "null"])
    run = resolve(cfg, 64)
    r = simulate_rank(cfg, 64, 0, steps=1)
    params = num_parameters(run.model)
    head = run.model.padded_vocab(1) * run.model.hidden_size  # the output layer: a bucket of its own
    largest = run.model.ffn_hidden_size * run.model.hidden_size  # the largest parameter of a layer
    assert r.breakdown["gradients"] <= 4 * (params / 64 + head + 2 * largest) * 1.001
    assert r.breakdown["gradients"] < 4 * params / 2  # the whole model's would be 4 × params


@pytest.mark.parametrize("zero,bucket", [("1", ["--parallel.bucket_size_mb", "16384"]), ("3", [])],
                         ids=["zero1-one-bucket", "zero3-one-unit"])
def test_a_bucket_over_2_31_elements_is_built_reduced_and_stepped(zero, bucket):
    """One Llama 3 405B layer at tp 1 holds 3.2 billion elements, over 2^31: as one ZeRO-1 bucket
    (16 GiB of buckets) or one ZeRO-3 unit, it is laid out at offsets past 2^31, reduce-scattered,
    gathered and stepped on fake tensors, and every size comes out whole — an int32 on the way
    (an offset, a shard bound, a count of bytes) would wrap it."""
    cfg = load_config("configs/llama3_405b.yaml", [
        "--model.num_layers", "1", "--model.vocab_size", "256", "--parallel.tp", "1", "--parallel.pp", "1",
        "--parallel.vpp", "1", "--parallel.pipeline_layers", "null", "--parallel.sequence_parallel", "false",
        "--parallel.zero", zero, *bucket, "--train.seq_length", "64", "--train.micro_batch_size", "1",
        "--train.global_batch_size", "2", "--train.rampup_batch_size", "null"])
    world = 2
    run = resolve(cfg, world)
    params = num_parameters(run.model)
    layer = params - 2 * 256 * run.model.hidden_size - run.model.hidden_size  # less embedding, head, final norm
    assert layer > 2**31
    r = simulate_rank(cfg, world, 1, steps=1)
    assert params * 4 <= r.comm_bytes["dp"]["reduce_scatter"] <= params * 4 * 1.0001  # fp32 grads, once
    assert params <= r.comm_bytes["dp"]["all_gather"]  # each bf16 half of the weights gathered (at least once)
    adam = 4 + 8 + 1 / 8  # fp32 master, two moments, the Triton AdamW's weight-decay bit mask
    assert params * adam / 2 <= r.breakdown["optimizer"] <= params * adam / 2 * 1.0001
    plan = planned(cfg, run, 0)
    assert (plan["planned_comm_bytes"], plan["planned_comm_calls"]) == (r.comm_bytes, r.comm_calls)
    assert r.host_reads == [] and sum(r.breakdown.values()) == r.peak_bytes


def test_the_planned_memory_leaves_offloaded_optimizer_state_off_the_device():
    """optim.offload: the planner's figure beside a simulated 8B rank drops by the optimizer part
    (fp32 masters and Adam moments, now host memory, reported as such); the rest is unchanged."""
    cfg = load_config("configs/llama3_8b.yaml", [])
    run = resolve(cfg, 64)
    on_device = planned(cfg, run, 0)
    cfg.optim.offload = True
    offloaded = planned(cfg, run, 0)
    state = offloaded["planned_host_optimizer_bytes"]
    assert on_device["planned_host_optimizer_bytes"] == 0 and state > 0
    assert offloaded["planned_breakdown"]["optimizer"] == 0
    # the device keeps none of it (nor the GPU AdamW's weight-decay mask: the host steps)
    dropped = on_device["planned_breakdown"]["optimizer"]
    assert offloaded["planned_peak_bytes"] == pytest.approx(on_device["planned_peak_bytes"] - dropped, abs=2)
    params = num_parameters(run.model)
    assert params * 12 / 64 <= state <= params * 12 / 64 * 1.001  # fp32 master + two moments a shard


def test_the_measured_memory_keeps_offloaded_optimizer_state_in_host_memory():
    """optim.offload on a simulated rank: masters and moments are host memory, measured apart as
    host_optimizer_bytes (the planner's host figure, to the shards' padding) and in no part of the
    device's breakdown; the device's peak drops, as the planned one does."""
    flags = TINY + ["--parallel.zero", "1", "--train.micro_batch_size", "1", "--train.global_batch_size", "8"]
    cfg = load_config("configs/tiny.yaml", flags)
    on_device = simulate_rank(cfg, 2, 0, steps=1)
    cfg = load_config("configs/tiny.yaml", flags + ["--optim.offload", "true"])
    offloaded = simulate_rank(cfg, 2, 0, steps=1)
    plan = planned(cfg, resolve(cfg, 2), 0)
    assert on_device.host_optimizer_bytes == 0 and on_device.breakdown["optimizer"] > 0
    assert offloaded.breakdown["optimizer"] == 0 and sum(offloaded.breakdown.values()) == offloaded.peak_bytes
    host = plan["planned_host_optimizer_bytes"]
    assert host <= offloaded.host_optimizer_bytes <= host * 1.002
    assert offloaded.peak_bytes < on_device.peak_bytes
    assert offloaded.to_json()["host_optimizer_bytes"] == offloaded.host_optimizer_bytes
