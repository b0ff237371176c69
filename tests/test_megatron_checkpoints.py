"""Megatron-LM checkpoints in and out, against megatron-core itself: a small ``GPTModel`` built
and saved by megatron-core's own ``dist_checkpointing`` (torch_dist) on gloo ranks, imported with
``from-megatron`` (our logits against megatron-core's forward), exported with ``to-megatron`` and
loaded back by megatron-core under tp 1 and tp 2 (its logits against the original's).

megatron-core runs a ``GPTModel`` on CPU with three stand-ins, set in its rank processes only
(:func:`_megatron_on_cpu`): ``torch.cuda.current_device`` gives "cpu" (the rotary embedding moves
its frequencies there), ``torch.cuda.synchronize`` does nothing (``dist_checkpointing``'s save
calls it after its host copy), and the CUDA RNG tracker's ``fork`` is a no-op context (attention
dropout forks it; dropout is 0). One more saves start-up time: the save's results queue is a plain queue, not one
from a manager process (a synchronous save fills and empties it in the rank's own process). Weights
are made on the CPU (``use_cpu_initialization``) and the
causal mask is passed in (its default is made on a CUDA device).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import time
import traceback

import pytest
import torch

pytest.importorskip("megatron.core")

from megapretrain.checkpoint.hf import our_logits, our_model
from megapretrain.checkpoint.reshard import GlobalWeights
from megapretrain.commands.convert_checkpoint import main
from megapretrain.config import load_config

from helpers import peak_host_mib

VOCAB, SEQ = 128, 16  # VOCAB: Megatron's padded vocabulary, the embedding's rows
# (name, the tp and pp it is saved under, model shape); "args": common.pt carries Megatron's
# arguments, whose vocab_size (the tokenizer's, before padding) is "vocab"
CASES = {
    "gqa_tied_tp2": dict(tp=2, pp=1, layers=2, hidden=64, heads=4, groups=2, ffn=96, tied=True,
                         qkv_bias=False, qk_norm=False, args=True, vocab=100),
    # untied: megatron-core ties across stages on a CUDA device only
    "bias_qknorm_pp2": dict(tp=1, pp=2, layers=2, hidden=32, heads=4, groups=4, ffn=64,
                            tied=False, qkv_bias=True, qk_norm=True, args=False, vocab=VOCAB),
}


# -- megatron-core's side, in its own gloo rank processes ----------------------------------------


def _megatron_on_cpu() -> None:
    import contextlib
    import queue
    import types

    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    tracker = types.SimpleNamespace(fork=lambda *a, **k: contextlib.nullcontext())
    tensor_parallel.get_cuda_rng_tracker = lambda: tracker
    filesystem_async._results_queue = queue.Queue()  # a save here is synchronous: no manager


def _build(case: dict, tp: int, seed: int, pp: int = 1):
    """megatron-core's GPTModel of ``case``'s shape under ``tp`` and ``pp`` (this rank's stage),
    its weights from ``seed`` (norm weights randomised too, so that a misplaced norm shows)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=case["layers"], hidden_size=case["hidden"], ffn_hidden_size=case["ffn"],
        num_attention_heads=case["heads"], num_query_groups=case["groups"],
        normalization="RMSNorm", layernorm_epsilon=1e-5, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=case["qkv_bias"], qk_layernorm=case["qk_norm"], init_method_std=0.1,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        use_cpu_initialization=True, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=case["qk_norm"])
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope", rotary_base=10000,
                     share_embeddings_and_output_weights=case["tied"],
                     pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage()).eval()
    gen = torch.Generator().manual_seed(seed + 1)  # the same on every tp rank: norms replicate
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def _tokens() -> torch.Tensor:
    real = min(case["vocab"] for case in CASES.values())  # no padding row is a token
    return torch.randint(0, real, (2, SEQ), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def _logits(model) -> torch.Tensor:
    """Full-vocabulary logits (b, s, v) of megatron-core's model, gathered over tp."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tokens = _tokens()
    positions = torch.arange(SEQ).expand(tokens.shape)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]  # True: masked
    local = model(tokens, positions, mask).float()  # (b, s, v/tp)
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, -1)


def _save(rank: int, root: str, name: str, model) -> None:
    """Save ``model`` the way Megatron-LM lays out a run: ``ROOT/NAME/iter_0000003`` (with
    Megatron's arguments in common.pt when the case says so) and the latest-iteration file."""
    from megatron.core import dist_checkpointing

    case = CASES[name]
    run = os.path.join(root, "runs", name)
    folder = os.path.join(run, "iter_0000003")
    if rank == 0:
        os.makedirs(folder)
    torch.distributed.barrier()
    state = {"model": model.sharded_state_dict(), "iteration": 3, "checkpoint_version": 3.0}
    if case["args"]:
        state["args"] = argparse.Namespace(
            num_layers=case["layers"], hidden_size=case["hidden"],
            num_attention_heads=case["heads"], group_query_attention=True,
            num_query_groups=case["groups"], ffn_hidden_size=case["ffn"],
            normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
            rotary_base=10000, norm_epsilon=1e-5, add_bias_linear=False,
            vocab_size=case["vocab"], padded_vocab_size=VOCAB, tensor_model_parallel_size=case["tp"])
    dist_checkpointing.save(state, folder)
    if rank == 0:
        with open(os.path.join(run, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write("3")
    torch.distributed.barrier()  # every rank may read the run now


def _convert(root: str) -> dict:
    """Every saved case through the tool: from-megatron (to tp 2), then to-megatron; what each
    command printed, or the error that stopped it."""
    import contextlib
    import io

    said = {}
    for name in CASES:
        ours = os.path.join(root, "ours", name)
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                codes = (main(["from-megatron", "--megatron", os.path.join(root, "runs", name),
                               "--output", ours, "--parallel.tp", "2",
                               "--train.seq_length", str(SEQ)] + _flags(name)),
                         main(["to-megatron", "--checkpoint", ours,
                               "--output", os.path.join(root, "exported", name)]))
            said[name] = (codes, out.getvalue())
        except Exception:
            said[name] = ((None, None), traceback.format_exc())
    return said


def _megatron_rank(rank: int, world: int, root: str) -> dict:
    """megatron-core's side of the round trip: save every case under its tp and pp, and its logits
    (of that model, or under pp of megatron-core's own load of it into one stage); convert both
    ways with the tool on rank 0; then load every export into a fresh model under tp 1 and 2 (and
    its logits)."""
    out = {"saved": {}, "loaded": {}}
    for name, case in CASES.items():
        model = _build(case, case["tp"], seed=11, pp=case["pp"])
        _save(rank, root, name, model)
        if case["pp"] == 1:
            out["saved"][name] = _logits(model)
        else:  # no forward without a pipeline schedule: megatron-core reshards it to pp 1
            out["saved"][name] = _load(case, 1, os.path.join(root, "runs", name))
    if rank == 0:
        out["converted"] = _convert(root)
    torch.distributed.barrier()
    for name, case in CASES.items():
        run = os.path.join(root, "exported", name)
        if not os.path.exists(run):
            continue  # its conversion failed: the test says why
        for tp in (1, 2):
            out["loaded"][(name, tp)] = _load(case, tp, run)
    return out


def _load(case: dict, tp: int, run: str) -> torch.Tensor:
    """The logits of a fresh model (other weights: the load must replace them all) under ``tp``
    after megatron-core's ``dist_checkpointing.load`` of Megatron-LM run ``run``'s latest."""
    from megatron.core import dist_checkpointing

    with open(os.path.join(run, "latest_checkpointed_iteration.txt")) as fh:
        folder = os.path.join(run, f"iter_{int(fh.read()):07d}")
    model = _build(case, tp, seed=99)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, folder)
    model.load_state_dict(state["model"])
    return _logits(model)


def _rank_main(fn, rank: int, world: int, tmp: str, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        _megatron_on_cpu()
        store = torch.distributed.FileStore(os.path.join(tmp, "store"), world)
        torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=world)
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(tmp, f"result{rank}.pt"))
    except BaseException:
        with open(os.path.join(tmp, f"error{rank}.txt"), "w") as fh:
            fh.write(traceback.format_exc())
        raise


def _run(fn, tmp: str, *args, world: int = 2, timeout: float = 240) -> dict:
    """``fn`` on ``world`` gloo ranks (processes that may start their own: megatron-core's save
    does); rank 0's result."""
    os.makedirs(tmp)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, tmp, args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode for p in procs):  # one failed: the others would wait for it forever
            break
        time.sleep(0.2)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].terminate()
    failed = any(p.exitcode for p in procs)
    hung = [] if failed else hung  # waiting for a failed rank is not hanging
    errors = [open(os.path.join(tmp, f)).read() for f in sorted(os.listdir(tmp))
              if f.startswith("error")]
    assert not hung and not errors and all(p.exitcode == 0 for p in procs), \
        f"ranks hung: {hung}; " + "\n".join(errors)
    return torch.load(os.path.join(tmp, "result0.pt"))


