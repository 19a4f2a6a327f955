import math

import pytest

from hdet_scale.config import AutoLRConfig
from hdet_scale.controller import (
    Controller,
    ControllerState,
    PaperDecay,
    bias_corrected,
    decay_to_floor,
    log_hypergradient,
    momentum,
    progress_hypergradient,
    relative_hypergradient,
    softmax_weights,
    zscore_weights,
)


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


def test_bias_corrected_velocity_by_hand():
    assert bias_corrected(0.1, 0.9, 1) == pytest.approx(1.0)  # 0.1 / (1 - 0.9)
    assert bias_corrected(0.19, 0.9, 2) == pytest.approx(1.0)  # 0.19 / (1 - 0.81): a constant Delta of 1
    assert bias_corrected(-0.405, 0.5, 3) == pytest.approx(-0.405 / 0.875)


@pytest.mark.parametrize("mode", ["log", "scale"])
def test_bias_correction_steps_at_full_size_from_the_first_sync(mode):
    """beta 0.9, lambda 1, two replicas spread symmetrically for the mode. The first update's velocity is 0.1 Delta,
    the second's (equal weights: no new Delta) 0.09 Delta; corrected, the scale steps along Delta, then along
    0.09 Delta / 0.19."""
    if mode == "log":  # Delta = 0.2 log(2/3) + 0.8 log(3/2) = 0.6 log 1.5; scale *= exp(step)
        rho, delta, apply = [2 / 3, 3 / 2], 0.6 * math.log(1.5), math.exp
    else:  # Delta = 0.2 (0.5 - 1) + 0.8 (1.5 - 1) = 0.3; scale *= 1 + step
        rho, delta, apply = [0.5, 1.5], 0.3, (lambda step: 1 + step)

    def two_updates(corrected: bool) -> tuple[float, float]:
        controller = Controller(AutoLRConfig(mode=mode, beta=0.9, step_size=1.0, sigma=1.0, initial_scale=1.0,
                                             bias_correction=corrected))
        state = controller.update(ControllerState(), weights=[0.2, 0.8], replica_multipliers=rho,
                                  scheduled_value=1.0, step=100, sync_interval=10)
        first = state.scale
        state = controller.update(state, weights=[0.5, 0.5], replica_multipliers=rho, scheduled_value=1.0,
                                  step=110, sync_interval=10)
        assert state.updates == 2
        return first, state.scale

    assert two_updates(True) == pytest.approx((apply(delta), apply(delta) * apply(0.09 * delta / 0.19)))
    assert two_updates(False) == pytest.approx((apply(0.1 * delta), apply(0.1 * delta) * apply(0.09 * delta)))


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
                                             max_log_step=10.0, warmup_steps=0, stop_steps=40,
                                             rise_only_after=rise_only_after))
        state, seen = ControllerState(), []
        for step, weights in ((10, [0.8, 0.2]), (20, [0.8, 0.2]), (30, [0.2, 0.8])):
            state = controller.update(state, weights=weights, replica_multipliers=rho, scheduled_value=1.0, step=step,
                                      sync_interval=10)
            seen.append(state.scale)
        return seen

    down = apply(-delta / 2)
    assert scales(0.4) == pytest.approx([down, down, down * apply(delta / 2)])
    both_ways = [down, down * apply(-3 * delta / 4), down * apply(-3 * delta / 4) * apply(delta / 8)]
    assert scales(1.0) == pytest.approx(both_ways)
    assert scales(0.5) == pytest.approx(both_ways)  # one-sided after step 20: the sync at 20 still lowers


