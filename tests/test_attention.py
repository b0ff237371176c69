"""Attention under document masking without an s × s mask (``model/attention.py``,
``model/blockwise.py``): every kernel against the dense reference — SDPA with the (b, 1, s, s) mask
— forward and backward (fp32, 1e-5), with grouped-query heads, odd documents (of one token, one
spanning the whole sample, an EOD as the last token), under context parallelism (2 ranks) and
recomputation; the block masks' structure; that no (s, s) tensor is allocated; and the choice of
``model.attention``."""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megapretrain.config import ConfigError, load_config
from megapretrain.model.attention import FLEX_BLOCK, check_attention, resolve_attention
from megapretrain.model.decoder import DecoderModel, documents
from megapretrain.monitor.flops import DEVICES
from megapretrain.parallel.context import gather_kv_from_cp, local_positions, split_to_cp
from megapretrain.parallel.state import Group, ParallelState
from megapretrain.planner import estimate_run
from megapretrain.resolve import resolve

from distributed import run_distributed
from helpers import tiny_args

EOD = 7
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _tokens(seq: int, eods: list[list[int]], seed: int = 0) -> torch.Tensor:
    """(b, seq) token ids, never EOD but at ``eods[i]``'s positions in sample i."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(EOD + 1, 200, (len(eods), seq), generator=g)
    for row, positions in zip(tokens, eods):
        row[positions] = EOD
    return tokens


# documents per sample: of one token (EOD first, EODs in a row), a last token that is an EOD, one
# document spanning the whole sample (no EOD), and one that fills all but the last token
LAYOUTS = {
    "odd": [[0, 1, 2, 9, 10, 23, 39], [], [38], [19, 20, 21, 22]],
    "short": [list(range(3, 40, 4)), list(range(0, 40, 5)), [13, 26], list(range(39))],
}


def _qkv(b: int, heads: int, kv_heads: int, seq: int, d: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, seq, d, generator=g, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, seq, d, generator=g, requires_grad=True) for _ in range(2))
    return q, k, v


def _forward_backward(attend, q, k, v, weight):
    """Output and the q, k, v gradients of Σ weight · attend(q, k, v)."""
    out = attend(q, k, v)
    return (out.detach(), *torch.autograd.grad((out * weight).sum(), (q, k, v)))


def _dense(mask):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(), enable_gqa=True)


def _close(got, want):
    for a, b, name in zip(got, want, ("out", "grad q", "grad k", "grad v")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (6, 1), (2, 2)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("tile", [8, 7, 64], ids=["tile8", "tile7", "one_tile"])
def test_blockwise_equals_the_dense_reference(layout, heads, kv_heads, tile):
    eods = LAYOUTS[layout]
    mask = documents(_tokens(40, eods), EOD, True, False).mask
    q, k, v = _qkv(len(eods), heads, kv_heads, 40)
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    want = _forward_backward(_dense(mask), q, k, v, weight)
    _close(_forward_backward(lambda *x: mask.prepare("blockwise", tile).attend(*x, 0.0), q, k, v, weight), want)


def test_blockwise_without_documents_is_causal_attention_and_skips_what_no_query_sees():
    """One document per sample is plain causal attention (SDPA's is_causal); many short documents
    visit a fraction of the tiles a long one does."""
    mask = documents(_tokens(64, [[], []]), EOD, True, False).mask
    q, k, v = _qkv(2, 4, 2, 64)
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    causal = _forward_backward(lambda *x: F.scaled_dot_product_attention(*x, is_causal=True, enable_gqa=True),
                               q, k, v, weight)
    _close(_forward_backward(lambda *x: mask.prepare("blockwise", 8).attend(*x, 0.0), q, k, v, weight), causal)
    long_pairs = mask.prepare("blockwise", 8).plan.pairs()
    assert long_pairs == 8 * 9 // 2 * 64  # the causal half of the tiles
    short = documents(_tokens(64, [list(range(5, 64, 6))] * 2), EOD, True, False).mask
    assert short.prepare("blockwise", 8).plan.pairs() < long_pairs / 2  # the diagonal and the tile before


def _check_blocks(mask, rows: int, cols: int):
    """``blocks`` against the dense mask: every allowed pair in a listed block, full blocks exactly."""
    some, full = mask.blocks(rows, cols)
    dense = mask.dense()[:, 0]  # (b, s_q, s_k)
    for i in range(some.shape[1]):
        for j in range(some.shape[2]):
            block = dense[:, i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
            assert torch.equal(block.flatten(1).any(1) & ~some[:, i, j], torch.zeros_like(some[:, i, j]))
            assert torch.equal(full[:, i, j], block.flatten(1).all(1))


@pytest.mark.parametrize("cp", [1, 2])
def test_block_classification_matches_the_dense_mask(cp):
    tokens = _tokens(48, LAYOUTS["odd"] + [[5, 30]], seed=4)
    for rank in range(cp):
        mask = documents(tokens, EOD, True, False, Group("cp", list(range(cp)), None, rank)).mask
        for rows, cols in ((4, 4), (8, 8), (5, 7), (12, 12)):  # 12: under cp, query blocks cross chunks
            _check_blocks(mask, rows, cols)


def test_flex_block_mask_is_built_from_the_documents():
    """The BlockMask of a 640-token micro-batch (five 128 blocks, the last sample one document):
    its partial and full blocks are those of the dense mask, and FlexAttention's forward (eager
    on CPU, which has no backward for it) equals the reference."""
    eods = [[0, 100, 101, 300, 639], list(range(50, 640, 50)), []]
    mask = documents(_tokens(640, eods), EOD, True, False).mask
    block_mask = mask.prepare("flex").block_mask
    some, full = mask.blocks(FLEX_BLOCK, FLEX_BLOCK)
    assert torch.equal(block_mask.to_dense()[:, 0].bool(), some)
    assert torch.equal(block_mask.full_kv_num_blocks[:, 0], full.sum(-1, dtype=torch.int32))
    assert int(full[2].sum()) == 10 and int(some[2].sum()) == 15  # one document: causal, diagonal masked
    q, k, v = (t.detach() for t in _qkv(3, 4, 2, 640, d=16))
    with pytest.warns(UserWarning, match="without torch.compile"):
        out = mask.prepare("flex").attend(q, k, v, 0.0)
    torch.testing.assert_close(out, _dense(mask)(q, k, v), rtol=1e-5, atol=1e-5)


TILES = (4, 6)  # 6: tiles that cross the boundary of a rank's two chunks (of 10 tokens)


def _cp_attention(rank, world, tokens):
    """This rank's share of attention under cp, per tile size: its queries, keys and values, the
    keys gathered, the blockwise kernel under the rank's document mask; out and grads of its own
    q, k and v."""
    ps = ParallelState(cp=world)
    seq, out = tokens.shape[1], {"positions": local_positions(tokens.shape[1], ps.cp)}
    q_all, k_all, v_all = _qkv(tokens.shape[0], 4, 2, seq)
    weight = split_to_cp(torch.randn(q_all.shape, generator=torch.Generator().manual_seed(2)), ps.cp, dim=2)
    mask = documents(tokens, EOD, True, False, ps.cp).mask
    for tile in TILES:
        q, k, v = (split_to_cp(t.detach(), ps.cp, dim=2).requires_grad_() for t in (q_all, k_all, v_all))
        k_full, v_full = gather_kv_from_cp(k, v, ps.cp)
        y = mask.prepare("blockwise", tile).attend(q, k_full, v_full, 0.0)  # (b, 4, s/cp, d)
        (y * weight).sum().backward()
        out[tile] = (y.detach(), q.grad, k.grad, v.grad)
    return out


def test_blockwise_under_cp2_equals_one_process():
    tokens = _tokens(40, LAYOUTS["odd"], seed=5)
    q, k, v = _qkv(4, 4, 2, 40)
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    want = _forward_backward(_dense(documents(tokens, EOD, True, False).mask), q, k, v, weight)
    for r in run_distributed(_cp_attention, 2, tokens, timeout=120):
        for tile in TILES:
            _close(r[tile], [t[:, :, r["positions"]] for t in want])


def _model_grads(attention: str, recompute: str, inputs, targets, docs):
    model = DecoderModel(tiny_args(num_heads=4, num_kv_heads=2), Group("tp", [0]), recompute=recompute,
                         attention=attention)
    model.init_weights(7)
    model(inputs, targets, docs).sum().backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_the_model_trains_alike_under_every_kernel_and_recomputation():
    """Parameter gradients of a packed micro-batch: blockwise with full and selective recompute
    equal sdpa's dense mask without it (the tile plan is shared by the layers and their recompute)."""
    tokens = _tokens(33, [[3, 4, 20, 32], [31]], seed=6)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    want = _model_grads("sdpa", "none", inputs, targets, documents(inputs, EOD, True, True))
    for recompute in ("none", "full", "selective"):
        docs = documents(inputs, EOD, True, True)
        got = _model_grads("blockwise", recompute, inputs, targets, docs)
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=f"{recompute}: {name}")


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_compiled_layers_run_it_without_recompiling_per_micro_batch(recompute, monkeypatch):
    """``train.compile``'s regional compilation (model/build.py, Dynamo with its eager backend
    here: inductor's C++ build takes minutes) around the blockwise kernel: the eager model's
    losses and gradients, and no new graph for a micro-batch of other documents."""
    from torch._dynamo.utils import counters

    from megapretrain.model.build import compile_layers

    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    models = [DecoderModel(tiny_args(num_heads=4, num_kv_heads=2), Group("tp", [0]), recompute=recompute,
                           attention="blockwise") for _ in range(2)]
    for model in models:
        model.init_weights(7)
    compile_layers(models[1], CPU)
    graphs = []
    for step, eods in enumerate([[[3, 4, 20], [31]], [[0, 9], [5, 6, 7, 30]], [[], [16]]]):
        tokens = _tokens(33, eods, seed=step)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        losses = [model(inputs, targets, documents(inputs, EOD, True, True)) for model in models]
        for loss in losses:
            loss.sum().backward()
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        graphs.append(counters["stats"]["unique_graphs"])
    for (name, p), compiled in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(compiled.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert graphs[0] > 0 and graphs[1:] == graphs[:1] * 2, graphs


class _Allocations(TorchDispatchMode):
    """The element count of every tensor an op returns (new storages and views alike)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("attention, dense", [("blockwise", False), ("sdpa", True)])
def test_no_seq_by_seq_tensor_in_a_document_masked_step(attention, dense):
    """Forward and backward of a 1024-token packed sample: blockwise never makes a tensor of s × s
    elements (its largest is a (heads, tile, tile) block of scores); sdpa's dense mask is one."""
    seq = 1024
    tokens = _tokens(seq + 1, [list(range(100, seq, 150))], seed=7)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    model = DecoderModel(tiny_args(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1), Group("tp", [0]),
                         attention=attention)
    model.init_weights(0)
    with _Allocations() as watch:
        model(inputs, targets, documents(inputs, EOD, True, True)).sum().backward()
    assert (watch.largest >= seq * seq) == dense, watch.largest


# -- the choice ---------------------------------------------------------------------------------


def test_auto_resolves_to_what_serves_the_device():
    kw = dict(dropout=0.0, documents=True)
    assert resolve_attention("auto", CPU, **kw) == "blockwise"
    assert resolve_attention("auto", CUDA, **kw) == "flex"  # triton is a runtime dependency
    assert resolve_attention("auto", CUDA, dropout=0.1, documents=True) == "sdpa"  # the one with dropout
    assert resolve_attention("auto", CUDA, dropout=0.0, documents=False) == "sdpa"  # causal: SDPA's kernels
    assert resolve_attention("blockwise", CUDA, **kw) == "blockwise"


@pytest.mark.parametrize("choice, device, dropout, message", [
    ("flex", CPU, 0.0, r"model.attention=flex cannot train on cpu: torch's FlexAttention has no backward on cpu"),
    ("flex", CUDA, 0.1, r"model.attention=flex has no attention dropout \(model.attention_dropout=0.1\)"),
    ("blockwise", CPU, 0.1, r"model.attention=blockwise has no attention dropout"),
])
def test_a_choice_that_cannot_train_is_one_line(choice, device, dropout, message):
    with pytest.raises(ConfigError, match=message) as info:
        resolve_attention(choice, device, dropout=dropout, documents=True)
    assert "\n" not in str(info.value)


def _cfg(*flags):
    return load_config(None, ["--model.vocab_size", "300", "--data.reset_attention_mask", "true", *flags])


def test_resolve_refuses_flex_on_a_cpu_run_and_warns_of_sdpa_memory():
    with pytest.raises(ConfigError, match="model.attention=flex cannot train on cpu"):
        resolve(_cfg("--model.attention", "flex", "--train.device", "cpu"), 1)
    big = ["--train.seq_length", "8192", "--train.micro_batch_size", "1", "--model.num_heads", "32",
           "--model.hidden_size", "4096", "--train.precision", "bf16"]
    warnings = resolve(_cfg("--model.attention", "sdpa", *big), 1).warnings
    assert any("64 MiB per micro-batch" in w and "4.0 GiB of scores per layer" in w for w in warnings), warnings
    assert not check_attention(_cfg(*big), resolve(_cfg(*big), 1).layout)  # auto: neither
    dropout = resolve(_cfg("--model.attention_dropout", "0.1"), 1).warnings  # auto falls back to sdpa: said
    assert any("only sdpa has dropout" in w for w in dropout), dropout


def test_the_planner_counts_the_dense_masks_scores():
    """plan --check and the OOM advice: sdpa under document masking keeps (b, heads, s, s) scores
    per layer; the default (flex on a GPU) keeps none, as without documents."""
    flags = ["--train.seq_length", "8192", "--train.micro_batch_size", "1", "--train.global_batch_size", "8",
             "--model.num_layers", "4", "--model.num_heads", "32", "--model.hidden_size", "4096"]
    h100 = DEVICES["h100"]

    def activations(*more):
        cfg = load_config(None, ["--model.vocab_size", "32000", *flags, *more])
        return estimate_run(cfg, resolve(cfg, 8).layout, h100).memory["activations"]

    plain, auto = activations(), activations("--data.reset_attention_mask", "true")
    dense = activations("--data.reset_attention_mask", "true", "--model.attention", "sdpa")
    assert auto == plain
    assert dense - plain >= 4 * 32 * 8192 * 8192 * 2  # four layers' bf16 softmax, at least


def test_the_oom_advice_starts_with_attention_without_the_dense_mask():
    from megapretrain.oom import remedies

    flags = ["--model.vocab_size", "32000", "--train.seq_length", "8192", "--train.micro_batch_size", "1",
             "--train.global_batch_size", "8", "--model.num_layers", "4", "--model.num_heads", "32",
             "--model.hidden_size", "4096", "--data.reset_attention_mask", "true"]
    dense = load_config(None, [*flags, "--model.attention", "sdpa"])
    first = remedies(dense, resolve(dense, 8).layout, CPU)[0]
    auto = load_config(None, flags)
    want = estimate_run(auto, resolve(auto, 8).layout, DEVICES["h100"]).memory["total"] / 2**30
    assert first == f"--model.attention auto (planner: {want:.1f} GB per GPU on {DEVICES['h100'].name})", first
    assert not remedies(auto, resolve(auto, 8).layout, CPU)[0].startswith("--model.attention")


def test_the_bench_prints_a_row_per_case_and_refuses_bad_flags(capsys):
    from helpers import load_tool

    main = load_tool("bench_attention").main

    assert main(["--seqs", "96", "--kinds", "sdpa", "blockwise", "--docs", "short", "--iters", "1", "--threads", "1",
                 "--json"]) == 0  # a fresh process per case
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["seq"], r["kind"]) for r in rows] == [(96, "sdpa"), (96, "blockwise")]
    assert all(r["peak_bytes"] > 0 and r["ms"] > 0 and r["docs"] == "short" for r in rows)
    assert main(["--heads", "8", "--kv-heads", "3"]) == 2
    assert capsys.readouterr().err.strip() == "error: --kv-heads 3 must divide --heads 8"


