"""The LR range test a run can start with (``auto_lr.range_test``): the ramp each replica trains at, the pick from
every rank's mean loss, the restart from the first weights with a fresh optimizer state, the start it gives the
controller, and where it is refused.

This file holds the tests that start no process; the tests on gloo ranks are in
tests/distributed/test_range_start_distributed.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hdet_scale import HDETConfig, HDETEnsemble, HDETOneCycleLR, ReplicaTopology, WarmInitConfig
from hdet_scale.config import AutoLRConfig, HDETConfigError
from hdet_scale.engines.ddp import DDPAdapter, attach


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
    # one replica: its multiplier is 1, and the schedule's peak (max_lr) goes to 0.7 times the pick
    scale = 0.7 * scheduler.hdet.range_test_pick / 0.1
    assert scheduler.hdet.value("lr/0") == pytest.approx(first_lr[0] * scale)


def test_current_lrs_are_the_ramps_during_the_test():
    """``current_lrs()`` is what the next ``optimizer.step()`` uses: during the test, the ramp's LR of each group
    (the second group keeps its ratio to the first), not the schedule's."""
    from hdet_scale.range_test import ramp_lr

    params = [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))]
    optimizer = torch.optim.SGD([{"params": [params[0]]}, {"params": [params[1]], "lr": 0.05}], lr=0.1)
    hdet = HDETEnsemble(HDETConfig(auto_lr=AutoLRConfig(mode="scale", range_test=15)), DDPAdapter(optimizer),
                        topology=ReplicaTopology.single_process())
    seen = []
    optimizer.register_step_pre_hook(lambda opt, *_: seen.append([group["lr"] for group in opt.param_groups]))
    for step in range(3):
        expected = [ramp_lr(step, steps=15), ramp_lr(step, steps=15) / 2]
        assert hdet.current_lrs() == pytest.approx(expected)
        for param in params:
            param.grad = torch.ones(2)
        optimizer.step()
        assert seen[-1] == pytest.approx(expected)
        hdet.step(1.0)
    hdet.close()


def test_a_step_count_kept_as_an_int_starts_again_too():
    """DeepSpeed's FusedAdam and CPU Adam keep ``state['step']`` as a Python int, which sets their bias correction:
    left at the test's count, the first steps after it would be several times a fresh Adam's."""
    parameter = nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([parameter], lr=0.1)
    optimizer.state[parameter] = {"step": 100, "exp_avg": torch.ones(4), "exp_avg_sq": torch.ones(4),
                                  "fused": True}
    DDPAdapter(optimizer).restart_optimizer_state()
    state = optimizer.state[parameter]
    assert state["step"] == 0 and type(state["step"]) is int
    assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    assert state["fused"] is True  # a flag, not a count


@pytest.mark.parametrize("make", [
    lambda params: torch.optim.AdamW(params, lr=0.1),
    lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    lambda params: torch.optim.NAdam(params, lr=0.1),
    lambda params: torch.optim.Rprop(params, lr=0.1),
    lambda params: torch.optim.Adagrad(params, lr=0.1, initial_accumulator_value=0.5),
    lambda params: torch.optim.ASGD(params, lr=0.1, t0=0),
], ids=["AdamW", "SGD", "NAdam", "Rprop", "Adagrad", "ASGD"])
def test_a_restarted_optimizer_steps_as_a_new_one(make):
    """Zeroing the state is a new optimizer for Adam and SGD, not for every one: NAdam's mu_product stayed 0 (its
    bias correction gone for the rest of the run), Rprop's step sizes 0 (the weights never moved again), Adagrad's
    sums below their initial value, ASGD's eta 0. Every entry stays, so a checkpoint taken then loads."""
    generator = torch.Generator().manual_seed(0)
    restarted = nn.Parameter(torch.randn(6, generator=generator))
    optimizer = make([restarted])
    for _ in range(3):  # a state of some steps (the range test's)
        restarted.grad = torch.randn(6, generator=generator)
        optimizer.step()
    keys = set(optimizer.state[restarted])
    DDPAdapter(optimizer).restart_optimizer_state()
    assert set(optimizer.state[restarted]) == keys
    optimizer.load_state_dict(optimizer.state_dict())  # what a resume from a checkpoint taken now does
    new = nn.Parameter(restarted.detach().clone())
    new_optimizer = make([new])
    for _ in range(3):
        gradient = torch.randn(6, generator=generator)
        restarted.grad, new.grad = gradient.clone(), gradient.clone()
        optimizer.step()
        new_optimizer.step()
        torch.testing.assert_close(restarted.detach(), new.detach(), rtol=0, atol=0)


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


