"""One run at a time in an output directory (hdet_scale/lm/out_lock.py): a live holder is refused in one line
naming it and the file to remove; a holder that is gone (its process ended on this host, or its Slurm job was
requeued since) is taken over; a run releases only its own lock.

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


@pytest.fixture(autouse=True)
def outside_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)


def test_a_free_directory_is_taken_and_a_second_run_refused_until_the_first_releases_it(tmp_path):
    out_lock.take(tmp_path / "new" / "out")  # a fresh --out is made
    assert (tmp_path / "new" / "out" / out_lock.LOCK).is_file()
    out_lock.take(tmp_path)
    assert held_by(tmp_path)["pid"] == os.getpid() and held_by(tmp_path)["host"] == socket.gethostname()
    message = (rf"--out {tmp_path} is in use by another run \(rank 0 on {socket.gethostname()}, pid {os.getpid()}, "
               rf"since .*\): wait for it to end or choose another --out; .*remove {tmp_path / 'run.lock'}")
    with pytest.raises(out_lock.OutInUse, match=message):
        out_lock.take(tmp_path)
    out_lock.release(tmp_path)
    assert not (tmp_path / out_lock.LOCK).exists()
    out_lock.take(tmp_path)


def test_a_lock_whose_process_ended_on_this_host_is_taken_over(tmp_path):
    holder(tmp_path, pid=ended_pid())
    out_lock.take(tmp_path)
    assert held_by(tmp_path)["pid"] == os.getpid()
    assert sorted(path.name for path in tmp_path.iterdir()) == [out_lock.LOCK]


def test_a_lock_from_another_machine_is_refused_unless_its_slurm_job_was_requeued_since(tmp_path, monkeypatch):
    holder(tmp_path, host="node-7", pid=ended_pid(), slurm_job="4242", slurm_restart=0)
    with pytest.raises(out_lock.OutInUse, match=r"rank 0 on node-7, pid \d+, Slurm job 4242, since"):
        out_lock.take(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # another step of the same allocation: still running
    with pytest.raises(out_lock.OutInUse):
        out_lock.take(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "5000")  # another job
    with pytest.raises(out_lock.OutInUse):
        out_lock.take(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the same job, requeued: its first allocation is over
    out_lock.take(tmp_path)
    assert (held_by(tmp_path)["slurm_job"], held_by(tmp_path)["slurm_restart"]) == ("4242", 1)


def test_an_unreadable_lock_is_refused_and_a_run_releases_only_its_own(tmp_path):
    (tmp_path / out_lock.LOCK).write_text("")
    with pytest.raises(out_lock.OutInUse, match="its lock file is unreadable"):
        out_lock.take(tmp_path)
    holder(tmp_path, host="node-7")
    out_lock.release(tmp_path)
    assert held_by(tmp_path)["host"] == "node-7"
