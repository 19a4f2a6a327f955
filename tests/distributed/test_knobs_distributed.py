"""Hyperparameters explored besides the LR (paper Remark 1): weight decay, dropout, attention scale, label
smoothing and user knobs, each with its own spread, permutation and controller.

This file holds the tests on gloo ranks; the tests that start no process are in tests/unit/test_knobs.py.
"""

from __future__ import annotations

import pytest
import torch
from settings import LR_HELD_AT_GIVEN
from test_knobs import EXPLORE, REPLICAS, expected_multiplier, record_group_values, tiny_llama, two_groups
from torch import nn

from distributed import run_ranks
from hdet_scale import AutoLRConfig, HDETConfig, HDETConfigError, HDETEnsemble
from hdet_scale.config import ExploreConfig, KnobConfig
from hdet_scale.engines.ddp import DDPAdapter


# -------------------------------------------------------------------- the controller's direction
def quadratic_knob(rank: int, world: int, start: float) -> list[float]:
    """A user knob h whose best value is 1 by construction: each replica's loss is (h_r - 1)^2. From below
    the controller must raise the base, from above lower it. The LR of a quadratic f(x) = x^2 / 2 with SGD
    is explored alongside (best LR 1: one step to the minimum) and must move toward 1 the same way."""
    config = HDETConfig(spread="linear", alpha=0.5, sync_interval=1,
                        auto_lr=AutoLRConfig(mode="scale", start=0, sigma=0.05, range_test=0))
    point = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([point], lr=start)
    hdet = HDETEnsemble(config, DDPAdapter(optimizer))
    knob = {"h": start}
    hdet.add_knob("h", lambda: knob["h"], lambda value: knob.update(h=value), low=0.0)
    bases = []
    for _ in range(30):
        # The LR: from x = 1, one SGD step on x^2 / 2 lands at 1 - lr, loss (1 - lr)^2 / 2.
        with torch.no_grad():
            point.fill_(1.0)
        optimizer.zero_grad()
        (point ** 2 / 2).sum().backward()
        optimizer.step()
        lr_loss = float(point.detach() ** 2 / 2)
        report = hdet.step((knob["h"] - 1.0) ** 2 + lr_loss)
        assert set(report.values) == {"lr/0", "h"}  # co-explored, each reported
        assert all({"delta", "velocity", "scale"} <= set(entry) for entry in report.values.values())
    bases.append(report.values["h"]["base"])
    bases.append(report.values["lr/0"]["base"])
    return bases


def from_both_sides(rank: int, world: int) -> list[list[float]]:
    return [quadratic_knob(rank, world, start) for start in STARTS]


STARTS = {0.4: 1.0, 1.6: -1.0}
"""Start value -> the direction the controller must move it (the best value is 1)."""


def test_the_controller_moves_a_knob_toward_its_best_value_from_both_sides():
    results = run_ranks(from_both_sides, REPLICAS)
    assert all(result == results[0] for result in results)  # every rank agrees
    for (start, direction), (h_base, lr_base) in zip(STARTS.items(), results[0], strict=True):
        assert direction * (h_base - start) > 0.1 and abs(h_base - 1.0) < abs(start - 1.0), (start, h_base)
        assert direction * (lr_base - start) > 0.05 and abs(lr_base - 1.0) < abs(start - 1.0), (start, lr_base)


