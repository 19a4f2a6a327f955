import math

import pytest
import torch
from torch import nn

from hdet_scale import HDETEnsemble, ReplicaTopology
from hdet_scale.config import AutoLRConfig, HDETConfig
from hdet_scale.config_checks import HDETConfigError
from hdet_scale.config_rules import largest_fall
from hdet_scale.controller import (
    Controller,
    ControllerState,
    PaperDecay,
    decay_to_floor,
    log_hypergradient,
    momentum,
    relative_hypergradient,
    softmax_weights,
    zscore_weights,
)
from hdet_scale.engines.ddp import DDPAdapter
from hdet_scale.spread import multipliers


def test_softmax_weights_by_hand():
    # mean 2.0; s = (2 - L)/0.5 = [2, 0, -2]
    weights = softmax_weights([1.0, 2.0, 3.0], sigma=0.5)
    total = math.exp(2) + 1 + math.exp(-2)
    assert weights == pytest.approx([math.exp(2) / total, 1 / total, math.exp(-2) / total])
    assert softmax_weights([5.0, 5.0], sigma=0.1) == [0.5, 0.5]


def test_non_finite_loss_gets_zero_weight():
    weights = softmax_weights([1.0, float("nan"), 1.0, float("inf")], sigma=0.1)
    assert weights == [0.5, 0.0, 0.5, 0.0]
    with pytest.raises(ValueError, match="every replica's loss is non-finite"):
        softmax_weights([float("nan")], sigma=0.1)


def test_delta_sign_lower_loss_at_higher_lr_raises_the_base():
    rho = [0.8, 1.2]
    high_lr_wins = softmax_weights([2.0, 1.0], sigma=0.1)
    low_lr_wins = softmax_weights([1.0, 2.0], sigma=0.1)
    assert relative_hypergradient(high_lr_wins, rho) > 0 > relative_hypergradient(low_lr_wins, rho)
    # By hand: w = softmax([-5, 5]) -> Delta = w1*0.2 - w0*0.2
    w1 = 1 / (1 + math.exp(-10))
    assert relative_hypergradient(high_lr_wins, rho) == pytest.approx(0.2 * w1 - 0.2 * (1 - w1))
    assert relative_hypergradient([0.25] * 4, [1.0] * 4) == 0.0


def test_momentum_by_hand():
    assert momentum(0.0, 1.0, 0.9) == pytest.approx(0.1)
    assert momentum(0.1, 1.0, 0.9) == pytest.approx(0.19)
    assert momentum(0.19, -1.0, 0.5) == pytest.approx(-0.405)


@pytest.mark.parametrize("mode", ["log", "scale"])
def test_past_rise_only_after_the_scale_only_rises(mode):
    """beta 0.5, lambda 1, the window from step 0 to 40, rise-only after 0.4 of it (step 16). At 10 the low replica
    wins (velocity -Delta/2: the scale falls); at 20 it wins again (velocity -3 Delta / 4, stopped at 0: the scale
    holds); at 30 the high replica wins (velocity 0 + Delta / 2: the scale rises by that; the unstopped velocity,
    -3/8 Delta + Delta / 2, by Delta / 8)."""
    if mode == "log":  # Delta = 0.8 log(3/2) + 0.2 log(2/3) = 0.6 log 1.5; scale *= exp(lambda v)
        rho, delta, apply = [2 / 3, 3 / 2], 0.6 * math.log(1.5), math.exp
    else:  # Delta = 0.8 (1.5 - 1) + 0.2 (0.5 - 1) = 0.3; scale *= 1 + lambda v
        rho, delta, apply = [0.5, 1.5], 0.3, (lambda step: 1 + step)

    def scales(rise_only_after: float) -> list[float]:
        controller = Controller(AutoLRConfig(mode=mode, beta=0.5, step_size=1.0, sigma=1.0, initial_scale=1.0,
                                             max_log_step=10.0, start=0, stop=40,
                                             rise_only_after=rise_only_after))
        state, seen = ControllerState(), []
        for step, weights in ((10, [0.8, 0.2]), (20, [0.8, 0.2]), (30, [0.2, 0.8])):
            state = controller.update(state, delta=controller.hypergradient(weights, rho), trained_base=1.0, step=step,
                                      sync_interval=10)
            seen.append(state.scale)
        return seen

    down = apply(-delta / 2)
    assert scales(0.4) == pytest.approx([down, down, down * apply(delta / 2)])
    both_ways = [down, down * apply(-3 * delta / 4), down * apply(-3 * delta / 4) * apply(delta / 8)]
    assert scales(1.0) == pytest.approx(both_ways)
    assert scales(0.5) == pytest.approx(both_ways)  # one-sided after step 20: the sync at 20 still lowers


