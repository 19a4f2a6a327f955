"""The probe batch: every replica scored on the same held-out batch at each sync, driving the controller.

This file holds the tests that start no process; the tests on gloo ranks are in
tests/distributed/test_probe_distributed.py.
"""

from __future__ import annotations

import pytest

from hdet_scale import HDETConfig, HDETConfigError


def test_probe_weight_is_validated():
    with pytest.raises(HDETConfigError, match=r"auto_lr.probe_weight must be a number in \[0.0, 1.0\]"):
        HDETConfig.from_dict({"auto_lr": {"mode": "scale", "probe_weight": 1.5}})
