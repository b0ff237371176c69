"""A config and a world size, resolved once into what a run is: its :class:`Layout`, its model
shape, its sizes (batches, steps, tokens, vocabulary) and the warnings it deserves.

Each rule lives with its owner — the fields' own ranges and choices in ``config.py``, the layout's
in ``parallel/layout.py``, the model's in ``model/args.py``, the pipeline schedule's in
``parallel/pipeline.py``, the batches' and the run's length in ``data/sampler.py``, the
optimizer's and the learning-rate schedule's in ``optim/`` — and :func:`resolve` only composes
them, in the order that names the most basic mistake first. ``train.py`` and every tool call it;
nothing else turns a config into a layout. It never mutates the config.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from .checkpoint.merge import check_average_last
from .config import Config, check_fields, check_needs
from .data.checks import check_split
from .data.sampler import check_batches, run_length
from .errors import ConfigError, PipelineError
from .eval import check_eval_config
from .faults import check_faults
from .model.args import ModelArgs, model_args
from .model.attention import check_attention
from .model.families import check_model
from .model.fp8 import check_fp8, fp8_summary
from .optim.lr_schedule import resolve_decay_iters
from .optim.optimizer import check_optim
from .parallel.context import check_cp_comm
from .parallel.layout import Layout
from .parallel.pipeline import SCHEDULES, Schedule, resolve_schedule
from .recovery import check_recovery


@dataclass(frozen=True)
class RunSizes:
    """Sizes derived from the config and the world size; computed once, printed at start-up."""
    layout: Layout
    grad_accum: int          # micro-batches per step on each dp rank, at the full global batch
    tokens_per_batch: int
    total_tokens: int
    num_kv_heads: int
    ffn_hidden_size: int
    padded_vocab: int
    decay_iters: int
    iters: int               # optimizer steps of the run (train.iters, or derived from
    #                          train.train_tokens)
    train_samples: int       # samples those steps consume (batch-size ramp-up included)
    schedule: Schedule = SCHEDULES["none"]  # the pipeline schedule, resolved (parallel.pp_schedule)
    rampup: tuple | None = None  # train.rampup_batch_size
    fp8: str = ""            # what runs in FP8 (model/fp8.py's summary); "" with model.fp8 none

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def cp(self) -> int:
        return self.layout.cp

    def describe(self, num_params: int | None = None, flops_per_token: float | None = None) -> str:
        parts = [self.layout.describe(),
                 f"grad_accum={self.grad_accum}",
                 f"tokens/step={self.tokens_per_batch:,}",
                 f"steps={self.iters:,}",
                 f"total_tokens={self.total_tokens:,}",
                 f"vocab(padded)={self.padded_vocab:,}"]
        if self.rampup:
            start, inc, ramp = self.rampup
            parts.append(f"batch_rampup={start}+{inc} up to the full batch over {ramp:,} samples")
        if num_params is not None:
            parts.append(f"params={num_params:,}")
            parts.append(f"tokens/param={self.total_tokens / num_params:.1f} (Chinchilla-optimal "
                         f"~20: {20 * num_params:,} tokens)")
        if flops_per_token is not None:
            parts.append(f"flops/token={flops_per_token:.3g}")
        if self.fp8:
            parts.append(self.fp8)
        return "plan: " + "  ".join(parts)


@dataclass(frozen=True)
class Resolved:
    """What a config means on a world of ranks: the one object a run and every tool read."""
    cfg: Config
    layout: Layout
    model: ModelArgs
    sizes: RunSizes
    warnings: tuple[str, ...]


def _check_kernel_choice(cfg: Config) -> None:
    """``model.kernels`` / ``optim.impl`` = triton needs triton, and on CPU Triton's interpreter."""
    for name, value in (("model.kernels", cfg.model.kernels), ("optim.impl", cfg.optim.impl)):
        if value != "triton":
            continue
        if importlib.util.find_spec("triton") is None:
            raise ConfigError(f"{name}=triton: triton is not installed (pip install "
                              f"'megapretrain[triton]', or {name}=auto)")
        if cfg.train.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(f"{name}=triton on train.device=cpu runs only under Triton's "
                              "interpreter: set TRITON_INTERPRET=1 before starting, or "
                              f"{name}=auto (torch on CPU)")


