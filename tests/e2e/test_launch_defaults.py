"""The sbatch templates' defaults and the arguments they give train.py, read by bash as sbatch runs them (no cluster
needed)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

LAUNCH = Path(__file__).resolve().parents[2] / "launch"


def out_dir(template: str, job_name: str, job_id: int) -> str:
    line = next(line for line in (LAUNCH / template).read_text().splitlines() if re.match(r"OUT_DIR=", line))
    done = subprocess.run(["bash", "-c", f'{line}\necho "$OUT_DIR"'], capture_output=True, text=True, check=True,
                          env={"SLURM_JOB_NAME": job_name, "SLURM_JOB_ID": str(job_id), "PATH": "/usr/bin:/bin"})
    return done.stdout.strip()


@pytest.mark.parametrize("template", ["fsdp.sbatch", "deepspeed.sbatch"])
def test_two_jobs_of_one_name_never_share_an_output_folder_and_a_requeue_keeps_its_own(template):
    """The default was runs/<job name>: every job submitted from a template without --job-name is named after it,
    and with RESUME=1 each resumed the last one's run."""
    first, second = out_dir(template, template, 101), out_dir(template, template, 102)
    assert first != second and first.startswith(f"runs/{template}")
    assert out_dir(template, template, 101) == first  # a requeued job keeps its id, so it resumes its own run


