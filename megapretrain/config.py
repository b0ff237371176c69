"""Configuration: a tree of dataclasses, YAML files, dotted command-line overrides, one validator.

Precedence is defaults < YAML < command line. Every field has a one-line help text (``metadata``),
which ``--help`` prints. Values from YAML and from the command line go through the same coercion to
the field's declared type, so ``--train.iters 50`` and ``iters: 50`` mean the same thing.

User mistakes raise :class:`~megapretrain.errors.ConfigError` with one line that names the field,
the rule and the fix; the entry point prints it without a traceback. This module is plain data and
rules: it imports nothing else of the package but the error types.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from .errors import ConfigError, PipelineError


def _f(default: Any, help: str, *, name: str | None = None, factory: Any = None, min: float | None = None,
       positive: bool = False):
    """Declare a config field with its help text (and, for Python keywords, its YAML name). A number
    declares its range here: ``min`` (at least; 0 for non-negative) or ``positive``; null passes."""
    meta = {"help": help}
    if name is not None:
        meta["name"] = name
    if min is not None:
        meta["min"] = min
    if positive:
        meta["positive"] = True
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class RunConfig:
    dir: str = _f("runs/default", "Directory for everything the run writes; rerunning with it resumes.")
    name: str = _f("", "Free-form run name shown in logs (defaults to the directory name).")


@dataclass
class ModelConfig:
    num_layers: int = _f(2, "Number of transformer decoder layers.", min=1)
    hidden_size: int = _f(128, "Width of the residual stream.", min=1)
    num_heads: int = _f(4, "Attention (query) heads.", min=1)
    num_kv_heads: Optional[int] = _f(None, "Key/value heads for grouped-query attention (null: num_heads).", min=1)
    ffn_hidden_size: Optional[int] = _f(None, "SwiGLU inner width (null: 8/3·hidden rounded up to 256).", min=1)
    mlp: str = _f("swiglu", "MLP: swiglu (Llama, the trainer's) | gelu (GPT-3 style; the planner only).")
    vocab_size: Optional[int] = _f(None, "Vocabulary size before padding (null: the tokenizer's).", min=1)
    make_vocab_size_divisible_by: int = _f(128, "Pad the vocabulary to a multiple of this × parallel.tp.", min=1)
    rope_theta: float = _f(10000.0, "Rotary embedding base.", positive=True)
    rope_scaling: Optional[dict] = _f(None, "Rotary frequency scaling (null: none), as Hugging Face writes it; "
                                      "Llama 3.1's: {rope_type: llama3, factor: 8, low_freq_factor: 1, "
                                      "high_freq_factor: 4, original_max_position_embeddings: 8192}.")
    norm_eps: float = _f(1e-5, "RMSNorm epsilon.", positive=True)
    tie_embeddings: bool = _f(False, "Share the input embedding with the output layer.")
    init_std: float = _f(0.02, "Std of the normal init; output projections use init_std/sqrt(2·num_layers).",
                         positive=True)
    attention_dropout: float = _f(0.0, "Dropout on attention probabilities.")
    hidden_dropout: float = _f(0.0, "Dropout on attention and MLP outputs before the residual add.")
    kernels: str = _f("auto", "Fused kernels: auto (Triton on CUDA, torch on CPU) | triton | torch (see kernels/).")
    z_loss: float = _f(0.0, "Weight of the z-loss z·logsumexp² added to each token's loss (0: none).", min=0)


@dataclass
class ParallelConfig:
    tp: int = _f(1, "Tensor-parallel size (ranks that split each layer).", min=1)
    pp: int = _f(1, "Pipeline-parallel size (stages that split the layers).", min=1)
    vpp: int = _f(1, "Virtual pipeline chunks per stage (interleaved 1F1B when > 1).", min=1)
    cp: int = _f(1, "Context-parallel size: ranks that split each sequence (attention all-gathers K/V over them).",
                 min=1)
    pp_schedule: str = _f("auto", "Pipeline schedule: auto | none | gpipe | 1f1b | interleaved "
                          "(auto: 1f1b, interleaved when vpp > 1).")
    pipeline_layers: Optional[list] = _f(None, "Layers per model chunk (pp×vpp counts, in chunk order; "
                                         "null: even split).")
    pp_trace: bool = _f(False, "Record each stage's forward/backward order and in-flight peak "
                        "(RUN_DIR/pipeline_trace_rankN.jsonl).")
    sequence_parallel: bool = _f(False, "Shard norms/residual activations along the sequence across tp.")
    zero: int = _f(0, "Sharding over dp: 0 replicated, 1 optimizer state, 2 also gradients, 3 also parameters "
                   "(gathered one decoder layer at a time).")
    zero3_keep_gathered: bool = _f(False, "zero 3: keep each layer gathered from its first use to the step's last "
                                   "backward (no re-gather for backward or between micro-batches; costs the "
                                   "stage's full parameters).")
    zero3_prefetch: bool = _f(True, "zero 3: start gathering the next layer while the current one computes.")
    zero_shard_size: Optional[int] = _f(None, "Hybrid sharding: shard over groups of this many dp × cp ranks "
                                        "(e.g. a node's) and replicate across the groups (null: shard over all "
                                        "of dp × cp).", min=1)
    recompute: str = _f("none", "Activation recomputation: none | selective | full.")
    bucket_size_mb: float = _f(32.0, "Gradient bucket size for the data-parallel reduction (MB; 0: one bucket).",
                               min=0)
    backend: str = _f("auto", "torch.distributed backend: auto (nccl on CUDA, gloo on CPU) | nccl | gloo.")
    comm_stats: bool = _f(False, "Count bytes and calls per collective each step (debugging).")


@dataclass
class TokenizerConfig:
    type: str = _f("ByteTokenizer", "ByteTokenizer | HuggingFaceTokenizer | GPT2BPETokenizer | "
                   "SentencePieceTokenizer | TikTokenizer.")
    model: Optional[str] = _f(None, "Tokenizer file or directory (see the README); ByteTokenizer needs none.")


@dataclass
class DataConfig:
    paths: list = _f(None, "Dataset prefixes from tools/preprocess_data.py, optionally weighted: "
                     "[0.3, prefixA, 0.7, prefixB].", factory=list)
    split: list = _f(None, "Train/valid/test weights over each dataset's documents.",
                     factory=lambda: [98.0, 2.0, 0.0])
    tokenizer: TokenizerConfig = _f(None, "Tokenizer (must match the one used for preprocessing).",
                                    factory=TokenizerConfig)
    cache_dir: Optional[str] = _f(None, "Where sample indices are cached (null: RUN_DIR/data_cache).")
    reset_attention_mask: bool = _f(False, "Document masking: a token attends only to earlier tokens of its own "
                                    "document inside a packed sample (Megatron's --reset-attention-mask).")
    reset_position_ids: bool = _f(False, "Rotary positions restart at each document of a packed sample.")
    eod_mask_loss: bool = _f(False, "Leave the end-of-document targets out of the loss (and of its mean).")


@dataclass
class TrainConfig:
    seq_length: int = _f(256, "Tokens per sample.", min=1)
    micro_batch_size: int = _f(4, "Samples per forward/backward on one data-parallel rank.", min=1)
    global_batch_size: int = _f(16, "Samples per optimizer step over all ranks (micro × dp × accumulation).", min=1)
    iters: int = _f(100, "Optimizer steps to train for (derived instead when train.train_tokens is set).", min=1)
    train_tokens: Optional[int] = _f(None, "Train for this many tokens instead of train.iters (set one of the "
                                     "two; the steps are derived, batch-size ramp-up included).", min=1)
    rampup_batch_size: Optional[list] = _f(None, "Batch-size ramp-up [start, increment, ramp_samples]: the global "
                                           "batch grows from start by increment until ramp_samples samples are "
                                           "consumed (Megatron's --rampup-batch-size).")
    seed: int = _f(1234, "Seed of initialization, data order and dropout.", min=0)
    precision: str = _f("fp32", "fp32 | bf16 | fp16 (bf16/fp16 keep fp32 master weights).")
    eval_interval: int = _f(100, "Evaluate on the valid split every this many iterations (0: never).", min=0)
    eval_iters: int = _f(10, "Global batches per evaluation.", min=1)
    device: str = _f("auto", "auto (cuda when available) | cpu | cuda.")
    threads: int = _f(0, "CPU threads per rank (0: the cores divided by the ranks on this node).", min=0)
    compile: bool = _f(False, "torch.compile each decoder layer (regional: compile time independent of depth).")


@dataclass
class OptimConfig:
    lr: float = _f(3e-4, "Peak learning rate.", positive=True)
    min_lr: float = _f(3e-5, "Learning rate at the end of the decay.")
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay (not applied to norms and biases).", min=0)
    betas: list = _f(None, "AdamW betas [beta1, beta2].", factory=lambda: [0.9, 0.95])
    eps: float = _f(1e-8, "AdamW epsilon.", positive=True)
    clip_grad: float = _f(1.0, "Clip the global gradient norm to this (0: no clipping).", min=0)
    offload: bool = _f(False, "Keep fp32 master weights and Adam moments in host memory and step them there.")
    initial_loss_scale: float = _f(2.0 ** 16, "fp16 only: starting dynamic loss scale.", positive=True)
    loss_scale_window: int = _f(1000, "fp16 only: clean steps before the loss scale doubles.", min=1)
    min_loss_scale: float = _f(1.0, "fp16 only: the scale never drops below this.", positive=True)
    impl: str = _f("auto", "AdamW implementation: auto (triton on CUDA, torch elsewhere) | triton | torch | apex.")


@dataclass
class ScheduleConfig:
    warmup_iters: int = _f(0, "Linear warmup steps from 0 to optim.lr.", min=0)
    decay: str = _f("cosine", "cosine | linear | wsd | constant.")
    decay_iters: Optional[int] = _f(None, "Step at which the decay reaches optim.min_lr (null: train.iters).", min=1)
    wsd_decay_fraction: float = _f(0.2, "wsd only: fraction of decay_iters spent in the final decay.")


@dataclass
class CheckpointConfig:
    interval: int = _f(1000, "Save every this many iterations (and at the end; 0: only at the end).", min=0)
    interval_minutes: float = _f(0.0, "Also save when this many minutes passed since the last save (0: off).", min=0)
    keep_last: int = _f(3, "Keep this many most recent checkpoints (0: keep all).", min=0)
    keep_every: int = _f(0, "Also keep every checkpoint whose iteration is a multiple of this (0: none).", min=0)
    async_save: bool = _f(False, "Write checkpoints in the background.", name="async")
    load: Optional[str] = _f(None, "Checkpoint directory to start from when run.dir has none.")
    milestone_fraction: float = _f(0.0, "Also keep the checkpoint at (or just before) every this fraction of "
                                   "train.iters, e.g. 0.1: every 10% of the run (0: none).", min=0)
    load_optimizer: bool = _f(True, "Load the optimizer state (Adam moments and step, loss scale) with the weights.")
    load_rng: bool = _f(True, "Load the random-number states (dropout streams) with the weights.")
    finetune: bool = _f(False, "Start a new run from checkpoint.load's weights: fresh optimizer, schedule "
                        "and data position (continued pretraining); the run's own checkpoints resume as usual.")


@dataclass
class LoggingConfig:
    interval: int = _f(1, "Log every this many iterations.", min=1)
    tensorboard: bool = _f(True, "Write TensorBoard scalars to RUN_DIR/tensorboard.")
    wandb: bool = _f(False, "Also log to Weights & Biases (needs the wandb extra).")
    peak_tflops: Optional[float] = _f(None, "Device peak TFLOP/s for MFU (null: known GPUs only).", positive=True)


@dataclass
class RecoveryConfig:
    action: str = _f("rollback", "On a loss spike or a run of non-finite steps: rollback (reload the newest "
                     "checkpoint from before it and skip the data that led to it), alert (report and go on) or none.")
    spike_zscore: float = _f(6.0, "A step's loss is a spike when it exceeds the mean of the previous "
                             "recovery.window losses by this many standard deviations.", positive=True)
    window: int = _f(50, "Steps of loss history the spike test compares with (no test until it is full).", min=2)
    min_std_fraction: float = _f(0.01, "Floor of that standard deviation, as a fraction of the mean loss.", min=0)
    max_bad_steps: int = _f(3, "Consecutive non-finite steps (NaN/Inf loss, or grad norm outside fp16) "
                            "that trigger the action.", min=1)
    skip_batches: int = _f(0, "After a rollback, also skip this many global batches past the offending ones.", min=0)
    max_rollbacks: int = _f(5, "Stop with an error after this many rollbacks in one run.", min=1)
    alert_command: Optional[str] = _f(None, "Shell command rank 0 runs for every alert (the alert as JSON "
                                      "in $MEGAPRETRAIN_ALERT), e.g. a curl to a chat webhook.")
    spike_ratio: float = _f(3.0, "Also a spike: a loss above this many times the mean of the previous "
                            "recovery.window losses (either test triggers).", positive=True)
    grad_norm_rollback: float = _f(100.0, "A gradient explosion: the grad norm (before clipping) above this for "
                                   "recovery.max_bad_steps steps in a row is treated like a spike.", positive=True)
    lr_factor: float = _f(0.5, "Each rollback multiplies the learning rate by this from the restored iteration "
                          "on (compounding; saved in checkpoints).", positive=True)
    prune_rolled_back: bool = _f(True, "Retention also prunes set-aside (rolled-back) checkpoints, keeping the "
                                 "newest checkpoint.keep_last of them (false: keep them all).")


@dataclass
class AlertsConfig:
    grad_norm_max: float = _f(10.0, "Alert when the grad norm (before clipping) exceeds this.", positive=True)
    loss_ratio: float = _f(2.0, "Alert when the loss exceeds this many times its rolling average.", positive=True)
    window: int = _f(100, "Steps of the rolling averages (loss, throughput).", min=2)
    throughput_drop: float = _f(0.2, "Alert when tokens/s falls this fraction below its rolling median.",
                                positive=True)
    data_wait_s: float = _f(1.0, "Alert when a step waits longer than this for its data (seconds).", positive=True)
    straggler_ratio: float = _f(1.2, "Name a rank whose step time exceeds the median rank's by this factor "
                                "(checked every logging interval).", positive=True)


@dataclass
class WatchdogConfig:
    timeout_s: Optional[float] = _f(None, "An iteration longer than this is a hang: every thread's stack goes "
                                    "to RUN_DIR/hang/rankN.txt and the rank exits with status 5 (null: "
                                    "watchdog.multiple × the rolling step time, at least watchdog.floor_s; 0: off).",
                                    min=0)
    multiple: float = _f(10.0, "With timeout_s null: the limit as a multiple of the rolling step time.", positive=True)
    floor_s: float = _f(300.0, "With timeout_s null: the limit is never below this (seconds).", positive=True)
    startup_s: float = _f(1800.0, "The allowance for the first steps, evaluations and checkpoint saves (seconds).",
                          positive=True)
    collective_timeout_s: float = _f(1800.0, "The process group's timeout: a collective that never completes "
                                     "ends in an error after this long (seconds).", positive=True)


@dataclass
class FaultsConfig:
    nan_at: Optional[int] = _f(None, "Fault drill: NaN in the grads at this iteration.", min=1)
    spike_at: Optional[int] = _f(None, "Fault drill: a loss spike (a corrupted batch) at this iteration.", min=1)
    exit_at: Optional[int] = _f(None, "Fault drill: the rank exits (status 1) at this iteration.", min=1)
    hang_at: Optional[int] = _f(None, "Fault drill: the rank blocks forever at this iteration.", min=1)
    slow_data_at: Optional[int] = _f(None, "Fault drill: the data wait at this iteration is faults.slow_data_s.",
                                     min=1)
    slow_data_s: float = _f(2.0, "Fault drill: the length of that data wait (seconds).", min=0)
    oom_at: Optional[int] = _f(None, "Fault drill: an out-of-memory error at this iteration.", min=1)
    rank: int = _f(-1, "The global rank the faults apply to (-1: every rank).", min=-1)


@dataclass
class Config:
    run: RunConfig = _f(None, "Run directory and name.", factory=RunConfig)
    model: ModelConfig = _f(None, "Model architecture.", factory=ModelConfig)
    parallel: ParallelConfig = _f(None, "Parallel layout.", factory=ParallelConfig)
    data: DataConfig = _f(None, "Datasets and tokenizer.", factory=DataConfig)
    train: TrainConfig = _f(None, "Batch sizes, length, precision.", factory=TrainConfig)
    optim: OptimConfig = _f(None, "Optimizer.", factory=OptimConfig)
    schedule: ScheduleConfig = _f(None, "Learning-rate schedule.", factory=ScheduleConfig)
    checkpoint: CheckpointConfig = _f(None, "Checkpointing.", factory=CheckpointConfig)
    logging: LoggingConfig = _f(None, "Logging and metrics.", factory=LoggingConfig)
    recovery: RecoveryConfig = _f(None, "Loss-spike and NaN detection, alerts and rollback.", factory=RecoveryConfig)
    alerts: AlertsConfig = _f(None, "Thresholds of the run's alerts.", factory=AlertsConfig)
    watchdog: WatchdogConfig = _f(None, "Hang detection.", factory=WatchdogConfig)
    faults: FaultsConfig = _f(None, "Fault injection for tests and drills (all off by default).", factory=FaultsConfig)


# ----------------------------------------------------------------------------------------------
# Loading: dict -> dataclasses with coercion, YAML, overrides


def _key(f: dataclasses.Field) -> str:
    return f.metadata.get("name", f.name)


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {_key(f): f for f in dataclasses.fields(cls)}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert ``value`` to the annotated type ``tp`` or raise a ConfigError naming ``where``."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _coerce(value, inner, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a section (mapping), got {value!r}")
        return _from_dict(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not (isinstance(value, int) or
                                           (isinstance(value, float) and value.is_integer())):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(value)
    if tp is float:
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads "3e-4" as a string
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if isinstance(value, (dict, list)) or value is None:
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    if tp is list or origin is list:
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list like [a, b], got {value!r}")
        return value
    return value


def _from_dict(cls, data: dict, where: str = ""):
    """Build dataclass ``cls`` from a (partial) mapping; unknown keys are rejected."""
    fields = _fields(cls)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            prefix = f"{where}." if where else ""
            hint = f"did you mean '{prefix}{close[0]}'?" if close else f"valid keys: {', '.join(fields)}"
            raise ConfigError(f"unknown config key '{path}': {hint}")
        f = fields[key]
        kwargs[f.name] = _coerce(value, hints[f.name], path)
    return cls(**kwargs)


def to_dict(obj) -> dict:
    """The config as a plain nested dict, using YAML key names (``checkpoint.async``)."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out[_key(f)] = to_dict(value) if dataclasses.is_dataclass(value) else value
    return out


