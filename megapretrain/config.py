"""Configuration schema: a tree of dataclasses, YAML files, dotted command-line overrides, and each
field's own range or choices (:func:`check_fields`).

What the fields mean together — the parallel layout, the model's shape, the batch sizes, the run's
length — is decided by their owners (``parallel/layout.py``, ``model/args.py``, ``data/sampler.py``,
``optim/``) and composed once by :func:`megapretrain.resolve.resolve`.

Precedence is defaults < YAML < command line. Every field has a one-line help text (``metadata``),
which ``--help`` prints. Values from YAML and from the command line go through the same coercion to
the field's declared type, so ``--train.iters 50`` and ``iters: 50`` mean the same thing.

User mistakes raise :class:`~megapretrain.errors.ConfigError` with one line that names the field,
the rule and the fix; the entry point prints it without a traceback. This module is plain data and
schema: it imports nothing else of the package but the error types.
"""

from __future__ import annotations

import dataclasses
import decimal
import difflib
import functools
import math
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from .errors import ConfigError
from .user_files import (
    DuplicateKey,
    StrictLoader,
    not_the_kind,
    not_writable_dir,
    read_text,
    yaml_problem,
)


def _f(default: Any, help: str, *, name: str | None = None, factory: Any = None,
       min: float | None = None, positive: bool = False, max: float | None = None,
       below: float | None = None, choices: tuple = (), output_dir: bool = False,
       path: bool = False, distinct: bool = False):
    """Declare a config field with its help text (and, for Python keywords, its YAML name). A number
    declares its range here: ``min`` (at least; 0 for non-negative) or ``positive``, ``max`` (at
    most) or ``below``; a string its ``choices``, ``path`` for a file system path (or a list of
    them), whose ``~`` and environment variables are expanded (:func:`expand_paths`), or
    ``output_dir`` for a directory the run writes into (:func:`check_output_dirs`; a path too);
    a list of inputs ``distinct`` when an entry given twice is a mistake (:func:`check_distinct`).
    Null passes (it means the default)."""
    meta = {"help": help}
    if distinct:
        meta["distinct"] = True
    if output_dir or path:
        meta["path"] = True
    if output_dir:
        meta["output_dir"] = True
    for key, value in (("name", name), ("min", min), ("max", max), ("below", below)):
        if value is not None:
            meta[key] = value
    if positive:
        meta["positive"] = True
    if choices:
        meta["choices"] = choices
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class RunConfig:
    dir: str = _f("runs/default",
                  "Directory for everything the run writes; rerunning with it resumes.",
                  output_dir=True)
    name: str = _f("", "Free-form run name shown in logs (defaults to the directory name).")


@dataclass
class ModelConfig:
    num_layers: int = _f(2, "Number of transformer decoder layers.", min=1)
    hidden_size: int = _f(128, "Width of the residual stream.", min=1)
    num_heads: int = _f(4, "Attention (query) heads.", min=1)
    num_kv_heads: Optional[int] = _f(None, "Key/value heads for grouped-query attention (null: "
                                           "num_heads).", min=1)
    ffn_hidden_size: Optional[int] = _f(None, "SwiGLU inner width (null: 8/3·hidden rounded up to "
                                              "256).", min=1)
    mlp: str = _f("swiglu",
                  "MLP: swiglu (Llama) | gelu (two matrices, exact GELU: GPT-NeoX, GPT-3 style).",
                  choices=("swiglu", "gelu"))
    vocab_size: Optional[int] = _f(None, "Vocabulary size before padding (null: the tokenizer's).",
                                   min=1)
    make_vocab_size_divisible_by: int = _f(128, "Pad the vocabulary to a multiple of this × "
                                                "parallel.tp.", min=1)
    rope_theta: float = _f(10000.0, "Rotary embedding base.", positive=True)
    rope_scaling: Optional[dict] = _f(None, "Rotary frequency scaling (null: none), as Hugging "
                                            "Face writes it; Llama 3.1's: {rope_type: llama3, "
                                            "factor: 8, low_freq_factor: 1, high_freq_factor: 4, "
                                            "original_max_position_embeddings: 8192}; YaRN's: "
                                            "{rope_type: yarn, factor: 8, "
                                            "original_max_position_embeddings: 8192} (optional: "
                                            "attention_factor, beta_fast, beta_slow, mscale, "
                                            "mscale_all_dim).")
    sliding_rope: Optional[dict] = _f(None, "With sliding_window: the rotary settings of the "
                                            "sliding_attention layers where they differ from "
                                            "rope_theta and rope_scaling (which then apply to the "
                                            "full_attention layers), as Hugging Face's "
                                            "rope_parameters['sliding_attention']; OLMo 3 with "
                                            "YaRN on its full layers only: {rope_type: default, "
                                            "rope_theta: 500000} (null: one setting for every "
                                            "layer; rope_theta null: model.rope_theta).")
    norm_eps: float = _f(1e-5, "Norm epsilon (RMSNorm's; GPT-NeoX: its LayerNorm's "
                               "layer_norm_eps).", positive=True)
    tie_embeddings: bool = _f(False, "Share the input embedding with the output layer.")
    init_std: float = _f(0.02, "Std of the normal init; output projections use "
                               "init_std/sqrt(2·num_layers).", positive=True)
    attention_dropout: float = _f(0.0, "Dropout on attention probabilities.", min=0, below=1)
    hidden_dropout: float = _f(0.0, "Dropout on attention and MLP outputs before the residual add.",
                               min=0, below=1)
    kernels: str = _f("auto", "Fused kernels: auto (Triton on CUDA, torch on CPU) | triton | torch "
                              "(see kernels/).", choices=("auto", "triton", "torch"))
    attention: str = _f("auto", "Attention under document masking (data.reset_attention_mask) "
                                "and on sliding-window layers: "
                                "auto (flex on CUDA, blockwise elsewhere, sdpa with "
                                "attention_dropout) | flex (FlexAttention) | blockwise (tiles, "
                                "plain torch) | sdpa (a dense s×s mask). Plain causal attention is "
                                "SDPA's under every choice.",
                        choices=("auto", "sdpa", "flex", "blockwise"))
    sliding_window: Optional[int] = _f(None, "Sliding-window attention: on a windowed layer the "
                                             "query at position i sees the keys j with i − window "
                                             "< j ≤ i, itself included (Hugging Face's "
                                             "sliding_window; null or 0: off).", min=0)
    layer_types: Optional[list] = _f(None, "With sliding_window: per layer, sliding_attention or "
                                           "full_attention (Hugging Face's layer_types; null: "
                                           "sliding_window_pattern decides).")
    sliding_window_pattern: Optional[int] = _f(None, "With sliding_window and no layer_types: "
                                                     "every N-th layer (the N-th, 2N-th, ...) has "
                                                     "full attention, the rest the window (OLMo "
                                                     "3: 4, Gemma 3: 6; null: every layer "
                                                     "windowed).", min=1)
    z_loss: float = _f(0.0, "Weight of the z-loss z·logsumexp² added to each token's loss (0: "
                            "none).", min=0)
    family: str = _f("llama", "Model family: llama (RMSNorm, SwiGLU; Qwen2/Qwen3 through qkv_bias "
                              "/ qk_norm) | gpt_neox (LayerNorm with bias, parallel residual, "
                              "partial rotary, GELU, biases; Pythia) | olmo (post-norm, QK-norm "
                              "over the whole q and k projections, SwiGLU; OLMo 2/3).")
    qkv_bias: bool = _f(False,
                        "llama family: biases on the query, key and value projections (Qwen2/2.5).")
    qk_norm: bool = _f(False,
                       "llama family: RMSNorm over each head's query and key before RoPE (Qwen3).")
    head_dim: Optional[int] = _f(None, "Per-head size (null: hidden_size/num_heads; Qwen3 sets it "
                                       "apart).", min=1)
    rotary_pct: float = _f(1.0, "Fraction of each head's dims that RoPE rotates, the first ones "
                                "(GPT-NeoX's rotary_pct; Pythia: 0.25).", positive=True, max=1)
    parallel_residual: Optional[bool] = _f(None, "x + attn(ln1(x)) + mlp(ln2(x)) instead of one "
                                                 "after the other (GPT-NeoX's "
                                                 "use_parallel_residual; null: the family's "
                                                 "default).")
    fp8: str = _f("none", "FP8 GEMMs in every decoder linear (q/k/v, o, gate/up, down), on top of "
                          "train.precision: none | tensorwise (one scale per tensor, e5m2 "
                          "gradients) | rowwise (per-row power-of-two scales, e4m3 gradients); "
                          "torchao.float8's recipes.", choices=("none", "tensorwise", "rowwise"))
    fp8_skip: list = _f(None, "With model.fp8: linears kept in train.precision, as glob patterns "
                              "of their names (e.g. ['layers.0.*', '*.down_proj']); the embedding "
                              "and output layer never run in FP8.", factory=list)


