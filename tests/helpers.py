"""What the tests share: small models and a bare training loop (the model and parallelism tests),
and the real trainer under a layout against one process (the equivalence tests)."""

from __future__ import annotations

import ast
import contextlib
import gzip
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from megapretrain.checkpoint.format import rank_state
from megapretrain.checkpoint.manager import optimizer_views
from megapretrain.config import OptimConfig
from megapretrain.model.args import ModelArgs
from megapretrain.model.decoder import DecoderModel
from megapretrain.optim.optimizer import MixedPrecisionAdamW
from megapretrain.parallel.state import ParallelState

VOCAB = 300  # not a multiple of 128: exercises vocabulary padding
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS_DIR = os.path.join(ROOT, "tools")


def load_tool(name: str) -> types.ModuleType:
    """What ``python tools/NAME.py`` runs, as a module with its ``main``: megapretrain.commands.NAME
    for a command users run, else the script itself (a benchmark or a developer check), imported as
    it imports its siblings: by name, with tools/ on the path (last, so that it shadows nothing)."""
    if importlib.util.find_spec(f"megapretrain.commands.{name}") is not None:
        return importlib.import_module(f"megapretrain.commands.{name}")
    if TOOLS_DIR not in sys.path:
        sys.path.append(TOOLS_DIR)
    module = importlib.import_module(name)
    assert os.path.dirname(os.path.abspath(module.__file__)) == TOOLS_DIR, module.__file__
    return module


def tiny_args(**overrides) -> ModelArgs:
    sizes = dict(num_layers=2, hidden_size=64, num_heads=8, num_kv_heads=4, ffn_hidden_size=128,
                 vocab_size=VOCAB, vocab_divisible_by=128)
    sizes.update(overrides)
    return ModelArgs(**sizes)


def make_tokens(batch: int = 8, seq: int = 32, seed: int = 0) -> torch.Tensor:
    """(batch, seq + 1) token ids with some structure (so the loss can fall)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, VOCAB, (batch, 1), generator=g)
    step = torch.randint(1, 7, (batch, 1), generator=g)
    return (base + step * torch.arange(seq + 1)) % VOCAB


def build(ps: ParallelState, args: ModelArgs, *, seed: int = 7, sequence_parallel: bool = False,
          recompute: str = "none", dtype=torch.float32) -> DecoderModel:
    model = DecoderModel(args, ps.tp, sequence_parallel=sequence_parallel, recompute=recompute, dtype=dtype)
    model.init_weights(seed)
    return model


def gather_full(model: DecoderModel, ps: ParallelState, grads: bool = False) -> dict:
    """Every parameter (or main grad) of ``model``, tp shards concatenated into the global tensor."""
    out, specs = {}, model.param_specs()
    for name, p in model.named_parameters():
        t = (p.main_grad if grads else p.detach()).clone()
        dim = specs[name].tp_dim
        out[name] = ps.tp.all_gather(t, dim) if dim is not None else t
    return out


def trainer_params(trainer) -> dict:
    """A trainer's parameters as global tensors (tp shards gathered, vocabulary padding dropped)."""
    out = {}
    with full_params(trainer.optimizer):  # zero 3: gathered for the copy
        for chunk in trainer.model_chunks:
            for name, p in chunk.named_parameters():
                spec = trainer.specs[name]
                full = trainer.ps.tp.all_gather(p.detach().clone(), spec.tp_dim) if spec.tp_dim is not None \
                    else p.detach().clone()
                out[name] = full[:spec.shape[0]] if spec.vocab else full
    return out


def train(ps: ParallelState, model: DecoderModel, tokens: torch.Tensor, steps: int, micro: int = 2,
          lr: float = 3e-3, precision: str = "fp32") -> tuple[list[float], dict]:
    """``steps`` AdamW steps on the same global batch split into ``micro`` micro-batches per dp rank.

    Returns the per-step global mean losses and the first step's (tp-gathered) gradients."""
    opt = MixedPrecisionAdamW(list(model.named_parameters()), model.param_specs(), OptimConfig(lr=lr), precision, ps)
    rows = tokens.shape[0] // ps.dp.size
    mine = tokens[ps.dp_rank * rows:(ps.dp_rank + 1) * rows]
    n_tokens = tokens.shape[0] * (tokens.shape[1] - 1)
    losses, first_grads = [], None
    for step in range(steps):
        opt.zero_grad()
        total = torch.zeros(())
        chunks = mine.chunk(micro)
        for i, chunk in enumerate(chunks):
            per_token = model(chunk[:, :-1], chunk[:, 1:])
            with opt.grad_sync(last=i == len(chunks) - 1):
                (per_token.sum() * opt.scaler.scale / n_tokens).backward()
            total += per_token.detach().sum()
        opt.reduce_grads()
        ps.dp.all_reduce(total)
        if step == 0:
            first_grads = gather_full(model, ps, grads=True)
        opt.step(lr)
        losses.append(total.item() / n_tokens)
    return losses, first_grads