def test_a_test_without_finite_losses_picks_nothing_and_says_so():
    """Every loss NaN: no pick, one warning, and the run goes on at the LR it was given (scale 1)."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    hdet = HDETEnsemble(HDETConfig(auto_lr=AutoLRConfig(mode="scale", range_test=15)), DDPAdapter(optimizer),
                        topology=ReplicaTopology.single_process())
    with pytest.warns(UserWarning, match="too few finite losses to pick an LR; the run goes on at the LR it was "
                                         "given"):
        for _ in range(15):
            hdet.step(float("nan"))
    assert not hdet.ramping and hdet.range_test_pick is None
    assert hdet.value("lr/0") == pytest.approx(0.1)
    # no LR found, also once resumed (train.py ended with 'found LR 1e-01 (1 x --lr)' after saying none was picked)
    assert hdet.found_lr_factor() is None
    state = hdet.state_dict()
    hdet.close()
    resumed = HDETEnsemble(HDETConfig(auto_lr=AutoLRConfig(mode="scale", range_test=15)), DDPAdapter(optimizer),
                           topology=ReplicaTopology.single_process(), state=state)
    assert resumed.found_lr_factor() is None
    resumed.close()


def test_a_first_group_at_lr_0_is_refused_in_one_line():
    """The test ramps the first group's LR and scales the others by their ratio to it: 0 divided by zero. Refused
    before the warm-init noise, which a retry would otherwise add a second time."""
    params = [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))]
    optimizer = torch.optim.SGD([{"params": [params[0]], "lr": 0.0}, {"params": [params[1]]}], lr=0.1)
    config = HDETConfig(auto_lr=AutoLRConfig(mode="scale", range_test=20), warm_init=WarmInitConfig(enabled=True))
    with pytest.raises(HDETConfigError, match="first param group's LR .* is 0.0: build the optimizer with its peak LR"):
        HDETEnsemble(config, DDPAdapter(optimizer), topology=ReplicaTopology.single_process())
    assert all(torch.equal(param, torch.ones(2)) for param in params)
    # a run that continues a checkpoint runs no test
    saved = HDETEnsemble(HDETConfig(auto_lr=AutoLRConfig(mode="scale", range_test=0)), DDPAdapter(optimizer),
                         topology=ReplicaTopology.single_process())
    state = saved.state_dict()
    saved.close()
    HDETEnsemble(config, DDPAdapter(optimizer), topology=ReplicaTopology.single_process(), state=state).close()


def test_a_step_without_a_loss_is_refused_during_the_test():
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    hdet = HDETEnsemble(HDETConfig(auto_lr=AutoLRConfig(mode="scale", range_test=20)), DDPAdapter(optimizer),
                        topology=ReplicaTopology.single_process())
    with pytest.raises(ValueError, match="range test .* needs every step's loss"):
        hdet.step()


@pytest.mark.parametrize(("auto_lr", "message"), [
    ({"range_test": 5}, r"auto_lr.range_test=5: a range test needs at least 13 steps"),
    ({"range_test": -1}, "auto_lr.range_test"),
    ({"range_test": 20, "mode": "paper"}, "auto_lr.range_test picks the LR, and the paper's controller owns it"),
    ({"range_test": 20, "initial_scale": 0.5}, "initial_scale=0.5 and the LR range test .* set range_test to 0"),
    ({"range_test": 20, "initial_scale": 0.1}, "remove initial_scale"),
])
def test_bad_range_test_settings_are_refused_in_one_line(auto_lr, message):
    with pytest.raises(HDETConfigError, match=message):
        HDETConfig.from_dict({"auto_lr": auto_lr})


def test_after_a_range_test_the_lr_holds_at_the_pick_while_the_controller_moves_the_other_values():
    assert AutoLRConfig(range_test=20).filled().initial_scale == 1.0
    assert AutoLRConfig(range_test=0).filled().initial_scale == 0.1
    assert AutoLRConfig(range_test=20, enabled=False).filled().range_test == 20  # allowed with the controller off
    assert not AutoLRConfig(range_test=20).filled().moves_lr and AutoLRConfig(range_test=0).filled().moves_lr


def test_every_way_of_attaching_takes_the_range_test_and_starts_with_it_by_default():
    from hdet_scale.integrations.lightning import HDETCallback

    assert HDETCallback(auto_lr={"range_test": 20}).config.auto_lr.range_test == 20
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    hdet = attach(None, optimizer, HDETConfig(), topology=ReplicaTopology.single_process())
    assert hdet.ramping and hdet.found_lr_factor() is None
    hdet.close()
    no_test = attach(None, optimizer, HDETConfig(auto_lr=AutoLRConfig(range_test=0)),
                     topology=ReplicaTopology.single_process())
    assert not no_test.ramping


def test_a_loop_bounded_by_epochs_gets_the_epochs_the_test_takes_on_top():
    from hdet_scale.range_test import epochs_with_test

    assert epochs_with_test(1, run_steps=7, test_steps=20, steps_per_epoch=5) == 6  # 27 steps over epochs of 5
    assert epochs_with_test(2, run_steps=10, test_steps=0, steps_per_epoch=5) == 2
    assert epochs_with_test(10, run_steps=7, test_steps=20, steps_per_epoch=5) == 10  # it has more already


def test_the_test_gives_back_every_buffer_too():
    """The weights came back after the test, but the buffers the replicas do not average kept what its LRs made them:
    BatchNorm's num_batches_tracked counted the test's steps, and an observer (+inf at the start, a constant) its
    activations."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model.register_buffer("seen_max", torch.tensor(-float("inf")))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hdet = HDETEnsemble(HDETConfig(auto_lr=AutoLRConfig(mode="scale", range_test=15)), DDPAdapter(optimizer, model),
                        topology=ReplicaTopology.single_process())
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    generator = torch.Generator().manual_seed(0)
    while hdet.ramping:
        optimizer.zero_grad()
        out = model(torch.randn(8, 3, generator=generator))
        model.seen_max.copy_(torch.maximum(model.seen_max, out.max().detach()))
        loss = out.pow(2).mean()
        loss.backward()
        optimizer.step()
        hdet.step(loss)
    after = dict(model.named_buffers())
    assert all(torch.equal(after[name], buffer) for name, buffer in before.items()), after


