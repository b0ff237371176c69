"""Rewrite a checkpoint for another parallel layout, offline, on one machine.

    python tools/reshard_checkpoint.py --checkpoint runs/big --output ckpt/big-tp8pp16 \\
        --world-size 2048 --parallel.tp 8 --parallel.pp 16 --parallel.vpp 2 --parallel.zero 1
    torchrun ... -m megapretrain.train --config ... --checkpoint.load ckpt/big-tp8pp16 ...

Training already loads a checkpoint of any layout (each rank rebuilds its shards when it starts),
so this is for when that should not happen at start-up on thousands of ranks, or to keep a copy in
the layout a run will use. The target layout is the run's ``config.yaml`` (or ``--config``) with
the given ``--section.key VALUE`` overrides, validated at ``--world-size``; every target rank gets a
file holding its tp slices of the weights and of the Adam moments when the checkpoint has them
(whole, so any ZeRO stage takes its ranges from them; a checkpoint without moments — a conversion,
a merge, one saved before the first step — stays without: none are invented). Data-parallel
replicas are hard links to one file. Random streams are not carried (they are per rank): dropout
restarts from the seed. The output's free space is checked for exactly the bytes it will hold
before any tensor is read (and before the input's checksums are verified); ``config.yaml`` is
written beside the output's files, so to-hf and a later reshard need no ``--config``.
``--output`` must be new.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from megapretrain.checkpoint.directories import check_room, new_directory, resolve_checkpoint
from megapretrain.checkpoint.format import (
    LazyTensor,
    check_shapes,
    metadata,
    read_metadata,
    write_metadata,
)
from megapretrain.checkpoint.reshard import (
    SavedShards,
    global_shapes,
    planned_bytes,
    resharded_state,
    saved_config_path,
    saved_padded_vocab,
    write_layout,
)
from megapretrain.cli import ToolParser, positive_int, progress_bar, user_errors
from megapretrain.config import drop_inherited, load_config, save_config
from megapretrain.errors import size_text
from megapretrain.model.build import rank_param_specs
from megapretrain.resolve import resolve


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = ToolParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Other --section.key VALUE arguments set the target "
                                        "layout.")
    ap.add_argument("--checkpoint", required=True,
                    help="iter_* directory, or a run directory (its latest)")
    ap.add_argument("--output", required=True, help="new checkpoint directory")
    ap.add_argument("--world-size", type=positive_int, required=True,
                    help="ranks of the target run")
    ap.add_argument("--config",
                    help="the run's config (default: config.yaml of the run that saved it)")
    return ap.parse_known_args(argv)


def reshard(args: argparse.Namespace, overrides: list[str]) -> str:
    # the checkpoint found without reading its tensors: the space check comes before the checksums
    path = resolve_checkpoint(args.checkpoint, check=False)
    plan = _plan(args, overrides, path)  # refuses at once an output that cannot fit
    checked = resolve_checkpoint(args.checkpoint)  # sizes and checksums: reads every byte
    if checked != path:  # the newest was damaged: an older one of the run is used
        plan.saved.close()
        path, plan = checked, _plan(args, overrides, checked)
    cfg, sizes, meta, saved, moments = plan.cfg, plan.sizes, plan.meta, plan.saved, plan.moments
    layout = sizes.layout.meta(v_shape=sizes.schedule.v_shape)
    start = time.perf_counter()
    with new_directory(args.output, needed=plan.size) as tmp, \
            progress_bar(plan.size, "resharding") as bar:
        files, distinct = write_layout(tmp, sizes.layout, lambda pp_rank, tp_rank: _counted(
            plan.state_at(pp_rank, tp_rank), bar))
        iteration = saved.state(0)["iteration"]
        saved.close()
        save_config(cfg, os.path.join(tmp, "config.yaml"))  # the architecture, for to-hf
        write_metadata(tmp, metadata(iteration=iteration, world_size=args.world_size, layout=layout,
                                     vocab_size=cfg.model.vocab_size,
                                     padded_vocab=sizes.padded_vocab, files=files,
                                     tensors=global_shapes(cfg),
                                     resharded_from={"path": os.path.abspath(path),
                                                     "layout": meta["layout"]}))
    what = "weights and optimizer moments" if moments else \
        "weights only (the checkpoint has no optimizer moments)"
    return (f"wrote {args.output}: iteration {iteration} of {path}, {meta['layout']} -> {layout} "
            f"({args.world_size} ranks, {distinct} distinct files, {size_text(plan.size)} of "
            f"{what} in {time.perf_counter() - start:.1f}s); train with --checkpoint.load "
            f"{args.output}")


class _Plan:
    """What a reshard of one checkpoint will write: the target config and layout, the saved
    shards (headers read), whether they hold moments, each place's lazy state and the bytes."""

    def __init__(self, args: argparse.Namespace, overrides: list[str], path: str):
        self.meta = read_metadata(path)
        self.cfg = cfg = load_config(saved_config_path(path, args.config), overrides)
        for note in drop_inherited(cfg, overrides):
            print(f"note: {note}", file=sys.stderr)
        cfg.model.vocab_size = cfg.model.vocab_size or self.meta.get("vocab_size")
        self.sizes = resolve(cfg, args.world_size).sizes  # the target layout, checked as training
        check_shapes(path, self.meta, global_shapes(cfg))  # every saved tensor has its place
        self.saved = SavedShards(path, self.meta)
        m = cfg.model
        self.padded = saved_padded_vocab(self.meta, m.vocab_size, m.make_vocab_size_divisible_by)
        self.moments = self.saved.has_moments()
        self.size = planned_bytes(self.sizes.layout, self.state_at)

    def state_at(self, pp_rank: int, tp_rank: int) -> dict:
        return resharded_state(self.saved, rank_param_specs(self.cfg, pp_rank, tp_rank), tp_rank,
                               self.sizes.tp, self.padded, moments=self.moments, lazy=True)


def _plan(args: argparse.Namespace, overrides: list[str], path: str) -> _Plan:
    """The plan for ``path``, refused in one line when ``--output``'s disk cannot hold it (before
    any tensor is read)."""
    plan = _Plan(args, overrides, path)
    try:
        check_room(args.output, plan.size)
    except BaseException:
        plan.saved.close()
        raise
    return plan


def _counted(node, bar):
    """A state whose lazy tensors add their bytes to the progress bar as they are read."""
    if isinstance(node, LazyTensor):
        def read(t=node):
            tensor = t.read()
            bar.update(tensor.numel() * tensor.element_size())
            return tensor
        return LazyTensor(node.dtype, node.shape, read)
    if isinstance(node, dict):
        return {k: _counted(v, bar) for k, v in node.items()}
    return node


@user_errors
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    print(reshard(args, overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
