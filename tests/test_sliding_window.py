"""Sliding-window attention (``model.sliding_window``, ``model.layer_types``): every kernel and
every context-parallel exchange against a dense reference mask written here, the tiles and ring
steps a window skips, a window covering the sequence as full attention, the bad values refused in
one line, the FLOPs that follow; and Qwen2's windowed logits (transformers) through the Llama
family's converter.

The windowed layouts of the real trainer against one process are cases of tests/layouts.py.
"""

from __future__ import annotations

import functools
import json
import warnings

import pytest
import torch
import torch.nn.functional as F

from megapretrain.config import ConfigError, load_config
from megapretrain.model.args import FULL, SLIDING, model_args, window_fraction
from megapretrain.model.attention import FLEX_BLOCK, DocumentMask
from megapretrain.model.context_attention import ring_plans
from megapretrain.model.decoder import DecoderModel, documents, flops_per_token
from megapretrain.parallel.context import gather_kv_from_cp, local_positions, split_to_cp
from megapretrain.parallel.state import Group, ParallelState

from distributed import run_distributed
from helpers import tiny_args

EOD = 7


def _tokens(seq: int, eods: list[list[int]], seed: int = 0) -> torch.Tensor:
    """(b, seq) token ids, never EOD but at ``eods[i]``'s positions in sample i."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(EOD + 1, 200, (len(eods), seq), generator=g)
    for row, positions in zip(tokens, eods):
        row[positions] = EOD
    return tokens


EODS = [[0, 1, 9, 10, 23, 39], [], [19, 20, 33]]  # short, no and long documents


def _reference(tokens: torch.Tensor | None, seq: int, window: int, queries=None) -> torch.Tensor:
    """(b or 1, 1, s_q, s) bool, pair by pair: key j is visible to query i when 0 <= i - j <
    window (Hugging Face's ``kv_idx > q_idx - sliding_window`` on a causal mask) and, given
    tokens, both are of one document (a document ends with its EOD)."""
    queries = range(seq) if queries is None else queries.tolist()
    docs = None
    if tokens is not None:
        docs = [[sum(int(t) == EOD for t in row[:j]) for j in range(seq)] for row in tokens]
    rows = []
    for b in range(len(docs) if docs else 1):
        rows.append([[0 <= i - j < window and (docs is None or docs[b][i] == docs[b][j])
                      for j in range(seq)] for i in queries])
    return torch.tensor(rows)[:, None]


def _qkv(b: int, seq: int, heads: int = 4, kv_heads: int = 2, d: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, seq, d, generator=g, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, seq, d, generator=g, requires_grad=True) for _ in range(2))
    return q, k, v


def _forward_backward(attend, q, k, v, *extra, weight):
    out = attend(q, k, v, *extra)
    return (out.detach(), *torch.autograd.grad((out * weight).sum(), (q, k, v)))


def _close(got, want, names=("out", "grad q", "grad k", "grad v")):
    for a, b, name in zip(got, want, names):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def _mask(documented: bool, seq: int, window: int, tokens=None) -> DocumentMask:
    if documented:
        return documents(tokens, EOD, True, False).mask.windowed(window)
    return DocumentMask.one_document(torch.arange(seq), seq, window)


@pytest.mark.parametrize("window", [1, 5, 13, 40])
@pytest.mark.parametrize("documented", [False, True], ids=["causal", "documents"])
def test_every_kernel_equals_the_dense_reference(window, documented):
    """sdpa (its dense mask), blockwise (tiles of 8 and 7) forward and backward, FlexAttention's
    forward (eager on CPU), against SDPA under the reference mask built pair by pair."""
    tokens = _tokens(40, EODS)
    mask = _mask(documented, 40, window, tokens)
    reference = _reference(tokens if documented else None, 40, window)
    assert torch.equal(mask.dense().expand_as(reference), reference.expand_as(mask.dense()))
    q, k, v = _qkv(3, 40)
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    want = _forward_backward(lambda *x: F.scaled_dot_product_attention(*x, attn_mask=reference, enable_gqa=True),
                             q, k, v, weight=weight)
    _close(_forward_backward(lambda *x: mask.prepare("sdpa").attend(*x, 0.0), q, k, v, weight=weight), want)
    for tile in (8, 7):
        _close(_forward_backward(mask.prepare("blockwise", tile).attend, q, k, v, 0.0, weight=weight), want)
    out = _eager_flex(mask, *(t.detach() for t in (q, k, v)))
    torch.testing.assert_close(out, want[0], rtol=1e-5, atol=1e-5)


def _eager_flex(mask: DocumentMask, q, k, v) -> torch.Tensor:
    """FlexAttention's forward, eager on CPU. torch warns once a process that it is not compiled:
    silenced here, and left unshown for the tests that expect it."""
    from torch.nn.attention import flex_attention

    shown = set(flex_attention._WARNINGS_SHOWN)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return mask.prepare("flex").attend(q, k, v, 0.0)
    finally:
        flex_attention._WARNINGS_SHOWN.clear()
        flex_attention._WARNINGS_SHOWN.update(shown)


def _tiles_with_a_pair(reference: torch.Tensor, tile: int) -> int:
    """(query tile, key tile) pairs of the reference mask holding some visible pair (any sample)."""
    dense = reference.any(0)[0]  # (s_q, s_k)
    n_q, n_k = -(-dense.shape[0] // tile), -(-dense.shape[1] // tile)
    return sum(bool(dense[i * tile:(i + 1) * tile, j * tile:(j + 1) * tile].any())
               for i in range(n_q) for j in range(n_k))


@pytest.mark.parametrize("documented", [False, True], ids=["causal", "documents"])
def test_blockwise_visits_only_the_tiles_inside_the_window(documented):
    """The plan lists exactly the tiles that hold a visible pair: with a window of 8 on 64 tokens
    in tiles of 8, the diagonal and the tile before it (15 of the causal 36)."""
    tokens = _tokens(64, [[5, 30], []])
    for window, tile in ((8, 8), (3, 8), (20, 8), (8, 5)):
        plan = _mask(documented, 64, window, tokens).tile_plan(tile)
        reference = _reference(tokens if documented else None, 64, window)
        assert plan.tiles() == _tiles_with_a_pair(reference, tile), (window, tile)
    assert _mask(False, 64, 8).tile_plan(8).tiles() == 15 < _mask(False, 64, 0).tile_plan(8).tiles() == 36


@pytest.mark.parametrize("cp", [1, 2])
def test_flex_blocks_are_those_of_the_reference(cp):
    """FlexAttention's partial and full blocks of a windowed document mask: every visible pair in a
    listed block, full blocks exactly (queries of a cp rank against every key)."""
    tokens = _tokens(4 * FLEX_BLOCK, [[0, 100, 300], []])
    for rank in range(cp):
        group = Group("cp", list(range(cp)), None, rank)
        mask = documents(tokens, EOD, True, False, group).mask.windowed(150)
        reference = _reference(tokens, tokens.shape[1], 150, local_positions(tokens.shape[1], group))[:, 0]
        some, full = mask.blocks(FLEX_BLOCK, FLEX_BLOCK)
        block_mask = mask.prepare("flex").block_mask
        assert torch.equal(block_mask.to_dense()[:, 0].bool(), some)
        for i in range(some.shape[1]):
            for j in range(some.shape[2]):
                block = reference[:, i * FLEX_BLOCK:(i + 1) * FLEX_BLOCK, j * FLEX_BLOCK:(j + 1) * FLEX_BLOCK]
                assert torch.equal(some[:, i, j], block.flatten(1).any(1))  # exact for contiguous blocks
                assert torch.equal(full[:, i, j], block.flatten(1).all(1))


def test_ring_steps_wholly_outside_the_window_are_empty_plans():
    """Under cp 4 on 32 tokens (chunks of 4), the ring steps a rank skips are those whose source
    holds no key any of its queries sees: counted against the reference mask."""
    seq, cp = 32, 4
    for window in (1, 3, 5, 9):
        for rank in range(cp):
            group = Group("cp", list(range(cp)), None, rank)
            plans = ring_plans(group, seq, "cpu", window=window)
            reference = _reference(None, seq, window, local_positions(seq, group))[0, 0]  # (s/cp, s)
            for source, plan in enumerate(plans):
                keys = local_positions(seq, Group("cp", list(range(cp)), None, source))
                assert plan.empty() == (not reference[:, keys].any()), (window, rank, source)
    # with a window of 5, rank 0 (positions 0-3, 28-31) needs nothing of rank 2 (8-11, 20-23)
    assert ring_plans(Group("cp", list(range(cp)), None, 0), seq, "cpu", window=5)[2].empty()


def _cp_kernels(rank, world, tokens, window):
    """This rank's windowed attention under cp (keys all-gathered, blockwise and sdpa): out and
    the gradients of its own q, k and v."""
    ps = ParallelState(cp=world)
    q_all, k_all, v_all = _qkv(tokens.shape[0], tokens.shape[1])
    weight = split_to_cp(torch.randn(q_all.shape, generator=torch.Generator().manual_seed(2)), ps.cp, dim=2)
    out = {"positions": local_positions(tokens.shape[1], ps.cp)}
    mask = documents(tokens, EOD, True, False, ps.cp).mask.windowed(window)
    for kind in ("blockwise", "sdpa"):
        q, k, v = (split_to_cp(t.detach(), ps.cp, dim=2).requires_grad_() for t in (q_all, k_all, v_all))
        k_full, v_full = gather_kv_from_cp(k, v, ps.cp)
        y = mask.prepare(kind, 6).attend(q, k_full, v_full, 0.0) if kind == "blockwise" else \
            mask.prepare(kind).attend(q, k_full, v_full, 0.0)
        (y * weight).sum().backward()
        out[kind] = (y.detach(), q.grad, k.grad, v.grad)
    return out


def test_windowed_kernels_under_cp2_equal_the_reference():
    tokens = _tokens(40, EODS, seed=5)
    q, k, v = _qkv(3, 40)
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    reference = _reference(tokens, 40, 6)
    want = _forward_backward(lambda *x: F.scaled_dot_product_attention(*x, attn_mask=reference, enable_gqa=True),
                             q, k, v, weight=weight)
    for r in run_distributed(_cp_kernels, 2, tokens, 6, timeout=120):
        for kind in ("blockwise", "sdpa"):
            _close(r[kind], [t[:, :, r["positions"]] for t in want])


LAYERS = (SLIDING, FULL, SLIDING)  # a full layer between windowed ones


def _model_under_cp(rank, world, tokens, comms, window):
    """Per-token losses and the cp-summed gradients of one forward + backward of a tiny model with
    windowed and full layers under each ``parallel.cp_comm``, causal and document-masked."""
    ps = ParallelState(cp=world)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    out = {"positions": local_positions(inputs.shape[1], ps.cp)}
    args = tiny_args(num_layers=3, sliding_window=window, layer_types=LAYERS)
    for comm in comms:
        for masked in (False, True):
            model = DecoderModel(args, ps.tp, cp=ps.cp, cp_comm=comm, attention="blockwise")
            model.init_weights(7)
            docs = documents(inputs, EOD, True, True, ps.cp) if masked else None
            losses = model(split_to_cp(inputs, ps.cp), split_to_cp(targets, ps.cp), docs)  # (b, s/cp)
            losses.sum().backward()
            grads = {name: ps.cp.all_reduce(p.grad.clone()) for name, p in model.named_parameters()}
            out[comm, masked] = {"losses": losses.detach(), "grads": grads}
    return out


def _packed_batch() -> torch.Tensor:
    """(2, 33) ids: documents of 5-26 tokens packed, crossing the cp ranks' chunks."""
    tokens = torch.randint(10, 290, (2, 33), generator=torch.Generator().manual_seed(4))
    tokens[0, [5, 11, 30]] = EOD
    tokens[1, [20]] = EOD
    return tokens


def _sdpa_model_losses(tokens, window, masked):
    """The one-process model on sdpa's dense masks (the other kernels are checked against it)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    model = DecoderModel(tiny_args(num_layers=3, sliding_window=window, layer_types=LAYERS), Group("tp", [0]),
                         attention="sdpa")
    model.init_weights(7)
    losses = model(inputs, targets, documents(inputs, EOD, True, True) if masked else None)
    losses.sum().backward()
    return losses.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("window", [1, 6])
def test_all_gather_ring_and_all_to_all_under_a_window_equal_one_process(window):
    """cp 2: all-gather, ring (a window of 1 leaves every step but a rank's own empty: skipped
    forward and backward) and all-to-all, causal and document-masked, give every token's loss and
    every gradient of one process on sdpa's dense masks."""
    tokens = _packed_batch()
    comms = ("allgather", "ring", "a2a")
    results = run_distributed(_model_under_cp, 2, tokens, comms, window, timeout=300)
    for masked in (False, True):
        want_losses, want_grads = _sdpa_model_losses(tokens, window, masked)
        for comm in comms:
            together = torch.zeros_like(want_losses)
            for r in results:
                together[:, r["positions"]] = r[comm, masked]["losses"]
            torch.testing.assert_close(together, want_losses, rtol=1e-5, atol=1e-6, msg=f"{comm} {masked}")
            for name, grad in want_grads.items():
                torch.testing.assert_close(results[0][comm, masked]["grads"][name], grad, rtol=1e-5, atol=1e-6,
                                           msg=f"{comm} {masked} {name}")


def _logits(args, attention="sdpa", recompute="none", tokens=None):
    model = DecoderModel(args, Group("tp", [0]), attention=attention, recompute=recompute)
    model.init_weights(3)
    return model(tokens)


def test_a_window_covering_the_sequence_is_full_attention():
    tokens = _tokens(24, [[], [5]])
    full = _logits(tiny_args(), tokens=tokens)
    for window in (24, 100):
        for attention in ("sdpa", "blockwise"):
            got = _logits(tiny_args(sliding_window=window, layer_types=(SLIDING, SLIDING)), attention, tokens=tokens)
            torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
    narrow = _logits(tiny_args(sliding_window=4, layer_types=(SLIDING, SLIDING)), tokens=tokens)
    assert not torch.allclose(narrow, full, atol=1e-3)  # a window that matters changes them


def test_each_layer_gets_its_own_window_under_recomputation():
    """A windowed layer and a full one: blockwise with full and selective recompute equals sdpa."""
    tokens = _tokens(33, [[3, 20], [31]], seed=6)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    args = tiny_args(sliding_window=5, layer_types=(FULL, SLIDING))
    model = DecoderModel(args, Group("tp", [0]))
    assert [layer.window for layer in model.layers.values()] == [0, 5]

    def grads(attention, recompute):
        model = DecoderModel(args, Group("tp", [0]), attention=attention, recompute=recompute)
        model.init_weights(7)
        model(inputs, targets, documents(inputs, EOD, True, True)).sum().backward()
        return {name: p.grad for name, p in model.named_parameters()}

    want = grads("sdpa", "none")
    for recompute in ("none", "full", "selective"):
        got = grads("blockwise", recompute)
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=f"{recompute}: {name}")