def test_progress_hypergradient_by_hand():
    half = math.log(1.5)  # replicas at 2/3 and 3/2: log rho = -+log 1.5
    # start 3.0, losses 2.9 and 2.8: progress 0.1 and 0.2, slope 0.1 / (2 log 1.5), mean 0.15
    elasticity = 0.1 / (2 * half) / 0.15
    assert progress_hypergradient([2.9, 2.8], 3.0, [2 / 3, 3 / 2]) == pytest.approx(elasticity * half)
    # progress in proportion to the LR (0.1 and 0.225 = 0.1 x 2.25): slope over mean reads 0.95, not 1 (a
    # difference over a mean, not a derivative of the log)
    proportional = progress_hypergradient([2.9, 2.775], 3.0, [2 / 3, 3 / 2])
    assert proportional == pytest.approx(0.125 / (2 * half) / 0.1625 * half)
    assert proportional / half == pytest.approx(0.948, abs=1e-3)
    # the higher multiplier made less progress: elasticity -0.05 / (2 log 1.5) / 0.075 = -0.82
    assert progress_hypergradient([2.9, 2.95], 3.0, [2 / 3, 3 / 2]) == pytest.approx(-0.05 / (2 * half) / 0.075 * half)
    # clipped at -1: the top replica went backwards
    assert progress_hypergradient([2.9, 3.05], 3.0, [2 / 3, 3 / 2]) == pytest.approx(-half)
    # no net progress: -1 when the higher multipliers did worse, else 0
    assert progress_hypergradient([3.0, 3.2], 3.0, [2 / 3, 3 / 2]) == pytest.approx(-half)
    assert progress_hypergradient([3.2, 3.0], 3.0, [2 / 3, 3 / 2]) == 0.0
    # a diverged replica: a full step down
    assert progress_hypergradient([2.9, math.nan], 3.0, [2 / 3, 3 / 2]) == pytest.approx(-half)
    # a target elasticity of 0.5: (e - 0.5) half-widths, e = 0.1 / (2 log 1.5) / 0.15 = 0.82 as above; and from a
    # diverged replica (e = -1) down by 1.5 half-widths
    assert progress_hypergradient([2.9, 2.8], 3.0, [2 / 3, 3 / 2], target=0.5) == pytest.approx(
        (0.1 / (2 * half) / 0.15 - 0.5) * half)
    assert progress_hypergradient([2.9, math.inf], 3.0, [2 / 3, 3 / 2], target=0.5) == pytest.approx(-1.5 * half)
    # four replicas, x = log rho = (-3, -1, 1, 3) h with h = log(1.5) / 3; progress 0.1, 0.12, 0.13, 0.13
    h, progress = math.log(1.5) / 3, [0.1, 0.12, 0.13, 0.13]
    slope = (-3 * 0.1 - 0.12 + 0.13 + 3 * 0.13) * h / (20 * h * h)
    rho = [math.exp(k * h) for k in (-3, -1, 1, 3)]
    assert progress_hypergradient([1.0 - p for p in progress], 1.0, rho) == pytest.approx(slope / 0.12 * 3 * h)


def test_the_progress_hypergradient_moves_the_log_controller():
    controller = Controller(AutoLRConfig(mode="log", hypergradient="progress", beta=0.0, step_size=1.0,
                                         initial_scale=1.0))
    state = controller.update(ControllerState(), weights=[0.5, 0.5], replica_multipliers=[2 / 3, 3 / 2],
                              scheduled_value=1.0, step=10, sync_interval=10, progress=([2.9, 2.8], 3.0))
    assert state.scale == pytest.approx(math.exp(0.1 / 2 / 0.15))  # e log 1.5 with e = 0.1 / (2 log 1.5) / 0.15
    aiming_lower = Controller(AutoLRConfig(mode="log", hypergradient="progress", progress_target=0.9, beta=0.0,
                                           step_size=1.0, initial_scale=1.0))
    lowered = aiming_lower.update(ControllerState(), weights=[0.5, 0.5], replica_multipliers=[2 / 3, 3 / 2],
                                  scheduled_value=1.0, step=10, sync_interval=10, progress=([2.9, 2.8], 3.0))
    assert lowered.scale == pytest.approx(math.exp(0.1 / 2 / 0.15 - 0.9 * math.log(1.5)))  # e 0.82 < 0.9: down
    with pytest.raises(ValueError, match="needs the replicas' probe losses"):
        controller.update(state, weights=[0.5, 0.5], replica_multipliers=[2 / 3, 3 / 2], scheduled_value=1.0,
                          step=20, sync_interval=10)


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
    state = controller.update(ControllerState(), weights=equal, replica_multipliers=[0.9, 1.1],
                              scheduled_value=1e-3, step=200, sync_interval=100, paper_decay=decay)
    gamma = 1 - (1e-5 / 1e-3) ** (1 / 8)  # K = (1000 - 200) / 100 = 8 remaining syncs
    assert state.gamma == pytest.approx(gamma)
    assert state.velocity == pytest.approx(0.0, abs=1e-15)
    assert state.owned_base == pytest.approx(1e-3 * (1 - gamma))
    # Now the high-LR replica wins: Delta = b * sum w (rho - 1) = b * (0.25*-0.1 + 0.75*0.1) = 0.05 b
    base = state.owned_base
    state = controller.update(state, weights=[0.25, 0.75], replica_multipliers=[0.9, 1.1],
                              scheduled_value=123.0, step=300, sync_interval=100, paper_decay=decay)
    assert state.last_delta == pytest.approx(0.05 * base)
    assert state.velocity == pytest.approx(0.5 * 0.05 * base)
    assert state.owned_base == pytest.approx(base * (1 - gamma) + 0.5 * 0.5 * 0.05 * base)
    with pytest.raises(ValueError, match="needs the base schedule's floor"):
        controller.update(ControllerState(), weights=equal, replica_multipliers=[0.9, 1.1],
                          scheduled_value=1e-3, step=0, sync_interval=10)


