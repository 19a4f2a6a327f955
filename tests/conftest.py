import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
TIERS = ("unit", "distributed", "e2e")
"""The test tiers, one folder each: ``unit`` starts no process, ``distributed`` starts gloo rank processes
(tests/distributed.py), ``e2e`` starts launchers and scripts as subprocesses (torchrun, deepspeed, Slurm, python)."""

# The helpers here (distributed.py, launcher.py, settings.py, ...) and every tier's test files are importable by
# plain module name, whichever tier runs: rank processes (tests/distributed.py) import their worker functions by
# module name, and a file split by tier imports its shared helpers from its part in unit/ (test_x_e2e.py from
# test_x.py). So each test file's name is unique across the tiers, and pytest imports it by that name (its default
# import mode) with no package folders in tests/.
for folder in (TESTS, *(TESTS / tier for tier in TIERS)):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

# The suite runs as if its interpreter's environment were activated, as the Slurm templates activate it for their
# jobs: every process it starts, and DeepSpeed's JIT build of its CPU communication op, then finds that
# environment's tools first. With one ninja for all of them, the op is built once into ~/.cache/torch_extensions;
# two ninja versions (a system one and the environment's) each discard the other's build log and build it again.
BIN = str(Path(sys.executable).parent)
if os.environ.get("PATH", "").split(os.pathsep)[0] != BIN:
    os.environ["PATH"] = os.pathsep.join([BIN, os.environ.get("PATH", "")])


def pytest_collection_modifyitems(items):
    """Every test in tests/e2e/ is marked ``e2e`` (whether or not its file says so), so ``-m "not e2e"`` still
    selects everything but the e2e tier. The tiers run slowest first (e2e, distributed, the benchmarks' tests, unit):
    with two files at a time (``-n 2``) the many short files at the end keep both workers busy, where a long file
    started last would run on alone."""
    e2e = TESTS / "e2e"
    for item in items:
        if e2e in item.path.parents:
            item.add_marker(pytest.mark.e2e)
    slowest_first = [TESTS / "e2e", TESTS / "distributed", TESTS.parent / "benchmarks"]
    items.sort(key=lambda item: next((rank for rank, folder in enumerate(slowest_first) if folder in item.path.parents),
                                     len(slowest_first)))


SHARED_MEMORY = Path("/dev/shm")
DEEPSPEED_BUFFERS = "deepspeed_allreduce_buffer_*"
"""DeepSpeed's CPU all-reduce maps a 66 MB buffer per rank here and never unlinks it: left behind by every run."""
BUFFERS_BEFORE = pytest.StashKey[set]()


def controls_the_run() -> bool:
    """Whether this process is the run's only one or, with ``-n``, the controller of its workers: it starts before
    them and ends after them."""
    return "PYTEST_XDIST_WORKER" not in os.environ


def pytest_sessionstart(session):
    if controls_the_run():
        session.config.stash[BUFFERS_BEFORE] = set(SHARED_MEMORY.glob(DEEPSPEED_BUFFERS))


def pytest_sessionfinish(session):
    """Removes the shared-memory buffers the run's DeepSpeed runs left, once they have all ended (in the controller:
    a worker ending first would remove those of the other's runs still going): a few sessions' worth fill a machine's
    memory, and Slurm's daemons were seen to stop answering under that."""
    before = session.config.stash.get(BUFFERS_BEFORE, None)
    if before is not None:
        for path in set(SHARED_MEMORY.glob(DEEPSPEED_BUFFERS)) - before:
            path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def main_job(tmp_path_factory):
    """The README's main job, launched once (shortened) for test_readme_e2e.py and test_train_e2e.py: a
    ``MainJob``."""
    from launcher import run_main_job

    return run_main_job(tmp_path_factory.mktemp("main_job"))
