"""The sbatch templates' time guard reads Slurm's time-left formats (``squeue -o %L``) as seconds, and both
templates stop and requeue alike; the guard and scancel run in real jobs in test_slurm.py.

This file holds the tests that start no process; the tests that start a launcher or script as a subprocess are in
tests/e2e/test_time_guard_e2e.py.
"""

from __future__ import annotations

import re
from pathlib import Path

LAUNCH = Path(__file__).resolve().parents[2] / "launch"


def seconds_of_function(template: str) -> str:
    text = (LAUNCH / template).read_text()
    found = re.search(r"^seconds_of\(\) \{.*?^\}$", text, re.MULTILINE | re.DOTALL)
    assert found, f"no seconds_of in {template}"
    return found.group(0)


def test_both_templates_share_one_guard():
    assert seconds_of_function("fsdp.sbatch") == seconds_of_function("deepspeed.sbatch")


def signal_handling(template: str) -> str:
    """The template's shell from its signal handlers to its end."""
    text = (LAUNCH / template).read_text()
    start, end = text.index("requeue=0\n"), text.index("# No --kill-on-bad-exit")
    return text[start:end] + text[text.index("wait \"$srun_pid\" || status=$?"):]


def test_both_templates_stop_and_requeue_alike():
    """test_slurm.py runs scancel against the FSDP template only; the DeepSpeed template's handling is the same
    shell. Both stop the ranks with SIGUSR1, which their launchers are started ignoring: torchrun before 2.9 and
    DeepSpeed's launcher kill the ranks 30 s after a SIGTERM, mid-checkpoint."""
    fsdp = signal_handling("fsdp.sbatch")
    assert "trap on_time_guard USR2" in fsdp and "scontrol requeue" in fsdp
    assert "--signal=USR1" in fsdp and "--signal=TERM" not in fsdp
    assert fsdp == signal_handling("deepspeed.sbatch")
    for template in ("fsdp.sbatch", "deepspeed.sbatch"):
        assert """trap "" TERM USR1\n""" in (LAUNCH / template).read_text(), template
