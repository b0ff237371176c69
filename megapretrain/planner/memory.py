"""Bytes a rank of one pipeline stage holds at its peak, by part: the planner's memory model.

The parts are those ``tools/simulate.py`` measures on the trainer's own program
(``megapretrain/simulate/measure.py``), so the two compare part by part; the figures follow the
program's code, and ``tests/test_simulate_planner.py`` holds them to the simulation:

- ``parameters``: the stage's parameters (its layers, the embedding on the first stage, the final
  norm and output layer on the last) in the model's dtype; under ZeRO-3 the rank's shard;
- ``gradients``: the fp32 gradient buffer (zero 0/1) or its shard (zero 2/3); zero 2 also keeps a
  bucket's full gradients while its micro-batch's reduction is in flight, the output layer's
  among them on the last stage;
- ``optimizer``: fp32 masters (none for fp32 weights) and Adam's two moments, over the shard ranks;
- ``activations`` / ``pipeline_in_flight``: what autograd keeps of the micro-batch chunk
  computing, and of the others the schedule holds in flight (:func:`saved_bytes_per_token`);
- ``zero3_gathered``: ZeRO-3's layers gathered in full at once (three) and every chunk's root;
- ``comm_buffers`` and ``temporary``: what the peak moment is computing with (a layer's
  backward, the output layer's chunk of logits).
"""

from __future__ import annotations

from ..model.args import ModelArgs
from ..parallel.layout import Layout
from ..parallel.pipeline import peak_in_flight, resolve_schedule, schedule_order

PARTS = ("parameters", "gradients", "optimizer", "activations", "pipeline_in_flight", "zero3_gathered",
         "comm_buffers", "temporary")
LAYER_UNITS_ALIVE = 3  # parallel/zero3.py's bound on gathered decoder layers
HEAD_CHUNK_BYTES = 512 << 20  # kernels/linear_cross_entropy.py: one chunk of logits on a GPU


def weight_bytes(precision: str) -> int:
    return 2 if precision in ("bf16", "fp16") else 4


def stage_layers(model: ModelArgs, layout: Layout, pp_rank: int) -> list[int]:
    """Layers of each of the stage's ``vpp`` chunks."""
    return [len(ids) for ids in layout.chunk_layers(model.num_layers, pp_rank)]


