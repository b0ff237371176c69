"""The published training runs the planner is checked against, and its estimate of each.

``tests/test_planner.py`` holds every estimate within ±20% of its published figure;
``tools/plan.py --published`` prints the table.
"""

from __future__ import annotations

import dataclasses

from ..model.args import ModelArgs
from ..monitor.flops import DEVICES
from .model import GIB, Estimate, Layout, estimate, split_layers

# Published runs the planner is checked against (tests/test_planner.py holds each within ±20%)


def _gpt(layers: int, hidden: int, heads: int) -> ModelArgs:
    """A GPT-3-style model as Megatron-LM ran them: GELU MLP of 4h, multi-head attention, vocabulary
    51,200, tied embeddings, dropout 0.1."""
    return ModelArgs(layers, hidden, heads, heads, 4 * hidden, 51200, tie_embeddings=True,
                     mlp="gelu", attention_dropout=0.1, hidden_dropout=0.1)


_L3_405B = ModelArgs(126, 16384, 128, 8, 53248, 128256, rope_theta=500000.0)
N21 = "Narayanan et al. 2021 (arXiv 2104.04473), Table 1: A100 80GB, full recompute, TFLOP/s " \
      "counting it"
K22 = "Korthikanti et al. 2022 (arXiv 2205.05198), end-to-end results: A100 80GB, selective " \
      "recompute + SP, MFU"
L3 = "Dubey et al. 2024 (arXiv 2407.21783), Table 4: H100, BF16 MFU"


@dataclasses.dataclass(frozen=True)
class Published:
    name: str
    source: str
    model: ModelArgs
    seq: int
    layout: Layout
    global_batch: int
    device: str
    attention: str
    metric: str        # "hw_tflops_per_gpu" (recompute counted) or "tflops_per_gpu" (model FLOPs)
    value: float       # TFLOP/s per GPU
    # whether the planner's memory model fits the layout in the device (the rows that do not: a
    # layout whose memory the paper does not account for, their throughput estimated as published)
    fits: bool = True

    @property
    def gpus(self) -> int:
        return self.layout.world_size


def _row(name, source, model, seq, tp, pp, gpus, batch, recompute, sp, device, attention, metric,
         value, vpp=1, layers=None, zero=0, cp=1, fits=True):
    layout = Layout(tp, pp, gpus // (tp * cp * pp), vpp, 1, zero, recompute,
                    layers or split_layers(model.num_layers, pp * vpp), sp, cp)
    return Published(name, source, model, seq, layout, batch, device, attention, metric, value,
                     fits)


META_SPLIT = (0,) + (1,) * 126 + (0,)  # Llama 3 405B's layers per chunk (pp 16 × vpp 8)

