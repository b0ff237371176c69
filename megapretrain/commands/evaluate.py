"""Score multiple-choice task files on a checkpoint, offline, as the training loop does.

    python tools/evaluate.py --checkpoint runs/tiny --tasks tasks/arc_easy.jsonl tasks/piqa.jsonl \\
        [--output items.jsonl] [--fewshot F1 F2 --num-fewshot 5 [--fewshot-sampler first_n]] \\
        [--fp32] [--json] [--section.key VALUE ...]
    torchrun --nproc_per_node 8 tools/evaluate.py --checkpoint runs/70b --tasks ... \\
        --parallel.tp 8 [--parallel.pp N --parallel.zero 3 ...]

``--checkpoint`` is an ``iter_*`` directory, or a run directory for its newest usable one, saved
under any layout. The architecture, tokenizer, ``train.seq_length`` and ``train.precision`` come
from the run's ``config.yaml`` (or ``--config``); the layout is one process's (tp, pp, cp 1, every
rank a dp rank, no ZeRO) unless ``--parallel.*`` flags give another, and any other config field can
be set the same way (``--train.micro_batch_size 8``). Under torchrun (or ``python -m
megapretrain.launcher``, what ``run_scripts/launch.sh`` runs) each rank builds its share of the
model in that layout, takes its weights from the checkpoint as a resumed training does (whatever
layout saved it), and scores through the training loop's forward-only pipeline schedule: tp/sp,
pp, cp, dp splitting the items, ZeRO 3 gathering one layer at a time. The model computes in the
run's precision, as the loop's evaluation does; ``--fp32`` scores in fp32 instead.

The task and few-shot files are read and checked before anything is built. Prints ``<task>/acc``,
``<task>/acc_norm`` and ``<task>/n`` per task (the names of the training loop's eval lines); rank 0
writes ``--output``, one JSON line per item with its choices' log-likelihoods. The task file format
and the scoring rule: docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist

from megapretrain.checkpoint.directories import resolve_checkpoint
from megapretrain.checkpoint.format import check_shapes, read_metadata
from megapretrain.checkpoint.manager import restore_optimizer
from megapretrain.checkpoint.reshard import (
    SavedShards,
    global_shapes,
    resharded_state,
    saved_config_path,
    saved_padded_vocab,
)
from megapretrain.cli import ToolParser, non_negative_int, user_errors
from megapretrain.config import load_config
from megapretrain.data.tokenizers import build_tokenizer
from megapretrain.errors import UserError
from megapretrain.eval import PipelineScorer, load_tasks, pack, task_metrics
from megapretrain.eval.tasks import FEWSHOT_SEED, SAMPLERS
from megapretrain.model.build import DTYPES, build_model_chunks, deferred_initializer
from megapretrain.optim.optimizer import MixedPrecisionAdamW
from megapretrain.parallel.pipeline import P2P, PipelineExecutor
from megapretrain.parallel.state import ParallelState, init_distributed
from megapretrain.resolve import resolve
from megapretrain.runtime import bind_device, resolve_device, set_numerics

# the layout an evaluation starts from: one process's, every rank a dp rank (--parallel.* flags
# change it); the run's own layout is not assumed (an evaluation rarely has the training's GPUs)
LAYOUT = ("parallel",)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The tool's flags, and the ``--section.key VALUE`` config overrides after them."""
    ap = ToolParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--checkpoint", required=True,
                    help="an iter_* checkpoint directory, or a run directory (its latest)")
    ap.add_argument("--tasks", nargs="+", required=True, metavar="FILE",
                    help="task files: JSONL of {context, choices, label}")
    ap.add_argument("--output", help="new JSONL file of per-item log-likelihoods (rank 0 writes)")
    ap.add_argument("--fewshot", nargs="+", default=[], metavar="FILE",
                    help="one file of example items per task, in the order of --tasks (a task's "
                         "own file: the item itself is left out of its examples)")
    ap.add_argument("--num-fewshot", type=non_negative_int, default=0,
                    help="examples put before every context, drawn per item as "
                         "lm-evaluation-harness draws them")
    ap.add_argument("--fewshot-seed", type=non_negative_int, default=FEWSHOT_SEED,
                    help=f"seed of the few-shot draws (default {FEWSHOT_SEED}, "
                         "lm-evaluation-harness's)")
    ap.add_argument("--fewshot-sampler", choices=SAMPLERS, default="random",
                    help="random: drawn per item (lm-evaluation-harness's default sampler); "
                         "first_n: the file's first ones (its first_n sampler, MMLU's)")
    ap.add_argument("--fp32", action="store_true",
                    help="compute in fp32 (default: the run's train.precision, as the training "
                         "loop's evaluation does)")
    ap.add_argument("--config", help="the run's config (default: config.yaml of the checkpoint's "
                                     "run)")
    ap.add_argument("--json", action="store_true", help="print one JSON object of the metrics")
    args, overrides = ap.parse_known_args(argv)
    bad = [a for a in overrides if a.startswith("-") and "." not in a]
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)} (config fields are --section.key "
                 "VALUE)")
    return args, overrides


