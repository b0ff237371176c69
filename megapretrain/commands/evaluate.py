"""Score multiple-choice task files on a checkpoint, offline, as the training loop does.

    python tools/evaluate.py --checkpoint runs/tiny --tasks tasks/arc_easy.jsonl tasks/piqa.jsonl \\
        [--output items.jsonl] [--fewshot F1 F2 --num-fewshot 5] [--micro-batch-size 8] [--json]

``--checkpoint`` is an ``iter_*`` directory, or a run directory for its newest usable one, saved
under any layout: its fp32 master weights are put together on one process (tp shards, pipeline
stages and ZeRO ranges, as ``convert_checkpoint.py to-hf`` reads them) into one fp32 model. The
tokenizer, ``train.seq_length`` and the architecture come from the run's ``config.yaml`` (or
``--config``). Prints ``<task>/acc``, ``<task>/acc_norm`` and ``<task>/n`` per task (the names of
the training loop's eval lines); ``--output`` writes one JSON line per item with its choices'
log-likelihoods. The task file format and the scoring rule: docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from megapretrain.checkpoint.directories import resolve_checkpoint
from megapretrain.checkpoint.hf import our_model
from megapretrain.checkpoint.reshard import GlobalWeights, saved_config_path
from megapretrain.cli import ToolParser, non_negative_int, positive_int, user_errors
from megapretrain.config import load_config
from megapretrain.data.tokenizers import build_tokenizer
from megapretrain.errors import UserError
from megapretrain.eval import load_tasks, model_logliks, pack, task_metrics


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = ToolParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--checkpoint", required=True,
                    help="an iter_* checkpoint directory, or a run directory (its latest)")
    ap.add_argument("--tasks", nargs="+", required=True, metavar="FILE",
                    help="task files: JSONL of {context, choices, label}")
    ap.add_argument("--output", help="new JSONL file of per-item log-likelihoods")
    ap.add_argument("--fewshot", nargs="+", default=[], metavar="FILE",
                    help="one file of example items per task, in the order of --tasks")
    ap.add_argument("--num-fewshot", type=non_negative_int, default=0,
                    help="examples put before every context (the first items of --fewshot's)")
    ap.add_argument("--micro-batch-size", type=positive_int,
                    help="samples per forward (default: the run's train.micro_batch_size)")
    ap.add_argument("--config", help="the run's config (default: config.yaml of the checkpoint's "
                                     "run)")
    ap.add_argument("--device", default="cpu", help="torch device to score on (default: cpu)")
    ap.add_argument("--json", action="store_true", help="print one JSON object of the metrics")
    return ap.parse_args(argv)


def evaluate(args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """The metrics of every task and one record per item."""
    if args.num_fewshot < 0:
        raise UserError(f"--num-fewshot {args.num_fewshot} must be at least 0")
    if args.num_fewshot and len(args.fewshot) != len(args.tasks):
        raise UserError(f"--num-fewshot {args.num_fewshot} needs one --fewshot file per task "
                        f"({len(args.tasks)}); got {len(args.fewshot)}")
    if args.output and os.path.exists(args.output):
        raise UserError(f"--output {args.output} exists: give a new file name (nothing is "
                        "overwritten)")
    path = resolve_checkpoint(args.checkpoint)
    cfg = load_config(saved_config_path(path, args.config), [])
    tokenizer = build_tokenizer(cfg.data.tokenizer.type, cfg.data.tokenizer.model)
    tasks = load_tasks(args.tasks, tokenizer, cfg.train.seq_length,
                       args.fewshot if args.num_fewshot else None, args.num_fewshot)
    weights = GlobalWeights(path, cfg)  # resets cfg's layout to one process
    try:
        model = our_model(cfg, weights.get).to(args.device)
    finally:
        weights.close()
    tokens, targets = pack(tasks, cfg.train.seq_length)
    logliks = model_logliks(model, tokens, targets,
                            args.micro_batch_size or cfg.train.micro_batch_size, args.device)
    return task_metrics(tasks, logliks)


def write_items(path: str, records: list[dict]) -> None:
    """One JSON line per item, written to a temporary name and renamed when complete."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


@user_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    with torch.no_grad():  # scoring only; the caller's grad mode is left as it was
        metrics, records = evaluate(args)
    if args.output:
        write_items(args.output, records)
    if args.json:
        print(json.dumps(metrics))
    else:
        for name in dict.fromkeys(k.split("/")[0] for k in metrics):
            print(f"{name}: acc {metrics[name + '/acc']:.4f}  acc_norm "
                  f"{metrics[name + '/acc_norm']:.4f}  n {metrics[name + '/n']}")
        if args.output:
            print(f"wrote {args.output}: {len(records)} items")
    return 0


if __name__ == "__main__":
    sys.exit(main())
