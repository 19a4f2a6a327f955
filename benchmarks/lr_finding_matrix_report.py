"""The LR-finding matrix's results (``lr_finding_matrix.py``): one summary table, then one section per setting.

The summary gives, per setting, the default variant's excess held-out loss over the sweep-best at each start
factor (mean over seeds), its mean over the starts, and each baseline's mean excess, with the holdout settings
in a table of their own. What the numbers mean is written by hand into the note blocks, which a rewrite keeps.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection
from pathlib import Path
from typing import Any

from common import note, save_markdown, table_header, table_row
from lr_finding_report import TARGET_AT_ONE, TARGET_NATS, _fmt, _plain_at, all_methods, headline, mean_sd, sweep_table

START_FACTORS = (0.1, 10 ** -0.5, 1.0, 10 ** 0.5, 10.0)
BASELINES = ("range_test", "proxy", "schedulefree", "prodigy")
TOLERANCE = 1e-9
"""Excesses are differences of means: a target met exactly must not read as missed by a rounding error."""
SHARE_BINS = 10
"""The controller's signal is binned by the share of the run (tenths) ..."""
LR_BINS_PER_DECADE = 2
"""... and by the LR the interval trained at over the sweep-best LR (half-decades), to find where it balances."""


def signal_points(record: dict[str, Any], variants: Collection[str]) -> list[tuple[float, float, float]]:
    """(share of the run, log10 of the interval's LR over the sweep-best, Delta) at every controller update of
    the runs of ``variants``: the LR is the run's start LR times the scale in effect before the update (the scale
    the previous sync left). A run recorded for another start too (``copy_of_lr``) counts once."""
    points = []
    steps = record["setting"]["steps"]
    for run in record["runs"]:
        if (run["method"] != "hdet" or run["variant"] not in variants or not run.get("deltas")
                or "copy_of_lr" in run):
            continue
        before = {}
        previous = None
        for step, scale in run["scales"]:
            before[step], previous = previous, scale
        for step, delta in run["deltas"]:
            if before.get(step) is not None:
                points.append((step / steps, math.log10(run["lr"] * before[step] / record["best_lr"]), delta))
    return points


def balance_by_share(points: list[tuple[float, float, float]]) -> dict[int, tuple[str, float] | None]:
    """Per tenth of the run, the LR over the sweep-best where the mean Delta changes sign, from positive (raise)
    below to negative (lower) above: ``("=", lr)`` interpolated between the half-decade bins around the change;
    ``(">", lr)`` where every bin says raise (it balances above the highest bin's LR), ``("<", lr)`` where every
    bin says lower (below the lowest); None where the signs change the other way only."""
    bins: dict[tuple[int, float], list[float]] = {}
    for share, log_ratio, delta in points:
        key = (min(int(share * SHARE_BINS), SHARE_BINS - 1), round(log_ratio * LR_BINS_PER_DECADE) / LR_BINS_PER_DECADE)
        bins.setdefault(key, []).append(delta)
    balance: dict[int, tuple[str, float] | None] = {}
    for share in sorted({share for share, _ in bins}):
        means = sorted((log_ratio, statistics.fmean(deltas)) for (bin_share, log_ratio), deltas in bins.items()
                       if bin_share == share)
        balance[share] = None
        if all(mean > 0 for _, mean in means):
            balance[share] = (">", 10 ** means[-1][0])
        elif all(mean <= 0 for _, mean in means):
            balance[share] = ("<", 10 ** means[0][0])
        for (low, low_mean), (high, high_mean) in zip(means, means[1:], strict=False):
            if low_mean > 0 >= high_mean:
                balance[share] = ("=", 10 ** (low + (high - low) * low_mean / (low_mean - high_mean)))
    return balance


def excess_by_start(record: dict[str, Any], method: str, variant: str) -> dict[float, float]:
    """Mean held-out loss over the seeds minus the sweep-best's, per start factor (rounded to 4 digits), of the
    runs of ``method`` and ``variant``."""
    sweep = sweep_table(record)
    best = sweep[record["best_lr"]][0]
    by_start: dict[float, list[float | None]] = {}
    for run in record["runs"]:
        if run["method"] == method and run["variant"] == variant:
            factor = -1.0 if run["start_factor"] is None else round(run["start_factor"], 4)
            by_start.setdefault(factor, []).append(run["heldout"])
    return {factor: mean_sd(values)[0] - best for factor, values in by_start.items()}


