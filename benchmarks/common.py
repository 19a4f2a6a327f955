"""What the benchmarks share: where results go, which machine and code a result came from, HDET configs, torchrun
launches, and JSON and Markdown results whose hand-written notes survive a rewrite.

A benchmark in this folder is a script (``python benchmarks/<name>.py``), so the folder is on ``sys.path`` and
its modules import each other by plain name (``from common import write_json``). This module imports nothing
heavy: torch and ``hdet_scale`` only inside the functions that need them.

Results. A benchmark writes ``<stem>.json``, the record (every number, the machine, the settings and the
command; ``write_json``), and ``<stem>.md``, tables generated from that record (``save_markdown``), so the
Markdown can always be regenerated from the JSON.

Notes: interpretation lives in the results' Markdown, not in code. What the numbers mean (why one is what it
is, the history of a run, caveats about the machine) is written by hand into the ``.md``, inside a named block::

    <!-- note: caveats -->
    - The runs shared the machine with a CI job, so wall times say little.
    <!-- end note -->

A writer puts each block, empty, where it belongs (``note("caveats")``), and ``save_markdown`` fills it with
the text of the same block in the file it replaces. Regenerating the tables therefore keeps the prose, and the
prose is written once, in the results. A new file (a quick run, another machine) starts with empty blocks to
fill in; a block the writer no longer places is kept at the end of the file instead of being dropped. The
markers are HTML comments, which Markdown does not display. Text that only says what a table shows (column
legends, how a number was measured) stays in the writer: it changes with the code, not with the results.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
RESULTS = BENCHMARKS / "results"
"""Where the committed results live."""
MiB = 2**20
REFRESH = "engine refresh (after_average)"  # the overhead benchmark's row for ZeRO rewriting its parameter copies
ONECYCLE_FLOOR_DIV = 25.0 * 1e4
"""OneCycleLR's default ``div_factor * final_div_factor``: its max LR over its final LR."""


# ------------------------------------------------------------------------------------- machine and code
def utc_now() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def package_versions(*names: str) -> dict[str, str]:
    """The installed version of each distribution in ``names`` (read from its metadata, without importing it)."""
    return {name: importlib.metadata.version(name) for name in names}


def cpu_model() -> str:
    """The CPU's model name (Linux: ``/proc/cpuinfo``; elsewhere ``platform.processor()``)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        if names:
            return names[0]
    return platform.processor()


def machine_info(*, backend: str, ranks: int, packages: Sequence[str] = ("torch",), date_key: str = "date",
                 **extra: Any) -> dict[str, Any]:
    """Where and when a benchmark ran: the date (under ``date_key``), CPU count, platform, Python, the versions
    of ``packages``, then ``extra`` (e.g. ``git_commit``, ``cpu``), the ranks and the backend."""
    return {
        date_key: utc_now(),
        "nproc": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        **package_versions(*packages),
        **extra,
        "ranks": ranks,
        "backend": backend,
    }


def head_commit() -> str:
    """The commit a benchmark measures: HEAD (uncommitted edits to ``hdet_scale`` are not measured)."""
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()


def snapshot_source(commit: str, runs_dir: Path) -> Path:
    """Exports ``hdet_scale`` and the benchmarks' scripts at ``commit`` under ``runs_dir/src`` (once) and returns
    the folder holding them.

    Runs started there (``python -m`` puts the working directory first on ``sys.path``, ahead of the editable
    install) or with it on ``PYTHONPATH`` import that code, and workers started from its ``benchmarks`` folder
    import their sibling scripts from there, so edits to the working tree during a long benchmark cannot leak
    into some of its runs.
    """
    target = runs_dir / "src" / commit[:12]
    if not (target / "benchmarks").is_dir():
        target.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", commit, "hdet_scale", "benchmarks/*.py"], cwd=REPO,
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


def repo_relative(path: str | Path) -> str:
    """``path`` relative to the repository root where it lies under it (committed results name files so)."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


# ------------------------------------------------------------------------------------------------ runs
MEASURED_DEFAULTS: dict[str, Any] = {"alpha": 1.0 / 9.0, "spread": "linear"}
MEASURED_CONTROLLER_DEFAULTS: dict[str, Any] = {"mode": "scale", "beta": 0.9, "sigma": 0.1, "step_size": 0.5,
                                                "max_log_step": 0.25, "average_window": 0.0, "rise_only_after": 1.0,
                                                "range_test": 0}
"""The library's defaults when the recorded benchmark rows were measured (before the lr_finding default variant
became the library's): written into every benchmark config, so that a row means what it measured."""


