"""The drop-in schedulers in one process: exactly OneCycleLR, no compounding, state, replica changes."""

from __future__ import annotations

import json

import pytest
import torch
from settings import LR_HELD_AT_GIVEN, lr_held_at_given
from torch import nn
from torch.optim.lr_scheduler import ExponentialLR, OneCycleLR

from hdet_scale import HDETConfig, HDETEnsemble, HDETOneCycleLR, HDETScheduler, ReplicaTopology
from hdet_scale.config import AutoLRConfig
from hdet_scale.controller import Controller, PaperDecay
from hdet_scale.engines.ddp import DDPAdapter
from hdet_scale.explored import ExploredValue
from hdet_scale.knobs import POSITIVE, Knob
from hdet_scale.spread import multipliers


def two_group_optimizer(kind: str) -> torch.optim.Optimizer:
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))]
    groups = [{"params": [params[0]]}, {"params": [params[1]], "weight_decay": 0.0}]
    if kind == "adam":
        return torch.optim.AdamW(groups, lr=1e-3)
    return torch.optim.SGD(groups, lr=1e-3, momentum=0.9)


def parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]


def train_step(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    params = parameters(optimizer)
    optimizer.zero_grad()
    loss = sum((p**2).sum() for p in params)
    loss.backward()
    optimizer.step()
    return loss


@pytest.mark.parametrize(
    ("kind", "kwargs"),
    [
        ("sgd", {"max_lr": 0.1, "total_steps": 60}),
        ("adam", {"max_lr": [0.1, 0.02], "total_steps": 60, "three_phase": True}),
        ("adam", {"max_lr": 0.05, "epochs": 3, "steps_per_epoch": 20, "anneal_strategy": "linear"}),
        ("sgd", {"max_lr": 0.1, "total_steps": 60, "pct_start": 0.5, "div_factor": 10.0, "final_div_factor": 100.0}),
    ],
)
def test_one_process_is_exactly_onecyclelr(kind, kwargs):
    reference_opt, hdet_opt = two_group_optimizer(kind), two_group_optimizer(kind)
    reference = OneCycleLR(reference_opt, **kwargs)
    rng_before = torch.random.get_rng_state()
    scheduler = HDETOneCycleLR(hdet_opt, **kwargs, alpha=0.5, sync_interval=7,
                               auto_lr={"start": 0, "range_test": 0})
    momentum_key = "betas" if kind == "adam" else "momentum"
    for step in range(59):
        train_step(reference_opt)
        loss = train_step(hdet_opt)
        reference.step()
        scheduler.step(loss if step % 2 else None)  # with and without a loss
        for ref_group, group in zip(reference_opt.param_groups, hdet_opt.param_groups, strict=True):
            assert type(group["lr"]) is float
            assert group["lr"] == ref_group["lr"] and group[momentum_key] == ref_group[momentum_key]
    for ref_param, param in zip(reference_opt.param_groups[0]["params"], hdet_opt.param_groups[0]["params"],
                                strict=True):
        assert torch.equal(ref_param, param)
    assert scheduler.get_last_lr() == reference.get_last_lr()
    assert torch.equal(rng_before, torch.random.get_rng_state())  # HDET never touches the global RNG


def test_a_group_held_at_lr_0_is_onecyclelrs_outside_paper_mode():
    """OneCycleLR takes a max_lr of 0 for a frozen group; only ``paper`` mode decays to the schedule's floor, so the
    others build and train as OneCycleLR does."""
    reference_opt, hdet_opt = two_group_optimizer("sgd"), two_group_optimizer("sgd")
    reference = OneCycleLR(reference_opt, max_lr=[0.1, 0.0], total_steps=20)
    scheduler = HDETOneCycleLR(hdet_opt, max_lr=[0.1, 0.0], total_steps=20, sync_interval=5,
                               auto_lr={"range_test": 0})
    for _ in range(19):
        train_step(reference_opt)
        loss = train_step(hdet_opt)
        reference.step()
        scheduler.step(loss)
    assert scheduler.get_last_lr() == reference.get_last_lr()
    for ref_group, group in zip(reference_opt.param_groups, hdet_opt.param_groups, strict=True):
        assert all(torch.equal(ref, param) for ref, param in zip(ref_group["params"], group["params"], strict=True))


def test_state_dict_resumes_onecycle_and_hdet():
    def run(steps, scheduler_state=None, optimizer_state=None, weights=None):
        optimizer = two_group_optimizer("adam")
        if optimizer_state:
            optimizer.load_state_dict(optimizer_state)
            with torch.no_grad():
                for param, weight in zip(parameters(optimizer), weights, strict=True):
                    param.copy_(weight)
        scheduler = HDETOneCycleLR(optimizer, max_lr=0.1, total_steps=40, sync_interval=5,
                                   auto_lr={"range_test": 0})
        if scheduler_state:
            scheduler.load_state_dict(scheduler_state)
        lrs = []
        for _ in range(steps):
            scheduler.step(train_step(optimizer))
            lrs.append(scheduler.get_last_lr())
        return lrs, scheduler, optimizer

    straight, _, straight_optimizer = run(30)
    first, scheduler, optimizer = run(13)
    second, resumed, resumed_optimizer = run(17, scheduler.state_dict(), optimizer.state_dict(),
                                             [param.detach().clone() for param in parameters(optimizer)])
    assert first + second == straight
    assert resumed.hdet.global_step == 30
    # the weights too: the first resumed step trained at OneCycleLR's first LR and momentum, not step 14's
    pairs = zip(parameters(resumed_optimizer), parameters(straight_optimizer), strict=True)
    assert all(torch.equal(param, straight_param) for param, straight_param in pairs)


def test_multipliers_never_compound_with_a_chainable_scheduler():
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    replica_one_of_two = ReplicaTopology(rank=1, world_size=2, ranks_per_replica=1)
    scheduler = HDETScheduler(ExponentialLR(optimizer, gamma=0.9), topology=replica_one_of_two,
                              alpha=0.5, spread="linear", sync_interval=1000, auto_lr=LR_HELD_AT_GIVEN)
    used = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    rho = scheduler.hdet.lr_multiplier()
    assert rho in multipliers(2, 0.5) and rho != 1.0
    for step in range(20):
        train_step(optimizer)
        scheduler.step()
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.9 ** (step + 1), rel=1e-12)
    assert used == pytest.approx([0.1 * 0.9**step * rho for step in range(20)], rel=1e-12)


