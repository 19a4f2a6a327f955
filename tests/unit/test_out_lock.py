"""One run at a time in an output directory (hdet_scale/lm/out_lock.py): a live holder is refused in one line
naming it and the file to remove; a holder that is gone (its process ended on this host, its Slurm job requeued
since or no longer queued) is taken over; a run releases only its own lock.

This file holds the tests that start no training; the refusal of a real launch is in tests/e2e/test_train_e2e.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from hdet_scale.lm import out_lock


def holder(out, **fields) -> None:
    (out / out_lock.LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": None,
                                                 "slurm_restart": 0, "since": "2026-11-27 10:00:00", **fields}))


def held_by(out) -> dict:
    return json.loads((out / out_lock.LOCK).read_text())


def ended_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@pytest.fixture
def live_pid():
    with subprocess.Popen(["sleep", "300"]) as process:
        yield process.pid
        process.kill()


@pytest.fixture
def squeue(tmp_path, monkeypatch):
    """A ``squeue`` on PATH that answers what the test writes into it (no squeue at all: ``None``)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", str(folder))

    def answer(script: str | None) -> None:
        path = folder / "squeue"
        path.unlink(missing_ok=True)
        if script is not None:
            path.write_text(f"#!/bin/sh\n{script}\n")
            path.chmod(0o755)
    return answer


@pytest.fixture(autouse=True)
def outside_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS", raising=False)


def test_a_free_directory_is_taken_and_a_live_holder_refused_until_it_releases_it(tmp_path, live_pid):
    out_lock.take(tmp_path / "new" / "out")  # a fresh --out is made
    assert (tmp_path / "new" / "out" / out_lock.LOCK).is_file()
    holder(tmp_path, pid=live_pid)  # another run, alive on this host
    message = (rf"--out {tmp_path} is in use by another run \(rank 0 on {socket.gethostname()}, pid {live_pid}, "
               rf"since .*\): wait for it to end or choose another --out; .*remove {tmp_path / 'run.lock'}")
    with pytest.raises(out_lock.OutInUse, match=message):
        out_lock.take(tmp_path)
    out_lock.release(tmp_path)  # not this process's lock: kept
    assert held_by(tmp_path)["pid"] == live_pid
    (tmp_path / out_lock.LOCK).unlink()  # the other run ended and released it
    out_lock.take(tmp_path)
    assert held_by(tmp_path)["pid"] == os.getpid()
    out_lock.take(tmp_path)  # this very process again (a restarted container may reuse host name and pid)
    out_lock.release(tmp_path)
    assert not (tmp_path / out_lock.LOCK).exists()


def test_a_lock_whose_process_ended_on_this_host_is_taken_over(tmp_path):
    holder(tmp_path, pid=ended_pid())
    out_lock.take(tmp_path)
    assert held_by(tmp_path)["pid"] == os.getpid()
    assert sorted(path.name for path in tmp_path.iterdir()) == [out_lock.LOCK]


def test_of_two_runs_taking_over_a_lock_at_once_one_proceeds(tmp_path, monkeypatch, live_pid):
    holder(tmp_path, pid=ended_pid())
    judge = out_lock.is_gone

    def other_run_takes_it_over_first(found: dict, me: dict) -> bool:
        # The other run judged the same lock gone a moment before, and has moved it away and taken the directory.
        if found["pid"] != live_pid:
            (tmp_path / out_lock.LOCK).unlink()
            holder(tmp_path, pid=live_pid)
        return judge(found, me)

    monkeypatch.setattr(out_lock, "is_gone", other_run_takes_it_over_first)
    with pytest.raises(out_lock.OutInUse, match=f"pid {live_pid}"):
        out_lock.take(tmp_path)
    assert held_by(tmp_path)["pid"] == live_pid
    assert sorted(path.name for path in tmp_path.iterdir()) == [out_lock.LOCK]