def _record(seen: dict, i: str, layer, args) -> None:
    seen.setdefault(i, args[1])


def test_each_layer_rotates_with_its_layer_type_s_table():
    """YaRN on the full layer, plain rotary of another base on the windowed one (model.sliding_rope):
    each layer is handed its own type's cos and sin, by global position or per document, under full
    recomputation too."""
    from megapretrain.model.layers import rope_tables

    yarn = (("factor", 4.0), ("original_max_position_embeddings", 8), ("rope_type", "yarn"))
    args = tiny_args(sliding_window=5, layer_types=(FULL, SLIDING), rope_scaling=yarn,
                     sliding_rope=(("rope_theta", 500000.0), ("rope_type", "default")))
    assert [args.rope(i) for i in range(2)] == [(10000.0, yarn), (500000.0, None)]
    tokens = _tokens(33, [[3, 20], [31]], seed=6)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    tables = [rope_tables(32, args.head_dim, 10000.0, "cpu", torch.float32, dict(yarn)),
              rope_tables(32, args.head_dim, 500000.0, "cpu", torch.float32)]
    assert not torch.allclose(tables[0][0], tables[1][0])
    for recompute, docs in (("none", None), ("full", documents(inputs, EOD, True, True))):
        model = DecoderModel(args, Group("tp", [0]), attention="blockwise", recompute=recompute)
        seen = {}
        for i, layer in model.layers.items():  # its cos, on its first call (full recompute: two)
            layer.register_forward_pre_hook(functools.partial(_record, seen, i))
        model(inputs, targets, docs).sum().backward()
        for i, (cos, _) in enumerate(tables):
            want = cos if docs is None else cos[docs.position_ids].unsqueeze(1)  # (b, 1, s, d)
            assert torch.equal(seen[str(i)], want), (recompute, i)


