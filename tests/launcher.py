"""Real launches of ``hdet_scale.lm.train`` (torchrun, deepspeed) for the end-to-end tests, and the README's main job.

The README's main job is a 4-rank torchrun run of FSDP2, 2 replicas x 2 ranks. tests/e2e/test_readme_e2e.py checks
that it runs and reports, tests/e2e/test_train_e2e.py checks the same run in depth and resumes a preempted copy of it:
conftest's ``main_job`` fixture launches it once for both, shortened.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}  # --wandb: no network
STEPS = 40
SYNC_INTERVAL = 5
EVAL_INTERVAL = 10
SHORT = ["--preset", "tiny", "--steps", str(STEPS), "--seq_len", "32", "--micro_batch_size", "4",
         "--max_data_mb", "1", "--warmup_steps", "5", "--no_progress", "--eval_batches", "2"]
"""Every test launch's arguments: a few short steps on a little data."""
SHORT_BESIDE_JSON = [word for index, word in enumerate(SHORT)
                     if not {word, SHORT[index - 1]} & {"--micro_batch_size", "--warmup_steps"}]
"""``SHORT`` beside a DeepSpeed JSON with a micro-batch and a scheduler: the flags it sets are refused there."""


def readme_commands() -> list[str]:
    """The README's two commands: the main job and the test command."""
    section = ROOT.joinpath("README.md").read_text().split("## Two commands on a fresh machine")[1]
    return re.findall(r"```bash\n(.+?)\n```", section.split("\n## ")[0])


def readme_launch() -> list[str]:
    """The launch at the end of the README's main job, word by word (after the install)."""
    main_job, _ = readme_commands()
    return main_job.split("&& ")[-1].split()


@dataclass
class MainJob:
    readme_launch: list[str]
    """The launch as the README writes it."""
    command: list[str]
    """The launch as run: this interpreter's launcher, shortened, with no ``--out``."""
    out: Path
    result: subprocess.CompletedProcess


def run_main_job(root: Path) -> MainJob:
    """Runs the README's main job into ``root/out``, shortened: STEPS short steps, with its own HDET config but
    syncing every SYNC_INTERVAL steps with the controller moving from step 10 to 30, evaluating every
    EVAL_INTERVAL steps and checkpointing every 20 (tests/e2e/test_train_e2e.py resumes a preempted copy of it)."""
    words = readme_launch()
    at = words.index("--hdet_config") + 1
    hdet = json.loads((ROOT / words[at]).read_text())
    hdet.update(sync_interval=SYNC_INTERVAL, gradient_mode="global",
                auto_lr={**hdet.get("auto_lr", {}), "start": 10, "stop": 30})
    config = root / "hdet.json"
    config.write_text(json.dumps(hdet))
    command = [str(BIN / Path(words[0]).name), *words[1:at], str(config), *words[at + 1:], *SHORT,
               "--eval_interval", str(EVAL_INTERVAL), "--checkpoint_interval", "20"]
    out = root / "out"
    out.mkdir()
    return MainJob(words, command, out, launch([*command, "--out", str(out)], cwd=out))


def torchrun(nproc: int, script: tuple[str, ...] = ("-m", "hdet_scale.lm.train")) -> list[str]:
    """A torchrun launch of ``script`` (``hdet_scale.lm.train`` unless given) with ``nproc`` ranks on a free port
    (append its arguments)."""
    return [str(BIN / "torchrun"), "--nnodes", "1", "--nproc_per_node", str(nproc), "--rdzv_backend", "c10d",
            "--rdzv_endpoint", f"127.0.0.1:{free_port()}", *script]


def single_process() -> list[str]:
    """``python -m hdet_scale.lm.train`` without a launcher: a world of one rank (append its arguments)."""
    return [sys.executable, "-m", "hdet_scale.lm.train"]


def deepspeed(nproc: int) -> list[str]:
    """A deepspeed-launcher launch of ``hdet_scale.lm.train`` with ``nproc`` ranks on a free port."""
    return [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()),
            "--module", "hdet_scale.lm.train"]


def launch(command: list[str], *, cwd: Path, sigterm_after_step: int | None = None,
           metrics: Path | None = None, timeout: float = 420, signal_number: int = signal.SIGTERM,
           sigterm_on_output: str | None = None) -> subprocess.CompletedProcess:
    """Runs a launcher in its own session; with ``sigterm_after_step``, sends SIGTERM (or ``signal_number``) to the
    whole session (as Slurm signals every process of a job step, or a terminal's Ctrl-C its foreground
    processes) once the metrics show that sync; with ``sigterm_on_output``, once the log shows that text."""
    with open(cwd / "log.txt", "w") as log:
        proc = subprocess.Popen(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=ENV,
                                start_new_session=True, text=True)
        deadline = time.monotonic() + timeout
        signalled = sigterm_after_step is None and sigterm_on_output is None
        while proc.poll() is None and time.monotonic() < deadline:
            if not signalled and (
                    sigterm_on_output is not None and sigterm_on_output in (cwd / "log.txt").read_text()
                    or sigterm_after_step is not None and metrics is not None and metrics.is_file()
                    and any(json.loads(line)["step"] >= sigterm_after_step
                            for line in metrics.read_text().splitlines())):
                os.killpg(proc.pid, signal_number)
                signalled = True
            time.sleep(0.2)
        # A signalled launcher may die at once while its ranks still checkpoint: wait for the whole session.
        while session_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if proc.poll() is None or session_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"{command[0]} timed out:\n{(cwd / 'log.txt').read_text()[-5000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, (cwd / "log.txt").read_text(), "")


def session_alive(group: int) -> bool:
    """Whether a live (not zombie) process of process group ``group`` is left: the launcher's, made by
    start_new_session. Read from /proc, since exited ranks reparented to a container's init may stay zombies."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, process_group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # the process ended while being read
        if state != "Z" and int(process_group) == group:
            return True
    return False
