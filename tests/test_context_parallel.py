"""Context parallelism: each sequence split over the cp ranks, attention over all of it.

The pieces (the load-balanced split, the masks by global position and document, the K/V
all-gather, ring and all-to-all attention), then the real trainer under cp: its ranks' dropout
streams, evaluation against one process, a cp=2 checkpoint resuming at cp=1 on the
single-process curve and the other way round; the validation, the planner's model of cp, and the
Triton kernels under cp. The cp layouts against one process are cases of tests/layouts.py.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest
import torch

from megapretrain.config import ConfigError, load_config
from megapretrain.model.args import ModelArgs
from megapretrain.model.decoder import DecoderModel, documents
from megapretrain.monitor.flops import DEVICES
from megapretrain.parallel.context import (
    causal_mask,
    gather_kv_from_cp,
    gathered_positions,
    local_positions,
    query_chunks,
    split_to_cp,
)
from megapretrain.parallel.random import RNGTracker
from megapretrain.parallel.state import Group, ParallelState, grid_groups, shard_groups
from megapretrain.planner import Layout, context_gather_bytes, context_sizes, estimate, search
from megapretrain.resolve import resolve
from megapretrain.train import setup

from distributed import run_distributed
from helpers import BASE, TORCH, TRITON, build, losses_close, tiny_args, train_losses
from layouts import BY_NAME

EOD = 7


def _group(size: int, rank: int) -> Group:
    """A cp group for computing positions and masks (no communication)."""
    return Group("cp", list(range(size)), None, rank)


@pytest.mark.parametrize("cp", [2, 4])
def test_every_rank_holds_two_chunks_and_as_much_attention_work(cp):
    seq = 64
    mine = [local_positions(seq, _group(cp, r)) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(mine)).values, torch.arange(seq))  # a partition of the sequence
    c = seq // (2 * cp)
    assert mine[0].tolist() == list(range(c)) + list(range(seq - c, seq))  # chunks 0 and 2·cp − 1
    assert torch.equal(gathered_positions(seq, _group(cp, 0)), torch.cat(mine))  # an all-gather's rank order
    row = torch.arange(3 * seq).view(3, seq)  # a (b, s) tensor whose values are the positions
    for r in range(cp):
        assert torch.equal(split_to_cp(row, _group(cp, r))[0], mine[r])
    # causal (query, key) pairs per rank: the same count on every rank
    pairs = [int(causal_mask(q, torch.arange(seq)).sum()) for q in mine]
    assert max(pairs) <= 1.02 * min(pairs), pairs
    assert sum(pairs) == seq * (seq + 1) // 2
    for r in range(cp):  # what the chunked attention computes: each chunk's keys, its own block lower-right
        chunks = query_chunks(2 * c, _group(cp, r))
        assert [rows.stop - rows.start for rows, _ in chunks] == [c, c]
        assert sum(c * keys - c * (c - 1) // 2 for _, keys in chunks) == pairs[r]
    contiguous = [sum(p + 1 for p in range(r * seq // cp, (r + 1) * seq // cp)) for r in range(cp)]
    assert max(contiguous) > 2 * min(contiguous)  # what the two-chunk split avoids


def test_one_rank_is_a_no_op():
    one = _group(1, 0)
    x = torch.randn(2, 3, 8, 4)
    assert split_to_cp(x, one) is x
    k, v = gather_kv_from_cp(x, x + 1, one)
    assert k is x and torch.equal(v, x + 1)
    assert torch.equal(local_positions(8, one), torch.arange(8))


def test_document_mask_follows_global_positions_and_documents():
    tokens = torch.tensor([[1, 2, EOD, 3, 4, 5, EOD, 6]])
    whole = documents(tokens, EOD, True, True)
    for r in range(2):
        cp = _group(2, r)
        share = documents(tokens, EOD, True, True, cp)
        mine = local_positions(8, cp)
        assert torch.equal(share.position_ids, whole.position_ids[:, mine])
        assert torch.equal(share.mask.dense(), whole.mask.dense()[:, :, mine])  # its queries' rows, every key


def _kv_gradients(rank, world):
    """The K/V all-gather against autograd on the whole tensor: values and reduce-scattered grads."""
    ps = ParallelState(cp=world)
    g = torch.Generator().manual_seed(3)
    k_all, v_all = torch.randn(2, 2, 16, 4, generator=g), torch.randn(2, 2, 16, 4, generator=g)
    weight = torch.randn(2, 2, 16, 4, generator=g)
    mine = local_positions(16, ps.cp)
    k = k_all[:, :, mine].clone().requires_grad_()
    v = v_all[:, :, mine].clone().requires_grad_()
    k_full, v_full = gather_kv_from_cp(k, v, ps.cp)  # (2, 2, 16, 4): every rank's keys, in global order
    # every rank's loss uses all keys; the sum over ranks is world × the one-process loss
    (((k_full + 2 * v_full) * weight).sum()).backward()
    return {"k": torch.equal(k_full, k_all), "v": torch.equal(v_full, v_all),
            "grad_k": k.grad, "grad_v": v.grad, "expected": weight[:, :, mine]}


def test_kv_all_gather_backward_is_a_reduce_scatter():
    for r in run_distributed(_kv_gradients, 2, timeout=120):
        assert r["k"] and r["v"]
        torch.testing.assert_close(r["grad_k"], 2 * r["expected"])  # both ranks' contributions, summed
        torch.testing.assert_close(r["grad_v"], 4 * r["expected"])


def _packed_losses(rank, world, tokens):
    """Per-token losses of a packed sample under cp=world, each with its global position."""
    ps = ParallelState(cp=world)
    model = DecoderModel(tiny_args(), ps.tp, cp=ps.cp)
    model.init_weights(7)  # the weights of helpers.build's one-process model
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    docs = documents(inputs, EOD, True, True, ps.cp)
    losses = model(split_to_cp(inputs, ps.cp), split_to_cp(targets, ps.cp), docs)  # (1, s/cp)
    return {"losses": losses.detach()[0], "positions": local_positions(inputs.shape[1], ps.cp)}


def test_attention_under_document_masking_equals_each_document_alone():
    """Three documents packed into one 32-token sample, split over 2 cp ranks (the middle document
    crosses both ranks' chunks): every token's loss is what its document alone gives."""
    g = torch.Generator().manual_seed(1)
    lengths = [9, 15, 9]  # + the sample's extra target token: 33 ids
    docs = [torch.cat([torch.randint(10, 290, (n - 1,), generator=g), torch.tensor([EOD])]) for n in lengths]
    packed = torch.cat(docs).unsqueeze(0)  # (1, 33)
    results = run_distributed(_packed_losses, 2, packed, timeout=120)
    together = torch.zeros(32)
    for r in results:
        together[r["positions"]] = r["losses"]
    torch.manual_seed(0)
    model = build(ParallelState(), tiny_args())
    start = 0
    for doc in docs:
        alone = model(doc[:-1].unsqueeze(0), doc[1:].unsqueeze(0))[0]  # the document on its own
        n = min(len(doc) - 1, 32 - start)
        torch.testing.assert_close(together[start:start + n], alone[:n], rtol=1e-5, atol=1e-5)
        start += len(doc)


def _model_under_cp(rank, world, tokens, comms):
    """Per-token losses and the cp-summed gradients of one forward + backward of a tiny model (8
    query heads, 4 kv heads) under each ``parallel.cp_comm`` of ``comms``, with and without
    document masking; and the bytes each exchanged over cp."""
    ps = ParallelState(cp=world, comm_stats=True)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    out = {"positions": local_positions(inputs.shape[1], ps.cp)}
    for comm in comms:
        for masked in (False, True):
            model = DecoderModel(tiny_args(), ps.tp, cp=ps.cp, cp_comm=comm, attention="blockwise")
            model.init_weights(7)
            docs = documents(inputs, EOD, True, True, ps.cp) if masked else None
            ps.stats.reset()
            losses = model(split_to_cp(inputs, ps.cp), split_to_cp(targets, ps.cp), docs)  # (b, s/cp)
            losses.sum().backward()
            grads = {name: ps.cp.all_reduce(p.grad.clone()) for name, p in model.named_parameters()}
            out[comm, masked] = {"losses": losses.detach(), "grads": grads,
                                 "sent": {k: v["bytes"] for k, v in ps.stats.summary().items()}}
    return out


def _packed_batch() -> torch.Tensor:
    """(2, 33) ids: documents of 5-26 tokens packed, crossing the cp ranks' chunks."""
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(10, 290, (2, 33), generator=g)
    tokens[0, [5, 11, 30]] = EOD
    tokens[1, [20]] = EOD
    return tokens


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ring_and_all_to_all_attention_equal_one_process(cp):
    """Ring attention and all-to-all (Ulysses) attention under cp 2 and 4, causal and document-
    masked: every token's loss and every gradient (summed over cp) of one forward and backward are
    those of one process, and the ring moves exactly its K/V blocks (forward: cp − 1 of them per
    layer; backward: cp − 1 more, and cp fp32 gradient blocks)."""
    tokens = _packed_batch()
    comms = ("ring", "a2a")
    single = _model_under_cp(0, 1, tokens, ["allgather"])
    results = run_distributed(_model_under_cp, cp, tokens, comms, timeout=300)
    args = tiny_args()
    b, s, kv, d = tokens.shape[0], tokens.shape[1] - 1, args.num_kv_heads, args.head_dim
    for comm in comms:
        for masked in (False, True):
            reference = single["allgather", masked]
            together = torch.zeros_like(reference["losses"])
            for r in results:
                together[:, r["positions"]] = r[comm, masked]["losses"]
            torch.testing.assert_close(together, reference["losses"], rtol=1e-5, atol=1e-6)
            for name, grad in reference["grads"].items():
                torch.testing.assert_close(results[0][comm, masked]["grads"][name], grad, rtol=1e-5, atol=1e-6,
                                           msg=f"{comm} {masked} {name}")
            sent = results[0][comm, masked]["sent"]
            if comm == "ring":
                block = 2 * b * (s // cp) * kv * d * 4  # K and V of one rank's tokens, fp32
                assert sent["cp.send"] == args.num_layers * ((cp - 1) * block + (cp - 1) * block + cp * block)
                assert "cp.all_gather" not in sent and "cp.all_to_all" not in sent
            else:  # one all-to-all of q, k, v and one of the output, each way
                assert "cp.all_gather" not in sent and "cp.send" not in sent
                qkv, o = b * (s // cp) * (args.num_heads + 2 * kv) * d * 4, b * (s // cp) * args.num_heads * d * 4
                assert sent["cp.all_to_all"] == args.num_layers * 2 * (qkv + o)


@pytest.mark.parametrize("flags, message", [
    (["--parallel.cp_comm", "a2a", "--model.num_kv_heads", "2", "--parallel.cp", "4"],
     r"parallel.cp_comm=a2a splits the heads over tp × cp = 1 × 4 = 4, which must divide model.num_kv_heads=2"),
    (["--parallel.cp_comm", "ring", "--parallel.cp", "2", "--model.attention_dropout", "0.1"],
     r"parallel.cp_comm=ring has no attention dropout"),
    (["--parallel.cp_comm", "gather"], r"parallel.cp_comm='gather' is not one of: allgather, ring, a2a"),
])
def test_cp_comm_that_cannot_work_is_a_one_line_error(flags, message):
    cfg = load_config(None, ["--model.vocab_size", "300", "--model.num_heads", "8", "--train.global_batch_size", "16",
                             *flags])
    with pytest.raises(ConfigError, match=message) as info:
        resolve(cfg, 4)
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------------------------
# The trainer under cp layouts against one process

CP2 = ["--parallel.cp", "2"]
DOCS = ["--data.reset_attention_mask", "true", "--data.reset_position_ids", "true", "--data.eod_mask_loss", "true"]
# the cp layouts against one process (alone and with tp + sp, pp, dp + ZeRO-1, recompute, document
# masking, ring and a2a) are cases of tests/layouts.py, run by test_parallel_equivalence.py


def _default_seed(rank, world, run_dir, corpus, flags):
    """The seed of this rank's default (dropout) stream once the trainer is set up."""
    setup(["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *BASE, *flags])
    return torch.initial_seed()


def test_cp_ranks_seed_their_default_streams_apart(corpus, tmp_path):
    """Each cp rank drops out other tokens (outside tp regions too): its stream starts elsewhere."""
    case = BY_NAME["cp2"]
    flags = [*case.model, *case.layout]
    seeds = run_distributed(_default_seed, case.world, str(tmp_path), corpus, flags, timeout=300)
    assert seeds[0] != seeds[1]


def _tracker_draws(rank, world):
    ps = ParallelState(cp=world)
    tracker = RNGTracker(5, ps.tp_rank, cp_rank=ps.cp_rank)
    with tracker.fork():
        return torch.rand(16)


def test_cp_ranks_draw_different_dropout_masks():
    a, b = run_distributed(_tracker_draws, 2, timeout=120)
    assert not torch.equal(a, b)


def _rows(rank, world, run_dir, corpus, iters, flags):
    """Train ``iters`` steps (resuming from the run's checkpoint if it has one): losses, valid losses
    and resume events of metrics.jsonl."""
    argv = ["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *BASE, *flags, "--train.iters", str(iters),
            "--schedule.decay_iters", "6"]
    setup(argv).fit()
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    return {"losses": {r["iter"]: r["loss"] for r in rows if "loss" in r},
            "valid": {r["iter"]: r["valid_loss"] for r in rows if "valid_loss" in r},
            "resumed": [r for r in rows if r.get("event") == "resumed"]}


def _launch(world, run_dir, corpus, iters, flags):
    if world == 1:
        return _rows(0, 1, run_dir, corpus, iters, flags)
    return run_distributed(_rows, world, run_dir, corpus, iters, flags, timeout=300)[0]


# the second resumes under hybrid sharding of dp × cp: each rank its own shard group, replicated over cp
RESUMES = [(2, CP2, 1, []), (1, [], 2, [*CP2, "--parallel.zero", "2", "--parallel.zero_shard_size", "1"])]


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """Six steps of one process: the curve every resumed run must stay on."""
    return _launch(1, str(tmp_path_factory.mktemp("straight")), corpus, 6, [])


@pytest.mark.parametrize("saved_world, saved, resumed_world, resumed", RESUMES,
                         ids=["cp2-to-cp1", "cp1-to-cp2_zero2_shard1"])
def test_a_checkpoint_resumes_under_another_cp_on_the_single_process_curve(saved_world, saved, resumed_world,
                                                                           resumed, straight, corpus, tmp_path):
    split = str(tmp_path / "split")
    _launch(saved_world, split, corpus, 3, saved)
    with open(os.path.join(split, "checkpoints", "iter_0000003", "metadata.json")) as fh:
        assert json.load(fh)["layout"] == {"tp": 1, "pp": 1, "dp": 1, "cp": saved_world}
    after = _launch(resumed_world, split, corpus, 6, resumed)
    assert after["resumed"][0]["resharded_from"]["cp"] == saved_world
    assert sorted(after["losses"]) == list(range(1, 7))
    for it in range(1, 7):
        assert after["losses"][it] == pytest.approx(straight["losses"][it], rel=1e-5), it


def test_evaluation_under_cp_matches_one_process(corpus, tmp_path):
    """The valid loss is a mean over every token too: the cp shares' sums added over dp × cp."""
    flags = ["--train.eval_interval", "3", "--train.eval_iters", "2", *DOCS]
    single = _launch(1, str(tmp_path / "single"), corpus, 3, flags)
    under_cp = _launch(2, str(tmp_path / "cp2"), corpus, 3, [*flags, *CP2])
    assert list(single["valid"]) == [3]
    assert under_cp["valid"][3] == pytest.approx(single["valid"][3], rel=1e-5)


def test_a_checkpoint_saved_before_cp_reads_as_cp1(tmp_path):
    from megapretrain.checkpoint.format import metadata, read_metadata, write_metadata

    meta = metadata(iteration=1, world_size=2, layout={"tp": 1, "pp": 1, "dp": 2}, vocab_size=300, padded_vocab=384,
                    files={})
    assert meta["layout"]["cp"] == 1
    del meta["layout"]["cp"]  # what a checkpoint written before context parallelism holds
    write_metadata(str(tmp_path), meta)
    assert read_metadata(str(tmp_path))["layout"] == {"tp": 1, "pp": 1, "dp": 2, "cp": 1}


# ----------------------------------------------------------------------------------------------
# Validation, the planner, the kernels


@pytest.mark.parametrize("flags, world, message", [
    (["--parallel.cp", "2", "--train.seq_length", "30"], 2,
     r"train.seq_length=30 must be a multiple of 2 × parallel.cp = 4 .*e.g. train.seq_length=32"),
    (["--parallel.cp", "2", "--parallel.tp", "2", "--parallel.sequence_parallel", "true", "--train.seq_length", "36"],
     4, r"train.seq_length=36 must be a multiple of 2 × parallel.cp × parallel.tp = 8"),
    (["--parallel.cp", "2", "--parallel.tp", "2"], 6, r"parallel.tp=2 × parallel.cp=2 × parallel.pp=1 = 4 must divide "
                                                       r"the world size 6"),
    (["--parallel.cp", "2", "--parallel.zero", "1", "--parallel.zero_shard_size", "3"], 4,
     r"parallel.zero_shard_size=3 must divide dp × cp = 4 \(valid: 1, 2, 4\)"),
])
def test_impossible_cp_layouts_are_one_line_errors(flags, world, message):
    cfg = load_config(None, ["--model.vocab_size", "300", "--train.global_batch_size", "16", *flags])
    with pytest.raises(ConfigError, match=message) as info:
        resolve(cfg, world)
    assert "\n" not in str(info.value)


def test_a_cp_layout_validates_with_dp_left_over():
    cfg = load_config(None, ["--model.vocab_size", "300", "--parallel.cp", "2", "--parallel.tp", "2",
                             "--parallel.sequence_parallel", "true", "--train.seq_length", "64",
                             "--train.micro_batch_size", "2", "--train.global_batch_size", "8"])
    sizes = resolve(cfg, 8).sizes
    assert (sizes.tp, sizes.cp, sizes.pp, sizes.dp, sizes.grad_accum) == (2, 2, 1, 2, 2)
    assert "world=8 (tp=2 cp=2 pp=1 dp=2)" in sizes.describe()


def test_the_rank_grid_is_tp_fastest_then_cp_then_dp():
    grid = np.arange(16).reshape(2, 2, 2, 2)  # (pp, dp, cp, tp)
    mine = {name: next(r.tolist() for r in lists if 5 in r) for name, lists in grid_groups(grid).items()}
    assert mine["tp"] == [4, 5] and mine["cp"] == [5, 7] and mine["dp"] == [1, 5] and mine["pp"] == [5, 13]
    assert mine["dp_cp"] == [1, 3, 5, 7]  # the ranks holding the same parameters
    assert mine["mp"] == [4, 5, 12, 13]  # pp × tp: cp left out, so the grad norm counts each parameter once
    assert mine["embedding"] == [5, 13]
    shards = {name: next(r.tolist() for r in lists if 5 in r) for name, lists in shard_groups(grid, 2).items()}
    assert shards == {"dp_shard": [5, 7], "dp_replicas": [1, 5]}
    assert "dp_cp" not in grid_groups(np.arange(4).reshape(1, 2, 1, 2))  # cp = 1: dp itself


LLAMA_70B = ModelArgs(80, 8192, 64, 8, 28672, 128256, rope_theta=500000.0)
LLAMA_405B = ModelArgs(126, 16384, 128, 8, 53248, 128256, rope_theta=500000.0)


def test_the_planner_models_context_parallelism():
    """cp = 2 at the same GPU count: half the tokens per rank (activations about halved, the K/V
    term growing with cp), a K/V all-gather per layer each way, half the data-parallel replicas."""
    h100, seq = DEVICES["h100"], 32768
    one = estimate(LLAMA_70B, seq, Layout(tp=8, pp=4, dp=8, zero=1), 64, h100)
    two = estimate(LLAMA_70B, seq, Layout(tp=8, pp=4, dp=4, zero=1, cp=2), 64, h100)
    assert one.time["context"] == 0 < two.time["context"] < 0.1 * two.time["total"]
    ratio = two.memory["activations"] / one.memory["activations"]
    assert 0.45 < ratio < 0.6, ratio
    # per layer and micro-batch: K and V of all 32768 positions, 1 kv head per tp rank, 128 wide, bf16
    assert context_gather_bytes(LLAMA_70B, Layout(tp=8, pp=4, dp=4, cp=2), seq) == 2 * seq * 1 * 128 * 2
    assert "--parallel.cp 2" in Layout(tp=8, pp=4, dp=4, cp=2).flags()
    assert two.mfu == pytest.approx(one.mfu, rel=0.25)  # the same work, differently cut
    with pytest.raises(ConfigError, match="does not cut into 2 × cp 4 chunks × tp 8"):
        estimate(LLAMA_70B, 8200, Layout(tp=8, pp=4, dp=2, cp=4), 64, h100)


def test_the_planner_chooses_cp_for_long_sequences_only():
    h100 = DEVICES["h100"]
    assert context_sizes(8192, 8, 2048) == [1] and context_sizes(131072, 8, 16384) == [1, 2, 4, 8, 16]
    long = [e for e in search(LLAMA_405B, 131072, 16384, 128, h100) if e.fits]
    assert long and long[0].layout.cp > 1  # 16M-token batches of 131k-token sequences
    cfg_path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                            "llama3_405b.yaml")
    for e in long[:3]:  # every chosen layout is one the trainer accepts
        cfg = load_config(cfg_path, [*shlex.split(e.layout.flags()), "--train.seq_length", "131072",
                                     "--train.global_batch_size", "128", "--train.rampup_batch_size", "null",
                                     "--model.vocab_size", "128256"])
        sizes = resolve(cfg, 16384).sizes
        assert (sizes.cp, sizes.dp) == (e.layout.cp, e.layout.dp)


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()


@pytest.mark.skipif(not INTERPRETED, reason="runs in a fresh process with TRITON_INTERPRET=1 "
                                            "(test_kernels_under_cp_in_a_fresh_process)")
def test_triton_kernels_under_cp2_train_like_torch(tmp_path, corpus):
    reference = train_losses(0, 1, str(tmp_path / "single"), corpus, TORCH)
    for losses in run_distributed(train_losses, 2, str(tmp_path / "cp2"), corpus, [*TRITON, *CP2], timeout=600):
        assert losses_close(losses, reference, 1e-5), (losses, reference)


def test_kernels_under_cp_in_a_fresh_process():
    """RoPE, RMSNorm, SwiGLU, the fused loss and AdamW kernels (Triton's interpreter on CPU) under cp=2."""
    if INTERPRETED or torch.cuda.is_available():
        pytest.skip("this process runs them (or the GPU does)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-k",
                           "triton_kernels_under_cp2"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]
