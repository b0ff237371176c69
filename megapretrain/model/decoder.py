"""The model chunk shared by every family: optional embedding, decoder layers, optional final norm
and head, built from the family's :class:`~.layers.LayerSpec` (model/families.py).

Parameter names are the chunk's own, the same for every family (``embed_tokens``,
``layers.{i}.self_attn.q_proj``, ``norm``, ``lm_head``, ... — Hugging Face's Llama names without
its ``model.`` prefix); a family's Hugging Face adapter maps them to its checkpoints' names. Layers
are keyed by their *global* index, so a pipeline stage holding layers 4..7 names them ``layers.4``
... ``layers.7`` — names, and so initial values, are layout-invariant.

Under context parallelism (``cp``) a chunk holds its rank's share of every sequence
(``parallel/context.py``): attention all-gathers the keys and values over cp and masks by global
position; everything else is local to the rank's tokens. Document masking is described by O(s)
document ids (:class:`~.attention.DocumentMask`), never by an s × s mask, unless
``model.attention=sdpa`` asks for one (``model/attention.py``). A layer with a sliding window
(``ModelArgs.window``) gets the same mask under its window: a chunk prepares one mask per window
its layers use, once per micro-batch, and hands each layer its own.

:class:`ModelChunk` is what the trainer, the pipeline schedules, the optimizer, checkpointing and
``model/build.py`` rely on of a chunk; :class:`DecoderModel` is the one implementation.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..kernels.dispatch import device_type
from ..parallel.context import local_positions
from ..parallel.cross_entropy import vocab_parallel_linear_cross_entropy
from ..parallel.fp8 import WeightCasts
from ..parallel.random import RNGTracker
from ..parallel.specs import ParamSpec, collect_specs
from ..parallel.state import Group
from ..parallel.tensor import DeferredGrads, SavedShards, enter_tp_region, init_shard_, linear
from .args import ModelArgs
from .attention import ATTENTION, DocumentMask
from .context_attention import ring_mask
from .families import layer_spec
from .fused_loss import linear_cross_entropy_per_token
from .layers import KERNELS, ColumnLinear, DecoderLayer, Embedding, rope_tables


class ModelChunk(Protocol):
    """What the rest of the program reads of a model chunk (one pipeline stage's share of the
    layers, or all of them). It is also an ``nn.Module``: the trainer calls ``train()``/``eval()``,
    parallel/ registers hooks on its modules, the optimizer reads ``named_parameters()``.

    - ``forward(x, targets=None, docs=None, *, loss_grad_scale=None)``: token ids (b, s) when
      ``pre_process`` else hidden states (b, s, h) in; per-token losses (b, s) when
      ``post_process`` and ``targets`` are given, logits (b, s, v/tp) when ``post_process``
      without targets, else hidden states (b, s, h) for the next stage (trainer, pipeline).
    - ``param_specs()``: each parameter's :class:`ParamSpec`, in ``named_parameters`` order
      (build.py's table, read by the optimizer, dp buffers, checkpoints, conversion, planner).
    - ``init_weights(seed)`` / ``init_parameter(name, out, seed, spec)``: layout-invariant initial
      values, all at once or one parameter into any tensor of its shape (ZeRO-3's deferred init).
    - ``output_weight()``: the head's (v/tp, h) weight (the embedding's when tied).
    - ``args`` (the :class:`ModelArgs`), ``pre_process`` / ``post_process`` (embeds / holds the
      head), ``layers`` (``ModuleDict`` by global index: regional compile, ZeRO-3 units),
      ``grad_sink`` (set by the optimizer: a weakref to the buffers of the fp32 main grads),
      ``fp8_weights`` (ZeRO-3's weights gathered as FP8, which the data-parallel buffers fill and
      the FP8 linears read, or None: ``model/fp8.py``), ``deferred`` (a zero-bubble schedule's
      :class:`~megapretrain.parallel.tensor.DeferredGrads`, which the output layer's loss leaves
      its weight gradient to, as the linears do: ``defer_weight_grads``, or None).
    """
    args: ModelArgs
    pre_process: bool
    post_process: bool
    layers: nn.ModuleDict
    grad_sink: object
    fp8_weights: WeightCasts | None
    deferred: DeferredGrads | None

    def __call__(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                 docs: Documents | None = None, *,
                 loss_grad_scale: float | None = None) -> torch.Tensor: ...

    def param_specs(self) -> dict[str, ParamSpec]: ...

    def init_weights(self, seed: int) -> None: ...

    def init_parameter(self, name: str, out: torch.Tensor, seed: int, spec: ParamSpec) -> None: ...

    def output_weight(self) -> torch.Tensor: ...


@dataclass
class Documents:
    """The documents packed into a micro-batch (``data.reset_position_ids`` /
    ``reset_attention_mask``): each token's position inside its document, and which tokens it may
    attend to — as document ids and positions, O(s) per sample. Under context parallelism both are
    this rank's share: its tokens' positions, its queries' documents and global positions (against
    every key)."""
    position_ids: torch.Tensor | None  # (b, s) int64: positions restarting at each document, or
    #                                    None
    mask: DocumentMask | None          # causal and within the document, or None (causal only)


def documents(tokens: torch.Tensor, eod: int, reset_attention_mask: bool, reset_position_ids: bool,
              cp: Group | None = None) -> Documents:
    """The document structure of (b, s) input ids: a document ends with its ``eod`` token, the next
    one starts after it (Megatron's ``get_ltor_masks_and_position_ids``). ``tokens`` are the whole
    sequence on every cp rank; with ``cp`` the result is this rank's share, each token judged by
    its global position and document, against every key in global order."""
    b, s = tokens.shape
    is_eod = tokens == eod
    # (b, s): EODs before each token
    doc = torch.cumsum(is_eod, dim=1, dtype=torch.int32) - is_eod.int()
    queries = local_positions(s, cp, tokens.device) if cp is not None \
        else torch.arange(s, device=tokens.device)
    positions = mask = None
    if reset_position_ids:
        idx = torch.arange(s, device=tokens.device).expand(b, s)
        starts = torch.ones_like(is_eod)
        starts[:, 1:] = is_eod[:, :-1]  # a token after an EOD starts a document
        positions = idx - torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)),
                                       dim=1).values
        positions = positions[:, queries]  # (b, s/cp): this rank's tokens
    if reset_attention_mask:
        # (b, s/cp), (b, s), (s/cp,)
        mask = DocumentMask(q_doc=doc[:, queries], k_doc=doc, q_pos=queries)
    return Documents(positions, mask)



class DecoderModel(nn.Module):
    """One pipeline chunk: optional embedding, the decoder layers ``layer_ids``, optional head,
    assembled from the parts ``args.family`` chooses (its :class:`~.layers.LayerSpec`).

    ``forward`` takes token ids (first chunk) or hidden states, and returns per-token losses (b, s)
    when the chunk has the head and ``targets`` are given, else hidden states. ``param_specs``
    declares how each of its parameters is laid out (see ``parallel/specs.py``). With a ``cp``
    group of several ranks the inputs are this rank's tokens (``parallel/context.py``'s
    ``split_to_cp``); the parameters are the same on every cp rank.
    """

    def __init__(self, args: ModelArgs, tp: Group, *, layer_ids: list[int] | None = None,
                 pre_process: bool = True, post_process: bool = True,
                 sequence_parallel: bool = False, recompute: str = "none",
                 rng: RNGTracker | None = None, kernels: str = "torch", z_loss: float = 0.0,
                 cp: Group | None = None, cp_comm: str = "allgather", attention: str = "sdpa",
                 head_on_stage: bool = False, stage_embedding: Embedding | None = None,
                 dtype=torch.float32, device=None):
        super().__init__()
        if kernels not in KERNELS:
            raise ValueError(f"kernels={kernels!r} must be one of {KERNELS} (model/build.py "
                             "resolves auto)")
        if attention not in ATTENTION:
            raise ValueError(f"attention={attention!r} must be one of {ATTENTION} (model/build.py "
                             "resolves auto)")
        self.attention = attention  # the kernel of document-masked attention (model/attention.py)
        self.args, self.tp = args, tp
        self.cp = cp if cp is not None else Group("cp", [0])
        # parallel/context.py: how attention meets cp
        self.cp_comm = cp_comm if self.cp.size > 1 else "allgather"
        self.kernels, self.z_loss = kernels, z_loss
        # weakref to the buffers of the fp32 main grads (MixedPrecisionAdamW.hook_models)
        self.grad_sink = None
        # a zero-bubble schedule's W makes the output layer's weight gradient (defer_weight_grads)
        self.deferred = None
        self.fp8_weights: WeightCasts | None = None  # ZeRO-3's FP8-gathered weights (model/fp8.py)
        # dropout streams (see parallel/random.py); the trainer passes one seeded by train.seed
        self.rng = rng if rng is not None else RNGTracker(0, tp.rank, device or "cpu")
        self.sequence_parallel = sequence_parallel and tp.size > 1
        # what backward keeps of the column-parallel linears' gathered input: the seq shard
        self.saved_shards = SavedShards() if self.sequence_parallel else None
        self.recompute = recompute
        self.pre_process, self.post_process = pre_process, post_process
        self.spec = layer_spec(args)
        layer_ids = list(range(args.num_layers)) if layer_ids is None else layer_ids
        kw = dict(dtype=dtype, device=device)
        padded_vocab = args.padded_vocab(tp.size)
        # V placement puts the head on the embedding's stage: a tied head then uses that chunk's
        # embedding (``stage_embedding``, not this chunk's parameter), and the embedding's chunk
        # knows its weight has a second use there (``head_on_stage``)
        self.head_on_stage = head_on_stage or (pre_process and post_process)
        self._stage_embedding = weakref.ref(stage_embedding) if stage_embedding is not None \
            else None
        if pre_process or (post_process and args.tie_embeddings and stage_embedding is None):
            self.embed_tokens = Embedding(padded_vocab, args.hidden_size, tp,
                                       init_std=args.init_std, real_vocab=args.vocab_size,
                                       sequence_parallel=self.sequence_parallel, **kw)
        self.layers = nn.ModuleDict({
            str(i): DecoderLayer(args, self.spec, tp, sequence_parallel=self.sequence_parallel,
                                 recompute=recompute, rng=self.rng, saved=self.saved_shards,
                                 kernels=kernels, cp=self.cp, cp_comm=self.cp_comm,
                                 window=args.window(i), rope=args.rope(i), **kw)
            for i in layer_ids})
        if post_process:
            self.norm = self.spec.norm(args.hidden_size, args.norm_eps,
                                       partial_grad=self.sequence_parallel, kernels=kernels, **kw)
            if not args.tie_embeddings:
                self.lm_head = ColumnLinear(args.hidden_size, padded_vocab, tp,
                                            init_std=args.init_std, vocab_rows=args.vocab_size,
                                            **kw)
        self._rope_cache: dict = {}
        self._context_cache: dict = {}  # context parallelism: this rank's rotary tables
        # without documents: ring attention's plans, and windowed layers' masks, per sequence length
        self._ring_cache: dict = {}
        self._window_cache: dict = {}

    # -- layout and initialization -----------------------------------------------------------------

    def param_specs(self) -> dict[str, ParamSpec]:
        """Every parameter's spec, in ``named_parameters`` order. A tied embedding held by two
        chunks (first and last pipeline stage) is marked ``tied``; the last stage's copy is the
        ``duplicate``. One that the stage's head uses from another chunk (V placement) gets its
        gradient from two backwards per micro-batch (``uses``)."""
        specs, tp = {}, self.tp.size
        for name, module in self.named_children():
            if name == "layers":
                for i, layer in self.layers.items():
                    specs.update(collect_specs(layer, tp, prefix=f"layers.{i}", layer=int(i)))
            elif name == "embed_tokens":
                tied = self.args.tie_embeddings and not self.head_on_stage
                shared = self.args.tie_embeddings and self.head_on_stage and not self.post_process
                specs.update(collect_specs(module, tp, prefix=name, tied=tied,
                                           duplicate=tied and not self.pre_process, uses=2 if shared
                                           else 1))
            else:
                specs.update(collect_specs(module, tp, prefix=name))
        return specs

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Give every parameter its layout-invariant initial value (see :meth:`init_parameter`)."""
        specs = self.param_specs()
        for name, param in self.named_parameters():
            self.init_parameter(name, param, seed, specs[name])

    @torch.no_grad()
    def init_parameter(self, name: str, out: torch.Tensor, seed: int, spec: ParamSpec) -> None:
        """Write parameter ``name``'s initial value into ``out``, a tensor of its shape, as its
        layer declared (``spec.init``): a constant, or this rank's shard of the global normal tensor
        drawn by name (``init_shard_``). ``out`` need not be the parameter itself (ZeRO-3 writes
        each unit straight into its gathered buffer: parallel/data.py)."""
        init = spec.init
        if init is None:
            raise TypeError(f"parameter '{name}' declares no initialization (Sharding.init, "
                            "parallel/specs.py)")
        if init.kind == "normal":
            init_shard_(out, spec, seed, init.std, self.tp)
        else:
            out.fill_({"ones": 1.0, "zeros": 0.0}[init.kind])

    # -- forward ----------------------------------------------------------------------------------

    def _rope(self, seq: int, like: torch.Tensor, rope: tuple):
        """cos, sin (s, r) for the global positions 0..seq-1 (r: the rotated dims of a head) under
        the rotary settings ``rope`` (``ModelArgs.rope``: base, scaling)."""
        key = (seq, like.device, like.dtype)
        if key not in self._rope_cache:  # kept for the latest length only
            self._rope_cache = {key: {}}
        tables = self._rope_cache[key]  # rope -> (cos, sin)
        if rope not in tables:
            theta, scaling = rope
            tables[rope] = rope_tables(seq, self.args.rotary_dim, theta, like.device, like.dtype,
                                       dict(scaling) if scaling else None)
        return tables[rope]

    def _context_tables(self, seq: int, like: torch.Tensor, rope: tuple):
        """Under context parallelism: cos, sin (s/cp, d) of this rank's tokens, rotated by their
        global positions."""
        key = (seq, like.device, like.dtype)
        if key not in self._context_cache:
            self._context_cache = {key: {}}
        tables = self._context_cache[key]  # rope -> (cos, sin)
        if rope not in tables:
            cos, sin = self._rope(seq, like, rope)
            mine = local_positions(seq, self.cp, like.device)
            tables[rope] = (cos[mine], sin[mine])  # (s/cp, d) each
        return tables[rope]

    def _tables(self, seq: int, x: torch.Tensor, docs: Documents | None, rope: tuple):
        """cos, sin of this rank's tokens under the rotary settings ``rope``: (s, d), or
        (b, 1, s, d) when positions restart per document."""
        if docs is not None and docs.position_ids is not None:
            cos, sin = self._rope(seq, x, rope)  # (s·cp, d): every global position
            # (b, 1, s, d)
            return cos[docs.position_ids].unsqueeze(1), sin[docs.position_ids].unsqueeze(1)
        if self.cp.size > 1:
            return self._context_tables(seq, x, rope)  # (s, d)
        return self._rope(seq, x, rope)  # (s, d)

    def _positions(self, x: torch.Tensor, docs: Documents | None):
        """For each rotary setting the chunk's layers use (``ModelArgs.rope``: OLMo 3's sliding
        and full layers may differ), cos and sin of this rank's tokens (see :meth:`_tables`); and,
        for each sliding window they use (0: none), the mask in the form this model's attention
        kernel reads, built once per micro-batch (None: causal by global position)."""
        # global length
        seq = x.shape[1] * (self.tp.size if self.sequence_parallel else 1) * self.cp.size
        tables = {rope: self._tables(seq, x, docs, rope)
                  for rope in {layer.rope for layer in self.layers.values()}}
        documents = docs.mask if docs is not None else None
        masks = {window: self._mask(seq, x.device, self._windowed(seq, x.device, documents, window))
                 for window in {layer.window for layer in self.layers.values()}}
        return tables, masks

    def _windowed(self, seq: int, device, documents: DocumentMask | None,
                  window: int) -> DocumentMask | None:
        """The micro-batch's document mask under a sliding ``window`` (0: as it is); without
        documents, this rank's queries against every position in one document (made once per
        sequence length)."""
        if documents is not None or not window:
            return documents.windowed(window) if documents is not None else None
        if (seq, device) not in self._window_cache:  # kept for the latest length only
            self._window_cache = {(seq, device): {}}
        masks = self._window_cache[seq, device]  # window -> its mask
        if window not in masks:
            masks[window] = DocumentMask.one_document(local_positions(seq, self.cp, device), seq,
                                                      window)
        return masks[window]

    def _mask(self, seq: int, device, documents: DocumentMask | None):
        """What attention reads of the micro-batch's mask: the document mask prepared for the
        model's kernel (all-to-all cp: for every query of the sample), or under ring attention the
        ring's plans (with or without documents), or None (causal by global position)."""
        if self.cp_comm == "ring":
            if documents is not None:
                return documents.cached("ring", lambda: ring_mask(self.cp, seq, device, documents))
            key = (seq, device)
            if key not in self._ring_cache:
                self._ring_cache = {key: ring_mask(self.cp, seq, device)}
            return self._ring_cache[key]
        if documents is None:
            return None
        return (documents.whole() if self.cp_comm == "a2a" else documents).prepare(self.attention)

    def _layer(self, layer: nn.Module, x, cos, sin, mask=None):
        if self.recompute == "full" and self.training:
            return checkpoint(layer, x, cos, sin, mask, use_reentrant=False,
                              context_fn=self.rng.checkpoint_context)
        return layer(x, cos, sin, mask)

    def output_weight(self) -> torch.Tensor:
        if not self.args.tie_embeddings:
            return self.lm_head.weight
        return (self._stage_embedding() if self._stage_embedding is not None
                else self.embed_tokens).weight

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                docs: Documents | None = None, *,
                loss_grad_scale: float | None = None) -> torch.Tensor:
        """``docs``: the micro-batch's document structure (positions, attention mask), the same on
        every pipeline chunk, or None for one causal stream per sample. ``loss_grad_scale``: the
        gradient the backward will bring to every per-token loss (the trainer backpropagates
        their sum times it), which lets the chunked loss add the output layer's weight gradient
        straight into its fp32 main grad in the forward (``model/fused_loss.py``)."""
        if self.saved_shards is None:
            return self._forward(x, targets, docs, loss_grad_scale)
        with self.saved_shards.hooks():  # backward keeps seq shards, not gathered sequences
            return self._forward(x, targets, docs, loss_grad_scale)

    def _grad_sink(self, weight: torch.Tensor):
        """The buffers that hold ``weight``'s fp32 main grad, for the loss to add its gradient into,
        or None: none, or the weight (tied) also gets a gradient from an embedding on this stage."""
        sink = self.grad_sink() if self.grad_sink is not None else None
        embedded_here = self.pre_process or self._stage_embedding is not None
        if sink is None or not sink.holds(weight) or (embedded_here and self.args.tie_embeddings):
            return None
        return sink

    def _forward(self, x: torch.Tensor, targets: torch.Tensor | None, docs: Documents | None,
                 loss_grad_scale: float | None = None) -> torch.Tensor:
        if self.pre_process:
            x = self.embed_tokens(x)  # (b, s) ids -> (b, s, h)
        tables, masks = self._positions(x, docs)
        for layer in self.layers.values():
            x = self._layer(layer, x, *tables[layer.rope], masks[layer.window])  # (b, s, h)
        if not self.post_process:
            return x
        # (b, s, h)
        x = enter_tp_region(self.norm(x), self.tp, self.sequence_parallel, self.saved_shards)
        weight = self.output_weight()  # (v/tp, h)
        # a tied weight embedded by this same chunk gets both gradients in one backward: autograd's
        # (one fold into the main grad, as its spec counts), so the output layer's part is not
        # deferred
        deferred = None if self.pre_process and self.args.tie_embeddings else self.deferred
        if targets is None:
            return linear(x, weight, None, deferred)  # (b, s, v/tp) logits
        vocab_start = self.tp.rank * weight.shape[0]
        # chunks of tokens, no (b, s, v/tp) logits at all: the kernels' path, and on CPU the torch
        # reference of the same algorithm (a sixth of the one-buffer loss's working memory, as fast)
        if self.kernels == "triton" or self.z_loss or device_type(x.device) == "cpu":
            return linear_cross_entropy_per_token(x, weight, targets, self.tp, vocab_start,
                                                  self.args.vocab_size, z_loss=self.z_loss,
                                                  reference=self.kernels == "torch",
                                                  grad_sink=self._grad_sink(weight),
                                                  # (b, s)
                                                  grad_scale=loss_grad_scale, deferred=deferred)
        # output layer + loss in one op: the (b, s, v/tp) logits stay private, so their buffer can
        # hold their gradient
        return vocab_parallel_linear_cross_entropy(x, weight, targets, self.tp, vocab_start,
                                                   # (b, s)
                                                   self.args.vocab_size, deferred=deferred)


