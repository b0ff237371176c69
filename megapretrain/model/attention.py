"""Attention under document masking without an s × s mask or s × s scores (``model.attention``).

With ``data.reset_attention_mask`` a token attends to the earlier tokens of its own document. What
attention needs to know of that is O(s): each query's document and global position, each key's
document (keys are in global order: all of a sample's positions, gathered over cp).
:class:`DocumentMask` holds that, once per micro-batch, and turns it — once, shared by every layer
and by the recomputation of any of them — into what the chosen kernel reads:

- ``flex``: torch's FlexAttention (compiled to Triton on CUDA) with a block mask built straight
  from the documents' bounds per 128 × 128 block (never from a dense mask): blocks no query may see
  are skipped, whole blocks inside one document run unmasked, and the rest test
  ``same document and key position ≤ query position`` per pair in the kernel.
- ``blockwise``: ``model/blockwise.py``, tiles with an online softmax and their own backward, in
  plain torch (so on CPU, where FlexAttention has no backward), from the same bounds per tile.
- ``sdpa``: ``scaled_dot_product_attention`` with the dense (b, 1, s_q, s_k) mask, as before: with a
  mask and grouped-query heads CUDA runs its math kernel, (b, heads, s_q, s_k) scores per layer.

``model.attention: auto`` resolves (:func:`resolve_attention`, called where ``model.kernels`` is)
to flex on CUDA, blockwise elsewhere, and sdpa when attention dropout is on (neither of the
others has it). Without document masking every choice runs SDPA's causal kernels
(:func:`causal_attention`: the plain ``is_causal`` path, and the lower-right chunks of context
parallelism): nothing changes there.

Sliding-window attention (``model.sliding_window`` on the layers ``model.layer_types`` marks) is
one more condition on the same O(s) data: a key fewer than ``window`` positions before the query
(Hugging Face's ``i − window < j ≤ i``). A :class:`DocumentMask` carries its window; the blocks
and tiles wholly outside it are skipped like those of other documents, and the rest test it per
pair. A windowed layer always runs the masked kernel ``model.attention`` resolves to (without
document masking too, then with every token in one document); full-attention layers keep
SDPA's causal kernels when there are no documents.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from ..config import Config
from ..errors import ConfigError
from ..kernels.dispatch import device_type
from ..parallel.context import causal_mask
from ..parallel.layout import Layout
from .args import FULL, SLIDING, ModelArgs, layer_types
from .blockwise import TilePlan, blockwise_attention

ATTENTION = ("sdpa", "flex", "blockwise")  # model.attention once resolved
FLEX_BLOCK = 128  # FlexAttention's block (its default), rows and columns
# blockwise's tile, rows and columns. fwd + bwd at seq 4096 on one CPU thread (8/2 heads of 64):
# two long documents 2.6 / 2.3 / 3.3 s at tiles 128 / 256 / 512, documents of 64-448 tokens 1.0 /
# 1.5 / 3.0 s
TILE = 256
LARGE_SCORES = 256 * 2**20  # sdpa with documents warns above this many bytes of scores per layer


def _bounds(x: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of each run of ``size`` entries along the last dimension (the last may be
    shorter)."""
    pad = -x.shape[-1] % size
    if pad:  # repeating the last entry changes no minimum or maximum
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)
    runs = x.unflatten(-1, (-1, size))  # (..., blocks, size)
    return runs.amin(-1), runs.amax(-1)


