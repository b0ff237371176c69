"""Any rank of a run on this CPU before launching it: the trainer's own program for rank R of N on
fake tensors and the fake process group — peak memory and its parts, traffic per group, FLOPs,
checkpoint bytes — beside the planner's estimate.

    python tools/simulate.py --config configs/llama3_8b.yaml --world-size 64 --rank 0
    python tools/simulate.py --config configs/llama3_405b.yaml --world-size 16384 --roles \\
        --train.rampup_batch_size null --output runs/sim405b
    python tools/simulate.py --config configs/llama3_70b.yaml --world-size 512 \\
        --rank 0 --rank 511 --json

``--roles`` simulates one rank of every distinct role (the first, second, middle and last
pipeline stage; see ``megapretrain/simulate/report.py``), ``--rank R`` (repeatable) the ranks
named. Each runs ``--steps`` training steps (default 2) of the program a GPU runs (``--device
cpu``: of the CPU one). ``--json`` prints one JSON object; ``--output DIR`` writes report.md and
report.json there (an existing report is replaced only with ``--overwrite``). Any other
``--section.key VALUE`` overrides the config, as for training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megapretrain.cli import ToolParser, non_negative_int, positive_int, user_errors
from megapretrain.config import load_config
from megapretrain.errors import UserError
from megapretrain.simulate.report import layout_json, markdown, role_of, role_ranks, text
from megapretrain.simulate.run import (
    DEVICES,
    planned,
    rampup_refusal,
    resolve_for_simulation,
    simulate_rank,
)


class SimulateArgumentError(UserError):
    """A bad flag of tools/simulate.py."""


class _Parser(ToolParser):
    def error(self, message):  # one line, through the UserError path
        raise SimulateArgumentError(f"{message} (see tools/simulate.py --help)")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = _Parser(description=__doc__.split("\n\n")[0],
                 formatter_class=argparse.RawDescriptionHelpFormatter,
                 epilog="Any other --section.key VALUE overrides the config.")
    ap.add_argument("--config", required=True, help="YAML config of the run")
    ap.add_argument("--world-size", type=positive_int, required=True,
                    help="ranks of the run (GPUs)")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--rank", type=non_negative_int, action="append",
                       help="a rank to simulate (repeatable; default 0)")
    which.add_argument("--roles", action="store_true", help="one rank of every distinct role")
    ap.add_argument("--steps", type=positive_int, default=2,
                    help="training steps per rank (default 2)")
    ap.add_argument("--device", default="cuda", choices=DEVICES,
                    help="whose program: a GPU's (default) or a CPU's")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    ap.add_argument("--output", metavar="DIR", help="write report.md and report.json into DIR")
    ap.add_argument("--overwrite", action="store_true", help="replace a report already in --output")
    args, rest = ap.parse_known_args(argv)
    for r in args.rank or ():
        if not 0 <= r < args.world_size:
            ap.error(f"argument --rank: {r} is not a rank of a world of {args.world_size} (0 .. "
                     f"{args.world_size - 1})")
    if args.output and not args.overwrite:
        for name in ("report.md", "report.json"):
            if os.path.exists(os.path.join(args.output, name)):
                raise SimulateArgumentError(f"{os.path.join(args.output, name)} exists; pass "
                                            "--overwrite to replace it")
    return args, rest


def simulate(args: argparse.Namespace, overrides: list[str], progress=None) -> dict:
    """The simulation's result as the JSON object ``--json`` prints."""
    cfg = load_config(args.config, overrides)
    run = resolve_for_simulation(cfg, args.world_size)
    refusal = rampup_refusal(cfg, args.world_size)
    warnings = [f"{refusal} (train.py refuses this config on {args.world_size:,} ranks; simulated "
                f"are the steps at the full batch)"] if refusal else []
    if progress is not None:
        for line in warnings:
            progress(f"warning: {line}")
    ranks = role_ranks(run.layout) if args.roles \
        else [(r, role_of(run.layout, r)) for r in args.rank or [0]]
    results = []
    for rank, role in ranks:
        if progress is not None:
            progress(f"simulating rank {rank} ({role}) of {args.world_size:,}")
        result = simulate_rank(cfg, args.world_size, rank, steps=args.steps,
                               device=args.device).to_json()
        result.update(role=role, **planned(cfg, run, result["coords"]["pp"], args.device))
        results.append(result)
        if progress is not None:
            progress(f"  peak {result['peak_bytes'] / 2**30:.2f} GiB "
                     f"(planned {result['planned_peak_bytes'] / 2**30:.2f}), "
                     f"{result['seconds']:.0f} s")
    return {"config": args.config, "world_size": args.world_size, "device": args.device,
            "steps": args.steps, "overrides": overrides, "layout": layout_json(run.layout, run),
            "warnings": warnings, "ranks": results}


@user_errors
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    doc = simulate(args, overrides, progress=None if args.json
                   else lambda line: print(line, file=sys.stderr))
    if args.output:
        os.makedirs(args.output, exist_ok=True)
        with open(os.path.join(args.output, "report.json"), "w") as fh:
            json.dump(doc, fh, indent=1)
        with open(os.path.join(args.output, "report.md"), "w") as fh:
            fh.write(markdown(doc))
    if args.json:
        print(json.dumps(doc))
    else:
        print(text(doc))
        if args.output:
            print(f"\nwrote {os.path.join(args.output, 'report.md')} and report.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
