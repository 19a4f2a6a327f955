"""The orchestrator in one process: step losses, micro-batches, metrics, misuse."""

from __future__ import annotations

import json

import pytest
import torch
from settings import lr_held_at_given
from torch import nn

from hdet_scale import HDETConfig, HDETEnsemble, ReplicaTopology
from hdet_scale.engines.ddp import DDPAdapter


def ensemble(**fields) -> HDETEnsemble:
    """An ensemble of one process, starting without a range test unless ``fields`` give one."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    fields["auto_lr"] = {"range_test": 0, **fields.get("auto_lr", {})}
    return HDETEnsemble(HDETConfig.from_dict(fields), DDPAdapter(optimizer),
                        topology=ReplicaTopology.single_process())


def test_micro_batch_losses_average_into_one_step(tmp_path):
    metrics = tmp_path / "m.jsonl"
    hdet = ensemble(sync_interval=3, metrics_path=str(metrics))
    assert hdet.step([1.0, 3.0]) is None  # a step of two micro-batches: loss 2
    hdet.observe(torch.tensor(2.0))
    hdet.observe(torch.tensor(6.0))
    assert hdet.step() is None  # loss 4, given as tensors
    report = hdet.step(torch.tensor([9.0]))  # loss 9
    assert report.replica_losses == [pytest.approx(5.0)]
    assert report.step == 3 and report.bytes_averaged == 0  # one replica: nothing to average
    record = json.loads(metrics.read_text())
    assert record["replica_losses"] == [pytest.approx(5.0)] and record["values"]["lr/0"]["base"] == 0.1


def test_a_loss_given_after_observed_micro_batches_is_refused():
    """It was taken as one more micro-batch: the step's loss became the mean of the micro-batches and itself."""
    hdet = ensemble(sync_interval=1)
    hdet.observe(torch.tensor(2.0))
    with pytest.raises(ValueError, match=r"given a loss after observe\(\) gave this step 1 micro-batch"):
        hdet.step(torch.tensor(2.0))
    assert hdet.global_step == 0  # nothing of the refused step counted
    hdet.observe(torch.tensor(6.0))
    assert hdet.step().replica_losses == [pytest.approx(4.0)]  # the step's micro-batches: 2 and 6


def test_steps_without_losses_report_none():
    hdet = ensemble(sync_interval=2)
    hdet.step()
    assert hdet.step().replica_losses == [None]


def test_non_scalar_loss_is_an_error():
    with pytest.raises(ValueError, match="needs a scalar loss"):
        ensemble().step(torch.ones(3))


def test_group_names_must_be_unique():
    params = [nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(1))]
    optimizer = torch.optim.SGD([{"params": [params[0]], "name": "a"}, {"params": [params[1]], "name": "a"}],
                                lr=0.1)
    with pytest.raises(ValueError, match="param group names must be unique"):
        HDETEnsemble(HDETConfig(), DDPAdapter(optimizer), topology=ReplicaTopology.single_process())


def test_a_construction_that_fails_leaves_the_optimizer_as_it_was():
    """A state that does not fit raises; the hooks the attempt installed go, so a retry scales the LR once."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    config = HDETConfig.from_dict({"auto_lr": {"range_test": 0}})
    state = ensemble().state_dict()
    state["explored"] = {"lr/other": state["explored"]["lr/0"]}
    with pytest.raises(ValueError, match="HDET state explores"):
        HDETEnsemble(config, DDPAdapter(optimizer), topology=ReplicaTopology.single_process(), state=state)
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert optimizer.step.__func__ is torch.optim.SGD.step
    HDETEnsemble(config, DDPAdapter(optimizer), topology=ReplicaTopology.single_process())
    assert len(optimizer._optimizer_step_pre_hooks) == 1


def test_paper_mode_without_a_floor_fails_at_construction():
    with pytest.raises(ValueError, match="auto_lr.mode='paper' needs the base schedule's floor"):
        ensemble(auto_lr={"mode": "paper"})


def test_an_early_sync_is_a_sync_point_and_keeps_the_regular_ones():
    hdet = ensemble(sync_interval=4)
    assert hdet.at_sync_point  # the start: replicas are identical
    hdet.step(1.0)
    assert not hdet.at_sync_point
    early = hdet.sync()  # e.g. before a preemption checkpoint
    assert early.step == 1 and early.replica_losses == [pytest.approx(1.0)] and hdet.at_sync_point
    state = hdet.state_dict()
    restored = ensemble(sync_interval=4)
    restored.load_state_dict(state)
    assert restored.at_sync_point and restored.global_step == 1
    reports = [restored.step(2.0) for _ in range(3)]
    assert reports[:2] == [None, None] and reports[2].step == 4  # the next regular sync, at 4 not at 5
    assert reports[2].replica_losses == [pytest.approx(2.0)]  # the interval since the early sync
    state_without_field = {key: value for key, value in restored.state_dict().items() if key != "last_sync_step"}
    restored.step(1.0)
    restored.load_state_dict(state_without_field)  # states from before the field: taken at regular syncs
    assert restored.at_sync_point


def test_a_step_that_raises_leaves_the_scheduled_lr_in_place():
    """A loop that catches an error inside optimizer.step() (e.g. out of memory) and skips the batch must not
    leave this replica's LR in the param groups, where the next step would scale it again."""
    param = nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    replica_one_of_two = ReplicaTopology(rank=1, world_size=2, ranks_per_replica=1)
    hdet = HDETEnsemble(HDETConfig(spread="linear", alpha=0.5, auto_lr=lr_held_at_given()),
                        DDPAdapter(optimizer), topology=replica_one_of_two)
    rho = hdet.lr_multiplier()
    assert rho != 1.0

    def failing_closure():
        raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")

    with pytest.raises(torch.OutOfMemoryError):
        optimizer.step(failing_closure)
    assert optimizer.param_groups[0]["lr"] == 0.1  # the scheduled value, not 0.1 * rho
    param.grad = torch.ones(1)
    optimizer.step()
    assert param.item() == pytest.approx(1.0 - 0.1 * rho)  # rho once, not rho squared
    assert optimizer.param_groups[0]["lr"] == 0.1
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)  # wraps the step HDET wrapped
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    hdet.close()
    optimizer.step()
    assert param.item() == pytest.approx(1.0 - 0.1 * rho - 0.1 * rho - 0.05)  # closed: the scheduled LR