@dataclass
class DocumentMask:
    """Which keys each query may attend to under document masking, as O(s) data: a key of the
    query's own document at its global position or before. Queries are this rank's tokens (all
    of them without context parallelism); keys are all of a sample's positions in global order."""
    q_doc: torch.Tensor  # (b, s_q) int32: each query's document (EODs before it in its sample)
    k_doc: torch.Tensor  # (b, s_k) int32: each key's document
    q_pos: torch.Tensor  # (s_q,) int64: each query's global position
    # (s_k,) int64: each key's global position; None: keys in global order (a key's is its index).
    # Ring attention's blocks hold another cp rank's keys (model/context_attention.py)
    k_pos: torch.Tensor | None = None
    window: int = 0  # a key must be fewer than this many positions before its query; 0: no window
    _prepared: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _windows: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def one_document(cls, q_pos: torch.Tensor, num_keys: int, window: int) -> DocumentMask:
        """Causal attention under a sliding ``window`` without document masking: queries at
        ``q_pos`` (s_q,), keys every position 0..num_keys-1, all in one document (ids (1, s):
        the same for every sample)."""
        return cls(torch.zeros(1, len(q_pos), dtype=torch.int32, device=q_pos.device),
                   torch.zeros(1, num_keys, dtype=torch.int32, device=q_pos.device), q_pos,
                   window=window)

    def windowed(self, window: int) -> DocumentMask:
        """The same documents under a sliding ``window`` (0: this mask), made once per micro-batch
        and window; it prepares and caches its own kernel inputs."""
        if not window:
            return self
        if window not in self._windows:
            self._windows[window] = DocumentMask(self.q_doc, self.k_doc, self.q_pos, self.k_pos,
                                                 window)
        return self._windows[window]

    def key_positions(self) -> torch.Tensor:
        """(s_k,) int64: each key's global position."""
        if self.k_pos is not None:
            return self.k_pos
        return torch.arange(self.k_doc.shape[1], device=self.k_doc.device)

    def dense(self) -> torch.Tensor:
        """(b, 1, s_q, s_k) bool: the mask itself (sdpa's input, and the tests' reference)."""
        return causal_mask(self.q_pos, self.key_positions(), self.q_doc, self.k_doc, self.window)

    def whole(self) -> DocumentMask:
        """The mask of every query of the sample, keys in global order (all-to-all context
        parallelism: each rank attends over the whole sequence for its share of the heads);
        made once."""
        return self.cached("whole", lambda: DocumentMask(self.k_doc, self.k_doc,
                                                         self.key_positions(), window=self.window))

    def cached(self, key, build):
        """``build()``, made once per micro-batch for ``key`` and kept (one kind per model: the
        latest only); every layer and every recomputation of the micro-batch shares it."""
        if key not in self._prepared:
            self._prepared = {key: build()}
        return self._prepared[key]

    def blocks(self, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(b, s_q/rows, s_k/cols) bool each, blocks of ``rows`` queries × ``cols`` keys: those with
        some allowed pair (exactly, or a few more: a block straddling a cp chunk boundary is judged
        by its bounds), and those whose every pair is allowed (exactly). Read off each block's
        bounds of positions and documents: documents never decrease along global positions. Under
        a window a block has some pair when its nearest (lowest query, highest key) is inside it,
        all when its farthest (highest query, lowest key) is."""
        q_lo, q_hi = _bounds(self.q_pos, rows)  # (nq,)
        qd_lo, qd_hi = _bounds(self.q_doc, rows)  # (b, nq)
        kd_lo, kd_hi = _bounds(self.k_doc, cols)  # (b, nk)
        # (nk,): each block's lowest and highest position
        k_first, k_last = _bounds(self.key_positions(), cols)
        # (b, nq, nk)
        overlap = (kd_lo[:, None, :] <= qd_hi[:, :, None]) & (qd_lo[:, :, None] <= kd_hi[:, None,
                                                                                         :])
        some = overlap & (k_first[None, :] <= q_hi[:, None])
        one_doc = (qd_lo == qd_hi)[:, :,
                                   None] & (kd_lo == kd_hi)[:, None,
                                                            :] & (qd_lo[:, :,
                                                                        None] == kd_lo[:, None, :])
        full = one_doc & (k_last[None, :] <= q_lo[:, None])
        if self.window:
            some = some & (q_lo[:, None] - k_last[None, :] < self.window)
            full = full & (q_hi[:, None] - k_first[None, :] < self.window)
        return some, full

    def prepare(self, kind: str, tile: int = TILE):
        """What the ``kind`` kernel reads (see the module docstring), built once per micro-batch and
        kind: every layer, every chunk of the stage and every recomputation gets the same object."""
        builders = {"sdpa": lambda: DenseMask(self.dense()),
                    "flex": lambda: FlexMask(self._block_mask()),
                    "blockwise": lambda: TileMask(self.tile_plan(tile))}
        if kind not in builders:
            raise ValueError(f"attention kind {kind!r} is not one of {ATTENTION}")
        return self.cached((kind, tile), builders[kind])

    def _allowed(self, rows: slice, cols: slice) -> torch.Tensor:
        """(b, rows, cols) bool: the mask on one block, from the O(s) data."""
        keys = self.key_positions()[cols]
        behind = self.q_pos[rows, None] - keys[None, :]  # (rows, cols)
        causal = (behind >= 0) & (behind < self.window) if self.window else behind >= 0
        return causal[None] & (self.q_doc[:, rows, None] == self.k_doc[:, None, cols])

    def tile_plan(self, tile: int = TILE) -> TilePlan:
        """Blockwise's plan: per query tile, the key tiles some sample needs, a tile mask unless
        every sample's pairs are all allowed (the samples of a micro-batch share one plan)."""
        some, full = self.blocks(tile, tile)  # (b, nq, nk)
        # which tiles to run is a decision of the Python loop over them: the one host read (a sync
        # on a GPU, where flex needs none) of a blockwise micro-batch, both maps in one copy
        some, full = torch.stack([some.any(0), full.all(0)]).tolist()  # (nq, nk) each
        s_q, s_k = self.q_doc.shape[1], self.k_doc.shape[1]
        rows = []
        for i, (needed, whole) in enumerate(zip(some, full)):
            q = slice(i * tile, min((i + 1) * tile, s_q))
            keys = []
            for j in (j for j, hit in enumerate(needed) if hit):
                k = slice(j * tile, min((j + 1) * tile, s_k))
                keys.append((k.start, k.stop, None if whole[j]
                             else ~self._allowed(q, k)[:, None, None]))
            rows.append((q.start, q.stop, tuple(keys)))
        return TilePlan(tuple(rows), s_k)

    def _block_mask(self):
        """FlexAttention's BlockMask: per 128-query block, the key blocks to compute partially (the
        mask function decides each pair) and fully, from :meth:`blocks` (no dense mask built)."""
        from torch.nn.attention.flex_attention import BlockMask

        some, full = self.blocks(FLEX_BLOCK, FLEX_BLOCK)  # (b, nq, nk)
        partial = some & ~full
        q_doc, k_doc, q_pos, k_pos = self.q_doc, self.k_doc, self.q_pos, self.k_pos
        window, shared = self.window, q_doc.shape[0] == 1  # shared: one row for every sample

        def mask_mod(b, h, q_idx, kv_idx):  # keys in global order unless k_pos says otherwise
            position = kv_idx if k_pos is None else k_pos[kv_idx]
            row = 0 if shared else b
            allowed = (q_doc[row, q_idx] == k_doc[row, kv_idx]) & (position <= q_pos[q_idx])
            if window:  # a sliding window: fewer than ``window`` positions back
                allowed = allowed & (q_pos[q_idx] - position < window)
            return allowed

        # counts (b, 1, nq), indices first
        def indexed(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # (b, nq, nk): listed ones first
            order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True)
            return blocks.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

        return BlockMask.from_kv_blocks(*indexed(partial), *indexed(full),
                                        BLOCK_SIZE=(FLEX_BLOCK, FLEX_BLOCK), mask_mod=mask_mod,
                                        seq_lengths=(q_doc.shape[1], k_doc.shape[1]))


# -- causal attention, without document masking ---------------------------------------------------

FLASH_DTYPES = (torch.float16, torch.bfloat16)  # what a GPU's flash kernel computes in
FLASH_MAX_HEAD_DIM = 256


def _lower_right(queries: int, keys: int):
    """``causal_lower_right(queries, keys)`` (a ``CausalBias``), made outside any dispatch mode:
    torch builds that tensor subclass with a legacy constructor, which fails under one (fake
    tensors, FLOP and memory counters)."""
    # imported here: torch.nn.attention.bias imports Dynamo, a second of every run's start-up
    from torch.nn.attention.bias import causal_lower_right

    with _disable_current_modes():
        return causal_lower_right(queries, keys)


def _simulated_gpu_flash(q: torch.Tensor) -> bool:
    """Whether ``q`` stands for a GPU's queries that torch runs in its flash kernel: a simulated
    CUDA rank (fake CPU tensors for which ``kernels.dispatch.device_type`` answers cuda:
    ``simulate/``),
    fp16 or bf16, a head dim that is a multiple of 8 up to 256 (torch's flash rules on sm80+).
    Never while torch.compile traces: a simulation runs eager, and reading the simulated device (a
    context variable) would break the graph."""
    if torch.compiler.is_compiling():
        return False
    return (q.device.type != "cuda" and device_type(q.device) == "cuda" and q.dtype in FLASH_DTYPES
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= FLASH_MAX_HEAD_DIM)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     dropout: float) -> torch.Tensor:
    """Causal attention of (b, n, s_q, d) queries at the last s_q of the (b, k, s_k, d) keys'
    positions -> (b, n, s_q, d), the kv heads unexpanded: query i sees keys up to s_k − s_q + i
    (lower-right; with s_q = s_k the plain causal square, else a context-parallel query chunk).

    torch's dispatch picks the kernel. On a GPU, in fp16 or bf16, both forms run its flash kernel
    without a mask (``CausalBias`` calls the flash op itself for the lower-right one); on a CPU the
    lower-right form materializes its (s_q, s_k) mask, which the CPU kernel saves for its backward.
    A simulated GPU rank, whose fake tensors sit on the CPU, calls that flash op directly (its
    fake implementation gives the output and log-sum-exp the GPU keeps): it holds what the GPU
    holds, not the CPU's masks."""
    if _simulated_gpu_flash(q):
        out, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout,
                                                                     is_causal=True)
        return out  # (b, n, s_q, d)
    kw = dict(enable_gqa=True, dropout_p=dropout)
    if q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_lower_right(q.shape[2], k.shape[2]),
                                          **kw)


