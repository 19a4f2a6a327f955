"""The sbatch templates in launch/, submitted with ``sbatch --nodes=2`` to a real (emulated) 2-node Slurm cluster.

Each template trains the tiny model on CPU (FSDP in local, DeepSpeed in global gradient mode): 2 nodes x 2
ranks, one replica per node (``ranks_per_replica: "node"``), so 2 replicas that sync every 5 steps. The FSDP
template is also preempted the way its time guard does it before a time limit: the job checkpoints,
requeues itself and resumes to the same final model.

Needs slurm-wlm and munge (``apt-get install slurm-wlm munge``) and root; skipped otherwise, unless
``HDET_REQUIRE_SLURM=1`` (CI sets it), which turns the skip into a failure.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from slurm_cluster import Job, SlurmCluster, unavailable

ROOT = Path(__file__).resolve().parents[2]
STEPS, SYNC_INTERVAL = 20, 5
TRAIN_ARGS = ["--preset", "tiny", "--steps", str(STEPS), "--warmup_steps", "5", "--checkpoint_interval", "10",
              "--no_progress", "--on_signal", "next_sync"]  # next_sync: a preempted run resumes bit-identically
FINAL_LINE = re.compile(r"^final train loss \d+\.\d+  held-out loss \d+\.\d+", re.MULTILINE)
pytestmark = pytest.mark.e2e  # every test here runs sbatch jobs on the emulated cluster


def require_slurm() -> None:
    reason = unavailable()
    if reason is None:
        return
    if os.environ.get("HDET_REQUIRE_SLURM") == "1":
        pytest.fail(f"HDET_REQUIRE_SLURM=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster():
    require_slurm()
    with SlurmCluster() as running:
        yield running


def python_environment() -> dict[str, str]:
    """How the jobs find this interpreter with its torchrun and deepspeed: its venv, which the templates activate
    (HDET_VENV); without one, PATH, whose first entry is its bin directory (tests/conftest.py)."""
    return {"HDET_VENV": sys.prefix if Path(sys.prefix, "bin", "activate").is_file() else ""}


def submit(cluster: SlurmCluster, template: str, run_dir: Path, env: dict[str, str] | None = None, *,
           gradient_mode: str = "global", options: tuple[str, ...] = (), train_args: tuple[str, ...] = ()) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    hdet_config = run_dir / "hdet.json"
    hdet_config.write_text(json.dumps({"alpha": 0.25, "sync_interval": SYNC_INTERVAL, "ranks_per_replica": "node",
                                       "gradient_mode": gradient_mode,
                                       # the preemption must land in the run, not in the LR range test before it
                                       "auto_lr": {"range_test": 0}}))
    job_env = {
        **python_environment(),
        "HDET_CONFIG": str(hdet_config),
        "OUT_DIR": str(run_dir / "out"),
        "OMP_NUM_THREADS": "1",  # 4 ranks share this machine's cores
        **(env or {}),
    }
    # The fake GPUs per node set the ranks per node: the templates read SLURM_GPUS_ON_NODE.
    options = ["--nodes=2", "--gpus-per-node=2", f"--output={run_dir}/slurm-%j.out", *options]
    return cluster.submit(ROOT / "launch" / template, *TRAIN_ARGS, *train_args, options=options, cwd=run_dir,
                          env=job_env)


def wait_for_line(cluster: SlurmCluster, job_id: int, log: Path, pattern: str, timeout: float = 300) -> re.Match:
    deadline = time.monotonic() + timeout
    while not (found := re.search(pattern, log.read_text() if log.exists() else "", re.MULTILINE)):
        assert time.monotonic() < deadline, f"no {pattern!r}:\n" + cluster.output(cluster.job_record(job_id))[-8000:]
        time.sleep(0.5)
    return found


def check_trained(job: Job, out: Path, engine: str, gradient_mode: str) -> str:
    """Asserts a finished 2-node, 2-replica run with syncs, a checkpoint and the exported model; returns the
    final loss line."""
    assert job.state == "COMPLETED", f"job {job.job_id} {job.state} ({job.exit_code}):\n{job.output[-8000:]}"
    assert job.nodes == "node[1-2]"
    assert f"HDET train: engine={engine} ranks=4 replicas=2 ranks_per_replica=2 " in job.output, job.output[-8000:]
    assert f"gradient_mode={gradient_mode} " in job.output
    records = [json.loads(line) for line in (out / "hdet_metrics.jsonl").read_text().splitlines()]
    syncs = [record for record in records if "replica_losses" in record]  # not the held-out loss records
    assert [sync["step"] for sync in syncs] == list(range(SYNC_INTERVAL, STEPS + 1, SYNC_INTERVAL))
    assert all(len(sync["replica_losses"]) == 2 for sync in syncs)
    assert len(set(syncs[0]["replica_losses"])) == 2, "the replicas trained at the same LR"
    checkpoints = re.findall(r"^checkpoint: (\S+)$", job.output, re.MULTILINE)
    assert checkpoints and Path(checkpoints[-1]).is_dir(), job.output[-8000:]  # older ones may be pruned
    assert (out / "final" / "config.json").is_file() and list((out / "final").glob("*.safetensors"))
    final = FINAL_LINE.search(job.output)
    assert final, job.output[-8000:]
    return final.group(0)


def final_model(out: Path) -> dict[str, torch.Tensor]:
    """The tensors of the model a run exported to ``out/final``."""
    from safetensors.torch import load_file

    return {name: tensor for path in sorted((out / "final").glob("*.safetensors"))
            for name, tensor in load_file(path).items()}


@pytest.fixture(scope="module")
def fsdp_job(cluster, tmp_path_factory) -> tuple[Job, Path]:
    """The uninterrupted FSDP run, which the preempted one is compared with; in local gradient mode (train.py's
    tests run torchrun in global mode and the deepspeed launcher in both)."""
    run_dir = tmp_path_factory.mktemp("fsdp")
    return cluster.wait(submit(cluster, "fsdp.sbatch", run_dir, gradient_mode="local"), timeout=600), run_dir / "out"


def test_cluster_runs_one_task_per_node_and_stops_its_daemons(tmp_path):
    require_slurm()
    script = tmp_path / "nodes.sbatch"
    script.write_text("#!/bin/bash\nsrun --ntasks-per-node=1 bash -c 'echo task $SLURMD_NODENAME $SLURM_NODEID'\n")
    with SlurmCluster() as cluster:
        daemons = cluster.daemon_processes
        job = cluster.wait(cluster.submit(script, options=["--nodes=2", f"--output={tmp_path}/out"], cwd=tmp_path),
                           timeout=120)
    assert job.state == "COMPLETED", job.output
    assert sorted(re.findall(r"^task \S+ \d$", job.output, re.MULTILINE)) == ["task node1 0", "task node2 1"]
    assert len(daemons) == 4 and all(process.poll() is not None for process in daemons)
    assert not cluster.job_processes() and not cluster.root.exists()


def test_start_now_starts_a_held_job_and_leaves_a_started_one(cluster, tmp_path):
    """The requeue test hurries the requeued job with start_now, and the scheduler may have started it on its own
    just before: that is not an error."""
    script = tmp_path / "sleep.sbatch"
    script.write_text("#!/bin/bash\nsleep 3\n")
    options = ["--nodes=1", f"--output={tmp_path}/out-%j", "--begin=now+1hour"]
    job_id = cluster.submit(script, options=options, cwd=tmp_path)
    cluster.start_now(job_id)  # held for an hour otherwise
    cluster.poll(lambda: cluster.job_record(job_id)["JobState"] != "PENDING", 60, f"job {job_id} did not start")
    cluster.start_now(job_id)  # running (or already over): nothing to do
    assert cluster.wait(job_id, timeout=60).state == "COMPLETED"


def test_fsdp_template_trains_two_replicas_on_two_nodes(fsdp_job):
    check_trained(*fsdp_job, "fsdp", "local")


def test_fsdp_template_checkpoints_on_the_time_guards_signal_requeues_and_resumes(cluster, tmp_path, fsdp_job):
    job_id = submit(cluster, "fsdp.sbatch", tmp_path, gradient_mode="local")
    wait_for_line(cluster, job_id, tmp_path / f"slurm-{job_id}.out", "^HDET train:")  # the signals are handled now
    cluster.signal_batch_shell(job_id)  # what the time guard does before the time limit
    cluster.start_requeued(job_id)
    job = cluster.wait(job_id, timeout=600, restarts=1)
    assert job.restarts == 1
    preempted = re.search(r"^preempted at step (\d+); checkpoint: (\S+); rerun with --resume$", job.output,
                          re.MULTILINE)
    # SIGUSR1, which torchrun ignores on every version (torch < 2.9 kills the ranks 30 s after a SIGTERM)
    assert preempted and "received SIGUSR1" in job.output, job.output[-8000:]
    step = int(preempted.group(1))
    assert 0 < step < STEPS and step % SYNC_INTERVAL == 0
    assert re.search(rf"^resumed from \S+ at step {step}$", job.output, re.MULTILINE), job.output[-8000:]
    # The same final model as the uninterrupted run: its loss line, and every exported tensor to the bit.
    assert check_trained(job, tmp_path / "out", "fsdp", "local") == check_trained(*fsdp_job, "fsdp", "local")
    resumed, straight = final_model(tmp_path / "out"), final_model(fsdp_job[1])
    assert resumed.keys() == straight.keys()
    assert [name for name in resumed if not torch.equal(resumed[name], straight[name])] == []


def test_deepspeed_template_trains_on_two_nodes_stops_past_the_launchers_checkpoints_requeues_and_resumes(
        cluster, tmp_path):
    """Two replicas on two nodes, one launcher a node; the time guard's SIGUSR1 reaches the ranks, and DeepSpeed's
    launchers, ignoring it, wait for their checkpoint (a SIGTERM would have them kill the ranks 30 s later).
    Submitted with --ntasks-per-node=2, a one-task-per-GPU habit: srun took its task count over the template's one
    launcher a node."""
    job_id = submit(cluster, "deepspeed.sbatch", tmp_path, options=("--ntasks-per-node=2",))
    wait_for_line(cluster, job_id, tmp_path / f"slurm-{job_id}.out", "^HDET train:")  # the signal is handled now
    cluster.signal_batch_shell(job_id)
    cluster.start_requeued(job_id)
    job = cluster.wait(job_id, timeout=600, restarts=1)
    preempted = re.search(r"^preempted at step (\d+); checkpoint: \S+; rerun with --resume$", job.output, re.MULTILINE)
    assert preempted and "received SIGUSR1" in job.output, job.output[-8000:]
    step = int(preempted.group(1))
    assert re.search(rf"^resumed from \S+ at step {step}$", job.output, re.MULTILINE), job.output[-8000:]
    check_trained(job, tmp_path / "out", "deepspeed", "global")
    # One launcher per node, each told its own node rank inside its task (not the batch shell's 0 for both), in
    # each of the job's two runs.
    assert sorted(re.findall(r"node_rank=(\d)\n", job.output)) == ["0", "0", "1", "1"], job.output[-8000:]


def test_a_short_time_limit_trains_before_the_time_guard_requeues_it_and_scancel_ends_it(cluster, tmp_path):
    """A 1-minute debugging job: the guard's lead shrinks to a fifth of the time left (a fixed 10-minute lead
    would signal it at once, at every start), so it trains, checkpoints, requeues and resumes where it stopped.
    Then scancel ends the job, which the templates must not take for the guard's signal."""
    job_id = submit(cluster, "fsdp.sbatch", tmp_path, gradient_mode="local", options=("--time=1",),
                    train_args=("--steps", "100000"))  # longer than the limit: the guard has to stop it
    log = tmp_path / f"slurm-{job_id}.out"
    guard = wait_for_line(cluster, job_id, log, r"time left (\d+) s: checkpoint and requeue (\d+) s before the limit$")
    left, lead = int(guard.group(1)), int(guard.group(2))
    assert 30 < left <= 60 and lead == left // 5
    preempted = wait_for_line(cluster, job_id, log, r"^preempted at step (\d+); checkpoint: \S+", timeout=left + 60)
    step = int(preempted.group(1))
    assert step > 0 and step % SYNC_INTERVAL == 0
    cluster.poll(lambda: cluster.job_record(job_id)["JobState"] == "PENDING", 60, f"job {job_id} was not requeued")
    # The resumed run gets 10 minutes, so that its own guard cannot stop it before the scancel below does.
    cluster.command("scontrol", "update", f"JobId={job_id}", "TimeLimit=10")
    cluster.start_requeued(job_id)
    wait_for_line(cluster, job_id, log, rf"^resumed from \S+ at step {step}$")
    wait_for_line(cluster, job_id, log, rf"^sync step {step + SYNC_INTERVAL} ")
    # scancel stops it for good: the ranks checkpoint in Slurm's KillWait, and the job is not requeued.
    cluster.command("scancel", str(job_id))
    cluster.poll(lambda: cluster.job_record(job_id)["JobState"] not in ("RUNNING", "COMPLETING"), 60,
                 f"job {job_id} did not end after scancel")
    job = cluster.wait(job_id, timeout=0, restarts=1)
    assert (job.state, job.restarts) == ("CANCELLED", 1), job.output[-8000:]
    assert job.output.count("SIGUSR2: the ranks checkpoint and stop; then the job is requeued") == 1
    stopped = "SIGTERM: the ranks checkpoint and stop; the job is not requeued"
    assert job.output.count(stopped) == 1, job.output[-8000:]
    after_scancel = job.output[job.output.index(stopped):]
    assert re.search(r"^preempted at step \d+; checkpoint: ", after_scancel, re.MULTILINE), job.output[-8000:]
