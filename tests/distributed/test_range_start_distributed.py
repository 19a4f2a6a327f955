"""The LR range test a run can start with (``auto_lr.range_test``): the ramp each replica trains at, the pick from
every rank's mean loss, the restart from the first weights with a fresh optimizer state, the start it gives the
controller, and where it is refused.

This file holds the tests on gloo ranks; the tests that start no process are in tests/unit/test_range_start.py.
"""

from __future__ import annotations

import json
import math
import statistics
import warnings

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from distributed import run_ranks
from hdet_scale import HDETConfig, HDETEnsemble, HDETScheduler, ReplicaTopology, multipliers
from hdet_scale.config import AutoLRConfig
from hdet_scale.engines.ddp import DDPAdapter
from hdet_scale.range_test import RangeTest
from hdet_scale.tools.report import main
from hdet_scale.tools.report_runs import load_run, sync_records

TEST_STEPS = 30
RUN_STEPS = 12  # three syncs after the test
WEIGHT_LR, BIAS_LR = 0.01, 0.002
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


def two_replicas_with_a_range_test(rank: int, world: int, metrics_path: str, alpha: float | None) -> dict:
    config = HDETConfig(alpha=alpha, sync_interval=4, metrics_path=metrics_path,
                        auto_lr=AutoLRConfig(mode="scale", range_test=TEST_STEPS, start=1))
    topology = ReplicaTopology.build(config)
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()  # float64: the smallest steps of the ramp are read back from the weights
    optimizer = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias], "lr": BIAS_LR}], lr=WEIGHT_LR)
    scheduler = HDETScheduler(LambdaLR(optimizer, lambda step: 1.0 / (1 + step)), hdet_config=config, topology=topology)
    hdet = scheduler.hdet
    # another explored value, which the controller moves from the replicas' losses while the LR holds
    hdet.add_knob("knob", lambda: 1.0, lambda value: None)
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
    after, multiplier = [], []
    for _ in range(RUN_STEPS):  # the replica with the larger knob value scores worse: the controller lowers it
        multiplier.append((hdet.lr_multiplier(0), hdet.lr_multiplier(1)))
        after.append(train_step(1.0 + hdet.value("knob")))
    knob_scale = hdet.last_report.values["knob"]["scale"]
    hdet.close()
    return {"ramp": ramp, "refused": refused, "restored": restored, "after": after, "pick": hdet.range_test_pick,
            "multiplier": multiplier, "steps": hdet.global_step, "knob_scale": knob_scale,
            "found": hdet.found_lr_factor()}


@pytest.fixture(scope="module", params=[None, 0.5], ids=["alpha unset", "alpha 0.5"])
def two_replicas(request, tmp_path_factory):
    """The ranks' results, the metrics file and the ``alpha`` given (None: unset, the default)."""
    metrics = tmp_path_factory.mktemp("range") / "m.jsonl"
    return run_ranks(two_replicas_with_a_range_test, 2, str(metrics), request.param), metrics, request.param


def test_every_replica_trains_at_the_ramp_each_group_at_its_ratio(two_replicas):
    ranks, _, _ = two_replicas
    for rank in ranks:
        for step, (weight_lr, bias_lr) in enumerate(rank["ramp"]):
            lr = 1e-6 * 1e6 ** (step / (TEST_STEPS - 1))
            assert weight_lr == pytest.approx(lr, rel=1e-4)
            assert bias_lr == pytest.approx(lr * BIAS_LR / WEIGHT_LR, rel=1e-4)
        assert rank["refused"] == ["sync", "state_dict"]


def test_the_pick_is_from_every_ranks_mean_loss(two_replicas):
    ranks, _, _ = two_replicas
    by_mean, by_rank_0 = RangeTest(TEST_STEPS), RangeTest(TEST_STEPS)
    for step in range(TEST_STEPS):
        by_mean.add((synthetic_loss(0, step) + synthetic_loss(1, step)) / 2)
        by_rank_0.add(synthetic_loss(0, step))
    assert by_mean.pick() != by_rank_0.pick()
    assert ranks[0]["pick"] == ranks[1]["pick"] == by_mean.pick()