# -- the prepared masks: each attends (b, n, s_q, d) queries to (b, k, s_k, d) keys and values -----


class PreparedMask(Protocol):
    """A micro-batch's document mask in the form one kernel reads (:meth:`DocumentMask.prepare`)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               dropout: float) -> torch.Tensor:
        """(b, n, s_q, d) queries against (b, k, s_k, d) keys and values -> (b, n, s_q, d)."""


@dataclass(frozen=True)
class DenseMask:
    """sdpa: the (b, 1, s_q, s_k) mask handed to ``scaled_dot_product_attention``."""
    mask: torch.Tensor

    def attend(self, q, k, v, dropout: float) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, dropout_p=dropout,
                                              enable_gqa=True)


@functools.cache
def _compiled_flex():
    """torch's flex_attention, compiled once per process: its kernels read the block mask's
    sparsity at run time, so each micro-batch's new mask reuses the compiled code."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _eager_in_compiled(attend):
    """``attend`` run eagerly when a compiled region (``train.compile``'s layers) calls it: there it
    calls ``torch.compiler.disable(attend)``, a graph break. Applying ``torch.compiler.disable``
    at import instead would import Dynamo in every run (a second or more of start-up, as much as
    torch itself); a run that compiles has it loaded already."""
    @functools.wraps(attend)
    def call(self, q, k, v, dropout: float) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.compiler.disable(attend)(self, q, k, v, dropout)
        return attend(self, q, k, v, dropout)
    return call


