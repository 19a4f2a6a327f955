"""Plots and a summary of training runs from their metrics JSON lines.

    python -m hdet_scale.tools.report runs/a/hdet_metrics.jsonl runs/b/baseline.jsonl --labels hdet baseline \
        --out plots/
    python -m hdet_scale.tools.report runs/a/hdet_metrics.jsonl --export-schedule schedule.json

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
JSON has no NaN). Other fields are ignored. Lines are sorted by step (stable), blank lines are skipped. A sync line
at or before the step of the last one starts the lines of a run resumed from a checkpoint: the interrupted run's
lines from that step on are dropped. A last line cut short (a run stopped while writing it) is skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hdet_scale.metrics import json_safe, writable_directory
from hdet_scale.replay import ScheduleFileError, schedule_from_records, write_schedule
from hdet_scale.tools.report_plots import figure_class, file_name, plot_losses, plot_schedules
from hdet_scale.tools.report_runs import (
    ReportError,
    default_labels,
    explored_names,
    format_summary,
    load_run,
    summarize,
    sync_records,
)


def report(paths: Sequence[str | Path], out: str | Path, labels: Sequence[str] | None = None) -> dict[str, Any]:
    """Reads the files, writes the plots and ``summary.json`` under ``out``; returns the summary (with the
    written files under ``"files"``)."""
    figure_class()  # fail on a missing matplotlib before reading large files
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
            stem = file_name(run.label)
            while stem in used:  # labels that differ only in characters a file name cannot hold
                stem += "_"
            used.add(stem)
            files.append(plot_schedules(run, out / f"schedules_{stem}.png"))
    summary = {"runs": [summarize(run) for run in runs], "files": [str(path) for path in files]}
    (out / "summary.json").write_text(json.dumps(json_safe(summary), indent=2) + "\n")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``python -m hdet_scale.tools.report METRICS.jsonl [...] --out DIR [--labels ...]``."""
    parser = argparse.ArgumentParser(
        prog="python -m hdet_scale.tools.report",
        description="Plot training loss (all runs) and HDET's per-replica schedules (runs with HDET sync lines) "
                    "from metrics JSON lines, and print a summary. Format: one object per line with 'step' "
                    "and 'loss' (or HDET's 'replica_losses'), optionally 'heldout_loss'.")
    parser.add_argument("metrics", nargs="+", help="metrics JSONL files, one per run")
    parser.add_argument("--out", help="directory for the PNGs and summary.json")
    parser.add_argument("--labels", nargs="+", help="one name per file, given after the files (default: the file "
                                                    "names)")
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
            if Path(args.export_schedule).is_dir():
                raise ValueError(f"--export-schedule {args.export_schedule} is a directory: give a file name, e.g. "
                                 f"{Path(args.export_schedule) / 'schedule.json'}")
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
