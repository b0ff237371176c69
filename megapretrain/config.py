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
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from .errors import ConfigError, PipelineError


def _f(default: Any, help: str, *, name: str | None = None, factory: Any = None):
    """Declare a config field with its help text (and, for Python keywords, its YAML name)."""
    meta = {"help": help}
    if name is not None:
        meta["name"] = name
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class RunConfig:
    dir: str = _f("runs/default", "Directory for everything the run writes; rerunning with it resumes.")
    name: str = _f("", "Free-form run name shown in logs (defaults to the directory name).")


@dataclass
class ModelConfig:
    num_layers: int = _f(2, "Number of transformer decoder layers.")
    hidden_size: int = _f(128, "Width of the residual stream.")
    num_heads: int = _f(4, "Attention (query) heads.")
    num_kv_heads: Optional[int] = _f(None, "Key/value heads for grouped-query attention (null: num_heads).")
    ffn_hidden_size: Optional[int] = _f(None, "SwiGLU inner width (null: 8/3·hidden rounded up to 256).")
    vocab_size: Optional[int] = _f(None, "Vocabulary size before padding (null: the tokenizer's).")
    make_vocab_size_divisible_by: int = _f(128, "Pad the vocabulary to a multiple of this × parallel.tp.")
    rope_theta: float = _f(10000.0, "Rotary embedding base.")
    norm_eps: float = _f(1e-5, "RMSNorm epsilon.")
    tie_embeddings: bool = _f(False, "Share the input embedding with the output layer.")
    init_std: float = _f(0.02, "Std of the normal init; output projections use init_std/sqrt(2·num_layers).")
    attention_dropout: float = _f(0.0, "Dropout on attention probabilities.")
    hidden_dropout: float = _f(0.0, "Dropout on attention and MLP outputs before the residual add.")


@dataclass
class ParallelConfig:
    tp: int = _f(1, "Tensor-parallel size (ranks that split each layer).")
    pp: int = _f(1, "Pipeline-parallel size (stages that split the layers).")
    vpp: int = _f(1, "Virtual pipeline chunks per stage (interleaved 1F1B when > 1).")
    pp_schedule: str = _f("auto", "Pipeline schedule: auto | none | gpipe | 1f1b | interleaved "
                          "(auto: 1f1b, interleaved when vpp > 1).")
    pipeline_layers: Optional[list] = _f(None, "Layers per model chunk (pp×vpp counts, in chunk order; "
                                         "null: even split).")
    pp_trace: bool = _f(False, "Record each stage's forward/backward order and in-flight peak "
                        "(RUN_DIR/pipeline_trace_rankN.jsonl).")
    sequence_parallel: bool = _f(False, "Shard norms/residual activations along the sequence across tp.")
    zero: int = _f(0, "Optimizer sharding over dp: 0 replicated, 1 optimizer state, 2 also gradients.")
    recompute: str = _f("none", "Activation recomputation: none | selective | full.")
    bucket_size_mb: float = _f(32.0, "Gradient bucket size for the data-parallel reduction (MB).")
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


@dataclass
class TrainConfig:
    seq_length: int = _f(256, "Tokens per sample.")
    micro_batch_size: int = _f(4, "Samples per forward/backward on one data-parallel rank.")
    global_batch_size: int = _f(16, "Samples per optimizer step over all ranks (micro × dp × accumulation).")
    iters: int = _f(100, "Optimizer steps to train for.")
    seed: int = _f(1234, "Seed of initialization, data order and dropout.")
    precision: str = _f("fp32", "fp32 | bf16 | fp16 (bf16/fp16 keep fp32 master weights).")
    eval_interval: int = _f(100, "Evaluate on the valid split every this many iterations (0: never).")
    eval_iters: int = _f(10, "Global batches per evaluation.")
    device: str = _f("auto", "auto (cuda when available) | cpu | cuda.")
    threads: int = _f(0, "CPU threads per rank (0: the cores divided by the ranks on this node).")


@dataclass
class OptimConfig:
    lr: float = _f(3e-4, "Peak learning rate.")
    min_lr: float = _f(3e-5, "Learning rate at the end of the decay.")
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay (not applied to norms and biases).")
    betas: list = _f(None, "AdamW betas [beta1, beta2].", factory=lambda: [0.9, 0.95])
    eps: float = _f(1e-8, "AdamW epsilon.")
    clip_grad: float = _f(1.0, "Clip the global gradient norm to this (0: no clipping).")
    offload: bool = _f(False, "Keep fp32 master weights and Adam moments in host memory and step them there.")
    initial_loss_scale: float = _f(2.0 ** 16, "fp16 only: starting dynamic loss scale.")
    loss_scale_window: int = _f(1000, "fp16 only: clean steps before the loss scale doubles.")
    min_loss_scale: float = _f(1.0, "fp16 only: the scale never drops below this.")