def test_gamma_reaches_the_floor_after_k_syncs():
    gamma = decay_to_floor(current=1e-3, floor=1e-3 / 25 / 1e4, num_syncs=40)
    value = 1e-3
    for _ in range(40):
        value *= 1 - gamma
    assert 0 < gamma < 1
    assert value == pytest.approx(1e-3 / 25 / 1e4, rel=1e-9)


def test_paper_mode_takes_over_then_decays_with_velocity():
    controller = Controller(AutoLRConfig(mode="paper", beta=0.5, step_size=0.5))
    decay = PaperDecay(total_steps=1000, floor=1e-5)
    equal = [0.5, 0.5]
    state = controller.update(ControllerState(), delta=controller.hypergradient(equal, [0.9, 1.1]),
                              trained_base=1e-3, step=200, sync_interval=100, paper_decay=decay)
    gamma = 1 - (1e-5 / 1e-3) ** (1 / 8)  # K = (1000 - 200) / 100 = 8 remaining syncs
    assert state.gamma == pytest.approx(gamma)
    assert state.velocity == pytest.approx(0.0, abs=1e-15)
    assert state.owned_base == pytest.approx(1e-3 * (1 - gamma))
    # Now the high-LR replica wins: Delta = b * sum w (rho - 1) = b * (0.25*-0.1 + 0.75*0.1) = 0.05 b
    base = state.owned_base
    state = controller.update(state, delta=controller.hypergradient([0.25, 0.75], [0.9, 1.1]),
                              trained_base=123.0, step=300, sync_interval=100, paper_decay=decay)
    assert state.last_delta == pytest.approx(0.05 * base)
    assert state.velocity == pytest.approx(0.5 * 0.05 * base)
    assert state.owned_base == pytest.approx(base * (1 - gamma) + 0.5 * 0.5 * 0.05 * base)
    with pytest.raises(ValueError, match="needs the base schedule's floor"):
        controller.update(ControllerState(), delta=controller.hypergradient(equal, [0.9, 1.1]),
                          trained_base=1e-3, step=0, sync_interval=10)


def test_scale_mode_moves_relative_to_the_base_and_clamps():
    controller = Controller(AutoLRConfig(mode="scale", beta=0.9, step_size=0.5, scale_min=0.5, scale_max=2.0))
    state = controller.update(ControllerState(), delta=controller.hypergradient([0.0, 1.0], [0.5, 1.5]),
                              trained_base=3.0, step=10, sync_interval=5)
    assert state.last_delta == pytest.approx(0.5)  # the 1.5x replica took all the weight
    assert state.velocity == pytest.approx(0.05)
    assert state.scale == pytest.approx(1.0 * (1 + 0.5 * 0.05))
    for _ in range(500):
        state = controller.update(state, delta=controller.hypergradient([0.0, 1.0], [0.5, 1.5]),
                                  trained_base=3.0, step=10, sync_interval=5)
    assert state.scale == 2.0
    for _ in range(500):
        state = controller.update(state, delta=controller.hypergradient([1.0, 0.0], [0.5, 1.5]),
                                  trained_base=3.0, step=10, sync_interval=5)
    assert state.scale == 0.5


@pytest.mark.parametrize(("fields", "message"), [
    ({"total_steps": 100_000, "floor": 0.0}, "floor must be a finite number > 0"),
    ({"total_steps": 100, "floor": -1e-5}, "floor must be a finite number > 0"),
    ({"total_steps": 100, "floor": math.inf}, "floor must be a finite number > 0"),
    ({"total_steps": 0, "floor": 1e-5}, "total_steps must be an integer >= 1"),
    ({"total_steps": 10.5, "floor": 1e-5}, "total_steps must be an integer >= 1"),
])
def test_paper_decay_is_checked_when_made_not_at_the_first_update(fields, message):
    with pytest.raises(ValueError, match=message):
        PaperDecay(**fields)