# -- an optimizer's state -------------------------------------------------------------------------

@contextlib.contextmanager
def full_params(optimizer: MixedPrecisionAdamW):
    """Context in which every parameter of ``optimizer`` holds its full value (zero 3 gathers and
    then releases them; otherwise nothing to do): for reading the model outside its forward."""
    if optimizer.units is None:
        yield
        return
    optimizer.units.gather_all()
    try:
        yield
    finally:
        optimizer.units.free_all()


def optimizer_checkpoint(optimizer: MixedPrecisionAdamW) -> dict:
    """A rank's checkpoint state holding ``optimizer``'s weights, moments, step and loss scale, as
    the checkpoint manager writes them (copied: the optimizer may step on);
    ``checkpoint.manager.restore_optimizer`` takes it back."""
    weights, moments = optimizer_views(optimizer)
    state = rank_state(iteration=0, consumed_samples=0, model=weights, moments=moments,
                       optimizer_step=optimizer.step_count, scaler=optimizer.scaler.state_dict())
    return _copied(state)


def _copied(tree):
    if torch.is_tensor(tree):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _copied(v) for k, v in tree.items()}
    return tree


# -- the trainer under a layout against one process ---------------------------------------------

ITERS = 5


BASE = ["--model.num_layers", "4", "--model.hidden_size", "64", "--model.num_heads", "4",
        "--model.num_kv_heads", "2", "--model.ffn_hidden_size", "128", "--train.seq_length", "32",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "8", "--train.iters", str(ITERS),
        "--train.eval_interval", "0", "--logging.tensorboard", "false", "--checkpoint.interval", "0",
        "--optim.lr", "3e-3", "--train.seed", "11",
        # eps 1e-6: with 1e-8, elements whose grad is ~0 get updates that hinge on summation order
        "--optim.eps", "1e-6"]


