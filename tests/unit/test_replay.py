"""Replaying a discovered schedule: the bases HDET records per step, their export, and ReplaySchedule.

This file holds the tests that start no process; the tests on gloo ranks are in
tests/distributed/test_replay_distributed.py.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from hdet_scale import HDETConfig, HDETEnsemble, ReplaySchedule, ReplicaTopology
from hdet_scale.config import AutoLRConfig
from hdet_scale.engines.ddp import DDPAdapter
from hdet_scale.replay import SCHEDULE_FORMAT, ScheduleFileError, schedule_from_records, write_schedule
from hdet_scale.tools.report import main
from hdet_scale.tools.report_runs import load_run, sync_records


def sync_line(step: int, bases: dict[str, list[float]]) -> dict:
    return {"step": step, "replica_losses": [1.0, 1.1],
            "values": {name: {"base": values[-1], "scale": 1.0, "replica_values": [values[-1]] * 2,
                              "applied_bases": values} for name, values in bases.items()}}


def write_lines(path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


# ------------------------------------------------------------------------------------------ export
def test_the_export_joins_the_intervals_step_by_step_and_the_later_line_of_a_step_wins(tmp_path):
    metrics = tmp_path / "run.jsonl"
    write_lines(metrics, [
        sync_line(3, {"lr/0": [0.1, 0.2, 0.3]}),
        sync_line(6, {"lr/0": [9.0, 9.0, 9.0]}),  # from a run that was preempted after its checkpoint at 3
        {"step": 4, "heldout_loss": 2.0},
        sync_line(6, {"lr/0": [0.4, 0.5, 0.6]}),  # the resumed run's line for step 6
        sync_line(8, {"lr/0": [0.7, 0.8]}),  # a last sync between regular ones (the run's end)
    ])
    schedule = schedule_from_records(sync_records(load_run(metrics)), "run.jsonl")
    assert schedule == {"format": SCHEDULE_FORMAT, "source": "run.jsonl", "steps": 8,
                        "values": {"lr/0": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]}}


def test_the_export_refuses_gaps_and_files_without_bases(tmp_path):
    gap = [sync_line(3, {"lr/0": [0.1, 0.2, 0.3]}), sync_line(9, {"lr/0": [0.7, 0.8, 0.9]})]
    with pytest.raises(ScheduleFileError, match=r"'lr/0' has no base for steps 4\.\.6 \(3 steps\)"):
        schedule_from_records(gap, "gap.jsonl")
    old = sync_line(3, {"lr/0": [0.1]})
    del old["values"]["lr/0"]["applied_bases"]
    with pytest.raises(ScheduleFileError, match="old.jsonl: the sync line of step 3 has no applied_bases"):
        schedule_from_records([old], "old.jsonl")
    with pytest.raises(ScheduleFileError, match="no HDET sync lines"):
        schedule_from_records([{"step": 3, "loss": 1.0}], "plain.jsonl")


def test_the_command_line_writes_the_schedule_and_says_what_it_needs(tmp_path, capsys):
    metrics = tmp_path / "run.jsonl"
    write_lines(metrics, [sync_line(2, {"lr/0": [0.1, 0.2], "weight_decay/0": [0.01, 0.01]})])
    assert main([str(metrics), "--export-schedule", str(tmp_path / "schedule.json")]) == 0
    assert "lr/0, weight_decay/0 over 2 steps" in capsys.readouterr().out
    assert json.loads((tmp_path / "schedule.json").read_text())["values"]["lr/0"] == [0.1, 0.2]
    assert main([str(metrics), "--export-schedule", str(tmp_path / "new" / "folder" / "schedule.json")]) == 0
    for argv, message in (([str(metrics)], "give --out DIR"),
                          ([str(metrics), str(metrics), "--export-schedule", "x.json"], "reads one run's")):
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ ReplaySchedule
def named_optimizer() -> torch.optim.Optimizer:
    return torch.optim.AdamW([{"params": [nn.Parameter(torch.ones(2))], "name": "embedding"},
                              {"params": [nn.Parameter(torch.ones(2))], "name": "transformer"}],
                             lr=1.0, weight_decay=0.5)


def applied_per_step(optimizer: torch.optim.Optimizer, scheduler: ReplaySchedule, steps: int) -> list[list[float]]:
    """[lr of each group, weight decay of the second] as ``optimizer.step()`` saw them, step by step."""
    seen = []
    handle = optimizer.register_step_pre_hook(lambda opt, *_: seen.append(
        [opt.param_groups[0]["lr"], opt.param_groups[1]["lr"], opt.param_groups[1]["weight_decay"]]))
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    handle.remove()
    return seen


SCHEDULE = {"format": SCHEDULE_FORMAT, "source": "run.jsonl", "steps": 3,
            "values": {"lr/embedding": [0.1, 0.2, 0.3], "lr/transformer": [1.0, 2.0, 3.0],
                       "weight_decay/transformer": [0.01, 0.02, 0.03], "label_smoothing": [0.1, 0.1, 0.2]}}


def test_replay_applies_the_recorded_values_at_every_step_then_holds_the_last(tmp_path):
    path = write_schedule(SCHEDULE, tmp_path / "schedule.json")
    optimizer = named_optimizer()
    scheduler = ReplaySchedule(optimizer, path)
    assert scheduler.value("label_smoothing") == 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the last step's scheduler.step() asks past the end, and no step uses it
        assert applied_per_step(optimizer, scheduler, 3) == [[0.1, 1.0, 0.01], [0.2, 2.0, 0.02], [0.3, 3.0, 0.03]]
    with pytest.warns(UserWarning, match="past the replayed schedule's 3 steps"):
        seen = applied_per_step(optimizer, scheduler, 2)
    assert seen == [[0.3, 3.0, 0.03], [0.3, 3.0, 0.03]]
    assert optimizer.param_groups[0]["weight_decay"] == 0.5  # not in the schedule: left alone


def test_replay_resumes_from_its_state_dict_without_storing_the_schedule(tmp_path):
    path = write_schedule(SCHEDULE, tmp_path / "schedule.json")
    optimizer = named_optimizer()
    scheduler = ReplaySchedule(optimizer, path)
    applied_per_step(optimizer, scheduler, 1)
    state = scheduler.state_dict()
    assert "values" not in state and state["last_epoch"] == 1
    resumed_optimizer = named_optimizer()
    resumed_optimizer.load_state_dict(optimizer.state_dict())  # before the schedule is built, which sets step 1's
    resumed = ReplaySchedule(resumed_optimizer, path)
    resumed.load_state_dict(state)
    # what the resumed loop's first step trains at: the run's second step's values
    assert [group["lr"] for group in resumed_optimizer.param_groups] == [0.2, 2.0]
    assert resumed_optimizer.param_groups[1]["weight_decay"] == 0.02
    resumed.step()
    assert resumed_optimizer.param_groups[0]["lr"] == 0.3


def test_a_replay_resumed_on_a_longer_file_replays_all_of_it(tmp_path):
    """The state held the file's length: a resume on the file of a run trained longer held its 3rd value from step 4
    on, as if the file ended there."""
    optimizer = named_optimizer()
    scheduler = ReplaySchedule(optimizer, write_schedule(SCHEDULE, tmp_path / "schedule.json"))
    applied_per_step(optimizer, scheduler, 1)
    longer = {**SCHEDULE, "steps": 5, "values": {name: [*values, values[-1] * 2, values[-1] * 4]
                                                 for name, values in SCHEDULE["values"].items()}}
    resumed_optimizer = named_optimizer()
    resumed = ReplaySchedule(resumed_optimizer, write_schedule(longer, tmp_path / "longer.json"))
    for state in (scheduler.state_dict(), {**scheduler.state_dict(), "steps": 3}):  # and one of an earlier version
        resumed.load_state_dict(state)
        assert resumed.steps == 5 and resumed.value("label_smoothing") == 0.1
    for _ in range(3):
        resumed.step()
    assert resumed_optimizer.param_groups[0]["lr"] == pytest.approx(0.3 * 4)  # step 5's, the file's last
    assert resumed.value("label_smoothing") == pytest.approx(0.8)


def test_replay_refuses_other_param_groups_and_other_files(tmp_path):
    path = write_schedule(SCHEDULE, tmp_path / "schedule.json")
    plain = torch.optim.AdamW([nn.Parameter(torch.ones(2))], lr=1.0)
    with pytest.raises(ScheduleFileError, match="'lr/embedding' is for param group 'embedding'; the optimizer's "
                                                r"groups are \['0'\]"):
        ReplaySchedule(plain, path)
    one_group = dict(SCHEDULE, values={"lr/embedding": [0.1, 0.2, 0.3]})
    with pytest.raises(ScheduleFileError, match=r"no lr for param group\(s\) \['transformer'\]"):
        ReplaySchedule(named_optimizer(), write_schedule(one_group, tmp_path / "one.json"))
    short = dict(SCHEDULE, values={**SCHEDULE["values"], "lr/embedding": [0.1]})
    with pytest.raises(ScheduleFileError, match=r"values\['lr/embedding'\] must be 3 finite numbers >= 0"):
        ReplaySchedule(named_optimizer(), write_schedule(short, tmp_path / "short.json"))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    with pytest.raises(ScheduleFileError, match="not a JSON schedule"):
        ReplaySchedule(named_optimizer(), tmp_path / "metrics.jsonl")
    (tmp_path / "line.json").write_text('{"step": 1}\n')
    with pytest.raises(ScheduleFileError, match="'format' must be 'hdet_scale.schedule/1'"):
        ReplaySchedule(named_optimizer(), tmp_path / "line.json")


# ------------------------------------------------------------------------------------------ what HDET records
def test_a_step_without_an_optimizer_step_still_gets_its_base(tmp_path):
    """An AMP overflow skips optimizer.step(): the line still has one base per step, so the steps stay aligned."""
    metrics = tmp_path / "metrics.jsonl"
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    hdet = HDETEnsemble(HDETConfig(sync_interval=3, metrics_path=str(metrics), auto_lr=AutoLRConfig(range_test=0)),
                        DDPAdapter(optimizer), topology=ReplicaTopology.single_process())
    for lr, skipped in ((0.1, False), (0.2, True), (0.3, False)):
        optimizer.param_groups[0]["lr"] = lr
        if not skipped:
            optimizer.step()
        hdet.step(1.0)
    hdet.close()
    assert json.loads(metrics.read_text())["values"]["lr/0"]["applied_bases"] == [0.1, 0.2, 0.3]


def test_a_skipped_step_under_a_scheduler_gets_its_own_base_not_the_next(tmp_path):
    """HDETScheduler and HDETOneCycleLR step their schedule before HDET: a step an AMP overflow skipped was recorded
    at the base the schedule had moved on to, the next step's, and a replay ran one value early there."""
    from torch.optim.lr_scheduler import ExponentialLR

    from hdet_scale import HDETOneCycleLR, HDETScheduler

    for make in ("exponential", "one_cycle"):
        metrics = tmp_path / f"{make}.jsonl"
        optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9)
        settings = {"sync_interval": 3, "metrics_path": str(metrics), "auto_lr": {"range_test": 0, "enabled": False},
                    "topology": ReplicaTopology.single_process()}
        if make == "exponential":
            scheduler = HDETScheduler(ExponentialLR(optimizer, gamma=0.5), **settings)
        else:
            scheduler = HDETOneCycleLR(optimizer, max_lr=0.1, total_steps=10, **settings)
        scheduled = []
        for skipped in (False, True, False):
            scheduled.append(optimizer.param_groups[0]["lr"])
            if not skipped:
                optimizer.step()
            scheduler.step(1.0)
        scheduler.hdet.close()
        assert json.loads(metrics.read_text())["values"]["lr/0"]["applied_bases"] == pytest.approx(scheduled)
        assert len(set(scheduled)) == 3