def train_arguments(template: str, resume: str, restart: int, *args: str) -> subprocess.CompletedProcess:
    """The arguments the template gives train.py (its lines from ``train_args=`` to the user's arguments)."""
    lines = (LAUNCH / template).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("train_args=("))
    end = next(i for i, line in enumerate(lines) if line.startswith('train_args+=("$@")'))
    script = "set -euo pipefail\n" + "\n".join(lines[start:end + 1]) + '\nprintf "%s\\n" "${train_args[@]}"'
    return subprocess.run(["bash", "-c", script, "sbatch", *args], capture_output=True, text=True,
                          env={"OUT_DIR": "out", "HDET_CONFIG": "", "DS_CONFIG": "", "RESUME": resume,
                               "SLURM_RESTART_COUNT": str(restart), "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("template", ["fsdp.sbatch", "deepspeed.sbatch"])
def test_a_job_started_afresh_continues_its_own_run_once_requeued(template):
    """With RESUME=0 a requeued job started train.py again without --resume, which refused the job's own output
    (--out holds a run already): every requeue of such a job failed."""
    def given(resume: str, restart: int, *args: str) -> list[str]:
        done = train_arguments(template, resume, restart, *args)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    assert given("1", 0) == ["--out", "out", "--resume"]
    assert given("0", 0, "--steps", "9") == ["--out", "out", "--steps", "9"]  # the first start: afresh
    assert given("0", 2, "--steps", "9") == ["--out", "out", "--resume", "--steps", "9"]  # requeued: continues
    # an --overwrite start: train.py itself continues the job's own checkpoint once requeued
    assert given("0", 2, "--overwrite") == ["--out", "out", "--overwrite"]
    assert given("0", 2, "--overw") == ["--out", "out", "--overw"]  # argparse's abbreviation of it
    refused = train_arguments(template, "yes", 0)
    assert refused.returncode == 2 and "RESUME must be 1" in refused.stderr and "not 'yes'" in refused.stderr
    for own_out in (["--out", "x"], ["--ou=x"]):  # where the script would not find the run's stopped_early
        refused = train_arguments(template, "1", 0, *own_out)
        assert refused.returncode == 2 and "give the run's folder as OUT_DIR=<folder> instead" in refused.stderr


PROGRESSED = "step 30 of 100, from step 20"
"""What train.py leaves in OUT/stopped_early when a signal stopped it after it trained steps 21 to 30."""
NO_PROGRESS = "step 20 of 100, from step 20"
"""What it leaves when a signal stopped it before it trained a step (during the LR range test)."""


def stand_in_slurm(bin_dir: Path, step_status: int, *, failing_once: bool = False, step: str | None = None,
                   time_left: str = "0:05", requeue_fails: bool = False, stopped_early: str | None = None) -> None:
    """Slurm's commands as the batch script calls them, on one node: ``squeue`` gives ``time_left`` (5 s: a time
    guard 1 s before the limit), ``scancel --signal`` signals the stand-in step, which ends with ``step_status`` once
    signalled (its checkpoint failed: 1), first writing ``stopped_early`` into ``$OUT_DIR/stopped_early`` where
    given (as train.py does when a signal stops it before its end), or runs ``step`` where given, and ``scontrol
    requeue`` is recorded (or fails: ``requeue_fails``). ``failing_once``: ``squeue``, ``scancel`` and ``scontrol
    show node`` fail their first call, as a busy controller's time out (``scontrol show hostnames`` and ``requeue``
    never do)."""
    bin_dir.mkdir()
    says_stopped = f'mkdir -p "$OUT_DIR"; echo "{stopped_early}" > "$OUT_DIR/stopped_early"; ' if stopped_early else ""
    requeue = 'echo "slurm_requeue error: Requeue of job is not allowed" >&2; exit 1' if requeue_fails else (
        'echo "requeue $2" >> "$REQUEUED"')
    scripts = {
        "squeue": f"echo {time_left}",
        "scancel": 'kill "-${1#--signal=}" "$(cat "$STEP_PID")"',
        "scontrol": f'case "$1" in show) echo "node1 NodeAddr=127.0.0.1";; requeue) {requeue};; esac',
        "srun": f'echo $$ > "$STEP_PID"; echo "$*" > "$STEP_PID.args"; trap \'{says_stopped}exit {step_status}\' '
                'TERM USR1; '
                + (step or 'for _ in $(seq 200); do sleep 0.1; done'),
    }
    for name, body in scripts.items():
        if failing_once and name != "srun":
            failed = bin_dir / f"{name}.failed"
            body = (f'if [[ "$*" != requeue* && "$*" != "show hostnames"* && ! -e "{failed}" ]]; then '
                    f'touch "{failed}"; echo "{name}: error: Socket timed out on send/recv operation" >&2; '
                    f'exit 1; fi\n{body}')
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)


@pytest.mark.parametrize("template", ["fsdp.sbatch", "deepspeed.sbatch"])
def test_the_time_guard_requeues_a_start_that_trained_and_ends_one_that_did_not(template, tmp_path):
    """The guard's signal requeued the job whatever the start did: one whose LR range test (which saves nothing)
    outlasted the time a start has stopped there at every start, requeued without end. A requeue asked for by hand
    (the guard's signal sent with scancel) goes ahead: the next start has its whole time."""
    by_hand = 'kill -USR2 "$PPID"; for _ in $(seq 200); do sleep 0.1; done'
    cases = {  # name: (what the ranks leave, the stand-in step, Slurm's time left, exit status, what the script
        # says, requeued)
        "trained": (PROGRESSED, None, "0:05", 0, "requeueing job 12345", True),
        "no_progress": (NO_PROGRESS, None, "0:05", 1, "with no step trained in this start: requeued, it would stop "
                        "there again, so the job ends FAILED", False),
        "by_hand": (NO_PROGRESS, by_hand, "UNLIMITED", 0, "requeueing job 12345", True),
    }
    for name, (stopped_early, step, time_left, status, said, requeued) in cases.items():
        stand_in_slurm(tmp_path / name, 0, stopped_early=stopped_early, step=step, time_left=time_left)
        record = tmp_path / f"{name}.requeued"
        done = run_template(template, tmp_path, tmp_path / name, record, OUT_DIR=str(tmp_path / f"{name}.out"))
        assert done.returncode == status, (name, done.stderr)
        assert said in done.stderr + done.stdout, (name, done.stdout, done.stderr)
        assert (record.read_text() if record.exists() else "") == ("requeue 12345\n" if requeued else ""), name


def run_template(template: str, tmp_path: Path, bin_dir: Path, record: Path,
                 **slurm: str) -> subprocess.CompletedProcess:
    """The batch script on the stand-in commands of ``bin_dir``, requeues recorded in ``record``; ``slurm``: more
    of Slurm's variables, or others than the one-node job's."""
    return subprocess.run(["bash", str(LAUNCH / template)], capture_output=True, text=True, timeout=90,
                          cwd=tmp_path, env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HDET_VENV": "",
                                             "SLURM_JOB_ID": "12345", "SLURM_JOB_NAME": "job",
                                             "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_NUM_NODES": "1",
                                             "SLURM_CPUS_ON_NODE": "1", "STEP_PID": str(tmp_path / "step.pid"),
                                             "REQUEUED": str(record), **slurm})


@pytest.mark.parametrize("template", ["fsdp.sbatch", "deepspeed.sbatch"])
def test_a_step_that_fails_after_the_time_guard_is_not_requeued(template, tmp_path):
    """The guard's signal set the requeue whatever the step's status: a checkpoint that failed every time (a full
    disk) requeued the job at every start, without end."""
    requeued = {}
    for status in (0, 1):
        stand_in_slurm(tmp_path / f"bin{status}", status, stopped_early=PROGRESSED)
        record = tmp_path / f"requeued{status}"
        done = run_template(template, tmp_path, tmp_path / f"bin{status}", record, OUT_DIR=str(tmp_path / f"{status}"))
        assert done.returncode == status, done.stderr
        requeued[status] = record.read_text() if record.exists() else ""
        if status:
            assert "training step failed with status 1 after the time guard; the job is not requeued" in done.stderr
    assert requeued == {0: "requeue 12345\n", 1: ""}


