"""An emulated 2-node Slurm cluster on this host, for testing sbatch scripts for real.

``SlurmCluster`` starts munged, slurmctld and one slurmd per node (``slurmd -N node1``, ``-N node2``, each on
its own port) as root, from a slurm.conf it writes to a fresh directory that also holds the state, spool, logs
and the munge key and socket. Nothing reads or writes /etc/slurm or the system munge: every command runs with
``SLURM_CONF`` pointing at this cluster's file. ``sbatch --nodes=2`` then runs one srun task per node with
``SLURM_NODEID`` 0 and 1, so multi-node launch scripts run unchanged. The nodes offer fake GPUs (``/dev/null``
look-alikes) so that ``--gpus-per-node`` lines work; nothing uses them.

    with SlurmCluster() as cluster:
        job = cluster.sbatch("launch/fsdp.sbatch", "--steps", "20", "--warmup_steps", "2", options=["--nodes=2"],
                             cwd=tmp)
        assert job.state == "COMPLETED", job.output

``stop()`` (or leaving the ``with``) cancels the jobs and stops every daemon it started, also on errors; the
processes of a job that would not end are found by this cluster's ``SLURM_CONF`` in their environment and
killed by pid.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hdet_scale.comm import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("munge", "sbatch", "srun", "scontrol", "scancel", "sinfo")
FINAL_STATES = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "TIMEOUT"}
"""Job states a job does not leave (a requeued job passes through PENDING and REQUEUED instead)."""
CRED_EXPIRE_S = 15
"""Lifetime of a job step credential (long enough for a step launch on a loaded machine), and how long slurmctld
holds a requeued job (Slurm's default: 120 s)."""


def unavailable() -> str | None:
    """Why this machine cannot run the emulated cluster, or None when it can."""
    missing = [name for name in DAEMONS + CLIENTS if shutil.which(name) is None]
    if missing:
        return f"Slurm is not installed (missing {', '.join(missing)}; apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "the emulated Slurm cluster runs its slurmd daemons as root, and this is not root"
    return None


def parse_record(text: str) -> dict[str, str]:
    """``scontrol show ... -o`` output (one ``Key=Value`` record per line) as a dict of the first record."""
    return dict(re.findall(r"(\w[\w/:.]*)=(\S*)", text.splitlines()[0])) if text.strip() else {}


@dataclass
class Job:
    job_id: int
    state: str
    exit_code: str
    restarts: int
    nodes: str
    """The allocation's node list, e.g. ``node[1-2]``."""
    output: str
    """The job's stdout file (stderr goes there too unless the script says otherwise)."""


class SlurmCluster:
    def __init__(self, root: Path | None = None, nodes: Sequence[str] = ("node1", "node2"), cpus_per_node: int = 4,
                 gpus_per_node: int = 2) -> None:
        # munged wants every directory above its socket searchable by all, which pytest's tmp_path is not.
        self._own_root = root is None
        self.root = Path(root or tempfile.mkdtemp(prefix="hdet-slurm-"))
        self.nodes = tuple(nodes)
        self.cpus_per_node = cpus_per_node
        self.gpus_per_node = gpus_per_node
        self.conf = self.root / "etc" / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self._daemons: list[tuple[str, subprocess.Popen]] = []

    @property
    def env(self) -> dict[str, str]:
        """The environment Slurm commands (and, through sbatch, the jobs) run with to reach this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self, timeout: float = 60) -> None:
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        self.root.chmod(0o755)  # mkdtemp gives 0700
        self._start_munged()
        self._write_config()
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(parents=True)
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-f", str(self.conf), "-N", node])
        self._wait_for_idle_nodes(timeout)

    def _start_munged(self) -> None:
        private = self.root / "munge-private"  # munged refuses a key (or seed, log) that others could read
        private.mkdir(mode=0o700)
        key = private / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket.parent.mkdir(mode=0o755)
        self._spawn("munged", ["munged", "-F", f"--socket={self.munge_socket}", f"--key-file={key}",
                               f"--pid-file={private / 'munged.pid'}", f"--seed-file={private / 'munged.seed'}",
                               f"--log-file={private / 'munged.log'}"])
        self.poll(lambda: self.munge_socket.exists(), 20, "munged did not create its socket")

    def _write_config(self) -> None:
        etc, devices = self.root / "etc", self.root / "dev"
        for directory in (etc, devices, self.root / "state", self.root / "log"):
            directory.mkdir()
        gpus = [devices / f"gpu{index}" for index in range(self.gpus_per_node)]
        for gpu in gpus:
            _fake_device(gpu)
        host = socket.gethostname().split(".")[0]
        node_lines = [
            # Node names do not resolve by DNS: NodeAddr tells slurmctld and srun where each slurmd listens.
            f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} "
            f"CPUs={self.cpus_per_node} Gres=gpu:{self.gpus_per_node} State=UNKNOWN"
            for node in self.nodes
        ]
        settings = {
            "ClusterName": "hdettest",
            "SlurmctldHost": f"{host}(127.0.0.1)",
            "SlurmctldPort": free_port(),
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            # cred_expire: see CRED_EXPIRE_S and start_requeued.
            "AuthInfo": f"socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}",
            "StateSaveLocation": self.root / "state",
            # %n: each slurmd of this one host needs its own spool, pid and log file.
            "SlurmdSpoolDir": self.root / "spool" / "%n",
            "SlurmdPidFile": self.root / "state" / "slurmd-%n.pid",
            "SlurmdLogFile": self.root / "log" / "slurmd-%n.log",
            "SlurmctldPidFile": self.root / "state" / "slurmctld.pid",
            "SlurmctldLogFile": self.root / "log" / "slurmctld.log",
            # No cgroups here: processes are tracked by parent pid and tasks are not bound to CPUs.
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_CPU",
            "MpiDefault": "none",
            "SwitchType": "switch/none",
            "JobAcctGatherType": "jobacct_gather/none",
            "AccountingStorageType": "accounting_storage/none",
            "JobCompType": "jobcomp/none",
            "GresTypes": "gpu",
            # Two slurmd on one host: trust the CPUs configured per node, not this machine's count.
            "SlurmdParameters": "config_overrides",
            "ReturnToService": 2,
            "KillWait": 10,
        }
        lines = [f"{key}={value}" for key, value in settings.items()]
        lines += node_lines
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        gres = f"NodeName={','.join(self.nodes)} Name=gpu File={devices}/gpu[0-{self.gpus_per_node - 1}]\n"
        (etc / "gres.conf").write_text(gres)

    def _spawn(self, name: str, command: list[str]) -> None:
        log = (self.root / f"{name}.stderr").open("w")
        process = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, cwd=self.root, preexec_fn=_die_with_parent)
        log.close()
        self._daemons.append((name, process))

    def _check_daemons(self) -> None:
        for name, process in self._daemons:
            if process.poll() is not None:
                log = (self.root / f"{name}.stderr").read_text()[-3000:]
                raise RuntimeError(f"{name} exited with code {process.returncode}:\n{log}")

    def poll(self, ready: Callable[[], bool], timeout: float, failure: str) -> None:
        """Waits until ``ready()`` is true, raising if a daemon of this cluster exits or ``timeout`` seconds pass
        (the ``TimeoutError`` starts with ``failure``)."""
        deadline = time.monotonic() + timeout
        while not ready():
            self._check_daemons()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{failure} within {timeout:.0f} s; logs in {self.root}")
            time.sleep(0.2)

    def _wait_for_idle_nodes(self, timeout: float) -> None:
        def idle() -> bool:
            result = self.command("sinfo", "--noheader", "--Node", "--format=%N %T", check=False)
            states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
            return result.returncode == 0 and all(states.get(node) == "idle" for node in self.nodes)

        self.poll(idle, timeout, f"nodes {', '.join(self.nodes)} were not idle")

    def command(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """Runs a Slurm client command (sinfo, scontrol, ...) against this cluster."""
        result = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def submit(self, script: str | Path, *args: str, options: Sequence[str] = (), cwd: str | Path | None = None,
               env: dict[str, str] | None = None) -> int:
        """``sbatch [options] script args``; the job inherits ``env`` on top of the cluster's environment."""
        result = subprocess.run(["sbatch", "--parsable", *options, str(script), *args], cwd=cwd,
                                env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch failed ({result.returncode}): {result.stderr.strip()}")
        return int(result.stdout.strip().split(";")[0])

    def job_record(self, job_id: int) -> dict[str, str]:
        return parse_record(self.command("scontrol", "show", "job", "--oneliner", str(job_id)).stdout)

    def wait(self, job_id: int, timeout: float = 600, restarts: int = 0) -> Job:
        """Polls ``scontrol show job`` (there is no slurmdbd for sacct) until the job has reached a final state
        after at least ``restarts`` requeues, and returns its state and output."""
        deadline = time.monotonic() + timeout
        while True:
            record = self.job_record(job_id)
            if record["JobState"] in FINAL_STATES and int(record.get("Restarts", 0)) >= restarts:
                break
            self._check_daemons()
            if time.monotonic() > deadline:
                self.command("scancel", str(job_id), check=False)
                raise TimeoutError(f"job {job_id} still {record['JobState']} after {timeout:.0f} s:\n"
                                   f"{self.output(record)[-5000:]}")
            time.sleep(0.5)
        return Job(job_id, record["JobState"], record.get("ExitCode", ""), int(record.get("Restarts", 0)),
                   record.get("NodeList", ""), self.output(record))

    @staticmethod
    def output(record: dict[str, str]) -> str:
        path = Path(record.get("StdOut", ""))
        return path.read_text(errors="replace") if path.is_file() else ""

    def sbatch(self, script: str | Path, *args: str, options: Sequence[str] = (), cwd: str | Path | None = None,
               env: dict[str, str] | None = None, timeout: float = 600) -> Job:
        """Submits a batch job and waits for it to end."""
        return self.wait(self.submit(script, *args, options=options, cwd=cwd, env=env), timeout)

    def start_requeued(self, job_id: int, timeout: float = 120) -> None:
        """Waits for the job to be back in the queue after a requeue and its old run to be over on every node,
        then lets it start once the hold for the old run's credential (``CRED_EXPIRE_S``) has passed, without
        waiting for the scheduler's next periodic pass. Starting it sooner races with slurmd revoking the old
        run's credential, which then fails the new launch."""
        def requeued() -> bool:
            record = self.job_record(job_id)
            if record["JobState"] in FINAL_STATES and not int(record.get("Restarts", 0)):
                raise RuntimeError(f"job {job_id} ended {record['JobState']} instead of being requeued:\n"
                                   f"{self.output(record)[-5000:]}")
            return record["JobState"] == "PENDING" and int(record.get("Restarts", 0)) >= 1

        self.poll(requeued, timeout, f"job {job_id} was not requeued")
        self._wait_for_idle_nodes(timeout)
        time.sleep(CRED_EXPIRE_S + 1)
        self.start_now(job_id)

    def start_now(self, job_id: int) -> None:
        """Lets a pending job start now. A job the scheduler has started meanwhile (its hold ended just before) is
        left as it is: ``scontrol update`` refuses any job that is no longer pending."""
        result = self.command("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=False)
        if result.returncode != 0 and self.job_record(job_id)["JobState"] == "PENDING":
            raise RuntimeError(f"scontrol update JobId={job_id} StartTime=now failed ({result.returncode}): "
                               f"{result.stderr.strip()}")

    def signal_batch_shell(self, job_id: int, name: str = "USR2") -> None:
        """What the templates' time guard does before the time limit: SIGUSR2 (or ``name``) to the batch shell
        only."""
        self.command("scancel", "--batch", f"--signal={name}", str(job_id))

    def stop(self) -> None:
        """Cancels every job, stops the daemons, then kills by pid whatever this cluster left running."""
        if self._daemons and self.conf.exists():
            try:
                self.command("scancel", "--user=root", check=False, timeout=30)
                self.poll(lambda: not self.job_processes(), 30, "cancelled jobs did not end")
            except (TimeoutError, RuntimeError, subprocess.TimeoutExpired):
                pass  # a daemon is gone or a job hangs: the sweep below kills what is left
        for _name, process in reversed(self._daemons):
            if process.poll() is None:
                process.terminate()
        for _name, process in self._daemons:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._daemons.clear()
        for pid in self.job_processes():
            _kill(pid)
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    @property
    def daemon_processes(self) -> list[subprocess.Popen]:
        return [process for _name, process in self._daemons]

    def job_processes(self) -> list[int]:
        """Pids of slurmstepd and job processes of this cluster: they carry its SLURM_CONF in their environment
        (slurmd passes its own to slurmstepd, and sbatch passes the submitter's to the job)."""
        marker = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environment = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker in environment:
                found.append(int(entry.name))
        # slurmctld's own helper (slurmscriptd) is its child; slurmstepd is not (slurmd double-forks it).
        daemons = {process.pid for _name, process in self._daemons}
        return [pid for pid in found if pid not in daemons and _parent(pid) not in daemons]


def _fake_device(path: Path) -> None:
    """A character device like /dev/null: slurmd wants a device file behind each GPU it offers."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except OSError:
        path.touch()  # slurmd then logs an error but still offers the GPU


def _die_with_parent() -> None:
    """Runs in each daemon before exec: the kernel sends it SIGTERM if the test process dies without stop()."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