def test_a_loop_of_ones_own_records_a_skipped_step_at_its_base_when_it_says_so_before_the_schedule(tmp_path):
    """The README's loop steps its scheduler, then HDET: with an AMP scaler, ``record_step_bases()`` before
    ``scheduler.step()`` keeps a skipped step at its own LR (without it, the next step's)."""
    from torch.optim.lr_scheduler import ExponentialLR

    for says_so in (True, False):
        metrics = tmp_path / f"{says_so}.jsonl"
        optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
        hdet = HDETEnsemble(HDETConfig(sync_interval=3, metrics_path=str(metrics),
                                       auto_lr=AutoLRConfig(enabled=False, range_test=0)),
                            DDPAdapter(optimizer), topology=ReplicaTopology.single_process())
        scheduler = ExponentialLR(optimizer, gamma=0.5)
        for skipped in (False, True, False):
            if not skipped:
                optimizer.step()
            if says_so:
                hdet.record_step_bases()
            scheduler.step()
            hdet.step(1.0)
        hdet.close()
        recorded = json.loads(metrics.read_text())["values"]["lr/0"]["applied_bases"]
        assert recorded == pytest.approx([0.1, 0.05, 0.025] if says_so else [0.1, 0.025, 0.025])


def test_an_optimizer_stepped_several_times_a_step_records_one_base_per_step(tmp_path):
    """ZeRO-3 steps the optimizer once per sub-group, every param group in each call: still one base per step."""
    metrics = tmp_path / "metrics.jsonl"
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    hdet = HDETEnsemble(HDETConfig(sync_interval=3, metrics_path=str(metrics), auto_lr=AutoLRConfig(range_test=0)),
                        DDPAdapter(optimizer), topology=ReplicaTopology.single_process())
    for lr in (0.1, 0.2, 0.3):
        optimizer.param_groups[0]["lr"] = lr
        optimizer.step()
        optimizer.step()
        hdet.step(1.0)
    assert json.loads(metrics.read_text())["values"]["lr/0"]["applied_bases"] == [0.1, 0.2, 0.3]