@dataclass(frozen=True)
class FlexMask:
    """flex: FlexAttention's block mask of the micro-batch."""
    block_mask: object  # torch.nn.attention.flex_attention.BlockMask

    # its own compiled kernel, outside a compiled layer's graph (model/build.py)
    @_eager_in_compiled
    def attend(self, q, k, v, dropout: float) -> torch.Tensor:
        if dropout:
            raise ValueError("FlexAttention has no attention dropout (model.attention resolves to "
                             "sdpa with it)")
        if q.device.type == "cuda":
            return _compiled_flex()(q, k, v, block_mask=self.block_mask, enable_gqa=True)
        # CPU: forward only (torch has no FlexAttention backward there; resolve_attention refuses
        # training with it), eagerly: compiling it with inductor's C++ backend takes minutes
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=self.block_mask, enable_gqa=True)


@dataclass(frozen=True)
class TileMask:
    """blockwise: the micro-batch's :class:`TilePlan`."""
    plan: TilePlan

    @_eager_in_compiled  # Python loops over the plan: run eagerly inside a compiled layer
    def attend(self, q, k, v, dropout: float) -> torch.Tensor:
        if dropout:
            raise ValueError("blockwise attention has no attention dropout (model.attention "
                             "resolves to sdpa with it)")
        return blockwise_attention(q, k, v, self.plan)