def test_zscore_weights_by_hand():
    # losses 1, 2, 3: mean 2, population std sqrt(2/3); z = -1.2247, 0, 1.2247; sigma 0.5: scores 2.4495, 0, -2.4495
    z = 1 / math.sqrt(2 / 3)
    total = math.exp(2 * z) + 1 + math.exp(-2 * z)
    assert zscore_weights([1.0, 2.0, 3.0], sigma=0.5) == pytest.approx(
        [math.exp(2 * z) / total, 1 / total, math.exp(-2 * z) / total])
    # scale-free: the same weights whatever the size of the gaps
    assert zscore_weights([1.0, 1.001, 1.002], 0.5) == pytest.approx(zscore_weights([1.0, 2.0, 3.0], 0.5))
    assert zscore_weights([4.0, 4.0], 0.5) == [0.5, 0.5]
    assert zscore_weights([1.0, float("nan"), 3.0], 1.0) == pytest.approx([math.e / (math.e + 1 / math.e), 0.0,
                                                                           (1 / math.e) / (math.e + 1 / math.e)])


def test_log_mode_moves_the_log_scale_and_caps_the_step():
    controller = Controller(AutoLRConfig(mode="log", beta=0.5, step_size=2.0, max_log_step=0.25, sigma=1.0))
    rhos = [0.5, 2.0]  # log rho = -0.693, +0.693
    state = controller.update(ControllerState(), delta=controller.hypergradient([0.25, 0.75], rhos),
                              trained_base=1.0, step=10, sync_interval=5)
    delta = 0.25 * math.log(0.5) + 0.75 * math.log(2.0)  # 0.3466
    assert log_hypergradient([0.25, 0.75], rhos) == pytest.approx(delta)
    assert state.last_delta == pytest.approx(delta)
    assert state.velocity == pytest.approx(0.5 * delta)  # 0.1733: lambda v = 0.3466 > 0.25, so capped
    assert state.scale == pytest.approx(math.exp(0.25))
    state = controller.update(state, delta=controller.hypergradient([0.5, 0.5], rhos), trained_base=1.0, step=15,
                              sync_interval=5)
    assert state.velocity == pytest.approx(0.25 * delta)  # Delta 0: the momentum decays
    assert state.scale == pytest.approx(math.exp(0.25 + 2.0 * 0.25 * delta))  # 0.1733 < 0.25: not capped
    down = controller.update(ControllerState(), delta=controller.hypergradient([0.75, 0.25], rhos), trained_base=1.0,
                             step=10, sync_interval=5)
    assert down.scale == pytest.approx(math.exp(-0.25))  # down as far as up
    assert controller.weights([1.0, 2.0]) == pytest.approx(zscore_weights([1.0, 2.0], 1.0))


def test_the_sync_on_the_one_sided_phases_first_step_still_lowers():
    """Window 0-90, rise-only after 0.7 of it: the phase starts after step 63 (63 / 90 = 0.7 exactly; 0.7 x 90
    rounds to 62.99999999999999, which would start it at 63). The low replica wins at 63 and 72: the scale falls at
    63, and at 72 the velocity (beta 0) is stopped at 0."""
    controller = Controller(AutoLRConfig(mode="log", beta=0.0, step_size=1.0, start=0, stop=90,
                                         initial_scale=1.0, rise_only_after=0.7))
    state = ControllerState()
    down = math.exp(0.8 * math.log(0.5) + 0.2 * math.log(2.0))  # Delta = 0.8 log 0.5 + 0.2 log 2
    for step, expected in ((63, down), (72, down)):
        state = controller.update(state, delta=controller.hypergradient([0.8, 0.2], [0.5, 2.0]), trained_base=1.0,
                                  step=step, sync_interval=9)
        assert state.scale == pytest.approx(expected)