# -- Adam's state: megatron-core's non-distributed optimizer ---------------------------------------

ADAM_CASE = dict(tp=2, pp=1, layers=2, hidden=32, heads=4, groups=2, ffn=64, tied=False,
                 qkv_bias=False, qk_norm=False, args=False, vocab=VOCAB)
# eps: well above the gradients of embedding rows barely used, where Adam's update is most
# sensitive to the last bits of a gradient (its summation order differs between the two models)
ADAM = dict(lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-4)


def _optimizer_on_cpu() -> None:
    """megatron-core's fp32 optimizer on the CPU: four of its modules make small tensors on
    ``device='cuda'`` (the loss scale, overflow flags, the grad norm); here those go to the CPU.
    (Gradient clipping asserts CUDA tensors: the optimizer runs with ``clip_grad`` 0. Its
    distributed optimizer refuses CPU parameters outright — "Wrapped parameters must be one of
    torch.cuda.FloatTensor, ..." — and is not run here.)"""
    import functools
    import types

    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.utils as utils

    class OnCpu(types.ModuleType):
        def __getattr__(self, name):
            made = getattr(torch, name)
            if name not in ("tensor", "zeros", "ones", "empty", "full"):
                return made

            @functools.wraps(made)
            def on_cpu(*args, device=None, **kwargs):
                return made(*args, device="cpu" if device == "cuda" else device, **kwargs)
            return on_cpu
    for module in (clip_grads, distrib_optimizer, optimizer, utils):
        module.torch = OnCpu("torch")


