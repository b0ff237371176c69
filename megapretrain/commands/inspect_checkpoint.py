"""Show what a checkpoint holds, check its integrity, and compare two checkpoints tensor by tensor.

    python tools/inspect_checkpoint.py runs/tiny                       # its latest checkpoint
    python tools/inspect_checkpoint.py runs/tiny/checkpoints/iter_0000100 [--no-checksum]
    python tools/inspect_checkpoint.py CKPT_A --diff CKPT_B [--config CONFIG] \\
        [--rtol 1e-4 --atol 1e-6 | --exact]

Prints the iteration, the data position (samples, and tokens when the run's config is found), the
layout it was saved under, the model's shape, every tensor's global shape and saved dtype, and the
sizes on disk. The integrity check is the one training runs before loading (metadata, every rank's
file present at its recorded size, CRC-32s): a problem exits 2 with one line naming it.
``--diff`` puts every weight of both checkpoints together (whatever their layouts) one tensor at
a time and compares them: a tensor matches when its largest absolute difference is at most
``--atol + --rtol × max|B|`` (the noise of fp32 arithmetic in another order passes; ``--exact``
asks for equal bits). It names both iterations, counts identical, matching and differing tensors,
prints each differing one, and exits 1 when any differs (a NaN never matches).
The config (the run's ``config.yaml``, or ``--config``) must describe the checkpoint's model: its
shapes are checked against the saved ones before anything is described.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from megapretrain.checkpoint.directories import owner, resolve_checkpoint
from megapretrain.checkpoint.format import METADATA, check_shapes, problem, read_metadata
from megapretrain.checkpoint.reshard import (
    GlobalWeights,
    SavedShards,
    global_shapes,
    saved_config_path,
)
from megapretrain.cli import ToolParser, non_negative_float, user_errors
from megapretrain.config import check_fields, load_config
from megapretrain.errors import CheckpointError, UserError
from megapretrain.model.args import ffn_hidden_size, kv_heads


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = ToolParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="iter_* directory, or a run directory (its latest)")
    ap.add_argument("--diff", metavar="OTHER", help="compare every tensor with this checkpoint")
    ap.add_argument("--config",
                    help="the run's config (default: config.yaml of the run that saved it)")
    ap.add_argument("--no-checksum", action="store_true",
                    help="check sizes only (skip reading every file)")
    ap.add_argument("--rtol", type=non_negative_float, default=1e-4,
                    help="--diff: relative tolerance, times the largest |value| of the tensor "
                         "(default 1e-4)")
    ap.add_argument("--atol", type=non_negative_float, default=1e-6,
                    help="--diff: absolute tolerance (default 1e-6)")
    ap.add_argument("--exact", action="store_true",
                    help="--diff: every bit equal (--rtol 0 --atol 0)")
    args = ap.parse_args(argv)
    if args.exact:
        args.rtol = args.atol = 0.0
    return args


def _config(path: str, explicit: str | None):
    """The config describing checkpoint ``path``'s model: ``explicit`` (its problems are the user's
    to hear), else the saved run's, if readable (None when not). Its shapes must be the saved
    ones."""
    try:
        source = saved_config_path(path, explicit)
        cfg = load_config(source, [])
    except UserError:
        if explicit:
            raise
        return None
    meta = read_metadata(path)
    cfg.model.vocab_size = cfg.model.vocab_size or meta.get("vocab_size")
    try:
        check_fields(cfg)
        check_shapes(path, meta, global_shapes(cfg))
    except UserError as exc:
        raise CheckpointError(f"{source} does not describe the model of {path}: {exc}") from None
    return cfg


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return ""


def _dtypes(saved: SavedShards) -> dict[str, str]:
    """The saved dtype of every weight, from the first rank file of each stage that holds it."""
    out = {}
    for rank, (_, d, c, t) in enumerate(saved.coords):
        if d == 0 and c == 0 and t == 0:
            f = saved.file(rank)
            for name in f.skeleton["model"]:
                if name not in out:
                    dtype = f.dtype(name)
                    out[name] = str(dtype).replace("torch.", "") if dtype is not None else "?"
    return out


def describe(path: str, cfg) -> str:
    meta = read_metadata(path)
    saved = SavedShards(path, meta)
    first = saved.state(0)
    lines = [f"{path}, {owner(path)}",
             f"  format version {meta.get('format_version', 1)}, iteration "
             f"{meta['iteration']}, world size {meta['world_size']}, layout {meta['layout']}"]
    samples = first.get("consumed_samples", 0)
    tokens = f", {samples * cfg.train.seq_length:,} tokens" if cfg is not None else ""
    lines.append(f"  data position: {samples:,} samples{tokens}; optimizer step "
                 f"{first['optimizer']['step']}")
    if cfg is not None:
        m = cfg.model
        lines.append(f"  model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads "
                     f"({kv_heads(m)} kv), ffn {ffn_hidden_size(m)}, vocab "
                     f"{meta.get('vocab_size')} (padded {meta.get('padded_vocab')}), tied "
                     f"{m.tie_embeddings}, rope_scaling {m.rope_scaling}")
    shapes = meta.get("tensors")
    dtypes = _dtypes(saved)
    if shapes is None:  # version 1 records no global shapes
        shapes = dict.fromkeys(dtypes, "?")
    total = sum(v["bytes"] for v in meta.get("files", {}).values()) or sum(
        os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n != METADATA)
    params = sum(_numel(s) for s in shapes.values() if s != "?")
    lines.append(f"  {len(shapes)} tensors, {params:,} parameters; {_size(total)} on disk in "
                 f"{meta['world_size']} rank files")
    width = max((len(n) for n in shapes), default=0)
    for name, shape in shapes.items():
        shown = tuple(shape) if shape != "?" else "?"
        lines.append(f"    {name:<{width}}  {str(shown):<16} {dtypes.get(name, '?')}")
    saved.close()
    return "\n".join(lines)


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def diff(a: str, b: str, cfg_a, cfg_b, atol: float = 0.0, rtol: float = 0.0) -> tuple[str, bool]:
    """Every weight of ``a`` against ``b``'s: a summary line naming both iterations, one line per
    tensor that differs beyond ``atol + rtol × max|b|``, and whether any does."""
    if cfg_a is None or cfg_b is None:
        raise CheckpointError("--diff needs the runs' config.yaml (to put the tp shards together): "
                              "pass --config")
    iterations = read_metadata(a)["iteration"], read_metadata(b)["iteration"]
    wa, wb = GlobalWeights(a, cfg_a), GlobalWeights(b, cfg_b)
    lines, same, close = [], 0, []
    try:
        for name, spec in wa.specs.items():
            if name not in wb.specs:
                lines.append(f"  {name}: only in {a}")
            elif spec.shape != wb.specs[name].shape:
                lines.append(f"  {name}: shape {spec.shape} vs {wb.specs[name].shape}")
            else:
                x, y = wa.get(name), wb.get(name)
                if torch.equal(x, y):
                    same += 1
                    continue
                delta = (x - y).abs().max().item()
                scale = y.abs().max().item()
                limit = atol + rtol * scale
                if delta <= limit:  # NaN is never within
                    close.append((delta / max(scale, 1e-30), name))
                else:
                    lines.append(f"  {name}: max |diff| {delta:.3e} > {limit:.1e} (max |b| "
                                 f"{scale:.3e})")
        lines += [f"  {name}: only in {b}" for name in wb.specs if name not in wa.specs]
    finally:
        wa.close()
        wb.close()
    total = len(set(wa.specs) | set(wb.specs))
    head = (f"{a} (iteration {iterations[0]}) vs {b} (iteration {iterations[1]}): {len(lines)} of "
            f"{total} tensors differ beyond |a-b| <= {atol:g} + {rtol:g}·max|b|, {len(close)} "
            "within it"
            + (f" (largest relative difference {max(close)[0]:.1e}, {max(close)[1]})" if close
               else "")
            + f", {same} identical")
    return "\n".join([head, *lines]), bool(lines)


@user_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    path = resolve_checkpoint(args.path, check=False)
    found = problem(path, [] if args.no_checksum else None)
    if found:
        raise CheckpointError(f"{path} is damaged: {found}")
    cfg = _config(path, args.config)
    if args.diff:
        other = resolve_checkpoint(args.diff, check=False)
        text, differ = diff(path, other, cfg, _config(other, args.config), args.atol, args.rtol)
        print(text)
        return 1 if differ else 0
    print(describe(path, cfg))
    print("  integrity: ok (metadata, sizes" + ("" if args.no_checksum else ", checksums") + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
