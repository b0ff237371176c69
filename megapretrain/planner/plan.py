"""The plan of a config on a GPU count: its layouts searched (or its own checked) with the
planner's model, the run's length from its token budget, and the result as plain numbers.

The layout search itself is :func:`megapretrain.planner.model.search` (exported as
``megapretrain.planner.search``, so this module is not named after it); this module turns a
config and ``tools/plan.py``'s flags into its arguments and reads its answer.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re

from ..config import TrainConfig, check_fields, load_config
from ..data.checks import vocab_without_data
from ..data.sampler import run_length
from ..errors import UserError
from ..model.build import model_args
from ..model.decoder import num_parameters
from ..model.families import check_model
from ..model.fp8 import check_fp8_fields
from ..monitor.flops import DEVICES, with_device
from ..resolve import resolve
from .comm import context_step_bytes
from .goodput import checkpoint_bytes, plan_goodput
from .model import GIB, context_gather_bytes, estimate_run, search
from .optimizer import OptimizerSpec


class PlanArgumentError(UserError):
    """A bad flag of tools/plan.py."""


_SUFFIX = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def tokens(text: str) -> int:
    """A token count: 2000000000000, 2e12, 2T, 300B, 1.5T."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*",
                         str(text))
    if not match or float(match[1]) * _SUFFIX[match[2].upper()] < 1:
        raise argparse.ArgumentTypeError("expected a positive token count like 2T, 300B or 2e12, "
                                         f"got {text!r}")
    return int(round(float(match[1]) * _SUFFIX[match[2].upper()]))


def split_train_tokens(overrides: list[str]) -> tuple[list[str], int | None]:
    """Take ``--train.train_tokens T`` out of the overrides: the plan's budget, which may replace
    the config's ``train.iters`` (validation accepts only one of the two)."""
    rest, found, i = [], None, 0
    while i < len(overrides):
        arg = overrides[i]
        if arg == "--train.train_tokens" or arg.startswith("--train.train_tokens="):
            value = arg.split("=", 1)[1] if "=" in arg \
                else (overrides[i + 1] if i + 1 < len(overrides) else "")
            i += 1 if "=" in arg else 2
            try:
                found = tokens(value)
            except argparse.ArgumentTypeError as exc:
                raise PlanArgumentError(f"--train.train_tokens: {exc}") from None
            continue
        rest.append(arg)
        i += 1
    return rest, found


def run_samples(t, budget: int | None) -> tuple[int, int]:
    """(steps, samples) of the run: ``budget`` tokens (or the config's train.train_tokens, else
    train.iters steps), batch-size ramp-up included where the config has one."""
    budget = budget or t.train_tokens
    return run_length(dataclasses.replace(t, train_tokens=budget, iters=TrainConfig.iters) if budget
                      else t)


def make_plan(args: argparse.Namespace, overrides: list[str]) -> dict:
    overrides, budget = split_train_tokens(overrides)
    cfg = load_config(args.config, overrides)
    m, t = cfg.model, cfg.train
    vocab_without_data(cfg, "plan")
    check_fields(cfg)  # every size positive and finite before the search divides by any of them
    check_model(m, 1)  # the model's own shape; each layout's tp is checked by the search
    # the recipe and fp8_skip's patterns; each layout's FP8 shapes by the search
    check_fp8_fields(cfg)
    device = with_device(DEVICES[args.device], peak_tflops=args.peak_tflops,
                         memory_gb=args.memory_gb, hbm_gbs=args.hbm_gbs, intra_gbs=args.intra_gbs,
                         inter_gbs=args.inter_gbs, efficiency=args.efficiency)
    model = model_args(cfg)
    if args.check:
        found = [estimate_run(cfg, resolve(cfg, args.gpus).layout, device, args.attention)]
    else:
        found = search(model, t.seq_length, args.gpus, t.global_batch_size, device, t.precision,
                       args.attention, m.fp8, tuple(m.fp8_skip), OptimizerSpec.of(cfg.optim))
    budget = args.train_tokens or budget
    steps, samples = run_samples(t, budget)
    return {"cfg": cfg, "device": device, "model": model, "found": found, "steps": steps,
            "tokens": samples * t.seq_length, "budget": budget or t.train_tokens,
            "full_steps": samples / t.global_batch_size, "overrides": overrides}


def summary(plan: dict, e, args) -> dict:
    """The plan as plain numbers (``--json``); ``goodput``: failures and checkpoints
    (:mod:`.goodput`) at ``args``' failure rate, write rate and restart time."""
    L, mem, t, cfg = e.layout, e.memory, e.time, plan["cfg"]
    # a ramp-up's smaller steps take proportionally less
    days = plan["full_steps"] * t["total"] / 86400
    rank_bytes, total_bytes = checkpoint_bytes(plan["model"], L, OptimizerSpec.of(cfg.optim))
    goodput = {**plan_goodput(args.gpus, t["total"], total_bytes,
                              failures_per_gpu_hour=args.failures_per_gpu_hour,
                              write_gbps=args.checkpoint_write_gbps,
                              restart_minutes=args.restart_minutes),
               "checkpoint_rank_bytes": rank_bytes}
    goodput["days_with_failures"] = days / goodput["goodput"] if goodput["goodput"] else None
    return {
        "config": args.config, "gpus": args.gpus,
        "nodes": math.ceil(args.gpus / plan["device"].gpus_per_node), "device": plan["device"].name,
        "params": num_parameters(plan["model"]),
        "layout": {"tp": L.tp, "cp": L.cp, "pp": L.pp, "dp": L.dp, "vpp": L.vpp,
                   "micro_batch_size": L.micro_batch, "zero": L.zero, "zero_shard_size": L.shard,
                   "recompute": L.recompute, "sequence_parallel": L.sequence_parallel,
                   "cp_comm": L.cp_comm, "tp_comm_overlap": L.tp_comm_overlap,
                   "pp_schedule": L.pp_schedule, "pipeline_layers": list(L.pipeline_layers)
                   if L.pipeline_layers else None, "flags": L.flags()},
        "fits": e.fits,
        "memory_gb": {"weights": mem["params"] / GIB,
                      "grads_optimizer": (mem["state"] - mem["params"]) / GIB,
                      "activations": mem["activations"] / GIB, "overhead": mem["overhead"] / GIB,
                      "total": mem["total"] / GIB, "capacity": mem["capacity"] / GIB},
        "time_s": dict(t),
        "cp_kv_gather_mib_per_layer": context_gather_bytes(plan["model"], L,
                                                           cfg.train.seq_length) / 2**20,
        "cp_traffic_mib_per_step": context_step_bytes(plan["model"], L, cfg.train.seq_length,
                                                      cfg.train.global_batch_size) / 2**20,
        "optimizer": cfg.optim.optimizer, "moments_dtype": cfg.optim.moments_dtype,
        "optimizer_share": t["optimizer"] / t["total"],
        "step_s": t["total"], "mfu": e.mfu, "hfu": e.hfu, "tflops_per_gpu": e.tflops_per_gpu,
        "hw_tflops_per_gpu": e.hw_tflops_per_gpu, "tokens_per_s_per_gpu": e.tokens_per_gpu_s,
        "tokens_per_s": e.tokens_per_gpu_s * args.gpus,
        "global_batch_size": cfg.train.global_batch_size, "seq_length": cfg.train.seq_length,
        "tokens_per_step": cfg.train.global_batch_size * cfg.train.seq_length,
        "steps": plan["steps"], "train_tokens": plan["tokens"], "days": days,
        "gpu_hours": days * 24 * args.gpus, "goodput": goodput}
