"""What train.py's rank 0 records per sync, by hand; the same scalars reach W&B (an offline run, read back) and a
resumed run logs on into the same W&B run; TensorBoard's curves go on from a resumed step.

This file holds the tests that start no process; the tests that start W&B's service (a subprocess of the test
process) are in tests/e2e/test_scalars_e2e.py.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hdet_scale.lm.checkpoints import TENSORBOARD
from hdet_scale.lm.progress import Progress
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
        "hdet/loss": 2.5, "hdet/replica_0_loss": 2.0, "hdet/replica_1_loss": 3.0,
        "hdet/lr/0/base": 0.0045, "hdet/lr/0/scale": 1.5, "hdet/lr/0/replica_0": 0.003, "hdet/lr/0/replica_1": 0.006,
        "hdet/weight_decay/0/base": 0.1, "hdet/weight_decay/0/scale": 1.0,
        "hdet/weight_decay/0/replica_0": 0.05, "hdet/weight_decay/0/replica_1": 0.15})
    excluded = report(10, [2.0, None], 1.0).scalars()  # a non-finite replica, left out of the average
    assert excluded["hdet/loss"] == 2.0 and "hdet/replica_1_loss" not in excluded
    assert math.isnan(report(10, [None, None], 1.0).scalars()["hdet/loss"])


def tensorboard_losses(out: Path) -> dict[int, float]:
    """The ``hdet/loss`` curve TensorBoard shows for ``out``, step by step (a step shown twice fails)."""
    accumulator = EventAccumulator(str(out / TENSORBOARD))
    accumulator.Reload()
    events = accumulator.Scalars("hdet/loss")
    assert len({event.step for event in events}) == len(events)
    return {event.step: event.value for event in events}


def log_attempt(out: Path, start: int, syncs: list[SyncReport], *, before_start=lambda: None) -> None:
    """One attempt of a run in ``out``: started (or resumed) at ``start``, logging ``syncs``."""
    progress = Progress(out, enabled=True, bar=False, total=20, metrics_path=None)
    before_start()
    progress.start(start, tokens_per_step=1)
    for sync in syncs:
        progress.sync(sync)
    progress.close()


def test_tensorboard_curves_go_on_from_the_resumed_step_without_steps_logged_twice(tmp_path):
    # The first attempt logged past its last checkpoint (step 10) before it was interrupted; the resumed one
    # trains steps 11-20 again and logs 15 anew.
    log_attempt(tmp_path, 0, [report(5, [2.0, 2.0], 1.0), report(10, [1.5, 1.5], 1.0), report(11, [1.4, 1.4], 1.0),
                              report(15, [1.2, 1.2], 1.0)])
    time.sleep(1.0)  # TensorBoard reads event files in name order, which begins with the second they were opened in
    log_attempt(tmp_path, 10, [report(15, [1.1, 1.1], 1.0), report(20, [1.0, 1.0], 1.0)])
    assert tensorboard_losses(tmp_path) == pytest.approx({5: 2.0, 10: 1.5, 15: 1.1, 20: 1.0})


def test_tensorboard_logs_into_the_directory_left_after_an_overwrite_removed_the_old_one(tmp_path):
    log_attempt(tmp_path, 0, [report(5, [2.0, 2.0], 1.0)])
    time.sleep(1.0)  # as a later attempt would be
    # --overwrite removes the earlier run's events after the sinks exist, before the run starts
    log_attempt(tmp_path, 0, [report(5, [3.0, 3.0], 1.0)], before_start=lambda: shutil.rmtree(tmp_path / TENSORBOARD))
    assert tensorboard_losses(tmp_path) == pytest.approx({5: 3.0})