@dataclass
class ScheduleConfig:
    warmup_iters: int = _f(0, "Linear warmup steps from 0 to optim.lr.")
    decay: str = _f("cosine", "cosine | linear | wsd | constant.")
    decay_iters: Optional[int] = _f(None, "Step at which the decay reaches optim.min_lr (null: train.iters).")
    wsd_decay_fraction: float = _f(0.2, "wsd only: fraction of decay_iters spent in the final decay.")


@dataclass
class CheckpointConfig:
    interval: int = _f(1000, "Save every this many iterations (and at the end; 0: only at the end).")
    interval_minutes: float = _f(0.0, "Also save when this many minutes passed since the last save (0: off).")
    keep_last: int = _f(3, "Keep this many most recent checkpoints (0: keep all).")
    keep_every: int = _f(0, "Also keep every checkpoint whose iteration is a multiple of this (0: none).")
    async_save: bool = _f(False, "Write checkpoints in the background.", name="async")
    load: Optional[str] = _f(None, "Checkpoint directory to start from when run.dir has none.")


@dataclass
class LoggingConfig:
    interval: int = _f(1, "Log every this many iterations.")
    tensorboard: bool = _f(True, "Write TensorBoard scalars to RUN_DIR/tensorboard.")
    wandb: bool = _f(False, "Also log to Weights & Biases (needs the wandb extra).")
    peak_tflops: Optional[float] = _f(None, "Device peak TFLOP/s for MFU (null: known GPUs only).")


@dataclass
class RecoveryConfig:
    action: str = _f("rollback", "On a loss spike or a run of non-finite steps: rollback (reload the newest "
                     "checkpoint from before it and skip the data that led to it), alert (report and go on) or none.")
    spike_zscore: float = _f(6.0, "A step's loss is a spike when it exceeds the mean of the previous "
                             "recovery.window losses by this many standard deviations.")
    window: int = _f(50, "Steps of loss history the spike test compares with (no test until it is full).")
    min_std_fraction: float = _f(0.01, "Floor of that standard deviation, as a fraction of the mean loss.")
    max_bad_steps: int = _f(3, "Consecutive non-finite steps (NaN/Inf loss, or grad norm outside fp16) "
                            "that trigger the action.")
    skip_batches: int = _f(0, "After a rollback, also skip this many global batches past the offending ones.")
    max_rollbacks: int = _f(5, "Stop with an error after this many rollbacks in one run.")
    alert_command: Optional[str] = _f(None, "Shell command rank 0 runs for every alert (the alert as JSON "
                                      "in $MEGAPRETRAIN_ALERT), e.g. a curl to a chat webhook.")


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

    def describe(self, num_params: int | None = None, flops_per_token: float | None = None) -> str:
        parts = [f"world={self.world_size} (tp={self.tp} pp={self.pp} dp={self.dp})",
                 f"grad_accum={self.grad_accum}",
                 f"tokens/step={self.tokens_per_batch:,}",
                 f"total_tokens={self.total_tokens:,}",
                 f"vocab(padded)={self.padded_vocab:,}"]
        if num_params is not None:
            parts.append(f"params={num_params:,}")
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
    "parallel.backend": ("auto", "nccl", "gloo"),
    "train.device": ("auto", "cpu", "cuda"),
}


