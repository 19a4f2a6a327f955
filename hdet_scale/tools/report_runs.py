"""The metrics files the report reads (the format is in ``hdet_scale.tools.report``'s docstring): a ``Run`` per file,
its loss curves, its sync records and each explored value's series, and a run's summary."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hdet_scale.notices import warn

LOSS_FIELDS = ("loss", "replica_losses", "heldout_loss")
PLOTS_EXTRA_HINT = "pip install 'hdet_scale[plots]'"  # quoted: shells such as zsh glob the brackets


class ReportError(ValueError):
    """A metrics file that cannot be read, or arguments that do not fit together."""


@dataclass
class Run:
    """One metrics file: its label, path and records (sorted by step)."""

    label: str
    path: Path
    records: list[dict[str, Any]]


# ------------------------------------------------------------------------------------------- reading
def _number(value: Any, where: str, field: str) -> float | None:
    """A float from a JSON number, null, or HDET's spelling of a non-finite number."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ReportError(f"{where}: {field} must be a number, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(value)
    raise ReportError(f"{where}: {field} must be a number, got {value!r}")


def _check_record(record: Any, where: str) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise ReportError(f"{where}: expected a JSON object, got {type(record).__name__}")
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        raise ReportError(f"{where}: needs an integer 'step', got {step!r}")
    if isinstance(record.get("range_test"), dict):  # the LR range test a run started with: no loss of the run
        return record
    if not any(field in record for field in LOSS_FIELDS):
        raise ReportError(f"{where}: has none of {', '.join(LOSS_FIELDS)}")
    for field in ("loss", "heldout_loss"):
        if field in record:
            _number(record[field], where, field)
    if "replica_losses" in record:
        if not isinstance(record["replica_losses"], list):
            raise ReportError(f"{where}: replica_losses must be a list")
        for loss in record["replica_losses"]:
            _number(loss, where, "replica_losses")
    values = record.get("values") or {}
    if not isinstance(values, dict) or not all(isinstance(entry, dict) for entry in values.values()):
        raise ReportError(f"{where}: values must map each explored value's name to an object")
    for name, entry in values.items():
        for field in ("base", "scale"):
            _number(entry.get(field), where, f"values[{name!r}].{field}")
        replica_values = entry.get("replica_values") or []
        if not isinstance(replica_values, list):
            raise ReportError(f"{where}: values[{name!r}].replica_values must be a list")
        for value in replica_values:
            _number(value, where, f"values[{name!r}].replica_values")
    return record