def _megatron_adam_rank(rank: int, world: int, root: str) -> torch.Tensor:
    """megatron-core's GPTModel under tp 2 trained 3 steps with its (non-distributed) Adam, saved
    with the optimizer as Megatron-LM saves it (iter_0000003), then one more step, saved again
    (iter_0000004, weights). Returns the tokens of that last step."""
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    _optimizer_on_cpu()
    model = _build(ADAM_CASE, 2, seed=5).train()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", clip_grad=0.0, **ADAM), [ddp])
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen) for _ in range(4)]
    positions = torch.arange(SEQ).expand(2, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    run = os.path.join(root, "runs", "adam")

    def step(tokens):
        for group in opt.param_groups:  # as Megatron-LM's OptimizerParamScheduler sets them
            group["lr"] = ADAM["lr"] * group["lr_mult"]
            group["weight_decay"] = ADAM["weight_decay"] * group["wd_mult"]
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ddp(tokens[:, :-1], positions, mask, labels=tokens[:, 1:]).float().mean().backward()
        ddp.finish_grad_sync()
        assert opt.step()[0]

    def save(iteration, state):
        folder = os.path.join(run, f"iter_{iteration:07d}")
        if rank == 0:
            os.makedirs(folder)
        torch.distributed.barrier()
        dist_checkpointing.save({"model": model.sharded_state_dict(), "iteration": iteration,
                                 "checkpoint_version": 3.0, **state}, folder)
        torch.distributed.barrier()

    for tokens in batches[:3]:
        step(tokens)
    save(3, {"optimizer": opt.sharded_state_dict(model.sharded_state_dict())})
    step(batches[3])
    save(4, {})
    return batches[3]


def test_adam_state_imports_and_one_more_step_equals_megatron_cores(tmp_path, capsys):
    """megatron-core's Adam (3 steps under tp 2) imported with its moments and step into tp 2;
    one step here on its next batch equals its own next step."""
    from megapretrain.checkpoint.format import read_metadata
    from megapretrain.checkpoint.manager import restore_optimizer
    from megapretrain.checkpoint.reshard import SavedShards, resharded_state
    from megapretrain.config import OptimConfig
    from megapretrain.model.build import model_args
    from megapretrain.model.decoder import DecoderModel
    from megapretrain.optim.optimizer import MixedPrecisionAdamW
    from megapretrain.parallel.state import ParallelState

    root = str(tmp_path)
    tokens = _run(_megatron_adam_rank, os.path.join(root, "ranks"), root)
    run = os.path.join(root, "runs", "adam")
    flags = ["--model.num_heads", "4", "--model.num_kv_heads", "2", "--train.seq_length",
             str(SEQ)]
    ours, after = os.path.join(root, "ours"), os.path.join(root, "after")
    assert main(["from-megatron", "--megatron", os.path.join(run, "iter_0000003"), "--output",
                 ours, "--parallel.tp", "2", *flags]) == 0
    assert "carried: Adam's moments and step 3, and the iteration 3" in capsys.readouterr().out
    assert main(["from-megatron", "--megatron", os.path.join(run, "iter_0000004"), "--output",
                 after, *flags]) == 0
    assert "optimizer state not imported (it holds no optimizer state)" in \
        capsys.readouterr().out
    # the distributed optimizer's fully_reshardable format keeps the same model-space tensors and
    # its step in every param group (common.pt rewritten so; the tensors are not: written by the
    # fp32 optimizer here): the same import
    moved = os.path.join(root, "moved", "iter_0000003")
    shutil.copytree(os.path.join(run, "iter_0000003"), moved)
    common = torch.load(os.path.join(moved, "common.pt"), weights_only=False)
    step = int(common["optimizer"]["state"].pop("common_step"))
    common["optimizer"] = {"optimizer": {"param_groups": [
        {k: v for k, v in g.items() if k != "params"} | {"step": step}
        for g in common["optimizer"]["param_groups"]]}}
    torch.save(common, os.path.join(moved, "common.pt"))
    again = os.path.join(root, "again")
    assert main(["from-megatron", "--megatron", moved, "--output", again, "--parallel.tp", "2",
                 *flags]) == 0
    assert "carried: Adam's moments and step 3" in capsys.readouterr().out
    for rank in ("rank_00000.safetensors", "rank_00001.safetensors"):
        with open(os.path.join(ours, rank), "rb") as a, open(os.path.join(again, rank), "rb") as b:
            assert a.read() == b.read()

    # one process from the tp-2 import, as a resumed run reads it (resharded)
    cfg = load_config(os.path.join(ours, "config.yaml"), [])
    ps = ParallelState()
    model = DecoderModel(model_args(cfg), ps.tp, dtype=torch.float32)
    optim = OptimConfig(lr=ADAM["lr"], weight_decay=ADAM["weight_decay"], eps=ADAM["adam_eps"],
                        betas=[ADAM["adam_beta1"], ADAM["adam_beta2"]], clip_grad=0.0)
    opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(), optim, "fp32",
                              ps)
    meta = read_metadata(ours)
    saved = SavedShards(ours, meta)
    restore_optimizer(opt, resharded_state(saved, model.param_specs(), 0, 1,
                                           meta["padded_vocab"]))
    saved.close()
    assert meta["iteration"] == 3 and opt.step_count == 3
    opt.zero_grad()
    with opt.grad_sync(last=True):
        (model(tokens[:, :-1], tokens[:, 1:]).sum() / tokens[:, 1:].numel()).backward()
    opt.reduce_grads()
    opt.step(ADAM["lr"])

    expected = GlobalWeights(after, load_config(os.path.join(after, "config.yaml"), []))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected.get(name), atol=1e-6, rtol=0, msg=name)
    expected.close()


