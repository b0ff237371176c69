"""A plan written out: the config with its layout, a launch script (SLURM or by hand), and the
same recipe as a DeepSpeed JSON or an Accelerate YAML. None overwrites a file unless asked to.
"""

from __future__ import annotations

import json
import math
import os
import shlex

import yaml

from ..config import TrainConfig, to_dict
from ..errors import ConfigError, UserError
from ..monitor.progress import human_duration
from ..parallel.pipeline import SCHEDULES

# the repository root (the directory holding the megapretrain package): launch scripts run its
# run_scripts/launch.sh
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class OutputExistsError(UserError):
    """An output file that exists (pass --overwrite)."""


def _open_new(path: str, overwrite: bool):
    if os.path.exists(path) and not overwrite:
        raise OutputExistsError(f"{path} exists; pass --overwrite to replace it")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return open(path, "w")


def layout_config(plan: dict, s: dict) -> dict:
    """The config with the plan's layout (and token budget) as a plain dict."""
    tree, L = to_dict(plan["cfg"]), s["layout"]
    tree["parallel"].update(tp=L["tp"], cp=L["cp"], pp=L["pp"], vpp=L["vpp"], zero=L["zero"],
                            recompute=L["recompute"], sequence_parallel=L["sequence_parallel"],
                            pipeline_layers=L["pipeline_layers"],
                            zero_shard_size=L["zero_shard_size"], cp_comm=L["cp_comm"],
                            tp_comm_overlap=L["tp_comm_overlap"], pp_schedule=L["pp_schedule"])
    tree["train"]["micro_batch_size"] = L["micro_batch_size"]
    if plan["budget"] and "train_tokens" in tree["train"]:  # the budget, the steps derived from it
        tree["train"].update(train_tokens=plan["budget"], iters=TrainConfig.iters)
    elif plan["budget"]:
        tree["train"]["iters"] = plan["steps"]
    return tree


def layout_line(cfg, gpus: int, gpus_per_node: int = 8, device: str = "H100") -> str:
    """The layout of ``cfg`` on ``gpus`` GPUs in words, as the shipped configs' first line states
    it: ``layout for 512 GPUs (64 nodes × 8 H100): tp 4 (sp) × pp 4 (vpp 5) × dp 32, zero 2,
    ...``."""
    p, t = cfg.parallel, cfg.train
    dp = gpus // (p.tp * p.cp * p.pp)
    nodes = math.ceil(gpus / gpus_per_node)
    parts = [f"tp {p.tp}" + (" (sp)" if p.sequence_parallel else "")]
    parts += [f"cp {p.cp}"] if p.cp > 1 else []
    parts += [f"pp {p.pp}" + (f" (vpp {p.vpp})" if p.vpp > 1 else ""), f"dp {dp}"]
    return (f"layout for {gpus} GPUs ({nodes} node{'s' * (nodes > 1)} × {gpus_per_node} {device}): "
            f"{' × '.join(parts)}, zero {p.zero}, recompute {p.recompute}, micro-batch "
            f"{t.micro_batch_size}")


def write_config(path: str, plan: dict, s: dict, overwrite: bool) -> None:
    tree = layout_config(plan, s)
    L = s["layout"]
    with _open_new(path, overwrite) as fh:
        fh.write(f"# Written by tools/plan.py from {s['config']}: {s['gpus']} GPUs ({s['nodes']} "
                 f"nodes), tp {L['tp']} × cp {L['cp']} × pp {L['pp']} × dp {L['dp']} (vpp "
                 f"{L['vpp']}); estimated {s['step_s']:.2f} s/step, "
                 f"MFU {s['mfu']:.1%}, {human_duration(s['days'] * 86400)}\n")
        yaml.safe_dump(tree, fh, sort_keys=False)