def _config(*flags):
    return load_config(None, ["--model.vocab_size", "256", "--model.num_layers", "4", *flags])


def test_the_start_up_line_says_which_layers_are_windowed():
    from megapretrain.model.attention import describe_window
    assert describe_window(model_args(_config())) == ""
    args = model_args(_config("--model.sliding_window", "8", "--model.sliding_window_pattern", "4"))
    assert describe_window(args) == "; a sliding window of 8 tokens on 3 of 4 layers"
    assert describe_window(args, "blockwise").endswith("layers (model.attention=blockwise)")


def test_the_layer_types_resolve_from_the_list_or_the_pattern():
    assert model_args(_config()).layer_types is None
    assert model_args(_config("--model.sliding_window", "0")).layer_types is None
    assert model_args(_config("--model.sliding_window", "8")).layer_types == (SLIDING,) * 4
    args = model_args(_config("--model.sliding_window", "8", "--model.sliding_window_pattern", "4"))
    assert args.layer_types == (SLIDING, SLIDING, SLIDING, FULL)  # OLMo 3's: every 4th layer full
    assert [args.window(i) for i in range(4)] == [8, 8, 8, 0]
    listed = _config("--model.sliding_window", "8", "--model.layer_types",
                     "[full_attention, sliding_attention, full_attention, sliding_attention]")
    assert model_args(listed).layer_types == (FULL, SLIDING, FULL, SLIDING)


