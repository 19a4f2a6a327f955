"""The sync's parts on their own: an explored value's math, the interval loss, the per-replica scores."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hdet_scale.config import AutoLRConfig
from hdet_scale.controller import Controller, ControllerState
from hdet_scale.explored import ExploredValue
from hdet_scale.knobs import NON_NEGATIVE, PROBABILITY, OptimizerGroupKnob, ValueKnob
from hdet_scale.scores import IntervalLoss, ReplicaScores
from hdet_scale.spread import PermutationStream
from hdet_scale.topology import ReplicaTopology


def lr_value(lr: float = 0.1, permutation: list[int] | None = None) -> ExploredValue:
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=lr)
    return ExploredValue(knob=OptimizerGroupKnob("lr/0", optimizer, 0, "lr", NON_NEGATIVE),
                         stream=PermutationStream("lr/0", 0), multipliers=[0.5, 1.0, 1.5],
                         permutation=permutation or [2, 0, 1])


def test_values_are_base_times_the_replicas_multiplier():
    explored = lr_value(permutation=[2, 0, 1])
    explored.state = ControllerState(scale=2.0)
    assert explored.base() == pytest.approx(0.2)  # scheduled 0.1 x scale 2
    assert explored.base(scheduled=0.3) == pytest.approx(0.6)
    assert explored.replica_multipliers() == [1.5, 0.5, 1.0]
    assert explored.multiplier(1) == 0.5
    assert explored.value(0) == pytest.approx(0.3) and explored.value(2, scheduled=0.3) == pytest.approx(0.6)
    assert explored.replica_values() == pytest.approx([0.3, 0.1, 0.2])
    explored.state = ControllerState(owned_base=0.04)  # paper mode: the controller's own base
    assert explored.base(scheduled=0.3) == pytest.approx(0.04)
    assert explored.replica_values() == pytest.approx([0.06, 0.02, 0.04])


def test_values_stay_inside_the_bounds():
    knob = ValueKnob("label_smoothing", 0.8, PROBABILITY)
    explored = ExploredValue(knob=knob, stream=PermutationStream(knob.name, 0), multipliers=[0.5, 1.0, 1.5],
                             permutation=[0, 1, 2])
    assert explored.replica_values()[:2] == pytest.approx([0.4, 0.8])
    assert explored.replica_values()[2] < 1.0  # 1.2 clamped below the open end 1


def test_update_moves_the_scale_by_the_weighted_multipliers():
    explored = lr_value(permutation=[0, 1, 2])  # replicas train at 0.5, 1.0, 1.5
    controller = Controller(AutoLRConfig(mode="scale", beta=0.5, step_size=2.0))
    explored.update(controller, weights=[0.0, 0.25, 0.75], steps=5, step=10, sync_interval=5)
    # Delta = 0.25 * 0 + 0.75 * 0.5 = 0.375; v = 0.5 * 0 + 0.5 * 0.375 = 0.1875; scale = 1 + 2 * 0.1875 = 1.375
    assert explored.state.last_delta == pytest.approx(0.375)
    assert explored.state.velocity == pytest.approx(0.1875)
    assert explored.state.scale == pytest.approx(1.375)
    trained_with = explored.replica_values()
    report = explored.report(trained_with, [0.1, 0.1], [0.5, 1.0, 1.5])
    assert report["base"] == pytest.approx(0.1375) and report["scale"] == pytest.approx(1.375)
    assert report["applied_bases"] == [0.1, 0.1] and report["replica_multipliers"] == [0.5, 1.0, 1.5]
    assert report["next_replica_values"] == pytest.approx([0.06875, 0.1375, 0.20625])


def test_an_interval_cut_by_an_extra_sync_moves_the_controller_by_the_step_weighted_mean_of_its_parts():
    """An extra sync 1 step into a 4-step interval, then the regular sync: the update rested on the last 3 steps
    alone, at the whole interval's strength."""
    explored = lr_value(permutation=[0, 1, 2])  # the first part trains at 0.5, 1.0, 1.5
    controller = Controller(AutoLRConfig(mode="scale", beta=0.5, step_size=2.0))
    explored.keep_part(controller, weights=[0.0, 0.0, 1.0], steps=1)  # Delta 0.5
    explored.permutation = [2, 1, 0]  # the extra sync's redraw: the rest at 1.5, 1.0, 0.5
    saved = explored.state_dict()  # as a preemption checkpoint after the extra sync
    explored = lr_value(permutation=[0, 1, 2])
    explored.load_state_dict(saved, same_layout=True)
    explored.update(controller, weights=[0.0, 0.5, 0.5], steps=3, step=20, sync_interval=4)  # Delta -0.25
    # Delta = (1 x 0.5 + 3 x -0.25) / 4 = -0.0625; v = 0.5 x -0.0625 = -0.03125; scale = 1 - 2 x 0.03125
    assert explored.state.last_delta == pytest.approx(-0.0625)
    assert explored.state.velocity == pytest.approx(-0.03125)
    assert explored.state.scale == pytest.approx(0.9375)
    explored.update(controller, weights=[0.0, 0.5, 0.5], steps=4, step=24, sync_interval=4)  # the parts are used
    assert explored.state.last_delta == pytest.approx(-0.25)


