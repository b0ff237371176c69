"""Pipeline schedules as orders: the published 1F1B order, bounded activations, the bubble."""

from __future__ import annotations

import os
from collections import defaultdict

import pytest

from megapretrain.errors import PipelineError
from megapretrain.parallel.layout import chunk_layers
from megapretrain.parallel.pipeline import (
    Op,
    Step,
    forward_only_order,
    input_transfer,
    output_transfer,
    peak_in_flight,
    resolve_schedule,
    schedule_order,
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
        assert text(schedule_order("1f1b", rank, 4, 1, 8)) == want
    # fewer micro-batches than stages: warmup is cut short, nothing runs twice
    assert text(schedule_order("1f1b", 0, 4, 1, 2)) == "F0 F1 B0 B1"


@pytest.mark.parametrize("pp, m", [(2, 1), (2, 4), (3, 5), (4, 4), (4, 8), (8, 3), (8, 16)])
def test_1f1b_in_flight_bounded_and_bubble_matches_formula(pp, m):
    orders = [schedule_order("1f1b", r, pp, 1, m) for r in range(pp)]
    for r, order in enumerate(orders):
        assert sorted(order, key=lambda o: (o.kind, o.micro)) == \
            sorted([Op("F", i, 0) for i in range(m)] + [Op("B", i, 0) for i in range(m)],
                   key=lambda o: (o.kind, o.micro))
        assert peak_in_flight(order) == min(pp - r, m) <= pp
    sim = simulate(orders, pp, 1)
    for idle in sim["idle_fraction"]:
        assert idle == pytest.approx((pp - 1) / (m + pp - 1))


def test_gpipe_keeps_every_micro_batch_in_flight():
    orders = [schedule_order("gpipe", r, 4, 1, 6) for r in range(4)]
    assert all(peak_in_flight(o) == 6 for o in orders)
    assert simulate(orders, 4, 1)["idle_fraction"][0] == pytest.approx(3 / (6 + 3))


@pytest.mark.parametrize("pp, vpp, m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (2, 3, 6), (4, 2, 4), (3, 2, 9)])
def test_interleaved_bubble_shrinks_by_vpp(pp, vpp, m):
    orders = [schedule_order("interleaved", r, pp, vpp, m) for r in range(pp)]
    for order in orders:
        assert len(order) == 2 * m * vpp and len(set(order)) == len(order)
    chunk_cost = 1.0 / vpp  # a chunk holds 1/vpp of a stage's layers
    sim = simulate(orders, pp, vpp, chunk_cost, chunk_cost)
    bubble = sim["makespan"] - 2 * m
    plain_bubble = simulate([schedule_order("1f1b", r, pp, 1, m) for r in range(pp)], pp, 1)["makespan"] - 2 * m
    assert bubble == pytest.approx(plain_bubble / vpp)


def test_every_valid_small_grid_combination_is_deadlock_free():
    for pp in (1, 2, 3, 4):
        for vpp in (1, 2, 3):
            for m in range(1, 9):
                try:
                    kind = resolve_schedule("auto", pp, vpp, m)
                except PipelineError:
                    assert pp == 1 and vpp > 1 or (vpp > 1 and m % pp)
                    continue
                orders = [schedule_order(kind, r, pp, vpp, m) for r in range(pp)]
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


def test_communication_rounds_pair_every_send_and_deliver_in_time():
    for pp in (1, 2, 3, 4, 5):
        for vpp in (1, 2, 3):
            for m in range(1, 10):
                for kind in ("gpipe", "1f1b", "interleaved"):
                    try:
                        if resolve_schedule(kind, pp, vpp, m) != kind:
                            continue
                    except PipelineError:
                        continue
                    for orders in ([schedule_order(kind, r, pp, vpp, m) for r in range(pp)],
                                   [forward_only_order(pp, vpp, m)] * pp):
                        plans = transfer_rounds(orders, pp, vpp)
                        rounds = {}
                        for r, steps in enumerate(plans):
                            assert [s.op for s in steps if s.op is not None] == orders[r]
                            have, last_round = set(), -1
                            for s in steps:
                                assert s.round > last_round
                                last_round = s.round
                                have.update(s.recvs)
                                sends, recvs = rounds.setdefault(s.round, ([], []))
                                sends += s.sends
                                recvs += s.recvs
                                if s.op is not None:  # the input is here, and goes out after the op
                                    src = input_transfer(s.op, r, pp, vpp)
                                    assert src is None or src in have, (kind, pp, vpp, m, r, s)
                                    out = output_transfer(s.op, r, pp, vpp)
                                    assert out is None or any(out in x.sends for x in steps if x.round > s.round)
                        for sends, recvs in rounds.values():  # a round's sends meet its receives
                            assert sorted(map(repr, sends)) == sorted(map(repr, recvs))
                            pairs = [(x.src, x.dst) for x in sends]
                            assert len(pairs) == len(set(pairs))  # one tensor each way per round
                        _blocking_replay(plans)


def test_blocking_replay_catches_sends_posted_before_receives():
    # each stage sending before it receives, in separate batches: the unbatched-p2p NCCL deadlock
    orders = [schedule_order("1f1b", r, 2, 1, 4) for r in range(2)]
    plans = transfer_rounds(orders, 2, 1)
    _blocking_replay(plans)
    split = [[x for s in steps for x in (Step(s.round, s.sends, (), None), Step(s.round, (), s.recvs, s.op))]
             for steps in plans]
    with pytest.raises(AssertionError, match="deadlock"):
        _blocking_replay(split)


def test_a_bad_order_is_caught_as_deadlock():
    good = [schedule_order("1f1b", r, 2, 1, 2) for r in range(2)]
    bad = [list(reversed(good[0])), good[1]]
    with pytest.raises(PipelineError, match="deadlocks"):
        simulate(bad, 2, 1)


@pytest.mark.parametrize("kind, pp, vpp, m, message", [
    ("interleaved", 4, 2, 6, "multiple of parallel.pp=4"),
    ("1f1b", 2, 2, 4, "needs parallel.pp_schedule=interleaved"),
    ("interleaved", 1, 2, 4, "needs parallel.pp > 1"),
    ("interleaved", 1, 1, 4, "interleaved needs parallel.pp > 1"),
    ("none", 2, 1, 4, "runs one stage"),
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
    with pytest.raises(PipelineError, match="must list 2 positive layer counts"):
        chunk_layers(10, 2, 1, 0, [5, 4])
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
    assert tool.main(["--pp", "4", "--vpp", "2", "--micro-batches", "6"]) == 2
    assert "multiple of parallel.pp=4" in capsys.readouterr().err