def evaluate(args: argparse.Namespace, overrides: list[str]) -> tuple[dict, list[dict]]:
    """The metrics of every task and one record per item (the same on every rank)."""
    if args.num_fewshot and len(args.fewshot) != len(args.tasks):
        raise UserError(f"--num-fewshot {args.num_fewshot} needs one --fewshot file per task "
                        f"({len(args.tasks)}); got {len(args.fewshot)}")
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if args.output and os.path.exists(args.output):
        raise UserError(f"--output {args.output} exists: give a new file name (nothing is "
                        "overwritten)")
    path = resolve_checkpoint(args.checkpoint, check=rank == 0)  # (one rank reads it through)
    cfg = eval_config(path, args, overrides)
    # every task and few-shot file read and checked before anything is built or loaded
    tasks = load_tasks(args.tasks, build_tokenizer(cfg.data.tokenizer.type,
                                                   cfg.data.tokenizer.model),
                       cfg.train.seq_length, args.fewshot if args.num_fewshot else None,
                       args.num_fewshot, args.fewshot_seed, args.fewshot_sampler)
    run = resolve(cfg, world_size)
    device = resolve_device(cfg)
    bind_device(device)
    set_numerics(cfg.train.tf32, cfg.train.deterministic, cfg.train.precision, device)
    if device.type == "cpu":  # ranks sharing a CPU must not oversubscribe it
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(cfg.train.threads or max(1, (os.cpu_count() or 1) // local))
    joined = not dist.is_initialized()
    init_distributed(cfg.parallel.backend, device.type,
                     timeout_s=cfg.watchdog.collective_timeout_s)
    try:
        ps = ParallelState.of(run.layout, device=device, comm_stats=cfg.parallel.comm_stats,
                              checkpoint_timeout_s=cfg.checkpoint.timeout_s)
        with contextlib.redirect_stdout(sys.stderr):  # the build's start-up lines: stdout is ours
            scorer = LayoutScorer(cfg, run.sizes, ps, _agreed(path, ps))
        tokens, targets = pack(tasks, cfg.train.seq_length)
        return task_metrics(tasks, scorer(tokens, targets))
    finally:
        if joined and dist.is_initialized():
            dist.destroy_process_group()


def eval_config(path: str, args: argparse.Namespace, overrides: list[str]):
    """The run's config with the evaluation's layout and overrides: one process's unless
    ``--parallel.*`` says otherwise, ``--fp32`` for fp32, the tasks the command line's."""
    extra = ["--train.precision", "fp32"] if args.fp32 else []
    cfg = load_config(saved_config_path(path, args.config), overrides + extra, reset=LAYOUT)
    if not cfg.model.vocab_size:  # (a config of a run that took it from its tokenizer)
        cfg.model.vocab_size = read_metadata(path).get("vocab_size")
    # the run's own eval.tasks are not scored here, and no training data is read
    cfg.eval.tasks, cfg.eval.fewshot, cfg.eval.num_fewshot = [], [], 0
    return cfg


def _agreed(path: str, ps: ParallelState) -> str:
    """Rank 0's checkpoint (it checked the files; a damaged newest is passed over there only)."""
    if ps.world_size == 1:
        return path
    chosen = [path]
    dist.broadcast_object_list(chosen, src=0, group=ps.checkpoint.pg)
    return chosen[0]


class LayoutScorer:
    """This rank's model chunks in the layout of ``ps``, their weights the fp32 masters of
    checkpoint ``path`` (whatever layout saved them, cut as a resumed training cuts them; in the
    model's dtype: ``train.precision``), scored by the training loop's :class:`PipelineScorer`
    (its forward-only schedule, ZeRO 3 gathering each layer around its use)."""

    def __init__(self, cfg, sizes, ps: ParallelState, path: str):
        t, p = cfg.train, cfg.parallel
        torch.manual_seed(t.seed)  # (no dropout in evaluation; weights come from the checkpoint)
        self.chunks, self.specs = build_model_chunks(cfg, ps)
        named = [np for chunk in self.chunks for np in chunk.named_parameters()]
        # the masters and their dp/ZeRO sharding, as in training: ZeRO 3 keeps 1/dp of the weights
        self.optimizer = MixedPrecisionAdamW(named, self.specs, cfg.optim, t.precision, ps,
                                             zero=p.zero, bucket_size_mb=p.bucket_size_mb,
                                             initialize=deferred_initializer(self.chunks,
                                                                             self.specs, t.seed))
        self.optimizer.hook_models(self.chunks, keep_gathered=p.zero3_keep_gathered,
                                   prefetch=p.zero3_prefetch)
        self._load(cfg, ps, path)
        args = self.chunks[0].args
        act_seq = t.seq_length // ps.cp.size  # a stage hands on its cp share of each sample
        act_seq //= ps.tp.size if p.sequence_parallel and ps.tp.size > 1 else 1
        p2p = P2P(ps.pp, (t.micro_batch_size, act_seq, args.hidden_size), DTYPES[t.precision],
                  ps.device) if ps.pp.size > 1 else None
        schedule = sizes.schedule
        pipeline = PipelineExecutor(ps.pp_rank, ps.pp.size, p.vpp, p2p, self.optimizer.grad_sync,
                                    schedule)
        orders = [schedule.forward_order(ps.pp.size, p.vpp, sizes.grad_accum)] * ps.pp.size
        self.score = PipelineScorer(self.chunks, ps, pipeline, orders, sizes.grad_accum,
                                    t.micro_batch_size)

    def _load(self, cfg, ps: ParallelState, path: str) -> None:
        """This rank's weights from checkpoint ``path``: whole tp slices of its parameters' fp32
        masters (no optimizer moments), of which each rank keeps its ZeRO ranges."""
        meta = read_metadata(path)
        check_shapes(path, meta, global_shapes(cfg))
        m = cfg.model
        padded = saved_padded_vocab(meta, m.vocab_size, m.make_vocab_size_divisible_by)
        owned = {name: self.specs[name] for name in self.optimizer.fragments}
        saved = SavedShards(path, meta)
        try:
            state = resharded_state(saved, owned, ps.tp_rank, ps.tp.size, padded, moments=False)
        finally:
            saved.close()
        restore_optimizer(self.optimizer, state, moments=False, where=path)

    def __call__(self, tokens: torch.Tensor, targets: torch.Tensor) -> list[float]:
        """Every row's log-likelihood (:class:`PipelineScorer`), the same on every rank."""
        return self.score(tokens, targets)


def write_items(path: str, records: list[dict]) -> None:
    """One JSON line per item, written to a temporary name and renamed when complete."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


@user_errors
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    with torch.no_grad():  # scoring only; the caller's grad mode is left as it was
        metrics, records = evaluate(args, overrides)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
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