@dataclass
class ParallelConfig:
    tp: int = _f(1, "Tensor-parallel size (ranks that split each layer).", min=1)
    pp: int = _f(1, "Pipeline-parallel size (stages that split the layers).", min=1)
    vpp: int = _f(1, "Virtual pipeline chunks per stage (interleaved 1F1B when > 1).", min=1)
    cp: int = _f(1, "Context-parallel size: ranks that split each sequence (attention all-gathers "
                    "K/V over them).", min=1)
    pp_schedule: str = _f("auto", "Pipeline schedule: auto | none | gpipe | 1f1b | interleaved | "
                                  "zb_h1 | zbv (auto: 1f1b, interleaved when vpp > 1; zb_h1 and "
                                  "zbv defer weight gradients into the bubble, zbv runs two chunks "
                                  "per stage in a V: vpp 2).")
    pipeline_layers: Optional[list] = _f(None,
                                         "Layers per model chunk (pp×vpp counts, in chunk order; "
                                         "the first and last may be 0; null: even split).")
    pp_trace: bool = _f(False, "Record each stage's forward/backward order and in-flight peak "
                        "(RUN_DIR/pipeline_trace_rankN.jsonl).")
    cp_comm: str = _f("allgather",
                      "How attention reaches the other cp ranks' keys: allgather (K/V gathered "
                      "before attention) | ring (K/V passed around the cp ranks under each block's "
                      "attention) | a2a (all-to-all of heads and sequence, Ulysses; heads and kv "
                      "heads must divide by tp × cp).", choices=("allgather", "ring", "a2a"))
    sequence_parallel: bool = _f(False,
                                 "Shard norms/residual activations along the sequence across tp.")
    tp_comm_overlap: bool = _f(False, "Split each sequence-parallel all-gather + column GEMM and "
                                      "row GEMM + reduce-scatter into chunks, each chunk's "
                                      "communication under the previous chunk's GEMM (needs "
                                      "sequence_parallel).")
    zero: int = _f(0, "Sharding over dp: 0 replicated, 1 optimizer state, 2 also gradients, 3 also "
                      "parameters (gathered one decoder layer at a time).")
    zero3_keep_gathered: bool = _f(False, "zero 3: keep each layer gathered from its first use to "
                                          "the step's last backward (no re-gather for backward or "
                                          "between micro-batches; costs the stage's full "
                                          "parameters).")
    zero3_prefetch: bool = _f(True, "zero 3: start gathering the next layer while the current one "
                                    "computes.")
    zero_shard_size: Optional[int] = _f(None, "Hybrid sharding: shard over groups of this many dp "
                                              "× cp ranks (e.g. a node's) and replicate across the "
                                              "groups (null: shard over all of dp × cp).", min=1)
    recompute: str = _f("none", "Activation recomputation: none | selective | full.",
                        choices=("none", "selective", "full"))
    bucket_size_mb: float = _f(32.0, "Gradient bucket size for the data-parallel reduction (MB; 0: "
                                     "one bucket).", min=0)
    backend: str = _f("auto",
                      "torch.distributed backend: auto (nccl on CUDA, gloo on CPU) | nccl | gloo.",
                      choices=("auto", "nccl", "gloo"))
    comm_stats: bool = _f(False, "Count bytes and calls per collective each step (debugging).")
    fp8_allgather: bool = _f(True, "With model.fp8: sequence parallelism's input all-gather, and "
                                   "ZeRO-3's weight all-gather (tensorwise), send FP8 and scales: "
                                   "half of bf16's bytes.")


