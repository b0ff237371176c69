"""Rules over a :class:`~megapretrain.config.Config`: the sizes derived from it (heads, FFN width,
padded vocabulary, the pipeline schedule, the batch-size ramp-up, the run's length) and
:func:`validate`, every cross-field rule with its one-line error. ``megapretrain.config`` re-exports
all of it, so ``from megapretrain.config import validate`` keeps working.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import ConfigError, PipelineError
from .model.args import check_model, ffn_hidden_size, kv_heads, padded_vocab_size

if TYPE_CHECKING:
    from .config import Config, ParallelConfig, TrainConfig

SCHEDULES = ("auto", "none", "gpipe", "1f1b", "interleaved")


def resolve_schedule(kind: str, pp: int, vpp: int, num_micro: int) -> str:
    """The pipeline schedule ``parallel.pp_schedule`` names at this layout, checking that it fits
    (pp, vpp, micro-batches per step); ``parallel/pipeline.py`` builds its order."""
    if kind not in SCHEDULES:
        raise PipelineError(f"parallel.pp_schedule={kind!r} is not one of: {', '.join(SCHEDULES)}")
    if vpp > 1 and pp == 1:
        raise PipelineError(f"parallel.vpp={vpp} needs parallel.pp > 1 (virtual chunks interleave stages)")
    if kind == "auto":
        kind = "none" if pp == 1 else ("interleaved" if vpp > 1 else "1f1b")
    if vpp > 1 and kind != "interleaved":
        raise PipelineError(f"parallel.vpp={vpp} needs parallel.pp_schedule=interleaved (or auto), not {kind!r}")
    if kind == "interleaved":
        if pp == 1:
            raise PipelineError("parallel.pp_schedule=interleaved needs parallel.pp > 1")
        if num_micro % pp:
            raise PipelineError(f"the interleaved schedule needs the micro-batches per step ({num_micro} = "
                                f"global_batch_size / (micro_batch_size × dp)) to be a multiple of "
                                f"parallel.pp={pp}; change train.global_batch_size or train.micro_batch_size")
    if kind == "none" and pp > 1:
        raise PipelineError("parallel.pp_schedule=none runs one stage; use gpipe, 1f1b or auto with parallel.pp > 1")
    return kind


def batch_size_at(consumed_samples: int, global_batch: int, rampup: list | None) -> int:
    """The global batch of the step after ``consumed_samples`` samples: ``global_batch``, or under
    ``rampup`` = [start, increment, ramp_samples] start + increment per ramp_samples/increments
    samples consumed (Megatron's rule), up to ``global_batch``."""
    if not rampup or consumed_samples >= rampup[2]:
        return global_batch
    start, increment, ramp_samples = rampup
    increments = (global_batch - start) // increment
    per_increment = ramp_samples / increments
    return min(global_batch, start + int(consumed_samples / per_increment) * increment)


def run_length(t: TrainConfig) -> tuple[int, int]:
    """(steps, samples) of the run: train.iters steps, or as many as train.train_tokens take."""
    if t.rampup_batch_size is None and t.train_tokens is None:
        return t.iters, t.iters * t.global_batch_size
    steps = samples = 0
    while (samples * t.seq_length < t.train_tokens) if t.train_tokens is not None else steps < t.iters:
        samples += batch_size_at(samples, t.global_batch_size, t.rampup_batch_size)
        steps += 1
    return steps, samples


@dataclass(frozen=True)
class RunSizes:
    """Sizes derived from the config and the world size; computed once, printed at start-up."""
    world_size: int
    tp: int
    pp: int
    dp: int
    grad_accum: int
    tokens_per_batch: int
    total_tokens: int
    num_kv_heads: int
    ffn_hidden_size: int
    padded_vocab: int
    decay_iters: int
    iters: int = 0           # optimizer steps of the run (train.iters, or derived from train.train_tokens)
    train_samples: int = 0   # samples those steps consume (batch-size ramp-up included)
    rampup: tuple | None = None  # train.rampup_batch_size
    cp: int = 1              # context-parallel ranks (world = tp × cp × pp × dp)

    def describe(self, num_params: int | None = None, flops_per_token: float | None = None) -> str:
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        parts = [f"world={self.world_size} (tp={self.tp}{cp} pp={self.pp} dp={self.dp})",
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
            parts.append(f"tokens/param={self.total_tokens / num_params:.1f} (Chinchilla-optimal ~20: "
                         f"{20 * num_params:,} tokens)")
        if flops_per_token is not None:
            parts.append(f"flops/token={flops_per_token:.3g}")
        return "plan: " + "  ".join(parts)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


CHOICES = {
    "train.precision": ("fp32", "bf16", "fp16"),
    "schedule.decay": ("cosine", "linear", "wsd", "constant"),
    "parallel.recompute": ("none", "selective", "full"),
    "model.mlp": ("swiglu", "gelu"),
    "parallel.backend": ("auto", "nccl", "gloo"),
    "train.device": ("auto", "cpu", "cuda"),
    "model.kernels": ("auto", "triton", "torch"),
    "optim.impl": ("auto", "triton", "torch", "apex"),
}


def _check_ranges(node, where: str = "") -> None:
    """Every number against the range its field declares (``_f(min=..., positive=...)``)."""
    hints = typing.get_type_hints(type(node))
    for f in dataclasses.fields(node):
        key = f.metadata.get("name", f.name)  # the field's name in the config (config._key)
        value, path = getattr(node, f.name), f"{where}.{key}" if where else key
        if dataclasses.is_dataclass(value):
            _check_ranges(value, path)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            null = " (or null for the default)" if typing.get_origin(hints[f.name]) is typing.Union else ""
            low = f.metadata.get("min")
            _check(low is None or value >= low,
                   f"{path}={value} must be " + ("non-negative" if low == 0 else f"at least {low}") + null)
            _check(not f.metadata.get("positive") or value > 0, f"{path}={value} must be positive{null}")


def _check_rampup(t: TrainConfig, per_step: int, p: ParallelConfig) -> None:
    """train.rampup_batch_size = [start, increment, ramp_samples]: every batch of the ramp a whole
    number of micro-batches on every dp rank (and of pp with the interleaved schedule)."""
    r = t.rampup_batch_size
    if r is None:
        return
    _check(len(r) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
           and r[0] >= 1 and r[1] >= 1 and r[2] >= 0,
           f"train.rampup_batch_size={r} must be three integers [start >= 1, increment >= 1, ramp_samples >= 0]")
    start, increment, _ = r
    _check(start <= t.global_batch_size and (t.global_batch_size - start) % increment == 0,
           f"train.rampup_batch_size={r}: train.global_batch_size={t.global_batch_size} minus start={start} "
           f"must be a non-negative multiple of increment={increment}")
    for batch in range(start, t.global_batch_size, increment):
        _check(batch % per_step == 0, f"train.rampup_batch_size={r}: the ramp's batch {batch} is not a multiple of "
                                      f"micro_batch_size × dp = {per_step}; choose start and increment as multiples")
        try:
            resolve_schedule(p.pp_schedule, p.pp, p.vpp, batch // per_step)
        except PipelineError as exc:
            raise ConfigError(f"train.rampup_batch_size={r}, at batch {batch}: {exc}") from None


def _check_kernels(kernels: str, impl: str, offload: bool, device: str) -> None:
    """``model.kernels`` and ``optim.impl`` against what is installed and the device."""
    for name, value in (("model.kernels", kernels), ("optim.impl", impl)):
        _check(value != "triton" or importlib.util.find_spec("triton") is not None,
               f"{name}=triton: triton is not installed (pip install 'megapretrain[triton]', or {name}=auto)")
        _check(not (value == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
               f"{name}=triton on train.device=cpu runs only under Triton's interpreter: set TRITON_INTERPRET=1 "
               f"before starting, or {name}=auto (torch on CPU)")
    _check(impl != "apex" or importlib.util.find_spec("apex") is not None,
           "optim.impl=apex: apex is not importable (install NVIDIA apex with its CUDA extensions, or optim.impl=auto)")
    _check(impl in ("auto", "torch") or not offload,
           f"optim.impl={impl} steps on the GPU, optim.offload on the host: set optim.impl=auto or torch")


def _check_context_parallel(p: ParallelConfig, seq: int) -> None:
    """parallel.cp: every rank two equal chunks of each sequence (the load-balanced split), and
    under sequence parallelism each rank's share split again over tp."""
    if p.cp == 1:
        return
    sp = p.sequence_parallel and p.tp > 1
    unit = 2 * p.cp * (p.tp if sp else 1)
    _check(seq % unit == 0,
           f"train.seq_length={seq} must be a multiple of 2 × parallel.cp" + (" × parallel.tp" if sp else "")
           + f" = {unit} (each cp rank takes 2 of {2 * p.cp} equal chunks"
           + (", split again over tp by sequence parallelism" if sp else "")
           + f"); e.g. train.seq_length={unit * max(1, round(seq / unit))}")


def validate(cfg: Config, world_size: int) -> tuple[RunSizes, list[str]]:
    """Check every cross-field rule; return the derived :class:`RunSizes` and warnings. Never mutates."""
    m, p, t, o, s = cfg.model, cfg.parallel, cfg.train, cfg.optim, cfg.schedule
    for dotted, choices in CHOICES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        _check(value in choices, f"{dotted}={value!r} is not one of: {', '.join(choices)}")
    _check_ranges(cfg)
    _check(p.zero in (0, 1, 2, 3), f"parallel.zero={p.zero} must be 0, 1, 2 or 3")
    _check(p.zero_shard_size is None or p.zero >= 1,
           f"parallel.zero_shard_size={p.zero_shard_size} shards the optimizer: it needs parallel.zero 1, 2 or 3")
    _check_kernels(m.kernels, o.impl, o.offload, t.device)

    model_parallel = p.tp * p.cp * p.pp
    named = f"parallel.tp={p.tp} × " + (f"parallel.cp={p.cp} × " if p.cp > 1 else "") + f"parallel.pp={p.pp}"
    _check(world_size % model_parallel == 0,
           f"{named} = {model_parallel} must divide the world size {world_size} (launch {model_parallel}·k "
           f"processes with torchrun, or pick tp×{'cp×' if p.cp > 1 else ''}pp from: {_divisors(world_size)})")
    dp = world_size // model_parallel
    _check(p.zero_shard_size is None or (dp * p.cp) % p.zero_shard_size == 0,
           f"parallel.zero_shard_size={p.zero_shard_size} must divide dp × cp = {dp * p.cp} "
           f"(valid: {_divisors(dp * p.cp)})")

    check_model(m, p.tp)
    kv, ffn = kv_heads(m), ffn_hidden_size(m)
    chunks = p.pp * p.vpp
    if p.pipeline_layers is None:
        _check(m.num_layers % chunks == 0,
               f"parallel.pp={p.pp} × parallel.vpp={p.vpp} = {chunks} must divide model.num_layers="
               f"{m.num_layers} (valid pp×vpp: {_divisors(m.num_layers)})")
    else:
        pl = p.pipeline_layers
        _check(len(pl) == chunks and all(isinstance(n, int) and n >= 1 for n in pl) and sum(pl) == m.num_layers,
               f"parallel.pipeline_layers={pl} must list {chunks} positive layer counts (pp × vpp) "
               f"summing to model.num_layers={m.num_layers}")
    _check(not (p.sequence_parallel and t.seq_length % p.tp),
           f"parallel.sequence_parallel needs parallel.tp={p.tp} to divide train.seq_length={t.seq_length}")
    _check_context_parallel(p, t.seq_length)
    _check(cfg.checkpoint.milestone_fraction <= 1,
           f"checkpoint.milestone_fraction={cfg.checkpoint.milestone_fraction} must be in [0, 1] (e.g. 0.1)")

    per_step = t.micro_batch_size * dp
    _check(t.global_batch_size % per_step == 0,
           f"train.global_batch_size={t.global_batch_size} must be a multiple of "
           f"train.micro_batch_size={t.micro_batch_size} × dp={dp} = {per_step} "
           f"(e.g. {per_step * max(1, round(t.global_batch_size / per_step))})")

    try:
        resolve_schedule(p.pp_schedule, p.pp, p.vpp, t.global_batch_size // per_step)
    except PipelineError as exc:
        raise ConfigError(str(exc)) from None
    _check_rampup(t, per_step, p)
    _check(t.train_tokens is None or t.iters == type(t).iters,
           f"set one of train.iters={t.iters} and train.train_tokens={t.train_tokens}: the other is derived")
    iters, train_samples = run_length(t)

    _check(len(cfg.data.split) == 3 and all(isinstance(x, (int, float)) and x >= 0 for x in cfg.data.split)
           and cfg.data.split[0] > 0,
           f"data.split={cfg.data.split} must be three non-negative weights [train, valid, test] "
           "with train > 0, e.g. [98, 2, 0]")

    _check(0 <= o.min_lr <= o.lr, f"optim.min_lr={o.min_lr} must be between 0 and optim.lr={o.lr}")
    _check(len(o.betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in o.betas),
           f"optim.betas={o.betas} must be two numbers in [0, 1), e.g. [0.9, 0.95]")
    _check(o.initial_loss_scale >= o.min_loss_scale,
           f"optim.initial_loss_scale={o.initial_loss_scale} must be ≥ optim.min_loss_scale={o.min_loss_scale} > 0")

    decay_iters = s.decay_iters if s.decay_iters is not None else iters
    _check(decay_iters >= s.warmup_iters,
           f"schedule.decay_iters={decay_iters} must be ≥ schedule.warmup_iters={s.warmup_iters}")
    _check(0 < s.wsd_decay_fraction <= 1,
           f"schedule.wsd_decay_fraction={s.wsd_decay_fraction} must be in (0, 1]")
    r = cfg.recovery
    _check(r.action in ("rollback", "alert", "none"),
           f"recovery.action={r.action!r} must be one of: rollback, alert, none"
           + (" (YAML reads off/on/yes/no as booleans)" if r.action in ("False", "True") else ""))

    warnings = []
    if s.warmup_iters > 0.05 * iters:
        warnings.append(f"schedule.warmup_iters={s.warmup_iters} is more than 5% of the run's {iters} steps")
    if s.decay != "constant" and decay_iters > iters and o.min_lr < o.lr:
        warnings.append(f"optim.min_lr={o.min_lr} is not reached: schedule.decay_iters={decay_iters} "
                        f"> the run's {iters} steps")

    tokens = t.global_batch_size * t.seq_length
    sizes = RunSizes(world_size=world_size, tp=p.tp, pp=p.pp, dp=dp,
                     grad_accum=t.global_batch_size // per_step, tokens_per_batch=tokens,
                     total_tokens=train_samples * t.seq_length, num_kv_heads=kv, ffn_hidden_size=ffn,
                     padded_vocab=padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, p.tp),
                     decay_iters=decay_iters, iters=iters, train_samples=train_samples,
                     rampup=tuple(t.rampup_batch_size) if t.rampup_batch_size else None, cp=p.cp)
    return sizes, warnings