def test_scale_mode_moves_relative_to_the_base_and_clamps():
    controller = Controller(AutoLRConfig(mode="scale", beta=0.9, step_size=0.5, scale_min=0.5, scale_max=2.0))
    state = controller.update(ControllerState(), weights=[0.0, 1.0], replica_multipliers=[0.5, 1.5],
                              scheduled_value=3.0, step=10, sync_interval=5)
    assert state.last_delta == pytest.approx(0.5)  # the 1.5x replica took all the weight
    assert state.velocity == pytest.approx(0.05)
    assert state.scale == pytest.approx(1.0 * (1 + 0.5 * 0.05))
    for _ in range(500):
        state = controller.update(state, weights=[0.0, 1.0], replica_multipliers=[0.5, 1.5],
                                  scheduled_value=3.0, step=10, sync_interval=5)
    assert state.scale == 2.0
    for _ in range(500):
        state = controller.update(state, weights=[1.0, 0.0], replica_multipliers=[0.5, 1.5],
                                  scheduled_value=3.0, step=10, sync_interval=5)
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
    state = controller.update(ControllerState(), weights=[0.25, 0.75], replica_multipliers=rhos,
                              scheduled_value=1.0, step=10, sync_interval=5)
    delta = 0.25 * math.log(0.5) + 0.75 * math.log(2.0)  # 0.3466
    assert log_hypergradient([0.25, 0.75], rhos) == pytest.approx(delta)
    assert state.last_delta == pytest.approx(delta)
    assert state.velocity == pytest.approx(0.5 * delta)  # 0.1733: lambda v = 0.3466 > 0.25, so capped
    assert state.scale == pytest.approx(math.exp(0.25))
    state = controller.update(state, weights=[0.5, 0.5], replica_multipliers=rhos, scheduled_value=1.0, step=15,
                              sync_interval=5)
    assert state.velocity == pytest.approx(0.25 * delta)  # Delta 0: the momentum decays
    assert state.scale == pytest.approx(math.exp(0.25 + 2.0 * 0.25 * delta))  # 0.1733 < 0.25: not capped
    down = controller.update(ControllerState(), weights=[0.75, 0.25], replica_multipliers=rhos, scheduled_value=1.0,
                             step=10, sync_interval=5)
    assert down.scale == pytest.approx(math.exp(-0.25))  # down as far as up
    assert controller.weights([1.0, 2.0]) == pytest.approx(zscore_weights([1.0, 2.0], 1.0))


def test_an_extra_delta_adds_to_the_hypergradient():
    scale = Controller(AutoLRConfig(mode="scale", beta=0.5, step_size=1.0))
    state = scale.update(ControllerState(), weights=[0.5, 0.5], replica_multipliers=[0.5, 1.5], scheduled_value=1.0,
                         step=10, sync_interval=5, extra_delta=0.2)
    assert state.last_delta == pytest.approx(0.2) and state.scale == pytest.approx(1.0 + 0.5 * 0.2)
    log = Controller(AutoLRConfig(mode="log", beta=0.0, step_size=1.0, max_log_step=1.0))
    state = log.update(ControllerState(), weights=[0.5, 0.5], replica_multipliers=[0.5, 2.0], scheduled_value=1.0,
                       step=10, sync_interval=5, extra_delta=-0.3)
    assert state.last_delta == pytest.approx(-0.3) and state.scale == pytest.approx(math.exp(-0.3))


