"""What train.py's rank 0 records per sync, by hand; the same scalars reach W&B (an offline run, read back) and a
resumed run logs on into the same W&B run.

This file holds the tests that start W&B's service (a subprocess of the test process); the test that starts no
process is in tests/unit/test_scalars.py.
"""

from __future__ import annotations

import pytest
import wandb
import wandb_records
from test_scalars import report

from hdet_scale.lm.checkpoints import remove_previous_run
from hdet_scale.lm.progress import Progress
from hdet_scale.lm.scalars import WANDB_ID_FILE


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
    rows = sorted((row for path in files for row in wandb_records.history(path)), key=lambda row: row["step"])
    syncs = [row for row in rows if "hdet/loss" in row]
    assert [row["step"] for row in syncs] == [5, 10, 15]
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


def test_a_run_started_with_overwrite_keeps_its_own_wandb_id(tmp_path, monkeypatch):
    """W&B starts before --overwrite removes the replaced run, its id file with it: the new run's id went too, and
    a resume of the new run logged into a W&B run of its own."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    progress = Progress(tmp_path, enabled=True, bar=False, total=15, metrics_path=None, wandb_project="hdet-test")
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    assert remove_previous_run(tmp_path, None) == [tmp_path / WANDB_ID_FILE]  # what train.py's --overwrite does
    progress.start(0, 1)
    progress.close()
    wandb.teardown()
    assert (tmp_path / WANDB_ID_FILE).read_text().strip() == run_id


def test_steps_logged_again_after_a_resume_reach_wandb(tmp_path, monkeypatch):
    """W&B drops a row whose step is below the highest the run logged: a run resumed from its checkpoint at step 5,
    after an attempt that had logged up to 15, lost its rows until it passed 15. The training step is a metric the
    charts are drawn over instead."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    progress = Progress(tmp_path, enabled=True, bar=False, total=15, metrics_path=None, wandb_project="hdet-test")
    for sync in (report(5, [2.0, 3.0], 1.0), report(10, [1.5, 2.5], 1.25), report(15, [1.0, 2.0], 1.5),
                 report(10, [1.4, 2.4], 1.25)):  # what the W&B run sees when a resumed run logs step 10 again
        progress.sync(sync)
    progress.close()
    wandb.teardown()
    rows = [row for path in tmp_path.glob("wandb/offline-run-*/run-*.wandb") for row in wandb_records.history(path)]
    assert [(row["step"], row["hdet/loss"]) for row in rows if "hdet/loss" in row] == [
        (5, 2.5), (10, 2.0), (15, 1.5), (10, 1.9)]


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
