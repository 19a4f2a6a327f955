"""Replaying a discovered schedule: the bases HDET records per step, their export, and ReplaySchedule.

This file holds the tests on gloo ranks; the tests that start no process are in tests/unit/test_replay.py.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from distributed import run_ranks
from hdet_scale import HDETConfig, HDETScheduler, ReplicaTopology
from hdet_scale.config import AutoLRConfig
from hdet_scale.engines.ddp import wrap_model
from hdet_scale.replay import schedule_from_records

STEPS, SYNC, START = 12, 4, 4


def hdet_run(rank: int, world: int, metrics: str) -> list[float]:
    """Two replicas on a decaying LambdaLR with a moving controller; returns the LR each step really used."""
    torch.manual_seed(0)
    config = HDETConfig(alpha=0.5, spread="log", sync_interval=SYNC, metrics_path=metrics,
                        auto_lr=AutoLRConfig(mode="log", start=START, stop=STEPS, sigma=1.0, step_size=1.0,
                                             beta=0.0, initial_scale=1.0, rise_only_after=1.0,
                                             range_test=0))  # both ways
    topology = ReplicaTopology.build(config)
    model = wrap_model(nn.Linear(3, 1), config, topology)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = HDETScheduler(LambdaLR(optimizer, lambda s: 1.0 / (1 + s)), hdet_config=config, model=model,
                              topology=topology)
    used: list[float] = []
    optimizer.register_step_pre_hook(lambda opt, *_: used.append(opt.param_groups[0]["lr"]))  # after HDET's
    data = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        optimizer.zero_grad()
        inputs = torch.randn(8, 3, generator=data)
        loss = (model(inputs).squeeze(1) - inputs.sum(1) * (1 + rank)).pow(2).mean()
        loss.backward()
        optimizer.step()
        scheduler.step(loss)
    return used


def test_every_sync_line_records_the_base_each_step_used(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    used = run_ranks(hdet_run, 2, str(metrics))
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["step"] for line in lines] == [4, 8, 12]
    scales = [1.0] + [line["values"]["lr/0"]["scale"] for line in lines]
    assert scales[2] != 1.0 and scales[3] != scales[2]  # the controller moved: the bases are not the schedule's
    for index, line in enumerate(lines):
        bases = line["values"]["lr/0"]["applied_bases"]
        steps = range(index * SYNC, (index + 1) * SYNC)  # 0-based: LambdaLR's value for the s-th optimizer step
        assert bases == pytest.approx([0.1 / (1 + s) * scales[index] for s in steps], rel=1e-12)
        for rank_used in used:  # each rank: the base times one multiplier, the same over the interval
            ratios = [lr / base for lr, base in zip(rank_used[index * SYNC:(index + 1) * SYNC], bases, strict=True)]
            assert ratios == pytest.approx([ratios[0]] * SYNC, rel=1e-12)
            assert abs(abs(math.log(ratios[0])) - math.log(1.5)) < 1e-9  # log spread, alpha 0.5: x1.5 or /1.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schedule = schedule_from_records(lines, "metrics.jsonl")
    assert schedule["steps"] == STEPS and len(schedule["values"]["lr/0"]) == STEPS