def with_measured_defaults(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` over ``MEASURED_DEFAULTS``: also the controller starting at step 100,000, never holding, and
    from a scale of 1, unless ``settings`` say otherwise (a ``log`` controller's stop is then a share of the
    run: the worker passes the run's length)."""
    auto_lr = {**MEASURED_CONTROLLER_DEFAULTS, **(settings.get("auto_lr") or {})}
    auto_lr.setdefault("start", 100_000)
    if "stop" not in auto_lr and auto_lr["mode"] == "log":
        auto_lr["stop"] = 1.0  # (its default now holds from a quarter of the run)
    auto_lr.setdefault("initial_scale", 1.0)
    return {**MEASURED_DEFAULTS, **settings, "auto_lr": auto_lr}


def hdet_config(**settings: Any) -> dict[str, Any]:
    """An HDET JSON config holding ``settings`` (sections such as ``auto_lr`` as dicts) over
    ``with_measured_defaults``. Checked against ``hdet_scale``'s config dataclasses (``HDETConfig.from_dict``), so a
    misspelt key or a bad value fails here, before any run starts."""
    from hdet_scale.config import HDETConfig

    settings = with_measured_defaults(settings)
    HDETConfig.from_dict(settings)
    return json.loads(json.dumps(settings))


def with_todays_names(config: dict[str, Any]) -> dict[str, Any]:
    """A recorded run's HDET config with the settings renamed since under their names of today
    (``hdet_scale.config.RENAMED_SETTINGS``: ``auto_lr.warmup_steps`` is now ``start``...)."""
    from hdet_scale.config import RENAMED_SETTINGS

    renamed = {section: {RENAMED_SETTINGS.get(section, {}).get(key, key): value for key, value in values.items()}
               if isinstance(values, dict) and section in RENAMED_SETTINGS else values
               for section, values in config.items()}
    return json.loads(json.dumps(renamed))


def torchrun_command(nproc: int, *args: str) -> list[str]:
    """The command that runs ``args`` (a script and its arguments, or ``-m module ...``) under torchrun with
    ``nproc`` processes on this machine, with this interpreter."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]


# ------------------------------------------------------------------------------------------------ JSON
def write_json(path: Path, data: Any, *, indent: int = 1) -> None:
    """Writes ``data`` to ``path`` as JSON with a final newline (non-finite floats as ``NaN``/``Infinity``),
    creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + "\n")


def read_json(path: Path, default: Any = None) -> Any:
    """The JSON in ``path``, or ``default`` when there is no such file."""
    return json.loads(path.read_text()) if path.is_file() else default


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (blank lines skipped); none when there is no such file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


# -------------------------------------------------------------------------------------------- Markdown
NOTE_END = "<!-- end note -->"
_NOTE = re.compile(r"^<!-- note: (?P<name>[^\n]+?) -->\n(?P<body>.*?)^<!-- end note -->$", re.M | re.S)


def note(name: str) -> list[str]:
    """An empty block for the hand-written note ``name``; ``save_markdown`` fills it from the file it replaces."""
    return [f"<!-- note: {name} -->", NOTE_END]


def notes_in(text: str) -> dict[str, str]:
    """The body of each note block in ``text`` by name (each body ends in a newline unless empty)."""
    return {match["name"]: match["body"] for match in _NOTE.finditer(text)}


def keep_notes(new: str, old: str) -> str:
    """``new`` with every note block holding the body of the same-named block in ``old``; blocks of ``old``
    that ``new`` does not place, if not empty, are appended at the end."""
    kept, placed = notes_in(old), set()

    def fill(match: re.Match[str]) -> str:
        placed.add(match["name"])
        return f"<!-- note: {match['name']} -->\n{kept.get(match['name'], match['body'])}{NOTE_END}"

    text = _NOTE.sub(fill, new)
    orphans = [f"<!-- note: {name} -->\n{body}{NOTE_END}\n" for name, body in kept.items()
               if name not in placed and body.strip()]
    return "\n".join([text, *orphans]) if orphans else text


def save_markdown(path: Path, lines: Iterable[str]) -> None:
    """Writes ``lines`` to ``path`` (ending in exactly one newline), keeping the hand-written notes of the file it
    replaces (see the module docstring)."""
    text = "\n".join(lines).rstrip("\n") + "\n"
    if path.is_file():
        text = keep_notes(text, path.read_text())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def table_header(*columns: str) -> list[str]:
    """A Markdown table's header and separator lines."""
    return [table_row(*columns), "|" + "---|" * len(columns)]


def table_row(*cells: object) -> str:
    """One Markdown table row."""
    return "| " + " | ".join(map(str, cells)) + " |"


def bullets(items: Iterable[str]) -> list[str]:
    """A Markdown list, one item a line."""
    return [f"- {item}" for item in items]
