"""Which ranks to simulate, and the result as text, Markdown and JSON.

``--roles`` simulates one rank of every distinct role. What a rank holds and moves depends on its
pipeline stage — the first embeds, the last holds the head, and in 1F1B and its interleaved form
stage ``s`` keeps ``pp - s`` micro-batches in flight — and not on its tensor- or data-parallel
position: those split every tensor into equal, equally padded shares (vocabulary rows, sequence
shards, ZeRO shards). So the roles are the first stage, the second (the most in flight after the
first), the middle one and the last, at tp = dp = 0.

Context-parallel positions move the same bytes but can hold different temporaries: cp rank ``r``
holds sequence chunks ``r`` and ``2·cp − 1 − r`` (``parallel/context.py``), whose causal attention
reads the first ``(r + 1)·c`` and ``(2·cp − r)·c`` keys (c = s / 2cp); the backward's key and value
gradients of each query chunk have those lengths. Every position runs the same ops in the same
order with sizes affine in ``r``, so at each moment the bytes alive are affine in ``r``, and the
peak — their maximum over the step — is convex in ``r``: the largest is at position 0 or
``cp − 1``. With cp > 1 each stage's role is simulated at both.
"""

from __future__ import annotations

from ..parallel.layout import Layout
from .measure import CATEGORIES

GIB = 2**30
BREAKDOWN = CATEGORIES
SHORT = {"parameters": "params", "gradients": "grads", "optimizer": "optim", "activations": "acts",
         "pipeline_in_flight": "in-flight", "zero3_gathered": "zero3", "comm_buffers": "comm",
         "temporary": "temp", "other": "other"}


def role_ranks(layout: Layout) -> list[tuple[int, str]]:
    """(rank, role) of one rank per distinct role (see the module docstring), first stage first,
    each stage at cp positions 0 and cp − 1."""
    pp = layout.pp
    stages = {0: "first stage", min(1, pp - 1): "second stage", pp // 2: "middle stage",
              pp - 1: "last stage"}
    if pp == 1:
        stages = {0: "the only stage"}
    grid = layout.grid()  # [pp, dp, cp, tp]
    places = sorted({0, layout.cp - 1})
    return [(int(grid[s, 0, c, 0]), name + (f", cp {c}" if layout.cp > 1 else ""))
            for s, name in sorted(stages.items()) for c in places]


def role_of(layout: Layout, rank: int) -> str:
    coords = layout.coords(rank)
    if layout.pp == 1:
        stage = "the only stage"
    else:
        stage = {0: "first stage", layout.pp - 1: "last stage"}.get(coords.pp, f"stage {coords.pp}")
    return stage + (f", cp {coords.cp}" if layout.cp > 1 else "")


def layout_json(layout: Layout, run) -> dict:
    return {"tp": layout.tp, "cp": layout.cp, "pp": layout.pp, "dp": layout.dp, "vpp": layout.vpp,
            "micro_batch_size": layout.micro_batch, "zero": layout.zero,
            "zero_shard_size": layout.shard, "recompute": layout.recompute,
            "sequence_parallel": layout.sequence_parallel,
            "pipeline_layers": list(layout.pipeline_layers) if layout.pipeline_layers else None,
            "schedule": run.sizes.schedule.name, "micro_batches": run.sizes.grad_accum}


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def _where(at: dict) -> str:
    if not at:
        return "-"
    parts = [f"step {at['step']}", at["phase"]]
    if at.get("micro_batch") is not None:
        parts.append(f"micro-batch {at['micro_batch']} chunk {at['chunk']}")
    if at.get("layer"):
        parts.append(at["layer"])
    return " ".join(parts)


def _table(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in [header] + rows)


def memory_table(doc: dict, markdown: bool = False) -> str:
    header = ["rank", "role", "pp", "peak GiB",
              "planned GiB"] + [SHORT[k] for k in BREAKDOWN] + ["peak at", "s"]
    rows = [[str(r["rank"]), r["role"], str(r["coords"]["pp"]), _gib(r["peak_bytes"]),
             _gib(r["planned_peak_bytes"])]
            + [_gib(r["breakdown"][k]) for k in BREAKDOWN]
            + [_where(r["peak_at"]), f"{r['seconds']:.0f}"]
            for r in doc["ranks"]]
    return _table(header, rows, markdown)


def traffic_table(doc: dict, markdown: bool = False) -> str:
    header = ["rank", "group", "op", "GiB/step", "calls/step"]
    rows = [[str(r["rank"]), group, op, f"{nbytes / GIB:.3f}", str(r["comm_calls"][group][op])]
            for r in doc["ranks"] for group in sorted(r["comm_bytes"])
            for op, nbytes in sorted(r["comm_bytes"][group].items())]
    return _table(header, rows, markdown)


def compute_table(doc: dict, markdown: bool = False) -> str:
    header = ["rank", "FLOPs/step (dispatched)", "model FLOPs/step (MFU formula's share)", "ratio",
              "checkpoint GiB", "host reads in the step"]
    rows = [[str(r["rank"]), f"{r['flops']:.4g}", f"{r['model_flops']:.4g}",
             f"{r['flops'] / r['model_flops']:.3f}" if r["model_flops"] else "-",
             _gib(r["checkpoint_bytes"]), "; ".join(r["host_reads"]) or "none"]
            for r in doc["ranks"]]
    return _table(header, rows, markdown)


def title(doc: dict) -> str:
    L = doc["layout"]
    return (f"{doc['config']} on {doc['world_size']:,} ranks: tp {L['tp']} × cp {L['cp']} × pp "
            f"{L['pp']} × dp {L['dp']} (vpp {L['vpp']}, {L['schedule']} schedule, "
            f"{L['micro_batches']} micro-batches of {L['micro_batch_size']}, "
            f"zero {L['zero']}" + (f" over {L['zero_shard_size']}" if L["zero_shard_size"] else "")
            + f", recompute {L['recompute']}, sequence parallel "
              f"{str(L['sequence_parallel']).lower()}); {doc['steps']} steps of the "
              f"{doc['device']} program"
            + "".join(f"\nwarning: {w}" for w in doc.get("warnings", ())))


NOTES = ("Memory is what the program holds in tensors (the allocator's rounding and cache, the "
         "CUDA context and NCCL's buffers come on top: the planner's allowance). Traffic is per "
         "step and rank: an all-reduce, all-gather or send counts the tensor the rank gives, a "
         "reduce-scatter its whole input. The simulation measures memory, traffic and FLOPs, not "
         "time.")


def text(doc: dict) -> str:
    return "\n\n".join([title(doc), memory_table(doc), traffic_table(doc), compute_table(doc),
                        NOTES])


def markdown(doc: dict) -> str:
    return "\n\n".join([f"# Simulated ranks\n\n{title(doc)}",
                        "## Memory (GiB; the breakdown at the peak)", memory_table(doc, True),
                        "## Traffic per step", traffic_table(doc, True), "## FLOPs and checkpoint",
                        compute_table(doc, True), NOTES]) + "\n"