def test_the_hypergradient_is_measured_from_the_replicas_own_mean_on_either_spread():
    """Eqs. 5-6 subtract eta bar, the replicas' mean value: a log spread's multipliers average above 1 and a linear
    spread's log multipliers below 0, so measured from 1 (or from log 1) equal weights read as a hypergradient."""
    log_spread, linear_spread, weights = [0.5, 1.0, 2.0], [0.5, 1.0, 1.5], [0.2, 0.3, 0.5]
    # By hand: mean rho 7/6, sum w rho = 0.1 + 0.3 + 1.0 = 1.4, and 1.4 / (7/6) - 1 = 0.2
    assert relative_hypergradient(weights, log_spread) == pytest.approx(0.2)
    # By hand: 0.2 log 0.5 + 0.5 log 1.5 less the mean log multiplier, log(0.75) / 3
    assert log_hypergradient(weights, linear_spread) == pytest.approx(
        0.2 * math.log(0.5) + 0.5 * math.log(1.5) - math.log(0.75) / 3)
    equal = [1 / 3] * 3
    assert relative_hypergradient(equal, log_spread) == pytest.approx(0.0, abs=1e-15)
    assert log_hypergradient(equal, linear_spread) == pytest.approx(0.0, abs=1e-15)
    # so identical losses leave every mode where it was, on the spread it does not default to
    for mode, rhos in (("scale", log_spread), ("paper", log_spread), ("log", linear_spread)):
        controller = Controller(AutoLRConfig(mode=mode, beta=0.5, step_size=1.0))
        state = ControllerState()
        for step in range(100, 4100, 100):
            state = controller.update(state, delta=controller.hypergradient(controller.weights([2.0] * 3), rhos),
                                      trained_base=1e-3, step=step, sync_interval=100,
                                      paper_decay=PaperDecay(total_steps=10_000, floor=1e-5))
        assert state.velocity == pytest.approx(0.0, abs=1e-15) and state.scale == pytest.approx(1.0)
        if mode == "paper":
            # eq. 8 alone: from 1e-3 to the floor 1e-5 over the 99 syncs left at the first update, 40 of them taken
            assert state.owned_base == pytest.approx(1e-3 * 0.01 ** (40 / 99), rel=1e-12)


@pytest.mark.parametrize(("spread", "alpha", "fall"), [("linear", 0.5, 0.5), ("log", 0.5, 1 - 2 / 3.25),
                                                       ("log", 1.0, 0.6)])
def test_largest_fall_is_the_lowest_replica_winning_at_any_size(spread, alpha, fall):
    # by hand: linear rho_min = 1 - alpha, mean 1; log with two replicas 1/(1+a), 1+a: 1 - 2 / ((1+a)^2 + 1)
    assert largest_fall(alpha, spread) == pytest.approx(fall)
    falls = [-relative_hypergradient([1.0] + [0.0] * (n - 1), multipliers(n, alpha, spread)) for n in range(2, 9)]
    assert max(falls) == pytest.approx(fall)


def test_a_step_size_past_the_largest_fall_is_refused_before_it_drops_the_scale_to_its_floor():
    fall = largest_fall(0.5, "linear")
    too_far = 1.0 / fall + 0.1
    # what the refusal prevents: the lowest replica winning every sync takes the scale to the floor at once
    controller = Controller(AutoLRConfig(mode="scale", beta=0.0, step_size=too_far, range_test=0))
    state = controller.update(ControllerState(), delta=controller.hypergradient([1.0, 0.0], [0.5, 1.5]),
                              trained_base=1.0, step=100, sync_interval=1)
    assert state.scale == controller.config.scale_min
    layout = {"alpha": 0.5, "spread": "linear"}
    with pytest.raises(HDETConfigError, match=r"auto_lr.step_size=2.1 with alpha=0.5 .* keep auto_lr.step_size "
                                              r"at most 2, lower the spread, or use mode 'log'"):
        HDETConfig.from_dict({**layout, "auto_lr": {"mode": "scale", "step_size": too_far, "range_test": 0}})
    # at most a fall to 0: allowed
    HDETConfig.from_dict({**layout, "auto_lr": {"mode": "scale", "step_size": 2.0, "range_test": 0}})
    # the LR held by its range test is not moved; an explored value in 'paper' mode is (a scale on its base)
    HDETConfig.from_dict({**layout, "auto_lr": {"mode": "scale", "step_size": too_far}})
    with pytest.raises(HDETConfigError, match=r"with explore.dropout.alpha=0.9 "):
        HDETConfig.from_dict({**layout, "auto_lr": {"mode": "paper", "step_size": 1.2},
                              "explore": {"dropout": {"alpha": 0.9}}})
    # a value of one's own, moved by a scale as the configured ones are
    hdet = HDETEnsemble(HDETConfig.from_dict({**layout, "auto_lr": {"mode": "scale", "step_size": 2.5}}),
                        DDPAdapter(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)),
                        topology=ReplicaTopology.single_process(), total_steps=100)
    with pytest.raises(HDETConfigError, match=r"auto_lr.step_size=2.5 with add_knob\('temperature', alpha=...\)=0.9 "):
        hdet.add_knob("temperature", lambda: 1.0, lambda value: None, alpha=0.9)
    assert not hdet.explores("temperature")