@dataclass
class TokenizerConfig:
    type: str = _f("ByteTokenizer", "ByteTokenizer | HuggingFaceTokenizer | GPT2BPETokenizer | "
                   "SentencePieceTokenizer | TikTokenizer.")
    model: Optional[str] = _f(None, "Tokenizer file or directory (see the README); ByteTokenizer "
                                    "needs none.", path=True)


@dataclass
class DataConfig:
    paths: list = _f(None, "Dataset prefixes from tools/preprocess_data.py, optionally weighted: "
                     "[0.3, prefixA, 0.7, prefixB].", factory=list, path=True,
                     distinct=True)
    split: list = _f(None, "Train/valid/test weights over each dataset's documents.",
                     factory=lambda: [98.0, 2.0, 0.0])
    tokenizer: TokenizerConfig = _f(None, "Tokenizer (must match the one used for preprocessing).",
                                    factory=TokenizerConfig)
    cache_dir: Optional[str] = _f(None, "Where sample indices are cached (null: "
                                        "RUN_DIR/data_cache).", output_dir=True)
    reset_attention_mask: bool = _f(False, "Document masking: a token attends only to earlier "
                                           "tokens of its own document inside a packed sample "
                                           "(Megatron's --reset-attention-mask); the kernel: "
                                           "model.attention.")
    reset_position_ids: bool = _f(False,
                                  "Rotary positions restart at each document of a packed sample.")
    eod_mask_loss: bool = _f(False,
                             "Leave the end-of-document targets out of the loss (and of its mean).")


@dataclass
class TrainConfig:
    seq_length: int = _f(256, "Tokens per sample.", min=1)
    micro_batch_size: int = _f(4, "Samples per forward/backward on one data-parallel rank.", min=1)
    global_batch_size: int = _f(16, "Samples per optimizer step over all ranks (micro × dp × "
                                    "accumulation).", min=1)
    iters: Optional[int] = _f(100, "Optimizer steps to train for (null: derived from "
                                   "train.train_tokens).", min=1)
    train_tokens: Optional[int] = _f(None, "Train for this many tokens instead of train.iters (set "
                                           "one of the two; the steps are derived, batch-size "
                                           "ramp-up included; over a config that sets train.iters: "
                                           "--train.iters null).", min=1)
    rampup_batch_size: Optional[list] = _f(None, "Batch-size ramp-up [start, increment, "
                                                 "ramp_samples]: the global batch grows from start "
                                                 "by increment until ramp_samples samples are "
                                                 "consumed (Megatron's --rampup-batch-size).")
    seed: int = _f(1234, "Seed of initialization, data order and dropout.", min=0)
    precision: str = _f("fp32", "fp32 | bf16 | fp16 (bf16/fp16 keep fp32 master weights).",
                        choices=("fp32", "bf16", "fp16"))
    eval_interval: int = _f(100, "Evaluate on the valid split every this many iterations (0: "
                                 "never).", min=0)
    eval_iters: int = _f(10, "Global batches per evaluation.", min=1)
    device: str = _f("auto", "auto (cuda when available) | cpu | cuda.",
                     choices=("auto", "cpu", "cuda"))
    threads: int = _f(0, "CPU threads per rank (0: the cores divided by the ranks on this node).",
                      min=0)
    compile: bool = _f(False, "torch.compile each decoder layer (regional: compile time "
                              "independent of depth).")
    tf32: bool = _f(True, "fp32 on CUDA: matmuls and convolutions on TF32 tensor cores (the MFU "
                          "peak follows; false: full fp32, about 15x slower on H100).")
    deterministic: bool = _f(False,
                             "Deterministic algorithms (torch.use_deterministic_algorithms; cuBLAS "
                             "workspace fixed): the same run gives the same bits on CUDA too, more "
                             "slowly; an op without a deterministic form warns.")


@dataclass
class EvalConfig:
    tasks: list = _f(None, "Multiple-choice task files (JSONL of {context, choices, label}) scored "
                     "at every train.eval_interval and at the end; logged as <task>/acc, "
                     "<task>/acc_norm, <task>/n (docs/evaluation.md).", factory=list, path=True,
                     distinct=True)
    fewshot: list = _f(None, "One file of example items per task (same order) to build a "
                       "few-shot prefix from; [] for none.", factory=list, path=True)
    num_fewshot: int = _f(0, "Examples put before every context, drawn per item from its "
                             "task's eval.fewshot file as lm-evaluation-harness draws them "
                             "(seeded; the item itself left out when the file is the task's own).",
                          min=0)
    fewshot_seed: int = _f(1234, "Seed of the few-shot draws (lm-evaluation-harness's default "
                                 "fewshot_random_seed): the same prompts on every layout and run.",
                           min=0)
    fewshot_sampler: str = _f("random", "How examples are chosen: random (drawn per item, "
                                        "lm-evaluation-harness's default sampler) | first_n (the "
                                        "file's first ones, its first_n sampler, as MMLU uses).",
                              choices=("random", "first_n"))


