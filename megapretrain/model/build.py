"""A rank's model chunks and their parameter-spec table, built from the config.

Training builds real, initialized chunks on the rank's device (:func:`build_model_chunks`); tools
that only need to know what a rank of some layout holds — checkpoint resharding, conversion, the
planner — build the same chunks on the meta device (:func:`rank_param_specs`), so both read one
table from one code path. Nothing here depends on the training loop.
"""

from __future__ import annotations

import os
import shutil
from collections import OrderedDict
from types import MethodType

import torch

from ..config import Config
from ..errors import ConfigError
from ..kernels._triton import use_triton
from ..kernels.dispatch import device_type
from ..parallel.fp8 import WeightCasts
from ..parallel.layout import Layout, chunk_layers
from ..parallel.pipeline import Placement, layout_schedule, named_schedule
from ..parallel.random import RNGTracker
from ..parallel.specs import ParamSpec
from ..parallel.state import Group, ParallelState
from ..parallel.tensor import overlap_tp_comm
from .args import ModelArgs, model_args
from .attention import describe_attention, describe_window, masked_attention, resolve_attention
from .decoder import DecoderModel, ModelChunk
from .families import family
from .fp8 import check_fp8_device, convert_to_fp8

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def table_of(chunks: list[ModelChunk]) -> dict[str, ParamSpec]:
    """The parameter-spec table of a rank's chunks, in their parameter order."""
    return {name: spec for chunk in chunks for name, spec in chunk.param_specs().items()}


def _placed_chunks(args: ModelArgs, tp: Group, place: Placement, pp_rank: int, pipeline_layers,
                   **kw) -> list[ModelChunk]:
    """Stage ``pp_rank``'s chunks under ``place``: the first global chunk embeds, the last holds the
    head (with tied embeddings on the embedding's stage, V placement: through that chunk's
    embedding); ``kw``: the rest of each :class:`DecoderModel`'s arguments."""
    layer_chunks = chunk_layers(args.num_layers, place.pp, place.vpp, pp_rank, pipeline_layers,
                                place.v_shape)
    head_on_stage = place.stage_of(place.chunks - 1) == pp_rank and place.stage_of(0) == pp_rank
    chunks: list[ModelChunk] = []
    for v, layer_ids in enumerate(layer_chunks):
        g = place.global_chunk(pp_rank, v)
        pre, post = g == 0, g == place.chunks - 1
        shared = chunks[0].embed_tokens \
            if post and not pre and head_on_stage and args.tie_embeddings else None
        chunks.append(DecoderModel(args, tp, layer_ids=layer_ids, pre_process=pre,
                                   post_process=post, head_on_stage=head_on_stage and pre,
                                   stage_embedding=shared, **kw))
    return chunks


def _chunks(cfg: Config, tp: Group, pp_rank: int, **kw) -> list[ModelChunk]:
    """Stage ``pp_rank``'s chunks where the pipeline schedule places them (interleaved, or in a V:
    ``parallel/pipeline.py``'s Placement); the first global chunk embeds, the last holds the head;
    their FP8 linears turned on (``model.fp8``)."""
    args, p = model_args(cfg), cfg.parallel
    place = named_schedule(p.pp_schedule, p.pp, p.vpp).placement(p.pp, p.vpp)
    chunks = _placed_chunks(args, tp, place, pp_rank, p.pipeline_layers,
                            sequence_parallel=p.sequence_parallel, recompute=p.recompute, **kw)
    if cfg.model.fp8 != "none":
        weights = WeightCasts()  # one per rank: ZeRO-3's FP8-gathered weights of all its chunks
        for chunk in chunks:
            convert_to_fp8(chunk, cfg.model.fp8, cfg.model.fp8_skip, allgather=p.fp8_allgather,
                           zero=p.zero, weights=weights)
    return chunks


def resolve_kernels(choice: str, device: torch.device) -> str:
    """``model.kernels`` on ``device``: "triton" (kernels/) or "torch". auto: Triton on CUDA, and on
    CPU only under Triton's interpreter (``TRITON_INTERPRET=1``); torch otherwise."""
    kind = device_type(device)
    runs = use_triton(kind)
    if choice == "triton" and not runs:
        raise ConfigError(f"model.kernels=triton cannot run on {kind}: it needs triton and CUDA, "
                          "or TRITON_INTERPRET=1 on CPU (or set model.kernels=auto)")
    return "triton" if choice == "triton" or (choice == "auto" and runs) else "torch"