def test_state_round_trips_and_redraws_on_another_layout():
    explored = ExploredValue.start(lr_value().knob, seed=3, num_replicas=3, alpha=0.5)
    explored.state = ControllerState(scale=1.5, velocity=0.1)
    saved = explored.state_dict()
    expected_next = explored.stream.draw(3)
    same = ExploredValue.start(lr_value().knob, seed=99, num_replicas=3, alpha=0.5)
    same.load_state_dict(saved, same_layout=True)
    assert same.permutation == explored.permutation and same.state == explored.state
    same.redraw()
    assert same.permutation == expected_next  # the stream continues where the saved one was
    other = ExploredValue.start(lr_value().knob, seed=99, num_replicas=4, alpha=0.5)  # a replica more
    other.load_state_dict(saved, same_layout=False)
    stream = PermutationStream("lr/0", 0)
    stream.load_state_dict(saved["stream"])
    assert other.permutation == stream.draw(4) and sorted(other.permutation) == [0, 1, 2, 3]  # drawn afresh from it
    assert other.state == explored.state


OLD_CONTROLLER_FIELDS = {"updates": 12, "log_scale_sum": 0.7, "scales_averaged": 3, "anchor": 0.4}
"""What a checkpoint of an earlier version holds for ``auto_lr.bias_correction`` and ``hold_average`` and for the
controller moving on from a range test's pick, since removed."""


def test_a_controller_state_saved_with_the_fields_of_removed_settings_loads():
    explored = ExploredValue.start(lr_value().knob, seed=3, num_replicas=3, alpha=0.5)
    explored.state = ControllerState(scale=1.5, velocity=0.1, last_delta=0.2)
    saved = explored.state_dict()
    old = {**saved, "controller": {**saved["controller"], **OLD_CONTROLLER_FIELDS}}
    for state in (old, saved):  # with and without them
        loaded = ExploredValue.start(lr_value().knob, seed=99, num_replicas=3, alpha=0.5)
        loaded.load_state_dict(state, same_layout=True)
        assert loaded.state == explored.state and loaded.permutation == explored.permutation
    with pytest.raises(TypeError, match="unexpected keyword argument 'momentum'"):  # anything else is still refused
        ControllerState.from_state_dict({**saved["controller"], "momentum": 0.9})


def test_an_ensemble_state_saved_with_the_keys_of_removed_settings_loads():
    """A checkpoint of an earlier version holds ``start_probe_loss`` (the progress hypergradient's) and the
    controller fields of bias correction and the held average: it resumes as one saved without them."""
    from hdet_scale import HDETConfig, HDETEnsemble
    from hdet_scale.engines.ddp import DDPAdapter

    config = HDETConfig.from_dict({"ranks_per_replica": 1, "sync_interval": 5, "auto_lr": {"range_test": 0}})
    two_replicas = ReplicaTopology(world_size=2, rank=0, ranks_per_replica=1)

    def ensemble() -> HDETEnsemble:
        optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
        return HDETEnsemble(config, DDPAdapter(optimizer), topology=two_replicas, total_steps=1000)

    def plain(value):  # tensors (the generators' states) as lists, to compare whole states
        if isinstance(value, dict):
            return {key: plain(item) for key, item in value.items()}
        return value.tolist() if isinstance(value, torch.Tensor) else value

    saved = ensemble().state_dict()
    assert "start_probe_loss" not in saved
    old = {**saved, "start_probe_loss": 2.5,
           "explored": {name: {**value, "controller": {**value["controller"], **OLD_CONTROLLER_FIELDS}}
                        for name, value in saved["explored"].items()}}
    for state in (old, saved):
        resumed = ensemble()
        resumed.load_state_dict(state)
        assert plain(resumed.state_dict()) == plain(saved)