@pytest.mark.parametrize("flags, message", [
    (("--model.sliding_window", "-1"), "model.sliding_window=-1"),
    (("--model.sliding_window", "8", "--model.layer_types", "[sliding_attention, full_attention]"),
     "model.layer_types has 2 entries; it needs one per layer (model.num_layers=4)"),
    (("--model.sliding_window", "8", "--model.layer_types",
      "[sliding_attention, full_attention, chunked_attention, full_attention]"),
     "model.layer_types[2]='chunked_attention' is not a layer type"),
    (("--model.layer_types", "[sliding_attention, full_attention, full_attention, full_attention]"),
     "model.layer_types names sliding_attention layers but model.sliding_window is None"),
    (("--model.sliding_window", "8", "--model.sliding_window_pattern", "2", "--model.layer_types",
      "[sliding_attention, full_attention, full_attention, full_attention]"),
     "model.layer_types and model.sliding_window_pattern=2 both choose"),
    (("--model.sliding_window", "8", "--model.sliding_window_pattern", "0"), "model.sliding_window_pattern=0"),
    (("--model.sliding_window", "8", "--model.attention", "flex", "--train.device", "cpu"),
     "model.attention=flex cannot train on cpu"),
    (("--model.sliding_rope", "{rope_type: default, rope_theta: 500000}"),
     "model.sliding_rope={'rope_type': 'default', 'rope_theta': 500000}: no layer has a sliding window"),
    (("--model.sliding_window", "8", "--model.sliding_rope", "{rope_type: yarn, factor: 4}"),
     "model.sliding_rope: rope_type yarn needs positive numbers original_max_position_embeddings"),
    (("--model.rope_scaling", "{rope_type: yarn, factor: 4, original_max_position_embeddings: 8, beta: 2}"),
     "model.rope_scaling: keys ['beta'] are not part of rope_type yarn"),
])
def test_bad_window_values_are_one_line_naming_the_field(flags, message):
    """Each bad value stops the run before any work with one line naming the field (a windowed
    layer needs a masked kernel that trains on the device, as document masking does)."""
    from megapretrain.resolve import resolve
    with pytest.raises(ConfigError) as err:
        resolve(_config(*flags), 1)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_flops_count_the_pairs_inside_the_window():
    """Attention FLOPs per token follow the pairs computed: a window's share of the causal pairs
    (counted here pair by pair), every layer's share averaged; a window of the sequence or more is
    full attention; the planner's per-layer attention time scales alike."""
    seq = 64
    for window in (1, 8, 63):
        pairs = sum(min(window, i + 1) for i in range(seq))
        assert window_fraction(window, seq) == pytest.approx(pairs / (seq * (seq + 1) / 2))
    assert window_fraction(64, seq) == window_fraction(0, seq) == 1.0
    full = tiny_args(num_layers=4)
    windowed = tiny_args(num_layers=4, sliding_window=8, layer_types=(SLIDING, SLIDING, SLIDING, FULL))
    attention = 12.0 * 4 * full.hidden_size * seq
    got = flops_per_token(full, seq) - flops_per_token(windowed, seq)
    assert got == pytest.approx(attention * 3 / 4 * (1 - window_fraction(8, seq)))
    covering = tiny_args(num_layers=4, sliding_window=seq, layer_types=(SLIDING,) * 4)
    assert flops_per_token(covering, seq) == flops_per_token(full, seq)

    from megapretrain.monitor.flops import DEVICES
    from megapretrain.planner.model import layer_time
    device = DEVICES["h100"]
    big = dict(num_layers=4, hidden_size=1024, num_heads=8, num_kv_heads=8, ffn_hidden_size=4096)
    a, b = (layer_time(tiny_args(**big, **extra), device, 1, 8192, 1, False, "flash")
            for extra in ({}, dict(sliding_window=1024, layer_types=(SLIDING,) * 4)))
    assert b.attn_f < a.attn_f * 0.3 and b.matmul_f == a.matmul_f