def load_run(path: str | Path, label: str | None = None) -> Run:
    """Reads and checks one metrics file; errors name the file and line. A run that resumed from a checkpoint and
    appended to the file writes a sync line at or before the step of the last one: what the interrupted run wrote
    from that step on is dropped, as the resumed run replaced it; a line a resumed loop wrote again for its step (a
    training loss without HDET, a held-out loss) counts the later one. A line cut short (a run killed while writing
    it, or writing it now) is skipped, with a warning; a file with no valid line is refused."""
    path = Path(path)
    if not path.is_file():
        raise ReportError(f"{path}: no such file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ReportError(f"{path}: not a text file (expected JSON lines)") from None
    numbered = [(number, line) for number, line in enumerate(lines, start=1) if line.strip()]
    kept: list[dict[str, Any] | None] = []  # None: a line a later one for its step replaced
    latest: dict[tuple[str, int], int] = {}  # a repeatable line's kind and step: where its latest is in ``kept``
    not_json: list[str] = []
    for number, line in numbered:
        where = f"{path}, line {number}"
        try:
            record = _check_record(json.loads(line), where)
        except json.JSONDecodeError as error:
            not_json.append(f"{where}: not valid JSON ({error.msg})")
            warn(f"{where}: not valid JSON, skipped (a line cut short: the run was stopped while writing it, or is "
                 "writing it now)")
            continue
        if _resumes_at(record, kept):
            kept = [earlier for earlier in kept if earlier is not None and earlier["step"] < record["step"]]
            latest = {key: index for index, earlier in enumerate(kept) if (key := _repeat_key(earlier))}
        key = _repeat_key(record)
        if key in latest:  # a resumed loop's later line for the step counts
            kept[latest[key]] = None
        if key:
            latest[key] = len(kept)
        kept.append(record)
    records = [record for record in kept if record is not None]
    if not records:
        raise ReportError(not_json[0] + ", and no line is: not a metrics file" if not_json
                          else f"{path}: no metrics lines (the file is empty)")
    records.sort(key=lambda record: record["step"])
    return Run(label=label or path.stem, path=path, records=records)


def _resumes_at(record: dict[str, Any], before: list[dict[str, Any] | None]) -> bool:
    """Whether ``record``, read after ``before``, starts a resumed run's lines: an HDET sync line at or before the
    step of the last sync line (a run writes them in step order, one a step; other lines may come in any order)."""
    if "replica_losses" not in record:
        return False
    last_sync = next((earlier["step"] for earlier in reversed(before)
                      if earlier is not None and "replica_losses" in earlier), None)
    return last_sync is not None and record["step"] <= last_sync


def _repeat_key(record: dict[str, Any]) -> tuple[str, int] | None:
    """A line a resumed loop may write again for its step, whose later line counts: a training loss written without
    HDET (``loss``, no ``replica_losses``) or a held-out loss alone; None for any other."""
    if "replica_losses" in record:
        return None
    if "loss" in record:
        return ("loss", record["step"])
    return ("heldout_loss", record["step"]) if "heldout_loss" in record else None


def default_labels(paths: Sequence[Path]) -> list[str]:
    """File stems; where two stems coincide (``runs/*/hdet_metrics.jsonl``), ``parent/stem`` for all."""
    stems = [path.stem for path in paths]
    if len(set(stems)) == len(stems):
        return stems
    return [f"{path.parent.name}/{path.stem}" if path.parent.name else path.stem for path in paths]


# ------------------------------------------------------------------------------------------- series
def train_loss(record: dict[str, Any]) -> float | None:
    """The record's training loss: ``loss``, else the mean of the finite replica losses (NaN when no replica
    has a finite one), else None (an evaluation-only line)."""
    if "loss" in record:
        return _number(record["loss"], "", "loss")
    if "replica_losses" in record:
        finite = finite_replica_losses(record)
        return sum(finite) / len(finite) if finite else math.nan
    return None


def finite_replica_losses(record: dict[str, Any]) -> list[float]:
    losses = [_number(loss, "", "replica_losses") for loss in record.get("replica_losses") or []]
    return [loss for loss in losses if loss is not None and math.isfinite(loss)]


def loss_curve(run: Run) -> tuple[list[int], list[float]]:
    """(steps, training losses) of the records that have a training loss."""
    points = [(record["step"], train_loss(record)) for record in run.records]
    points = [(step, loss) for step, loss in points if loss is not None]
    return [step for step, _ in points], [loss for _, loss in points]


def heldout_curve(run: Run) -> tuple[list[int], list[float]]:
    """(steps, held-out losses) of the records that have ``heldout_loss``."""
    points = [(record["step"], _number(record["heldout_loss"], "", "heldout_loss")) for record in run.records
              if record.get("heldout_loss") is not None]
    return [step for step, _ in points], [loss for _, loss in points]


def sync_records(run: Run) -> list[dict[str, Any]]:
    """HDET's sync lines (those with ``replica_losses``), one per step: where a file repeats a step (a run that
    resumed and appended), the later line, which the continued run wrote."""
    by_step = {record["step"]: record for record in run.records if "replica_losses" in record}
    return [by_step[step] for step in sorted(by_step)]


def explored_names(run: Run) -> list[str]:
    """The explored values (``values`` keys) in the order they first appear."""
    names: dict[str, None] = {}
    for record in run.records:
        names.update(dict.fromkeys(record.get("values") or {}))
    return list(names)


def value_series(run: Run, name: str) -> dict[str, Any]:
    """One explored value over the syncs: ``steps``, ``base``, ``scale`` and ``replicas`` (one list per replica of
    the values it trained with at the end of each interval; NaN where a line has fewer replicas)."""
    rows = [(record["step"], record["values"][name]) for record in sync_records(run)
            if name in (record.get("values") or {})]
    replica_rows = [entry.get("replica_values") or [] for _, entry in rows]
    width = max((len(values) for values in replica_rows), default=0)
    replicas = [[_float(values[index]) if index < len(values) else math.nan for values in replica_rows]
                for index in range(width)]
    return {"steps": [step for step, _ in rows], "base": [_float(entry.get("base")) for _, entry in rows],
            "scale": [_float(entry.get("scale")) for _, entry in rows], "replicas": replicas}


def applied_series(run: Run, name: str) -> dict[str, Any] | None:
    """One explored value step by step, from sync lines that carry ``applied_bases`` and ``replica_multipliers``:
    ``steps``, ``base`` (the base each step used), ``replicas`` (each replica's value at each step, the base times
    its multiplier of that interval before the value's bounds; NaN where a replica was left out or absent) and
    ``excluded`` ((sync step, value) of every interval a replica was left out of for non-finite weights or
    optimizer state). None for a file written without those fields (an older hdet_scale)."""
    steps: list[int] = []
    base: list[float] = []
    replicas: list[list[float]] = []
    excluded: list[tuple[int, float]] = []
    for record in sync_records(run):
        entry = (record.get("values") or {}).get(name)
        if entry is None:
            continue
        bases, multipliers = entry.get("applied_bases"), entry.get("replica_multipliers")
        if bases is None or multipliers is None:
            return None
        left_out = set(record.get("excluded_replicas") or [])
        while len(replicas) < len(multipliers):  # a run resumed with more replicas
            replicas.append([math.nan] * len(steps))
        first = record["step"] - len(bases) + 1
        for offset, value in enumerate(bases):
            steps.append(first + offset)
            base.append(_float(value))
            for replica, series in enumerate(replicas):
                inside = replica < len(multipliers) and replica not in left_out
                series.append(base[-1] * _float(multipliers[replica]) if inside else math.nan)
        excluded += [(record["step"], base[-1] * _float(multipliers[replica])) for replica in sorted(left_out)
                     if replica < len(multipliers)]
    return {"steps": steps, "base": base, "replicas": replicas, "excluded": excluded}


VALUE_WORDS = {"lr": "learning rate", "weight_decay": "weight decay", "dropout": "dropout",
               "attention_scale": "attention scale", "label_smoothing": "label smoothing"}


def value_title(name: str) -> str:
    """An explored value's name in words: ``lr/0`` is "learning rate of param group 0", ``lr/embedding``
    "learning rate of the embedding group"."""
    key, _, group = name.partition("/")
    words = VALUE_WORDS.get(key, key.replace("_", " "))
    if not group:
        return words
    return f"{words} of param group {group}" if group.isdigit() else f"{words} of the {group} group"


def _float(value: Any) -> float:
    number = _number(value, "", "value")
    return math.nan if number is None else number


# ------------------------------------------------------------------------------------------- summary
def summarize(run: Run) -> dict[str, Any]:
    """Final training and held-out loss, syncs, and the final base and scale of every explored value."""
    steps, losses = loss_curve(run)
    held_steps, held = heldout_curve(run)
    syncs = sync_records(run)
    values = {}
    for name in explored_names(run):
        series = value_series(run, name)
        values[name] = {"base": series["base"][-1], "scale": series["scale"][-1], "step": series["steps"][-1]}
    return {
        "label": run.label, "path": str(run.path), "lines": len(run.records),
        "first_step": run.records[0]["step"], "last_step": run.records[-1]["step"],
        "final_loss": losses[-1] if losses else None, "final_loss_step": steps[-1] if steps else None,
        "final_heldout_loss": held[-1] if held else None, "final_heldout_step": held_steps[-1] if held else None,
        "syncs": len(syncs), "replicas": len(syncs[-1]["replica_losses"]) if syncs else None,
        "values": values,
    }


def format_summary(summary: dict[str, Any]) -> str:
    """A few lines of text for one run's ``summarize`` result."""
    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.6g}"

    def at(step: int | None) -> str:
        return "" if step is None else f" (step {step})"

    lines = [f"run {summary['label']} ({summary['path']}): {summary['lines']} lines, steps "
             f"{summary['first_step']}-{summary['last_step']}",
             f"  last logged train loss {number(summary['final_loss'])}{at(summary['final_loss_step'])}; "
             f"final held-out loss {number(summary['final_heldout_loss'])}{at(summary['final_heldout_step'])}"]
    if summary["syncs"]:
        replicas = summary["replicas"]
        lines.append(f"  syncs {summary['syncs']} ({replicas} replica{'' if replicas == 1 else 's'})")
    for name, value in summary["values"].items():
        lines.append(f"  {name}: final {number(value['base'])} ({number(value['scale'])} x schedule, step "
                     f"{value['step']})")
    return "\n".join(lines)