def test_interval_loss_averages_micro_batches_into_steps():
    interval = IntervalLoss()
    interval.add_step(2.0)
    interval.add_step([1.0, 3.0, 5.0])  # a step of three micro-batches: 3
    interval.observe(torch.tensor(4.0))
    interval.observe(torch.tensor(8.0))
    with pytest.raises(ValueError, match="give a step's losses one way"):  # a whole step's loss, or one more?
        interval.add_step(torch.tensor(8.0))
    interval.add_step(None)  # the observed 4 and 8: 6
    interval.add_step(None)  # no loss: not counted
    assert (interval.total(), interval.count) == (pytest.approx(11.0), 3)
    interval.observe(1.0)
    interval.restore(7.0, 2)  # an unfinished micro-batch is dropped
    interval.add_step(None)
    assert (interval.total(), interval.count) == (pytest.approx(7.0), 2)
    interval.reset()
    assert (interval.total(), interval.count) == (0.0, 0)
    with pytest.raises(ValueError, match="scalar loss"):
        interval.add_step(torch.ones(2))


def test_scores_reduce_rank_rows_to_replicas():
    topology = ReplicaTopology(rank=0, world_size=6, ranks_per_replica=2)  # 3 replicas of 2 ranks
    table = torch.tensor([
        # loss sum, steps, tensors finite, probe
        [6.0, 3.0, 1.0, 1.0],  # replica 0: interval means 2 and 4 -> 3; probe 1.5
        [12.0, 3.0, 1.0, 2.0],
        [0.0, 0.0, 1.0, 5.0],  # replica 1: one rank without losses -> 5; its tensors are not finite
        [10.0, 2.0, 0.0, 7.0],
        [0.0, 0.0, 1.0, 3.0],  # replica 2: no losses at all
        [0.0, 0.0, 1.0, 3.0],
    ], dtype=torch.float64)
    scores = ReplicaScores.from_table(table, topology, with_probe=True)
    assert scores.losses == [3.0, 5.0, None]
    assert scores.probe_losses == [1.5, 6.0, 3.0]
    assert scores.healthy == [True, False, True] and scores.excluded == [1]
    assert scores.bytes_gathered == 6 * 4 * 8
    assert scores.controller_signal(0.0) == [3.0, 5.0, None]
    assert scores.controller_signal(1.0) == [1.5, 6.0, 3.0]
    assert scores.controller_signal(0.25) == pytest.approx([2.625, 5.25, None])
    assert ReplicaScores.from_table(table, topology, with_probe=False).probe_losses is None


def test_non_finite_tensors_make_a_replica_unhealthy_and_a_non_finite_loss_does_not():
    """Column 2 says whether a rank's tensors and optimizer state are finite; a loss is only a score."""
    topology = ReplicaTopology(rank=0, world_size=3, ranks_per_replica=1)
    table = torch.tensor([[math.inf, 1.0, 1.0, math.nan], [1.0, 1.0, 1.0, math.nan], [2.0, 1.0, 0.0, math.nan]],
                         dtype=torch.float64)
    scores = ReplicaScores.from_table(table, topology, with_probe=False)
    assert scores.healthy == [True, True, False] and scores.excluded == [2]
    assert scores.losses[:2] == [math.inf, 1.0]
    sharded = ReplicaScores.from_table(table[[0, 2, 1, 1]], ReplicaTopology(rank=0, world_size=4, ranks_per_replica=2),
                                       with_probe=False)
    assert sharded.healthy == [False, True]  # one unhealthy rank leaves its whole replica out