def test_the_range_tests_steps_leave_no_base_of_another_value(tmp_path):
    """During the LR range test the weight decay (explored too) is applied but its steps are not the run's: the
    first sync records one weight-decay base per step of the run."""
    metrics = tmp_path / "metrics.jsonl"
    optimizer = torch.optim.AdamW([nn.Parameter(torch.ones(2))], lr=0.1, weight_decay=0.05)
    config = HDETConfig.from_dict({"sync_interval": 3, "metrics_path": str(metrics), "explore": {"weight_decay": {}},
                                   "auto_lr": {"range_test": 13}})
    hdet = HDETEnsemble(config, DDPAdapter(optimizer), topology=ReplicaTopology.single_process())
    while hdet.global_step < 3:
        optimizer.param_groups[0]["params"][0].grad = torch.ones(2)
        optimizer.step()
        hdet.step(1.0)
    sync = [json.loads(line) for line in metrics.read_text().splitlines() if "values" in json.loads(line)]
    assert [line["step"] for line in sync] == [3]
    assert sync[0]["values"]["weight_decay/0"]["applied_bases"] == [pytest.approx(0.05)] * 3


def test_a_run_resumed_between_syncs_records_the_base_of_every_step_in_order(tmp_path):
    """A state saved between syncs and loaded into a fresh run: the next sync's line holds the bases of the steps
    before the save and after the resume, each at its own step (the export assigns them step by step)."""
    config = HDETConfig(sync_interval=6, auto_lr=AutoLRConfig(range_test=0))

    def fresh(state=None) -> tuple[torch.optim.Optimizer, HDETEnsemble]:
        optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
        return optimizer, HDETEnsemble(config, DDPAdapter(optimizer), topology=ReplicaTopology.single_process(),
                                       state=state)

    optimizer, hdet = fresh()
    for step in range(1, 7):
        optimizer.param_groups[0]["lr"] = 0.1 * step
        optimizer.step()
        report = hdet.step(1.0)
        if step == 2:
            state = hdet.state_dict()
            hdet.close()
            optimizer, hdet = fresh(state)
    hdet.close()
    assert report.values["lr/0"]["applied_bases"] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
