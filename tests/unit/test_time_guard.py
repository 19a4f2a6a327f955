"""The sbatch templates' time guard reads Slurm's time-left formats (``squeue -o %L``) as seconds, the same in
both templates; the guard itself runs in a real job in test_slurm.py.

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
