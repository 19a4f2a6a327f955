"""The probe on averaged weights (``auto_lr.average_window``) on 2 replicas of every engine, against independent
computations: the running mean by hand in one process, then each sync's probe scores against each replica's full
weights recorded at the window's steps, averaged here, loaded into a plain copy of the model and scored on the same
probe batch.

This file holds the tests that start no process; the tests on gloo ranks are in
tests/distributed/test_averaged_probe_distributed.py.
"""

from __future__ import annotations

import pytest
import torch
from settings import LR_HELD_AT_GIVEN
from torch import nn

from hdet_scale import HDETConfig, HDETEnsemble, ReplicaTopology
from hdet_scale.engines.ddp import DDPAdapter
from hdet_scale.weight_average import WindowAverage

SYNC_INTERVAL, STEPS = 4, 12  # three syncs
WINDOW = 0.5  # the last 2 steps of every interval


def test_window_average_by_hand():
    window = WindowAverage(WINDOW, SYNC_INTERVAL)
    tensor = torch.zeros(3)
    refreshed = []
    for since_sync, value in enumerate([1.0, 2.0, 4.0, 8.0], start=1):
        tensor.fill_(value)
        window.observe(SYNC_INTERVAL - since_sync, lambda: [tensor])
    assert window.count == 2  # steps 3 and 4 of the interval
    with window.swapped_in([tensor], lambda: refreshed.append(tensor.clone())) as swapped:
        assert swapped and torch.equal(tensor, torch.full((3,), 6.0))  # (4 + 8) / 2
    assert torch.equal(tensor, torch.full((3,), 8.0)) and len(refreshed) == 2  # its own values back, refreshed
    with window.swapped_in([tensor], lambda: None):
        assert torch.equal(tensor, torch.full((3,), 6.0))  # the mean survives being swapped in and out
    assert torch.equal(tensor, torch.full((3,), 8.0))
    window.reset()
    with window.swapped_in([tensor], lambda: refreshed.append(None)) as swapped:
        assert not swapped  # nothing averaged since the reset (e.g. an early sync)
    assert len(refreshed) == 2
    assert not WindowAverage(0.0, SYNC_INTERVAL).enabled


def test_window_average_of_bf16_weights_is_kept_in_fp32():
    """A bf16 model's weights (DDP, or FSDP2 without a parameter policy): a running mean kept in bf16 stopped
    moving once ``(x - mean) / n`` fell below half of bf16's precision, and stayed near the window's first
    iterate (1.2 here, against a mean of 1.3)."""
    window = WindowAverage(0.5, 200)
    tensor = torch.zeros(4, dtype=torch.bfloat16)
    iterates = []
    for since_sync in range(1, 201):
        tensor.fill_(1.0 + 0.002 * since_sync)  # a steady drift along the valley
        window.observe(200 - since_sync, lambda: [tensor])
        if since_sync > 100:
            iterates.append(tensor.double())
    with window.swapped_in([tensor], lambda: None):
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, torch.stack(iterates).mean(0).to(torch.bfloat16))


def test_after_an_extra_sync_the_probe_scores_the_last_steps_before_the_regular_one():
    """The window was counted from the last sync: after an extra sync (a preemption checkpoint's) no step of the
    rest of the interval fell in it, and the probe at the regular sync scored the last iterate alone."""
    weight = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    config = HDETConfig(sync_interval=SYNC_INTERVAL, auto_lr={**LR_HELD_AT_GIVEN, "average_window": WINDOW})
    hdet = HDETEnsemble(config, DDPAdapter(optimizer), topology=ReplicaTopology.single_process())
    probed: list[float] = []
    hdet.set_probe(lambda: probed.append(weight.item()) or 0.0)
    for step in range(1, 2 * SYNC_INTERVAL + 1):
        weight.grad = torch.full((1,), -1.0)  # the weight is the step count
        optimizer.step()
        hdet.step(0.0)
        if step == SYNC_INTERVAL + 1:
            hdet.sync()  # an extra sync, one step into the second interval
    # the regular syncs at steps 4 and 8 score the mean of their last 2 steps; the extra one at 5, step 5 alone
    assert probed == [3.5, 5.0, 7.5]


def test_a_refresh_that_raises_leaves_the_tensors_their_own_values():
    """A refresh after the mean was swapped in that raised (ZeRO's all-gather of the low-precision copies failing)
    left the weights at the window's mean, and the mean's memory holding them."""
    window = WindowAverage(WINDOW, SYNC_INTERVAL)
    tensors = [torch.zeros(3), torch.zeros(2)]
    for since_sync, value in enumerate([1.0, 2.0, 4.0, 8.0], start=1):
        for tensor in tensors:
            tensor.fill_(value)
        window.observe(SYNC_INTERVAL - since_sync, lambda: tensors)
    calls = []

    def refresh_failing_first():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("all-gather failed")

    with pytest.raises(RuntimeError, match="all-gather failed"), window.swapped_in(tensors, refresh_failing_first):
        pytest.fail("the block runs only once the mean is in place")
    assert all(torch.equal(tensor, torch.full_like(tensor, 8.0)) for tensor in tensors) and len(calls) == 2
    with window.swapped_in(tensors, lambda: None):  # the mean is intact
        assert all(torch.equal(tensor, torch.full_like(tensor, 6.0)) for tensor in tensors)