# -- the tests -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """The whole megatron-core side, run once on 2 gloo ranks: ``(root, rank 0's results)``."""
    root = tmp_path_factory.mktemp("megatron")
    return root, _run(_megatron_rank, str(root / "ranks"), str(root))


def _flags(name: str) -> list[str]:
    """What a user passes when common.pt has no args: the heads."""
    case = CASES[name]
    return [] if case["args"] else ["--model.num_heads", str(case["heads"]),
                                    "--model.num_kv_heads", str(case["groups"])]


def _our_logits(checkpoint: str) -> torch.Tensor:
    cfg = load_config(os.path.join(checkpoint, "config.yaml"), [])
    weights = GlobalWeights(checkpoint, cfg)
    model = our_model(cfg, weights.get)
    weights.close()
    return our_logits(model, _tokens())


def test_from_megatron_matches_megatron_core(megatron):
    root, results = megatron
    for name in CASES:
        codes, said = results["converted"][name]
        assert codes == (0, 0), said
        assert "optimizer starts fresh" in said and "iteration 3" in said
        vocab = CASES[name]["vocab"]  # the padding rows are not imported
        torch.testing.assert_close(_our_logits(str(root / "ours" / name)),
                                   results["saved"][name][..., :vocab], rtol=1e-4, atol=1e-4)