@dataclass
class OptimConfig:
    lr: float = _f(3e-4, "Peak learning rate.", positive=True)
    min_lr: float = _f(3e-5, "Learning rate at the end of the decay.")
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay (not applied to norms and biases).",
                             min=0)
    betas: list = _f(None, "AdamW betas [beta1, beta2].", factory=lambda: [0.9, 0.95])
    eps: float = _f(1e-8, "AdamW epsilon.", positive=True)
    clip_grad: float = _f(1.0, "Clip the global gradient norm to this (0: no clipping).", min=0)
    offload: bool = _f(False, "Keep fp32 master weights and the optimizer state (Adam's moments, "
                              "Muon's momentum) in host memory and step them there (Muon's "
                              "Newton–Schulz runs on the device).")
    initial_loss_scale: float = _f(2.0 ** 16, "fp16 only: starting dynamic loss scale.",
                                   positive=True)
    loss_scale_window: int = _f(1000, "fp16 only: clean steps before the loss scale doubles.",
                                min=1)
    min_loss_scale: float = _f(1.0, "fp16 only: the scale never drops below this.", positive=True)
    impl: str = _f("auto", "AdamW implementation: auto (triton on CUDA, torch elsewhere) | triton "
                           "| torch | apex.", choices=("auto", "triton", "torch", "apex"))
    moments_dtype: str = _f("fp32", "AdamW's two moments: fp32 | bf16 (stored in bf16, 4 bytes "
                                    "less per parameter; each step computes in fp32 and rounds "
                                    "them back; on the AdamW optim.impl picks, as fp32 ones: "
                                    "auto the Triton kernel on CUDA; not apex).",
                        choices=("fp32", "bf16"))
    optimizer: str = _f("adamw", "adamw | muon: Muon (momentum, then Newton–Schulz "
                                 "orthogonalization) for every 2-D weight inside the decoder "
                                 "layers, each logical matrix on its own; AdamW (lr, betas, eps, "
                                 "weight_decay) for the rest.", choices=("adamw", "muon"))
    muon_lr: Optional[float] = _f(None, "Muon's peak learning rate (null: optim.lr); the schedule "
                                        "scales it as it scales optim.lr.", positive=True)
    muon_momentum: float = _f(0.95, "Muon's momentum.", min=0, below=1)
    muon_nesterov: bool = _f(True, "Muon: Nesterov momentum.")
    muon_ns_steps: int = _f(5, "Muon: Newton–Schulz iterations.",
                            min=1, below=100)
    muon_ns_precision: str = _f("bf16", "Muon: the Newton–Schulz iteration's precision: bf16 "
                                        "(torch.optim.Muon's) | fp32 (slower; reproducible across "
                                        "layouts to fp32 rounding).", choices=("bf16", "fp32"))
    muon_adjust_lr: str = _f("original", "Muon's per-matrix learning-rate factor: original "
                                         "(sqrt(max(1, rows/cols))) | match_rms_adamw "
                                         "(0.2·sqrt(max(rows, cols))), torch.optim.Muon's.",
                             choices=("original", "match_rms_adamw"))
    muon_weight_decay: Optional[float] = _f(None, "Muon's decoupled weight decay (null: "
                                                  "optim.weight_decay).", min=0)


@dataclass
class ScheduleConfig:
    warmup_iters: int = _f(0, "Linear warmup steps from 0 to optim.lr.", min=0)
    decay: str = _f("cosine", "cosine | linear | wsd | constant.",
                    choices=("cosine", "linear", "wsd", "constant"))
    decay_iters: Optional[int] = _f(None, "Step at which the decay reaches optim.min_lr (null: "
                                          "train.iters; a resumed run keeps its checkpoint's).",
                                    min=1)
    wsd_decay_fraction: float = _f(0.2,
                                   "wsd only: fraction of decay_iters spent in the final decay.",
                                   positive=True, max=1)
    rewarm_iters: int = _f(0, "A resumed run extended past the end of its checkpoint's schedule: "
                              "warm from the rate reached there back to optim.lr over this many "
                              "steps, then decay to optim.min_lr at the new train.iters (0: "
                              "continue at optim.min_lr).", min=0)


@dataclass
class CheckpointConfig:
    interval: int = _f(1000, "Save every this many iterations (and at the end; 0: only at the "
                             "end).", min=0)
    interval_minutes: float = _f(0.0, "Also save when this many minutes passed since the last save "
                                      "(0: off).", min=0)
    keep_last: int = _f(3, "Keep this many most recent checkpoints (0: keep all).", min=0)
    keep_every: int = _f(0, "Also keep every checkpoint whose iteration is a multiple of this (0: "
                            "none).", min=0)
    average_last: int = _f(0, "When training ends, also write the uniform average of the last "
                              "this many checkpoints' weights beside them, as "
                              "checkpoints/average_last_K_iter_N: a fine-tune start (0: off).",
                           min=0)
    async_save: bool = _f(False, "Write checkpoints in the background.", name="async")
    load: Optional[str] = _f(None, "Checkpoint directory to start from when run.dir has none.",
                             path=True)
    milestone_fraction: float = _f(0.0, "Also keep the checkpoint at (or just before) every this "
                                        "fraction of train.iters, e.g. 0.1: every 10% of the run "
                                        "(0: none).", min=0, max=1)
    load_optimizer: bool = _f(True, "Load the optimizer state (Adam moments and step, loss scale) "
                                    "with the weights.")
    load_rng: bool = _f(True, "Load the random-number states (dropout streams) with the weights.")
    finetune: bool = _f(False,
                        "Start a new run from checkpoint.load's weights: fresh optimizer, schedule "
                        "and data position (continued pretraining); the run's own checkpoints "
                        "resume as usual.")
    timeout_s: float = _f(3600.0, "How long the ranks wait for each other while saving or loading "
                                  "a checkpoint (seconds): their agreement runs on a process "
                                  "group of its own, so a slow file system trips this limit, not "
                                  "watchdog.collective_timeout_s.", positive=True)


@dataclass
class LoggingConfig:
    interval: int = _f(1, "Log every this many iterations.", min=1)
    tensorboard: bool = _f(True, "Write TensorBoard scalars to RUN_DIR/tensorboard.")
    wandb: bool = _f(False, "Also log to Weights & Biases (needs the wandb extra).")
    peak_tflops: Optional[float] = _f(None, "Device peak TFLOP/s for MFU (null: known GPUs only).",
                                      positive=True)


