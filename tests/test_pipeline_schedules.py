"""Pipeline schedules as orders: the published 1F1B order, bounded activations, the bubble."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from collections import defaultdict

import pytest

from megapretrain.errors import PipelineError
from megapretrain.parallel.layout import Layout, chunk_layers
from megapretrain.parallel.pipeline import (
    SCHEDULES,
    Op,
    Step,
    forward_only_order,
    has_weight_ops,
    input_transfer,
    layout_schedule,
    output_transfer,
    peak_in_flight,
    resolve_schedule,
    simulate,
    transfer_rounds,
)


def text(order):
    return " ".join(f"{op.kind}{op.micro}" + (f".{op.chunk}" if op.chunk else "") for op in order)


def test_1f1b_matches_the_published_order():
    # PipeDream-Flush / Megatron 1F1B, 4 stages and 8 micro-batches (Narayanan et al. 2021, fig. 4)
    expected = {
        0: "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
        1: "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
        2: "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
        3: "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
    }
    for rank, want in expected.items():
        assert text(SCHEDULES["1f1b"].order(rank, 4, 1, 8)) == want
    # fewer micro-batches than stages: warmup is cut short, nothing runs twice
    assert text(SCHEDULES["1f1b"].order(0, 4, 1, 2)) == "F0 F1 B0 B1"


@pytest.mark.parametrize("pp, m", [(2, 1), (2, 4), (3, 5), (4, 4), (4, 8), (8, 3), (8, 16)])
def test_1f1b_in_flight_bounded_and_bubble_matches_formula(pp, m):
    orders = SCHEDULES["1f1b"].orders(pp, 1, m)
    for r, order in enumerate(orders):
        assert sorted(order, key=lambda o: (o.kind, o.micro)) == \
            sorted([Op("F", i, 0) for i in range(m)] + [Op("B", i, 0) for i in range(m)],
                   key=lambda o: (o.kind, o.micro))
        assert peak_in_flight(order) == min(pp - r, m) <= pp
    sim = simulate(orders, pp, 1)
    for idle in sim["idle_fraction"]:
        assert idle == pytest.approx((pp - 1) / (m + pp - 1))


def test_gpipe_keeps_every_micro_batch_in_flight():
    orders = SCHEDULES["gpipe"].orders(4, 1, 6)
    assert all(peak_in_flight(o) == 6 for o in orders)
    assert simulate(orders, 4, 1)["idle_fraction"][0] == pytest.approx(3 / (6 + 3))


@pytest.mark.parametrize("pp, vpp, m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (2, 3, 6), (4, 2, 4), (3, 2, 9)])
def test_interleaved_bubble_shrinks_by_vpp(pp, vpp, m):
    orders = SCHEDULES["interleaved"].orders(pp, vpp, m)
    for order in orders:
        assert len(order) == 2 * m * vpp and len(set(order)) == len(order)
    chunk_cost = 1.0 / vpp  # a chunk holds 1/vpp of a stage's layers
    sim = simulate(orders, pp, vpp, chunk_cost, chunk_cost)
    bubble = sim["makespan"] - 2 * m
    plain_bubble = simulate(SCHEDULES["1f1b"].orders(pp, 1, m), pp, 1)["makespan"] - 2 * m
    assert bubble == pytest.approx(plain_bubble / vpp)


def test_interleaved_runs_any_number_of_micro_batches_in_groups_of_pp():
    """Micro-batches go through the chunks in groups of pp; when pp does not divide them, the order
    is the next multiple's with the missing micro-batches left out, so the last group is the
    remainder: every (micro-batch, chunk) once forward and once backward, no more in flight than
    with the next multiple of pp, and no deadlock — down to fewer micro-batches than stages
    (Llama 3 405B's ramp-up on 16,384 GPUs: 4 on 16 stages)."""
    # 2 stages, 2 chunks, 3 micro-batches: the group (0, 1) through chunk 0 then 1, then (2) the same way
    forwards = [op for op in SCHEDULES["interleaved"].order(0, 2, 2, 3) if op.kind == "F"]
    assert text(forwards) == "F0 F1 F0.1 F1.1 F2 F2.1"
    assert text(forward_only_order(2, 2, 3)) == text(forwards)
    interleaved = SCHEDULES["interleaved"]
    for pp, vpp, m in [(2, 2, 3), (4, 2, 6), (4, 3, 7), (4, 2, 2), (16, 2, 4), (16, 2, 14), (5, 2, 12)]:
        orders = SCHEDULES["interleaved"].orders(pp, vpp, m)
        every = sorted((Op(k, i, c) for k in "FB" for i in range(m) for c in range(vpp)), key=repr)
        full = -(-m // pp) * pp
        for r, order in enumerate(orders):
            assert sorted(order, key=repr) == every, (pp, vpp, m, r)
            assert peak_in_flight(order) <= peak_in_flight(interleaved.order(r, pp, vpp, full))
        simulate(orders, pp, vpp)  # raises on deadlock
        _check_rounds("interleaved", pp, vpp, m, orders, False)


def test_every_valid_small_grid_combination_is_deadlock_free():
    for pp in (1, 2, 3, 4):
        for vpp in (1, 2, 3):
            for m in range(1, 9):
                try:
                    kind = resolve_schedule("auto", pp, vpp, m)
                except PipelineError:
                    assert pp == 1 and vpp > 1
                    continue
                orders = kind.orders(pp, vpp, m)
                simulate(orders, pp, vpp)  # raises on deadlock
                if pp > 1:
                    simulate([forward_only_order(pp, vpp, m)] * pp, pp, vpp)


def _blocking_replay(plans):
    """Run the plans as NCCL would at worst: a stage's batch finishes only when every one of its
    sends and receives has met its partner (the k-th send from a stage to another meets the k-th
    receive there, tags ignored), and the stage starts its next batch only after that. Returns
    the matched pairs; fails on a mismatch or when no stage can move (deadlock)."""
    pos = [0] * len(plans)
    sent, received, posted = defaultdict(list), defaultdict(list), [None] * len(plans)

    def post(r):
        while pos[r] < len(plans[r]) and not (plans[r][pos[r]].sends or plans[r][pos[r]].recvs):
            pos[r] += 1  # compute only
        if pos[r] < len(plans[r]):
            step = plans[r][pos[r]]
            posted[r] = ([(t, len(sent[(t.src, t.dst)])) for t in step.sends],
                         [(t, len(received[(t.src, t.dst)])) for t in step.recvs])
            for t in step.sends:
                sent[(t.src, t.dst)].append(t)
            for t in step.recvs:
                received[(t.src, t.dst)].append(t)

    for r in range(len(plans)):
        post(r)
    moved = True
    while moved:
        moved = False
        for r in range(len(plans)):
            if pos[r] == len(plans[r]):
                continue
            sends, recvs = posted[r]
            if all(k < len(received[(t.src, t.dst)]) for t, k in sends) and \
                    all(k < len(sent[(t.src, t.dst)]) for t, k in recvs):
                for t, k in recvs:
                    assert sent[(t.src, t.dst)][k] == t, f"stage {r} would receive {sent[(t.src, t.dst)][k]} as {t}"
                pos[r] += 1
                post(r)
                moved = True
    assert all(pos[r] == len(plans[r]) for r in range(len(plans))), f"p2p deadlock at steps {pos}"


def _check_rounds(kind, pp, vpp, m, orders, v):
    """The rounds of ``orders``: each op's input arrives before it, its output leaves after it
    (or, V placement's turn on one stage, is handed over without a transfer), a round's sends
    meet its receives one tensor each way, and they run to the end as NCCL would."""
    plans = transfer_rounds(orders, pp, vpp, v)
    rounds = {}
    for r, steps in enumerate(plans):
        assert [s.op for s in steps if s.op is not None] == orders[r]
        have, last_round = set(), -1
        done = set()
        for s in steps:
            assert s.round > last_round
            last_round = s.round
            have.update(s.recvs)
            sends, recvs = rounds.setdefault(s.round, ([], []))
            sends += s.sends
            recvs += s.recvs
            if s.op is not None:  # the input is here, and goes out after the op
                src = input_transfer(s.op, r, pp, vpp, v)
                local = src is not None and src.src == r
                assert src is None or src in have or (local and src in done), (kind, pp, vpp, m, r, s)
                out = output_transfer(s.op, r, pp, vpp, v)
                if out is not None and out.dst == r:
                    done.add(out)
                else:
                    assert out is None or any(out in x.sends for x in steps if x.round > s.round)
    for sends, recvs in rounds.values():  # a round's sends meet its receives
        assert sorted(map(repr, sends)) == sorted(map(repr, recvs))
        pairs = [(x.src, x.dst) for x in sends]
        assert len(pairs) == len(set(pairs))  # one tensor each way per round
        assert all(x.src != x.dst for x in sends)
    _blocking_replay(plans)


def test_communication_rounds_pair_every_send_and_deliver_in_time():
    for pp in (1, 2, 3, 4, 5):
        for vpp in (1, 2, 3):
            for m in range(1, 10):
                for kind in ("gpipe", "1f1b", "interleaved"):
                    try:
                        if resolve_schedule(kind, pp, vpp, m).name != kind:
                            continue
                    except PipelineError:
                        continue
                    for orders in (SCHEDULES[kind].orders(pp, vpp, m),
                                   [forward_only_order(pp, vpp, m)] * pp):
                        _check_rounds(kind, pp, vpp, m, orders, False)


@pytest.mark.parametrize("kind, vpp", [("zb_h1", 1), ("zbv", 2), ("1f1b", 1)])
def test_every_op_of_the_zero_bubble_schedules_runs_without_deadlock(kind, vpp):
    """pp 2-8 and 1-16 micro-batches: every F, B and W of every micro-batch and chunk exactly once,
    a W after its B, the replay and the rounds (as NCCL would run them) never stuck."""
    for pp in range(2, 9):
        for m in range(1, 17):
            assert resolve_schedule(kind, pp, vpp, m).name == kind
            orders = SCHEDULES[kind].orders(pp, vpp, m)
            v = SCHEDULES[kind].v_shape
            kinds = "FBW" if kind != "1f1b" else "FB"
            for order in orders:
                assert sorted(order, key=repr) == sorted(
                    [Op(k, i, c) for k in kinds for i in range(m) for c in range(vpp)], key=repr)
                position = {op: i for i, op in enumerate(order)}
                assert all(position[Op("W", i, c)] > position[Op("B", i, c)] for i in range(m) for c in range(vpp)
                           if kind != "1f1b")
            simulate(orders, pp, vpp, 1.0, 2.0, 1.0, v_shape=v)  # raises on deadlock
            _check_rounds(kind, pp, vpp, m, orders, v)
            _check_rounds(kind, pp, vpp, m, [forward_only_order(pp, vpp, m, v)] * pp, v)


def test_zb_h1_matches_the_published_order():
    # Qi et al. 2024 (zero bubble), ZB-H1 with 4 stages and 8 micro-batches: 1F1B's F and B, each W
    # deferred by the stage's index, the last stage's last three W filling its cooldown
    def text_w(order):
        return " ".join(f"{op.kind}{op.micro}" for op in order)
    assert text_w(SCHEDULES["zb_h1"].order(0, 4, 1, 8)) == \
        "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7"
    assert text_w(SCHEDULES["zb_h1"].order(3, 4, 1, 8)) == \
        "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7"


@pytest.mark.parametrize("kind", [s.name for s in SCHEDULES.values() if s.bubble is not None])
def test_measured_bubble_equals_theory(kind):
    """The replay of the real orders idles each stage exactly as long as the schedule's formula
    says, for pp 2-8 and 1-16 micro-batches (interleaved: multiples of pp; chunk costs: a
    forward, an input gradient and a weight gradient each 1, ZB-H1 also at 1 : 1.5 : 0.5)."""
    vpp = SCHEDULES[kind].shown_vpp
    costs = [(1.0, 2.0, 1.0)] + ([(1.0, 2.0, 0.5)] if kind == "zb_h1" else [])
    for pp in range(2, 9):
        for m in range(1, 17):
            if SCHEDULES[kind].whole_groups and m % pp:
                continue
            orders = SCHEDULES[kind].orders(pp, vpp, m)
            for f, b, w in costs:
                sim = simulate(orders, pp, vpp, f, b, w, v_shape=SCHEDULES[kind].v_shape)
                busy = m * vpp * (f + b)  # every stage runs every chunk's forward and whole backward
                theory = SCHEDULES[kind].idle(pp, vpp, m, f, b, w)
                assert sim["makespan"] - busy == pytest.approx(theory), (pp, m)
                for idle in sim["idle_fraction"]:
                    assert idle * sim["makespan"] == pytest.approx(sim["makespan"] - busy)


def test_zero_bubble_schedules_cut_the_bubble_at_1f1b_memory():
    """At pp 4, 16 micro-batches and equal forward, input- and weight-gradient times: ZB-H1 idles a
    third of 1F1B, ZB-V a sixth; no stage of either holds more micro-batches' activations than
    1F1B's first stage (pp of them; ZB-V's chunks are half a stage each)."""
    pp, m = 4, 16
    one = simulate(SCHEDULES["1f1b"].orders(pp, 1, m), pp, 1, 1.0, 2.0)
    h1_orders = SCHEDULES["zb_h1"].orders(pp, 1, m)
    h1 = simulate(h1_orders, pp, 1, 1.0, 2.0, 1.0)
    v_orders = SCHEDULES["zbv"].orders(pp, 2, m)
    v = simulate(v_orders, pp, 2, 0.5, 1.0, 0.5, v_shape=True)  # a chunk is half a stage
    busy = 3 * m
    assert h1["makespan"] - busy == pytest.approx((one["makespan"] - busy) / 3)
    assert v["makespan"] - busy == pytest.approx((one["makespan"] - busy) / 6)
    assert max(peak_in_flight(o) for o in h1_orders) == pp
    assert max(peak_in_flight(o) for o in v_orders) == 2 * pp


def test_blocking_replay_catches_sends_posted_before_receives():
    # each stage sending before it receives, in separate batches: the unbatched-p2p NCCL deadlock
    orders = SCHEDULES["1f1b"].orders(2, 1, 4)
    plans = transfer_rounds(orders, 2, 1)
    _blocking_replay(plans)
    split = [[x for s in steps for x in (Step(s.round, s.sends, (), None), Step(s.round, (), s.recvs, s.op))]
             for steps in plans]
    with pytest.raises(AssertionError, match="deadlock"):
        _blocking_replay(split)


def test_a_bad_order_is_caught_as_deadlock():
    good = SCHEDULES["1f1b"].orders(2, 1, 2)
    bad = [list(reversed(good[0])), good[1]]
    with pytest.raises(PipelineError, match="deadlocks"):
        simulate(bad, 2, 1)


@pytest.mark.parametrize("kind, pp, vpp, m, message", [
    ("1f1b", 2, 2, 4, "needs parallel.pp_schedule=interleaved"),
    ("interleaved", 1, 2, 4, "needs parallel.pp > 1"),
    ("interleaved", 1, 1, 4, "interleaved needs parallel.pp > 1"),
    ("none", 2, 1, 4, "runs one stage"),
    ("zbv", 4, 1, 8, "zbv runs two chunks per stage in a V: it needs parallel.vpp=2"),
    ("zb_h1", 4, 2, 8, "needs parallel.pp_schedule=interleaved"),
    ("zb_h1", 1, 1, 8, "zb_h1 needs parallel.pp > 1"),
    ("zigzag", 2, 1, 4, "is not one of"),
])
def test_invalid_combinations_fail_with_one_line(kind, pp, vpp, m, message):
    with pytest.raises(PipelineError, match=message) as err:
        resolve_schedule(kind, pp, vpp, m)
    assert "\n" not in str(err.value)


def test_chunk_layers():
    assert chunk_layers(8, 2, 1, 0) == [[0, 1, 2, 3]]
    assert chunk_layers(8, 2, 2, 1) == [[2, 3], [6, 7]]  # stage 1 holds global chunks 1 and 3
    assert chunk_layers(10, 2, 1, 0, [4, 6]) == [[0, 1, 2, 3]]
    with pytest.raises(PipelineError, match="must list 2 layer counts"):
        chunk_layers(10, 2, 1, 0, [5, 4])
    # the first and last chunk may hold no layer (the embedding, the output layer alone); no other
    assert chunk_layers(4, 2, 2, 0, [0, 2, 2, 0]) == [[], [2, 3]]
    assert chunk_layers(4, 2, 2, 1, [0, 2, 2, 0]) == [[0, 1], []]
    with pytest.raises(PipelineError, match="each at least 1 but the first and the last"):
        chunk_layers(4, 2, 2, 0, [2, 0, 2, 0])
    with pytest.raises(PipelineError, match="must divide model.num_layers=6"):
        chunk_layers(6, 4, 1, 0)


def test_schedule_tool_reports_the_bubble_and_draws_the_timeline(capsys):
    from megapretrain.commands import pipeline_schedule as tool
    assert tool.main(["--pp", "4", "--micro-batches", "8", "--backward-cost", "1", "--timeline"]) == 0
    out = capsys.readouterr().out
    assert "schedule 1f1b" in out and "efficiency 72.7%" in out  # 1 - 3/11 with unit costs
    rows = [line for line in out.splitlines() if line.startswith("stage ") and "|" in line]
    assert len(rows) == 4
    cells = rows[3].split("| ")[1].split()
    assert cells[:5] == ["..", "..", "..", "F0", "b0"]  # the last stage waits pp-1 forwards, then 1F1B
    assert sum(c != ".." for c in cells) == 16  # 8 forwards and 8 backwards


def test_schedule_tool_reads_a_config_at_its_gpu_count(capsys):
    from megapretrain.commands import pipeline_schedule as tool
    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "llama3_405b.yaml")
    assert tool.main(["--config", config]) == 0
    out = capsys.readouterr().out
    assert "2048 GPUs (tp=8 cp=1 pp=16 dp=16)" in out and "schedule interleaved" in out
    assert "reshape(pp=16, dp=16, cp=1, tp=8)" in out
    assert "128 micro-batches" in out and "32.0 MiB per transfer" in out  # 1 × 8192/8 × 16384 × bf16
    assert tool.main(["--config", config, "--world-size", "1000"]) == 2
    assert "must divide the world size 1000" in capsys.readouterr().err
    assert tool.main(["--pp", "4", "--vpp", "2", "--micro-batches", "6"]) == 0  # a group of 4, then one of 2
    assert "theory: the interleaved formula holds for a multiple of pp" in capsys.readouterr().out


def test_schedule_tool_draws_the_zero_bubble_schedules_with_their_weight_ops(capsys):
    from megapretrain.commands import pipeline_schedule as tool
    assert tool.main(["--pp", "4", "--micro-batches", "8", "--schedule", "zb_h1", "--timeline"]) == 0
    out = capsys.readouterr().out
    assert "schedule zb_h1" in out and "efficiency 88.9%" in out  # 24 / 27: a third of 1F1B's bubble
    assert "theory: idle 3 forward-units per stage (11.1% of the step)" in out
    rows = [line for line in out.splitlines() if line.startswith("stage ") and "|" in line]
    cells = rows[3].split("| ")[1].split()
    assert cells[:6] == ["..", "..", "..", "F0", "b0", "F1"] and cells[-4:] == ["w4", "w5", "w6", "w7"]
    assert tool.main(["--pp", "4", "--vpp", "2", "--micro-batches", "8", "--schedule", "zbv"]) == 0
    out = capsys.readouterr().out
    assert "efficiency 94.1%" in out and "theory: idle 1.5 forward-units" in out
    assert tool.main(["--pp", "4", "--micro-batches", "8", "--schedule", "zbv"]) == 2
    assert "needs parallel.vpp=2" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Every registered schedule keeps every rule: a new one left out of a rule fails here


SIZES = [(pp, vpp, m) for pp in (1, 2, 3, 4) for vpp in (1, 2, 3) for m in range(1, 10)]


def _accepted(schedule):
    return [(pp, vpp, m) for pp, vpp, m in SIZES if schedule.accepts(pp, vpp, m)]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_registered_schedule_builds_complete_deadlock_free_orders(name):
    """At every pp, vpp and micro-batch count it accepts: every F and B (and W, where its backward
    splits) of every micro-batch and chunk exactly once, each W after its B, no deadlock in the
    replay or the communication rounds (as NCCL would run them), nor in its evaluation order."""
    s = SCHEDULES[name]
    accepted = _accepted(s)
    assert accepted, f"{name} accepts no pipeline size at all"
    assert s.accepts(2 if s.pipelines else 1, s.shown_vpp), f"{name} refuses the vpp shown"
    kinds = "FBW" if s.split_backward else "FB"
    for pp, vpp, m in accepted:
        orders = s.orders(pp, vpp, m)
        assert len(orders) == pp
        every = sorted((Op(k, i, c) for k in kinds for i in range(m) for c in range(vpp)), key=repr)
        for order in orders:
            assert sorted(order, key=repr) == every, (name, pp, vpp, m)
            position = {op: i for i, op in enumerate(order)}
            assert all(position[op] > position[Op("B", op.micro, op.chunk)]
                       for op in order if op.kind == "W")
        simulate(orders, pp, vpp, 1.0, 2.0, 1.0, v_shape=s.v_shape)  # raises on deadlock
        simulate([s.forward_order(pp, vpp, m)] * pp, pp, vpp, v_shape=s.v_shape)
        if pp <= 3 and m <= 6:
            _check_rounds(name, pp, vpp, m, orders, s.v_shape)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_registered_schedule_refuses_a_size_in_one_line(name):
    s = SCHEDULES[name]
    for pp, vpp, m in SIZES:
        if s.accepts(pp, vpp, m):
            assert resolve_schedule(name, pp, vpp, m) is s
            continue
        with pytest.raises(PipelineError, match=r"parallel\.(pp|vpp)") as err:
            resolve_schedule(name, pp, vpp, m)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_declared_traits_agree_with_the_orders(name):
    """Split backward exactly where the orders hold W ops; V placement exactly where the orders
    run on it (the other placement deadlocks them at some size with virtual chunks), and the
    layer layout, the model build and a checkpoint's metadata place the chunks the same way."""
    s = SCHEDULES[name]
    accepted = _accepted(s)
    for pp, vpp, m in accepted:
        assert has_weight_ops(s.orders(pp, vpp, m)) == s.split_backward, (name, pp, vpp, m)
    assert not s.v_shape or s.vpp == 2, "V placement holds two chunks per stage"
    chunked = [(pp, vpp, m) for pp, vpp, m in accepted if vpp > 1 and pp > 1]
    if chunked:
        def deadlocks(pp, vpp, m):
            try:
                simulate(s.orders(pp, vpp, m), pp, vpp, v_shape=not s.v_shape)
            except PipelineError:
                return True
            return False
        assert any(deadlocks(*size) for size in chunked), f"{name} runs on either placement"
    for pp, vpp, _ in {(pp, vpp, 0) for pp, vpp, _ in accepted}:
        layout = Layout(tp=1, pp=pp, dp=1, vpp=vpp, pp_schedule=name)
        assert layout_schedule(layout) is s  # what the model build and the planner place by
        place = s.placement(pp, vpp)
        layers = 2 * pp * vpp
        for r in range(pp):
            assert [ids[0] // 2 for ids in layout.chunk_layers(layers, r, s.v_shape)] == \
                [place.global_chunk(r, v) for v in range(vpp)]
        assert (layout.meta(v_shape=s.v_shape).get("placement") == "v") == (s.v_shape and vpp > 1)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_the_planners_steady_state_points_hold(name):
    """The planner replays ``bubble_micro`` micro-batches for the bubble and ``memory_micro`` for
    the activations' peak: each must idle as long, and peak as high, as the full count."""
    s = SCHEDULES[name]

    def idle(pp, vpp, m):
        sim = simulate(s.orders(pp, vpp, m), pp, vpp, 1.0, 2.0, 1.0, v_shape=s.v_shape)
        return sim["makespan"] - m * vpp * 3.0

    def peak(pp, vpp, m):
        return max(peak_in_flight(order) for order in s.orders(pp, vpp, m))

    for pp, vpp, m in _accepted(s):
        size = (name, pp, vpp, m)
        assert idle(pp, vpp, s.bubble_micro(pp, m)) == pytest.approx(idle(pp, vpp, m)), size
        assert peak(pp, vpp, s.memory_micro(pp, m)) == peak(pp, vpp, m), size


def test_every_registered_schedule_is_named_where_users_read():
    """parallel.pp_schedule's help (config.py, which imports nothing of the pipeline) and the
    configuration reference name every schedule; ``auto`` resolves to a registered one."""
    from megapretrain.config import ParallelConfig
    field = next(f for f in dataclasses.fields(ParallelConfig) if f.name == "pp_schedule")
    help_text = field.metadata["help"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "configuration.md")) as fh:
        reference = fh.read()
    for name in SCHEDULES:
        assert re.search(rf"\b{name}\b", help_text), f"parallel.pp_schedule's help misses {name}"
        assert re.search(rf"\b{name}\b", reference), f"docs/configuration.md does not name {name}"
    for pp, vpp, m in SIZES:
        if not (vpp > 1 and pp == 1):
            assert resolve_schedule("auto", pp, vpp, m) in SCHEDULES.values()


# Comparisons with schedule names outside parallel/pipeline.py: how a new schedule silently gets
# another's rules. Config values (parallel__pp_schedule="zbv") and defaults are not comparisons.
_NAMED = set(SCHEDULES) - {"none"}  # "none" and "auto" are the values of many other choices too


def _schedule_comparisons(source, path="<source>"):
    tree = ast.parse(source, path)
    found = []

    def literals(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return set().union(*(literals(e) for e in node.elts)) if node.elts else set()
        return set()

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = set().union(*(literals(x) for x in sides))
            text = " ".join(ast.unparse(x) for x in sides if not literals(x))
            generic = names & {"auto", "none"} and re.search(r"schedule|\bkind\b", text)
            if names & _NAMED or generic:
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
            if len(set(keys) & _NAMED) > 1:
                found.append(f"{path}:{node.lineno}: a dict keyed by schedule names")
    return found


def test_no_module_but_the_pipelines_compares_schedule_names():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    package = os.path.join(root, "megapretrain")
    own = os.path.join(package, "parallel", "pipeline.py")
    found = []
    for folder, _, files in os.walk(package):
        for file in files:
            path = os.path.join(folder, file)
            if file.endswith(".py") and path != own:
                with open(path) as fh:
                    found += _schedule_comparisons(fh.read(), path)
    assert not found, "ask parallel/pipeline.py's Schedule instead:\n" + "\n".join(found)
    asking_by_name = """
if p.pp_schedule == "zbv": pass
v = kind in ("interleaved", "zbv")
chunks = {"1f1b": 1, "gpipe": 1, "zbv": 2}
name = L.pp_schedule if schedule == "auto" else schedule
ok = fp8 == "none" and choice == "auto" and op.kind == "W"
"""
    assert len(_schedule_comparisons(asking_by_name)) == 4  # the scan sees each way of asking