def test_to_megatron_loads_in_megatron_core_under_tp_1_and_2(megatron):
    root, results = megatron
    assert sorted(results["loaded"]) == [(name, tp) for name in sorted(CASES) for tp in (1, 2)]
    for (name, tp), logits in results["loaded"].items():
        vocab = CASES[name]["vocab"]  # the padding rows come back as zeros
        assert logits.shape[-1] == VOCAB and not logits[..., vocab:].any()
        torch.testing.assert_close(logits[..., :vocab], results["saved"][name][..., :vocab],
                                   rtol=1e-4, atol=1e-4,
                                   msg=lambda m, name=name, tp=tp: f"{name} loaded under tp {tp}: {m}")
    run = root / "exported" / "gqa_tied_tp2"
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "0"
    common = torch.load(run / "iter_0000000" / "common.pt", weights_only=False)
    assert common["iteration"] == 0 and common["args"].num_query_groups == 2
    assert (common["args"].vocab_size, common["args"].padded_vocab_size) == (100, VOCAB)
    assert json.loads((run / "iter_0000000" / "metadata.json").read_text())[
        "sharded_backend"] == "torch_dist"


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_megatron_bad_input(megatron, tmp_path, capsys):
    root, _ = megatron
    run = str(root / "runs" / "gqa_tied_tp2")
    err = _one_line_error(capsys, ["from-megatron", "--megatron", run, "--output",
                                   str(tmp_path / "a"), "--model.ffn_hidden_size", "80"])
    assert "linear_fc1.weight" in err and "(2, 192, 64)" in err and "(2, 160, 64)" in err
    for not_megatron in (root / "runs", root / "ours" / "gqa_tied_tp2"):
        err = _one_line_error(capsys, ["from-megatron", "--megatron", str(not_megatron),
                                       "--output", str(tmp_path / "b")])
        assert "not a Megatron-LM torch_dist checkpoint" in err
    err = _one_line_error(capsys, ["from-megatron", "--megatron",
                                   str(root / "runs" / "bias_qknorm_pp2"), "--output",
                                   str(tmp_path / "c")])
    assert "--model.num_heads" in err
    err = _one_line_error(capsys, ["from-megatron", "--megatron", str(root / "runs" / "bias_qknorm_pp2"),
                                   "--output", str(tmp_path / "e"), "--model.tie_embeddings", "true"]
                          + _flags("bias_qknorm_pp2"))
    assert "'output_layer.weight'" in err and "--model.tie_embeddings false" in err
    layernorm = tmp_path / "layernorm"  # the same run, its args naming another architecture
    shutil.copytree(run, layernorm)
    common = layernorm / "iter_0000003" / "common.pt"
    saved = torch.load(common, weights_only=False)
    saved["args"].normalization = "LayerNorm"
    torch.save(saved, common)
    err = _one_line_error(capsys, ["from-megatron", "--megatron", str(layernorm), "--output",
                                   str(tmp_path / "d")])
    assert "normalization=LayerNorm" in err
    saved["args"].normalization, saved["args"].window_size = "RMSNorm", (64, 0)  # a sliding window
    torch.save(saved, common)
    err = _one_line_error(capsys, ["from-megatron", "--megatron", str(layernorm), "--output",
                                   str(tmp_path / "d")])
    assert "window_size=(64, 0)" in err and "no sliding window" in err
    assert sorted(os.listdir(tmp_path)) == ["layernorm"]  # nothing written


