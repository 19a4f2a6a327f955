"""Plots and a summary of training runs from their metrics JSON lines.

    python -m hdet_scale.report runs/a/hdet_metrics.jsonl runs/b/baseline.jsonl --labels hdet baseline --out plots/
    python -m hdet_scale.report runs/a/hdet_metrics.jsonl --export-schedule schedule.json

Writes ``loss.png`` (training loss vs steps, one line per run, and held-out loss where the files have it: the
paper's Figure 2), ``schedules_<label>.png`` for every run with HDET sync lines (per explored value, e.g.
``lr/0``, ``lr/embedding``, ``weight_decay/0``: the base value and each replica's value over steps, and the
controller's scale: the paper's Figure 3) and ``summary.json``, and prints a short summary. ``--export-schedule``
writes the base values one HDET run applied at every step (``hdet_scale.replay``), for ``ReplaySchedule``.

The format, one JSON object per line:

- minimal (any training loop, e.g. a plain baseline): ``{"step": int, "loss": float}``, optionally with
  ``"heldout_loss": float``; a line may also carry only ``step`` and ``heldout_loss`` (an evaluation).
- HDET's sync lines (``SyncReport.as_record``, written to ``metrics_path``): ``step``, ``replica_losses`` (each
  replica's mean training loss over the interval ending at ``step``; null for a replica without losses) and
  ``values`` (per explored value: ``replica_values`` the replicas trained with at the end of the interval,
  the controller's new ``base`` and ``scale``, and ``applied_bases``, the base every step of the interval
  used). Their training loss is the mean of the finite replica losses;
  a ``loss`` field, where present, takes precedence.

Non-finite numbers may appear as the strings ``"nan"``, ``"inf"`` and ``"-inf"`` (how HDET writes them, since
JSON has no NaN). Other fields are ignored. Lines are sorted by step (stable), blank lines are skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hdet_scale.metrics import writable_directory
from hdet_scale.replay import ScheduleFileError, schedule_from_records, write_schedule

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
    """Reads and checks one metrics file; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ReportError(f"{path}: no such file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ReportError(f"{path}: not a text file (expected JSON lines)") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ReportError(f"{where}: not valid JSON ({error.msg})") from None
        records.append(_check_record(record, where))
    if not records:
        raise ReportError(f"{path}: no metrics lines (the file is empty)")
    records.sort(key=lambda record: record["step"])
    return Run(label=label or path.stem, path=path, records=records)


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
        finite = _finite_replica_losses(record)
        return sum(finite) / len(finite) if finite else math.nan
    return None


def _finite_replica_losses(record: dict[str, Any]) -> list[float]:
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
        lines.append(f"  syncs {summary['syncs']} ({summary['replicas']} replicas)")
    for name, value in summary["values"].items():
        lines.append(f"  {name}: final {number(value['base'])} ({number(value['scale'])} x schedule, step "
                     f"{value['step']})")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- plots
def _figure_class() -> Any:
    """matplotlib's Figure on the Agg canvas; no pyplot, so the caller's backend stays as it is."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ReportError(f"the report's plots need matplotlib: {PLOTS_EXTRA_HINT}") from error

    def figure(**kwargs: Any) -> Any:
        fig = Figure(**kwargs)
        FigureCanvasAgg(fig)
        return fig

    return figure


def plot_losses(runs: Sequence[Run], path: str | Path) -> Path:
    """Training loss vs steps, one line per run (the band spans HDET's replica losses); a second panel with
    the held-out loss when any run has one."""
    figure = _figure_class()
    with_heldout = any(heldout_curve(run)[0] for run in runs)
    fig = figure(figsize=(12 if with_heldout else 7, 4.5), layout="constrained")
    axes = fig.subplots(1, 2 if with_heldout else 1, squeeze=False)[0]
    for index, run in enumerate(runs):
        color = f"C{index % 10}"
        steps, losses = loss_curve(run)
        axes[0].plot(steps, losses, color=color, label=run.label, marker="." if len(steps) < 40 else None)
        band = [(record["step"], _finite_replica_losses(record)) for record in sync_records(run)]
        band = [(step, values) for step, values in band if len(values) > 1]
        if band:
            axes[0].fill_between([step for step, _ in band], [min(values) for _, values in band],
                                 [max(values) for _, values in band], color=color, alpha=0.15, linewidth=0)
        if with_heldout:
            held_steps, held = heldout_curve(run)
            if held_steps:
                axes[1].plot(held_steps, held, color=color, label=run.label, marker="o", markersize=3)
    axes[0].set_title("training loss (band: replicas' range)" if any(sync_records(run) for run in runs)
                      else "training loss")
    if with_heldout:
        axes[1].set_title("held-out loss")
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(fig, path)


def plot_schedules(run: Run, path: str | Path) -> Path:
    """Per explored value, one row: the base and each replica's value over the syncs (left) and the
    controller's scale (right)."""
    figure = _figure_class()
    names = explored_names(run)
    if not names:
        raise ReportError(f"{run.path}: no HDET values to plot")
    fig = figure(figsize=(12, 3.2 * len(names)), layout="constrained")
    axes = fig.subplots(len(names), 2, squeeze=False, width_ratios=[3, 1])
    for row, name in enumerate(names):
        series = value_series(run, name)
        left, right = axes[row]
        _draw_values(left, series, applied_series(run, name))
        left.set_title(f"{run.label}: {value_title(name)}")
        left.set_ylabel(VALUE_WORDS.get(name.partition("/")[0], name))
        right.plot(series["steps"], series["scale"], color="black", marker="." if len(series["steps"]) < 40 else None)
        right.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
        right.set_title("controller scale (per sync)")
        for ax in (left, right):
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        left.legend(fontsize="small", ncol=2 if len(series["replicas"]) > 4 else 1)
    return _save(fig, path)


def _draw_values(ax: Any, series: dict[str, Any], applied: dict[str, Any] | None) -> None:
    """Each replica's value and the base where they applied: step by step when the lines carry it, else (older
    files) each replica's value at the end of an interval held over the whole interval."""
    if applied is None:
        edges = _interval_edges(series["steps"])
        for replica, values in enumerate(series["replicas"]):
            ax.stairs(values, edges, color=f"C{replica % 10}", linewidth=0.8, alpha=0.8, baseline=None,
                      label=f"replica {replica}")
        ax.plot(series["steps"], series["base"], color="black", linewidth=2, label="base")
        return
    # A replica's multiplier changes at a sync: break its line there instead of drawing a jump.
    syncs = set(series["steps"])
    for replica, values in enumerate(applied["replicas"]):
        steps, broken = [], []
        for step, value in zip(applied["steps"], values, strict=True):
            steps.append(step)
            broken.append(value)
            if step in syncs:
                steps.append(step + 0.5)
                broken.append(math.nan)
        ax.plot(steps, broken, color=f"C{replica % 10}", linewidth=0.8, alpha=0.8, label=f"replica {replica}")
    ax.plot(applied["steps"], applied["base"], color="black", linewidth=2, label="base")
    if applied["excluded"]:
        steps, values = zip(*applied["excluded"], strict=True)
        ax.scatter(steps, values, marker="x", color="red", zorder=3, label="left out (non-finite)")


def _interval_edges(steps: list[int]) -> list[float]:
    """Interval boundaries for values reported at the end of each interval: the first interval is as long
    as the second (or starts at step 0)."""
    gap = steps[1] - steps[0] if len(steps) > 1 and steps[1] > steps[0] else steps[0]
    return [min(max(steps[0] - gap, 0), steps[0] - 1), *steps]


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _file_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "run"


# ------------------------------------------------------------------------------------------- command
def report(paths: Sequence[str | Path], out: str | Path, labels: Sequence[str] | None = None) -> dict[str, Any]:
    """Reads the files, writes the plots and ``summary.json`` under ``out``; returns the summary (with the
    written files under ``"files"``)."""
    _figure_class()  # fail on a missing matplotlib before reading large files
    paths = [Path(path) for path in paths]
    if labels is not None and len(labels) != len(paths):
        raise ReportError(f"--labels has {len(labels)} names for {len(paths)} files")
    names = list(labels) if labels is not None else default_labels(paths)
    if len(set(names)) != len(names):
        raise ReportError(f"run labels must be unique, got {names}")
    runs = [load_run(path, name) for path, name in zip(paths, names, strict=True)]
    out = Path(out)
    files = [plot_losses(runs, out / "loss.png")]
    used: set[str] = set()
    for run in runs:
        if explored_names(run):
            stem = _file_name(run.label)
            while stem in used:  # labels that differ only in characters a file name cannot hold
                stem += "_"
            used.add(stem)
            files.append(plot_schedules(run, out / f"schedules_{stem}.png"))
    summary = {"runs": [summarize(run) for run in runs], "files": [str(path) for path in files]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``python -m hdet_scale.report METRICS.jsonl [...] --out DIR [--labels ...]``."""
    parser = argparse.ArgumentParser(
        prog="python -m hdet_scale.report",
        description="Plot training loss (all runs) and HDET's per-replica schedules (runs with HDET sync lines) "
                    "from metrics JSON lines, and print a summary. Format: one object per line with 'step' "
                    "and 'loss' (or HDET's 'replica_losses'), optionally 'heldout_loss'.")
    parser.add_argument("metrics", nargs="+", help="metrics JSONL files, one per run")
    parser.add_argument("--out", help="directory for the PNGs and summary.json")
    parser.add_argument("--labels", nargs="+", help="one name per file (default: the file names)")
    parser.add_argument("--export-schedule", dest="export_schedule", metavar="FILE",
                        help="write the base values the run applied at every step (one HDET metrics file) to FILE, "
                             "for hdet_scale.schedule.ReplaySchedule and train.py --replay_schedule")
    args = parser.parse_args(argv)
    if args.out is None and args.export_schedule is None:
        parser.error("give --out DIR (plots and summary) or --export-schedule FILE, or both")
    try:  # before any work: a bad path is one line, not a traceback after the plots
        if args.out is not None:
            writable_directory(args.out, "--out")
        if args.export_schedule is not None:
            writable_directory(Path(args.export_schedule).parent, "--export-schedule's folder")
    except ValueError as error:
        parser.error(str(error))
    if args.export_schedule is not None:
        if len(args.metrics) != 1:
            parser.error(f"--export-schedule reads one run's metrics file, got {len(args.metrics)}")
        try:
            run = load_run(args.metrics[0])
            schedule = schedule_from_records(sync_records(run), str(run.path))
        except (ReportError, ScheduleFileError) as error:
            parser.error(str(error))
        written = write_schedule(schedule, args.export_schedule)
        print(f"wrote {written}: {', '.join(schedule['values'])} over {schedule['steps']} steps")
        if args.out is None:
            return 0
    try:
        summary = report(args.metrics, args.out, args.labels)
    except ReportError as error:
        parser.error(str(error))
    for run in summary["runs"]:
        print(format_summary(run))
    print("wrote " + ", ".join(summary["files"]) + f", {Path(args.out) / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
