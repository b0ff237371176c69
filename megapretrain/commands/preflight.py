"""Pre-flight check of a config before a long run: train a little, checkpoint, resume, and report.

    python tools/preflight.py --config configs/tiny.yaml                         # 100 iterations
    python tools/preflight.py --config configs/llama3_8b.yaml --nproc-per-node 8 --iters 50 \\
        --min-tokens-per-sec 60000 --max-memory-gb 75 --layouts
    # any config override
    python tools/preflight.py --config configs/tiny.yaml --train.precision bf16
    # + 64 simulated
    python tools/preflight.py --config configs/llama3_8b.yaml --nproc-per-node 8 --world-size 64

It trains the config (with its overrides) for ``--iters`` steps through the real entry point
(``python -m megapretrain.train``, or torchrun with ``--nproc-per-node`` > 1) in
``RUN_DIR/preflight/full``, saving a checkpoint at the midpoint; then a second run in
``RUN_DIR/preflight/resume`` starts from that checkpoint and trains the second half again. The
learning-rate schedule is the config's own (``schedule.decay_iters`` stays that of the full run), so
these are the first steps of the real run. Then it checks:

    training runs      the full run exits 0 and logs every step
    loss falls         the loss drops by more than 3σ of its noise, with no spike and no rollback
    grad norm          every step's grad norm (before clipping) is finite and within [0.1,
                       10] at all but one step in 20 (a lone spike is what clipping is for)
    lr schedule        the logged lr equals LRSchedule (megapretrain.optim.lr_schedule) at every
                       step
    checkpoint         the midpoint checkpoint was saved, complete and with valid checksums
    resume             the resumed run's losses equal the uninterrupted ones (bitwise or within
                       1e-6)
    throughput         median tokens/s ≥ --min-tokens-per-sec (reported, not checked, without it)
    memory             peak memory ≤ the device's (or --max-memory-gb)
    layouts            (--layouts) tools/smoke_test.py: every parallel layout (cp ones included)
                       matches one process
    production layout  (--world-size N) the config's layout on N GPUs, one rank of every role
                       simulated with the trainer's own program (tools/simulate.py): each peak plus
                       the planner's allowance fits the GPU (--gpu, or --max-memory-gb); the planner
                       within 5%

and writes ``RUN_DIR/preflight/report.md`` — the checks with measured values, pass/fail and what to
do on failure — with loss.png, grad_norm.png, lr.png and throughput.png beside it. The exit status
is 0 when every check passes, 1 when one fails (stderr names each), 2 on bad input. An existing
``RUN_DIR/preflight`` is never overwritten without ``--overwrite``; RUN_DIR itself is not touched.

This module reads the input and runs the steps in order; the training subprocesses are
``preflight_runs.py``, the checks ``preflight_checks.py``, the report ``preflight_report.py``.
"""


from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

from megapretrain.cli import (
    ToolParser,
    non_negative_float,
    positive_float,
    positive_int,
    user_errors,
)
from megapretrain.config import Config, ConfigError, check_output_dirs, load_config
from megapretrain.errors import UserError
from megapretrain.monitor.flops import DEVICES
from megapretrain.optim.lr_schedule import LRSchedule
from megapretrain.resolve import resolve

from .preflight_checks import (
    Check,
    check_checkpoint,
    check_grad_norm,
    check_layouts,
    check_loss,
    check_lr,
    check_memory,
    check_production,
    check_ran,
    check_resume,
    check_throughput,
)
from .preflight_report import write_plots, write_report
from .preflight_runs import Run, data_cache, run_training, train_command

# ----------------------------------------------------------------------------------------------
# Input


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = ToolParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--config", required=True,
                    help="YAML config; --section.key VALUE overrides follow")
    ap.add_argument("--iters", type=positive_int, default=100, help="iterations of the full run "
                                                                    "(default 100)")
    ap.add_argument("--nproc-per-node", type=positive_int, default=1,
                    help="ranks (torchrun when > 1)")
    ap.add_argument("--min-tokens-per-sec", type=positive_float, help="required median throughput")
    ap.add_argument("--max-memory-gb", type=positive_float, help="peak memory allowed (default: "
                                                                 "the device's)")
    ap.add_argument("--layouts", nargs="?", const="auto", metavar="SPEC",
                    help="also run tools/smoke_test.py's layout checks (optionally its --layouts "
                         "SPEC, e.g. 'tp=2,cp=2,sp=1; cp=2,pp=2')")
    ap.add_argument("--resume-tolerance", type=non_negative_float, default=1e-6,
                    help="largest |Δloss| after resuming")
    ap.add_argument("--timeout-s", type=positive_float,
                    help="stop a training run that takes longer")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an existing RUN_DIR/preflight")
    ap.add_argument("--world-size", type=positive_int, metavar="N",
                    help="also simulate the layout on N GPUs, as the run will be launched "
                         "(tools/simulate.py)")
    ap.add_argument("--gpu", default="h100", choices=sorted(DEVICES),
                    help="the GPUs of --world-size (default h100)")
    args, overrides = ap.parse_known_args(argv)
    if args.iters < 4:
        raise UserError(f"--iters {args.iters}: a pre-flight needs at least 4 iterations (default "
                        "100)")
    return args, overrides


