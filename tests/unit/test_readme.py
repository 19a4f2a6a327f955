"""The README's two commands stay true: CI runs the test command, and the main job runs.

This file holds the tests that start no process; the tests that start a launcher or script as a subprocess are in
tests/e2e/test_readme_e2e.py.
"""

from __future__ import annotations

import json

from launcher import ROOT, readme_commands
from settings import assert_resolves_like_the_defaults

from hdet_scale import HDETConfig


def test_ci_runs_the_readmes_test_command():
    main_job, tests = readme_commands()
    ci_lines = ROOT.joinpath(".ci/run").read_text().splitlines()
    assert tests in ci_lines
    assert "pip install torch==2.13.0" in main_job and "pip install torch==2.13.0" in tests


def test_the_settings_example_is_the_default_config():
    """The settings JSON of docs/configuration.md (linked from the README) writes out the defaults: copying it
    changes nothing, and changing the controller's mode or range test in the copy does what it does alone."""
    page = ROOT.joinpath("docs/configuration.md").read_text()
    example = page.split("### Settings (`--hdet_config hdet.json`)", 1)[1].split("```json", 1)[1].split("```", 1)[0]
    shown = HDETConfig.from_dict(json.loads(example))
    assert (shown.alpha, shown.spread, shown.sync_interval) == (None, "log", 1000)
    assert_resolves_like_the_defaults(json.loads(example))
