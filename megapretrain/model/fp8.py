"""Which linears run in FP8 (``model.fp8``), and turning them on in a built model chunk.

Every decoder linear — the q, k and v projections (or GPT-NeoX's fused qkv), the attention output,
the MLP's gate/up and down — runs its three GEMMs in FP8 (``parallel/fp8.py``), except those whose
name matches a pattern of ``model.fp8_skip`` (``layers.0.*``, ``*.down_proj``). The embedding
(a lookup, no GEMM) and the output layer (its GEMMs live inside the chunked cross entropy) stay in
``train.precision``, as do norms, biases, attention and the loss; weights, master weights and the
optimizer are untouched, so a checkpoint does not know whether FP8 ran: an FP8 run resumes in bf16
and back.

FP8 communication (``parallel.fp8_allgather``): a block whose column-parallel linears all run in
FP8 all-gathers its sequence-parallel input as FP8; under ZeRO-3 the tensorwise recipe's weights
are all-gathered as FP8 (the rowwise recipe's backward needs the bf16 weight).

Linear names are the chunk's module names, the same for every layout: ``layers.3.self_attn.q_proj``,
``layers.3.mlp.down_proj``.
"""

from __future__ import annotations

import fnmatch
import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import ConfigError, require
from ..parallel.fp8 import RECIPES, FP8Linear, GatheredInputs, WeightCasts
from ..parallel.random import RNGTracker
from ..parallel.state import Group
from ..parallel.tensor import ColumnParallelLinear, RowParallelLinear
from .args import ModelArgs, model_args

if TYPE_CHECKING:
    from ..config import Config
    from ..parallel.layout import Layout
    from .decoder import DecoderModel

LINEARS = (ColumnParallelLinear, RowParallelLinear)
GEMM_MULTIPLE = 16  # FP8 GEMM kernels need every operand dimension a multiple of 16 (cuBLASLt)


def layer_linears(layer: nn.Module) -> dict[str, nn.Module]:
    """A decoder layer's linears by their name inside it (``self_attn.q_proj``)."""
    return {name: m for name, m in layer.named_modules() if isinstance(m, LINEARS)}


@functools.lru_cache(maxsize=64)
def _one_layer(args: ModelArgs) -> tuple[tuple[str, str, tuple[int, int]], ...]:
    """(name inside the layer, "column" | "row", (out, in) global shape) of each linear of one
    decoder layer of ``args``'s family, read off a model built on the meta device."""
    from .decoder import DecoderModel  # the model module imports this one

    with torch.device("meta"):
        model = DecoderModel(args, Group("tp", [0], None, 0), layer_ids=[0],
                             rng=RNGTracker(0, 0, "cpu"), device="meta")
    return tuple((name, "column" if isinstance(m, ColumnParallelLinear) else "row",
                  tuple(m.weight.shape))
                 for name, m in layer_linears(model.layers["0"]).items())


def linear_names(args: ModelArgs) -> list[str]:
    """Every decoder linear's name, layer by layer (``layers.{i}.self_attn.q_proj``)."""
    return [f"layers.{i}.{name}" for i in range(args.num_layers) for name, _, _ in _one_layer(args)]


def skipped(name: str, skip: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in skip)