def baseline_mean(record: dict[str, Any], method: str) -> float:
    """A baseline's mean excess over the sweep-best: over its seeds, then over its start factors if it has any."""
    excess = excess_by_start(record, method, method)
    return statistics.fmean(excess.values()) if excess else math.nan


def judged_variant(record: dict[str, Any], default: str) -> str:
    """The HDET variant a setting is judged by: on a holdout setting, the first variant it ran (the default of that
    day; a holdout runs once); elsewhere, the default."""
    ran = [run["variant"] for run in record["runs"] if run["method"] == "hdet"]
    return ran[0] if record["holdout"] and ran else default


def summary_rows(records: list[dict[str, Any]], variant: str) -> list[str]:
    """One row per setting: the default's excess at each start, its mean, the baselines' means, and whether the
    targets hold (within +0.03 at every start, within 0.01 of plain DP at 1x, no worse than the range test). A
    holdout judged by an earlier default shows that default, named, and the current default in a row of its own
    where it ran there after its choice (that setting was seen before the choice, so it is not held out for it)."""
    lines = table_header("setting", *(f"{factor:.3g}x" for factor in START_FACTORS), "mean", "range test",
                         "proxy", "schedule-free", "Prodigy", "targets met")
    for record in records:
        judged = judged_variant(record, variant)
        if judged == variant:
            lines.append(summary_row(record, variant, record["name"]))
            continue
        lines.append(summary_row(record, judged, f"{record['name']} (the earlier default `{judged}`)"))
        if any(run["method"] == "hdet" and run["variant"] == variant for run in record["runs"]):
            lines.append(summary_row(record, variant, f"{record['name']} (the default, run after its choice: "
                                                      "seen, not held out)"))
    return lines


def summary_row(record: dict[str, Any], variant: str, name: str) -> str:
    """``record``'s summary row for HDET variant ``variant``, named ``name``."""
    hdet = excess_by_start(record, "hdet", variant)
    cells = [hdet.get(round(factor, 4), math.nan) for factor in START_FACTORS]
    found = [cell for cell in cells if math.isfinite(cell)]
    baselines = [baseline_mean(record, method) for method in BASELINES]
    return table_row(name, *(_fmt(cell, signed=True) for cell in cells),
                     _fmt(statistics.fmean(found), signed=True) if found else "-",
                     *(_fmt(value, signed=True) for value in baselines), targets_met(record, cells))


def targets_met(record: dict[str, Any], cells: list[float]) -> str:
    """"yes", "no" (naming what missed) or "-" when the default has not run from every start."""
    if not all(math.isfinite(cell) for cell in cells):
        return "-"
    sweep = sweep_table(record)
    best = sweep[record["best_lr"]][0]
    missed = [f"{factor:.3g}x" for factor, cell in zip(START_FACTORS, cells, strict=True)
              if cell > TARGET_NATS + TOLERANCE]
    plain = _plain_at(sweep, record["best_lr"])[0] - best
    if cells[START_FACTORS.index(1.0)] - plain > TARGET_AT_ONE + TOLERANCE:
        missed.append("plain DP at 1x")
    range_test = baseline_mean(record, "range_test")
    if math.isfinite(range_test) and max(cells) > range_test + TOLERANCE:
        missed.append("range test")
    return "yes" if not missed else "no: " + ", ".join(missed)


def setting_line(record: dict[str, Any]) -> str:
    s = record["setting"]
    size = "".join(f", {key} {s[key]}" for key in ("hidden", "layers") if s[key] is not None)
    return (f"Preset `{s['preset']}`{size}, {s['steps']} steps, {s['nproc']} ranks = replicas, batch "
            f"{s['batch_size']} x {s['seq_len']} bytes per rank, schedule `{s['schedule']}`, T = {s['sync_interval']}.")


def picks(record: dict[str, Any]) -> list[str]:
    """The LRs the range test and the proxy picked, over the sweep-best LR."""
    best = record["best_lr"]
    lines = []
    probes = sorted(record.get("range_probes", []), key=lambda probe: probe["seed"])
    if probes:
        lines.append("Range test picks (LR / sweep-best): " + ", ".join(
            f"seed {probe['seed']}: {probe['picked_lr'] / best:.2f}" if probe["picked_lr"] else
            f"seed {probe['seed']}: none" for probe in probes) + ".")
    if record.get("proxy_best_lr"):
        lines.append(f"Proxy (half width) sweep-best: {record['proxy_best_lr']:.3g} = "
                     f"{record['proxy_best_lr'] / best:.2f} x the full model's.")
    return lines


