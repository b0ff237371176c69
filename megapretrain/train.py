"""Entry point: ``python -m megapretrain.train --config configs/NAME.yaml [--section.key VALUE
...]``.

The same command runs under ``torchrun --nproc_per_node N ... -m megapretrain.train``. Mistakes in
the config, the data or the checkpoint (a :class:`~megapretrain.errors.UserError`) stop the run
before any work with one line on stderr and exit status 2; anything else is a bug and shows its
traceback.
"""

from __future__ import annotations

# first, before torch loads: a stop signal during start-up is kept, not fatal (early_stop.py)
from .early_stop import PENDING, EarlyStop

# isort: split
import os
import sys

import torch

from .checkpoint.directories import latest_checkpoint, resolve_checkpoint
from .cli import USER_ERROR_EXIT, print_error
from .config import check_output_dirs, help_text, load_config, repeated_overrides
from .data.checks import changed_datasets, check_data_matches_model, resolve_vocab
from .data.gpt_dataset import parse_data_paths
from .errors import ConfigError, UserError
from .monitor.flops import slow_half_precision_warning
from .oom import check_micro_batch_fits, check_model_fits
from .resolve import check_run_faults, resolve
from .run_lock import RunLock
from .runtime import bind_device, resolve_device

USAGE = """\
usage: python -m megapretrain.train --config configs/NAME.yaml [--check] [--section.key VALUE ...]

Every config field can be overridden by its dotted name; values are read as YAML
(--train.iters 50, --data.paths '[prefixA, prefixB]', --parallel.sequence_parallel true).
Rerunning with the same run.dir resumes from its latest checkpoint.
--check validates the config, its data paths, its tokenizer and its eval.tasks files at
$WORLD_SIZE ranks (default 1) and exits (0: ready; 2: the line that says what is not), building
and writing nothing but the data checks' cache.
Options (default, meaning):"""


def split_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """Separate ``--config PATH`` from the dotted overrides."""
    config, rest, i = None, [], 0
    while i < len(argv):
        if argv[i] == "--config" and i + 1 < len(argv) or argv[i].startswith("--config="):
            given = argv[i + 1] if argv[i] == "--config" else argv[i].split("=", 1)[1]
            if config is not None:  # the last would win without a word
                raise ConfigError(f"--config given twice ({config!r}, then {given!r}): give one "
                                  "config file; change single fields with --section.key VALUE")
            config, i = given, i + (2 if argv[i] == "--config" else 1)
        else:
            rest.append(argv[i])
            i += 1
    return config, rest


def checked(argv: list[str], verify: bool = True, dry: bool = False):
    """The config of ``argv``, resolved at $WORLD_SIZE ranks, with its data and tokenizer checked
    against the model: everything a launch needs that can be checked without building it. Returns
    the config, the resolved run and the data files' facts. ``verify=False`` (the other ranks of a
    node) reads the data files' summaries and headers only, not the files through. ``dry``
    (``--check``, a dry run: often on a login node without the run's GPUs) sizes the model against
    this machine's CPU only where ``train.device`` says the run trains on the CPU."""
    config_path, overrides = split_args(argv)
    cfg = load_config(config_path, overrides)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    tokenizer_vocab = resolve_vocab(cfg)
    run = resolve(cfg, world_size)  # before any process group exists
    check_run_faults(run)
    if cfg.checkpoint.load is not None and latest_checkpoint(
            os.path.join(cfg.run.dir, "checkpoints")) is None:  # (read only while there is none)
        try:
            resolve_checkpoint(cfg.checkpoint.load, check=False)
        except UserError as exc:
            raise ConfigError(f"--checkpoint.load {exc}") from None
    device = resolve_device(cfg)
    bind_device(device)  # before any CUDA query, tensor, Triton launch or process group
    if int(os.environ.get("RANK", "0")) == 0:
        # run.dir and data.cache_dir can be written (tried by one rank: no races)
        check_output_dirs(cfg)
    if not cfg.data.paths:
        raise ConfigError("data.paths is empty: set it to a prefix written by "
                          "tools/preprocess_data.py, e.g. --data.paths "
                          "'[data/corpus_text_document]'")
    if not (dry and device.type == "cpu" and cfg.train.device != "cpu"):
        check_model_fits(cfg, run.layout, device)  # before anything is built
    check_micro_batch_fits(cfg, run.layout, device)  # before any index is read or written
    data_files = check_data_matches_model(cfg.data.paths, cfg.data.tokenizer.type, tokenizer_vocab,
                                          cfg.model.vocab_size,
                                          cfg.data.cache_dir or
                                          os.path.join(cfg.run.dir, "data_cache"), verify)
    return cfg, run, data_files


