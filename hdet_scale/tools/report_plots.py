"""The report's plots (matplotlib on the Agg canvas, no pyplot): the runs' losses (the paper's Figure 2) and one
run's explored values per replica with the controller's factor on the schedule (its Figure 3)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hdet_scale.tools.report_runs import (
    PLOTS_EXTRA_HINT,
    VALUE_WORDS,
    ReportError,
    Run,
    applied_series,
    explored_names,
    finite_replica_losses,
    heldout_curve,
    loss_curve,
    sync_records,
    value_series,
    value_title,
)


def figure_class() -> Any:
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
    figure = figure_class()
    with_heldout = any(heldout_curve(run)[0] for run in runs)
    fig = figure(figsize=(12 if with_heldout else 7, 4.5), layout="constrained")
    axes = fig.subplots(1, 2 if with_heldout else 1, squeeze=False)[0]
    for index, run in enumerate(runs):
        color = f"C{index % 10}"
        steps, losses = loss_curve(run)
        axes[0].plot(steps, losses, color=color, label=run.label, marker="." if len(steps) < 40 else None)
        band = [(record["step"], finite_replica_losses(record)) for record in sync_records(run)]
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
    figure = figure_class()
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


def file_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "run"
