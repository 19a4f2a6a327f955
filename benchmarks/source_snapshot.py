"""The code a benchmark measures: HEAD's ``hdet_scale``, exported once, so edits to the working tree during a
long benchmark cannot leak into some of its runs (``python -m`` puts the working directory first on
``sys.path``, ahead of the editable install, and each run starts there)."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def head_commit() -> str:
    """The commit the benchmark measures (uncommitted edits to ``hdet_scale`` are not measured)."""
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()


def snapshot_source(commit: str, runs_dir: Path) -> Path:
    """Exports ``hdet_scale`` at ``commit`` under ``runs_dir/src`` (once) and returns the folder holding it."""
    target = runs_dir / "src" / commit[:12]
    if not (target / "hdet_scale").is_dir():
        target.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", commit, "hdet_scale"], cwd=REPO, capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target
