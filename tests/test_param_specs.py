"""The parameter-spec table: one source for how every parameter is laid out.

The trainer's table equals the one a tool builds on the meta device for the same rank; the model
declares its own facts (tp split, vocabulary rows, sequence-parallel norms, the tied embedding and
its duplicate); nothing reads or writes a layout fact as an attribute of a parameter.
"""

from __future__ import annotations

import ast
import dataclasses
import os

import pytest
import torch
from torch import nn

from megapretrain.config import load_config
from megapretrain.model.build import rank_param_specs
from megapretrain.parallel.specs import ParamSpec, collect_specs
from megapretrain.train import setup

from distributed import run_distributed
from helpers import BASE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUT = ["--parallel.tp", "2", "--parallel.pp", "2", "--parallel.sequence_parallel", "true",
          "--model.tie_embeddings", "true", "--train.precision", "bf16"]


def _trainer_specs(rank, world, run_dir, corpus):
    trainer = setup(["--run.dir", run_dir, "--data.paths", f"[{corpus}]", *BASE, *LAYOUT, "--train.iters", "1"])
    trainer.fit()  # one step: grads, buckets and the optimizer have touched every parameter
    extra = {name: sorted(vars(p)) for chunk in trainer.model_chunks for name, p in chunk.named_parameters()}
    return {"pp": trainer.ps.pp_rank, "tp": trainer.ps.tp_rank, "specs": trainer.specs, "attributes": extra}


@pytest.fixture(scope="module")
def ranks(corpus, tmp_path_factory):
    return run_distributed(_trainer_specs, 4, str(tmp_path_factory.mktemp("specs")), corpus, timeout=300)


def test_a_tool_builds_the_trainer_s_table(ranks, corpus):
    cfg = load_config(None, ["--data.paths", f"[{corpus}]", *BASE, *LAYOUT, "--model.vocab_size", "257"])
    for r in ranks:
        assert rank_param_specs(cfg, r["pp"], r["tp"]) == r["specs"]


def test_the_model_declares_its_layout(ranks):
    first = next(r["specs"] for r in ranks if r["pp"] == 0 and r["tp"] == 1)
    last = next(r["specs"] for r in ranks if r["pp"] == 1 and r["tp"] == 1)
    emb, dup = first["embed_tokens.weight"], last["embed_tokens.weight"]
    assert emb.tied and not emb.duplicate and dup.tied and dup.duplicate and "lm_head.weight" not in last
    assert emb.vocab and emb.shape == (257, 64) and emb.local_shape == (256, 64) and emb.tp_dim == 0
    assert emb.counts_in_grad_norm(0) and emb.counts_in_grad_norm(1) and not dup.counts_in_grad_norm(0)
    q, o = first["layers.0.self_attn.q_proj.weight"], first["layers.1.self_attn.o_proj.weight"]
    assert (q.tp_dim, q.shape, q.local_shape, q.layer) == (0, (64, 64), (32, 64), 0)
    assert (o.tp_dim, o.shape, o.local_shape, o.layer) == (1, (64, 64), (64, 32), 1)
    norm = last["layers.3.input_layernorm.weight"]
    assert norm.partial_grad_over_tp and norm.tp_dim is None and not norm.weight_decay
    assert norm.counts_in_grad_norm(0) and not norm.counts_in_grad_norm(1)
    assert last["norm.weight"].layer is None and last["norm.weight"].partial_grad_over_tp
    assert all(s.dtype == torch.bfloat16 for r in ranks for s in r["specs"].values())


def test_no_layout_fact_rides_on_a_parameter(ranks):
    """After a training step, parameters carry nothing but the fp32 gradient view the buffers own."""
    for r in ranks:
        assert all(set(names) <= {"main_grad"} for names in r["attributes"].values()), r["attributes"]


LAYOUT_NAMES = {f.name for f in dataclasses.fields(ParamSpec)} - {"name", "shape", "dtype"} | {
    "tp_shard_dim", "shared_embedding", "pipeline_duplicate", "sequence_parallel", "shard_dims"}


def _sources():
    for top in ("megapretrain", "kernels", "tools"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            yield from (os.path.join(folder, f) for f in files if f.endswith(".py"))


def test_no_module_reads_a_layout_attribute_off_an_object():
    """``getattr(x, "<layout fact>", default)`` is how a forgotten tag silently gives the wrong
    answer; every such fact comes from the spec table."""
    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in LAYOUT_NAMES):
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    assert not found, found


def test_a_module_that_declares_no_sharding_is_a_bug():
    class Undeclared(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(3, 4))

    with pytest.raises(TypeError, match="Undeclared at 'head' owns parameters \\['weight'\\]"):
        collect_specs(Undeclared(), 1, prefix="head")

    class Mismatched(Undeclared):
        def param_shardings(self):
            return {"bias": None}

    with pytest.raises(TypeError, match="declares \\['bias'\\], but the module owns \\['weight'\\]"):
        collect_specs(Mismatched(), 1)
