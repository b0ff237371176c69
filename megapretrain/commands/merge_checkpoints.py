"""Average checkpoints of one model into a new checkpoint, weighted, offline, on one machine.

    python tools/merge_checkpoints.py --checkpoints runs/a/checkpoints/iter_0009000 \\
        runs/a/checkpoints/iter_0009500 runs/a --output ckpt/avg [--weights 1 1 2] \\
        [--config CONFIG] [--section.key VALUE ...] [--world-size W]
    torchrun ... -m megapretrain.train --config ... --checkpoint.load ckpt/avg \\
        --checkpoint.finetune true ...

Each ``--checkpoints`` entry is an ``iter_*`` directory, or a run directory for its newest usable
one; each may have been saved under its own layout (tp, pp, vpp, cp, dp, zero). They must be of
one model (every architecture setting and tensor shape equal; dropout, kernels and the like may
differ). The fp32 master weights are averaged with ``--weights`` (default: uniform; one per
checkpoint, finite, ≥ 0, summing to more than 0; normalised to sum to 1), one tensor slice at a
time, so host memory holds a few tensors, never the model.

The output is written for the first checkpoint's layout (its run's ``config.yaml`` at its world
size), or for ``--config`` with ``--section.key VALUE`` overrides at ``--world-size``: data-parallel
replicas are hard links. Only the weights are averaged: the output is iteration 0 with no optimizer
state, learning-rate schedule or data position, a fine-tune start, as ``convert_checkpoint.py
from-hf`` writes; ``to-hf`` converts it. ``--output`` must be new; it is written through a
temporary directory renamed at the end.
"""

from __future__ import annotations

import argparse
import sys

from megapretrain.checkpoint.directories import resolve_checkpoint
from megapretrain.checkpoint.merge import MergeInput, normalised_weights, write_average
from megapretrain.checkpoint.reshard import layout_bytes, saved_config_path
from megapretrain.cli import ToolParser, number, positive_int, progress_bar, user_errors
from megapretrain.config import load_config
from megapretrain.errors import UserError
from megapretrain.resolve import resolve


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = ToolParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Other --section.key VALUE arguments set the output's "
                                        "layout (--parallel.tp ...).")
    ap.add_argument("--checkpoints", nargs="+", required=True, metavar="CHECKPOINT",
                    help="iter_* directories, or run directories (their latest); two or more")
    ap.add_argument("--output", required=True, help="new checkpoint directory (for "
                                                    "--checkpoint.load)")
    # (finite here; >= 0 and a positive sum: checkpoint.merge.normalised_weights)
    ap.add_argument("--weights", nargs="+", type=number(float), metavar="W",
                    help="one weight per checkpoint, in order (default: uniform); normalised")
    ap.add_argument("--config", help="config of the run that will train from the output (its "
                                     "layout; default: config.yaml of the first checkpoint's run)")
    ap.add_argument("--world-size", type=positive_int,
                    help="ranks of the output's layout (default: the first checkpoint's)")
    return ap.parse_known_args(argv)


def merge(args: argparse.Namespace, overrides: list[str]) -> str:
    if len(args.checkpoints) < 2:
        raise UserError(f"--checkpoints names {len(args.checkpoints)} checkpoint: averaging needs "
                        "two or more")
    weights = normalised_weights(args.weights, len(args.checkpoints))
    inputs = [MergeInput.open(resolve_checkpoint(p)) for p in args.checkpoints]
    try:
        return _merge(args, overrides, inputs, weights)
    finally:
        for one in inputs:
            one.close()


def _merge(args: argparse.Namespace, overrides: list[str], inputs: list[MergeInput],
           weights: list[float]) -> str:
    """Write the average of ``inputs`` (opened) with ``weights`` (normalised) to ``--output``."""
    first = inputs[0]
    cfg = load_config(args.config or saved_config_path(first.path), overrides)
    cfg.model.vocab_size = cfg.model.vocab_size or first.cfg.model.vocab_size
    world = args.world_size or first.meta["world_size"]
    sizes = resolve(cfg, world).sizes  # the output's layout, checked as training would
    size = layout_bytes(cfg, sizes.layout, moments=False)
    with progress_bar(size, "merging") as bar:
        meta = write_average(inputs, weights, cfg, sizes, world, args.output, bar.update)
    parts = ", ".join(f"{one.path} (iteration {one.meta['iteration']}) × {w:.4g}"
                      for one, w in zip(inputs, weights))
    return (f"wrote {args.output} for {world} ranks (layout {meta['layout']}): the average of "
            f"{parts}\nnot averaged: the iteration, optimizer state (Adam moments and step, loss "
            "scale), learning-rate schedule and data position; the output is iteration 0 with "
            f"none of them, a fine-tune start: train with --checkpoint.load {args.output} "
            "--checkpoint.finetune true")


@user_errors
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    print(merge(args, overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
