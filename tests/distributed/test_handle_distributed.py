"""One handle on every engine: what DDP's ``attach`` and scheduler and FSDP2's ``wrap`` hand back answer the same
calls (the probe, an early sync, the last report, the step count, explored values, a knob of one's own, closing,
the state), and the handles whose loop steps HDET itself refuse ``step``.

This file holds the tests on gloo ranks; the tests that start no process are in tests/unit/test_handle.py.
"""

from __future__ import annotations

import statistics

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from distributed import run_ranks
from hdet_scale import HDETConfig, HDETScheduler
from hdet_scale.engines.ddp import attach
from hdet_scale.engines.fsdp import wrap
from hdet_scale.handle import HDETHandle

STEPS, SYNC_INTERVAL = 5, 2


def handle_of(kind: str, config: HDETConfig) -> tuple[nn.Module, torch.optim.Optimizer, HDETHandle]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    if kind == "fsdp":
        model, hdet = wrap(model, config)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        hdet.attach(optimizer)
        return model, optimizer, hdet
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if kind == "attach":
        return model, optimizer, attach(model, optimizer, config)
    return model, optimizer, HDETScheduler(LambdaLR(optimizer, lambda step: 1.0), hdet_config=config)


def the_same_calls(rank: int, world: int, kind: str) -> dict:
    config = HDETConfig(sync_interval=SYNC_INTERVAL, ranks_per_replica=1,
                        auto_lr={"mode": "scale", "start": 0, "range_test": 0})
    model, optimizer, hdet = handle_of(kind, config)
    probe_input = torch.ones(2, 4)
    before = hdet.last_report
    knob = {}
    hdet.add_knob("my_scalar", lambda: 2.0, lambda value: knob.update(value=value), alpha=0.5)
    knob_start = knob["value"]
    hdet.set_probe(lambda: model(probe_input).pow(2).mean())
    generator = torch.Generator().manual_seed(rank)
    losses: list[float] = []
    scored: list[list[float]] = []  # each regular sync's replica losses
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model(torch.randn(3, 4, generator=generator)).pow(2).mean()
        loss.backward()
        optimizer.step()
        if step < SYNC_INTERVAL:  # the first interval's loss given as two micro-batches: the same mean
            hdet.observe(loss * 0.5)
            hdet.observe(loss * 1.5)
            report = hdet.step()
        else:
            report = hdet.step(loss)
        losses.append(loss.item())
        if report is not None:
            scored.append(report.replica_losses)
    regular = hdet.last_report
    lrs, multiplier, lr_value = hdet.current_lrs(), hdet.lr_multiplier(), hdet.value("lr/0")
    lrs_by_hand = lrs == [lr_value] and multiplier == hdet.ensemble.lr_multiplier()
    early = hdet.sync()  # step 5: between the regular syncs at 4 and 6
    hdet.load_state_dict(hdet.state_dict())  # a checkpoint's round trip, at the sync point
    knob_found = hdet.ensemble.base("my_scalar")
    hdet.close()
    return {"is_handle": isinstance(hdet, HDETHandle), "before": before, "regular_step": regular.step,
            "early_step": early.step, "last_is_early": hdet.last_report is early,
            "probed": early.probe_losses is not None, "global_step": hdet.global_step, "lr": hdet.value("lr/0"),
            "ensemble_lr": hdet.ensemble.value("lr/0"), "knob_start": knob_start,
            "knob_closed": knob["value"] / knob_found, "lrs_by_hand": lrs_by_hand,
            "multiplier": multiplier,
            "scored": scored, "losses": losses}


@pytest.mark.parametrize("kind", ["attach", "scheduler", "fsdp"])
def test_every_engine_hands_back_a_handle_with_the_same_calls(kind):
    outcomes = run_ranks(the_same_calls, 2, kind)
    # the knob of one's own: base 2, spread over [2 / 1.5, 2 x 1.5] by the two replicas, at the base the controller
    # found once closed
    assert sorted(outcome.pop("knob_start") for outcome in outcomes) == pytest.approx([2 / 1.5, 3.0])
    # the syncs at steps 2 (losses observed as micro-batches) and 4 scored each replica (a rank) by its mean loss
    losses = [outcome.pop("losses") for outcome in outcomes]
    assert len({outcome.pop("multiplier") for outcome in outcomes}) == 2  # each replica its own
    expected = [[statistics.fmean(rank[steps]) for rank in losses] for steps in (slice(0, 2), slice(2, 4))]
    for outcome in outcomes:
        assert outcome.pop("scored") == [pytest.approx(row) for row in expected]
        assert outcome.pop("lrs_by_hand")
        assert outcome == {"is_handle": True, "before": None, "regular_step": 4, "early_step": 5, "last_is_early": True,
                           "probed": True, "global_step": 5, "lr": outcome["ensemble_lr"],
                           "ensemble_lr": outcome["ensemble_lr"], "knob_closed": 1.0}