def unfit_linears(args: ModelArgs, tp: int, skip: list[str]) -> dict[str, tuple[int, int]]:
    """The linears (by name inside a layer) whose weight on a tp rank, (out, in), FP8 GEMMs cannot
    take: a dimension not a multiple of 16. One that ``skip`` keeps out of FP8 in every layer is
    fine."""
    bad = {}
    for name, kind, (out, inp) in _one_layer(args):
        local = (out // tp, inp) if kind == "column" else (out, inp // tp)
        if any(d % GEMM_MULTIPLE for d in local) and not all(
                skipped(f"layers.{i}.{name}", skip) for i in range(args.num_layers)):
            bad[name] = local
    return bad


def check_fp8_fields(cfg: Config) -> None:
    """``model.fp8``'s recipe and ``model.fp8_skip``'s patterns (each must name a linear): the
    rules of any layout (``tools/plan.py`` checks them before its search)."""
    m = cfg.model
    require(m.fp8 == "none" or m.fp8 in RECIPES, f"model.fp8={m.fp8!r} is not one of: none, "
                                                 f"{', '.join(RECIPES)}")
    require(isinstance(m.fp8_skip, list) and all(isinstance(p, str) for p in m.fp8_skip),
            f"model.fp8_skip={m.fp8_skip!r} must be a list of name patterns, e.g. ['layers.0.*', "
            "'*.down_proj']")
    if m.fp8 == "none":
        return
    names = linear_names(model_args(cfg))
    for pattern in m.fp8_skip:
        require(any(fnmatch.fnmatchcase(n, pattern) for n in names),
                f"model.fp8_skip pattern {pattern!r} matches no decoder linear (names look like "
                f"{names[0]}, {names[-1]}; the embedding and output layer never run in FP8)")


def check_fp8(cfg: Config, layout: Layout) -> None:
    """``model.fp8``'s rules: :func:`check_fp8_fields`, and the shapes FP8 GEMMs take — every FP8
    linear's dimensions on a tp rank, and a micro-batch's tokens on a rank (the weight gradient's
    inner dimension), multiples of 16."""
    check_fp8_fields(cfg)
    m = cfg.model
    if m.fp8 == "none":
        return
    args = model_args(cfg)
    tokens = cfg.train.micro_batch_size * cfg.train.seq_length // layout.cp
    require(tokens % GEMM_MULTIPLE == 0,
            f"model.fp8={m.fp8}: a micro-batch's tokens on a rank, train.micro_batch_size × "
            f"train.seq_length / parallel.cp = {tokens}, must be a multiple of {GEMM_MULTIPLE} "
            "(FP8 GEMMs' rule)")
    # every linear FP8 cannot take, named in one line
    bad = unfit_linears(args, layout.tp, m.fp8_skip)
    if bad:
        sizes = ", ".join(f"{name} is {out}×{inp}" for name, (out, inp) in bad.items())
        skip = ", ".join(f"'*.{name}'" for name in bad)
        raise ConfigError(f"model.fp8={m.fp8}: {sizes} on a tp rank (tp={layout.tp}); FP8 GEMMs "
                          f"need multiples of {GEMM_MULTIPLE}: change the sizes or tp, or keep "
                          f"them in {cfg.train.precision} with --model.fp8_skip \"[{skip}]\"")


def fp8_summary(cfg: Config) -> str:
    """What runs in FP8, for the start-up plan: the recipe, the linears (by kind, with the layers
    each covers), what stays in the training precision; "" with FP8 off."""
    m = cfg.model
    if m.fp8 == "none":
        return ""
    args = model_args(cfg)
    kinds = [name.rsplit(".", 1)[-1] for name, _, _ in _one_layer(args)]
    on = {k: [i for i in range(args.num_layers) if not skipped(f"layers.{i}.{n}", m.fp8_skip)]
          for k, (n, _, _) in zip(kinds, _one_layer(args))}
    parts = [f"{k}×{len(layers)}" for k, layers in on.items() if layers]
    count = sum(len(layers) for layers in on.values())
    total = len(kinds) * args.num_layers
    off = ", ".join(m.fp8_skip)
    return (f"fp8={m.fp8}: {count}/{total} linears ({' '.join(parts) or 'none'})"
            + (f", skipped {off}" if off else "")
            + f"; embedding, output layer, attention, norms in {cfg.train.precision}")


def check_fp8_device(device: torch.device) -> None:
    """FP8 GEMMs need FP8 tensor cores on CUDA (compute capability 8.9: Ada, Hopper and later);
    CPUs run ``torch._scaled_mm`` too (slowly: for tests and debugging). ROCm's MI300 takes FP8
    in its own formats (e4m3fnuz), which the recipes here do not cast to."""
    if device.type != "cuda":
        return
    if torch.version.hip:
        raise ConfigError("model.fp8 casts to the OCP formats (e4m3fn, e5m2), which ROCm's FP8 "
                          "GEMMs on MI300 do not take: set --model.fp8 none")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ConfigError("model.fp8 needs FP8 tensor cores (compute capability 8.9+: L4/L40S, "
                          f"H100, B200); {torch.cuda.get_device_name(device)} is {major}.{minor}: "
                          "set --model.fp8 none")


def convert_to_fp8(chunk: DecoderModel, recipe: str, skip: list[str], *, allgather: bool, zero: int,
                   weights: WeightCasts | None = None) -> int:
    """Give ``chunk``'s decoder linears (but those ``skip`` names) FP8 GEMMs under ``recipe``;
    with ``allgather``, the FP8 all-gathers: each block whose column-parallel linears are all FP8
    gathers its sequence-parallel input in FP8, and under ZeRO-3 (``zero`` 3, a recipe with one
    scale per weight) the weights are gathered in FP8 into ``weights`` (shared by a rank's chunks:
    the data-parallel buffers fill it). Under context parallelism the amaxes over the tokens are
    all-reduced over the chunk's cp group. Returns the number of FP8 linears."""
    r = RECIPES[recipe]
    inputs = GatheredInputs(r, chunk.cp) if allgather and chunk.sequence_parallel else None
    weights = weights if allgather and zero == 3 and r.gathers_weight else None
    count = 0
    for i, layer in chunk.layers.items():
        for block_name, block in layer.named_children():  # attention, MLP (and norms: no linears)
            linears = layer_linears(block)
            on = [m for n, m in linears.items()
                  if not skipped(f"layers.{i}.{block_name}.{n}", skip)]
            columns = [m for m in linears.values() if isinstance(m, ColumnParallelLinear)]
            # the block's input (enter_tp_region) is gathered in FP8 only when no bf16 linear reads
            # it
            gathers = inputs is not None and bool(columns) and block.saved is not None and \
                all(any(c is m for m in on) for c in columns)
            for m in on:
                column = isinstance(m, ColumnParallelLinear)
                m.fp8 = FP8Linear(r, m.tp, "out" if column else "in", weights=weights,
                                  inputs=inputs if column and gathers else None, cp=chunk.cp)
            if gathers:
                block.saved = block.saved.with_fp8(inputs)
            count += len(on)
    chunk.fp8_weights = weights
    return count