def _pre_hooks_run_eagerly(forward):
    """``forward`` (a compiled ``DecoderLayer.forward``) as a method that first runs the forward
    pre-hooks of the layer's submodules itself, with no inputs, and hides them while ``forward``
    runs, so that no hook is traced. Those hooks (parallel/data.py's waits for a module's
    parameters) then run as the layer starts rather than as each submodule does: earlier, which
    is all a wait needs; a pre-hook that reads or replaces its module's inputs cannot be moved.
    Forward (post) and backward hooks on the submodules would still be traced; parallel/ registers
    none there."""
    def method(layer, *args, **kwargs):
        hooked = [m for m in layer.modules() if m is not layer and m._forward_pre_hooks]
        saved = [m._forward_pre_hooks for m in hooked]
        for m, hooks in zip(hooked, saved):
            for key, hook in list(hooks.items()):
                if key in m._forward_pre_hooks_with_kwargs:
                    hook(m, (), {})
                else:
                    hook(m, ())
            m._forward_pre_hooks = OrderedDict()
        try:
            return forward(layer, *args, **kwargs)
        finally:
            for m, hooks in zip(hooked, saved):
                m._forward_pre_hooks = hooks
    return method


def compile_layers(chunk: ModelChunk, device: torch.device) -> None:
    """``train.compile``: torch.compile the decoder layers' ``forward`` (regional compilation). One
    compiled function serves every layer: Dynamo caches by code object and, with modules inlined,
    guards on their attributes rather than their identity, so a chunk of layers of one shape
    compiles once. Module hooks stay outside the graph: the layer's own (parallel/zero3.py's
    gather and free) run in ``Module.__call__`` around ``forward``; its submodules' pre-hooks are
    run eagerly as the layer starts (see :func:`_pre_hooks_run_eagerly`). Parameter names are
    unchanged."""
    if device.type == "cpu" and shutil.which(os.environ.get("CXX", "c++")) is None:
        raise ConfigError("train.compile=true on CPU needs a C++ compiler for inductor (install "
                          "g++ or set CXX), or set train.compile=false")
    compiled = {}  # layer class -> its compiled forward, shared by the chunk's layers
    for layer in chunk.layers.values():
        cls = type(layer)
        if cls not in compiled:
            compiled[cls] = _pre_hooks_run_eagerly(torch.compile(cls.forward))
        layer.forward = MethodType(compiled[cls], layer)


def build_model_chunks(cfg: Config, ps: ParallelState) -> tuple[list[ModelChunk],
                                                                dict[str, ParamSpec]]:
    """This rank's ``vpp`` model chunks, on its device, with their layout-invariant initial weights,
    and their parameter-spec table.

    Under ZeRO-3 (``parallel.zero: 3``) the chunks are built without parameter storage and their
    values are written when the optimizer shards them (pass :func:`deferred_initializer` to it).

    The first stage's first chunk embeds, the last stage's last chunk holds the head. With tied
    embeddings and pp > 1 the last stage keeps its own copy of the embedding: both copies start
    equal (same name, same seed), their grads are summed over the embedding group, and the copy on
    the last stage is left out of the grad norm (its spec says so).
    """
    # dropout inside tp regions
    rng = RNGTracker(cfg.train.seed, ps.tp_rank, ps.device, cp_rank=ps.cp_rank)
    deferred = cfg.parallel.zero == 3
    kernels = resolve_kernels(cfg.model.kernels, ps.device)
    if cfg.model.fp8 != "none":
        check_fp8_device(ps.device)
    torch_only = family(cfg.model.family).torch_only_layers(model_args(cfg))
    if kernels == "triton" and torch_only and ps.rank == 0:
        print(f"model.kernels=triton: {' and '.join(torch_only)} of "
              f"model.family={cfg.model.family} have no Triton kernel and run torch's ops",
              flush=True)
    documents = cfg.data.reset_attention_mask
    attention = resolve_attention(cfg.model.attention, ps.device,
                                  dropout=cfg.model.attention_dropout,
                                  documents=masked_attention(cfg))
    if ps.rank == 0:
        print(describe_attention(attention, documents, ps.cp.size > 1, cfg.parallel.cp_comm)
              + describe_window(model_args(cfg), attention), flush=True)
    chunks = _chunks(cfg, ps.tp, ps.pp_rank, rng=rng, kernels=kernels, attention=attention,
                     z_loss=cfg.model.z_loss, cp=ps.cp, cp_comm=cfg.parallel.cp_comm,
                     dtype=DTYPES[cfg.train.precision], device="meta" if deferred else ps.device)
    # parallel/tp_overlap.py (sequence parallelism)
    overlap_tp_comm(chunks, cfg.parallel.tp_comm_overlap)
    for chunk in chunks:
        if deferred:
            _placeholders(chunk, ps.device)
        else:
            chunk.init_weights(cfg.train.seed)
        if cfg.train.compile:
            compile_layers(chunk, ps.device)
    return chunks, table_of(chunks)


