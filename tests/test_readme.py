"""The README's two commands stay true: CI runs the test command, and the main job runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    section = ROOT.joinpath("README.md").read_text().split("## Two commands on a fresh machine")[1]
    return re.findall(r"```bash\n(.+?)\n```", section.split("\n## ")[0])


def test_ci_runs_the_readmes_test_command():
    main_job, tests = readme_commands()
    ci_lines = ROOT.joinpath(".ci/run").read_text().splitlines()
    assert tests in ci_lines
    assert "pip install torch==2.13.0" in main_job and "pip install torch==2.13.0" in tests


def test_main_job_runs_and_reports(tmp_path):
    main_job, _ = readme_commands()
    launch = main_job.split("&& ")[-1].split()
    assert launch[0] == ".venv/bin/torchrun" and launch[launch.index("-m") + 1] == "hdet_scale.train"
    torchrun = Path(sys.executable).with_name("torchrun")
    # The same launch, shortened to 25 steps (one sync) to keep the suite fast.
    command = [str(torchrun), *launch[1:], "--steps", "25", "--seq_len", "64", "--no_progress", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=400,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ranks=4 replicas=2 ranks_per_replica=2" in result.stdout
    assert re.search(r"final train loss \d+\.\d+  held-out loss \d+\.\d+", result.stdout)
    metrics = tmp_path / "hdet_metrics.jsonl"
    assert f"metrics: {metrics}" in result.stdout
    assert f"model: {tmp_path / 'final'}" in result.stdout
    assert f"checkpoint: {tmp_path / 'checkpoints'}" in result.stdout
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["step"] for line in lines if "replica_losses" in line] == [25]  # one sync
    assert [line["step"] for line in lines if "heldout_loss" in line] == [25]  # the final evaluation