@dataclass
class RecoveryConfig:
    action: str = _f("rollback",
                     "On a loss spike or a run of non-finite steps: rollback (reload the newest "
                     "checkpoint from before it and skip the data that led to it), alert (report "
                     "and go on) or none.")
    spike_zscore: float = _f(6.0, "A step's loss is a spike when it exceeds what a line fitted to "
                                  "the previous recovery.window losses expects by this many "
                                  "standard deviations of their residuals.", positive=True)
    window: int = _f(50, "Steps of loss history the spike test compares with (it judges from 8 of "
                         "them on).", min=2)
    min_std_fraction: float = _f(0.02, "Floor of that standard deviation, as a fraction of the "
                                       "mean loss (so a spike is at least spike_zscore × this "
                                       "above the trend: 12% by default).", min=0)
    max_bad_steps: int = _f(3, "Consecutive non-finite steps (NaN/Inf loss, or grad norm outside "
                               "fp16) that trigger the action.", min=1)
    skip_batches: int = _f(0, "After a rollback, also skip this many global batches past the "
                              "offending ones.", min=0)
    max_rollbacks: int = _f(5, "Stop with an error after this many rollbacks in one run.", min=1)
    alert_command: Optional[str] = _f(None, "Shell command rank 0 runs for every alert (the alert "
                                            "as JSON in $MEGAPRETRAIN_ALERT), e.g. a curl to a "
                                            "chat webhook.")
    spike_ratio: float = _f(3.0,
                            "Also a spike: a loss above this many times the mean of the previous "
                            "recovery.window losses (either test triggers).", positive=True)
    grad_norm_rollback: float = _f(100.0, "A gradient explosion: the grad norm (before clipping) "
                                          "above this for recovery.max_bad_steps steps in a row is "
                                          "treated like a spike.", positive=True)
    lr_factor: float = _f(0.5, "Each rollback multiplies the learning rate by this from the "
                               "restored iteration on (compounding; saved in checkpoints).",
                          positive=True)
    prune_rolled_back: bool = _f(True, "Retention also prunes set-aside (rolled-back) checkpoints, "
                                       "keeping the newest checkpoint.keep_last of them (false: "
                                       "keep them all).")


@dataclass
class AlertsConfig:
    grad_norm_max: float = _f(10.0, "Alert when the grad norm (before clipping) exceeds this.",
                              positive=True)
    loss_ratio: float = _f(2.0, "Alert when the loss exceeds this many times its rolling average.",
                           positive=True)
    window: int = _f(100, "Steps of the rolling averages (loss, throughput).", min=2)
    throughput_drop: float = _f(0.2,
                                "Alert when tokens/s falls this fraction below its rolling median.",
                                positive=True)
    data_wait_s: float = _f(1.0, "Alert when a step waits longer than this for its data (seconds).",
                            positive=True)
    straggler_ratio: float = _f(1.2, "Name a rank whose own step time (the median of its last "
                                "alerts.straggler_steps) is at least this many times the median "
                                "rank's (checked every logging interval).", positive=True)
    straggler_steps: int = _f(20, "Steps a rank must be slow for (the window of that median) to be "
                                  "named a straggler.", min=1)


@dataclass
class WatchdogConfig:
    timeout_s: Optional[float] = _f(None, "An iteration longer than this is a hang: every thread's "
                                          "stack goes to RUN_DIR/hang/rankN.txt and the rank exits "
                                          "with status 5 (null: watchdog.multiple × the rolling "
                                          "step time, at least watchdog.floor_s; 0: off).", min=0)
    multiple: float = _f(10.0, "With timeout_s null: the limit as a multiple of the rolling step "
                               "time.", positive=True)
    floor_s: float = _f(300.0, "With timeout_s null: the limit is never below this (seconds).",
                        positive=True)
    startup_s: float = _f(1800.0, "The allowance for the first steps, evaluations and checkpoint "
                                  "saves (seconds).", positive=True)
    collective_timeout_s: float = _f(1800.0, "The process group's timeout: a collective that never "
                                             "completes ends in an error after this long "
                                             "(seconds).", positive=True)


@dataclass
class FaultsConfig:
    nan_at: Optional[int] = _f(None, "Fault drill: NaN in the grads at this iteration.", min=1)
    spike_at: Optional[int] = _f(None, "Fault drill: a loss spike (a corrupted batch) at this "
                                       "iteration.", min=1)
    exit_at: Optional[int] = _f(None, "Fault drill: the rank exits (status 1) at this iteration.",
                                min=1)
    hang_at: Optional[int] = _f(None, "Fault drill: the rank blocks forever at this iteration.",
                                min=1)
    slow_data_at: Optional[int] = _f(None, "Fault drill: the data wait at this iteration is "
                                           "faults.slow_data_s.", min=1)
    slow_data_s: float = _f(2.0, "Fault drill: the length of that data wait (seconds).", min=0)
    slow_data_steps: int = _f(1, "Fault drill: the steps from faults.slow_data_at that wait so (a "
                                 "rank slow for alerts.straggler_steps or more is a straggler).",
                              min=1)
    oom_at: Optional[int] = _f(None, "Fault drill: an out-of-memory error at this iteration.",
                               min=1)
    rank: int = _f(-1, "The global rank the faults apply to (-1: every rank).", min=-1)
    every_attempt: bool = _f(False, "Fire the drills again in every process on the run directory "
                                    "(each restart: a crash loop), instead of once per run "
                                    "directory.")


@dataclass
class Config:
    run: RunConfig = _f(None, "Run directory and name.", factory=RunConfig)
    model: ModelConfig = _f(None, "Model architecture.", factory=ModelConfig)
    parallel: ParallelConfig = _f(None, "Parallel layout.", factory=ParallelConfig)
    data: DataConfig = _f(None, "Datasets and tokenizer.", factory=DataConfig)
    train: TrainConfig = _f(None, "Batch sizes, length, precision.", factory=TrainConfig)
    eval: EvalConfig = _f(None, "Downstream multiple-choice tasks.", factory=EvalConfig)
    optim: OptimConfig = _f(None, "Optimizer.", factory=OptimConfig)
    schedule: ScheduleConfig = _f(None, "Learning-rate schedule.", factory=ScheduleConfig)
    checkpoint: CheckpointConfig = _f(None, "Checkpointing.", factory=CheckpointConfig)
    logging: LoggingConfig = _f(None, "Logging and metrics.", factory=LoggingConfig)
    recovery: RecoveryConfig = _f(None, "Loss-spike and NaN detection, alerts and rollback.",
                                  factory=RecoveryConfig)
    alerts: AlertsConfig = _f(None, "Thresholds of the run's alerts.", factory=AlertsConfig)
    watchdog: WatchdogConfig = _f(None, "Hang detection.", factory=WatchdogConfig)
    faults: FaultsConfig = _f(None, "Fault injection for tests and drills (all off by default; "
                                    "each fires once per run directory).", factory=FaultsConfig)


