"""The probe batch: every replica scored on the same held-out batch at each sync, driving the controller.

This file holds the tests that start no process; the tests on gloo ranks are in
tests/distributed/test_probe_distributed.py.
"""

from __future__ import annotations

from collections import UserDict
from typing import NamedTuple

import pytest
import torch

from hdet_scale import HDETConfig, HDETConfigError
from hdet_scale.probe import batch_probe


class Pair(NamedTuple):
    a: torch.Tensor
    b: int


def test_probe_weight_is_validated():
    with pytest.raises(HDETConfigError, match=r"auto_lr.probe_weight must be a number in \[0.0, 1.0\]"):
        HDETConfig.from_dict({"auto_lr": {"mode": "scale", "probe_weight": 1.5}})


def test_probe_keeps_each_submodule_in_its_own_mode():
    """A model training with a frozen (eval-mode) BatchNorm keeps it frozen after the probe: the probe's
    model.train() on the way out must not switch it back to updating its running statistics."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3), torch.nn.Dropout(0.5))
    model.train()
    model[1].eval()  # frozen statistics (fine-tuning)
    seen = []

    def loss_fn(module, batch):
        seen.append([m.training for m in module.modules()])
        return module(batch).pow(2).mean()

    probe = batch_probe(model, torch.randn(4, 3), loss_fn)
    with torch.no_grad():
        probe()
    assert seen == [[False, False, False, False]]
    assert [m.training for m in model.modules()] == [True, True, False, True]


def test_probe_moves_a_mapping_batch_that_is_not_a_dict():
    """transformers' BatchEncoding (what its collators give the Trainer's eval loader) is a Mapping, not a dict:
    its tensors go to the probe's device as a dict's do."""
    seen = []

    def loss_fn(module, batch):
        seen.append((type(batch), batch["x"].device, batch["pair"].a.device))
        return torch.zeros(())

    batch = UserDict({"x": torch.ones(2), "pair": Pair(torch.ones(1), 3)})
    batch_probe(torch.nn.Linear(2, 2), batch, loss_fn, device="meta")()
    assert seen == [(UserDict, torch.device("meta"), torch.device("meta"))]