def test_a_param_group_added_after_attaching_is_refused_before_the_step():
    """A group added later (progressive unfreezing) trained at the bare scheduled LR, unexplored and unscaled,
    while the other groups trained at the replica's value."""
    param, later = nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    hdet = HDETEnsemble(HDETConfig(auto_lr=lr_held_at_given()), DDPAdapter(optimizer),
                        topology=ReplicaTopology.single_process())
    optimizer.add_param_group({"params": [later]})
    param.grad, later.grad = torch.ones(1), torch.ones(1)
    with pytest.raises(RuntimeError, match="param group 1 was added to the optimizer after HDET attached"):
        optimizer.step()
    assert param.item() == later.item() == 1.0
    hdet.close()


def test_the_found_lr_factor_is_the_controllers_scale_where_one_moves_it():
    """train.py's last line: the factor on the schedule's LR, read where a controller moves it or a range test
    picked it; none where the LR stays as given (controller off, one replica), the paper's controller owns the LR
    (no factor), or the range test has not run yet."""
    from hdet_scale.controller import PaperDecay

    two = ReplicaTopology(world_size=2, rank=0, ranks_per_replica=1)
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)

    def factor(values, topology=two, **kwargs):
        hdet = HDETEnsemble(HDETConfig.from_dict({"ranks_per_replica": 1, "sync_interval": 5, **values}),
                            DDPAdapter(optimizer), topology=topology, total_steps=300, **kwargs)
        hdet.close()
        return hdet.found_lr_factor()

    assert factor({}) is None  # the range test comes first
    no_test = {"range_test": 0}
    assert factor({"auto_lr": no_test}) == pytest.approx(0.1)  # the log controller's start, a tenth of the LR
    assert factor({"auto_lr": {**no_test, "initial_scale": 2.0, "scale_max": 10.0}}) == pytest.approx(2.0)
    assert factor({"auto_lr": {**no_test, "enabled": False}}) is None
    assert factor({"auto_lr": no_test}, topology=ReplicaTopology(world_size=1, rank=0, ranks_per_replica=1)) is None
    assert factor({"alpha": 0.1, "spread": "linear", "auto_lr": {"mode": "paper"}},
                  paper_decay=[PaperDecay(300, 0.01)]) is None


def test_base_is_the_schedules_value_times_the_controllers_scale():
    """What train.py's progress bar shows: it multiplied the schedule's LR by the scale of the last sync's report,
    1 until the first sync (after the range test, or a resume), where the LR was another."""
    state = ensemble().state_dict()
    state["explored"]["lr/0"]["controller"]["scale"] = 0.4  # where a resumed run's controller had moved it
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    hdet = HDETEnsemble(HDETConfig.from_dict({"auto_lr": {"range_test": 0}}), DDPAdapter(optimizer),
                        topology=ReplicaTopology.single_process(), state=state)
    assert hdet.base("lr/0") == pytest.approx(0.4 * 0.1) == hdet.value("lr/0")  # one replica: multiplier 1
    optimizer.param_groups[0]["lr"] = 0.05  # a scheduler's step
    assert hdet.base("lr/0") == pytest.approx(0.4 * 0.05)
    with pytest.raises(KeyError, match="'dropout' is not explored"):
        hdet.base("dropout")