def test_the_lr_starts_at_the_controllers_initial_scale_and_other_values_at_one():
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1, weight_decay=0.01)
    replica_one_of_two = ReplicaTopology(rank=1, world_size=2, ranks_per_replica=1)
    scheduler = HDETScheduler(ExponentialLR(optimizer, gamma=0.9), topology=replica_one_of_two, alpha=0.5,
                              sync_interval=1000, explore={"weight_decay": {"alpha": 0.5}},
                              auto_lr={"mode": "log", "initial_scale": 0.25, "scale_min": 0.01, "range_test": 0},
                              total_steps=10_000)
    used = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.append(
        (opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"])))
    rho = scheduler.hdet.lr_multiplier()
    for _ in range(3):
        train_step(optimizer)
        scheduler.step()
    assert [lr for lr, _ in used] == pytest.approx([0.1 * 0.9**step * 0.25 * rho for step in range(3)], rel=1e-12)
    assert {round(decay / 0.01, 9) for _, decay in used} <= {round(m, 9) for m in multipliers(2, 0.5, "log")}


def test_one_replica_trains_at_the_lr_it_was_given_whatever_the_initial_scale():
    """One replica has no controller to climb from a low start: its LR would stay at the initial scale."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.warns(UserWarning, match="ONE replica"):
        scheduler = HDETScheduler(ExponentialLR(optimizer, gamma=0.9), topology=ReplicaTopology.single_process(),
                                  auto_lr={"mode": "log", "initial_scale": 0.25, "scale_min": 0.01, "range_test": 0})
    used = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    for _ in range(3):
        train_step(optimizer)
        scheduler.step()
    assert used == pytest.approx([0.1 * 0.9**step for step in range(3)], rel=1e-12)


def test_state_loads_into_a_different_number_of_replicas():
    def ensemble(num_replicas: int) -> HDETEnsemble:
        optimizer = two_group_optimizer("sgd")
        topology = ReplicaTopology(rank=0, world_size=num_replicas, ranks_per_replica=1)
        config = HDETConfig(spread="linear", alpha=0.3, sync_interval=100, auto_lr=lr_held_at_given())
        return HDETEnsemble(config, DDPAdapter(optimizer), topology=topology)

    four = ensemble(4)
    for _ in range(3):
        four.step(1.0)
    state = four.state_dict()
    state["explored"]["lr/0"]["controller"]["scale"] = 1.5  # as if the controller had moved
    two = ensemble(2)
    two.load_state_dict(state)
    assert two.global_step == 3
    assert two.lr_multiplier(0) in multipliers(2, 0.3) and two.lr_multiplier(1) in multipliers(2, 0.3)
    assert two.current_lrs()[0] == pytest.approx(1e-3 * 1.5 * two.lr_multiplier(0))
    assert "rank" not in str(state)

    one_group = HDETEnsemble(HDETConfig(), DDPAdapter(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)),
                             topology=ReplicaTopology.single_process())
    with pytest.raises(ValueError, match="param groups and HDET.s explore settings must match the checkpoint"):
        one_group.load_state_dict(state)


def test_bad_settings_fail_before_any_work():
    optimizer = two_group_optimizer("sgd")
    with pytest.raises(ValueError, match="sync_interval must be an integer >= 1, got 0"):
        HDETOneCycleLR(optimizer, max_lr=0.1, total_steps=10, sync_interval=0)
    with pytest.raises(ValueError, match="unknown HDET setting 'alpah'"):
        HDETOneCycleLR(optimizer, max_lr=0.1, total_steps=10, alpah=0.1)
    with pytest.raises(ValueError, match="spread must be one of 'linear', 'log', got 0.1"):
        HDETOneCycleLR(optimizer, max_lr=0.1, total_steps=10, spread=0.1)
    with pytest.raises(ValueError, match="ranks_per_replica=2 needs torch.distributed"):
        HDETOneCycleLR(optimizer, max_lr=0.1, total_steps=10, ranks_per_replica=2)
    assert "initial_lr" not in optimizer.param_groups[0]  # OneCycleLR never started


def test_onecycle_starts_the_controller_at_its_share_of_total_steps():
    scheduler = HDETOneCycleLR(two_group_optimizer("adam"), max_lr=0.1, total_steps=40, sync_interval=5,
                               auto_lr={"start": 0.25})
    assert scheduler.hdet.config.auto_lr.start == 10  # 0.25 x 40


@pytest.mark.parametrize("kind", ["onecycle", "any scheduler"])
def test_a_scheduler_built_with_its_saved_state_continues_without_new_warm_init_noise(kind):
    """A run that loads its weights before building the scheduler passes the scheduler's state: it was noised
    again by warm init (eq. 10 is for a fresh start)."""
    replica_one_of_two = ReplicaTopology(rank=1, world_size=2, ranks_per_replica=1)
    settings = {"sync_interval": 50, "auto_lr": LR_HELD_AT_GIVEN, "warm_init": {"enabled": True, "nu": 0.1}}

    def build(optimizer: torch.optim.Optimizer, state=None):
        if kind == "onecycle":
            return HDETOneCycleLR(optimizer, max_lr=0.1, total_steps=40, topology=replica_one_of_two, state=state,
                                  **settings)
        return HDETScheduler(ExponentialLR(optimizer, gamma=0.9), topology=replica_one_of_two, state=state,
                             total_steps=40, **settings)

    def params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [param for group in optimizer.param_groups for param in group["params"]]

    optimizer = two_group_optimizer("sgd")
    scheduler = build(optimizer)
    assert not torch.equal(params(optimizer)[0], torch.ones(3))  # a fresh start is noised
    for _ in range(10):  # no sync: one process, no process group
        scheduler.step(train_step(optimizer))
    loaded = two_group_optimizer("sgd")
    with torch.no_grad():  # the checkpoint's weights, loaded before the scheduler is built
        for param, saved in zip(params(loaded), params(optimizer), strict=True):
            param.copy_(saved)
    resumed = build(loaded, state=scheduler.state_dict())
    for param, saved in zip(params(loaded), params(optimizer), strict=True):
        assert torch.equal(param, saved)
    assert resumed.hdet.global_step == 10 and resumed.get_last_lr() == scheduler.get_last_lr()


def test_the_papers_controller_takes_over_onecycle_at_the_end_of_its_warm_up():
    """Eq. 8's decay starts from where the controller takes over: at 5% of the run it took OneCycleLR over on its
    rise, at a tenth of max_lr, and the LR never reached its peak."""
    def start(pct_start: float, **auto_lr) -> int:
        return HDETOneCycleLR(two_group_optimizer("sgd"), max_lr=0.1, total_steps=40, pct_start=pct_start,
                              auto_lr={"mode": "paper", **auto_lr}).hdet.config.auto_lr.start

    assert start(0.3) == 12 and start(0.25) == 10  # 0.3 x 40 and 0.25 x 40: OneCycleLR's peak
    assert start(0.3, start=5) == 5 and start(0.3, start=0.5) == 20  # as given
    assert start(1.0) == 2  # a warm-up over the whole run (OneCycleLR takes it): the mode's own default, 5%


def test_a_syncs_report_holds_the_values_the_intervals_last_step_trained_with():
    """At a sync the scheduler has already stepped to the next step's LR: the report gave that one as what the
    replicas trained with, not the LR of the losses it reports."""
    optimizer = two_group_optimizer("sgd")
    scheduler = HDETOneCycleLR(optimizer, max_lr=0.1, total_steps=20, topology=ReplicaTopology.single_process(),
                               sync_interval=5, auto_lr=LR_HELD_AT_GIVEN)
    used: list[list[float]] = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.append([g["lr"] for g in opt.param_groups]))
    for step in range(1, 11):
        train_step(optimizer)
        report = scheduler.step(1.0)
        if step % 5:
            continue
        for group in range(2):
            values = report.values[f"lr/{group}"]
            assert values["replica_values"] == [used[-1][group]]  # step 5's and step 10's LR, as the optimizer had it
            assert values["next_replica_values"] == [optimizer.param_groups[group]["lr"]] != [used[-1][group]]


class MovingKnob(Knob):
    """A knob whose schedule the test moves by hand."""

    def __init__(self) -> None:
        super().__init__("lr/0", POSITIVE)
        self.now = 1e-3

    def scheduled(self) -> float:
        return self.now


def test_the_papers_controller_takes_over_from_the_base_the_intervals_last_step_trained_with():
    """Eq. 7 moves eta at kT, the base of the sync's step; at the sync the schedule has moved on a step."""
    knob = MovingKnob()
    explored = ExploredValue.start(knob, seed=0, num_replicas=2, alpha=0.1, spread="linear",
                                   paper_decay=PaperDecay(total_steps=1000, floor=1e-5))
    explored.applied_value(0, None, 0)  # the interval's last step trains at 1e-3
    knob.now = 2e-3  # then the scheduler steps
    explored.update(Controller(AutoLRConfig(mode="paper")), weights=[0.5, 0.5], steps=100, step=200,
                    sync_interval=100)
    gamma = 1 - (1e-5 / 1e-3) ** (1 / 8)  # 8 syncs left, from 1e-3 down to the floor
    assert explored.state.owned_base == pytest.approx(1e-3 * (1 - gamma))
    # the report's scale is the owned base over the schedule's value now (the controller's own scale stays 1)
    assert explored.report([], [], [])["scale"] == pytest.approx(1e-3 * (1 - gamma) / 2e-3)


def test_a_sync_where_the_replicas_are_one_model_already_does_nothing(tmp_path):
    """A sync() right after a regular one wrote a second line for the same step, without losses or bases, which the
    report then took for that interval's (and a schedule export said the interval's bases were missing)."""
    metrics = tmp_path / "metrics.jsonl"
    optimizer = two_group_optimizer("sgd")
    scheduler = HDETOneCycleLR(optimizer, max_lr=0.1, total_steps=20, topology=ReplicaTopology.single_process(),
                               sync_interval=4, auto_lr=LR_HELD_AT_GIVEN, metrics_path=str(metrics))
    assert scheduler.hdet.sync() is None  # at the start
    for _ in range(8):
        train_step(optimizer)
        scheduler.step(1.0)
    assert scheduler.hdet.sync() is None  # right after the sync at step 8
    train_step(optimizer)
    scheduler.step(1.0)
    assert scheduler.hdet.sync().step == 9  # one step later the replicas may differ: a sync
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [4, 8, 9]


def test_a_wrapped_scheduler_resumed_after_its_optimizer_trains_at_the_restored_lr():
    """Building LambdaLR set the groups to its first step's LR, over the one the optimizer's state restored: the first
    resumed step trained at base_lr x f(0)."""
    def build(optimizer_state: dict | None = None) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
        if optimizer_state is not None:
            optimizer.load_state_dict(optimizer_state)  # then the scheduler is built: LambdaLR sets its first LR
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))

    optimizer, torch_scheduler = build()
    scheduler = HDETScheduler(torch_scheduler, auto_lr=LR_HELD_AT_GIVEN)
    for _ in range(3):
        train_step(optimizer)
        scheduler.step(0.0)
    saved_optimizer, saved = optimizer.state_dict(), scheduler.state_dict()
    optimizer, torch_scheduler = build(saved_optimizer)
    resumed = HDETScheduler(torch_scheduler, auto_lr=LR_HELD_AT_GIVEN, state=saved)
    assert optimizer.param_groups[0]["lr"] == resumed.get_last_lr()[0] == pytest.approx(0.1 / 4)