transformers = pytest.importorskip("transformers")


def test_qwen2_windowed_logits_equal_transformers_and_convert_both_ways(tmp_path, capsys):
    """A random Qwen2 with a window of 5 on its first and third layers (shorter than the 40-token
    sequence): ``from-hf`` reads the window and the layer types, our logits are transformers'
    within 1e-5 (fp32), and ``to-hf`` writes them back; Llama's architecture, which has no window,
    is refused."""
    from megapretrain.checkpoint.hf import our_logits, our_model
    from megapretrain.checkpoint.reshard import GlobalWeights
    from megapretrain.commands import convert_checkpoint as convert

    types = [SLIDING, FULL, SLIDING]
    config = transformers.Qwen2Config(vocab_size=257, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                                      use_sliding_window=True, sliding_window=5, layer_types=types)
    torch.manual_seed(0)
    reference = transformers.Qwen2ForCausalLM(config).eval()
    hf_dir, ckpt, back = (str(tmp_path / name) for name in ("hf", "ckpt", "back"))
    reference.save_pretrained(hf_dir)
    assert convert.main(["from-hf", "--hf", hf_dir, "--output", ckpt, "--verify"]) == 0
    printed = capsys.readouterr().out  # the flags, each value one shell word
    assert '--model.sliding_window 5 --model.layer_types ["sliding_attention","full_attention",' in printed
    cfg = load_config(str(tmp_path / "ckpt" / "config.yaml"), [])
    assert (cfg.model.sliding_window, cfg.model.layer_types) == (5, types)
    weights = GlobalWeights(ckpt, cfg)
    ours = our_model(cfg, weights.get)
    weights.close()
    tokens = torch.randint(0, 257, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = reference(tokens).logits
    torch.testing.assert_close(our_logits(ours, tokens), theirs, rtol=0, atol=1e-5)
    for window in (4, 6):
        other = load_config(str(tmp_path / "ckpt" / "config.yaml"), ["--model.sliding_window", str(window)])
        weights = GlobalWeights(ckpt, cfg)
        shifted = our_model(other, weights.get)
        weights.close()
        # a window one key wider or narrower is another function: the off-by-one is pinned
        assert (our_logits(shifted, tokens) - theirs).abs().max() > 1e-3, window
    assert convert.main(["to-hf", "--checkpoint", ckpt, "--output", back, "--dtype", "fp32", "--verify"]) == 0
    written = json.load(open(tmp_path / "back" / "config.json"))
    assert (written["use_sliding_window"], written["sliding_window"], written["layer_types"]) == (True, 5, types)
    from megapretrain.model.hf_adapter import ConvertError
    from megapretrain.model.llama_hf import ADAPTER
    plain = load_config(str(tmp_path / "ckpt" / "config.yaml"), ["--model.qkv_bias", "false"])
    with pytest.raises(ConvertError, match="LlamaForCausalLM has no sliding window"):
        ADAPTER.hf_config(plain, model_args(plain), "float32", None, None)
