"""Out of memory: what was allocated, and what to change, in the recipe's order.

The trainer catches an out-of-memory error (``torch.OutOfMemoryError``, or ``MemoryError`` for host
memory) at the step boundary, writes the memory summary to ``RUN_DIR/oom_rankN.txt``, prints the
remedies — document masking without a dense mask (``model.attention``), activation recomputation,
half the micro-batch, a higher ZeRO stage or optimizer offload, more tensor or pipeline
parallelism — each with the planner's memory estimate for the changed layout, and exits with
:data:`OOM_EXIT`.
"""

from __future__ import annotations

import copy
import os

import torch

from .errors import ConfigError, UserError, size_text
from .host_memory import available_bytes
from .model.args import model_args
from .model.attention import dense_document_mask
from .model.decoder import num_parameters
from .monitor.flops import DEVICES, find_device
from .parallel.layout import Layout
from .planner import GIB, estimate_run

OOM_EXIT = 4


def memory_summary(device: torch.device) -> str:
    """The allocator's summary on CUDA; the process's and the machine's memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_summary(device)
    lines = []
    sources = (("/proc/self/status", ("VmPeak", "VmHWM", "VmRSS")),
               ("/proc/meminfo", ("MemTotal", "MemAvailable")))
    for path, keys in sources:
        try:
            with open(path) as fh:
                lines += [line.strip() for line in fh if line.split(":")[0] in keys]
        except OSError:
            pass
    return "\n".join(lines) or "no memory statistics on this platform"


def advice_device(device: torch.device):
    """The device whose figures the advice quotes: this GPU when the planner knows it, else an
    H100."""
    gpu = find_device(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return gpu or DEVICES["h100"]


def remedies(cfg, layout: Layout, device: torch.device) -> list[str]:
    """The changes to try, in order, each with the planner's per-GPU memory for the new layout."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    dev, args, dp = advice_device(device), model_args(cfg), layout.dp

    def planned(**change) -> str:
        changed = layout.replace(**change)
        if "pp" in change or "vpp" in change:
            # the config's own split fits its pp × vpp only
            changed = changed.replace(pipeline_layers=None)
        try:
            e = estimate_run(cfg, changed, dev)
        except UserError:
            return "(not a valid layout here)"
        return f"(planner: {e.memory['total'] / GIB:.1f} GB per GPU on {dev.name})"

    out = []
    if dense_document_mask(cfg):  # the (b, heads, s, s) scores of SDPA's math kernel, per layer
        fused = copy.deepcopy(cfg)
        fused.model.attention, fused.model.attention_dropout = "auto", 0.0
        try:
            gb = f"(planner: {estimate_run(fused, layout, dev).memory['total'] / GIB:.1f} GB per " \
                 f"GPU on {dev.name})"
        except UserError:
            gb = ""
        dropout = " --model.attention_dropout 0" if m.attention_dropout else ""
        out.append(f"--model.attention auto{dropout} {gb}".rstrip())
    if p.recompute != "full":
        out.append(f"--parallel.recompute full {planned(recompute='full')}")
    if t.micro_batch_size > 1:
        half = t.micro_batch_size // 2
        out.append(f"--train.micro_batch_size {half} {planned(micro_batch=half)}")
    if p.zero < 3 and dp > 1:
        out.append(f"--parallel.zero {p.zero + 1} {planned(zero=p.zero + 1)}")
    if not cfg.optim.offload and cfg.optim.impl in ("auto", "torch"):  # (what offload runs with)
        out.append(f"--optim.offload true {offloaded(cfg, layout, dev)}")
    if args.num_heads % (2 * p.tp) == 0 and args.num_kv_heads % (2 * p.tp) == 0 and dp % 2 == 0:
        out.append(f"--parallel.tp {2 * p.tp} {planned(tp=2 * p.tp, dp=dp // 2)}")
    if args.num_layers % (2 * p.pp * p.vpp) == 0 and dp % 2 == 0:
        out.append(f"--parallel.pp {2 * p.pp} {planned(pp=2 * p.pp, dp=dp // 2)}")
    if t.seq_length % (4 * p.cp * p.tp) == 0 and dp % 2 == 0:  # long sequences: split them further
        out.append(f"--parallel.cp {2 * p.cp} {planned(cp=2 * p.cp, dp=dp // 2)}")
    return out


def offloaded(cfg, layout: Layout, dev) -> str:
    """The planner's per-GPU memory of ``layout`` with ``optim.offload``, and what it saves: the
    optimizer state (fp32 masters and moments), held in host memory instead (and the Triton
    AdamW's decay mask, which the host's AdamW does without)."""
    moved = copy.deepcopy(cfg)
    moved.optim.offload = True
    try:
        e, before = estimate_run(moved, layout, dev), estimate_run(cfg, layout, dev)
    except UserError:
        return "(masters and moments in host memory)"
    saved = before.memory["total"] - e.memory["total"]
    return (f"(planner: {e.memory['total'] / GIB:.1f} GB per GPU on {dev.name}, "
            f"{saved / GIB:.1f} GB less: masters and moments in host memory)")


