"""The sbatch templates' defaults, read by bash as sbatch runs them (no cluster needed)."""

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