@pytest.mark.parametrize("flags, masks", [
    ((), 1),  # documents: one mask for every layer
    (("--model.sliding_window", "8", "--model.sliding_window_pattern", "2"), 2),  # and one for the windowed
    (("--model.sliding_window", "8"), 1),  # every layer windowed
    (("--model.sliding_window", "8", "--model.sliding_window_pattern", "2", "--data.reset_attention_mask",
      "false"), 1),  # the full layers causal, unmasked
])
def test_sdpa_counts_the_dense_masks_the_model_builds(flags, masks):
    """sdpa keeps one dense mask per distinct mask its layers read (documents with a window: two), as
    many as the model prepares for a micro-batch; the memory warning counts them all."""
    from megapretrain.model.attention import dense_attention_bytes, dense_masks

    cfg = _cfg("--model.attention", "sdpa", "--model.num_layers", "4", "--train.seq_length", "16", *flags)
    layout = resolve(cfg, 1).layout
    assert dense_masks(cfg) == masks
    one = dense_attention_bytes(_cfg("--model.attention", "sdpa", "--train.seq_length", "16"), layout)[0]
    assert dense_attention_bytes(cfg, layout)[0] == masks * one
    model = DecoderModel(tiny_args(num_layers=4, **_window_args(cfg)), Group("tp", [0]), attention="sdpa")
    tokens = torch.randint(0, 5, (2, 16), generator=torch.Generator().manual_seed(0))
    docs = documents(tokens, 0, cfg.data.reset_attention_mask, False)
    _, prepared = model._positions(model.embed_tokens(tokens), docs)
    assert sum(mask is not None for mask in prepared.values()) == masks


def _window_args(cfg) -> dict:
    from megapretrain.model.build import model_args

    args = model_args(cfg)
    return dict(sliding_window=args.sliding_window, layer_types=args.layer_types)