# ----------------------------------------------------------------------------------------------
# Loading: dict -> dataclasses with coercion, YAML, overrides


def _key(f: dataclasses.Field) -> str:
    return f.metadata.get("name", f.name)


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {_key(f): f for f in dataclasses.fields(cls)}


def _exponent_integer(text: str) -> int | str:
    """``3e9`` or ``1.5e12`` as the integer it writes, else ``text`` unchanged. YAML 1.1 reads
    exponent notation as a number only with a dot and a signed exponent (``3.0e+9``), so ``3e9`` —
    how a token budget is naturally written — arrives as a string. Decimal, not float:
    ``12345678901234567e0`` stays exact."""
    if not re.fullmatch(r"[+-]?[0-9][0-9_]*(\.[0-9_]*)?[eE][+-]?[0-9]+", text.strip()):
        return text
    number = decimal.Decimal(text.strip().replace("_", ""))
    # far out of range, or a fraction
    if number.adjusted() >= 64 or number != number.to_integral_value():
        return text
    return int(number)  # one over the int64 range is refused by check_fields, naming the limit


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
        if isinstance(value, str):
            value = _exponent_integer(value)
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
            close = _elsewhere(path) or [
                f"{where}.{c}" if where else c
                for c in difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)]
            hint = f"did you mean {_either(close, '')}?" if close \
                else f"valid keys: {', '.join(fields)}"
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


@functools.cache  # the schema is fixed; reading its type hints is slow
def _all_paths(cls, where: str = "") -> tuple[str, ...]:
    """Every field's dotted name under section ``cls``."""
    paths: list[str] = []
    hints = typing.get_type_hints(cls)
    for key, f in _fields(cls).items():
        path = f"{where}.{key}" if where else key
        if dataclasses.is_dataclass(hints[f.name]):
            paths += _all_paths(hints[f.name], path)
        else:
            paths.append(path)
    return tuple(paths)


def _elsewhere(dotted: str) -> list[str]:
    """Every field named as ``dotted``'s last part in any section (``train.lr`` -> ``optim.lr``),
    the most alike first: a key put under the wrong section is found where it belongs, before a
    look-alike of the section it was given in."""
    name = dotted.rsplit(".", 1)[-1]
    found = [p for p in _all_paths(Config) if p.rsplit(".", 1)[-1] == name]
    return sorted(found, key=lambda p: -difflib.SequenceMatcher(None, p, dotted).ratio())


