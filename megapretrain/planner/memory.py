"""Bytes a rank of one pipeline stage holds at its peak, by part: the planner's memory model.

The parts are those ``tools/simulate.py`` measures on the trainer's own program
(``megapretrain/simulate/measure.py``), so the two compare part by part; the figures follow the
program's code, and ``tests/test_simulate_planner.py`` holds them to the simulation:

- ``parameters``: the stage's parameters (its layers, the embedding on the first stage, the final
  norm and output layer on the last — under ZB-V's V placement both on the first) in the model's
  dtype; under ZeRO-3 the rank's shard;
- ``gradients``: the fp32 gradient buffer (zero 0/1) or its shard (zero 2/3); zero 2 also keeps a
  bucket's full gradients while its micro-batch's reduction is in flight, the output layer's
  among them on the last stage;
- ``optimizer``: fp32 masters (none for fp32 weights) and Adam's two moments (fp32 or bf16), or
  Muon's one fp32 momentum on its matrices, over the shard ranks (``planner/optimizer.py``);
- ``activations`` / ``pipeline_in_flight``: what autograd keeps of the micro-batch chunk
  computing, and of the others the schedule holds in flight (:func:`saved_bytes_per_token`); under
  a zero-bubble schedule also what each chunk whose B ran keeps for its W (the linears' inputs
  and output gradients: :func:`~.pipeline.deferred_bytes_per_token`);
- ``zero3_gathered``: ZeRO-3's layers gathered in full at once (three) and every chunk's root;
- ``comm_buffers`` and ``temporary``: what the peak moment is computing with (a layer's
  backward, the output layer's chunk of logits).
"""

from __future__ import annotations

import functools

from ..model.args import ModelArgs
from ..model.families import layer_spec
from ..parallel.layout import Layout
from ..parallel.pipeline import Placement, Schedule, layout_schedule, resolve_schedule
from .optimizer import ADAMW, OptimizerSpec, state_bytes
from .pipeline import deferred_bytes_per_token

PARTS = ("parameters", "gradients", "optimizer", "activations", "pipeline_in_flight",
         "zero3_gathered", "comm_buffers", "temporary")
HEAD_CHUNK_BYTES = 512 << 20  # kernels/linear_cross_entropy.py: one chunk of logits on a GPU


def weight_bytes(precision: str) -> int:
    return 2 if precision in ("bf16", "fp16") else 4


def chunk_placement(layout: Layout, schedule: Schedule | None = None) -> Placement:
    """Where ``schedule``'s chunks sit (None: the layout's own schedule's): interleaved, or in
    ZB-V's V, whose first stage holds the first chunk and the last — the embedding and the head."""
    return (schedule or layout_schedule(layout)).placement(layout.pp, layout.vpp)


def chunk_layer_counts(model: ModelArgs, layout: Layout, pp_rank: int,
                       schedule: Schedule | None = None) -> list[int]:
    """How many layers each of the stage's ``vpp`` chunks holds under ``schedule``'s placement
    (None: the layout's own schedule's), as :meth:`Layout.chunk_sizes` counts them."""
    v_shape = (schedule or layout_schedule(layout)).v_shape
    return list(layout.chunk_sizes(model.num_layers, pp_rank, v_shape))


def head_chunk(layout: Layout, pp_rank: int, schedule: Schedule | None = None) -> int | None:
    """Which of stage ``pp_rank``'s chunks holds the output layer (None: none of them)."""
    place = chunk_placement(layout, schedule)
    mine = [v for v in range(layout.vpp) if place.global_chunk(pp_rank, v) == place.chunks - 1]
    return mine[0] if mine else None