def write_launch(path: str, s: dict, config: str, flags: str, overwrite: bool) -> None:
    name = os.path.splitext(os.path.basename(path))[0]
    per_node = s["gpus"] // s["nodes"]
    estimated = (f"Estimated {s['step_s']:.2f} s/step, MFU {s['mfu']:.1%}, {s['steps']:,} steps, "
                 f"{s['days']:.1f} days.")
    g = s["goodput"]
    goodput = (f"Goodput {g['goodput']:.1%} expected with a checkpoint every "
               f"{g['interval_iters']:,} steps (Young/Daly: --checkpoint.interval "
               f"{g['interval_iters']}).")
    script = f"""#!/usr/bin/env bash
# Written by tools/plan.py: {s['gpus']} GPUs = {s['nodes']} nodes × {per_node}
# Layout: {s['layout']['flags']}
# {estimated}
# {goodput}
# SLURM:   sbatch {path}
# By hand: NNODES={s['nodes']} NODE_RANK=<i> MASTER_ADDR=<node 0> bash {path}   (on every node)
# Check first: bash {path} --dry-run
#SBATCH --job-name={name}
#SBATCH --nodes={s['nodes']}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={per_node}
#SBATCH --exclusive
set -euo pipefail
ROOT={shlex.quote(ROOT)}
[ -f "$ROOT/run_scripts/launch.sh" ] \\
  || ROOT="${{SLURM_SUBMIT_DIR:?submit from the repository root}}"
export DEFAULT_NNODES={s['nodes']} DEFAULT_NPROC_PER_NODE={per_node}
exec bash "$ROOT/run_scripts/launch.sh" \\
  {shlex.quote(os.path.abspath(config))}{" " + flags if flags else ""} "$@"
"""
    with _open_new(path, overwrite) as fh:
        fh.write(script)
    os.chmod(path, 0o755)


def _no_hybrid(L: dict, target: str) -> None:
    """DeepSpeed shards over all data-parallel ranks: hybrid sharding has no equivalent there."""
    if L["zero_shard_size"]:
        raise ConfigError(f"parallel.zero_shard_size={L['zero_shard_size']}: {target} has no "
                          "hybrid sharding (shard inside groups, replicate across them); emit with "
                          "--parallel.zero_shard_size null, or use --accelerate-plugin fsdp "
                          "(HYBRID_SHARD)")


def _no_rampup(t, target: str) -> None:
    """A batch-size ramp-up has no equivalent where the batch (or the accumulation) is fixed."""
    if t.rampup_batch_size:
        raise ConfigError(f"train.rampup_batch_size={t.rampup_batch_size}: {target} has no "
                          "batch-size ramp-up (its batch is fixed from the first step); emit with "
                          "--train.rampup_batch_size null to train at the full "
                          f"{t.global_batch_size} samples from step 1, or ramp up in the training "
                          "script")