# -- the choice -----------------------------------------------------------------------------------


def _flex_runs(device_type: str) -> str | None:
    """None when FlexAttention can train on ``device_type``, else why not."""
    if device_type != "cuda":
        return f"torch's FlexAttention has no backward on {device_type}"
    if importlib.util.find_spec("triton") is None:
        return "FlexAttention compiles to Triton, which is not installed"
    return None


def resolve_attention(choice: str, device: torch.device, *, dropout: float, documents: bool) -> str:
    """``model.attention`` on ``device``: the kernel of document-masked attention (see the module
    docstring; without document masking the choice is kept, and unused). Raises ConfigError for
    a choice that cannot train there."""
    if not documents:
        return "sdpa" if choice == "auto" else choice
    if choice == "auto":
        if dropout:
            return "sdpa"
        return "flex" if _flex_runs(device.type) is None else "blockwise"
    if choice in ("flex", "blockwise") and dropout:
        raise ConfigError(f"model.attention={choice} has no attention dropout "
                          f"(model.attention_dropout={dropout}): set model.attention_dropout 0, or "
                          "model.attention sdpa")
    why = _flex_runs(device.type) if choice == "flex" else None
    if why:
        raise ConfigError(f"model.attention=flex cannot train on {device.type}: {why}; set "
                          f"model.attention auto (blockwise off CUDA) or blockwise")
    return choice


def masked_attention(cfg: Config) -> bool:
    """Whether some layer of ``cfg``'s model runs the masked kernels: under document masking, or
    with a sliding window on some layer."""
    types = layer_types(cfg.model)
    return cfg.data.reset_attention_mask or (types is not None and SLIDING in types)


def describe_window(args: ModelArgs, kind: str | None = None) -> str:
    """The start-up line's note of the sliding window (and, given, the kernel its layers run), or
    "" without one."""
    windowed = sum(1 for i in range(args.num_layers) if args.window(i))
    if not windowed:
        return ""
    return (f"; a sliding window of {args.sliding_window} tokens on {windowed} of "
            f"{args.num_layers} layers" + (f" (model.attention={kind})" if kind else ""))


def dense_masks(cfg: Config) -> int:
    """How many dense masks a micro-batch keeps under sdpa: one per sliding window its layers use,
    and under document masking one more for its full-attention layers (without documents those
    run causal, unmasked) — two for OLMo 3 with documents."""
    types = layer_types(cfg.model) or (FULL,) * cfg.model.num_layers
    documents = cfg.data.reset_attention_mask
    return sum(1 for kind in set(types) if kind == SLIDING or documents)