@pytest.mark.parametrize("template", ["fsdp.sbatch", "deepspeed.sbatch"])
def test_slurm_commands_that_time_out_once_are_tried_again(template, tmp_path):
    """One timed-out squeue left the job without its time guard, one timed-out scancel left the ranks unsignalled:
    either way the job ran into its time limit and was not requeued."""
    stand_in_slurm(tmp_path / "bin", 0, failing_once=True, stopped_early=PROGRESSED)
    record = tmp_path / "requeued"
    done = run_template(template, tmp_path, tmp_path / "bin", record, OUT_DIR=str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert "checkpoint and requeue 1 s before the limit" in done.stdout
    assert record.read_text() == "requeue 12345\n"
    assert all((tmp_path / "bin" / f"{name}.failed").exists() for name in ("squeue", "scancel", "scontrol"))


@pytest.mark.parametrize("template", ["fsdp.sbatch", "deepspeed.sbatch"])
def test_each_launcher_gets_the_cpus_of_the_smallest_node(template, tmp_path):
    """The batch node's CPU count went to every node's launcher: on nodes with fewer CPUs srun could not create
    the step ('Requested node configuration is not available')."""
    stand_in_slurm(tmp_path / "bin", 0)
    done = run_template(template, tmp_path, tmp_path / "bin", tmp_path / "requeued", SLURM_JOB_NUM_NODES="3",
                        SLURM_CPUS_ON_NODE="72", SLURM_JOB_CPUS_PER_NODE="72(x2),48")
    assert done.returncode == 0, done.stderr
    srun_args = (tmp_path / "step.pid.args").read_text().split()
    assert "--cpus-per-task=48" in srun_args and "--ntasks=3" in srun_args


@pytest.mark.parametrize("template", ["fsdp.sbatch", "deepspeed.sbatch"])
def test_ranks_stopped_by_a_signal_the_script_did_not_send_are_requeued_not_completed(template, tmp_path):
    """sbatch's --signal=USR1@90 signals the ranks alone: they checkpointed and exited 0, and the job ended COMPLETED
    before its --steps, starting what waited for its success (afterok). The run's OUT/stopped_early tells. A step
    that ends 0 without it finished (one left before the step does not count); a start that trained no step before
    the stop would stop there at every requeue, and a requeue that fails: both end the job FAILED; after scancel's
    SIGTERM the job stays ended."""
    out = tmp_path / "out"
    write = 'mkdir -p "$OUT_DIR"; echo "step {} of 100, from step 20" > "$OUT_DIR/stopped_early"; '
    cases = {  # name: (the stand-in step, its requeue fails, exit status, what the script says, requeued)
        "stopped": (write.format(30) + "exit 0", False, 0, "stopped before the end of training (step 30 of 100, "
                    "from step 20) on a signal this script did not send; the job is requeued", True),
        "finished": ("exit 0", False, 0, None, False),
        "no_progress": (write.format(20) + "exit 0", False, 1, "with no step trained in this start: requeued, it "
                        "would stop there again, so the job ends FAILED", False),
        "unrequeued": (write.format(30) + "exit 0", True, 1, "scontrol requeue failed 5 times", False),
        "cancelled": (write.format(30) + 'kill -TERM "$PPID"; for _ in $(seq 100); do sleep 0.1; done', False, 0,
                      "SIGTERM: the ranks checkpoint and stop; the job is not requeued", False),
    }
    for name, (step, fails, status, said, requeued) in cases.items():
        out.mkdir(exist_ok=True)
        (out / "stopped_early").write_text("step 5 of 100, from step 0\n")  # an earlier run's, left behind
        stand_in_slurm(tmp_path / name, 0, step=step, time_left="UNLIMITED", requeue_fails=fails)
        record = tmp_path / f"{name}.requeued"
        done = run_template(template, tmp_path, tmp_path / name, record, OUT_DIR=str(out))
        assert done.returncode == status, (name, done.stderr)
        assert said in done.stderr if said else "requeueing" not in done.stderr, (name, done.stderr)
        assert (record.read_text() if record.exists() else "") == ("requeue 12345\n" if requeued else ""), name
