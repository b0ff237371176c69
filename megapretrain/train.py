"""Entry point: ``python -m megapretrain.train --config configs/NAME.yaml [--section.key VALUE ...]``.

The same command runs under ``torchrun --nproc_per_node N ... -m megapretrain.train``. Mistakes in
the config, the data or the checkpoint (a :class:`~megapretrain.errors.UserError`) stop the run
before any work with one line on stderr and exit status 2; anything else is a bug and shows its
traceback.
"""

from __future__ import annotations

import os
import sys

import torch

from .config import Config, help_text, load_config, validate
from .errors import ConfigError, UserError

USAGE = """usage: python -m megapretrain.train --config configs/NAME.yaml [--section.key VALUE ...]

Every config field can be overridden by its dotted name; values are read as YAML
(--train.iters 50, --data.paths '[prefixA, prefixB]', --parallel.sequence_parallel true).
Rerunning with the same run.dir resumes from its latest checkpoint.
Options (default, meaning):"""


def split_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """Separate ``--config PATH`` from the dotted overrides."""
    config, rest, i = None, [], 0
    while i < len(argv):
        if argv[i] == "--config" and i + 1 < len(argv):
            config, i = argv[i + 1], i + 2
        elif argv[i].startswith("--config="):
            config, i = argv[i].split("=", 1)[1], i + 1
        else:
            rest.append(argv[i])
            i += 1
    return config, rest


def resolve_device(cfg: Config) -> torch.device:
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible (use --train.device cpu)")
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def resolve_vocab(cfg: Config) -> None:
    """Fill ``model.vocab_size`` from the tokenizer when unset; check it covers the tokenizer."""
    from .data.tokenizers import build_tokenizer

    tok = cfg.data.tokenizer
    tokenizer_vocab = build_tokenizer(tok.type, tok.model).vocab_size
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = tokenizer_vocab
    elif cfg.model.vocab_size < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the vocabulary of "
                          f"data.tokenizer ({tok.type}: {tokenizer_vocab}); set it to at least "
                          f"{tokenizer_vocab} or to null")


def setup(argv: list[str]):
    """Parse, validate and build the trainer; raises user-facing errors before any training."""
    from .parallel.state import ParallelState, init_distributed
    from .trainer import Trainer

    config_path, overrides = split_args(argv)
    cfg = load_config(config_path, overrides)
    device = resolve_device(cfg)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    resolve_vocab(cfg)
    sizes, warnings = validate(cfg, world_size)  # before any process group exists
    if not cfg.data.paths:
        raise ConfigError("data.paths is empty: set it to a prefix written by tools/preprocess_data.py, "
                          "e.g. --data.paths '[data/corpus_text_document]'")
    if device.type == "cpu":
        # Ranks sharing a CPU must not oversubscribe it: OpenMP spin-waits make that ~100× slower.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(cfg.train.threads or max(1, (os.cpu_count() or 1) // local))
    init_distributed(cfg.parallel.backend, device.type)
    ps = ParallelState(cfg.parallel.tp, cfg.parallel.pp, device=device, comm_stats=cfg.parallel.comm_stats)
    if ps.rank == 0:
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
    return Trainer(cfg, sizes, ps)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE + help_text())
        return 0
    from .recovery import RecoveryError

    try:
        trainer = setup(argv)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        trainer.fit()
    except RecoveryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
