"""The LR range test a run can start with (``auto_lr.range_test``): the ramp each replica trains at, the pick from
every rank's mean loss, the restart from the first weights with a fresh optimizer state, the start it gives the
controller, and where it is refused."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from distributed import run_ranks
from hdet_scale import HDETConfig, HDETEnsemble, HDETOneCycleLR, HDETScheduler, ReplicaTopology, multipliers
from hdet_scale.config import AutoLRConfig, HDETConfigError
from hdet_scale.controller import Controller, ControllerState
from hdet_scale.engines.ddp import DDPAdapter, attach
from hdet_scale.range_test import RangeTest
from hdet_scale.report import main
from hdet_scale.report_runs import load_run, sync_records

TEST_STEPS = 30
WEIGHT_LR, BIAS_LR = 0.01, 0.002
ALPHA = 0.5
SPREAD = HDETConfig().spread


def synthetic_loss(rank: int, step: int) -> float:
    """Each rank's loss at step ``step`` of the test: rank 0 falls a little early, rank 1 a lot later, so the mean
    falls fastest where rank 0's alone does not."""
    drop, centre = ((1.0, 14.0), (3.0, 24.0))[rank]
    return 5.0 - drop / (1.0 + math.exp(-(step - centre)))


def gradient_of(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The constant gradient of rank ``rank``'s linear loss, for the weight and the bias: a step of plain SGD at LR
    ``lr`` moves them by exactly ``-lr`` times these."""
    generator = torch.Generator().manual_seed(rank)
    return (torch.rand(2, 3, generator=generator, dtype=torch.float64) + 0.5,
            torch.rand(2, generator=generator, dtype=torch.float64) + 0.5)


def two_replicas_with_a_range_test(rank: int, world: int, metrics_path: str) -> dict:
    config = HDETConfig(alpha=ALPHA, sync_interval=4, metrics_path=metrics_path,
                        auto_lr=AutoLRConfig(mode="scale", range_test=TEST_STEPS, start=100))
    topology = ReplicaTopology.build(config)
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()  # float64: the smallest steps of the ramp are read back from the weights
    optimizer = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias], "lr": BIAS_LR}], lr=WEIGHT_LR)
    scheduler = HDETScheduler(LambdaLR(optimizer, lambda step: 1.0 / (1 + step)), hdet_config=config, topology=topology)
    hdet = scheduler.hdet
    first = [model.weight.detach().clone(), model.bias.detach().clone()]
    weight_grad, bias_grad = gradient_of(rank)

    def train_step(loss: float | None) -> tuple[float, float]:
        """One step; the LRs it ran at, read back from how far each tensor moved."""
        before = [model.weight.detach().clone(), model.bias.detach().clone()]
        optimizer.zero_grad()
        ((model.weight * weight_grad).sum() + (model.bias * bias_grad).sum()).backward()
        optimizer.step()
        applied = ((before[0] - model.weight.detach()) / weight_grad).mean().item(), \
            ((before[1] - model.bias.detach()) / bias_grad).mean().item()
        scheduler.step(loss)
        return applied

    ramp, refused = [], []
    for step in range(TEST_STEPS):
        assert hdet.ramping and hdet.global_step == 0
        assert hdet.value("lr/0") == pytest.approx(1e-6 * 1e6 ** (step / (TEST_STEPS - 1)))
        ramp.append(train_step(synthetic_loss(rank, step)))
        assert scheduler.get_last_lr() == [WEIGHT_LR, BIAS_LR]  # the schedule held
        if step == 3:
            for call in (hdet.sync, hdet.state_dict):
                with pytest.raises(RuntimeError, match="LR range test"):
                    call()
                refused.append(call.__name__)
    assert not hdet.ramping and hdet.global_step == 0
    restored = torch.equal(model.weight, first[0]) and torch.equal(model.bias, first[1])
    after = [train_step(1.0) for _ in range(3)]
    hdet.close()
    return {"ramp": ramp, "refused": refused, "restored": restored, "after": after, "pick": hdet.range_test_pick,
            "multiplier": hdet.lr_multiplier(), "steps": hdet.global_step, "schedule": scheduler.get_last_lr()}


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory):
    metrics = tmp_path_factory.mktemp("range") / "m.jsonl"
    return run_ranks(two_replicas_with_a_range_test, 2, str(metrics)), metrics


def test_every_replica_trains_at_the_ramp_each_group_at_its_ratio(two_replicas):
    ranks, _ = two_replicas
    for rank in ranks:
        for step, (weight_lr, bias_lr) in enumerate(rank["ramp"]):
            lr = 1e-6 * 1e6 ** (step / (TEST_STEPS - 1))
            assert weight_lr == pytest.approx(lr, rel=1e-4)
            assert bias_lr == pytest.approx(lr * BIAS_LR / WEIGHT_LR, rel=1e-4)
        assert rank["refused"] == ["sync", "state_dict"]


def test_the_pick_is_from_every_ranks_mean_loss(two_replicas):
    ranks, _ = two_replicas
    by_mean, by_rank_0 = RangeTest(TEST_STEPS), RangeTest(TEST_STEPS)
    for step in range(TEST_STEPS):
        by_mean.add((synthetic_loss(0, step) + synthetic_loss(1, step)) / 2)
        by_rank_0.add(synthetic_loss(0, step))
    assert by_mean.pick() != by_rank_0.pick()
    assert ranks[0]["pick"] == ranks[1]["pick"] == by_mean.pick()


def test_the_run_restarts_from_its_first_weights_with_the_fastest_replica_at_the_pick(two_replicas):
    ranks, metrics = two_replicas
    pick, top = ranks[0]["pick"], max(multipliers(2, ALPHA, SPREAD))
    for rank in ranks:
        assert rank["restored"] and rank["steps"] == 3
        # the schedule starts from its first step after the test: 1 / (1 + step) of the given LRs
        for step, (weight_lr, bias_lr) in enumerate(rank["after"]):
            expected = pick / top * rank["multiplier"] / (1 + step)
            assert weight_lr == pytest.approx(expected, rel=1e-4)
            assert bias_lr == pytest.approx(expected * BIAS_LR / WEIGHT_LR, rel=1e-4)
    assert {rank["multiplier"] for rank in ranks} == set(multipliers(2, ALPHA, SPREAD))
    record = json.loads(metrics.read_text().splitlines()[0])
    assert record["step"] == 0 and record["range_test"]["picked_lr"] == pick
    assert record["range_test"]["scale"] == pytest.approx(pick / (WEIGHT_LR * top))
    assert len(record["range_test"]["lrs"]) == TEST_STEPS


def test_the_report_reads_a_run_that_started_with_a_range_test(two_replicas, tmp_path, capsys):
    _, metrics = two_replicas
    run = load_run(metrics)
    assert [record["step"] for record in sync_records(run)] == []  # 3 steps after the test: no sync yet
    assert main([str(metrics), "--out", str(tmp_path)]) == 0


def test_adam_starts_afresh_and_onecycle_holds_through_the_test():
    parameter = nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([parameter], lr=0.1)
    scheduler = HDETOneCycleLR(optimizer, max_lr=0.1, total_steps=50, sync_interval=5,
                               auto_lr={"range_test": 15, "start": 100})
    first_lr = scheduler.get_last_lr()
    for step in range(15):
        optimizer.zero_grad()
        loss = (parameter ** 2).sum()
        loss.backward()
        optimizer.step()
        scheduler.step(loss.item())
        if step < 14:
            assert optimizer.state[parameter]["exp_avg"].abs().sum() > 0
    assert scheduler.get_last_lr() == first_lr and scheduler.last_epoch == 0
    state = optimizer.state[parameter]
    assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"]
    assert all(not value.any() for value in state.values())
    assert torch.equal(parameter.detach(), torch.ones(4))
    # one replica: its multiplier is 1, the schedule's peak (max_lr) is the pick
    scale = scheduler.hdet.range_test_pick / 0.1
    assert scheduler.hdet.value("lr/0") == pytest.approx(first_lr[0] * scale)


def test_a_resumed_run_does_not_test_again():
    def scheduler_of(parameter: nn.Parameter) -> HDETOneCycleLR:
        return HDETOneCycleLR(torch.optim.SGD([parameter], lr=0.1), max_lr=0.1, total_steps=50, sync_interval=5,
                              auto_lr={"range_test": 15, "start": 100})

    first = scheduler_of(nn.Parameter(torch.ones(2)))
    for _ in range(15):
        first.step(1.0)
    saved = first.state_dict()
    resumed = scheduler_of(nn.Parameter(torch.ones(2)))
    assert resumed.hdet.ramping
    resumed.load_state_dict(saved)
    assert not resumed.hdet.ramping
    assert resumed.hdet.value("lr/0") == pytest.approx(first.hdet.value("lr/0"))


def test_a_step_without_a_loss_is_refused_during_the_test():
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    hdet = HDETEnsemble(HDETConfig(auto_lr=AutoLRConfig(mode="scale", range_test=20)), DDPAdapter(optimizer),
                        topology=ReplicaTopology.single_process())
    with pytest.raises(ValueError, match="range test .* needs every step's loss"):
        hdet.step()


def test_the_controller_bounds_are_relative_to_where_the_test_started_it():
    controller = Controller(AutoLRConfig(mode="scale", beta=0.0, step_size=0.5, scale_min=0.5, scale_max=2.0))
    state = ControllerState(scale=0.3, anchor=0.3)
    for weights in ([0.0, 1.0], [1.0, 0.0]):
        for _ in range(200):
            state = controller.update(state, weights=weights, replica_multipliers=[0.5, 1.5], scheduled_value=1.0,
                                      step=10, sync_interval=5)
        assert state.anchor == 0.3
        assert state.scale == pytest.approx(0.6 if weights == [0.0, 1.0] else 0.15)
    assert ControllerState.from_state_dict({"velocity": 0.0, "scale": 2.0, "last_delta": 0.0}).anchor == 1.0


@pytest.mark.parametrize(("auto_lr", "message"), [
    ({"range_test": 5}, r"auto_lr.range_test=5: a range test needs at least 13 steps"),
    ({"range_test": -1}, "auto_lr.range_test"),
    ({"range_test": 20, "enabled": False}, "auto_lr.range_test sets the scale .* set it to 0 or turn auto_lr on"),
    ({"range_test": 20, "mode": "paper"}, "auto_lr.range_test sets the scale"),
    ({"range_test": 20, "initial_scale": 0.1}, "remove initial_scale"),
])
def test_bad_range_test_settings_are_refused_in_one_line(auto_lr, message):
    with pytest.raises(HDETConfigError, match=message):
        HDETConfig.from_dict({"auto_lr": auto_lr})


def test_after_a_range_test_the_controller_climbs_from_the_pick():
    assert AutoLRConfig(range_test=20).filled().initial_scale == 1.0
    assert AutoLRConfig().filled().initial_scale == 0.1


def test_the_loops_that_would_run_their_scheduler_through_the_test_refuse_it():
    from hdet_scale.integrations.hf_trainer import add_hdet
    from hdet_scale.integrations.lightning import HDETCallback

    with pytest.raises(HDETConfigError, match="range_test is not supported in Lightning"):
        HDETCallback(auto_lr={"range_test": 20})
    with pytest.raises(HDETConfigError, match="range_test is not supported in the transformers Trainer"):
        add_hdet(SimpleNamespace(), {"auto_lr": {"range_test": 20}})
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    assert attach(None, optimizer, HDETConfig(auto_lr=AutoLRConfig(mode="scale", range_test=20)),
                  topology=ReplicaTopology.single_process()).ramping