def stage_params(model: ModelArgs, layout: Layout, pp_rank: int, layer: tuple[int, int, int]) -> int:
    """Parameters a rank of stage ``pp_rank`` holds (its tp share); ``layer``: the (tp-split,
    replicated) parameters of one decoder layer and the head's replicated ones (the final norm)."""
    split, replicated, head = layer
    tp = layout.tp
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    vocab = model.padded_vocab(tp) // tp * model.hidden_size
    params = sum(stage_layers(model, layout, pp_rank)) * (split // tp + replicated)
    if first:
        params += vocab
    if last:
        params += head + (0 if model.tie_embeddings and first else vocab)
    return params


def in_flight(layout: Layout, pp_rank: int, micro_batches: int, schedule: str) -> int:
    """The most micro-batch chunks stage ``pp_rank`` keeps activations of, read off its schedule."""
    kind = resolve_schedule(schedule, layout.pp, layout.vpp, micro_batches)
    return peak_in_flight(schedule_order(kind, pp_rank, layout.pp, layout.vpp, micro_batches))


def saved_bytes_per_token(model: ModelArgs, layout: Layout, seq: int, precision: str, kernels: str) -> float:
    """Bytes autograd keeps of one decoder layer per token of a rank's share of a micro-batch.

    Without recomputation (flash attention): the layer's input, its attention norm's output, the
    residual after attention and the MLP norm's output (sequence-parallel: the rank's 1/tp of the
    tokens; else whole on every tp rank); q and the attention output, k and v (heads split over
    tp; under cp the keys and values of every cp rank); the MLP's inner activations (the Triton
    SwiGLU keeps gate, up and their product; torch's also the SiLU; GELU its input and output);
    fp32 norm statistics and attention log-sum-exp. Selective recomputation drops the
    log-sum-exp; full recomputation keeps the layer's input only."""
    w, tp, cp = weight_bytes(precision), layout.tp, layout.cp
    sp = tp if layout.sequence_parallel or tp == 1 else 1
    h, d = model.hidden_size, model.head_dim
    q, kv = model.num_heads * d / tp, model.num_kv_heads * d / tp
    if layout.recompute == "full":
        return w * h / sp
    stream = 3 if model.parallel_residual else 4
    f = model.ffn_hidden_size / tp
    mlp = 2 * f if model.mlp == "gelu" else (3 if kernels == "triton" else 4) * f
    attention = 2 * q + 2 * kv * cp + (q + model.num_kv_heads * d / tp if model.qk_norm else 0)
    stats = 4 * 2 * (2 if model.mlp == "gelu" else 1) / sp  # rstd per norm (LayerNorm: mean and rstd)
    lse = 0 if layout.recompute == "selective" else 4 * model.num_heads / tp
    return w * (stream * h / sp + attention + mlp) + stats + lse


def stage_memory(model: ModelArgs, seq: int, layout: Layout, pp_rank: int, micro_batches: int, *,
                 layer: tuple[int, int, int], precision: str = "bf16", schedule: str = "auto",
                 kernels: str = "triton", bucket_mb: float = 32.0) -> dict:
    """Bytes by part (:data:`PARTS`) on a rank of stage ``pp_rank`` at its peak, and their
    ``total``: ``micro_batches`` per step and dp rank; ``layer`` as for :func:`stage_params`."""
    L, w = layout, weight_bytes(precision)
    n_shard = L.shard_ranks
    params = stage_params(model, L, pp_rank, layer)
    first, last = pp_rank == 0, pp_rank == L.pp - 1
    chunks = stage_layers(model, L, pp_rank)
    tokens = L.micro_batch * seq // L.cp  # the rank's share of a micro-batch
    sp = L.tp if L.sequence_parallel or L.tp == 1 else 1
    h = model.hidden_size
    vocab_rows = model.padded_vocab(L.tp) // L.tp

    out = dict.fromkeys(PARTS, 0.0)
    out["parameters"] = params * w / (n_shard if L.zero == 3 else 1)
    out["gradients"] = params * 4.0 / (n_shard if L.zero >= 2 else 1)
    out["optimizer"] = params * ((4.0 if w == 2 else 0.0) + 8.0) / (n_shard if L.zero >= 1 else 1)
    if L.zero == 2:  # a bucket's full fp32 gradients while its reduction is in flight (the head's: its own)
        out["gradients"] += 4.0 * (vocab_rows * h if last and not model.tie_embeddings else 0) + bucket_mb * 2**20
    per_layer = tokens * saved_bytes_per_token(model, L, seq, precision, kernels)
    held = in_flight(L, pp_rank, micro_batches, schedule)
    out["activations"] = max(chunks) * per_layer
    out["pipeline_in_flight"] = (held - 1) * sum(chunks) / len(chunks) * per_layer
    if L.recompute == "full":  # the layer recomputed for its backward keeps its whole activations then
        full = L.replace(recompute="none")
        out["activations"] += tokens * saved_bytes_per_token(model, full, seq, precision, kernels)
    if L.zero == 3:
        layer_full = (layer[0] // L.tp + layer[1]) * w
        roots = params - sum(chunks) * (layer[0] // L.tp + layer[1])
        out["zero3_gathered"] = min(LAYER_UNITS_ALIVE, max(chunks)) * layer_full + roots * w
    if L.tp > 1:  # a gathered (b, s, h) input and its pieces
        out["comm_buffers"] = 2.0 * tokens * h * w * (1 if sp > 1 else 0)
    out["temporary"] = (min(tokens * vocab_rows * w, HEAD_CHUNK_BYTES) + tokens * h * w * 2) if last \
        else tokens * h * w * 2 / sp
    if first:
        out["temporary"] += tokens * h * w
    out["total"] = sum(out[k] for k in PARTS)
    return out