def deepspeed_config(plan: dict, s: dict) -> dict:
    """The recipe as a DeepSpeed config: the same batch, precision, ZeRO stage, optimizer,
    schedule."""
    cfg, L = plan["cfg"], s["layout"]
    o, sch, t = cfg.optim, cfg.schedule, cfg.train
    _no_rampup(t, "DeepSpeed's config")
    accum = t.global_batch_size // (L["micro_batch_size"] * L["dp"])
    ds = {"train_batch_size": t.global_batch_size,
          "train_micro_batch_size_per_gpu": L["micro_batch_size"],
          "gradient_accumulation_steps": accum, "gradient_clipping": o.clip_grad,
          "steps_per_print": cfg.logging.interval, "wall_clock_breakdown": False}
    if t.precision == "bf16":
        ds["bf16"] = {"enabled": True}
    elif t.precision == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0,
                      "initial_scale_power": int(math.log2(o.initial_loss_scale)),
                      "loss_scale_window": o.loss_scale_window, "min_loss_scale": o.min_loss_scale,
                      "hysteresis": 2}
    # DeepSpeed's pipeline engine refuses ZeRO 2 and 3 at start-up: with pp > 1 it runs ZeRO 1
    zero = {"stage": min(L["zero"], 1) if L["pp"] > 1 else L["zero"], "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": int(cfg.parallel.bucket_size_mb * 2**20)}
    _no_hybrid(L, "DeepSpeed")
    if o.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    ds["zero_optimization"] = zero
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps,
                                                   "weight_decay": o.weight_decay}}
    total = sch.decay_iters if sch.decay_iters is not None else plan["steps"]
    if sch.decay == "cosine":
        ds["scheduler"] = {"type": "WarmupCosineLR", "params": {
            "total_num_steps": total, "warmup_num_steps": sch.warmup_iters, "warmup_min_ratio": 0.0,
            "cos_min_ratio": o.min_lr / o.lr, "warmup_type": "linear"}}
    elif sch.decay == "constant":
        ds["scheduler"] = {"type": "WarmupLR",
                           "params": {"warmup_min_lr": 0.0, "warmup_max_lr": o.lr,
                                      "warmup_num_steps": sch.warmup_iters,
                                      "warmup_type": "linear"}}
    elif sch.decay == "linear" and o.min_lr == 0:
        ds["scheduler"] = {"type": "WarmupDecayLR", "params": {
            "total_num_steps": total, "warmup_min_lr": 0.0, "warmup_max_lr": o.lr,
            "warmup_num_steps": sch.warmup_iters, "warmup_type": "linear"}}
    else:
        raise ConfigError(f"schedule.decay={sch.decay} with optim.min_lr={o.min_lr} has no "
                          "DeepSpeed scheduler; use schedule.decay cosine or constant (or linear "
                          "with optim.min_lr 0) for --emit deepspeed")
    if L["tp"] > 1:
        ds["tensor_parallel"] = {"autotp_size": L["tp"]}
    if L["pp"] > 1:
        ds["pipeline"] = {"stages": L["pp"], "partition": "uniform",
                          "activation_checkpoint_interval": 1 if L["recompute"] == "full" else 0}
    if L["recompute"] != "none":
        ds["activation_checkpointing"] = {"partition_activations": L["sequence_parallel"],
                                          "contiguous_memory_optimization": False,
                                          "cpu_checkpointing": False}
    return ds


def accelerate_config(plan: dict, s: dict, plugin: str) -> dict:
    """The recipe as an Accelerate config file: machines, processes, precision, and the plugin."""
    cfg, L = plan["cfg"], s["layout"]
    acc = {"compute_environment": "LOCAL_MACHINE", "debug": False,
           "mixed_precision": {"bf16": "bf16", "fp16": "fp16"}.get(cfg.train.precision, "no"),
           "num_machines": s["nodes"], "num_processes": s["gpus"], "machine_rank": 0,
           "main_process_ip": "127.0.0.1", "main_process_port": 29500, "rdzv_backend": "static",
           "same_network": True, "main_training_function": "main", "use_cpu": False,
           "downcast_bf16": False}
    if plugin == "deepspeed":
        _no_hybrid(L, "Accelerate's DeepSpeed plugin")
        _no_rampup(cfg.train, "Accelerate's DeepSpeed plugin (a fixed gradient_accumulation_steps)")
        acc["distributed_type"] = "DEEPSPEED"
        accum = cfg.train.global_batch_size // (L["micro_batch_size"] * L["dp"])
        # zero 3: each process builds only its shard (deepspeed.zero.Init), never the whole model
        acc["deepspeed_config"] = {"zero_stage": L["zero"], "gradient_accumulation_steps": accum,
                                   "gradient_clipping": cfg.optim.clip_grad,
                                   "offload_optimizer_device": "cpu" if cfg.optim.offload
                                   else "none", "offload_param_device": "none",
                                   "zero3_init_flag": L["zero"] == 3}
    # FSDP has no ZeRO-1: ZeRO 1 and 2 map to SHARD_GRAD_OP (2's memory or less), 3 to FULL_SHARD
    else:
        acc["distributed_type"] = "FSDP"
        hybrid = "HYBRID_SHARD" if L["zero"] == 3 else "HYBRID_SHARD_ZERO2"  # shard inside a node
        strategy = "NO_SHARD" if L["zero"] == 0 else "FULL_SHARD" if L["zero"] == 3 \
            else "SHARD_GRAD_OP"
        acc["fsdp_config"] = {"fsdp_sharding_strategy": hybrid if L["zero_shard_size"] and L["zero"]
                              else strategy, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                              "fsdp_backward_prefetch": "BACKWARD_PRE",
                              "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                              "fsdp_offload_params": bool(cfg.optim.offload),
                              "fsdp_use_orig_params": True, "fsdp_sync_module_states": True,
                              "fsdp_cpu_ram_efficient_loading": True,
                              "fsdp_activation_checkpointing": L["recompute"] != "none"}
    return acc


