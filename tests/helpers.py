"""Small models and a bare training loop shared by the model and parallelism tests."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

import torch

from megapretrain.config import OptimConfig
from megapretrain.model.args import ModelArgs
from megapretrain.model.decoder import DecoderModel
from megapretrain.optim.optimizer import MixedPrecisionAdamW
from megapretrain.parallel.state import ParallelState

VOCAB = 300  # not a multiple of 128: exercises vocabulary padding
TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")


def load_tool(name: str) -> types.ModuleType:
    """What ``python tools/NAME.py`` runs, as a module with its ``main``: megapretrain.commands.NAME
    for a command users run, else the script itself (a benchmark or a developer check), imported as
    it imports its siblings: by name, with tools/ on the path (last, so that it shadows nothing)."""
    if importlib.util.find_spec(f"megapretrain.commands.{name}") is not None:
        return importlib.import_module(f"megapretrain.commands.{name}")
    if TOOLS not in sys.path:
        sys.path.append(TOOLS)
    module = importlib.import_module(name)
    assert os.path.dirname(os.path.abspath(module.__file__)) == TOOLS, module.__file__
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
    with trainer.optimizer.full_params():  # zero 3: gathered for the copy
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
