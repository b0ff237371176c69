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
