"""Learning-rate schedule values at warmup start/end, mid-decay and the end."""

import math

import pytest

from megapretrain.optim.lr_schedule import LRSchedule


def sched(decay, warmup=10, decay_iters=110, **kw):
    return LRSchedule(lr=1.0, min_lr=0.1, warmup_iters=warmup, decay_iters=decay_iters, decay=decay, **kw)


@pytest.mark.parametrize("decay", ["cosine", "linear", "wsd", "constant"])
def test_warmup_is_linear_to_peak(decay):
    s = sched(decay)
    assert s(1) == pytest.approx(0.1)
    assert s(5) == pytest.approx(0.5)
    assert s(10) == pytest.approx(1.0)


def test_cosine():
    s = sched("cosine")
    assert s(60) == pytest.approx(0.55)                      # halfway: (lr + min_lr) / 2
    assert s(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert s(110) == pytest.approx(0.1) and s(500) == pytest.approx(0.1)


def test_linear():
    s = sched("linear")
    assert s(60) == pytest.approx(0.55)
    assert s(85) == pytest.approx(0.1 + 0.9 * 0.25)
    assert s(110) == pytest.approx(0.1)


def test_wsd_stays_flat_then_decays():
    s = sched("wsd", wsd_decay_fraction=0.2)                   # decay over the last 22 steps
    assert s(50) == pytest.approx(1.0) and s(88) == pytest.approx(1.0)
    assert s(99) == pytest.approx(0.1 + 0.9 * (1 - 11 / 22))
    assert s(110) == pytest.approx(0.1)


def test_constant_and_no_warmup():
    assert sched("constant")(1000) == 1.0
    s = sched("cosine", warmup=0, decay_iters=100)
    assert s(0) == pytest.approx(1.0) and s(100) == pytest.approx(0.1)
    assert all(s(i) >= s(i + 1) for i in range(100))


# -- a resumed run's schedule ------------------------------------------------------------------------

def _cfg(*overrides):
    from megapretrain.config import load_config

    return load_config(None, ["--optim.lr", "1.0", "--optim.min_lr", "0.1", "--schedule.warmup_iters", "10",
                              *overrides])


def test_a_resumed_run_keeps_its_checkpoints_decay_and_an_extension_continues_at_min_lr():
    from megapretrain.optim.lr_schedule import resumed_schedule

    saved = sched("cosine", decay_iters=100)
    kept, note = resumed_schedule(_cfg(), saved, iteration=60, iters=100)
    assert note == "" and [kept(i) for i in range(1, 101)] == [saved(i) for i in range(1, 101)]
    extended, note = resumed_schedule(_cfg(), saved, iteration=100, iters=300)  # train.iters 100 -> 300
    assert extended(101) == extended(300) == pytest.approx(0.1) and "continues at 0.1" in note
    assert "--schedule.rewarm_iters" in note
    stopped_early, _ = resumed_schedule(_cfg(), saved, iteration=60, iters=300)  # the decay still ends at 100
    assert [stopped_early(i) for i in (61, 100, 200)] == [saved(61), pytest.approx(0.1), pytest.approx(0.1)]


def test_an_explicit_decay_iters_replaces_the_checkpoints_schedule():
    from megapretrain.optim.lr_schedule import resumed_schedule

    saved = sched("cosine", decay_iters=100)
    schedule, note = resumed_schedule(_cfg("--schedule.decay_iters", "300"), saved, iteration=100, iters=300)
    assert note == "" and schedule.decay_iters == 300 and schedule(101) > 0.5


@pytest.mark.parametrize("decay", ["cosine", "linear", "wsd"])
def test_a_rewarm_starts_at_the_old_end_rises_to_lr_and_decays_to_the_new_end(decay):
    from megapretrain.optim.lr_schedule import LRSchedule, resumed_schedule

    saved = sched(decay, decay_iters=100)
    cfg = _cfg("--schedule.decay", decay, "--schedule.rewarm_iters", "20")
    schedule, note = resumed_schedule(cfg, saved, iteration=100, iters=300)
    assert "re-warming from iteration 100" in note
    assert [schedule(i) for i in range(1, 101)] == [saved(i) for i in range(1, 101)]  # the past is unchanged
    assert schedule(110) == pytest.approx(0.1 + 0.9 * 10 / 20) and schedule(120) == pytest.approx(1.0)
    assert schedule(300) == pytest.approx(0.1) and all(schedule(i) >= schedule(i + 1) for i in range(120, 300))
    again = LRSchedule.from_dict(schedule.to_dict())  # as a checkpoint keeps it
    assert again == schedule
    resumed, note = resumed_schedule(cfg, again, iteration=200, iters=300)  # a resume inside the re-warmed part
    assert note == "" and [resumed(i) for i in range(1, 301)] == [schedule(i) for i in range(1, 301)]


def test_a_rewarm_longer_than_the_extension_is_refused():
    from megapretrain.errors import ConfigError
    from megapretrain.optim.lr_schedule import resumed_schedule

    with pytest.raises(ConfigError, match="schedule.rewarm_iters=50 does not fit in the 20 steps"):
        resumed_schedule(_cfg("--schedule.rewarm_iters", "50"), sched("cosine", decay_iters=100), 100, 120)
