"""The sbatch templates' time guard reads Slurm's time-left formats (``squeue -o %L``) as seconds, the same in
both templates; the guard itself runs in a real job in test_slurm.py.

This file holds the tests that start a launcher or script as a subprocess; the tests that start no process are in
tests/unit/test_time_guard.py.
"""

from __future__ import annotations

import subprocess

import pytest
from test_time_guard import seconds_of_function


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