def balance_cell(balance: tuple[str, float] | None) -> str:
    """``balance_by_share``'s value for one tenth, as a table cell."""
    if balance is None:
        return "-"
    relation, lr = balance
    return f"{'' if relation == '=' else relation}{lr:.2f}"


def balance_lines(records: list[dict[str, Any]], variants: Collection[str]) -> list[str]:
    """A table: per setting, where the controller's signal balances in each tenth of the run."""
    lines = table_header("setting", *(f"{10 * share}-{10 * share + 10}%" for share in range(SHARE_BINS)))
    for record in records:
        balance = balance_by_share(signal_points(record, variants))
        if balance:
            lines.append(table_row(record["name"], *(balance_cell(balance[share]) if share in balance else ""
                                                     for share in range(SHARE_BINS))))
    return lines


def setting_section(record: dict[str, Any]) -> list[str]:
    sweep = sweep_table(record)
    best_mean = sweep[record["best_lr"]][0]
    lines = [f"### {record['name']}{' (holdout)' if record['holdout'] else ''}", "", setting_line(record)]
    if record.get("imported_from"):
        lines.append(f"Its sweep and runs so far come from `{record['imported_from']}`.")
    lines += ["", *headline(record, sweep), "", *all_methods(record, best_mean), ""]
    return lines + ([*picks(record), ""] if picks(record) else [])


SIGNAL_VARIANTS = ("tenth_rise_start2", "range_hold", "range_rise", "range_top_hold", "range_top_rise",
                   "library_range_hold")
"""The variants whose controller reads one signal (the log spread with alpha 0.5 over 4 replicas, scored on a probe
batch of quarter-interval averaged weights), wherever their LR starts and however it then moves: the balance
section pools their updates. ``tenth_rise_start2`` is the controller's own defaults (``auto_lr.range_test`` 0)."""


def write_matrix_report(stem: Path, matrix: dict[str, Any]) -> None:
    """``<stem>.md`` from the matrix record."""
    records = [record for record in matrix["settings"] if record.get("best_lr")]
    design = [record for record in records if not record["holdout"]]
    holdout = [record for record in records if record["holdout"]]
    variant = matrix["default_variant"]
    lines = [
        "# LR finding on a matrix of settings", "",
        f"The LR-finding benchmark (`lr_finding.md`) on the settings of `{matrix['settings_file']}`. Cells: the "
        "mean held-out loss over the seeds minus the sweep-best LR's mean (nats; lower is better). HDET columns: "
        f"the default variant `{variant}` started at that multiple of the sweep-best LR (it starts with the LR "
        "range test, whose ramp does not read the LR given; a run marked `copy_of_lr` in the JSON ran from one "
        "start and stands for another, where the first seed's runs from every start, on one machine, ended alike "
        "to the last bit). Baselines: the LR range test (100 steps of an exponential LR ramp, the LR of the "
        "steepest descent of the smoothed loss, then one "
        "run at it), the best LR of a sweep on the model at half the width reused on the full model, "
        "schedule-free AdamW (mean over the same starts) and Prodigy at LR 1.0. Targets: within "
        f"+{TARGET_NATS} at every start, within {TARGET_AT_ONE} of plain data parallel at 1x, and no start worse "
        "than the range test. Command: `python benchmarks/lr_finding_matrix.py`; every launch is in the JSON.", "",
        "## Design settings", "", *summary_rows(design, variant), "",
        "## Holdout settings", "",
        *(summary_rows(holdout, variant) if holdout else ["Not run yet: they run once, with the chosen default."]),
        "", "## Where the controller's signal balances", "",
        "The LR (over the sweep-best) at which the controller's Delta changes sign from raise to lower, by tenth "
        "of the run, from every update of the runs whose controller reads the same signal (the spread 0.67-1.5x, "
        f"scored on a probe batch: {', '.join(f'`{name}`' for name in SIGNAL_VARIANTS)}) at every start, "
        "interpolated between half-decade bins of the LR. `>x`: every bin said raise, up to x; `<x`: every bin "
        "said lower, down to x; -: no change from raise to lower; blank: no update (the controller updates "
        "only in its window, 2-25% of the run). A signal without lean would balance at 1.00 throughout.", "",
        *balance_lines(design + holdout, SIGNAL_VARIANTS),
        "", "## Findings", "", *note("findings"), "", "## Each setting", "",
    ]
    for record in design + holdout:
        lines += setting_section(record)
    lines += ["## Caveats", "", *note("caveats")]
    save_markdown(stem.with_suffix(".md"), lines)