def test_megatron_round_trip_is_exact_across_layouts(megatron, tmp_path, capsys):
    """ours (tp 2) -> Megatron -> ours (pp 2, 2 replicas): every weight bit for bit."""
    root, _ = megatron
    for name in CASES:
        ours = str(root / "ours" / name)
        exported, back = str(tmp_path / name / "megatron"), str(tmp_path / name / "back")
        assert main(["to-megatron", "--checkpoint", ours, "--output", exported]) == 0
        assert main(["from-megatron", "--megatron", exported, "--output", back,
                     "--parallel.pp", "2", "--world-size", "4"]) == 0
        capsys.readouterr()
        configs = [load_config(os.path.join(path, "config.yaml"), []) for path in (ours, back)]
        a, b = (GlobalWeights(path, cfg) for path, cfg in zip((ours, back), configs))
        assert list(a.specs) == list(b.specs)
        for weight in a.specs:
            assert torch.equal(a.get(weight), b.get(weight)), f"{name}: {weight}"
        a.close()
        b.close()


@pytest.mark.slow
def test_megatron_conversions_stream_with_bounded_host_memory(tmp_path):
    """A ~350 MiB model (24 layers; its largest tensor the 31 MiB embedding) in Megatron-LM's
    format, written a layer at a time: from-megatron and to-megatron each peak at a few copies of
    the largest tensor, far from a whole-model copy."""
    from megapretrain.checkpoint.megatron import write_megatron
    from megapretrain.checkpoint.reshard import global_shapes
    from megapretrain.resolve import resolve

    cfg = load_config(None, ["--model.num_layers", "24", "--model.hidden_size", "512",
                             "--model.num_heads", "8", "--model.num_kv_heads", "4",
                             "--model.ffn_hidden_size", "1536", "--model.vocab_size", "16000"])
    resolve(cfg, 1)
    shapes = global_shapes(cfg)
    os.makedirs(tmp_path / "megatron")
    model_mib = write_megatron(str(tmp_path / "megatron"), cfg, shapes,
                               lambda n: torch.randn(shapes[n]) * 0.02, torch.float32, 16000,
                               5) / 2**20
    largest_mib = 16000 * 512 * 4 / 2**20
    ours, back = str(tmp_path / "ours"), str(tmp_path / "back")
    into = peak_host_mib("convert_checkpoint", "from-megatron", "--megatron",
                         str(tmp_path / "megatron"), "--output", ours,
                         "--parallel.tp", "2")
    out = peak_host_mib("convert_checkpoint", "to-megatron", "--checkpoint", ours, "--output", back)
    print(f"model {model_mib:.0f} MiB, largest tensor {largest_mib:.0f} MiB; peak above imports: "
          f"from-megatron {into:.0f} MiB, to-megatron {out:.0f} MiB")
    for extra in (into, out):
        assert extra < min(0.5 * model_mib, 6 * largest_mib)
