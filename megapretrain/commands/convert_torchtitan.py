"""``from-torchtitan`` / ``to-torchtitan`` (aliases ``from-dcp`` / ``to-dcp``) of
tools/convert_checkpoint.py: torchtitan Llama 3 checkpoints (torch.distributed.checkpoint) in and
out, streaming one tensor at a time (``checkpoint/torchtitan.py`` holds the format's facts).

    python tools/convert_checkpoint.py from-torchtitan --dcp outputs/checkpoint/step-1000 \\
        --output ckpt/titan [--config C] [--parallel.tp 2 ... --world-size W] [--model.* ...] \\
        [--weights-only]
    python tools/convert_checkpoint.py to-torchtitan --checkpoint runs/x --output titan/step-0 \\
        [--dtype bf16] [--key-names released|main]

The model's shape comes from ``--config`` and ``--model.*`` flags (a torchtitan checkpoint records
tensors, not its model's settings); the rotary settings default to torchtitan's Llama 3 ones
(``rope_theta`` 500000 with Llama 3.1 scaling) where ``--config`` does not set them, and flags win
over both. A full checkpoint's AdamW state (moments and step) comes in with the weights, the
step as the iteration too (``--weights-only`` leaves it out); data position, learning-rate schedule
and random state do not.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import yaml

from megapretrain.checkpoint.directories import new_directory, resolve_checkpoint
from megapretrain.checkpoint.format import check_shapes, read_metadata
from megapretrain.checkpoint.reshard import (
    GlobalWeights,
    global_shapes,
    saved_config_path,
    write_weights_checkpoint,
)
from megapretrain.checkpoint.torchtitan import (
    ROPE_SCALING,
    ROPE_THETA,
    STYLES,
    ConvertError,
    DCPTensors,
    TorchtitanWeights,
    check_model,
    find_dcp,
    global_slice,
    save_dcp,
    titan_name,
    to_pairs,
)
from megapretrain.cli import positive_int, progress_bar
from megapretrain.config import load_config, save_config
from megapretrain.model.build import DTYPES, model_args
from megapretrain.resolve import resolve

FROM, TO = ("from-torchtitan", "from-dcp"), ("to-torchtitan", "to-dcp")
COMMANDS = FROM + TO
NOT_CARRIED = ("not carried: optimizer state (Adam moments and step), learning-rate schedule, "
               "data position and random state")
FRESH = "optimizer state not imported: the optimizer starts fresh"
CARRIED = ("carried: AdamW's moments and step {step} (as the iteration too); not carried: "
           "learning-rate schedule (the config's, from iteration {step}), data position (from the "
           "start) and random state")


def add_parsers(sub) -> None:
    """The two subcommands (and their aliases) on ``sub``, the tool's subparsers."""
    frm = sub.add_parser(FROM[0], aliases=list(FROM[1:]),
                         help="torchtitan Llama 3 checkpoint (DCP) -> megapretrain checkpoint",
                         epilog="Other --section.key VALUE arguments set the model's shape "
                                "(--model.hidden_size ...) and the target layout "
                                "(--parallel.tp ...).")
    frm.add_argument("--dcp", required=True, help="a torchtitan step-N directory (.metadata + "
                                                  "*.distcp), or the folder holding step-N/")
    frm.add_argument("--output", required=True, help="new checkpoint directory (for "
                                                     "--checkpoint.load)")
    frm.add_argument("--config", help="YAML config of the run that will train from it (its model "
                                      "and layout)")
    frm.add_argument("--world-size", type=positive_int,
                     help="ranks of the target run (default: tp × cp × pp)")
    frm.add_argument("--weights-only", action="store_true",
                     help="leave the checkpoint's AdamW state out (the optimizer starts fresh)")
    to = sub.add_parser(TO[0], aliases=list(TO[1:]),
                        help="megapretrain checkpoint -> torchtitan Llama 3 checkpoint (DCP)")
    to.add_argument("--checkpoint", required=True,
                    help="iter_* directory, or a run directory (its latest)")
    to.add_argument("--output", required=True, help="new DCP directory (torchtitan's "
                                                    "checkpoint.initial_load_path)")
    to.add_argument("--config",
                    help="the run's config (default: config.yaml of the run that saved it)")
    to.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weights' dtype")
    to.add_argument("--key-names", choices=STYLES, default="released",
                    help="torchtitan's key spelling: released (≤ 0.2: attention.wq, output) or "
                         "main (attention.qkv_linear.wq, lm_head)")


def run(args: argparse.Namespace, overrides: list[str]) -> str:
    if args.command in FROM:
        return from_torchtitan(args, overrides)
    if overrides:
        raise ConvertError(f"{args.command} takes no {overrides[0]}: the model comes from the "
                           "checkpoint's config.yaml (or --config)")
    return to_torchtitan(args)


def _flag(value) -> str:
    return json.dumps(value) if isinstance(value, dict) else str(value)


def _titan_rope(config: str | None) -> list[str]:
    """Overrides setting torchtitan's Llama 3 rotary (theta, scaling), each unless ``config``
    sets it: a torchtitan checkpoint does not record its model's settings."""
    model = {}
    if config is not None:
        with open(config, encoding="utf-8-sig") as fh:  # load_config has checked it
            model = (yaml.safe_load(fh) or {}).get("model") or {}
    flags = [] if "rope_theta" in model else ["--model.rope_theta", _flag(ROPE_THETA)]
    return flags + ([] if "rope_scaling" in model else
                    ["--model.rope_scaling", _flag(ROPE_SCALING)])


