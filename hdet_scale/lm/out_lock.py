"""One run at a time in an output directory: a second run started on the same ``--out`` (a copy-pasted command,
two Slurm jobs sharing an ``OUT_DIR``) is refused instead of deleting the first run's metrics and overwriting its
checkpoints.

The first run's rank 0 holds ``OUT/run.lock`` (its host, pid, Slurm job and requeue count) until it ends. A lock
left by a run that is gone (killed, aborted by NCCL, stopped by Slurm's SIGKILL) is taken over: one of the same
Slurm job requeued since (``SLURM_RESTART_COUNT`` grew), one of another Slurm job that ``squeue`` no longer lists,
or (outside Slurm, or in the same allocation) one whose process no longer runs on this host. A lock left on
another machine outside Slurm cannot be checked from here; the refusal says which file to remove.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

LOCK = "run.lock"


class OutInUse(RuntimeError):
    """Another run holds the output directory; the message says which and what to do, in one line."""


def this_process() -> dict[str, Any]:
    """Who holds the lock: this host and process, and its Slurm job, requeue count and step where Slurm started
    it."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", 0)),
            "slurm_step": os.environ.get("SLURM_STEP_ID"), "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def is_this(holder: dict[str, Any], me: dict[str, Any]) -> bool:
    """Whether the lock ``holder`` was written by the process ``me`` (``this_process()``)."""
    return (holder.get("host"), holder.get("pid")) == (me["host"], me["pid"])


def is_gone(holder: dict[str, Any], me: dict[str, Any]) -> bool:
    """Whether the run that wrote ``holder`` has ended, as far as ``me`` can tell."""
    if is_this(holder, me):
        return True  # this very process (a restarted container may reuse a host name and a pid)
    job = holder.get("slurm_job")
    if job and job == me["slurm_job"]:
        if int(holder.get("slurm_restart", 0)) < me["slurm_restart"]:
            return True  # the same job requeued: its earlier allocation is over
    elif job:
        # Another job: gone once squeue no longer lists it. One listed is alive, whatever its pid here says: a
        # requeued job waits in the queue, and a container may share this host name with its own pids.
        return not slurm_job_listed(str(job))
    if holder.get("host") != me["host"]:
        return False
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return False


def slurm_job_listed(job: str) -> bool:
    """Whether ``squeue`` still lists Slurm job ``job`` (True where it cannot be asked: the lock then holds)."""
    try:
        listed = subprocess.run(["squeue", "--noheader", "--jobs", job, "--format", "%i"], capture_output=True,
                                text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return True
    if listed.returncode != 0:  # an id slurmctld no longer knows is an error, and a job gone
        return "invalid job id" not in listed.stderr.lower()
    return bool(listed.stdout.strip())


def _holder(path: Path) -> dict[str, Any] | None:
    """The lock file's holder: {} where it cannot be read, None where it is not there."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def take(out: Path) -> None:
    """Takes ``out``'s lock for this process (making ``out`` where it is not there yet), or raises ``OutInUse``
    naming the run that holds it."""
    path, me = out / LOCK, this_process()
    out.mkdir(parents=True, exist_ok=True)
    holder: dict[str, Any] | None = {}
    for _ in range(3):  # again where the lock was released or taken over meanwhile
        if _create(path, me):
            return
        holder = _holder(path)
        if holder is None:
            continue
        if not (holder and is_gone(holder, me)):
            break
        # Of runs taking over at once, one moves the old lock away (a rename is atomic) and the first to create
        # the new one wins; a lock moved that is not the one judged gone was just taken over: it goes back.
        claimed = path.with_name(f"{LOCK}.{me['host']}.{me['pid']}")
        try:
            path.rename(claimed)
        except FileNotFoundError:
            continue
        if _holder(claimed) != holder:
            claimed.rename(path)
            continue
        claimed.unlink()
    job = f", Slurm job {holder['slurm_job']}" if holder and holder.get("slurm_job") else ""
    who = (f"rank 0 on {holder.get('host')}, pid {holder.get('pid')}{job}, since {holder.get('since')}" if holder
           else "its lock file is unreadable")
    if holder and _same_srun_step(holder, me):
        raise OutInUse(
            f"--out {out} is in use by another task of this same srun step ({who}): train.py was started as "
            f"{os.environ['SLURM_STEP_NUM_TASKS']} tasks without a launcher, each a run of its own. Start one launcher "
            "a node: launch/fsdp.sbatch or launch/deepspeed.sbatch, or srun --nodes=N --ntasks=N --ntasks-per-node=1 "
            "torchrun --nnodes=N --nproc_per_node=<GPUs> --node_rank=$SLURM_NODEID ... (if no run uses --out any "
            f"more, remove {path})")
    raise OutInUse(f"--out {out} is in use by another run ({who}): wait for it to end or choose another --out; if "
                   f"no run uses it any more (one killed on another machine), remove {path}")


def _create(path: Path, me: dict[str, Any]) -> bool:
    """Creates the lock ``path`` holding ``me``, whole or not at all; False where it exists. Written beside it
    first, on the disk, then linked to its name (which fails where the name is taken): a lock created empty and then
    written would be left empty, unreadable and so never taken over, by a kill or a crash in between. Where the file
    system has no hard links, it is created and written in place."""
    draft = path.with_name(f"{LOCK}.draft.{me['host']}.{me['pid']}")
    try:
        with open(draft, "w") as file:
            json.dump(me, file)
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(draft, path)
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links here (some FUSE and SMB mounts)
            pass
        try:
            with os.fdopen(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY), "w") as file:
                json.dump(me, file)
            return True
        except FileExistsError:
            return False
    finally:
        draft.unlink(missing_ok=True)


def _same_srun_step(holder: dict[str, Any], me: dict[str, Any]) -> bool:
    """Whether the live ``holder`` is another task of the srun step of several tasks ``me`` runs in as a world of
    one (`srun python -m hdet_scale.lm.train`: every task a run of its own, all on one --out)."""
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "1")
    return (tasks.isdigit() and int(tasks) > 1 and os.environ.get("WORLD_SIZE") == "1" and me["slurm_step"] is not None
            and (holder.get("slurm_job"), holder.get("slurm_restart"), holder.get("slurm_step"))
            == (me["slurm_job"], me["slurm_restart"], me["slurm_step"]))


def held_by(out: Path, holder: dict[str, Any]) -> bool:
    """Whether ``out``'s lock, as this process sees it, is the one ``holder`` (``this_process()`` of the run's rank
    0) wrote: ranks whose ``--out`` is a folder of their own node's disk find none there."""
    found = _holder(out / LOCK)
    return bool(found) and is_this(found, holder)


def release(out: Path) -> None:
    """Removes ``out``'s lock where this process holds it."""
    path = out / LOCK
    holder = _holder(path)
    if holder and is_this(holder, this_process()):
        # It runs in a finally after the run: raising there would hide the run's own error and leave the other
        # ranks waiting; a lock left behind is taken over as a gone holder's by the next run.
        with contextlib.suppress(OSError):
            path.unlink()