def test_a_lock_from_another_machine_is_taken_over_only_when_its_slurm_job_is_over(tmp_path, monkeypatch, squeue):
    holder(tmp_path, host="node-7", pid=ended_pid(), slurm_job="4242", slurm_restart=0)
    squeue("echo 4242")  # still queued or running
    with pytest.raises(out_lock.OutInUse, match=r"rank 0 on node-7, pid \d+, Slurm job 4242, since"):
        out_lock.take(tmp_path)
    squeue(None)  # no Slurm to ask here: the lock holds
    with pytest.raises(out_lock.OutInUse):
        out_lock.take(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # another step of the same allocation: still running
    with pytest.raises(out_lock.OutInUse):
        out_lock.take(tmp_path)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the same job, requeued: its first allocation is over
    out_lock.take(tmp_path)
    assert (held_by(tmp_path)["slurm_job"], held_by(tmp_path)["slurm_restart"]) == ("4242", 1)
    monkeypatch.setenv("SLURM_JOB_ID", "5000")  # a new job, after 4242 ended
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    for ended in ("true", "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1"):
        holder(tmp_path, host="node-7", pid=1, slurm_job="4242")
        squeue(ended)
        out_lock.take(tmp_path)
        assert held_by(tmp_path)["slurm_job"] == "5000"


def test_tasks_of_one_srun_step_started_without_a_launcher_are_told_so(tmp_path, monkeypatch, live_pid):
    """`srun python -m hdet_scale.lm.train` runs every task as a world of one on one --out: the tasks that lost the
    lock were told another run held it, which was their own job."""
    holder(tmp_path, pid=live_pid, slurm_job="4242", slurm_step="0")
    for name, value in {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8",
                        "WORLD_SIZE": "1"}.items():  # train.py's own world of one
        monkeypatch.setenv(name, value)
    with pytest.raises(out_lock.OutInUse, match=r"in use by another task of this same srun step \(rank 0 on .*\): "
                                                r"train.py was started as 8 tasks without a launcher"):
        out_lock.take(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "16")  # a launcher's rank 0 (torchrun's elastic restart on another node)
    with pytest.raises(out_lock.OutInUse, match=r"is in use by another run \(rank 0 on "):
        out_lock.take(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("SLURM_STEP_ID", "1")  # another step of the job: another run, as any other
    with pytest.raises(out_lock.OutInUse, match=r"is in use by another run \(rank 0 on "):
        out_lock.take(tmp_path)


def test_an_unreadable_lock_is_refused_and_a_run_releases_only_its_own(tmp_path):
    (tmp_path / out_lock.LOCK).write_text("")
    with pytest.raises(out_lock.OutInUse, match="its lock file is unreadable"):
        out_lock.take(tmp_path)
    holder(tmp_path, host="node-7")
    out_lock.release(tmp_path)
    assert held_by(tmp_path)["host"] == "node-7"


def test_a_run_killed_while_it_writes_the_lock_leaves_none(tmp_path, monkeypatch):
    """The lock was created empty and then written: a kill (or a crash before the page cache reached the disk) in
    between left an empty lock, unreadable, which every later run refused, the same job requeued included."""
    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # as a kill would end the writing

    monkeypatch.setattr(out_lock.json, "dump", killed)
    with pytest.raises(KeyboardInterrupt):
        out_lock.take(tmp_path)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []
    out_lock.take(tmp_path)
    assert held_by(tmp_path)["pid"] == os.getpid()


def test_a_lock_that_cannot_be_removed_is_left_without_an_error(tmp_path, monkeypatch):
    out_lock.take(tmp_path)

    def refuse(path, missing_ok=False):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(type(tmp_path), "unlink", refuse)
    out_lock.release(tmp_path)  # after a run, in a finally: must not raise
    monkeypatch.undo()
    assert held_by(tmp_path)["pid"] == os.getpid()


def test_a_lock_of_another_slurm_job_still_listed_holds_though_its_pid_ended_here(tmp_path, monkeypatch, squeue):
    """A job requeued waits in the queue while another lands on its old rank-0 node: the dead pid on this host
    handed the lock over, and the two runs then wrote the same checkpoint folder."""
    monkeypatch.setenv("SLURM_JOB_ID", "5000")
    holder(tmp_path, pid=ended_pid(), slurm_job="4242")  # this host, its process gone
    squeue("echo 4242")  # pending after its requeue
    with pytest.raises(out_lock.OutInUse, match="Slurm job 4242"):
        out_lock.take(tmp_path)
    squeue("true")  # no longer listed: over
    out_lock.take(tmp_path)
    assert held_by(tmp_path)["slurm_job"] == "5000"