def _placeholders(chunk: ModelChunk, device: torch.device) -> None:
    """ZeRO-3: replace every (meta) parameter of ``chunk`` by one of its shape and dtype on
    ``device`` that has no storage. The optimizer's buffers (parallel/data.py) then write each
    unit's initial values straight into its gathered buffer, keep this rank's shard and free the
    rest, so no rank ever holds its whole model: one parameter at a time is allocated here, for an
    instant, and one unit at a time there."""
    for module in chunk.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            tensor = torch.empty(param.shape, dtype=param.dtype, device=device)
            tensor.untyped_storage().resize_(0)
            setattr(module, name, torch.nn.Parameter(tensor, requires_grad=param.requires_grad))


def deferred_initializer(chunks: list[ModelChunk], specs: dict[str, ParamSpec], seed: int):
    """``initialize(param, out)`` for the optimizer's buffers: writes the initial value of a
    parameter of ``chunks`` that :func:`build_model_chunks` left without storage (ZeRO-3) into
    ``out``, the same values :meth:`DecoderModel.init_weights` gives it. ``specs``: the chunks'
    table, as :func:`build_model_chunks` returns it."""
    owner = {id(p): (chunk, name) for chunk in chunks for name, p in chunk.named_parameters()}

    def initialize(param: torch.nn.Parameter, out: torch.Tensor) -> None:
        chunk, name = owner[id(param)]
        chunk.init_parameter(name, out, seed, specs[name])
    return initialize


def rank_param_specs(cfg: Config, pp_rank: int, tp_rank: int) -> dict[str, ParamSpec]:
    """The parameter-spec table of the rank at (``pp_rank``, ``tp_rank``) of ``cfg``'s layout, from
    chunks built on the meta device (nothing is allocated); dp and cp ranks hold the same table."""
    tp = Group("tp", list(range(cfg.parallel.tp)), None, tp_rank)  # no communication on meta
    with torch.device("meta"):
        chunks = _chunks(cfg, tp, pp_rank, rng=RNGTracker(0, tp_rank, "cpu"),
                         dtype=DTYPES[cfg.train.precision], device="meta")
    return table_of(chunks)


def one_layer_specs(args: ModelArgs) -> dict[str, ParamSpec]:
    """The spec table of a one-process model holding the embedding, decoder layer 0, the final
    norm and the head, built on the meta device: per-layer and per-stage parameter counts for the
    planner, read off the model itself."""
    with torch.device("meta"):
        model = DecoderModel(args, Group("tp", [0], None, 0), layer_ids=[0],
                             rng=RNGTracker(0, 0, "cpu"), device="meta")
    return model.param_specs()


def stage_parameters(args: ModelArgs, layout: Layout, pp_rank: int,
                     dtype: torch.dtype = torch.bfloat16) -> list[list[tuple[torch.nn.Parameter,
                                                                             ParamSpec]]]:
    """A rank of stage ``pp_rank`` of ``layout``: each of its chunks' parameters (on the meta
    device: shapes only) with their specs, in ``named_parameters`` order — the trainer's order,
    which its data-parallel buffers are cut into buckets from (``parallel/data.py``)."""
    tp = Group("tp", list(range(layout.tp)), None, 0)  # no communication on meta
    place = layout_schedule(layout).placement(layout.pp, layout.vpp)
    with torch.device("meta"):
        chunks = _placed_chunks(args, tp, place, pp_rank, list(layout.pipeline_layers)
                                if layout.pipeline_layers
                                else None, sequence_parallel=layout.sequence_parallel,
                                recompute=layout.recompute, rng=RNGTracker(0, 0, "cpu"),
                                dtype=dtype, device="meta")
    specs = table_of(chunks)
    return [[(p, specs[name]) for name, p in chunk.named_parameters()] for chunk in chunks]
