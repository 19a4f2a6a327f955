"""What train.py's rank 0 records per sync, by hand; the same scalars reach W&B (an offline run, read back) and a
resumed run logs on into the same W&B run.

This file holds the test that starts no process; the tests that start W&B's service (a subprocess of the test
process) are in tests/e2e/test_scalars_e2e.py.
"""

from __future__ import annotations

import math

import pytest

from hdet_scale.metrics import SyncReport


def report(step: int, losses: list[float | None], scale: float) -> SyncReport:
    values = {"lr/0": {"replica_values": [0.002 * scale, 0.004 * scale], "base": 0.003 * scale, "scale": scale,
                       "delta": 0.1, "velocity": 0.01, "next_replica_values": [0.004 * scale, 0.002 * scale]},
              "weight_decay/0": {"replica_values": [0.05, 0.15], "base": 0.1, "scale": 1.0, "delta": 0.0,
                                 "velocity": 0.0, "next_replica_values": [0.15, 0.05]}}
    return SyncReport(step=step, replica_losses=losses, probe_losses=None, excluded_replicas=[], weights=None,
                      controller_updated=True, values=values, sync_seconds=0.01, bytes_averaged=8, bytes_gathered=8)


def test_sync_report_scalars_by_hand():
    assert report(10, [2.0, 3.0], 1.5).scalars() == pytest.approx({
        "train/loss": 2.5, "train/replica_0_loss": 2.0, "train/replica_1_loss": 3.0,
        "hdet/lr/0/base": 0.0045, "hdet/lr/0/scale": 1.5, "hdet/lr/0/replica_0": 0.003, "hdet/lr/0/replica_1": 0.006,
        "hdet/weight_decay/0/base": 0.1, "hdet/weight_decay/0/scale": 1.0,
        "hdet/weight_decay/0/replica_0": 0.05, "hdet/weight_decay/0/replica_1": 0.15})
    excluded = report(10, [2.0, None], 1.0).scalars()  # a non-finite replica, left out of the average
    assert excluded["train/loss"] == 2.0 and "train/replica_1_loss" not in excluded
    assert math.isnan(report(10, [None, None], 1.0).scalars()["train/loss"])