def _all_paths(cls, where: str = "") -> list[str]:
    paths = []
    hints = typing.get_type_hints(cls)
    for key, f in _fields(cls).items():
        path = f"{where}.{key}" if where else key
        if dataclasses.is_dataclass(hints[f.name]):
            paths += _all_paths(hints[f.name], path)
        else:
            paths.append(path)
    return paths


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Write ``value`` at ``a.b.c`` in a nested dict, checking the path exists in the schema."""
    valid = _all_paths(Config)
    if dotted not in valid:
        close = difflib.get_close_matches(dotted, valid, n=1, cutoff=0.6)
        hint = f"did you mean '--{close[0]}'?" if close else "run with --help to list the options"
        raise ConfigError(f"unknown option '--{dotted}': {hint}")
    node = tree
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"'{p}' in the config file is not a section")
    node[leaf] = value


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """Parse ``--a.b VALUE`` / ``--a.b=VALUE`` pairs; values are read as YAML."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}': overrides look like --train.iters 50")
        name = arg[2:]
        if "=" in name:
            name, raw = name.split("=", 1)
            i += 1
        elif i + 1 < len(args):
            raw = args[i + 1]
            i += 2
        else:
            raise ConfigError(f"option '{arg}' needs a value, e.g. {arg} 10")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        pairs.append((name, value))
    return pairs