def report_oom(exc: BaseException, cfg, layout: Layout, rank: int, iteration: int,
               device: torch.device) -> str:
    """Write ``RUN_DIR/oom_rankN.txt``; return the console message with the remedies."""
    path = os.path.join(cfg.run.dir, f"oom_rank{rank}.txt")
    with open(path, "w") as fh:
        fh.write(f"rank {rank}, iteration {iteration}: {type(exc).__name__}: "
                 f"{exc}\n\n{memory_summary(device)}\n")
    lines = [f"error: out of memory on rank {rank} at iteration {iteration} "
             f"({type(exc).__name__}); memory summary in {path}. Try, in this order:"]
    lines += [f"  {i}. {r}" for i, r in enumerate(remedies(cfg, layout, device), start=1)]
    return "\n".join(lines)


def device_capacity(device: torch.device) -> tuple[int | None, str]:
    """(bytes one rank may fill, what they are): the GPU's memory, or the host's available
    memory."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, f"the {props.name}'s memory"
    return available_bytes(), "the host memory available"


def check_model_fits(cfg, layout: Layout, device: torch.device) -> None:
    """Refuse, before building anything, a model whose weights, gradients and optimizer state
    alone exceed one rank's memory (``model.num_layers`` 1e6, ``model.vocab_size`` 1e9): the
    planner's figures for the busiest rank of this layout, in one line naming the size fields."""
    capacity, what = device_capacity(device)
    if capacity is None:
        return
    try:
        e = estimate_run(cfg, layout, advice_device(device))
    except UserError:  # a layout the planner does not model: the run's own checks decide
        return
    parts = e.memory["parts"]
    # optim.offload keeps masters and moments in host memory, beside the GPU's
    held = ("parameters", "gradients") + (() if cfg.optim.offload and device.type == "cuda"
                                          else ("optimizer",))  # the planner's names
    needed = int(sum(parts[k] for k in held))
    if needed > capacity:
        a = model_args(cfg)
        words = [{"parameters": "weights", "optimizer": "optimizer state"}.get(k, k) for k in held]
        what_for = ", ".join(words[:-1]) + " and " + words[-1]
        raise ConfigError(f"model.num_layers={a.num_layers:,}, model.hidden_size={a.hidden_size:,}"
                          f", model.ffn_hidden_size={a.ffn_hidden_size:,}, model.vocab_size="
                          f"{a.vocab_size:,}: the model ({num_parameters(a):,} parameters) needs "
                          f"{size_text(needed)} a rank for its {what_for} alone "
                          f"(planner), {what} is {size_text(capacity)}; shrink the "
                          "model, or split it over more ranks (parallel.tp, parallel.pp, "
                          "parallel.zero: tools/plan.py finds a layout)")


def min_micro_batch_bytes(cfg, layout: Layout) -> int:
    """A floor on what one micro-batch holds on its busiest stage: its token ids and targets, and
    the one activation per layer that backward needs whatever ``parallel.recompute`` is (a layer's
    input, of micro_batch × seq_length/cp × hidden values, cut by tp under sequence parallelism).
    Python integers: no overflow however large the sizes."""
    m, t = cfg.model, cfg.train
    seq = t.seq_length // layout.cp // (layout.tp if layout.sp else 1)
    element = 4 if t.precision == "fp32" else 2
    layers = max(1, m.num_layers // layout.pp)  # the busiest stage holds at least the average
    return 2 * 8 * t.micro_batch_size * t.seq_length \
        + layers * t.micro_batch_size * seq * m.hidden_size * element


def check_micro_batch_fits(cfg, layout: Layout, device: torch.device) -> None:
    """Refuse, before building anything, a micro-batch whose activations alone exceed the device
    (``train.seq_length`` 1e9, ``train.micro_batch_size`` 1e8): one line naming what it needs."""
    needed = min_micro_batch_bytes(cfg, layout)
    capacity, what = device_capacity(device)
    if capacity is not None and needed > capacity:
        t = cfg.train
        raise ConfigError(f"train.micro_batch_size={t.micro_batch_size} × "
                          f"train.seq_length={t.seq_length:,}: one micro-batch needs at least "
                          f"{size_text(needed)} (its tokens, and one activation of "
                          f"{cfg.model.hidden_size} values per token in each of the stage's "
                          f"layers), {what} is {size_text(capacity)}; lower them (tools/plan.py "
                          "estimates the whole memory of a layout)")