@functools.lru_cache(maxsize=256)
def _parameter_counts(args: ModelArgs) -> tuple[int, int, int]:
    """(embedding and head, one decoder layer, the rest) of ``args``'s model, read off the spec
    table of a one-layer model built on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = DecoderModel(args, Group("tp", [0], None, 0), layer_ids=[0],
                             rng=RNGTracker(0, 0, "cpu"), device="meta")
    vocab = layer = rest = 0
    for spec in model.param_specs().values():
        if spec.vocab:
            vocab += spec.numel
        elif spec.layer is not None:
            layer += spec.numel
        else:
            rest += spec.numel
    return vocab, layer, rest


def num_parameters(args: ModelArgs, *, embeddings: bool = True) -> int:
    """Parameters of the whole (unpadded-vocabulary) model, independent of the layout: the sum of
    its parameter-spec table, whatever the family (a tied embedding counted once)."""
    vocab, layer, rest = _parameter_counts(args)
    return args.num_layers * layer + rest + (vocab if embeddings else 0)


def flops_per_token(args: ModelArgs, seq_length: int) -> float:
    """Training FLOPs per token: 6 × (matmul parameters, output layer included) + attention, for
    every family (its matmuls are read off its spec table; norms and biases, a rounding error, ride
    along).

    Attention scores and weighted sums cost 12·layers·hidden·seq per token (forward + backward),
    counted as in PaLM's appendix B without the causal halving. A sliding-window layer computes
    only the pairs inside its window, min(window, i + 1) keys for the query at i: its share of
    that, scaled by the fraction of causal pairs it keeps (``ModelArgs.attention_fraction``; 1
    for a window of at least ``seq_length``).
    """
    matmul_params = num_parameters(args, embeddings=False) + args.vocab_size * args.hidden_size
    attention = 12.0 * args.num_layers * args.hidden_size * seq_length
    return 6.0 * matmul_params + attention * args.attention_fraction(seq_length)