def rebuilt_data_warnings(run_dir: str, data_files: dict) -> list[str]:
    """Record the data files this start trained on; when the run resumes, name the datasets that
    were rebuilt since it started (its data position then no longer continues its order)."""
    changed = changed_datasets(os.path.join(run_dir, "data_files.json"), data_files)
    if not changed or latest_checkpoint(os.path.join(run_dir, "checkpoints")) is None:
        return []
    return [f"data.paths {line}: resuming, the saved data position no longer continues the run's "
            "data order (the sample indices are rebuilt from the new files)" for line in changed]


def setup(argv: list[str]):
    """Parse, validate and build the trainer; raises user-facing errors before any training."""
    from .host_memory import keep_freed_host_memory
    from .model.decoder import num_parameters
    from .parallel import flight_recorder
    from .parallel.state import ParallelState, init_distributed
    from .runtime import pinned_host_warning, set_numerics
    from .trainer import Trainer

    # one rank per node reads the data files through
    builder = int(os.environ.get("LOCAL_RANK", "0")) == 0
    cfg, run, data_files = checked(argv, verify=builder)
    device = resolve_device(cfg)
    warnings = list(run.warnings)
    numerics = set_numerics(cfg.train.tf32, cfg.train.deterministic, cfg.train.precision, device)
    pinned = pinned_host_warning(device, cfg.checkpoint.async_save, cfg.parallel.zero,
                                 num_parameters(run.model) // (run.layout.tp * run.layout.pp))
    warnings += [pinned] if pinned else []
    if device.type == "cpu":
        # Ranks sharing a CPU must not oversubscribe it: OpenMP spin-waits make that ~100× slower.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(cfg.train.threads or max(1, (os.cpu_count() or 1) // local))
        keep_freed_host_memory()  # no page faults on each step's large tensors (host_memory.py)
    if device.type == "cpu" and cfg.train.precision in ("bf16", "fp16"):
        slow = slow_half_precision_warning(cfg.train.precision)
        warnings += [slow] if slow else []
    lock = RunLock(cfg.run.dir) if int(os.environ.get("RANK", "0")) == 0 else None
    if lock is not None:
        lock.acquire()  # before anything is written: one training per run directory
    try:
        if lock is not None:
            warnings += rebuilt_data_warnings(cfg.run.dir, data_files)
        # before the NCCL group exists: it reads them when created
        flight_recorder.enable(cfg.parallel.backend, device.type, cfg.run.dir)
        init_distributed(cfg.parallel.backend, device.type,
                         timeout_s=cfg.watchdog.collective_timeout_s)
        ps = ParallelState.of(run.layout, device=device, comm_stats=cfg.parallel.comm_stats,
                              checkpoint_timeout_s=cfg.checkpoint.timeout_s)
        if ps.rank == 0:
            for w in warnings:
                print(f"warning: {w}", file=sys.stderr)
            for repeated in repeated_overrides(split_args(argv)[1]):  # run scripts' defaults
                print(f"note: {repeated}", flush=True)
            if numerics:
                print(f"numerics: {numerics}", flush=True)
        return Trainer(cfg, run.sizes, ps, lock=lock)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if PENDING is not None and (set(argv) & {"-h", "--help", "--check"}):
        PENDING.release()  # no training: a stop signal ends it as any other program
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE + help_text())
        return 0
    from .recovery import RecoveryError

    if "--check" in argv:
        try:
            cfg, run, _ = checked([a for a in argv if a != "--check"], dry=True)
            if cfg.eval.tasks:  # the task and few-shot files, read and tokenized
                from .data.tokenizers import build_tokenizer
                from .eval import DownstreamEval

                DownstreamEval(cfg, build_tokenizer(cfg.data.tokenizer.type,
                                                    cfg.data.tokenizer.model))
        except UserError as exc:
            print_error(exc)
            return USER_ERROR_EXIT
        for warning in run.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        print("check: the config, its data "
              f"({', '.join(prefix for _, prefix in parse_data_paths(cfg.data.paths))}) and its "
              f"tokenizer ({cfg.data.tokenizer.type}) are ready at {run.layout.describe()}")
        return 0
    # kept since this module's first line (python -m megapretrain.train), else from here on
    early = PENDING or EarlyStop()
    try:
        trainer = setup(argv)
    except UserError as exc:
        print_error(exc)
        return USER_ERROR_EXIT
    early.hand_over(trainer)
    try:
        trainer.fit()
    except RecoveryError as exc:
        print_error(exc)
        return 3
    except UserError as exc:  # found while training: a full disk at a save, say
        print_error(exc)
        return USER_ERROR_EXIT
    except KeyboardInterrupt:
        print(f"interrupted at iteration {trainer.iteration} (a second Ctrl-C); nothing saved "
              "since the last checkpoint", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