def load_config(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults < YAML file at ``path`` < dotted ``overrides``; returns the (unvalidated) Config."""
    tree: dict = {}
    if path is not None:
        try:
            with open(path) as fh:
                tree = yaml.safe_load(fh) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file '{path}' not found (see configs/ for examples)") from None
        except OSError as exc:  # a directory, no permission, ...
            raise ConfigError(f"config file '{path}' cannot be read ({exc.strerror}); --config takes a YAML file "
                              "(see configs/)") from None
        except yaml.YAMLError as exc:
            line = getattr(getattr(exc, "problem_mark", None), "line", None)
            at = f" at line {line + 1}" if line is not None else ""
            raise ConfigError(f"config file '{path}' is not valid YAML{at}: {exc.problem}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file '{path}' must be a mapping of sections (run:, model:, ...)")
    for name, value in parse_overrides(overrides or []):
        _set_dotted(tree, name, value)
    return _from_dict(Config, tree)


def save_config(cfg: Config, path: str) -> None:
    with open(path, "w") as fh:
        yaml.safe_dump(to_dict(cfg), fh, sort_keys=False)


def help_text() -> str:
    """One line per field: dotted name, default and help, grouped by section."""
    lines = []
    for section, sf in _fields(Config).items():
        lines.append(f"\n{section}: {sf.metadata['help']}")
        lines += _help_lines(typing.get_type_hints(Config)[sf.name], section)
    return "\n".join(lines)


def _help_lines(cls, where: str) -> list[str]:
    lines, obj, hints = [], cls(), typing.get_type_hints(cls)
    for key, f in _fields(cls).items():
        if dataclasses.is_dataclass(hints[f.name]):
            lines += _help_lines(hints[f.name], f"{where}.{key}")
        else:
            lines.append(f"  --{where}.{key:<28} {getattr(obj, f.name)!s:<14} {f.metadata['help']}")
    return lines


# ----------------------------------------------------------------------------------------------
# Derived sizes and validation


def default_ffn_hidden_size(hidden_size: int) -> int:
    """Llama's rule: 2/3 of 4·hidden, rounded up to a multiple of 256."""
    return 256 * math.ceil(int(8 * hidden_size / 3) / 256)


def kv_heads(m: ModelConfig) -> int:
    """``model.num_kv_heads`` resolved (null: multi-head attention)."""
    return m.num_heads if m.num_kv_heads is None else m.num_kv_heads


def ffn_hidden_size(m: ModelConfig) -> int:
    """``model.ffn_hidden_size`` resolved (null: Llama's rule)."""
    return default_ffn_hidden_size(m.hidden_size) if m.ffn_hidden_size is None else m.ffn_hidden_size


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Round the vocabulary up so every tp rank holds an equal, aligned slice of it."""
    multiple = divisible_by * tp
    return multiple * math.ceil(vocab_size / multiple)


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
        value, path = getattr(node, f.name), f"{where}.{_key(f)}" if where else _key(f)
        if dataclasses.is_dataclass(value):
            _check_ranges(value, path)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            null = " (or null for the default)" if typing.get_origin(hints[f.name]) is typing.Union else ""
            low = f.metadata.get("min")
            _check(low is None or value >= low,
                   f"{path}={value} must be " + ("non-negative" if low == 0 else f"at least {low}") + null)
            _check(not f.metadata.get("positive") or value > 0, f"{path}={value} must be positive{null}")


ROPE_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_rope_scaling(rs: Any, where: str) -> None:
    """Rotary scaling the model implements: null, or Llama 3.1's ``llama3`` with its four numbers."""
    if rs is None:
        return
    kind = rs.get("rope_type", rs.get("type")) if isinstance(rs, dict) else None
    _check(kind in ("llama3", "default"), f"{where}={rs!r}: only rope_type llama3 (Llama 3.1+) is supported; "
                                          "other variants would not compute the same function")
    if kind == "default":
        return
    missing = [k for k in ROPE_LLAMA3_KEYS if not isinstance(rs.get(k), (int, float)) or rs[k] <= 0]
    _check(not missing, f"{where}: rope_type llama3 needs positive numbers {', '.join(missing)}")
    _check(rs["low_freq_factor"] < rs["high_freq_factor"],
           f"{where}: low_freq_factor={rs['low_freq_factor']} must be below high_freq_factor={rs['high_freq_factor']}")


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
    _check(m.mlp == "swiglu", "model.mlp=gelu: the trainer implements swiglu only so far; the planner models gelu")
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

    kv = kv_heads(m)
    _check(m.hidden_size % m.num_heads == 0,
           f"model.num_heads={m.num_heads} must divide model.hidden_size={m.hidden_size} "
           f"(valid: {_divisors(m.hidden_size)})")
    _check((m.hidden_size // m.num_heads) % 2 == 0,
           f"head size hidden_size/num_heads={m.hidden_size // m.num_heads} must be even for RoPE")
    _check(m.num_heads % kv == 0,
           f"model.num_kv_heads={kv} must divide model.num_heads={m.num_heads} "
           f"(valid: {_divisors(m.num_heads)})")
    _check(m.num_heads % p.tp == 0,
           f"parallel.tp={p.tp} must divide model.num_heads={m.num_heads} (valid: {_divisors(m.num_heads)})")
    _check(kv % p.tp == 0,
           f"parallel.tp={p.tp} must divide model.num_kv_heads={kv} (valid: {_divisors(kv)})")
    ffn = ffn_hidden_size(m)
    _check(ffn % p.tp == 0, f"parallel.tp={p.tp} must divide model.ffn_hidden_size={ffn} "
                            f"(valid: {_divisors(ffn)})")
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
    _check(m.vocab_size is not None and m.vocab_size >= 1,
           "model.vocab_size is unset: set it, or set data.tokenizer so it can be read from the tokenizer")
    for name in ("attention_dropout", "hidden_dropout"):
        _check(0 <= getattr(m, name) < 1, f"model.{name}={getattr(m, name)} must be in [0, 1)")
    check_rope_scaling(m.rope_scaling, "model.rope_scaling")
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
    _check(t.train_tokens is None or t.iters == TrainConfig.iters,
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