def from_torchtitan(args: argparse.Namespace, overrides: list[str]) -> str:
    path = find_dcp(args.dcp)
    tensors = DCPTensors(path)
    load_config(args.config, overrides)  # a missing or bad --config: one line, before reading it
    cfg = load_config(args.config, _titan_rope(args.config) + overrides)
    m = cfg.model
    check_model(cfg)
    weights = TorchtitanWeights(tensors)
    if m.vocab_size is None:  # the embedding's rows
        m.vocab_size = tensors.shapes[weights.key("embed_tokens.weight")][0]
    p = cfg.parallel
    world = args.world_size or p.tp * p.cp * p.pp
    sizes = resolve(cfg, world).sizes
    margs = model_args(cfg)
    shapes = global_shapes(cfg)
    weights.check(shapes, m.tie_embeddings, (margs.num_heads, margs.num_kv_heads))
    step = None if args.weights_only else weights.adam_step(shapes)
    moments = None if step is None else \
        lambda spec, tp_rank, key: global_slice(lambda n: weights.moment(n, key), spec, tp_rank)
    meta, _ = write_weights_checkpoint(
        args.output, cfg, sizes, world,
        lambda spec, tp_rank: global_slice(weights.get, spec, tp_rank),
        label="from-torchtitan", record={"converted_from": os.path.abspath(path)},
        moments=moments, step=step or 0)
    layout = meta["layout"]
    left = [o for o in weights.others if o != "optimizer" or step is None]
    others = f" (the checkpoint's {', '.join(left)} are left out)" if left else ""
    scaling = f"llama3 ×{m.rope_scaling['factor']:g}" if m.rope_scaling else "none"
    head = (f"wrote {args.output} for {world} ranks (layout {layout}) from {path} "
            f"({weights.style} torchtitan keys); rotary: rope_theta {m.rope_theta:g}, scaling "
            f"{scaling}\n")
    if step is None:
        return (f"{head}{FRESH}; {NOT_CARRIED}{others}: train from it with --checkpoint.load "
                f"{args.output} --checkpoint.finetune true")
    return (f"{head}{CARRIED.format(step=step)}{others}: resume from it with --checkpoint.load "
            f"{args.output} (train.iters above {step}), or start afresh from its weights with "
            "--checkpoint.finetune true")


def to_torchtitan(args: argparse.Namespace) -> str:
    path = resolve_checkpoint(args.checkpoint)
    meta = read_metadata(path)
    cfg = load_config(saved_config_path(path, args.config), [])
    m = cfg.model
    m.vocab_size = m.vocab_size or meta.get("vocab_size")
    if m.vocab_size is None:
        raise ConvertError(f"model.vocab_size is null in the config and {path}/metadata.json has "
                           "none: pass --config with model.vocab_size set")
    check_model(cfg)
    check_shapes(path, meta, global_shapes(cfg))
    weights = GlobalWeights(path, cfg)  # resets cfg's layout to one process
    resolve(cfg, 1)
    margs = model_args(cfg)
    heads = {"q_proj": margs.num_heads, "k_proj": margs.num_kv_heads}
    dtype, style = DTYPES[args.dtype], args.key_names
    source = {titan_name(n, style): n for n in weights.specs}
    if m.tie_embeddings:  # torchtitan's Llama 3 keeps an output layer of its own: the embedding
        source[titan_name("lm_head.weight", style)] = "embed_tokens.weight"
    shapes = {k: (tuple(weights.specs[n].shape), dtype) for k, n in source.items()}
    size = sum(torch.Size(s).numel() for s, _ in shapes.values()) * dtype.itemsize

    with new_directory(args.output, needed=size) as tmp, \
            progress_bar(size, "to-torchtitan") as bar:
        def produce(key: str) -> torch.Tensor:
            name = source[key]
            w = weights.get(name)
            part = name.split(".", 2)[-1].split(".")[1] if name.startswith("layers.") else ""
            if part in heads:
                w = to_pairs(w, heads[part])
            out = _exported(key, w, dtype)
            bar.update(out.numel() * out.element_size())
            return out

        save_dcp(tmp, shapes, produce)
        save_config(cfg, os.path.join(tmp, "config.yaml"))  # beside it, as every tool writes
    weights.close()
    factors = {k: v for k, v in (m.rope_scaling or {}).items() if k != "rope_type"}
    scaling = f"rope scaling llama3 {json.dumps(factors)}" if factors else "no rope scaling"
    return (f"wrote {args.output}: iteration {meta['iteration']} of {path}, {len(shapes)} "
            f"{args.dtype} tensors ({style} torchtitan keys); torchtitan's Llama 3 model must "
            f"match: dim {m.hidden_size}, n_layers {m.num_layers}, n_heads {margs.num_heads}, "
            f"n_kv_heads {margs.num_kv_heads}, vocab_size {m.vocab_size}, FFN hidden "
            f"{margs.ffn_hidden_size}, norm_eps {m.norm_eps:g}, rope_theta {m.rope_theta:g}, "
            f"{scaling}\n{NOT_CARRIED}: load it in torchtitan with checkpoint.initial_load_path "
            f"{args.output} and checkpoint.initial_load_model_only true")


def _exported(key: str, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` in ``dtype``; NaN or infinite values (before or after the cast) are refused."""
    out = weight.to(dtype).contiguous()
    if not (torch.isfinite(weight).all() and torch.isfinite(out).all()):
        raise ConvertError(f"'{key}' holds NaN or infinite values in {dtype} (max |w| "
                           f"{weight.abs().max().item():.3g}): convert an earlier checkpoint or "
                           "use --dtype fp32 (nothing written)")
    return out