# ----------------------------------------------------------------------------- sharded engines
def knob_values_on(rank: int, world: int, engine: str) -> list[float]:
    """FSDP2 or DeepSpeed ZeRO-2, 2 replicas x 2 ranks: this rank's dropout, softmax scale, the weight decay
    and LR inside the optimizer step, and the label smoothing, checked against its replica's multipliers."""
    import os

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # 2 "nodes" of 2 ranks: one replica per node
    model = tiny_llama()
    hdet_settings = {"alpha": 0.3, "spread": "linear", "gradient_mode": "local", "explore": EXPLORE,
                     "ranks_per_replica": 2, "auto_lr": LR_HELD_AT_GIVEN}
    if engine == "fsdp":
        from hdet_scale.engines.fsdp import wrap

        model, handle = wrap(model, HDETConfig.from_dict(hdet_settings))
        optimizer = two_groups(model)
        hdet = handle.attach(optimizer)
    else:
        from hdet_scale.engines.deepspeed import initialize

        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}, "hdet": hdet_settings}
        engine_, _, _, _ = initialize(model=model, optimizer=two_groups(model), config=config)
        model, optimizer, hdet = engine_, engine_.basic_optimizer, engine_.hdet.ensemble
    replica = rank // 2
    rho = {name: expected_multiplier(name, replica, alpha, replicas=2) for name, alpha in
           [("dropout", 0.4), ("attention_scale", 0.2), ("weight_decay/matrices", 0.5), ("weight_decay/vectors", 0.5),
            ("label_smoothing", 0.6), ("lr/matrices", 0.3), ("lr/vectors", 0.3)]}
    attention = [module for module in model.modules() if type(module).__name__ == "LlamaAttention"]
    assert attention and all(module.attention_dropout == pytest.approx(0.1 * rho["dropout"]) for module in attention)
    assert all(module.scaling == pytest.approx(8 ** -0.5 * rho["attention_scale"]) for module in attention)
    assert hdet.value("label_smoothing") == pytest.approx(0.1 * rho["label_smoothing"])
    used = record_group_values(optimizer)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    loss = model(input_ids=tokens, labels=tokens).loss
    if engine == "fsdp":
        loss.backward()
        optimizer.step()
    else:
        model.backward(loss)
        model.step()
    # ZeRO-2 steps the base optimizer once per param group, with only that group in param_groups: each group
    # must still get its own values.
    (lr, weight_decay), (vector_lr, vector_weight_decay) = [pair for call in used for pair in call]
    assert weight_decay == pytest.approx(0.1 * rho["weight_decay/matrices"])
    assert lr == pytest.approx(1e-3 * rho["lr/matrices"])
    assert vector_weight_decay == pytest.approx(0.02 * rho["weight_decay/vectors"])
    assert vector_lr == pytest.approx(1e-3 * rho["lr/vectors"])
    return [attention[0].attention_dropout, attention[0].scaling, weight_decay, hdet.value("label_smoothing")]


@pytest.mark.parametrize("engine", ["fsdp", "deepspeed"])
def test_knobs_reach_every_replica_of_a_sharded_engine(engine):
    values = run_ranks(knob_values_on, REPLICAS, engine)
    assert values[0] == values[1] and values[2] == values[3]  # ranks of one replica agree
    assert all(first != second for first, second in zip(values[0], values[2], strict=True))  # replicas differ


# --------------------------------------------------------------------------- values scored on a probe
def smoothing_scored_on_probe(rank: int, world: int, with_probe: bool) -> tuple[list[float], str]:
    """2 replicas of 1 rank in local mode, label smoothing explored and moved by the controller at every sync:
    the smoothing the loss reads in each step and in the probe, and the error of a run without a probe."""
    config = HDETConfig(spread="linear", alpha=0.5, sync_interval=2, gradient_mode="local",
                        auto_lr=AutoLRConfig(mode="scale", start=0, range_test=0),
                        explore=ExploreConfig(label_smoothing=KnobConfig(base=0.2)))
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hdet = HDETEnsemble(config, DDPAdapter(optimizer, model))
    inputs, targets = torch.randn(8, 4), torch.randint(0, 3, (8,))
    read: list[float] = []

    def loss() -> torch.Tensor:
        read.append(hdet.value("label_smoothing"))
        return nn.functional.cross_entropy(model(inputs), targets, label_smoothing=read[-1])

    if with_probe:
        hdet.set_probe(loss)
    try:
        for _ in range(2):
            step_loss = loss()
            optimizer.zero_grad()
            step_loss.backward()
            optimizer.step()
            hdet.step(step_loss)
    except HDETConfigError as error:
        return read, str(error)
    return read, ""


def test_label_smoothing_is_compared_on_the_plain_loss_of_a_probe_and_refused_without_one():
    for rank, (read, error) in enumerate(run_ranks(smoothing_scored_on_probe, 2, True)):
        own = 0.2 * (1.5 if rank else 0.5)  # the replica's value in its steps; 0 in the probe, at the sync
        assert read == pytest.approx([own, own, 0.0]) and error == ""
    for read, error in run_ranks(smoothing_scored_on_probe, 2, False):
        assert len(read) == 2 and error.startswith(
            "explore.label_smoothing needs a probe batch: a replica's training loss rises with its own label "
            "smoothing whatever it is worth, so the controller compares the replicas on one held-out batch, scored "
            "with neither; set one with hdet.set_probe before the first step")
