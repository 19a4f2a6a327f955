"""The report command: plots and summary from metrics JSON lines (hand-made, and one written by HDET itself).

This file holds the tests that start a launcher or script as a subprocess; the tests that start no process are in
tests/unit/test_report.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_report import baseline_run, check_png, number_after, summary_block

REPO = Path(__file__).resolve().parents[2]


def test_runs_as_a_module(tmp_path):
    path, expected = baseline_run(tmp_path / "base.jsonl")
    result = subprocess.run([sys.executable, "-m", "hdet_scale.tools.report", str(path), "--out", str(tmp_path / "o")],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert number_after(summary_block(result.stdout, "base"), "last logged train loss") == pytest.approx(
        expected["loss"], rel=1e-5)
    check_png(tmp_path / "o" / "loss.png")