PUBLISHED = [  # Megatron-LM 2021: no sequence parallelism, unfused attention, micro-batch 1, fp16
    _row("GPT 1.7B", N21, _gpt(24, 2304, 24), 2048, 1, 1, 32, 512, "full", False, "a100", "unfused",
         "hw_tflops_per_gpu", 137),
    _row("GPT 3.6B", N21, _gpt(30, 3072, 32), 2048, 2, 1, 64, 512, "full", False, "a100", "unfused",
         "hw_tflops_per_gpu", 138),
    _row("GPT 7.5B", N21, _gpt(36, 4096, 32), 2048, 4, 1, 128, 512, "full", False, "a100",
         "unfused", "hw_tflops_per_gpu", 142),
    _row("GPT 18.4B", N21, _gpt(40, 6144, 48), 2048, 8, 1, 256, 1024, "full", False, "a100",
         "unfused", "hw_tflops_per_gpu", 135),
    _row("GPT 39.1B", N21, _gpt(48, 8192, 64), 2048, 8, 2, 512, 1536, "full", False, "a100",
         "unfused", "hw_tflops_per_gpu", 138),
    _row("GPT 76.1B", N21, _gpt(60, 10240, 80), 2048, 8, 4, 1024, 1792, "full", False, "a100",
         "unfused", "hw_tflops_per_gpu", 140),
    _row("GPT 145.6B", N21, _gpt(80, 12288, 96), 2048, 8, 8, 1536, 2304, "full", False, "a100",
         "unfused", "hw_tflops_per_gpu", 148),
    _row("GPT 310.1B", N21, _gpt(96, 16384, 128), 2048, 8, 16, 1920, 2160, "full", False, "a100",
         "unfused", "hw_tflops_per_gpu", 155),
    _row("GPT 529.6B", N21, _gpt(105, 20480, 128), 2048, 8, 35, 2520, 2520, "full", False, "a100",
         "unfused", "hw_tflops_per_gpu", 163),
    _row("GPT 1008B", N21, _gpt(128, 25600, 160), 2048, 8, 64, 3072, 3072, "full", False, "a100",
         "unfused", "hw_tflops_per_gpu", 163),
    # Megatron-LM 2022: sequence parallelism + selective recompute, one data-parallel replica
    _row("GPT 22B sel", K22, _gpt(48, 6144, 64), 2048, 8, 1, 8, 4, "selective", True, "a100",
         "unfused", "tflops_per_gpu", 0.415 * 312),
    _row("GPT 175B sel", K22, _gpt(96, 12288, 96), 2048, 8, 8, 64, 64, "selective", True, "a100",
         "unfused", "tflops_per_gpu", 0.514 * 312),
    _row("GPT 530B sel", K22, _gpt(105, 20480, 128), 2048, 8, 35, 280, 280, "selective", True,
         "a100", "unfused", "tflops_per_gpu", 0.560 * 312),
    _row("GPT 1T sel", K22, _gpt(128, 25600, 160), 2048, 8, 64, 512, 512, "selective", True, "a100",
         "unfused", "tflops_per_gpu", 0.563 * 312),
    # Llama 3 405B: 16M-token batches, interleaved 1F1B over 128 chunks of one layer but the
    # first (the embedding alone) and the last (the output layer alone), §3.3.2: META_SPLIT; no
    # activation checkpointing at 8K tokens, and FSDP sharding the gradients and the optimizer
    # state with the weights kept whole through the step (§3.3.2): zero 2. At 16,384 GPUs a step
    # is 16 micro-batches, as many as stages, so each stage holds every one's activations at its
    # peak
    # (126 layers' worth of one sample, 63 GB): with whole fp32 gradients (zero 1, 12 GB more)
    # it would not fit. At 8,192 GPUs (32 micro-batches) the interleaved order holds
    # 1 + 15/128 times that, which the memory model puts above 80 GB: its throughput is estimated
    # as published.
    _row("Llama 3 405B", L3, _L3_405B, 8192, 8, 16, 8192, 2048, "none", True, "h100", "flash",
         "tflops_per_gpu", 430, vpp=8, layers=META_SPLIT, zero=2, fits=False),
    _row("Llama 3 405B 16k", L3, _L3_405B, 8192, 8, 16, 16384, 2048, "none", True, "h100", "flash",
         "tflops_per_gpu", 400, vpp=8, layers=META_SPLIT, zero=2),
    # its long-context stage: 131,072-token sequences over context parallelism 16, the same
    # 16M-token batches (dp 8); the throughput is estimated as published (the memory model puts this
    # layout's activations above 80 GB without recomputation, which the paper does not detail)
    _row("Llama 3 405B 128k", L3, _L3_405B, 131072, 8, 16, 16384, 128, "none", True, "h100",
         "flash", "tflops_per_gpu", 380, vpp=4, zero=2, cp=16, fits=False),
]


def published_estimate(row: Published) -> Estimate:
    """The planner's estimate of a published run at its layout."""
    return estimate(row.model, row.seq, row.layout, row.global_batch, DEVICES[row.device], "bf16",
                    "auto", row.attention)


def published_estimates() -> list[tuple[Published, float]]:
    """Every published run with the planner's figure for it (the same metric)."""
    return [(row, getattr(published_estimate(row), row.metric)) for row in PUBLISHED]


def published_table() -> str:
    lines = ["| run | GPUs | layout (tp/cp/pp/dp, recompute) | zero, vpp | metric | estimate | "
             "published | error | memory GB/GPU |", "|---|---|---|---|---|---|---|---|---|"]
    for row in PUBLISHED:
        e = published_estimate(row)
        L, got = row.layout, getattr(e, row.metric)
        metric = "TFLOP/s/GPU incl. recompute" if row.metric == "hw_tflops_per_gpu" \
            else "model TFLOP/s/GPU"
        memory = f"{e.memory['total'] / GIB:.1f}" + ("" if e.fits else " (does not fit)")
        lines.append(f"| {row.name} ({row.device.upper()}) | {row.gpus:,} | "
                     f"{L.tp}/{L.cp}/{L.pp}/{L.dp}, {L.recompute} | {L.zero}, {L.vpp} | "
                     f"{metric} | {got:.0f} | {row.value:.0f} | {got / row.value - 1:+.1%} | "
                     f"{memory} |")
    sources = sorted({row.source for row in PUBLISHED})
    return "\n".join(lines + [""] + [f"- {s}" for s in sources])