def test_a_plateau_scheduler_is_refused_with_the_way_that_works():
    """ReduceLROnPlateau steps on a metric HDETScheduler does not have: its first step raised a bare TypeError, after
    HDET's hooks were on the optimizer."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    with pytest.raises(TypeError, match=r"ReduceLROnPlateau steps on one: keep calling plateau.step\(metric\) .*"
                                        r"hdet_scale.engines.ddp.attach"):
        HDETScheduler(plateau, auto_lr=LR_HELD_AT_GIVEN)
    assert not getattr(optimizer, "_hdet_attached", False)


def test_a_wrapped_cycling_scheduler_resumes_its_momentum_and_its_step_count():
    """OneCycleLR under HDETScheduler: the LR came back, the momentum stayed at max_momentum, where building the
    scheduler put it (0.95 where the run was at 0.861)."""
    def build(optimizer_state: dict | None = None) -> tuple[torch.optim.Optimizer, OneCycleLR]:
        optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9)
        if optimizer_state is not None:
            optimizer.load_state_dict(optimizer_state)  # then the scheduler is built: its first step's values
        return optimizer, OneCycleLR(optimizer, max_lr=0.1, total_steps=20)

    optimizer, torch_scheduler = build()
    scheduler = HDETScheduler(torch_scheduler, auto_lr=LR_HELD_AT_GIVEN)
    for _ in range(8):
        train_step(optimizer)
        scheduler.step(0.0)
    group, count = dict(optimizer.param_groups[0]), torch_scheduler._step_count
    saved_optimizer, saved = optimizer.state_dict(), scheduler.state_dict()
    optimizer, torch_scheduler = build(saved_optimizer)
    HDETScheduler(torch_scheduler, auto_lr=LR_HELD_AT_GIVEN, state=saved)
    resumed = optimizer.param_groups[0]
    assert (resumed["lr"], resumed["momentum"]) == pytest.approx((group["lr"], group["momentum"]))
    assert resumed["momentum"] != pytest.approx(0.95) and torch_scheduler._step_count == count