def stage_params(model: ModelArgs, layout: Layout, pp_rank: int, layer: tuple[int, int, int],
                 schedule: Schedule | None = None) -> int:
    """Parameters a rank of stage ``pp_rank`` holds (its tp share) under ``schedule``'s placement
    (None: the layout's own schedule's);
    ``layer``: the (tp-split, replicated) parameters of one decoder layer and the head's replicated
    ones (the final norm)."""
    split, replicated, head = layer
    tp = layout.tp
    place = chunk_placement(layout, schedule)
    first, last = place.stage_of(0) == pp_rank, place.stage_of(place.chunks - 1) == pp_rank
    vocab = model.padded_vocab(tp) // tp * model.hidden_size
    params = sum(chunk_layer_counts(model, layout, pp_rank, schedule)) * (split // tp + replicated)
    if first:
        params += vocab
    if last:
        params += head + (0 if model.tie_embeddings and first else vocab)
    return params


def saved_bytes_per_token(model: ModelArgs, layout: Layout, seq: int, precision: str, kernels: str,
                          attention: str = "flash") -> float:
    """Bytes autograd keeps of one decoder layer per token of a rank's share of a micro-batch.

    Without recomputation (flash attention): the layer's input, its attention norm's output, the
    residual after attention and the MLP norm's output (sequence-parallel: the rank's 1/tp of the
    tokens; else whole on every tp rank); q and the attention output, k and v (heads split over
    tp; under cp the keys and values of every cp rank, and the output twice; with a QK-norm, per
    head or over the whole projection, q and k before it as well); the MLP's inner
    activations (the Triton SwiGLU keeps gate, up and their product; torch's also the SiLU; GELU its
    input and output); fp32 norm statistics and attention log-sum-exp, dropout masks. Unfused
    attention (Megatron before flash attention) also keeps its softmax, and its dropout mask, unless
    recomputed selectively; selective recomputation drops the log-sum-exp; full recomputation keeps
    the layer's input only."""
    w, tp, cp = weight_bytes(precision), layout.tp, layout.cp
    sp = tp if layout.sequence_parallel or tp == 1 else 1
    h, d = model.hidden_size, model.head_dim
    q, kv = model.num_heads * d / tp, model.num_kv_heads * d / tp
    if layout.recompute == "full":
        return w * h / sp
    stream = 3 if layer_spec(model).parallel_residual else 4
    f = model.ffn_hidden_size / tp
    mlp = 2 * f if model.mlp == "gelu" else (3 if kernels == "triton" else 4) * f
    # under cp the two query chunks' outputs are kept by their attention and, concatenated, by the
    # output projection: the attention output twice
    spec = layer_spec(model)
    # QK-norm (per head, or over the whole projection) keeps its inputs: q and k once more
    qk_norm = q + kv if spec.qk_norm or spec.full_qk_norm else 0
    kv_and_q = (2 if cp == 1 else 3) * q + 2 * kv * cp + qk_norm
    # rstd per norm (LayerNorm: mean and rstd)
    stats = 4 * 2 * (2 if model.mlp == "gelu" else 1) / sp
    lse = 4 * model.num_heads / tp if attention == "flash" and layout.recompute != "selective" \
        else 0
    dropout = 2 * h / sp if model.hidden_dropout > 0 else 0  # a bool mask per residual branch
    scores = 0.0
    # softmax (+ dropout mask and output)
    if attention == "unfused" and layout.recompute != "selective":
        scores = (w + 3 * (model.attention_dropout > 0)) * model.num_heads / tp * seq
    return w * (stream * h / sp + kv_and_q + mlp) + stats + lse + dropout + scores


@functools.cache
def _backward_start(schedule: Schedule, pp_rank: int, pp: int, vpp: int, micro_batches: int,
                    chunks: tuple[int, ...], head: int | None,
                    deferred: float) -> tuple[int, float, float, bool]:
    """At the backward that starts with the most activations held: the layers of its own micro-batch
    chunk, those of the others between their F and B, those between their B and W (a zero-bubble
    schedule's: each keeps ``deferred`` of a layer's activations for its W), and whether it is the
    head's chunk (``head``: this stage's chunk holding it, or None)."""
    best, held, waiting = (0, 0.0, 0.0, False), {}, {}
    for op in schedule.order(pp_rank, pp, vpp, micro_batches):
        key = (op.micro, op.chunk)
        if op.kind == "F":
            held[key] = chunks[op.chunk]
            continue
        if op.kind == "W":  # its weight gradients made: what the B left for it is freed
            del waiting[key]
            continue
        others, kept = sum(held.values()) - held[key], sum(waiting.values())
        if held[key] + others + deferred * kept > best[0] + best[1] + deferred * best[2]:
            best = (held[key], others, kept, op.chunk == head)
        if schedule.split_backward:
            waiting[key] = held[key]
        del held[key]
    return best


def _backward_working(model: ModelArgs, L: Layout, seq: int, tokens: int, head: bool,
                      precision: str, kernels: str, attention: str,
                      chunk_bytes: int) -> tuple[float, float]:
    """(activations made again, temporaries) of what a backward computes with, at the larger of two
    moments: on the stage with the head, its backward (a chunk of logits and the gradient of its
    input); then a layer's MLP backward — the gradients in and out of the layer and those of the
    MLP's input, gate and up (recomputed fully: with the layer's activations made again, the MLP's
    output already used)."""
    w, sp = weight_bytes(precision), L.tp if L.sequence_parallel or L.tp == 1 else 1
    h, f = model.hidden_size, model.ffn_hidden_size // L.tp
    grads = 2 * h / sp * tokens * w
    vocab_rows = model.padded_vocab(L.tp) // L.tp
    head_backward = min(tokens * vocab_rows * w, chunk_bytes) + 2 * tokens * h * w if head else 0.0
    if L.recompute != "full":
        return 0.0, max(grads + 3 * f * tokens * w, head_backward)
    redo = tokens * saved_bytes_per_token(model, L.replace(recompute="none"), seq, precision,
                                          kernels, attention)
    mlp_backward = grads + 2 * f * tokens * w
    return (redo, mlp_backward) if redo + mlp_backward > head_backward else (0.0, head_backward)


def stage_memory(model: ModelArgs, seq: int, layout: Layout, pp_rank: int, micro_batches: int, *,
                 layer: tuple[int, int, int], precision: str = "bf16",
                 schedule: str | Schedule = "auto",
                 kernels: str = "triton", bucket_mb: float = 32.0, attention: str = "flash",
                 fused_adamw: bool = True, chunk_bytes: int = HEAD_CHUNK_BYTES,
                 optimizer: OptimizerSpec = ADAMW) -> dict:
    """Bytes by part (:data:`PARTS`) on a rank of stage ``pp_rank`` at its peak, and their
    ``total``: ``micro_batches`` per step and dp rank; ``layer`` as for :func:`stage_params`;
    ``fused_adamw``: the Triton AdamW (``optim.impl`` triton, or auto on CUDA; fp32 or bf16
    moments), which keeps a bit of weight decay per parameter — unless Muon's AdamW part (torch's)
    or ``offload`` (the host steps with torch's AdamW) takes its place;
    ``chunk_bytes``: the output layer's chunk of logits; ``optimizer``: the state kept
    (``planner/optimizer.state_bytes``) and, under ``offload`` (``optim.offload``), kept in host
    memory: counted as ``host_optimizer`` and not in the total.

    The peak is taken at the backward that starts with the most activations held (the schedule's
    own order decides which): everything kept for the backward of its micro-batch chunk and of the
    others in flight, and what that backward computes with — the output layer's chunk of logits
    and its gradients (on the stage holding it), a layer's recomputation (full) and its backward's
    gradients, the fp32 gradients of the buckets being reduced (zero 2, 3)."""
    L, w = layout, weight_bytes(precision)
    n_shard = L.shard_ranks
    kind = resolve_schedule(schedule, L.pp, L.vpp, micro_batches, default=L.pp_schedule)
    params = stage_params(model, L, pp_rank, layer, kind)
    chunks = tuple(chunk_layer_counts(model, L, pp_rank, kind))
    tokens = L.micro_batch * seq // L.cp  # the rank's share of a micro-batch
    h, f = model.hidden_size, model.ffn_hidden_size // L.tp
    vocab_rows = model.padded_vocab(L.tp) // L.tp
    layer_params = layer[0] // L.tp + layer[1]

    out = dict.fromkeys(PARTS, 0.0)
    out["parameters"] = params * w / (n_shard if L.zero == 3 else 1)
    out["gradients"] = params * 4.0 / (n_shard if L.zero >= 2 else 1)
    muon = sum(chunks) * optimizer.muon_layer(model) / L.tp
    # the Triton AdamW's decay mask: where optim.impl runs it (fp32 or bf16 moments), never for
    # Muon's AdamW part (torch's) nor offloaded (the host steps with torch's)
    fused = fused_adamw and not optimizer.muon and not optimizer.offload
    # offloaded, fp32 weights too have a master of their own: the host's copy
    masters = "bf16" if optimizer.offload else precision
    out["optimizer"] = state_bytes(params, muon, masters, optimizer.name,
                                   optimizer.moments_dtype, fused) / (n_shard if L.zero >= 1 else 1)
    steady = kind.memory_micro(L.pp, micro_batches)
    per_layer = tokens * saved_bytes_per_token(model, L, seq, precision, kernels, attention)
    # what a chunk whose B ran keeps for its W, per layer (the output layer's input, h a token, left
    # out)
    deferred = tokens * deferred_bytes_per_token(model, L.tp, w)
    own, others, waiting, head = _backward_start(kind, pp_rank, L.pp, L.vpp, steady, chunks,
                                                 head_chunk(L, pp_rank, kind),
                                                 round(64 * deferred / per_layer) / 64)
    out["activations"] = own * per_layer
    out["pipeline_in_flight"] = others * per_layer + waiting * deferred
    # the full fp32 gradients of the bucket filling and of the one reducing: a layer's
    if L.zero >= 2:
        # (zero 3) or a parameter's
        bucket = layer_params if L.zero == 3 else max(bucket_mb * 2**20 / 4, f * h)
        # (the output layer's own)
        out["gradients"] += 4.0 * (bucket + (vocab_rows * h if head else bucket))
    if L.zero == 3:  # every chunk's root, the layer computing and the next one, prefetched (the one
        # that follows the chunk's second layer is its first: by its backward, the second has been
        # freed)
        roots = params - sum(chunks) * layer_params
        out["zero3_gathered"] = (max(1, min(2, max(chunks) - 1)) * layer_params + roots) * w
    if L.sequence_parallel:  # an input gathered (again) for the weight gradients, and its pieces
        out["comm_buffers"] = 2.0 * tokens * h * w
    redone, out["temporary"] = _backward_working(model, L, seq, tokens, head, precision, kernels,
                                                 attention, chunk_bytes)
    out["activations"] += redone
    if optimizer.offload:  # masters and moments in host memory: no device bytes
        out["host_optimizer"], out["optimizer"] = out["optimizer"], 0.0
    out["total"] = sum(out[k] for k in PARTS)
    return out
