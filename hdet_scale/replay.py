"""The schedule an HDET run discovered, as a file another run can replay without HDET.

HDET's sync lines carry, per explored value, ``applied_bases``: the base every optimizer step of the interval
used (the schedule's value times the controller's scale, or ``paper`` mode's own base). Joined over the syncs
they give the base at every step, with the schedule's own shape between syncs:

    {"format": "hdet_scale.schedule/1", "source": "run.jsonl", "steps": N,
     "values": {"lr/0": [base at step 1, ..., base at step N], "weight_decay/0": [...], ...}}

``hdet_scale.schedule.ReplaySchedule`` replays the optimizer entries of such a file in any training loop.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

SCHEDULE_FORMAT = "hdet_scale.schedule/1"
OPTIMIZER_KEYS = ("lr", "weight_decay")
"""The optimizer entries HDET explores per param group (``lr/<group>``, ``weight_decay/<group>``)."""


class ScheduleFileError(ValueError):
    """A metrics file without what a schedule needs, or a schedule file that cannot be replayed."""


def schedule_from_records(records: Iterable[Mapping[str, Any]], source: str) -> dict[str, Any]:
    """The per-step bases of HDET sync ``records`` (one per sync step, in step order; ``source`` names them in
    errors). Every step from 1 to the last sync must be covered, and every explored value recorded at every
    sync."""
    per_step: dict[str, dict[int, float]] = {}
    last_step = 0
    for record in records:
        step, values = record["step"], record.get("values") or {}
        for name, entry in values.items():
            bases = entry.get("applied_bases")
            if bases is None:
                raise ScheduleFileError(
                    f"{source}: the sync line of step {step} has no applied_bases for {name!r} (written by an "
                    "hdet_scale older than the schedule export): rerun with this version to export its schedule")
            first = step - len(bases) + 1
            for offset, base in enumerate(bases):
                per_step.setdefault(name, {})[first + offset] = float(base)
        last_step = max(last_step, step)
    if not per_step:
        raise ScheduleFileError(f"{source}: no HDET sync lines with explored values: nothing to export")
    values = {}
    for name, by_step in per_step.items():
        missing = [step for step in range(1, last_step + 1) if step not in by_step]
        if missing:
            raise ScheduleFileError(f"{source}: {name!r} has no base for steps {missing[0]}..{missing[-1]} "
                                    f"({len(missing)} steps): the file lacks the sync lines that cover them")
        values[name] = [by_step[step] for step in range(1, last_step + 1)]
    return {"format": SCHEDULE_FORMAT, "source": source, "steps": last_step, "values": values}


def optimizer_entry(name: str) -> tuple[str, str] | None:
    """(key, param group) of an explored value an optimizer holds (``"lr/embedding"``: ``("lr", "embedding")``);
    None for the others (``dropout``, ``label_smoothing``)."""
    key, _, group = name.partition("/")
    return (key, group) if key in OPTIMIZER_KEYS and group else None


def write_schedule(schedule: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Writes ``schedule`` as JSON (atomically: a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(schedule) + "\n", encoding="utf-8")
    partial.replace(path)
    return path


def read_schedule(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A schedule file, checked: the format, and one finite, non-negative base per step for every value."""
    path = Path(path)
    try:
        schedule = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ScheduleFileError(f"{path}: no such schedule file") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ScheduleFileError(f"{path}: not a JSON schedule (write one with python -m hdet_scale.tools.report "
                                "RUN.jsonl --export-schedule FILE)") from None
    if not isinstance(schedule, dict) or schedule.get("format") != SCHEDULE_FORMAT:
        raise ScheduleFileError(f"{path}: 'format' must be {SCHEDULE_FORMAT!r} (a file written by python -m "
                                "hdet_scale.tools.report --export-schedule)")
    steps, values = schedule.get("steps"), schedule.get("values")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1 or not isinstance(values, dict) \
            or not values:
        raise ScheduleFileError(f"{path}: needs 'steps' (an integer >= 1) and 'values' (one list per name)")
    for name, bases in values.items():
        if not isinstance(bases, list) or len(bases) != steps or not all(
                isinstance(base, (int, float)) and not isinstance(base, bool) and math.isfinite(base) and base >= 0
                for base in bases):
            raise ScheduleFileError(f"{path}: values[{name!r}] must be {steps} finite numbers >= 0")
    return schedule
