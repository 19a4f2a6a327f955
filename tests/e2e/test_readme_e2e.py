"""The README's two commands stay true: CI runs the test command, and the main job runs.

This file holds the tests that start a launcher or script as a subprocess; the tests that start no process are in
tests/unit/test_readme.py.
"""

from __future__ import annotations

import json
import re

import pytest
from launcher import EVAL_INTERVAL, ROOT, STEPS, SYNC_INTERVAL


@pytest.mark.e2e
def test_main_job_runs_and_reports(main_job):
    """The README's launch, shortened (conftest's ``main_job``, which test_train_e2e.py checks in depth too)."""
    launch = main_job.readme_launch
    assert launch[0] == ".venv/bin/torchrun" and launch[launch.index("-m") + 1] == "hdet_scale.lm.train"
    result, out = main_job.result, main_job.out
    assert result.returncode == 0, result.stdout[-5000:]
    assert "ranks=4 replicas=2 ranks_per_replica=2" in result.stdout
    assert re.search(r"final train loss \d+\.\d+  held-out loss \d+\.\d+", result.stdout)
    for shown in readme_output_lines(("sync step 5 ", "found LR")):  # the README shows the lines as printed
        assert re.search(shown, result.stdout, re.M), shown
    metrics = out / "hdet_metrics.jsonl"
    assert f"metrics: {metrics}" in result.stdout
    assert f"model: {out / 'final'}" in result.stdout
    assert f"checkpoint: {out / 'checkpoints'}" in result.stdout
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["step"] for line in lines if "replica_losses" in line] == list(
        range(SYNC_INTERVAL, STEPS + 1, SYNC_INTERVAL))  # a line per sync
    assert [line["step"] for line in lines if "heldout_loss" in line] == list(
        range(EVAL_INTERVAL, STEPS + 1, EVAL_INTERVAL))  # every --eval_interval, the last one the final evaluation


def readme_output_lines(starts: tuple[str, ...]) -> list[str]:
    """The lines of the README's "What the main job prints" block that begin with ``starts``, as patterns: each
    placeholder (a capital letter, maybe with an index: L, L_0, B, K, X, N, M) stands for a number."""
    readme = ROOT.joinpath("README.md").read_text()
    block = readme.split("## What the main job prints", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if line.startswith(starts)]
    assert len(lines) == len(starts), (starts, block)
    number = r"(?:[-+]?[0-9][0-9.e+-]*|nan)"
    return ["^" + re.sub(r"\b[A-Z](?:_\d)?\b", number, re.escape(line).replace(r"\ ", " ")) + "$" for line in lines]
