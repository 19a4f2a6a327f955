"""The sbatch templates' time guard reads Slurm's time-left formats (``squeue -o %L``) as seconds, the same in
both templates; the guard itself runs in a real job in test_slurm.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

LAUNCH = Path(__file__).resolve().parents[1] / "launch"


def seconds_of_function(template: str) -> str:
    text = (LAUNCH / template).read_text()
    found = re.search(r"^seconds_of\(\) \{.*?^\}$", text, re.MULTILINE | re.DOTALL)
    assert found, f"no seconds_of in {template}"
    return found.group(0)


def test_both_templates_share_one_guard():
    assert seconds_of_function("fsdp.sbatch") == seconds_of_function("deepspeed.sbatch")


@pytest.mark.parametrize(("left", "seconds"), [
    ("4:59", 4 * 60 + 59),
    ("09", 9),
    ("1:02:03", 3600 + 2 * 60 + 3),
    ("2-00:00:08", 2 * 86400 + 8),
    ("10-01:00:00", 10 * 86400 + 3600),
])
def test_slurm_time_left_in_seconds(left, seconds):
    script = f"{seconds_of_function('fsdp.sbatch')}\nseconds_of {left}"
    assert subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout == f"{seconds}\n"


@pytest.mark.parametrize("left", ["UNLIMITED", "INVALID", "NOT_SET", ""])
def test_no_time_limit_means_no_guard(left):
    script = f"{seconds_of_function('fsdp.sbatch')}\nseconds_of '{left}'"
    assert subprocess.run(["bash", "-c", script], capture_output=True, text=True).returncode != 0