def test_the_held_scale_is_the_geometric_mean_over_the_windows_last_part():
    """Start 10, stop 50, T = 10, hold_average 0.5: the updates at steps 30, 40 and 50 (>= 50 - 0.5 x 40) are
    averaged, and the one at 50 (the next sync, 60, is past the stop) holds their geometric mean."""
    config = AutoLRConfig(mode="log", beta=0.0, step_size=1.0, max_log_step=1.0, warmup_steps=10, stop_steps=50,
                          hold_average=0.5, initial_scale=1.0, rise_only_after=1.0)  # moves both ways
    controller = Controller(config)
    rhos = [0.5, 2.0]
    weights = {10: [0.2, 0.8], 20: [0.2, 0.8], 30: [0.2, 0.8], 40: [0.7, 0.3], 50: [0.9, 0.1]}
    log_scale, logs, state = 0.0, [], ControllerState()
    for step, w in weights.items():
        state = controller.update(state, weights=w, replica_multipliers=rhos, scheduled_value=1.0, step=step,
                                  sync_interval=10)
        log_scale += w[0] * math.log(0.5) + w[1] * math.log(2.0)  # beta 0, lambda 1: the step is Delta
        logs.append(log_scale)
        if step < 50:
            assert state.scale == pytest.approx(math.exp(log_scale))  # not held yet: the controller's own
    assert state.scales_averaged == 3
    assert state.scale == pytest.approx(math.exp((logs[2] + logs[3] + logs[4]) / 3))
    assert state.scale != pytest.approx(math.exp(logs[4]))
    # 0: the last scale is held; the mean is clamped into [scale_min, scale_max] like any scale
    last = Controller(AutoLRConfig(mode="log", beta=0.0, step_size=1.0, max_log_step=1.0, warmup_steps=10,
                                   stop_steps=50, initial_scale=1.0, rise_only_after=1.0))
    state = ControllerState()
    for step, w in weights.items():
        state = last.update(state, weights=w, replica_multipliers=rhos, scheduled_value=1.0, step=step,
                            sync_interval=10)
    assert state.scale == pytest.approx(math.exp(logs[4])) and state.scales_averaged == 0


@pytest.mark.parametrize(("stop", "hold_average", "averaged"), [(100, 0.5, 6), (100, 0.7, 8), (100, 0.25, 3),
                                                                 (90, 0.7, 8)])
def test_the_sync_on_the_averaged_parts_first_step_is_averaged(stop, hold_average, averaged):
    """Window 0 to ``stop``, T = stop / 10: the averaged part starts at stop (1 - h) (50, 30, 75 -> the syncs from
    80, 27), and the sync on its first step counts. On 0-90 with h = 0.7, 90 - 0.7 x 90 rounds to 27.000000000000007,
    and 1 - 0.7 to 0.30000000000000004 (above 27 / 90): either comparison would leave the sync at 27 out. The
    averaged part is placed as a share before the stop, (90 - 27) / 90 = 0.7 <= h."""
    interval = stop // 10
    controller = Controller(AutoLRConfig(mode="log", beta=0.0, step_size=1.0, warmup_steps=0, stop_steps=stop,
                                         hold_average=hold_average, rise_only_after=1.0))
    state = ControllerState()
    for step in range(interval, stop + 1, interval):
        state = controller.update(state, weights=[0.5, 0.5], replica_multipliers=[0.5, 2.0], scheduled_value=1.0,
                                  step=step, sync_interval=interval)
    assert state.scales_averaged == averaged


def test_the_sync_on_the_one_sided_phases_first_step_still_lowers():
    """Window 0-90, rise-only after 0.7 of it: the phase starts after step 63 (63 / 90 = 0.7 exactly; 0.7 x 90
    rounds to 62.99999999999999, which would start it at 63). The low replica wins at 63 and 72: the scale falls at
    63, and at 72 the velocity (beta 0) is stopped at 0."""
    controller = Controller(AutoLRConfig(mode="log", beta=0.0, step_size=1.0, warmup_steps=0, stop_steps=90,
                                         initial_scale=1.0, rise_only_after=0.7))
    state = ControllerState()
    down = math.exp(0.8 * math.log(0.5) + 0.2 * math.log(2.0))  # Delta = 0.8 log 0.5 + 0.2 log 2
    for step, expected in ((63, down), (72, down)):
        state = controller.update(state, weights=[0.8, 0.2], replica_multipliers=[0.5, 2.0], scheduled_value=1.0,
                                  step=step, sync_interval=9)
        assert state.scale == pytest.approx(expected)


def test_a_stop_off_the_sync_grid_holds_at_the_last_update_before_it():
    """Stop 37 with T = 10: the update at 30 is the last before it (the next, 40, is past it) and holds the mean."""
    controller = Controller(AutoLRConfig(mode="scale", beta=0.0, step_size=1.0, warmup_steps=0, stop_steps=37,
                                         hold_average=0.5, sigma=0.1))
    state, scales = ControllerState(), []
    for step in (10, 20, 30):
        state = controller.update(state, weights=[0.0, 1.0], replica_multipliers=[0.5, 1.5], scheduled_value=1.0,
                                  step=step, sync_interval=10)
        scales.append(scales[-1] * 1.5 if scales else 1.5)  # Delta = +0.5: scale x 1.5 per update
    # averaged: steps >= 37 - 0.5 x 37 = 18.5, i.e. 20 and 30
    assert state.scale == pytest.approx(math.sqrt(scales[1] * scales[2]))
