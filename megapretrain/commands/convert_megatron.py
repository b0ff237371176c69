"""``convert_checkpoint.py from-megatron`` / ``to-megatron``: Megatron-LM ``torch_dist``
checkpoints in and out (the format itself: ``checkpoint/megatron.py``).

    python tools/convert_checkpoint.py from-megatron --megatron MEGATRON_RUN --output ckpt/m \\
        [--config CONFIG] [--parallel.tp 2 ...] [--world-size W] [--model.* ...] [--weights-only]
    python tools/convert_checkpoint.py to-megatron --checkpoint runs/tiny --output MEGATRON_RUN \\
        [--dtype bf16] [--padded-vocab-size N]

``from-megatron`` reads a run directory (its ``latest_checkpointed_iteration.txt``) or one
``iter_*`` directory saved under any tp/pp, and writes a megapretrain checkpoint for the target
layout: fp32 weights and, when its optimizer state is in model space (Megatron-Core's
non-distributed optimizer, or the distributed one's ``fully_reshardable`` format), Adam's moments
and step, the fp32 masters of a bf16/fp16 run and Megatron's iteration (else iteration 0 and no
optimizer state: it starts fresh, and one line says why). The model's shape is
read off the tensors and Megatron's saved ``args`` (``common.pt``); ``--config`` and ``--model.*``
flags win over both, and a flag that disagrees with a tensor's shape is one line naming both.

``to-megatron`` writes a Megatron-LM run directory: ``iter_NNNNNNN/`` (the weights under
Megatron-Core's GPT keys, ``common.pt`` with ``args``, ``metadata.json``) and
``latest_checkpointed_iteration.txt``, which ``megatron.core.dist_checkpointing.load`` reads into a
``GPTModel`` of the same shape under any tp/pp. Weights only.
"""

from __future__ import annotations

import argparse
import os

import torch

from megapretrain.checkpoint.directories import new_directory, resolve_checkpoint
from megapretrain.checkpoint.format import (
    check_shapes,
    read_metadata,
)
from megapretrain.checkpoint.megatron import (
    MegatronCheckpoint,
    MegatronError,
    adam_state,
    check_against,
    flag_list,
    model_flags,
    reader_of,
    write_megatron,
)
from megapretrain.checkpoint.reshard import (
    GlobalWeights,
    global_shapes,
    saved_config_path,
    write_weights_checkpoint,
)
from megapretrain.cli import positive_int
from megapretrain.config import load_config
from megapretrain.model.args import padded_vocab_size
from megapretrain.model.build import DTYPES
from megapretrain.resolve import resolve

COMMANDS = ("from-megatron", "to-megatron")
FRESH_OPTIMIZER = ("optimizer state not imported ({why}): the optimizer starts fresh (train "
                   "with --checkpoint.finetune true)")
CARRIED = ("carried: Adam's moments and step {step}{masters}, and the iteration {iteration}; "
           "not carried: learning-rate schedule, data position (from the start) and random state")


def add_parsers(sub) -> None:
    """The ``from-megatron`` and ``to-megatron`` subcommands."""
    frm = sub.add_parser("from-megatron", help="Megatron-LM torch_dist checkpoint -> megapretrain "
                                               "checkpoint",
                         epilog="Other --section.key VALUE arguments set the model (--model.*) and "
                                "the target layout (--parallel.tp ...).")
    frm.add_argument("--megatron", required=True,
                     help="Megatron-LM run directory (latest_checkpointed_iteration.txt) or one of "
                          "its iter_* directories")
    frm.add_argument("--output", required=True, help="new checkpoint directory (for "
                                                     "--checkpoint.load)")
    frm.add_argument("--config", help="YAML config of the run that will train from it")
    frm.add_argument("--world-size", type=positive_int,
                     help="ranks of the target run (default: tp × cp × pp)")
    frm.add_argument("--weights-only", action="store_true",
                     help="leave the checkpoint's optimizer state out (it starts fresh)")
    to = sub.add_parser("to-megatron", help="megapretrain checkpoint -> Megatron-LM torch_dist "
                                            "run directory")
    to.add_argument("--checkpoint", required=True,
                    help="iter_* directory, or a run directory (its latest)")
    to.add_argument("--output", required=True, help="new Megatron-LM run directory")
    to.add_argument("--config",
                    help="the run's config (default: config.yaml of the run that saved it)")
    to.add_argument("--dtype", choices=sorted(DTYPES),
                    help="weights' dtype (default: the run's train.precision)")
    to.add_argument("--padded-vocab-size", type=positive_int,
                    help="embedding and output rows, as Megatron-LM pads the vocabulary "
                         "(default: model.vocab_size rounded up to "
                         "model.make_vocab_size_divisible_by)")


def _local(weight, spec, tp_rank: int) -> torch.Tensor:
    """Rank ``tp_rank``'s fp32 slice of ``spec``'s global weight, vocabulary rows padded."""
    t = weight(spec.name)
    dim, local = spec.tp_dim, spec.local_shape
    if dim is not None:
        lo = min(tp_rank * local[dim], t.shape[dim])  # a rank may hold padding only
        t = t.narrow(dim, lo, min(local[dim], t.shape[dim] - lo))
    if dim is not None and t.shape[dim] < local[dim]:  # rows past the vocabulary: zeros
        pad = list(local)
        pad[dim] -= t.shape[dim]
        t = torch.cat([t, t.new_zeros(pad)], dim)
    if not torch.isfinite(t).all():
        raise MegatronError(f"Megatron weights for '{spec.name}' hold NaN or infinite values; "
                            "these weights cannot be trained from (nothing written)")
    return t.contiguous()


