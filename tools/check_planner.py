"""Hold the planner to the program: simulate a sweep of Llama 3 8B, 70B and 405B layouts and set
the planner's figures for each rank beside the simulated ones — peak memory within 5%, the bytes
and calls of every group's collectives equal.

    python tools/check_planner.py --output runs/planner_sweep.jsonl          # every case (hours)
    python tools/check_planner.py --cases 8b-config 70b-config               # some of them
    python tools/check_planner.py --from runs/planner_sweep.jsonl            # the planner again, no simulation

The cases are ``megapretrain/simulate/sweep.py``'s. Each simulated rank is appended to
``--output`` (JSON lines) as it finishes; ``--from`` reads such a file instead of simulating, so a
change to the planner is checked in seconds. ``--json`` prints the rows as one JSON object. Exit
status 1 when a row is off (memory beyond 5%, traffic unequal).
"""

from __future__ import annotations

import argparse
import json
import sys

import _tool  # noqa: F401  (the package installed, or one line saying how)

from megapretrain.cli import ToolParser, positive_int, user_errors
from megapretrain.config import load_config
from megapretrain.errors import UserError
from megapretrain.simulate.report import role_ranks
from megapretrain.simulate.run import planned, resolve_for_simulation, simulate_rank
from megapretrain.simulate.sweep import MEMORY_TOLERANCE, SWEEP

GIB = 2**30


class CheckPlannerError(UserError):
    """A bad flag or file of tools/check_planner.py."""


def _ranks(case, layout) -> list[int]:
    if case.stages == ("roles",):
        return [r for r, _ in role_ranks(layout)]
    grid = layout.grid()
    stage = {"first": 0, "last": layout.pp - 1}
    return sorted({int(grid[stage[s], 0, 0, 0]) for s in case.stages})


def simulated(cases, steps: int, output: str | None, progress):
    """Every case's ranks simulated: (case name, rank result as JSON) as they finish."""
    for case in cases:
        cfg = load_config(case.config, list(case.overrides))
        run = resolve_for_simulation(cfg, case.world_size)
        for rank in _ranks(case, run.layout):
            progress(f"{case.name}: rank {rank} of {case.world_size:,}")
            result = simulate_rank(cfg, case.world_size, rank, steps=steps).to_json()
            if output:
                with open(output, "a") as fh:
                    fh.write(json.dumps({"case": case.name, **result}) + "\n")
            yield case.name, result


def stored(path: str):
    try:
        with open(path) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckPlannerError(f"--from {path}: {exc}") from None
    return [(row.pop("case"), row) for row in rows]


def compare(case, result: dict) -> dict:
    """A table row: the simulated rank against the planner's estimate of it."""
    cfg = load_config(case.config, list(case.overrides))
    run = resolve_for_simulation(cfg, case.world_size)
    plan = planned(cfg, run, result["coords"]["pp"])
    sim, est = result["peak_bytes"], plan["planned_peak_bytes"]
    unequal = sorted(f"{g}.{op}" for g in set(result["comm_bytes"]) | set(plan["planned_comm_bytes"])
                     for op in set(result["comm_bytes"].get(g, {})) | set(plan["planned_comm_bytes"].get(g, {}))
                     if (result["comm_bytes"].get(g, {}).get(op), result["comm_calls"].get(g, {}).get(op))
                     != (plan["planned_comm_bytes"].get(g, {}).get(op), plan["planned_comm_calls"].get(g, {}).get(op)))
    L = run.layout
    return {"case": case.name, "rank": result["rank"], "pp_rank": result["coords"]["pp"],
            "layout": f"tp{L.tp} cp{L.cp} pp{L.pp} vpp{L.vpp} dp{L.dp} zero{L.zero}"
                      + (f"/{L.shard}" if L.shard else "") + f" {L.recompute} mb{L.micro_batch}",
            "simulated_bytes": sim, "planned_bytes": est, "error": (est - sim) / sim,
            "traffic_equal": not unequal, "unequal": unequal, "seconds": result["seconds"],
            "ok": abs(est - sim) <= MEMORY_TOLERANCE * sim and not unequal}


def table(rows: list[dict]) -> str:
    header = ["case", "rank", "stage", "layout", "simulated GiB", "planned GiB", "error", "traffic", "sim s"]
    body = [[r["case"], str(r["rank"]), str(r["pp_rank"]), r["layout"], f"{r['simulated_bytes'] / GIB:.2f}",
             f"{r['planned_bytes'] / GIB:.2f}", f"{r['error']:+.1%}",
             "equal" if r["traffic_equal"] else "differs: " + ", ".join(r["unequal"]), f"{r['seconds']:.0f}"]
            for r in rows]
    widths = [max(len(x[i]) for x in body + [header]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [header] + body)


@user_errors
def main(argv: list[str] | None = None) -> int:
    ap = ToolParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", metavar="NAME", help="cases to run (default: all)")
    ap.add_argument("--steps", type=positive_int, default=1, help="training steps per simulated rank (default 1)")
    ap.add_argument("--output", metavar="FILE", help="append each simulated rank to FILE (JSON lines)")
    ap.add_argument("--from", dest="source", metavar="FILE", help="compare ranks simulated before (JSON lines)")
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON object")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    by_name = {c.name: c for c in SWEEP}
    unknown = sorted(set(args.cases or ()) - set(by_name))
    if unknown:
        raise CheckPlannerError(f"--cases: no case {', '.join(unknown)} (cases: {', '.join(by_name)})")
    cases = [by_name[n] for n in args.cases] if args.cases else list(SWEEP)
    names = {c.name for c in cases}
    progress = (lambda line: None) if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    results = stored(args.source) if args.source else simulated(cases, args.steps, args.output, progress)
    rows = [compare(by_name[name], result) for name, result in results if name in names and name in by_name]
    if args.json:
        print(json.dumps({"rows": rows, "tolerance": MEMORY_TOLERANCE}))
    else:
        print(table(rows))
        worst = max((abs(r["error"]) for r in rows), default=0.0)
        print(f"\n{sum(r['ok'] for r in rows)} of {len(rows)} ranks within {MEMORY_TOLERANCE:.0%} with equal traffic; "
              f"largest memory error {worst:.1%}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
