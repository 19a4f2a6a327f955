"""The LR range test's rule against values computed by hand: the debiased smoothing, the divergence stop (losses
of either sign) and the steepest-descent pick. How a run takes the test is in test_range_start.py."""

from __future__ import annotations

import pytest

from hdet_scale.range_test import SKIP_BEGIN, RangeTest, SmoothedLoss, ramp_lr, steepest_descent


def test_the_smoothed_loss_is_a_debiased_moving_average():
    smoother = SmoothedLoss(beta=0.5)
    # average 0.5 * 0 + 0.5 * 2 = 1, over 1 - 0.5 = 0.5: 2; then 0.5 * 1 + 0.5 * 4 = 2.5, over 1 - 0.25: 10/3
    assert smoother.add(2.0) == pytest.approx(2.0)
    assert smoother.add(4.0) == pytest.approx(10 / 3)
    assert smoother.best == pytest.approx(2.0)


def test_the_ramp_stops_at_four_times_the_best_loss_and_as_far_above_a_negative_one():
    smoother = SmoothedLoss(beta=0.0)  # no smoothing: each value as it is
    smoother.add(1.0)
    assert not smoother.diverged(smoother.add(3.9)) and smoother.diverged(smoother.add(4.1))
    below_zero = SmoothedLoss(beta=0.0)  # a log-likelihood of continuous data: the best is -2, stop above 4
    for loss in (-1.0, -1.5, -2.0, -1.0, 0.9):
        assert not below_zero.diverged(below_zero.add(loss))
    assert below_zero.diverged(below_zero.add(4.1))  # 6.1 above -2, more than 3 x 2
    assert SmoothedLoss().diverged(float("nan"))


def test_a_falling_negative_loss_runs_the_whole_test():
    """Any loss below 0 stopped the test at its second step (the loss above 4 times a negative best), with no pick."""
    test = RangeTest(20)
    ended = [test.add(-1.0 - 0.1 * step) for step in range(20)]
    assert ended == [False] * 19 + [True] and test.pick() is not None


def test_the_pick_is_the_lr_of_the_steepest_fall_after_the_first_points():
    lrs = [ramp_lr(step, steps=16) for step in range(16)]
    # kept: steps 10..14 (the first 10 and the last are left out); their slopes by central differences:
    # -1 (one-sided), (1 - 5) / 2 = -2, (0.5 - 4) / 2 = -1.75, (0.4 - 1) / 2 = -0.3, -0.1 (one-sided)
    smoothed = [9.0] * SKIP_BEGIN + [5.0, 4.0, 1.0, 0.5, 0.4] + [0.0]
    assert steepest_descent(lrs, smoothed) == lrs[11]
    assert lrs[0] == pytest.approx(1e-6) and lrs[15] == pytest.approx(1.0)
    assert lrs[1] / lrs[0] == pytest.approx(10 ** 0.4)  # six decades in 15 equal ratios
    assert steepest_descent(lrs[:12], smoothed[:12]) is None  # one point left: no slope