def dropped(plan: dict, s: dict, fmt: str) -> list[str]:
    """What of the plan the ``fmt`` export does not carry (each in words): interleaved pipeline
    stages, a zero-bubble schedule, FP8 GEMMs, and for DeepSpeed a ZeRO stage above 1 under
    pipeline parallelism (its pipeline engine allows ZeRO 0 or 1 only)."""
    cfg, L = plan["cfg"], s["layout"]
    out = []
    if fmt == "deepspeed" and L["pp"] > 1 and L["zero"] > 1:
        out.append(f"ZeRO {L['zero']} (written as ZeRO 1: DeepSpeed's pipeline engine takes ZeRO "
                   "0 or 1 with pp > 1)")
    if L["pp"] > 1 and L["vpp"] > 1:
        out.append(f"interleaved stages (vpp {L['vpp']}: plain 1F1B instead)")
    schedule = SCHEDULES.get(L["pp_schedule"])
    if schedule is not None and schedule.split_backward:  # zero bubble: deferred weight grads
        out.append(f"the zero-bubble schedule (parallel.pp_schedule {L['pp_schedule']})")
    if cfg.model.fp8 != "none":
        out.append(f"FP8 GEMMs (model.fp8 {cfg.model.fp8}: {cfg.train.precision} only)")
    return out


def render(fmt: str, path: str, plan: dict, s: dict, args) -> tuple[str, str]:
    """(the file's text, a note for the user) of ``--emit fmt path``; a recipe the format cannot
    hold is refused here, before any file is written; what it drops is named in one line."""
    lost = dropped(plan, s, fmt)
    lost = f"note: {path} drops {'; '.join(lost)}" if lost else ""
    if fmt == "deepspeed":
        return json.dumps(deepspeed_config(plan, s), indent=2) + "\n", lost
    acc = accelerate_config(plan, s, args.accelerate_plugin)
    text = yaml.safe_dump(acc, sort_keys=False)
    note = accelerate_note(path, plan, s, args.accelerate_plugin)
    return ("# " + lost[len("note: "):] + "\n" if lost else "") + text, \
        "\n".join(n for n in (lost, note) if n)


def write_text(path: str, text: str, overwrite: bool) -> None:
    with _open_new(path, overwrite) as fh:
        fh.write(text)


def accelerate_note(path: str, plan: dict, s: dict, plugin: str) -> str:
    """What an Accelerate config does not hold, and the training script must: the optimizer, the LR
    schedule, the batch (and its ramp-up), and tensor or pipeline parallelism."""
    cfg, L = plan["cfg"], s["layout"]
    o, sch, t = cfg.optim, cfg.schedule, cfg.train
    batch = f"micro-batch {L['micro_batch_size']} per GPU, global batch {t.global_batch_size} " \
            "samples"
    if t.rampup_batch_size:
        batch += f" ramped up as train.rampup_batch_size={t.rampup_batch_size}"
    lines = [f"note: {path} holds the launch, precision and sharding; set in the training script: "
             f"AdamW lr {o.lr:g} betas {list(o.betas)} eps {o.eps:g} weight decay "
             f"{o.weight_decay:g}; warmup {sch.warmup_iters} steps then {sch.decay} to "
             f"{o.min_lr:g} at step {sch.decay_iters or plan['steps']}; {batch}"
             + (f"; clip the grad norm to {o.clip_grad:g}" if plugin == "fsdp" else "")]
    if L["tp"] * L["pp"] > 1:
        lines.append(f"note: Accelerate's {plugin} plugin has no tensor or pipeline parallelism; "
                     f"set them up in the model code (tp {L['tp']}, pp {L['pp']})")
    return "\n".join(lines)
