"""Train a config with several optimizer settings for the same tokens and compare their validation
curves: a table of the final valid loss per setting and one PNG of every curve.

Two sweeps, each a list of runs of ``python -m megapretrain.train`` run one after another:

- ``optimizers``: AdamW at ``optim.lr`` 1e-3, 2e-3, 4e-3, and Muon at ``optim.muon_lr`` 0.01,
  0.02, 0.04 (its AdamW part at the config's ``optim.lr``);
- ``moments``: AdamW at the config's ``optim.lr`` with ``optim.moments_dtype`` fp32 and bf16.

    python tools/compare_optimizers.py optimizers --iters 50 --eval-interval 5 --plot opt.png \\
        -- --train.global_batch_size 4 --train.micro_batch_size 4 --train.seq_length 128

Arguments after ``--`` go to every run of the trainer (dotted config overrides).

A run directory (``--output-dir``/NAME) that a run of the same command finished is reused: a sweep
that was interrupted continues where it stopped, and the two sweeps share their AdamW run at the
config's rate. Any other run directory of the sweep is trained anew. The table and the plot show
the sweep's finished runs (``--only``: train some of them, e.g. in several processes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import _tool

from megapretrain import cli

SWEEPS = {
    "optimizers": [  # each optimizer's middle rate first: a sweep cut short still compares
        ("adamw", "AdamW, lr 2e-3", []),  # configs/tiny.yaml's rates
        ("muon_lr0.02", "Muon, muon_lr 0.02", ["--optim.optimizer", "muon", "--optim.muon_lr", "0.02"]),
        ("adamw_lr4e-3", "AdamW, lr 4e-3", ["--optim.lr", "4.0e-3", "--optim.min_lr", "4.0e-4"]),
        ("muon_lr0.04", "Muon, muon_lr 0.04", ["--optim.optimizer", "muon", "--optim.muon_lr", "0.04"]),
        ("adamw_lr1e-3", "AdamW, lr 1e-3", ["--optim.lr", "1.0e-3", "--optim.min_lr", "1.0e-4"]),
        ("muon_lr0.01", "Muon, muon_lr 0.01", ["--optim.optimizer", "muon", "--optim.muon_lr", "0.01"]),
    ],
    "moments": [
        ("adamw", "AdamW, fp32 moments", []),
        ("adamw_bf16_moments", "AdamW, bf16 moments", ["--optim.moments_dtype", "bf16"]),
    ],
}


def read_curve(run_dir: str) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(iter, loss) of the training lines and (iter, valid_loss) of the eval lines of a run."""
    train, valid = {}, {}
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return [], []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if "valid_loss" in rec:
                valid[rec["iter"]] = rec["valid_loss"]
            elif "loss" in rec and "event" not in rec:
                train[rec["iter"]] = rec["loss"]
    return sorted(train.items()), sorted(valid.items())


def command(run_dir: str, flags: list[str], args, overrides: list[str]) -> list[str]:
    """The trainer's arguments for one run of the sweep."""
    cmd = ["-m", "megapretrain.train", "--config", args.config,
           "--run.dir", run_dir, "--train.iters", str(args.iters),
           "--train.eval_interval", str(args.eval_interval),
           "--train.eval_iters", str(args.eval_iters), "--checkpoint.interval", "0",
           "--logging.tensorboard", "false", *overrides, *flags]
    if args.data:
        cmd += ["--data.paths", f"[{os.path.abspath(args.data)}]"]
    return cmd


def finished(run_dir: str, cmd: list[str]) -> bool:
    """Whether ``cmd`` ran to its end in ``run_dir``."""
    done = os.path.join(run_dir, "command.json")
    if not os.path.exists(done):
        return False
    with open(done) as f:
        return json.load(f) == cmd


def train(run_dir: str, cmd: list[str]) -> None:
    """One run of the trainer, in a fresh directory unless the same command finished there."""
    if finished(run_dir, cmd):
        print(f"{run_dir}: finished before by the same command, reused", flush=True)
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    print("python " + " ".join(cmd), flush=True)
    start = time.monotonic()
    subprocess.run([sys.executable, *cmd], check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "command.json"), "w") as f:
        json.dump(cmd, f)
    print(f"{run_dir}: {time.monotonic() - start:.0f} s", flush=True)


def plot(curves: dict[str, list[tuple[int, float]]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, points in sorted(curves.items()):
        style = "--" if label.startswith("AdamW") and len(curves) > 2 else "-"
        ax.plot([i for i, _ in points], [v for _, v in points], style, marker=".", label=label)
    ax.set_xlabel("iteration")
    ax.set_ylabel("validation loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    p = cli.ToolParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", choices=sorted(SWEEPS))
    p.add_argument("--config", default=os.path.join(_tool.ROOT, "configs", "tiny.yaml"))
    p.add_argument("--data", default=None, help="a data prefix in place of the config's")
    p.add_argument("--iters", type=cli.positive_int, default=200)
    p.add_argument("--eval-interval", type=cli.positive_int, default=20)
    p.add_argument("--eval-iters", type=cli.positive_int, default=8)
    p.add_argument("--output-dir", default="runs/compare_optimizers")
    p.add_argument("--plot", default=None, help="write the validation curves to this PNG")
    p.add_argument("--muon-ns-precision", choices=("bf16", "fp32"), default="bf16",
                   help="optim.muon_ns_precision of the Muon runs (fp32: far faster on a CPU "
                        "without bf16 instructions); an fp32 run's directory and label say so")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME",
                   help="train only these runs of the sweep (their directories' names); the table "
                        "and the plot show the runs finished so far")
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, overrides = p.parse_args(argv[:cut]), argv[cut + 1:]

    curves, rows = {}, []
    for name, label, flags in SWEEPS[args.sweep]:
        if args.muon_ns_precision != "bf16" and "muon" in flags:
            name, label = f"{name}_ns_{args.muon_ns_precision}", \
                f"{label}, Newton–Schulz in {args.muon_ns_precision}"
            flags = [*flags, "--optim.muon_ns_precision", args.muon_ns_precision]
        run_dir = os.path.join(args.output_dir, name)
        cmd = command(run_dir, flags, args, overrides)
        if args.only is None or name in args.only:
            train(run_dir, cmd)
        if not finished(run_dir, cmd):
            continue
        train_curve, valid = read_curve(run_dir)
        curves[label] = valid
        rows.append((label, train_curve[-1][1], valid[-1][1], min(v for _, v in valid)))
    print(f"\n{args.iters} iterations, valid loss over {args.eval_iters} batches "
          f"every {args.eval_interval}:\n")
    print("| run | final train loss | final valid loss | best valid loss |")
    print("|---|---|---|---|")
    for label, loss, final, best in sorted(rows):
        print(f"| {label} | {loss:.4f} | {final:.4f} | {best:.4f} |")
    if args.plot:
        plot(curves, args.plot, f"{os.path.basename(args.config)}, {args.iters} iterations")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
