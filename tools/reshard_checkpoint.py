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
import json
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megapretrain.checkpoint.manager import (FORMAT, CheckpointError, new_directory, read_metadata,  # noqa: E402
                                             resolve_checkpoint)
from megapretrain.checkpoint.reshard import (VOCAB_PARAMS, SavedShards, rank_coords,  # noqa: E402
                                             saved_config_path, saved_padded_vocab, stage_parameters,
                                             tp_slice)
from megapretrain.config import ConfigError, load_config, validate  # noqa: E402


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Other --section.key VALUE arguments set the target layout.")
    ap.add_argument("--checkpoint", required=True, help="iter_* directory, or a run directory (its latest)")
    ap.add_argument("--output", required=True, help="new checkpoint directory")
    ap.add_argument("--world-size", type=int, required=True, help="ranks of the target run")
    ap.add_argument("--config", help="the run's config (default: config.yaml of the run that saved it)")
    return ap.parse_known_args(argv)


def reshard(args: argparse.Namespace, overrides: list[str]) -> str:
    path = resolve_checkpoint(args.checkpoint)
    meta = read_metadata(path)
    cfg = load_config(saved_config_path(path, args.config), overrides)
    plan, _ = validate(cfg, args.world_size)  # the target layout, checked as training would
    m = cfg.model
    saved = SavedShards(path, meta)
    first = saved.state(0)
    saved_padded = saved_padded_vocab(meta, m.vocab_size, m.make_vocab_size_divisible_by)
    layout = {"tp": plan.tp, "pp": plan.pp, "dp": plan.dp}
    with new_directory(args.output) as tmp:
        written: dict[tuple[int, int], str] = {}
        for rank, (pp_rank, dp_rank, tp_rank) in enumerate(rank_coords(layout)):
            file = os.path.join(tmp, f"rank_{rank:05d}.pt")
            if (pp_rank, tp_rank) in written:  # a data-parallel replica: the same content
                try:
                    os.link(written[(pp_rank, tp_rank)], file)
                except OSError:
                    shutil.copyfile(written[(pp_rank, tp_rank)], file)
                continue
            model, params = {}, {}
            for name, (shape, dim) in stage_parameters(cfg, plan, pp_rank, tp_rank).items():
                vocab = m.vocab_size if name.split(".")[0] in VOCAB_PARAMS else None
                piece = {key: tp_slice(saved, name, key, shape, dim, tp_rank, plan.tp, vocab, saved_padded)
                         for key in ("master", "exp_avg", "exp_avg_sq")}
                model[name] = piece["master"]
                params[name] = {"exp_avg": piece["exp_avg"], "exp_avg_sq": piece["exp_avg_sq"]}
            torch.save({"iteration": first["iteration"], "consumed_samples": first["consumed_samples"],
                        "model": model, "optimizer": {"step": first["optimizer"]["step"], "params": params,
                                                      "scaler": first["optimizer"].get("scaler")}}, file)
            written[(pp_rank, tp_rank)] = file
        out_meta = {"iteration": first["iteration"], "world_size": args.world_size, "layout": layout,
                    "format": FORMAT, "vocab_size": m.vocab_size, "padded_vocab": plan.padded_vocab,
                    "resharded_from": {"path": os.path.abspath(path), "layout": meta["layout"]}}
        with open(os.path.join(tmp, "metadata.json"), "w") as fh:
            json.dump(out_meta, fh, indent=1)
    return (f"wrote {args.output}: iteration {first['iteration']} of {path}, {meta['layout']} -> {layout} "
            f"({args.world_size} ranks, {len(written)} distinct files); train with --checkpoint.load {args.output}")


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        print(reshard(args, overrides))
    except (CheckpointError, ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