def validate(cfg: Config, world_size: int) -> tuple[RunSizes, list[str]]:
    """Check every cross-field rule; return the derived :class:`RunSizes` and warnings. Never mutates."""
    m, p, t, o, s = cfg.model, cfg.parallel, cfg.train, cfg.optim, cfg.schedule
    for dotted, choices in CHOICES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        _check(value in choices, f"{dotted}={value!r} is not one of: {', '.join(choices)}")
    for dotted in ("model.num_layers", "model.hidden_size", "model.num_heads", "parallel.tp",
                   "parallel.pp", "parallel.vpp", "train.seq_length", "train.micro_batch_size",
                   "train.global_batch_size", "train.iters", "train.eval_iters",
                   "logging.interval", "model.make_vocab_size_divisible_by"):
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        _check(value >= 1, f"{dotted}={value} must be at least 1")
    _check(p.zero in (0, 1, 2), f"parallel.zero={p.zero} must be 0, 1 or 2")

    _check(world_size % (p.tp * p.pp) == 0,
           f"parallel.tp={p.tp} × parallel.pp={p.pp} = {p.tp * p.pp} must divide the world size "
           f"{world_size} (launch {p.tp * p.pp}·k processes with torchrun, or pick tp×pp from: "
           f"{_divisors(world_size)})")
    dp = world_size // (p.tp * p.pp)

    for name in ("num_kv_heads", "ffn_hidden_size"):
        value = getattr(m, name)
        _check(value is None or value >= 1, f"model.{name}={value} must be at least 1 (or null for the default)")
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
    _check(m.vocab_size is not None and m.vocab_size >= 1,
           "model.vocab_size is unset: set it, or set data.tokenizer so it can be read from the tokenizer")
    for name in ("norm_eps", "init_std", "rope_theta"):
        _check(getattr(m, name) > 0, f"model.{name}={getattr(m, name)} must be positive")
    for name in ("attention_dropout", "hidden_dropout"):
        _check(0 <= getattr(m, name) < 1, f"model.{name}={getattr(m, name)} must be in [0, 1)")

    per_step = t.micro_batch_size * dp
    _check(t.global_batch_size % per_step == 0,
           f"train.global_batch_size={t.global_batch_size} must be a multiple of "
           f"train.micro_batch_size={t.micro_batch_size} × dp={dp} = {per_step} "
           f"(e.g. {per_step * max(1, round(t.global_batch_size / per_step))})")

    try:
        resolve_schedule(p.pp_schedule, p.pp, p.vpp, t.global_batch_size // per_step)
    except PipelineError as exc:
        raise ConfigError(str(exc)) from None

    _check(len(cfg.data.split) == 3 and all(isinstance(x, (int, float)) and x >= 0 for x in cfg.data.split)
           and cfg.data.split[0] > 0,
           f"data.split={cfg.data.split} must be three non-negative weights [train, valid, test] "
           "with train > 0, e.g. [98, 2, 0]")

    _check(o.lr > 0, f"optim.lr={o.lr} must be positive")
    _check(0 <= o.min_lr <= o.lr, f"optim.min_lr={o.min_lr} must be between 0 and optim.lr={o.lr}")
    _check(len(o.betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in o.betas),
           f"optim.betas={o.betas} must be two numbers in [0, 1), e.g. [0.9, 0.95]")
    _check(o.eps > 0, f"optim.eps={o.eps} must be positive")
    _check(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay} must be non-negative")
    _check(o.clip_grad >= 0, f"optim.clip_grad={o.clip_grad} must be non-negative (0 disables clipping)")
    _check(o.initial_loss_scale >= o.min_loss_scale > 0,
           f"optim.initial_loss_scale={o.initial_loss_scale} must be ≥ optim.min_loss_scale={o.min_loss_scale} > 0")

    decay_iters = s.decay_iters if s.decay_iters is not None else t.iters
    _check(s.warmup_iters >= 0, f"schedule.warmup_iters={s.warmup_iters} must be non-negative")
    _check(decay_iters >= s.warmup_iters,
           f"schedule.decay_iters={decay_iters} must be ≥ schedule.warmup_iters={s.warmup_iters}")
    _check(0 < s.wsd_decay_fraction <= 1,
           f"schedule.wsd_decay_fraction={s.wsd_decay_fraction} must be in (0, 1]")
    c = cfg.checkpoint
    for name in ("interval", "keep_last", "keep_every"):
        _check(getattr(c, name) >= 0, f"checkpoint.{name}={getattr(c, name)} must be non-negative")
    _check(c.interval_minutes >= 0, f"checkpoint.interval_minutes={c.interval_minutes} must be non-negative")
    _check(t.eval_interval >= 0, f"train.eval_interval={t.eval_interval} must be non-negative")
    r = cfg.recovery
    _check(r.action in ("rollback", "alert", "none"),
           f"recovery.action={r.action!r} must be one of: rollback, alert, none"
           + (" (YAML reads off/on/yes/no as booleans)" if r.action in ("False", "True") else ""))
    _check(r.spike_zscore > 0, f"recovery.spike_zscore={r.spike_zscore} must be positive")
    _check(r.window >= 2, f"recovery.window={r.window} must be at least 2")
    _check(r.min_std_fraction >= 0, f"recovery.min_std_fraction={r.min_std_fraction} must be non-negative")
    for name in ("max_bad_steps", "max_rollbacks"):
        _check(getattr(r, name) >= 1, f"recovery.{name}={getattr(r, name)} must be at least 1")
    _check(r.skip_batches >= 0, f"recovery.skip_batches={r.skip_batches} must be non-negative")

    warnings = []
    if s.warmup_iters > 0.05 * t.iters:
        warnings.append(f"schedule.warmup_iters={s.warmup_iters} is more than 5% of train.iters={t.iters}")
    if s.decay != "constant" and decay_iters > t.iters and o.min_lr < o.lr:
        warnings.append(f"optim.min_lr={o.min_lr} is not reached: schedule.decay_iters={decay_iters} "
                        f"> train.iters={t.iters}")

    tokens = t.global_batch_size * t.seq_length
    plan = RunSizes(world_size=world_size, tp=p.tp, pp=p.pp, dp=dp,
                grad_accum=t.global_batch_size // per_step, tokens_per_batch=tokens,
                total_tokens=tokens * t.iters, num_kv_heads=kv, ffn_hidden_size=ffn,
                padded_vocab=padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, p.tp),
                decay_iters=decay_iters)
    return plan, warnings
