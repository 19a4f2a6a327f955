"""What train.py's rank 0 records per sync, by hand; the same scalars reach W&B (an offline run, read back) and a
resumed run logs on into the same W&B run."""

from __future__ import annotations

import math

import pytest
import wandb
import wandb_records

from hdet_scale.lm.progress import Progress
from hdet_scale.lm.scalars import WANDB_ID_FILE
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


def test_wandb_gets_the_sync_scalars_and_a_resumed_run_continues_it(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    reports = [report(5, [2.0, 3.0], 1.0), report(10, [1.5, 2.5], 1.25), report(15, [1.0, 2.0], 1.5)]
    # a run, then its resume from a checkpoint in the same output directory
    for part, resumed in ((reports[:2], False), (reports[2:], True)):
        progress = Progress(tmp_path, enabled=True, bar=False, total=15, metrics_path=None, wandb_project="hdet-test",
                            config={"train": {"steps": 15}}, resumed=resumed)
        for sync in part:
            progress.sync(sync)
        progress.heldout(part[-1].step, 4.0, announce=False)
        progress.close()
    wandb.teardown()  # the service writes the last rows after finish() returns; at the latest when it stops
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    files = list(tmp_path.glob(f"wandb/offline-run-*/run-{run_id}.wandb"))
    assert len(files) == 2  # both parts logged into the one W&B run (W&B names the folders)
    rows = sorted((row for path in files for row in wandb_records.history(path)), key=lambda row: row["_step"])
    syncs = [row for row in rows if "train/loss" in row]
    assert [row["_step"] for row in syncs] == [5, 10, 15]
    for row, sync in zip(syncs, reports, strict=True):
        expected = sync.scalars()
        assert {name: row[name] for name in expected} == pytest.approx(expected)
        assert row["train/tokens_per_second"] >= 0
    assert [row["eval/heldout_loss"] for row in rows if "eval/heldout_loss" in row] == [4.0, 4.0]
    # A fresh run in the same directory (no checkpoint resumed) logs into a W&B run of its own.
    fresh = Progress(tmp_path, enabled=True, bar=False, total=15, metrics_path=None, wandb_project="hdet-test")
    fresh.close()
    wandb.teardown()
    assert (tmp_path / WANDB_ID_FILE).read_text().strip() != run_id


def test_a_signalled_wandb_service_does_not_fail_the_run(tmp_path, monkeypatch, capsys):
    """The deepspeed launcher answers SIGTERM by terminating its ranks' process trees, W&B's service among them:
    logging stops with one line, and the run goes on to its checkpoint."""
    import psutil

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    progress = Progress(tmp_path, enabled=True, bar=False, total=15, metrics_path=None, wandb_project="hdet-test")
    progress.sync(report(5, [2.0, 3.0], 1.0))
    service = [child for child in psutil.Process().children(recursive=True)  # not this process's other children
               if "wandb" in " ".join(child.cmdline())]                     # (the test ranks' forkserver)
    assert service
    for child in service:
        child.terminate()
    psutil.wait_procs(service, timeout=30)
    progress.sync(report(10, [1.5, 2.5], 1.25))
    progress.close()
    assert capsys.readouterr().err.count("W&B stopped logging") == 1
