"""Parameter specs: how every parameter is laid out across the parallel ranks, in one table.

Each layer declares, for the parameters it owns, a :class:`Sharding` (which dimension tensor
parallelism splits, whether the rows are the vocabulary, whether the parameter decays, whether its
gradient is a partial sum over tp, how it starts: :class:`Init`). The model turns those into one
:class:`ParamSpec` per parameter under its global name, adding what only it knows (the decoder
layer, a tied embedding's copy on another pipeline stage). ``model/build.py`` collects the specs of
a rank's chunks into a table (``dict[str, ParamSpec]``, in parameter order) that the optimizer, the
data-parallel buffers, checkpointing, resharding, Hugging Face conversion and the planner read — and
nothing else: no layout fact is ever read off a parameter object.

A module that owns parameters and declares no sharding is a bug, reported as soon as the specs are
collected; so is a declared sharding that does not match the parameters the module owns. New
dimensions of the layout (parameters sharded over dp under ZeRO-3, context parallelism) become
new fields here, read by the code that needs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Init:
    """How a parameter starts, declared by the layer that owns it: ``normal`` draws the global
    tensor from normal(0, ``std``) seeded by the parameter's name (layout-invariant, see
    ``parallel/tensor.py``'s ``init_shard_``; output projections declare their scaled std),
    ``ones`` and ``zeros`` are constants (norm weights, biases)."""
    kind: str = "normal"  # normal | ones | zeros
    std: float = 0.0

    @staticmethod
    def normal(std: float) -> Init:
        return Init("normal", std)


ONES, ZEROS = Init("ones"), Init("zeros")


@dataclass(frozen=True)
class Sharding:
    """What a layer declares about one of its parameters."""
    tp_dim: int | None = None        # dimension split across tp ranks; None: replicated over tp
    vocab_rows: int | None = None    # dim 0 is the vocabulary: this many real rows, padding after
    #                                  them
    weight_decay: bool = True        # AdamW's decoupled decay applies (not to norm weights)
    partial_grad_over_tp: bool = False  # replicated, but each tp rank's grad covers part of the
    #                                     sequence (sequence-parallel norms): grads are summed over
    #                                     tp
    init: Init | None = None         # how the parameter starts (None: a module outside the model's
    #                                  layers)
    fp8_gather: bool = False         # an FP8 linear's weight with one scale per tensor: ZeRO-3 may
    #                                  all-gather it as FP8 (parallel/fp8.py)
    row_parts: tuple[int, ...] | None = None  # a fused weight: the rows of each logical
    #                                  matrix within every repeating group of dim 0, e.g. (n/k·d,
    #                                  d, d) for a QKV fused per kv head (Muon orthogonalizes each)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of one rank, as every module that handles parameters sees it."""
    name: str                        # global, layout-invariant name, e.g.
    #                                  "layers.3.mlp.up_proj.weight"
    shape: tuple[int, ...]           # the global tensor (vocabulary unpadded)
    local_shape: tuple[int, ...]     # this rank's tensor (vocabulary padded for tp, split over tp)
    dtype: torch.dtype
    tp_dim: int | None               # dimension split across tp ranks; None: replicated over tp
    vocab: bool                      # dim 0 is the vocabulary (padded past shape[0] with zero rows)
    weight_decay: bool
    partial_grad_over_tp: bool       # grads summed over tp before the dp reduction
    layer: int | None                # global decoder layer index; None: embedding, final norm, head
    tied: bool = False               # the embedding tied to the output layer, held by the first and
    #                                  the last pipeline stage: grads summed over the embedding
    #                                  group
    duplicate: bool = False          # this rank's copy of a tied embedding is the last stage's
    #                                  second copy: not counted in the grad norm
    uses: int = 1                    # backward passes adding to its gradient per micro-batch: 2 for
    #                                  an embedding its stage's head (another chunk: V placement)
    #                                  shares
    init: Init | None = None         # how the parameter starts (its layer's declaration)
    fp8_gather: bool = False         # ZeRO-3 all-gathers it as FP8 and a scale (parallel/fp8.py)
    row_parts: tuple[int, ...] | None = None  # a fused weight's logical matrices (Sharding's)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def counts_in_grad_norm(self, tp_rank: int) -> bool:
        """Whether this rank's gradient adds to the global norm: tp-split parameters on every tp
        rank, replicated ones on tp rank 0 only, a tied embedding's second copy never."""
        return not self.duplicate and (self.tp_dim is not None or tp_rank == 0)


def collect_specs(module: nn.Module, tp_size: int, *, prefix: str = "", layer: int | None = None,
                  tied: bool = False, duplicate: bool = False,
                  uses: int = 1) -> dict[str, ParamSpec]:
    """Specs of every parameter under ``module`` from the shardings its layers declare
    (``param_shardings()``); ``tied`` / ``duplicate`` / ``uses`` apply to all of them."""
    specs = {}
    for mod_name, mod in module.named_modules(prefix=prefix):
        own = dict(mod.named_parameters(recurse=False))
        if not own:
            continue
        if not hasattr(mod, "param_shardings"):
            raise TypeError(f"{type(mod).__name__} at '{mod_name}' owns parameters {sorted(own)} "
                            "but has no param_shardings() declaring how they are laid out (see "
                            "parallel/specs.py)")
        shardings = mod.param_shardings()
        if set(shardings) != set(own):
            raise TypeError(f"{type(mod).__name__}.param_shardings() declares {sorted(shardings)}, "
                            f"but the module owns {sorted(own)}")
        for pname, param in own.items():
            name = f"{mod_name}.{pname}" if mod_name else pname
            specs[name] = make_spec(name, param, shardings[pname], tp_size, layer=layer, tied=tied,
                                    duplicate=duplicate, uses=uses)
    return specs


def make_spec(name: str, param: torch.Tensor, s: Sharding, tp_size: int,
              **model_facts) -> ParamSpec:
    """The spec of ``param`` (this rank's tensor) laid out as ``s`` says over ``tp_size`` ranks."""
    shape = list(param.shape)
    if s.tp_dim is not None:
        shape[s.tp_dim] *= tp_size
    if s.vocab_rows is not None:
        shape[0] = s.vocab_rows
    return ParamSpec(name=name, shape=tuple(shape), local_shape=tuple(param.shape),
                     dtype=param.dtype, tp_dim=s.tp_dim, vocab=s.vocab_rows is not None,
                     weight_decay=s.weight_decay, partial_grad_over_tp=s.partial_grad_over_tp,
                     init=s.init, fp8_gather=s.fp8_gather, row_parts=s.row_parts,
                     **model_facts)


def plain_specs(named_params) -> dict[str, ParamSpec]:
    """Specs for parameters of a module built outside this project's layers (no tensor
    parallelism): whole on every rank, decayed when at least 2-D."""
    return {name: make_spec(name, p, Sharding(weight_decay=p.ndim >= 2), 1, layer=None)
            for name, p in named_params}