def _schedule(cfg: Config, layout: Layout, batches: list[int]) -> Schedule:
    """The pipeline schedule, checked at the full batch and at every batch of a ramp-up."""
    p, per_step = cfg.parallel, layout.micro_batch * layout.dp
    full, *ramp = batches
    try:
        schedule = resolve_schedule(p.pp_schedule, p.pp, p.vpp, full // per_step)
    except PipelineError as exc:
        raise ConfigError(str(exc)) from None
    for batch in ramp:
        try:
            schedule.check(p.pp, p.vpp, batch // per_step)
        except PipelineError as exc:
            raise ConfigError(f"train.rampup_batch_size={cfg.train.rampup_batch_size}, at batch "
                              f"{batch}: {exc}; or start the ramp-up at a batch that gives such a "
                              f"count, or set train.rampup_batch_size null") from None
    return schedule


def check_run_faults(run: Resolved) -> None:
    """The fault drills of a run about to train (``train.py``, ``tools/drill.py``), on its world
    and its length: one that can never fire is refused (``faults.py``). Not part of
    :func:`resolve`: the tools that read a saved run's config under a layout of their own
    (resharding, merging, converting) run none of its drills."""
    cfg, layout, sizes = run.cfg, run.layout, run.sizes
    place = sizes.schedule.placement(layout.pp, layout.vpp)
    head = layout.grid()[place.stage_of(place.chunks - 1)].ravel().tolist()  # (the loss's stage)
    check_faults(cfg, sizes.iters, layout.world_size, head,
                 "train.train_tokens" if cfg.train.train_tokens is not None else "train.iters")


def resolve(cfg: Config, world_size: int) -> Resolved:
    """Check every rule of ``cfg`` on ``world_size`` ranks and derive the run from it (raises
    :class:`ConfigError`, one line naming the fields, on the first rule broken)."""
    m, t = cfg.model, cfg.train
    check_fields(cfg)
    check_needs(cfg)
    _check_kernel_choice(cfg)
    check_optim(cfg.optim)
    layout = Layout.from_config(cfg, world_size)
    check_model(m, layout.tp)
    shape = model_args(cfg)
    check_cp_comm(layout.cp_comm, layout.cp, layout.tp, shape.num_heads, shape.num_kv_heads,
                  m.attention_dropout)
    check_fp8(cfg, layout)
    attention_warnings = check_attention(cfg, layout)
    batches = check_batches(t, layout.dp)
    schedule = _schedule(cfg, layout, batches)
    iters, train_samples = run_length(t)
    check_split(cfg.data.split)
    decay_iters, warnings = resolve_decay_iters(cfg, iters)
    check_recovery(cfg.recovery.action)
    check_average_last(cfg.checkpoint)
    check_eval_config(cfg)

    model = shape
    sizes = RunSizes(layout=layout,
                     grad_accum=t.global_batch_size // (t.micro_batch_size * layout.dp),
                     tokens_per_batch=t.global_batch_size * t.seq_length,
                     total_tokens=train_samples * t.seq_length, num_kv_heads=model.num_kv_heads,
                     ffn_hidden_size=model.ffn_hidden_size,
                     padded_vocab=model.padded_vocab(layout.tp), decay_iters=decay_iters,
                     iters=iters, train_samples=train_samples, schedule=schedule,
                     rampup=tuple(t.rampup_batch_size) if t.rampup_batch_size else None,
                     fp8=fp8_summary(cfg))
    return Resolved(cfg=cfg, layout=layout, model=model, sizes=sizes,
                    warnings=(*warnings, *attention_warnings))

