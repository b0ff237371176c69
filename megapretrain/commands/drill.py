"""Rehearse the failures of a multi-node run on one machine, through the real launcher.

    python tools/drill.py --list
    python tools/drill.py --drill worker-crash                        # 2 nodes × 1 process
    python tools/drill.py --drill worker-crash --drill node-loss --nodes 2 --procs-per-node 2
    python tools/drill.py --drill all --json --output runs/drills

Each node is one ``run_scripts/launch.sh`` (torchrun, c10d rendezvous on 127.0.0.1, its own process
session) training a tiny model on CPU in one shared run directory. A drill injects one failure — a
worker crash, a lost node, a hang, a stop signal, a corrupt checkpoint, ... — and checks how the
job comes out of it against a straight run of the same layout (run once per invocation): the
losses of every iteration equal bitwise (fp32 on CPU), every launcher's exit status, and that the
launchers end promptly once the last iteration is done. Per drill it reports the time from the
failure to the job noticing it (a launcher's or the watchdog's line), to the first step after the
restart, the iterations trained again, and the goodput of the drill run (productive step time /
wall time). Without ``--data`` it writes a small corpus of its own. Exit status 0 when every drill
passes, 1 when one fails. The drills: ``megapretrain/commands/drills.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import numpy as np

from megapretrain.cli import ToolParser, positive_float, positive_int, user_errors
from megapretrain.config import load_config
from megapretrain.data.checks import resolve_vocab
from megapretrain.errors import ConfigError, UserError
from megapretrain.resolve import check_run_faults, resolve
from megapretrain.user_files import DATASET, check_kind

from .drill_cluster import ROOT, Job, free_port
from .drills import DRILLS, Drill, Rehearsal, losses_of

# a model small enough that a drill's ten steps take a second or two on a loaded CPU
SMALL = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_heads", "4",
         "--model.num_kv_heads", "2", "--model.ffn_hidden_size", "128", "--train.seq_length", "32",
         "--train.micro_batch_size", "2", "--logging.tensorboard", "false", "--optim.lr", "3e-3",
         "--train.eval_interval", "0", "--schedule.warmup_iters", "2", "--logging.interval", "1"]
ITERS, CHECKPOINT_INTERVAL = 10, 2


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = ToolParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--drill", action="append", default=[], metavar="NAME",
                    help="a drill to run (repeat for several; 'all': every one; see --list)")
    ap.add_argument("--list", action="store_true", help="list the drills and exit")
    ap.add_argument("--nodes", type=positive_int, default=2, help="nodes (launchers)")
    ap.add_argument("--procs-per-node", type=positive_int, default=1,
                    help="training processes per node")
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny.yaml"),
                    help="the config (its model made small by the drill's overrides)")
    ap.add_argument("--data", metavar="PREFIX",
                    help="a tokenized corpus (default: a small one written into --output)")
    ap.add_argument("--output", help="new directory for the runs and logs (default: "
                                     "runs/drill-TIME)")
    ap.add_argument("--timeout", type=positive_float, default=600.0,
                    help="seconds a launch may take before the drill fails and is stopped")
    ap.add_argument("--exit-within", type=positive_float, default=60.0,
                    help="seconds the launchers may take to exit after the last iteration")
    ap.add_argument("--join-timeout", type=positive_int, default=30,
                    help="RDZV_JOIN_TIMEOUT of the launchers: how long the nodes left after a "
                         "node loss wait for it in the next rendezvous (seconds)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    if not args.list and not args.drill:
        ap.error("give --drill NAME (or --drill all, or --list)")
    return args


def write_corpus(prefix: str, docs: int = 300, seed: int = 0) -> str:
    """A small byte-tokenized corpus (EOS 256) of pseudo-code lines, in the indexed format."""
    from megapretrain.data.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    words = ("def return class self value index tensor rank batch layer model data token loss "
             "grad step seed shard group split").split()
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for _ in range(docs):
        lines = [" ".join(rng.choice(words, size=int(rng.integers(2, 7))))
                 for _ in range(int(rng.integers(2, 12)))]
        builder.add_document(list("\n".join(lines).encode()) + [256])
    builder.finalize(prefix + ".idx")
    return prefix


def selected(names: list[str]) -> list[Drill]:
    if "all" in names:
        return list(DRILLS.values())
    unknown = [n for n in names if n not in DRILLS]
    if unknown:
        raise UserError(f"--drill {unknown[0]}: no such drill; one of {', '.join(DRILLS)} or all "
                        "(see --list)")
    return [DRILLS[n] for n in dict.fromkeys(names)]


def cannot_fire(drill: Drill, s: Settings) -> str | None:
    """Why ``drill`` can never fire in the runs of ``s`` (its nodes, processes and ITERS), or
    None: too few nodes for what it strikes, a moment after the runs end, or ``faults.*``
    overrides the trainer would refuse (a rank outside the world, an iteration past the end)."""
    flags = f"--nodes {s.nodes} --procs-per-node {s.nproc}"
    if s.nodes < drill.min_nodes:
        return (f"--drill {drill.name} can never fire with --nodes {s.nodes}: "
                f"{drill.needs_nodes}; use --nodes {drill.min_nodes} or more")
    if drill.after is not None and drill.after >= s.iters:
        return (f"--drill {drill.name} strikes after iteration {drill.after}, but the drill's "
                f"runs end at iteration {s.iters}")
    cfg = load_config(s.config, s.argv(os.path.join(s.output, drill.name),
                                       drill.overrides(s)))
    try:
        resolve_vocab(cfg)
        check_run_faults(resolve(cfg, s.nodes * s.nproc))
    except ConfigError as exc:
        return f"--drill {drill.name} can never fire with {flags}: {exc}"
    return None


def check_drills(drills: list[Drill], s: Settings) -> None:
    """Refuse, before any launch, the drills that can never fire in one line (naming the
    others that cannot, too)."""
    refused = [(d, why) for d in drills if (why := cannot_fire(d, s))]
    if refused:
        (_, first), rest = refused[0], [d.name for d, _ in refused[1:]]
        raise UserError(first + (f" (nor can {', '.join(rest)})" if rest else ""))


class Settings:
    """What every launch of one invocation shares."""

    def __init__(self, args: argparse.Namespace, output: str, data: str):
        self.nodes, self.nproc, self.config = args.nodes, args.procs_per_node, args.config
        self.output, self.timeout, self.exit_within = output, args.timeout, args.exit_within
        self.iters, self.checkpoint_interval = ITERS, CHECKPOINT_INTERVAL
        self.join_timeout = args.join_timeout
        self.env = {"MAX_RESTARTS": "3", "RDZV_JOIN_TIMEOUT": str(args.join_timeout)}
        self.base = ["--data.paths", f"[{data}]", *SMALL,
                     "--train.global_batch_size", str(2 * args.nodes * args.procs_per_node),
                     "--train.iters", str(ITERS), "--checkpoint.interval",
                     str(CHECKPOINT_INTERVAL)]

    def argv(self, run_dir: str, extra: list[str]) -> list[str]:
        return ["--run.dir", run_dir, *self.base, *extra]


def straight_run(s: Settings) -> dict:
    """The reference: the same layout with no failure."""
    run_dir = os.path.join(s.output, "straight")
    started = time.time()
    job = Job(list(range(s.nodes)), s.nproc, free_port(), s.config, s.argv(run_dir, []),
              os.path.join(s.output, "straight"), s.env)
    try:
        statuses = job.wait(s.timeout)
    finally:
        job.kill()
    if statuses != [0] * s.nodes:
        tail = "\n".join(job.nodes[0].text().splitlines()[-20:])
        raise RuntimeError(f"the straight run failed (launchers exited {statuses}); its logs: "
                           f"{s.output}/straight.node*.log\n{tail}")
    rows = losses_of(run_dir)
    wall = max(n.ended for n in job.nodes) - started
    productive = sum(r["step_time"] for r in {r["iter"]: r for r in rows}.values())
    return {"losses": {r["iter"]: r["loss"] for r in rows}, "wall_s": round(wall, 2),
            "goodput": round(productive / wall, 4)}


def report_row(r: dict) -> list[str]:
    def num(key, fmt="{:.1f}"):
        return "-" if r.get(key) is None else fmt.format(r[key])

    exits = "/".join("-" if e is None else str(e) for e in r["exit_statuses"])
    return [r["drill"], "PASS" if r["passed"] else "FAIL", num("detection_s"),
            num("restart_s"), num("iterations_lost", "{}"),
            {True: "yes", False: "NO", None: "-"}[r["losses_bitwise"]], exits,
            num("exit_after_s"), num("goodput", "{:.1%}")]


def print_table(reference: dict, results: list[dict]) -> None:
    head = ["drill", "verdict", "detect s", "next step s", "lost", "bitwise", "exits",
            "exit after s", "goodput"]
    rows = [head] + [report_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    print(f"straight run: {reference['wall_s']:.1f} s, goodput {reference['goodput']:.1%}")
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    for r in results:
        for check in r["checks"]:
            if not check["ok"]:
                print(f"FAIL {r['drill']}: {check['check']}: {check['detail']}")
        for note in r["notes"]:
            print(f"note {r['drill']}: {note}")


@user_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.list:
        for d in DRILLS.values():
            print(f"{d.name:24} {d.what}")
        return 0
    drills = selected(args.drill)
    # a stop (a CI timeout, kill) ends the drill's launchers too: they run in sessions of their own
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if not os.path.isfile(args.config):
        raise UserError(f"--config {args.config}: no such file (see configs/)")
    output = os.path.abspath(args.output or os.path.join(
        "runs", time.strftime("drill-%Y%m%d-%H%M%S")))
    if args.data is not None and not os.path.exists(args.data + ".idx"):
        fix = "give the prefix of a tokenized corpus (tools/preprocess_data.py --output-prefix)"
        check_kind("--data", args.data, DATASET, fix)
        raise UserError(f"--data {args.data}: {args.data}.idx not found; {fix}")
    # the drills against the runs they will be played in, before anything is written or launched
    check_drills(drills, Settings(args, output, os.path.abspath(args.data or "corpus")))
    if os.path.exists(output) and os.listdir(output):
        raise UserError(f"--output {output} is not empty: give a new directory")
    os.makedirs(output, exist_ok=True)
    data = args.data
    if data is None:
        os.makedirs(os.path.join(output, "corpus"), exist_ok=True)
        data = write_corpus(os.path.join(output, "corpus", "drill_text_document"))
    s = Settings(args, output, os.path.abspath(data))
    reference = straight_run(s)
    results = []
    for drill in drills:
        r = Rehearsal(s, drill, reference["losses"])
        results.append(r.perform())
        if not args.json:
            print(f"{drill.name}: {'PASS' if results[-1]['passed'] else 'FAIL'}", flush=True)
    if args.json:
        print(json.dumps({"nodes": s.nodes, "procs_per_node": s.nproc, "output": output,
                          "straight": {k: v for k, v in reference.items() if k != "losses"},
                          "drills": results}, indent=1))
    else:
        print_table(reference, results)
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