def load(args: argparse.Namespace, overrides: list[str]) -> tuple[Config, int, int]:
    """The validated config (vocabulary filled from the tokenizer), its schedule's decay_iters and
    the tokenizer's vocabulary size."""
    from megapretrain.data.checks import resolve_vocab

    cfg = load_config(args.config, overrides)
    tokenizer_vocab = resolve_vocab(cfg)
    sizes = resolve(cfg, args.nproc_per_node).sizes
    check_output_dirs(cfg)
    if not cfg.data.paths:
        raise ConfigError("data.paths is empty: set it to a prefix written by "
                          "tools/preprocess_data.py")
    return cfg, sizes.decay_iters, tokenizer_vocab


def prepare_dir(cfg: Config, overwrite: bool, tokenizer_vocab: int) -> str:
    """A new RUN_DIR/preflight (the old one removed only with ``overwrite``), once the data is
    known to fit the model (the check's index cache goes inside, where the runs find it)."""
    from megapretrain.data.checks import check_data_matches_model

    out = os.path.join(cfg.run.dir, "preflight")
    if os.path.exists(out):
        if not overwrite:
            raise UserError(f"{out} exists (an earlier pre-flight); pass --overwrite to replace "
                            "it, or another --run.dir")
        shutil.rmtree(out)
    made_run_dir = not os.path.exists(cfg.run.dir)
    os.makedirs(out)
    try:
        check_data_matches_model(cfg.data.paths, cfg.data.tokenizer.type, tokenizer_vocab,
                                 cfg.model.vocab_size, data_cache(cfg, out))
    except UserError:
        # ours, just made: nothing blocks the next try
        shutil.rmtree(cfg.run.dir if made_run_dir else out)
        raise
    return out



# ----------------------------------------------------------------------------------------------
# Main


def run_checks(args, overrides: list[str], cfg: Config, decay_iters: int,
               out: str) -> tuple[list[Check], list]:
    mid = args.iters // 2
    schedule = LRSchedule.from_config(cfg, decay_iters)
    full_dir, resume_dir = os.path.join(out, "full"), os.path.join(out, "resume")
    full = run_training(Run("full", full_dir,
                            train_command(args, overrides, cfg, decay_iters, full_dir,
                                          ["--checkpoint.interval", str(mid)])), args.timeout_s,
                        args.iters)
    checks = [check_ran(full, args.iters)]
    runs = [full]
    if not full.steps():
        later = ("loss falls", "grad norm", "lr schedule", "checkpoint", "resume", "throughput",
                 "memory")
        checks += [Check(name, None, "the full run logged no steps", "", "") for name in later]
        return checks, runs
    checks += [check_loss(full), check_grad_norm(full)]
    ckpt_check, ckpt = check_checkpoint(full, mid)
    resumed = Run("resume", resume_dir, [])
    if ckpt_check.ok:
        resumed.command = train_command(args, overrides, cfg, decay_iters, resume_dir,
                                        ["--checkpoint.load", ckpt, "--checkpoint.finetune",
                                         "false", "--checkpoint.load_optimizer", "true",
                                         "--checkpoint.load_rng", "true", "--checkpoint.interval",
                                         "0"])
        run_training(resumed, args.timeout_s, args.iters)
        runs.append(resumed)
    checks += [check_lr(runs, schedule), ckpt_check]
    checks.append(check_resume(full, resumed, mid, args.iters, args.resume_tolerance)
                  if ckpt_check.ok
                  else Check("resume", None, "no checkpoint to resume from", "", ""))
    checks += [check_throughput(full, args.min_tokens_per_sec, args.iters),
               check_memory(runs, cfg, args)]
    if args.layouts:
        checks.append(check_layouts(args, cfg, out))
    if args.world_size:
        checks.append(check_production(args, overrides, cfg, out))
    return checks, runs


@user_errors
def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    if args.layouts and args.nproc_per_node < 2:
        raise UserError("--layouts compares parallel layouts with one process: it needs "
                        "--nproc-per-node ≥ 2")
    cfg, decay_iters, tokenizer_vocab = load(args, overrides)
    out = prepare_dir(cfg, args.overwrite, tokenizer_vocab)
    checks, runs = run_checks(args, overrides, cfg, decay_iters, out)
    full = runs[0]
    resumed = runs[1] if len(runs) > 1 else Run("resume", "", [])
    plots = write_plots(out, full, resumed, LRSchedule.from_config(cfg, decay_iters),
                        args.min_tokens_per_sec)
    report = write_report(out, args, overrides, cfg, checks, runs, plots)
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"  {c.name:<{width}}  {c.result.strip('*'):<11}  {c.measured}")
    failed = [c for c in checks if c.ok is False]
    for c in failed:
        print(f"preflight: FAILED {c.name}: {c.measured} (required: {c.required})", file=sys.stderr)
    checked = [c for c in checks if c.ok is not None]
    print(f"preflight: {'FAILED' if failed else 'PASSED'} {len(checked) - len(failed)} of "
          f"{len(checked)} checks ({len(checks) - len(checked)} not checked) in "
          f"{time.monotonic() - started:.0f} s; report: {report}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