def from_megatron(args: argparse.Namespace, overrides: list[str]) -> str:
    ckpt = MegatronCheckpoint(args.megatron)
    inferred = model_flags(ckpt)
    if "num_heads" not in inferred and "--model.num_heads" not in overrides and not args.config:
        why = ckpt.common_problem or f"{ckpt.path}/common.pt has no args"
        raise MegatronError(f"{why}, and the number of attention heads cannot be read off the "
                            "tensors: pass --model.num_heads and --model.num_kv_heads")
    cfg = load_config(args.config, flag_list(inferred) + overrides)
    given = "the flags" + (" and the checkpoint's args" if ckpt.args else "")
    p = cfg.parallel
    world = args.world_size or p.tp * p.cp * p.pp
    sizes = resolve(cfg, world).sizes
    shapes = global_shapes(cfg)
    check_against(ckpt, cfg, shapes, given)
    step, masters, why = (None, None, "--weights-only") if args.weights_only else \
        adam_state(ckpt, shapes)
    weight = reader_of(ckpt, cfg, masters)
    moments = None
    if step is not None:
        readers = {k: reader_of(ckpt, cfg, k) for k in ("exp_avg", "exp_avg_sq")}

        def moments(spec, tp_rank: int, key: str) -> torch.Tensor:
            return _local(readers[key], spec, tp_rank)
    meta, _ = write_weights_checkpoint(
        args.output, cfg, sizes, world, lambda spec, tp_rank: _local(weight, spec, tp_rank),
        label="from-megatron", record={"converted_from": os.path.abspath(ckpt.path),
                                       "megatron_iteration": ckpt.iteration},
        moments=moments, step=step or 0, iteration=ckpt.iteration if step is not None else 0)
    layout = meta["layout"]
    note = f" ({ckpt.common_problem}: shape from the tensors and flags)" \
        if ckpt.common_problem else ""
    if step is None:
        optimizer = FRESH_OPTIMIZER.format(why=why)
    else:
        optimizer = CARRIED.format(step=step, iteration=ckpt.iteration,
                                   masters=", the fp32 master weights" if masters else "")
    return (f"wrote {args.output} for {world} ranks (layout {layout}) from iteration "
            f"{ckpt.iteration} of {ckpt.path}{note}; {optimizer}; train from it with "
            f"--checkpoint.load {args.output} and\n  {' '.join(flag_list(inferred))}")


def to_megatron(args: argparse.Namespace) -> str:
    path = resolve_checkpoint(args.checkpoint)
    meta = read_metadata(path)
    cfg = load_config(saved_config_path(path, args.config), [])
    m = cfg.model
    if m.vocab_size is None:
        m.vocab_size = meta.get("vocab_size")
    # (Megatron's GPT layout as read and written here: a format's limits, checked field by field
    # as the torchtitan export does)
    required = (("family", m.family, "llama"), ("mlp", m.mlp, "swiglu"),
                ("rope_scaling", bool(m.rope_scaling), False),
                ("sliding_window", m.sliding_window is not None, False),
                ("parallel_residual", bool(m.parallel_residual), False))
    if any(value != wanted for _, value, wanted in required):
        raise MegatronError(f"model.family={m.family}, mlp={m.mlp}, rope_scaling={m.rope_scaling}"
                            f", sliding_window={m.sliding_window}, parallel_residual="
                            f"{m.parallel_residual}: to-megatron writes the llama family with "
                            "swiglu, no rope_scaling, no sliding window, no parallel residual")
    check_shapes(path, meta, global_shapes(cfg))
    weights = GlobalWeights(path, cfg)  # resets cfg's layout to one process
    resolve(cfg, 1)
    shapes = {n: s.shape for n, s in weights.specs.items()}
    padded = args.padded_vocab_size or padded_vocab_size(m.vocab_size,
                                                         m.make_vocab_size_divisible_by, 1)
    if padded < m.vocab_size:
        raise MegatronError(f"--padded-vocab-size {padded} is less than model.vocab_size="
                            f"{m.vocab_size}; pass at least {m.vocab_size}")
    dtype = DTYPES[args.dtype or cfg.train.precision]
    size = sum(s.numel for s in weights.specs.values()) * dtype.itemsize
    with new_directory(args.output, needed=size) as tmp:
        written = write_megatron(tmp, cfg, shapes, weights.get, dtype, padded, meta["iteration"])
    weights.close()
    return (f"wrote {args.output}: iteration {meta['iteration']} of {path}, "
            f"{written / 2**20:,.1f} MiB of {str(dtype).removeprefix('torch.')} weights under "
            "Megatron-Core GPT keys "
            f"(vocabulary padded to {padded}); weights only: load it in Megatron-LM with "
            "--no-load-optim --no-load-rng (or --finetune)")


def run(args: argparse.Namespace, overrides: list[str]) -> str:
    """Run the ``from-megatron`` or ``to-megatron`` command ``args`` names; its closing line."""
    if args.command == "to-megatron":
        return to_megatron(args)
    return from_megatron(args, overrides)