def _either(paths: list[str], dashes: str) -> str:
    return " or ".join(f"'{dashes}{p}'" for p in paths)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Write ``value`` at ``a.b.c`` in a nested dict, checking the path exists in the schema."""
    valid = _all_paths(Config)
    if dotted not in valid:
        close = _elsewhere(dotted) \
            or difflib.get_close_matches(dotted, valid, n=1, cutoff=0.6)
        hint = f"did you mean {_either(close, '--')}?" if close \
            else "run with --help to list the options"
        raise ConfigError(f"unknown option '--{dotted}': {hint}")
    node = tree
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"'{p}' in the config file is not a section")
    node[leaf] = value


def _raw_overrides(args: list[str]) -> list[tuple[str, str]]:
    """``--a.b VALUE`` / ``--a.b=VALUE`` pairs as given: (name, the value's text)."""
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
        pairs.append((name, raw))
    return pairs


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """Parse ``--a.b VALUE`` / ``--a.b=VALUE`` pairs; values are read as YAML. An option given
    twice is applied twice: the last wins (:func:`repeated_overrides` says so)."""
    pairs = []
    for name, raw in _raw_overrides(args):
        try:
            value = yaml.load(raw, Loader=StrictLoader) if raw != "" else ""
        except DuplicateKey as exc:
            raise ConfigError(f"option '--{name}': {exc.problem}") from None
        except yaml.YAMLError:
            value = raw
        pairs.append((name, value))
    return pairs


def repeated_overrides(args: list[str]) -> list[str]:
    """A warning for each option of ``args`` given twice with another value: the last wins. Run
    scripts put their defaults before the user's ``"$@"``, so a repeat is legitimate, but not
    silent (the training prints these at start-up, on stdout beside its plan)."""
    given: dict[str, str] = {}
    warnings = []
    for name, raw in _raw_overrides(args):
        if name in given and given[name] != raw:
            warnings.append(f"--{name} given twice ({given[name]}, then {raw}): the last is used")
        given[name] = raw
    return warnings


def load_config(path: str | None = None, overrides: list[str] | None = None,
                reset: tuple[str, ...] = ()) -> Config:
    """Defaults < YAML file at ``path`` < dotted ``overrides``; returns the (unvalidated) Config.
    The sections named in ``reset`` start from their defaults, not the file's (a tool that runs a
    saved run's model under a layout of its own: no field is left that needs the saved layout)."""
    tree: dict = {}
    if path is not None:
        path = expand_path(path, "--config")
        other = not_the_kind(path, "a config", also=("a YAML file", "a JSON file"))
        if other:  # a run directory, a dataset, a metrics.jsonl, an empty file, ...
            raise ConfigError(f"config file {other}: --config takes a YAML config (see configs/)")
        try:
            tree = yaml.load(read_text(path), Loader=StrictLoader)
        except yaml.YAMLError as exc:
            raise ConfigError(
                f"config file '{path}' is not valid YAML {yaml_problem(exc)}") from None
        if tree is None:  # comments only: no config (every default would be taken silently)
            raise ConfigError(f"config file '{path}' holds no sections: --config takes a YAML "
                              "config (see configs/)")
        if not isinstance(tree, dict):
            raise ConfigError(f"config file '{path}' must be a mapping of sections (run:, model:, "
                              "...)")
    for section in reset:
        tree.pop(section, None)
    for name, value in parse_overrides(overrides or []):
        _set_dotted(tree, name, value)
    cfg = _from_dict(Config, tree)
    expand_paths(cfg)
    return cfg


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
# Each field against what it declares


_INT_LIMIT = 2 ** 63  # every count ends up in an int64 (numpy indices, torch tensors)


def check_fields(node, where: str = "") -> None:
    """Every field of ``node`` (a config or a section of one) against the range or choices its
    declaration names (``_f(min=..., max=..., below=..., positive=..., choices=...)``); every
    number, also inside a list or a mapping, must be finite (NaN passes no range check: ``nan < 0``
    is false) and an integer must fit in 64 bits."""
    hints = typing.get_type_hints(type(node))
    for f in dataclasses.fields(node):
        value, path = getattr(node, f.name), f"{where}.{_key(f)}" if where else _key(f)
        if dataclasses.is_dataclass(value):
            check_fields(value, path)
            continue
        meta = f.metadata
        if meta.get("choices") and value not in meta["choices"]:
            raise ConfigError(f"{path}={value!r} is not one of: "
                              f"{', '.join(map(str, meta['choices']))}")
        bad = _unrepresentable(value)
        if bad is not None:
            shown = f"{path}={value!r}" if isinstance(value, (list, dict)) else f"{path}={value}"
            raise ConfigError(f"{shown}: {bad}")
        if meta.get("distinct") and isinstance(value, list):
            check_distinct(path, [v for v in value if isinstance(v, str)])
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            null = " (or null for the default)" \
                if typing.get_origin(hints[f.name]) is typing.Union else ""
            _check_range(path, value, meta, null)


def _unrepresentable(value) -> str | None:
    """What makes a number in ``value`` (or in its items) unusable, or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return "every number must be finite (not NaN or infinite)"
    if isinstance(value, int) and abs(value) >= _INT_LIMIT:
        return f"{value} is out of range (an integer must be below 2**63)"
    items = value.values() if isinstance(value, dict) else value \
        if isinstance(value, (list, tuple)) else ()
    return next((found for item in items if (found := _unrepresentable(item)) is not None), None)


def _check_range(path: str, value: float, meta, null: str) -> None:
    """``value`` against the range its field declares (min, max, below, positive)."""
    low, high, below = meta.get("min"), meta.get("max"), meta.get("below")
    positive = meta.get("positive", False)
    if high is not None or below is not None:  # a bounded interval: say both ends
        ok = ((value > 0) if positive else (low is None or value >= low)) and \
             (value <= high if high is not None else value < below)
        opening = "(0" if positive else f"[{low:g}" if low is not None else "(-inf"
        closing = f"{high:g}]" if high is not None else f"{below:g})"
        if not ok:
            raise ConfigError(f"{path}={value} must be in {opening}, {closing}{null}")
        return
    if low is not None and value < low:
        raise ConfigError(f"{path}={value} must be " + ("non-negative" if low == 0
                                                        else f"at least {low}") + null)
    if positive and value <= 0:
        raise ConfigError(f"{path}={value} must be positive{null}")


def check_distinct(where: str, entries: list[str]) -> None:
    """A list of inputs (``data.paths``, ``eval.tasks``, a tool's input files) names each once: a
    repeated entry would be read twice — twice the weight, a task scored twice — without a word.
    Entries are compared as the paths they name (``a/../b`` is ``b``)."""
    seen: dict[str, str] = {}
    for entry in entries:
        key = os.path.normpath(os.path.abspath(entry))
        if key in seen:
            same = "" if seen[key] == entry else f" (as {seen[key]!r})"
            raise ConfigError(f"{where} names {entry!r} twice{same}: give each input once (to "
                              "weight a dataset, write its weight before it: [0.7, A, 0.3, B])"
                              if where == "data.paths" else
                              f"{where} names {entry!r} twice{same}: give each input once")
        seen[key] = entry


# ----------------------------------------------------------------------------------------------
# Fields that mean something only with another setting


@dataclass(frozen=True)
class Needs:
    """``fields`` take effect only when ``holds(cfg)``, which ``partner`` says in words: given a
    value other than their default while it does not hold, they would be ignored."""
    fields: tuple[str, ...]
    partner: str
    holds: Any  # Callable[[Config], bool]
    shown: tuple[str, ...]  # the fields whose values decide it, named in the message


_MUON = ("optim.muon_lr", "optim.muon_momentum", "optim.muon_nesterov", "optim.muon_ns_steps",
         "optim.muon_ns_precision", "optim.muon_adjust_lr", "optim.muon_weight_decay")
_FAULT_AT = ("faults.nan_at", "faults.spike_at", "faults.exit_at", "faults.hang_at",
             "faults.slow_data_at", "faults.oom_at")

NEEDS: tuple[Needs, ...] = (
    Needs(_MUON, "optim.optimizer muon", lambda c: c.optim.optimizer == "muon",
          ("optim.optimizer",)),
    Needs(("optim.initial_loss_scale", "optim.loss_scale_window", "optim.min_loss_scale"),
          "train.precision fp16 (the loss scale)", lambda c: c.train.precision == "fp16",
          ("train.precision",)),
    Needs(("parallel.sequence_parallel",), "parallel.tp > 1 (it shards over the tp ranks)",
          lambda c: c.parallel.tp > 1, ("parallel.tp",)),
    Needs(("parallel.pipeline_layers", "parallel.pp_trace"), "parallel.pp > 1 (pipeline stages)",
          lambda c: c.parallel.pp > 1, ("parallel.pp",)),
    Needs(("parallel.cp_comm",), "parallel.cp > 1 (context parallelism)",
          lambda c: c.parallel.cp > 1, ("parallel.cp",)),
    Needs(("parallel.zero3_keep_gathered", "parallel.zero3_prefetch"), "parallel.zero 3",
          lambda c: c.parallel.zero == 3, ("parallel.zero",)),
    Needs(("parallel.fp8_allgather", "model.fp8_skip"), "model.fp8 tensorwise or rowwise",
          lambda c: c.model.fp8 != "none", ("model.fp8",)),
    Needs(("model.sliding_window_pattern",), "model.sliding_window > 0",
          lambda c: bool(c.model.sliding_window), ("model.sliding_window",)),
    Needs(("schedule.wsd_decay_fraction",), "schedule.decay wsd",
          lambda c: c.schedule.decay == "wsd", ("schedule.decay",)),
    Needs(("checkpoint.finetune",), "checkpoint.load (the weights to start from)",
          lambda c: c.checkpoint.load is not None, ("checkpoint.load",)),
    Needs(("recovery.skip_batches", "recovery.max_rollbacks", "recovery.lr_factor",
           "recovery.prune_rolled_back"), "recovery.action rollback",
          lambda c: c.recovery.action == "rollback", ("recovery.action",)),
    Needs(("watchdog.multiple", "watchdog.floor_s"), "watchdog.timeout_s null (a limit that "
          "follows the step time)", lambda c: c.watchdog.timeout_s is None,
          ("watchdog.timeout_s",)),
    Needs(("faults.slow_data_s", "faults.slow_data_steps"), "faults.slow_data_at",
          lambda c: c.faults.slow_data_at is not None, ("faults.slow_data_at",)),
    Needs(("faults.rank", "faults.every_attempt"), "a fault drill (faults.exit_at, ...)",
          lambda c: any(get_field(c, f) is not None for f in _FAULT_AT), ()),
)


def get_field(cfg, dotted: str) -> Any:
    """The value of field ``a.b`` (YAML names: ``checkpoint.async``) of ``cfg``."""
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, _fields(type(node))[part].name)
    return node


@functools.cache
def _default(dotted: str) -> Any:
    return get_field(Config(), dotted)


def check_needs(cfg: Config) -> None:
    """Every field of :data:`NEEDS` given a value other than its default while the setting it
    needs is off is refused, naming the field, what it needs and the fix: it would do nothing.
    A saved run config lists every field, so only values that differ from the defaults count."""
    for rule, dotted, value, default in _idle_fields(cfg):
        now = ", ".join(f"{p}={_shown(get_field(cfg, p))}" for p in rule.shown)
        raise ConfigError(f"{dotted}={_shown(value)} does nothing without {rule.partner}"
                          + (f", and {now}" if now else "")
                          + f": set {rule.partner.split(' (')[0]}, or drop {dotted} "
                          f"(default {_shown(default)})")


def drop_inherited(cfg: Config, overrides: list[str]) -> list[str]:
    """A saved run's config under a tool's new settings (a reshard's layout): each field of
    :data:`NEEDS` that the saved config set, whose setting the ``overrides`` turned off (a tp 2
    run with sequence parallelism resharded to tp 1), is reset to its default, as training would
    have refused it; returns a note for each. A field the overrides give themselves is left for
    :func:`check_needs` to refuse."""
    given = {name for name, _ in _raw_overrides(overrides)}
    notes = []
    for rule, dotted, value, default in _idle_fields(cfg):
        if dotted in given:
            continue
        parent, leaf = dotted.rsplit(".", 1)
        node = get_field(cfg, parent)
        setattr(node, _fields(type(node))[leaf].name, default)
        notes.append(f"{dotted}={_shown(value)} of the saved config does nothing without "
                     f"{rule.partner}: reset to {_shown(default)}")
    return notes


def _idle_fields(cfg: Config):
    """``(rule, field, value, default)`` for each field of :data:`NEEDS` set to other than its
    default while the setting it needs is off (read as iterated: a caller may reset each)."""
    for rule in NEEDS:
        if rule.holds(cfg):
            continue
        for dotted in rule.fields:
            value, default = get_field(cfg, dotted), _default(dotted)
            if value != default:
                yield rule, dotted, value, default


def _shown(value: Any) -> str:
    """A value as a flag or YAML writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


_UNSET = re.compile(r"\$(\w+|\{[^}]*\})")


def expand_paths(node, where: str = "") -> None:
    """Expand ``~`` and environment variables (``$VAR``, ``${VAR}``) in every path field of
    ``node`` (``_f(path=True)``; the strings of a list such as ``data.paths``), in place: a path
    is never taken literally, so ``run.dir: ~/x`` is no directory named ``~``. A variable that is
    not set is refused naming the field."""
    for f in dataclasses.fields(node):
        value, path = getattr(node, f.name), f"{where}.{_key(f)}" if where else _key(f)
        if dataclasses.is_dataclass(value):
            expand_paths(value, path)
        elif f.metadata.get("path") and isinstance(value, list):
            setattr(node, f.name, [expand_path(v, path) if isinstance(v, str) else v
                                   for v in value])
        elif f.metadata.get("path") and isinstance(value, str):
            setattr(node, f.name, expand_path(value, path))


def expand_path(value: str, where: str) -> str:
    """``value`` with ``~`` and environment variables expanded; an unset variable is an error
    naming ``where`` (a field, or a tool's flag)."""
    out = os.path.expanduser(os.path.expandvars(value))
    unset = _UNSET.search(out)
    if unset:
        name = unset.group(1).strip("{}")
        raise ConfigError(f"{where}={value!r}: environment variable {name} is not set; set it "
                          f"(export {name}=...) or write the path out")
    return out


def check_output_dirs(cfg: Config) -> None:
    """Every directory field the run writes into (``_f(output_dir=True)``: ``run.dir``,
    ``data.cache_dir``) is a directory that exists or can be made, and can be written to: checked
    before any work, so a run never fails after building indices or a model."""
    for path, value in _output_dirs(cfg):
        if value is None:
            continue
        problem = not_writable_dir(value)
        if problem:
            raise ConfigError(f"{path}={value!r}: {problem}")


def _output_dirs(node, where: str = ""):
    for f in dataclasses.fields(node):
        value, path = getattr(node, f.name), f"{where}.{_key(f)}" if where else _key(f)
        if dataclasses.is_dataclass(value):
            yield from _output_dirs(value, path)
        elif f.metadata.get("output_dir"):
            yield path, value