def train_layout(rank, world, run_dir, corpus, layout):
    """The trainer on ``BASE`` + ``layout`` (one rank of ``world``): its losses, grad norms, last
    loss and (tp rank 0 of dp rank 0) its global parameters."""
    from megapretrain.train import setup  # (here: the tests of single modules need no trainer)

    argv = ["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *BASE, *layout]
    trainer = setup(argv)
    trainer.fit()
    ps = trainer.ps
    params = trainer_params(trainer)
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [r for r in map(json.loads, fh) if "loss" in r]
    return {"params": params if ps.dp_rank == 0 and ps.tp_rank == 0 else {}, "losses": [r["loss"] for r in rows],
            "grad_norms": [r["grad_norm"] for r in rows], "loss_on_rank": trainer.last_loss}


_REFERENCES: dict = {}


def reference_for(model_flags: tuple, corpus: str, tmp_path_factory) -> dict:
    """The single-process run for these model flags (computed once per test session)."""
    if model_flags not in _REFERENCES:
        run = str(tmp_path_factory.mktemp("single"))
        _REFERENCES[model_flags] = train_layout(0, 1, run, corpus, list(model_flags))
    return _REFERENCES[model_flags]


def check(reference, results):
    """Every rank's results (train_layout's) equal the single-process ``reference``: losses and
    grad norms within 1e-5, the merged parameters within 1e-4."""
    merged = {}
    for r in results:
        merged.update(r["params"])
        assert r["loss_on_rank"] == pytest.approx(reference["losses"][-1], rel=1e-5)
    assert results[0]["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert results[0]["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5)
    assert reference["losses"][-1] < reference["losses"][0]
    assert set(merged) == set(reference["params"])
    for name, ref in reference["params"].items():
        torch.testing.assert_close(merged[name], ref, rtol=1e-4, atol=1e-5, msg=name)


def resume_run(rank, world, run_dir, corpus, iters, layout, dropout=0.1):
    """``iters`` iterations (resuming from RUN_DIR's checkpoint if any) of a 6-iteration schedule;
    returns the (iter, loss, grad norm) rows and the iterations resumed from."""
    from megapretrain.train import setup

    argv = ["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *BASE, *layout, "--train.iters", str(iters),
            "--schedule.decay_iters", "6", "--model.hidden_dropout", str(dropout),
            "--model.attention_dropout", str(dropout)]
    setup(argv).fit()
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    return [(r["iter"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r], \
        [r["iter"] for r in rows if r.get("event") == "resumed"]


def eval_layout(rank, world, run_dir, corpus, flags, offline=None):
    """The trainer on ``BASE`` + ``flags`` (eval.tasks among them) for one rank of ``world``: its
    eval lines (rank 0's metrics.jsonl) and the downstream log-likelihoods it scores after
    training. ``offline``: tools/evaluate.py's arguments after ``--checkpoint RUN_DIR``, run next
    on the same ranks; its ``--output`` is RUN_DIR/offline_items.jsonl (rank 0 writes it)."""
    from megapretrain.train import setup

    trainer = setup(["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *BASE, *flags])
    trainer.fit()
    d = trainer.downstream
    logliks = d.scorer(d.tokens, d.targets)
    evals = records(run_dir, "downstream_time_s") if rank == 0 else []
    out = {"evals": evals, "logliks": logliks}
    if offline is not None:
        items = os.path.join(run_dir, "offline_items.jsonl")
        out["offline_status"] = load_tool("evaluate").main(["--checkpoint", run_dir, "--output",
                                                            items, *offline])
    return out


def item_logliks(path) -> list[float]:
    """Every choice's log-likelihood in a tools/evaluate.py --output file, item by item."""
    with open(path) as fh:
        return [ll for line in fh for ll in json.loads(line)["logliks"]]


def evaluate_watched(rank, world, argv):
    """tools/evaluate.py on one rank of ``world`` with every collective it enters recorded:
    (group, op, bytes this rank sends, the group's size) each; and, of its ZeRO-3 units (a decoder
    layer each, or a chunk's embedding, final norm and head), the bytes of each gathered whole and
    the most gathered at once (``parallel/zero3.py``)."""
    from megapretrain.commands import evaluate
    from megapretrain.parallel.state import Group

    calls, built = [], []
    record, init = Group._record, evaluate.LayoutScorer.__init__

    def recorded(group, kind, tensor):
        calls.append((group.name, kind, tensor.numel() * tensor.element_size(), group.size))
        record(group, kind, tensor)

    def kept(scorer, *args, **kwargs):
        init(scorer, *args, **kwargs)
        built.append(scorer)

    Group._record, evaluate.LayoutScorer.__init__ = recorded, kept
    try:
        status = evaluate.main(argv)
    finally:
        Group._record, evaluate.LayoutScorer.__init__ = record, init
    optimizer = built[0].optimizer
    units = {u.name: sum(b.numel * optimizer.buffers.gathered_element_size(b) for b in u.buckets)
             for u in optimizer.units.units}
    return {"status": status, "calls": calls, "units": units,
            "max_gathered": dict(optimizer.units.max_gathered)}


# -- one process of the real trainer --------------------------------------------------------------

TINY = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_heads", "4",
        "--model.num_kv_heads", "2", "--model.ffn_hidden_size", "128", "--train.seq_length", "64",
        "--train.micro_batch_size", "4", "--train.global_batch_size", "8", "--logging.interval", "1",
        "--logging.tensorboard", "false", "--optim.lr", "3e-3", "--schedule.warmup_iters", "2"]


def train_tiny(run_dir, corpus, *extra) -> int:
    """``python -m megapretrain.train`` in this process on ``TINY`` + ``extra``: its exit code."""
    from megapretrain.train import main

    return main(["--run.dir", str(run_dir), "--data.paths", f"[{corpus}]", *TINY, *extra])


def records(run_dir, key: str | None = None) -> list[dict]:
    """The run's metrics.jsonl records in order: every one, or those that carry ``key``."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if key is None or key in r]


# two steps of a 2-layer model: what the bad-input tests train
TWO_STEPS = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_heads", "4",
             "--train.iters", "2", "--train.seq_length", "32", "--train.micro_batch_size", "2",
             "--train.global_batch_size", "2", "--logging.tensorboard", "false"]


# -- data ------------------------------------------------------------------------------------------

def write_jsonl(path, texts, extra_lines=()):
    """JSON lines of ``{"text", "id"}`` (gzipped for a .gz path), then ``extra_lines`` as they are."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"text": text, "id": i}) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return str(path)


# -- FP8 -------------------------------------------------------------------------------------------

def fp8_model(recipe, *, recompute="none", tp=None, sequence_parallel=False, zero=0, weights=None, allgather=True):
    """A tiny bf16 model (``tiny_args``) with its linears in FP8 under ``recipe`` (``"none"``: left
    bf16), and the parallel state it was built on."""
    from megapretrain.model.fp8 import convert_to_fp8

    ps = tp or ParallelState()
    model = build(ps, tiny_args(), recompute=recompute, sequence_parallel=sequence_parallel, dtype=torch.bfloat16)
    if recipe != "none":
        convert_to_fp8(model, recipe, [], allgather=allgather, zero=zero, weights=weights)
    return ps, model


# -- Hugging Face ----------------------------------------------------------------------------------

def safetensors_of(directory) -> dict:
    """Every tensor of a Hugging Face directory's .safetensors files, by name."""
    from safetensors.torch import load_file
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


# -- model families --------------------------------------------------------------------------------

# the Qwen options of the Llama family; GPT-NeoX (partial rotary, GELU MLP, LayerNorm)
QWEN = ("--model.qkv_bias", "true", "--model.qk_norm", "true", "--model.head_dim", "32")  # both options at once
NEOX = ("--model.family", "gpt_neox", "--model.mlp", "gelu", "--model.num_kv_heads", "4", "--model.rotary_pct",
        "0.5", "--model.ffn_hidden_size", "256")
# OLMo 3: post-norm, QK-norm over the whole projections (across tp ranks), layers 0-2 of 4 windowed
OLMO3 = ("--model.family", "olmo", "--model.sliding_window", "5", "--model.sliding_window_pattern", "4")
# the long-context OLMo 3's rotary: YaRN (stretching an 8-token context 4×) on the full layer only, plain
# rotary with another base on the windowed ones
OLMO3_YARN = (*OLMO3, "--model.rope_scaling", "{rope_type: yarn, factor: 4, original_max_position_embeddings: 8}",
              "--model.sliding_rope", "{rope_type: default, rope_theta: 500000}")


# -- runs that save and resume ---------------------------------------------------------------------

# the trainer's TINY run, saving every 2 steps of an 8-step schedule
CHECKPOINTED = [*TINY, "--train.eval_interval", "0", "--schedule.decay_iters", "8", "--checkpoint.interval", "2"]


def run_argv(run, corpus, iters, *extra) -> list[str]:
    """The arguments of ``iters`` steps of ``CHECKPOINTED`` + ``extra`` in run directory ``run``."""
    return ["--run.dir", str(run), "--data.paths", f"[{corpus}]", *CHECKPOINTED, "--train.iters", str(iters), *extra]


def ckpt_dir(run, iteration: int) -> str:
    """The checkpoint directory of ``iteration`` in run directory ``run``."""
    return os.path.join(str(run), "checkpoints", f"iter_{iteration:07d}")


# a run of PART_ITERS steps trained in parts (saved at PART_SPLIT, resumed, perhaps under another layout)
PART_ITERS, PART_SPLIT = 6, 3


def train_part(rank, world, run_dir, corpus, iters, flags):
    """Train to iteration ``iters`` of a PART_ITERS-step schedule (resuming from the run's
    checkpoint if it has one): the losses, the resumed events and the global parameters."""
    from megapretrain.train import setup

    argv = ["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *BASE, *flags, "--train.iters", str(iters),
            "--schedule.decay_iters", str(PART_ITERS)]
    trainer = setup(argv)
    trainer.fit()
    params = trainer_params(trainer)
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    return {"losses": {r["iter"]: r["loss"] for r in rows if "loss" in r},
            "resumed": [r for r in rows if r.get("event") == "resumed"],
            "params": params if trainer.ps.dp_rank == 0 and trainer.ps.tp_rank == 0 else {}}


def launch_part(world, run_dir, corpus, iters, flags) -> list[dict]:
    """``train_part`` on ``world`` ranks (one: in this process): every rank's results."""
    from distributed import run_distributed

    if world == 1:
        return [train_part(0, 1, run_dir, corpus, iters, flags)]
    return run_distributed(train_part, world, run_dir, corpus, iters, flags, timeout=300)


# -- the Triton kernels through the trainer -------------------------------------------------------

KERNELS_TINY = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_heads", "4",
        "--model.num_kv_heads", "2", "--model.ffn_hidden_size", "128", "--train.seq_length", "32",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "4", "--train.iters", "2",
        "--train.eval_interval", "0", "--logging.interval", "1", "--logging.tensorboard", "false",
        "--checkpoint.interval", "0", "--optim.lr", "3e-3", "--schedule.warmup_iters", "1"]
TRITON = ["--model.kernels", "triton", "--optim.impl", "triton"]
TORCH = ["--model.kernels", "torch", "--optim.impl", "torch"]


def losses_of(run_dir: str) -> list[float]:
    """The logged training losses of a run, in order."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r["loss"] for r in map(json.loads, fh) if "loss" in r]


def train_losses(rank, world, run_dir, corpus, flags) -> list[float]:
    """``KERNELS_TINY`` + ``flags`` through ``megapretrain.train.main`` on one rank: its losses."""
    from megapretrain.train import main

    assert main(["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *KERNELS_TINY, *flags]) == 0
    return losses_of(run_dir)


def losses_close(a: list[float], b: list[float], rel: float) -> bool:
    """Two equally long, non-empty loss lists within ``rel`` of each other, step by step."""
    return len(a) == len(b) > 0 and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


# -- the tools ---------------------------------------------------------------------------------------

# the scripts (tools/_*.py are the modules they share)
TOOLS = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "tools"))
               if f.endswith(".py") and not f.startswith("_"))

# runs every tools/*.py --help as its own __main__ in one interpreter (a process each costs a torch import)
EVERY_HELP = """
import json, os, runpy, sys
codes = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    sys.path.insert(0, os.path.dirname(path))  # as python PATH puts the script's folder first
    try:
        runpy.run_path(path, run_name="__main__")
        codes[path] = "returned without exiting"
    except SystemExit as exit:
        codes[path] = exit.code
import megapretrain
print(json.dumps({"codes": codes, "package": megapretrain.__file__}))
"""


def every_help(env: dict | None = None, cwd: str | None = None) -> dict:
    """Every tools/*.py --help run in one interpreter: {"codes": {path: exit code}, "package": ...}."""
    paths = [os.path.join(ROOT, "tools", f"{name}.py") for name in TOOLS]
    proc = subprocess.run([sys.executable, "-c", EVERY_HELP, *paths], capture_output=True, text=True, timeout=600,
                          env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def console_scripts() -> dict[str, str]:
    """setup.py's console_scripts: {name: "module:function"}."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "console_scripts":
                    return dict(item.value.split("=", 1) for item in value.elts)
    raise AssertionError("setup.py declares no console_scripts")


# -- tokenizers (tiny ones, trained on CORPUS) -----------------------------------------------------

CORPUS = ["the quick brown fox jumps over the lazy dog", "def main():\n    return 0\n",
          "naïve café — ünïcödé ✓ 数据", "hello world " * 5] * 20


def train_hf_tokenizer(path, special="<|endoftext|>"):
    """A tiny byte-level BPE saved as tokenizer.json (what HuggingFaceTokenizer loads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[special], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path))
    return tok


def train_gpt2_files(directory):
    """vocab.json + merges.txt of a tiny GPT-2 style byte-level BPE."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(CORPUS, vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False)
    tok.save_model(str(directory))
    return directory


def train_sentencepiece(directory):
    """A tiny SentencePiece BPE model with byte fallback and no normalization (exact round trips)."""
    spm = pytest.importorskip("sentencepiece")
    prefix = str(directory / "sp")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_prefix=prefix, vocab_size=400,
                                   hard_vocab_limit=False, byte_fallback=True, character_coverage=1.0,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   add_dummy_prefix=False, minloglevel=2, num_threads=1, model_type="bpe")
    return prefix + ".model"


def write_tiktoken_ranks(path):
    """A .tiktoken rank file: the 256 bytes, then the words of CORPUS (with and without a space before)."""
    import base64

    tokens = [bytes([b]) for b in range(256)]
    words = sorted({w for text in CORPUS for w in text.split()})
    for word in words:
        for token in (word.encode(), b" " + word.encode()):
            if len(token) > 1 and token not in tokens:
                tokens.append(token)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return str(path)


PEAK_SCRIPT = """
import json, sys
from megapretrain.commands import {tool} as tool
import megapretrain.checkpoint.hf, megapretrain.checkpoint.megatron, megapretrain.train  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401 (everything imported before measuring)
def status(key):  # kB, from /proc/self/status (VmRSS: now, VmHWM: the peak)
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":"))
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
before = status("VmRSS")
rc = tool.main(sys.argv[1:])
print(json.dumps({{"rc": rc, "extra_mib": (status("VmHWM") - before) / 1024}}))
"""


def peak_host_mib(tool: str, *argv: str) -> float:
    """Peak host memory (MiB) above the imports of one run of ``megapretrain.commands.<tool>``
    with ``argv``, in a process of its own; the run must succeed."""
    proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT.format(tool=tool), *argv],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["rc"] == 0, proc.stderr
    return result["extra_mib"]


def wandb_history(run_dir: str) -> list[dict]:
    """Every history row (``{key: value, "_step": step}``) that the offline wandb runs under
    ``RUN_DIR/wandb`` recorded, read back from their ``.wandb`` files. wandb has no public reader
    for them: the file is a 7-byte header, then 32 KiB blocks of records each framed as CRC-32 (4
    bytes), length (2), type (1: whole, 2/3/4: first/middle/last piece) and a protobuf Record."""
    import glob
    import struct

    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "*.wandb"))):
        data = open(path, "rb").read()
        assert data[:4] == b":W&B", f"{path} is not a wandb data file"
        pos, piece, block = 7, b"", 32768
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a frame is padding
                pos += block - pos % block
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if kind == 0 and length == 0:
                break
            piece, pos = piece + data[pos + 7:pos + 7 + length], pos + 7 + length
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(piece)
                piece = b""
                if record.WhichOneof("record_type") == "history":
                    rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                 for item in record.history.item})
    return rows


EOD = 0  # make_corpus's end-of-document token


def make_corpus(prefix, num_docs=60, seed=0, first_token=1):
    """Documents of 0-40 distinct tokens, each ending with EOD (as preprocessing writes them).
    Every non-EOD token is unique, so a token identifies its place in the corpus."""
    import numpy as np

    from megapretrain.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    docs, next_token = [], first_token
    for _ in range(num_docs):
        n = int(rng.integers(0, 40))
        doc = np.append(np.arange(next_token, next_token + n), EOD)
        next_token += n
        if rng.random() < 0.1:
            doc = doc[:0]  # a few empty sequences: packing must step over them
        docs.append(doc)
        builder.add_document(doc)
    builder.finalize(prefix + ".idx")
    return IndexedDataset(prefix), docs


# -- a random Hugging Face Llama on disk -----------------------------------------------------------


def write_hf_llama(hf_dir: str, *, hidden: int, ffn: int, layers: int, vocab: int, heads: int,
                   kv: int, dtype=torch.bfloat16, shards: int = 1, rope_theta: float = 500000.0,
                   max_positions: int = 4096) -> dict[str, tuple]:
    """A random Llama in ``hf_dir`` written straight to safetensors one tensor at a time (no model
    built, never held whole), in ``shards`` files (more than one: with the index transformers
    writes); norm weights near one, the rest ~0.02. Returns every tensor's shape by name."""
    from megapretrain.checkpoint import tensorfile

    os.makedirs(hf_dir)
    d = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,),
                       p + "post_attention_layernorm.weight": (hidden,),
                       p + "self_attn.q_proj.weight": (heads * d, hidden),
                       p + "self_attn.k_proj.weight": (kv * d, hidden),
                       p + "self_attn.v_proj.weight": (kv * d, hidden),
                       p + "self_attn.o_proj.weight": (hidden, heads * d),
                       p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
                       p + "mlp.down_proj.weight": (hidden, ffn)})
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    gen = torch.Generator().manual_seed(0)

    def make(name):
        if len(shapes[name]) == 1:  # norms: near one
            return (1 + 0.1 * torch.randn(shapes[name], generator=gen)).to(dtype)
        return (torch.randn(shapes[name], generator=gen) * 0.02).to(dtype)
    names = list(shapes)
    files = {(f"model-{i + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else
              "model.safetensors"): names[i * len(names) // shards:(i + 1) * len(names) // shards]
             for i in range(shards)}
    for file, members in files.items():
        tensorfile.write(os.path.join(hf_dir, file),
                         [(n, dtype, shapes[n], lambda n=n: make(n)) for n in members], {"format": "pt"})
    if shards > 1:
        json.dump({"weight_map": {n: f for f, ms in files.items() for n in ms}},
                  open(os.path.join(hf_dir, "model.safetensors.index.json"), "w"))
    json.dump({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
               "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
               "num_attention_heads": heads, "num_key_value_heads": kv, "rms_norm_eps": 1e-5,
               "rope_theta": rope_theta, "tie_word_embeddings": False,
               "max_position_embeddings": max_positions,
               "torch_dtype": str(dtype).removeprefix("torch.")},
              open(os.path.join(hf_dir, "config.json"), "w"))
    return shapes


# -- the dataset index as built whole, epoch by epoch ------------------------------------------------


def lengths_only_prefix(prefix, lengths):
    """A dataset prefix whose .idx holds ``lengths`` and whose .bin is a sparse file of the size
    they make (no tokens written, no disk blocks): what building the indices reads."""
    import numpy as np

    from megapretrain.data.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    builder._write_lengths(np.asarray(lengths))
    builder._docs_file.write((1 + np.arange(len(lengths), dtype=np.int64)).tobytes())
    builder.document_count = len(lengths)
    builder.finalize(prefix + ".idx")
    os.truncate(prefix + ".bin", 2 * int(np.sum(lengths, dtype=np.int64)))


def whole_epoch_gpt_indices(sequence_lengths, document_ids, seq_length, num_epochs, seed):
    """doc_index, sample_index and shuffle_index built as they were before the build went by
    chunks: every epoch's arrays whole in memory, in one piece. The streamed build must equal it
    bit for bit (its cache files and the samples of runs that used them stay valid)."""
    import numpy as np

    from megapretrain.data.gpt_dataset import _documents_holding, _tokens_of, gpt_index_dtypes

    document_ids = np.asarray(document_ids, dtype=np.int64)
    tokens_per_epoch, s = _tokens_of(sequence_lengths, document_ids), int(seq_length)
    dtypes = gpt_index_dtypes(sequence_lengths, document_ids, seq_length, num_epochs)
    parts, doc_base, row_base = [], 0, 0
    for e in range(num_epochs):
        first = -(-e * tokens_per_epoch // s)
        count = -(-(e + 1) * tokens_per_epoch // s) - first
        order = document_ids[np.random.default_rng([seed, e]).permutation(document_ids.size)]
        order = order.astype(dtypes["doc_index"])
        positions_first = first * s - e * tokens_per_epoch
        needed = positions_first + count * s + 1 - tokens_per_epoch
        wrap = order[:0]
        if needed > 0:
            head = np.tile(order, -(-needed // tokens_per_epoch))
            cumulative = np.cumsum(sequence_lengths[head], dtype=np.int64)
            wrap = head[: int(np.searchsorted(cumulative, needed, side="left")) + 1]
        stream = np.concatenate([order, wrap])
        starts = np.zeros(stream.size + 1, dtype=np.int64)
        np.cumsum(sequence_lengths[stream], dtype=np.int64, out=starts[1:])
        where = _documents_holding(starts, positions_first, s, count + 1)
        rows = np.empty((count + 1, 2), dtype=dtypes["sample_index"])
        np.add(where, doc_base, out=rows[:, 0], casting="unsafe")
        rows[:, 1] = positions_first + np.arange(count + 1, dtype=np.int64) * s - starts[where]
        samples = np.arange(row_base, row_base + count, dtype=dtypes["shuffle_index"])
        np.random.default_rng([seed, e, 1 << 31]).shuffle(samples)
        parts.append((stream, rows, samples))
        doc_base, row_base = doc_base + stream.size, row_base + count + 1
    return {name: np.concatenate([p[k] for p in parts])
            for k, name in enumerate(("doc_index", "sample_index", "shuffle_index"))}