def test_a_resume_on_another_replica_count_keeps_the_replicas_mean_lr_at_the_range_tests_pick():
    """The LR the range test picked holds at the replicas' mean (0.7 times the pick). On a log spread the mean
    multiplier depends on the replica count: a resume from 2 replicas onto 4 kept the scale, and trained at 0.676
    times the pick instead (the default, with the LR unspread, was unaffected)."""
    import math

    from hdet_scale import multipliers

    def ensemble(replicas: int, range_test: int) -> HDETEnsemble:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        config = HDETConfig.from_dict({"alpha": 0.5, "spread": "log", "sync_interval": 10, "ranks_per_replica": 1,
                                       "auto_lr": {"range_test": range_test}})
        return HDETEnsemble(config, DDPAdapter(optimizer), total_steps=100,
                            topology=ReplicaTopology(world_size=replicas, rank=0, ranks_per_replica=1))

    two = ensemble(2, 0)  # a state as the range test left it: the scale that puts the mean LR at 0.7 x the pick
    two._explored_named("lr/0").state.scale = 0.7 * 0.05 / (0.1 * math.fsum(multipliers(2, 0.5, "log")) / 2)
    state = two.state_dict()
    four = ensemble(4, 100)
    four.load_state_dict(state)
    mean_lr = math.fsum(four._explored_named("lr/0").replica_values()) / 4
    assert mean_lr == pytest.approx(0.7 * 0.05)
    same = ensemble(2, 100)
    same.load_state_dict(state)  # the same layout: the scale as it was, to the bit
    assert same._explored_named("lr/0").state.scale == two._explored_named("lr/0").state.scale