@pytest.mark.parametrize("mode", ["scale", "log"])
def test_the_velocity_does_not_wind_on_past_a_bound_the_scale_stopped_at(mode):
    """beta 0.5, lambda 1, scale_max 1.1. The high replica wins (scale mode: Delta 0.5, v 0.25, scale 1.25; log mode:
    Delta log 2, v log(2) / 2, scale sqrt 2), clamped to 1.1: the velocity pointing past it is dropped. Then the low
    one wins: v = -Delta / 2 at once, where the wound-on velocity would have halved the fall."""
    controller = Controller(AutoLRConfig(mode=mode, beta=0.5, step_size=1.0, scale_max=1.1, max_log_step=10.0))
    rhos = [0.5, 1.5] if mode == "scale" else [0.5, 2.0]
    up = controller.update(ControllerState(), delta=controller.hypergradient([0.0, 1.0], rhos), trained_base=1.0,
                           step=10, sync_interval=5)
    assert up.scale == 1.1 and up.velocity == 0.0
    down = controller.update(up, delta=controller.hypergradient([1.0, 0.0], rhos), trained_base=1.0, step=15,
                             sync_interval=5)
    if mode == "scale":  # Delta -0.5: v -0.25, scale 1.1 x 0.75
        assert down.velocity == pytest.approx(-0.25) and down.scale == pytest.approx(0.825)
    else:  # Delta -log 2: v -log(2) / 2, scale 1.1 / sqrt 2
        assert down.velocity == pytest.approx(-math.log(2) / 2) and down.scale == pytest.approx(1.1 / math.sqrt(2))
    floor = Controller(AutoLRConfig(mode=mode, beta=0.5, step_size=1.0, scale_min=0.9, max_log_step=10.0))
    low = floor.update(ControllerState(), delta=floor.hypergradient([1.0, 0.0], rhos), trained_base=1.0, step=10,
                       sync_interval=5)
    assert low.scale == 0.9 and low.velocity == 0.0


def test_a_values_own_bounds_clamp_after_the_controllers_and_stop_the_velocity_too():
    """Scale mode, beta 0.5, lambda 1: a raise (v 0.25, scale 1.25) inside scale_max 2 stops at the value's bound
    1.1 (a probability at 0.9 on a schedule of 0.8, say) with no velocity outward; a fall past its lower bound 0.95
    likewise. A value whose bounds lie wholly above the controller's (3 to 4, scale_max 2) ends at 3 with no velocity
    upward either: past scale_max too."""
    controller = Controller(AutoLRConfig(mode="scale", beta=0.5, step_size=1.0, scale_max=2.0))
    raise_, lower = controller.hypergradient([0.0, 1.0], [0.5, 1.5]), controller.hypergradient([1.0, 0.0], [0.5, 1.5])
    up = controller.update(ControllerState(), delta=raise_, trained_base=1.0, step=10, sync_interval=5,
                           value_bounds=(0.95, 1.1))
    assert up.scale == 1.1 and up.velocity == 0.0
    down = controller.update(ControllerState(), delta=lower, trained_base=1.0, step=10, sync_interval=5,
                             value_bounds=(0.95, 1.1))
    assert down.scale == 0.95 and down.velocity == 0.0
    apart = controller.update(ControllerState(), delta=raise_, trained_base=1.0, step=10, sync_interval=5,
                              value_bounds=(3.0, 4.0))
    assert apart.scale == 3.0 and apart.velocity == 0.0