def test_the_run_restarts_from_its_first_weights_with_the_replicas_mean_lr_at_0_7_times_the_pick(two_replicas):
    ranks, metrics, alpha = two_replicas
    # unset, alpha leaves the LR the test picked unspread (nothing reads its spread), and spreads the other value
    lr_multipliers = multipliers(2, 0.0 if alpha is None else alpha, SPREAD)
    pick, mean = ranks[0]["pick"], statistics.fmean(lr_multipliers)
    for rank in ranks:
        assert rank["restored"] and rank["steps"] == RUN_STEPS
        # the schedule starts from its first step after the test: 1 / (1 + step) of the given LRs, the replicas'
        # mean at 0.7 times the pick through every sync, while the controller moved the other explored value
        for step, (weight_lr, bias_lr) in enumerate(rank["after"]):
            weight_multiplier, bias_multiplier = rank["multiplier"][step]
            assert weight_lr == pytest.approx(0.7 * pick / mean * weight_multiplier / (1 + step), rel=1e-4)
            assert bias_lr == pytest.approx(0.7 * pick / mean * bias_multiplier / (1 + step) * BIAS_LR / WEIGHT_LR,
                                            rel=1e-4)
        assert rank["found"] == pytest.approx(0.7 * pick / (WEIGHT_LR * mean))
        assert rank["knob_scale"] < 1.0
    assert {ranks[0]["multiplier"][0][0], ranks[1]["multiplier"][0][0]} == set(lr_multipliers)
    record = json.loads(metrics.read_text().splitlines()[0])
    assert record["step"] == 0 and record["range_test"]["picked_lr"] == pick
    assert record["range_test"]["scale"] == pytest.approx(0.7 * pick / (WEIGHT_LR * mean))
    assert len(record["range_test"]["lrs"]) == TEST_STEPS


def test_the_report_reads_a_run_that_started_with_a_range_test(two_replicas, tmp_path, capsys):
    _, metrics, _ = two_replicas
    run = load_run(metrics)
    assert [record["step"] for record in sync_records(run)] == [4, 8, 12]
    assert main([str(metrics), "--out", str(tmp_path)]) == 0


def controller_settings_under_a_range_test(rank: int, world: int) -> dict[str, list[str]]:
    """The first step's warnings, by whether a value besides the LR is explored (``add_knob``)."""
    seen = {}
    for with_knob in (False, True):
        config = HDETConfig(sync_interval=4, auto_lr=AutoLRConfig(mode="scale", sigma=0.05, step_size=2.0, start=1,
                                                                  scale_max=4.0, range_test=TEST_STEPS))
        weight = nn.Parameter(torch.ones(2))
        optimizer = torch.optim.SGD([weight], lr=WEIGHT_LR)
        scheduler = HDETScheduler(LambdaLR(optimizer, lambda step: 1.0), hdet_config=config,
                                  topology=ReplicaTopology.build(config))
        if with_knob:
            scheduler.hdet.add_knob("knob", lambda: 1.0, lambda value: None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            weight.sum().backward()
            optimizer.step()
            scheduler.step(1.0)
        seen[str(with_knob)] = [str(warning.message) for warning in caught]
        scheduler.hdet.close()
    return seen


def test_controller_settings_the_range_test_leaves_idle_are_told_once():
    """With the range test (on unless set to 0) the LR holds at its pick: settings given for the controller moved
    nothing, silently, unless another value is explored."""
    told, quiet = run_ranks(controller_settings_under_a_range_test, 2)
    assert len(told["False"]) == 1 and told["True"] == []
    assert told["False"][0].startswith("auto_lr.mode, auto_lr.sigma, auto_lr.step_size, auto_lr.scale_max set for ")
    assert "Set auto_lr.range_test to 0" in told["False"][0]
    assert quiet == {"False": [], "True": []}  # rank 0 says it


def one_rank_without_a_loss(rank: int, world: int) -> str:
    config = HDETConfig(auto_lr=AutoLRConfig(mode="scale", range_test=TEST_STEPS))
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    hdet = HDETEnsemble(config, DDPAdapter(optimizer), topology=ReplicaTopology.build(config))
    hdet.step(1.0)
    with pytest.raises(ValueError) as refused:
        hdet.step(1.0 if rank == 0 else None)
    return str(refused.value)


def test_a_rank_without_a_loss_stops_every_rank_in_the_range_test():
    """The rank without a loss raised before the all-reduce of the step's losses, where the others waited until
    the collectives' timeout."""
    messages = run_ranks(one_rank_without_a_loss, 2, timeout=60)
    assert all("needs every step's loss, and rank 1 gave none" in message for message in messages)