def dense_attention_bytes(cfg: Config, layout: Layout) -> tuple[int, int]:
    """(mask bytes per micro-batch, scores bytes per layer) of sdpa under document masking or a
    sliding window: the (b, 1, s/cp, s) bool masks (:func:`dense_masks`), and one
    (b, heads/tp, s/cp, s) tensor of SDPA's math kernel."""
    t, seq = cfg.train, cfg.train.seq_length
    element = 4 if t.precision == "fp32" else 2
    mask = t.micro_batch_size * seq // layout.cp * seq
    return mask * dense_masks(cfg), mask * cfg.model.num_heads // layout.tp * element


def dense_document_mask(cfg: Config) -> bool:
    """Whether ``cfg``'s run on a GPU builds the dense mask: document masking under sdpa, chosen
    or (auto, with attention dropout) fallen back to."""
    m = cfg.model
    return masked_attention(cfg) and (m.attention == "sdpa" or (m.attention == "auto" and
                                                                 m.attention_dropout > 0))


def check_attention(cfg: Config, layout: Layout) -> list[str]:
    """``model.attention`` against the config, before any work: a ConfigError for a choice that
    cannot train (on ``train.device: cpu``, where the device is known), warnings for sdpa with
    document masking at sizes where its dense mask and scores cost memory."""
    m = cfg.model
    if not masked_attention(cfg):
        return []
    device = torch.device("cpu" if cfg.train.device == "cpu" else "cuda")  # auto: a GPU run's rules
    resolve_attention(m.attention, device, dropout=m.attention_dropout, documents=True)
    mask, scores = dense_attention_bytes(cfg, layout)
    if not dense_document_mask(cfg) or (m.attention == "sdpa" and scores < LARGE_SCORES):
        return []
    if m.attention == "sdpa":
        why, fix = "model.attention=sdpa", "model.attention auto (flex on CUDA, blockwise " \
                                           "elsewhere) needs neither"
    else:
        why = f"model.attention=auto with model.attention_dropout={m.attention_dropout} (only " \
              "sdpa has dropout)"
        fix = "with model.attention_dropout 0 auto chooses flex on CUDA or blockwise elsewhere, " \
              "which need neither"
    under = "data.reset_attention_mask" if cfg.data.reset_attention_mask else \
        "model.sliding_window"
    masks = dense_masks(cfg)
    built = "a dense (b, 1, s, s) mask" if masks == 1 else f"{masks} dense (b, 1, s, s) masks"
    return [f"{why} under {under} builds {built} "
            f"({mask / 2**20:,.0f} MiB per micro-batch) and on CUDA runs SDPA's math kernel: "
            f"{scores / 2**30:,.1f} GiB of scores per layer at "
            f"train.seq_length={cfg.train.seq_length}; {fix}"]


def describe_attention(kind: str, documents: bool, context_parallel: bool,
                       cp_comm: str = "allgather") -> str:
    """The start-up line saying which kernel attention runs."""
    if context_parallel and cp_comm == "ring":
        return ("attention: ring over the cp ranks (parallel.cp_comm=ring: K/V blocks passed on "
                "under each block's attention, blockwise tiles merged by log-sum-exp"
                + (", document-masked" if documents else "") + ")")
    if context_parallel and cp_comm == "a2a":
        context_parallel = False  # whole sequences after the all-to-all
        prefix = "attention: all-to-all over the cp ranks (parallel.cp_comm=a2a), then "
    else:
        prefix = "attention: "
    causal = "SDPA causal" + (" (lower-right chunks under cp)" if context_parallel else "")
    if not documents:
        return f"{prefix}{causal}"
    how = {"flex": "FlexAttention, compiled; a block mask per micro-batch from the document ids",
           "blockwise": "tiles with an online softmax; a tile plan per micro-batch from the "
                        "document ids", "sdpa": "SDPA with a dense (b, 1, s, s) mask per "
                                                "micro-batch"}[kind]
    return f"{prefix}model.attention={kind} under document masking ({how})"
