"""Check, on the machines of a real job, that every parallel layout computes what one device does.

    torchrun --nproc_per_node 8 tools/smoke_test.py                        # every layout of 8 ranks
    torchrun --nproc_per_node 8 tools/smoke_test.py \\
        --layouts "tp=2,pp=2,sp=1,zero=1; tp=8; tp=2,cp=2,sp=1"
    torchrun --nnodes 2 --nproc_per_node 8 ... tools/smoke_test.py --workdir /shared/smoke \\
        --precision bf16

Rank 0 writes a small synthetic corpus, trains a small Llama on it for ``--steps`` steps alone (a
one-process run of ``megapretrain.train``: the reference), then all ranks train the same model,
data and seed under each layout — tensor, sequence, context, pipeline (with virtual chunks) and
data parallel, ZeRO-1 — through the real trainer, backend and devices of the job. Each layout's
per-step losses must match the reference within ``--rtol``; the table shows the largest relative
difference and the step time, and the exit status is 1 if any layout does not match. Run it after
bringing up a cluster or changing drivers, before a long run. ``--workdir`` must be on a file
system every node sees, and new (nothing is overwritten).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from megapretrain.cli import ToolParser, positive_float, positive_int, print_error, user_errors
from megapretrain.data.indexed_dataset import IndexedDatasetBuilder

# the directory holding the megapretrain package (a checkout's root): the PYTHONPATH of the runs it
# starts
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = {"num_layers": 8, "hidden_size": 128, "num_heads": 8, "ffn_hidden_size": 256}
KEYS = ("tp", "pp", "vpp", "cp", "sp", "zero")


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = ToolParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="auto",
                    help='";"-separated: "auto" (every tp × pp that divides the world) and/or '
                         'layouts such as "tp=2,pp=2,vpp=2,cp=2,sp=1,zero=1"')
    ap.add_argument("--steps", type=positive_int, default=5, help="optimizer steps per layout")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--rtol", type=positive_float, help="largest relative loss difference allowed "
                                               "(default 1e-4 in fp32, 2e-2 in bf16)")
    ap.add_argument("--workdir", help="new directory on a shared file system (default: "
                                      "runs/smoke_test-TIME)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps={args.steps} must be at least 1")
    return args


def parse_layouts(text: str, world: int) -> list[dict]:
    """Layouts to check, ``;``-separated: ``key=value`` lists, or ``auto`` for every tp × pp that
    divides ``world``, each also with cp = 2 where that divides it too (with virtual chunks,
    sequence parallelism and ZeRO-1 where they apply)."""
    layouts = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        if item == "auto":
            layouts += _auto_layouts(world)
            continue
        layout = {"tp": 1, "pp": 1, "vpp": 1, "cp": 1, "sp": 0, "zero": 0}
        for pair in item.split(","):
            key, _, value = pair.strip().partition("=")
            if key not in KEYS or not value.strip().isdigit():
                raise SystemExit(f"error: --layouts: {pair.strip()!r} must be one of "
                                 f"{'/'.join(KEYS)}=<integer>, e.g. tp=2,pp=2")
            layout[key] = int(value)
        layouts.append(layout)
    return layouts


def _auto_layouts(world: int) -> list[dict]:
    layouts = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            for cp in (1, 2):
                if world % (tp * pp * cp) or tp * pp * cp == world == 1:
                    continue  # does not divide, or is the one-process reference itself
                replicas = world // (tp * pp)  # dp × cp: the ranks ZeRO shards over
                layouts.append({"tp": tp, "pp": pp, "vpp": 2 if 1 < pp <= 4 else 1, "cp": cp,
                                "sp": int(tp > 1), "zero": int(replicas > 1)})
    return layouts


def layout_name(layout: dict, world: int) -> str:
    cp = layout.get("cp", 1)
    model_parallel = layout["tp"] * layout["pp"] * cp
    dp = world // model_parallel if world % model_parallel == 0 else "?"
    return (f"tp{layout['tp']} pp{layout['pp']}" + (f" vpp{layout['vpp']}" if layout["vpp"] > 1
                                                    else "")
            + (f" cp{cp}" if cp > 1 else "") + f" dp{dp}" + (" sp" if layout["sp"] else "")
            + (f" zero{layout['zero']}" if layout["zero"] else ""))


def write_corpus(prefix: str, seed: int = 0, docs: int = 400) -> None:
    """Documents of byte-level pseudo-words (learnable), EOS 256 after each."""
    rng = np.random.default_rng(seed)
    words = [bytes(rng.integers(97, 123, size=int(n))).decode()
             for n in rng.integers(2, 8, size=64)]
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for _ in range(docs):
        text = " ".join(rng.choice(words, size=int(rng.integers(20, 120))))
        builder.add_document(list(text.encode()) + [256])
    builder.finalize(prefix + ".idx")


def train_argv(run_dir: str, prefix: str, layout: dict, args, world: int,
               kv_heads: int) -> list[str]:
    flags = ["--run.dir", run_dir, "--data.paths", f"[{prefix}]", "--data.tokenizer.type",
             "ByteTokenizer", "--model.num_kv_heads", str(kv_heads), "--train.seq_length", "64",
             "--train.micro_batch_size", "1", "--train.global_batch_size", str(4 * world),
             "--train.iters", str(args.steps), "--train.precision", args.precision,
             "--train.eval_interval", "0", "--optim.lr", "3e-3", "--optim.eps", "1e-6",
             "--schedule.warmup_iters", "1", "--checkpoint.interval", "0", "--logging.interval",
             "1", "--logging.tensorboard", "false", "--recovery.action", "none", "--parallel.tp",
             str(layout["tp"]), "--parallel.pp", str(layout["pp"]), "--parallel.vpp",
             str(layout["vpp"]), "--parallel.cp", str(layout.get("cp", 1)),
             "--parallel.sequence_parallel", str(bool(layout["sp"])).lower(), "--parallel.zero",
             str(layout["zero"])]
    for key, value in MODEL.items():
        flags += [f"--model.{key}", str(value)]
    return flags


def losses_of(run_dir: str) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r["loss"] for r in map(json.loads, fh) if "loss" in r and "event" not in r]


@user_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from megapretrain.errors import UserError
    from megapretrain.parallel.state import init_distributed
    from megapretrain.train import setup

    device = "cuda" if torch.cuda.is_available() else "cpu"
    owned = not dist.is_initialized()  # torchrun: ours to set up and tear down
    init_distributed("auto", device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    layouts = parse_layouts(args.layouts, world)
    if not layouts:  # before any work: with nothing to compare, the test would prove nothing
        if rank == 0:
            print_error(f"--layouts {args.layouts!r}: no layout to check on {world} rank(s) (the "
                        "one-process reference is not compared with itself); run under torchrun "
                        "with more ranks")
        return 2
    kv_heads = max([4] + [layout["tp"] for layout in layouts])
    rtol = args.rtol or (1e-4 if args.precision == "fp32" else 2e-2)

    workdir = [args.workdir or os.path.join("runs", time.strftime("smoke_test-%Y%m%d-%H%M%S"))]
    if dist.is_initialized():
        dist.broadcast_object_list(workdir, src=0)
    workdir = os.path.abspath(workdir[0])
    problem = [None]
    if rank == 0:
        if os.path.exists(workdir) and os.listdir(workdir):
            problem[0] = f"--workdir {workdir} exists and is not empty; give a new one"
        else:
            os.makedirs(workdir, exist_ok=True)
            write_corpus(os.path.join(workdir, "corpus_text_document"))
            reference = os.path.join(workdir, "reference")
            env = {k: v for k, v in os.environ.items()
                   if k not in ("MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")}
            env.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
            layout = {"tp": 1, "pp": 1, "vpp": 1, "cp": 1, "sp": 0, "zero": 0}
            cmd = [sys.executable, "-m", "megapretrain.train",
                   *train_argv(reference, os.path.join(workdir, "corpus_text_document"), layout,
                               args, world, kv_heads)]
            done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
            if done.returncode != 0:
                problem[0] = f"the one-process reference failed:\n{done.stderr[-3000:]}"
    if dist.is_initialized():
        dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        if rank == 0:
            print_error(problem[0])
        return 2
    prefix = os.path.join(workdir, "corpus_text_document")
    reference = losses_of(os.path.join(workdir, "reference")) if rank == 0 else None

    rows, failed = [], 0
    for layout in layouts:
        name = layout_name(layout, world)
        run_dir = os.path.join(workdir, name.replace(" ", "_"))
        error, losses, step_s = None, None, None
        try:
            trainer = setup(train_argv(run_dir, prefix, layout, args, world, kv_heads))
            start = time.perf_counter()
            trainer.fit()
            step_s = (time.perf_counter() - start) / args.steps
        except UserError as exc:  # an impossible layout: one line, then the next one (a bug raises)
            error = str(exc).splitlines()[0]
        if rank == 0:
            if error is None:
                losses = losses_of(run_dir)
                diffs = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
                # max() would skip a NaN
                worst = max(diffs) if all(d == d for d in diffs) else float("nan")
                ok = len(losses) == len(reference) and worst <= rtol
                failed += not ok
                rows.append((name, "ok" if ok else "MISMATCH", f"{worst:.1e}",
                             f"{step_s * 1e3:.0f} ms", f"{losses[-1]:.4f}"))
            else:
                rows.append((name, "skipped", "-", "-", error))
    if rank == 0:
        print(f"\nsmoke test: {world} ranks, {device}, {args.precision}, {args.steps} steps; "
              f"reference (one process) final loss {reference[-1]:.4f}; tolerance {rtol:g} "
              "relative")
        header = ("layout", "result", "max rel diff", "step", "final loss")
        widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(5)]
        for r in [header] + rows:
            print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
        with open(os.path.join(workdir, "smoke_test.json"), "w") as fh:
            json.dump({"world": world, "device": device, "precision": args.precision,
                       "reference": reference, "rows": rows}, fh, indent=1)
        checked = sum(r[1] != "skipped" for r in rows)
        if not checked:  # nothing compared is not a success
            failed = 1
            print(f"no layout was checked ({len(rows)} skipped; on {world} rank(s) every tp × pp × "
                  "cp is the one-process reference or does not divide it): run on more ranks or "
                  f"give --layouts; details in {workdir}")
        else:
            print(f"{'all layouts match' if not failed else f'{failed} layout(s) differ'}; details "
                  f"in {workdir}")
    result = [failed]
    if dist.is_initialized():
        dist.broadcast_object_list(result, src=0)
        if owned:
            dist.destroy_process_group()
    return 1 if result[0] else 0


if __name__ == "__main__":
    sys.exit(main())
