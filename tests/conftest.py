import sys
from pathlib import Path

import pytest

# Rank processes (tests/distributed.py) import the worker functions by module name: keep tests/ importable.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def main_job(tmp_path_factory):
    """The README's main job, launched once (shortened) for test_readme.py and test_train.py: a ``MainJob``."""
    from launcher import run_main_job

    return run_main_job(tmp_path_factory.mktemp("main_job"))
