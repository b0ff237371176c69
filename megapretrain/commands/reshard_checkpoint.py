"""Rewrite a checkpoint for another parallel layout, offline, on one machine.

    python tools/reshard_checkpoint.py --checkpoint runs/big --output ckpt/big-tp8pp16 \\
        --world-size 2048 --parallel.tp 8 --parallel.pp 16 --parallel.vpp 2 --parallel.zero 1
    torchrun ... -m megapretrain.train --config ... --checkpoint.load ckpt/big-tp8pp16 ...

Training already loads a checkpoint of any layout (each rank rebuilds its shards when it starts),
so this is for when that should not happen at start-up on thousands of ranks, or to keep a copy in
the layout a run will use. The target layout is the run's ``config.yaml`` (or ``--config``) with
the given ``--section.key VALUE`` overrides, validated at ``--world-size``; every target rank gets a
file holding its tp slices of the weights and Adam moments (whole, so any ZeRO stage takes its
ranges from them). Data-parallel replicas are hard links to one file. Random streams are not
carried (they are per rank): dropout restarts from the seed. ``--output`` must be new.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from megapretrain.checkpoint.directories import new_directory, resolve_checkpoint
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
    layout_bytes,
    resharded_state,
    saved_config_path,
    saved_padded_vocab,
    write_layout,
)
from megapretrain.cli import positive_int, progress_bar, user_errors
from megapretrain.config import load_config
from megapretrain.errors import size_text
from megapretrain.model.build import rank_param_specs
from megapretrain.resolve import resolve


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
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
    path = resolve_checkpoint(args.checkpoint)
    meta = read_metadata(path)
    cfg = load_config(saved_config_path(path, args.config), overrides)
    sizes = resolve(cfg, args.world_size).sizes  # the target layout, checked as training would
    m = cfg.model
    shapes = global_shapes(cfg)
    check_shapes(path, meta, shapes)  # every saved tensor has its place in the target
    saved = SavedShards(path, meta)
    saved_padded = saved_padded_vocab(meta, m.vocab_size, m.make_vocab_size_divisible_by)
    layout = sizes.layout.meta(v_shape=sizes.schedule.v_shape)
    size = layout_bytes(cfg, sizes.layout, moments=True)
    start = time.perf_counter()
    with new_directory(args.output, needed=size) as tmp, progress_bar(size, "resharding") as bar:
        def state_at(pp_rank: int, tp_rank: int) -> dict:
            state = resharded_state(saved, rank_param_specs(cfg, pp_rank, tp_rank), tp_rank,
                                    sizes.tp, saved_padded, lazy=True)
            return _counted(state, bar)

        files, distinct = write_layout(tmp, sizes.layout, state_at)
        iteration = saved.state(0)["iteration"]
        saved.close()
        write_metadata(tmp, metadata(iteration=iteration, world_size=args.world_size, layout=layout,
                                     vocab_size=m.vocab_size, padded_vocab=sizes.padded_vocab,
                                     files=files, tensors=shapes,
                                     resharded_from={"path": os.path.abspath(path),
                                                     "layout": meta["layout"]}))
    return (f"wrote {args.output}: iteration {iteration} of {path}, {meta['layout']} -> {layout} "
            f"({args.world_size} ranks, {distinct} distinct files, {size_text(size)} in "
            f"{time.perf_counter() - start:.1f}s); train with --checkpoint.load {args.output}")


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
