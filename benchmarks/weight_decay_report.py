"""The weight-decay demonstration's results (``lr_finding_matrix.py --settings weight_decay_finding.json``): what
each method ends at when AdamW's weight decay is given wrong, against the best plain run over the weight decays
and LRs run.

Each setting of the file is the LR-finding benchmark's setting at one weight decay. The anchor is the lowest mean
held-out loss of a plain run over every setting's sweep (the LR sweep at the benchmark's usual weight decay, one
plain run per seed at that sweep's best LR for the others). What the numbers mean is written by hand into the
Markdown's note blocks, which a rewrite keeps.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from common import note, save_markdown, table_header, table_row
from lr_finding_report import _fmt, mean_sd, sweep_table

WORKER_WEIGHT_DECAY = 0.01
"""The worker's weight decay, which a setting recorded without ``weight_decay`` ran with."""
COLUMNS = (("range_test", "range_test"), ("hdet", "default"), ("hdet", "default_weight_decay"))
"""The methods compared at each given weight decay: the LR range test and one run, HDET's defaults (the LR found
in the run), the same exploring the weight decay."""


def weight_decay_of(record: dict[str, Any]) -> float:
    return record["setting"].get("weight_decay", WORKER_WEIGHT_DECAY)


def plain_at_best(record: dict[str, Any]) -> tuple[float, float, int]:
    """Mean, sd and count of the held-out loss of the plain runs at the setting's sweep-best LR."""
    return sweep_table(record)[record["best_lr"]]


def runs_of(record: dict[str, Any], method: str, variant: str) -> list[dict[str, Any]]:
    """The runs of ``method`` and ``variant``; HDET's only where started at the setting's best LR."""
    return [run for run in record["runs"] if run["method"] == method and run["variant"] == variant
            and (run.get("start_factor") is None or math.isclose(run["start_factor"], 1.0))]


def final_weight_decay(record: dict[str, Any], run: dict[str, Any]) -> float | None:
    """The weight decay the controller left the run's base at (the given one times its last scale)."""
    path = (run.get("other_scales") or {}).get("weight_decay/0")
    return weight_decay_of(record) * path[-1][1] if path else None


def summary(records: list[dict[str, Any]]) -> tuple[list[str], float]:
    """One row per given weight decay: plain at the best LR, then each of ``COLUMNS`` (mean excess over the anchor,
    with the seeds' sd), and the weight decay the exploring runs ended on; and the anchor."""
    anchor = min(plain_at_best(record)[0] for record in records)
    lines = table_header("given weight decay", "plain at the best LR", "LR range test, then one run",
                         "HDET's defaults", "HDET's defaults exploring weight decay",
                         "weight decay it ended on (seeds)")
    for record in sorted(records, key=weight_decay_of):
        cells = [plain_at_best(record)]
        cells += [mean_sd(run["heldout"] for run in runs_of(record, *column)) for column in COLUMNS]
        ended = [final_weight_decay(record, run) for run in runs_of(record, "hdet", "default_weight_decay")]
        lines.append(table_row(f"{weight_decay_of(record):g}",
                               *(_cell(mean - anchor, sd, count) for mean, sd, count in cells),
                               ", ".join(f"{value:.3g}" for value in ended if value is not None) or "-"))
    return lines, anchor


def _cell(excess: float, sd: float, count: int) -> str:
    if not count:
        return "-"
    return f"{_fmt(excess, signed=True)} ± {sd:.3f}" if math.isfinite(excess) else _fmt(excess)


def per_seed(records: list[dict[str, Any]], anchor: float) -> list[str]:
    """Every run's held-out loss over the anchor, by given weight decay, method and seed."""
    lines = table_header("given weight decay", "method", "seed", "LR over the sweep-best", "held-out - anchor")
    for record in sorted(records, key=weight_decay_of):
        shown = [run for column in COLUMNS for run in runs_of(record, *column)]
        for run in sorted(shown, key=lambda run: (run["method"], run["variant"], run["seed"])):
            ratio = run.get("final_lr_ratio")
            lines.append(table_row(f"{weight_decay_of(record):g}", f"`{run['variant']}`", run["seed"],
                                   "-" if ratio is None else f"{ratio:.2f}",
                                   _fmt(run["heldout"] - anchor if run["heldout"] is not None else math.inf,
                                        signed=True)))
    return lines


def write_weight_decay_report(stem: Path, matrix: dict[str, Any]) -> None:
    """Writes ``<stem>.md`` from the matrix-format record ``matrix``."""
    records = [record for record in matrix["settings"] if record.get("sweep_runs")]
    lines = ["# Finding the weight decay: what an LR range test cannot", "",
             "The LR-finding benchmark's setting (`lr_finding.md`) with AdamW's weight decay given at several values. "
             "Cells: mean held-out loss over the seeds minus the anchor, the best plain run's mean over every weight "
             "decay and LR run (nats; lower is better), ± the seeds' sd. Methods: plain data parallel at the "
             "benchmark's sweep-best LR; the LR range test, then one plain run at its pick; HDET with the library's "
             "defaults (its own range test, then every replica at 0.7 times the pick), and the same exploring the "
             f"weight decay (`explore.weight_decay`). Settings: `{matrix.get('settings_file', '')}`; every launch is "
             "in the JSON.", ""]
    if records:
        table, anchor = summary(records)
        seeds = sorted({run["seed"] for record in records for run in record["sweep"]})
        lines += [f"Anchor: {anchor:.4f} (seeds {', '.join(map(str, seeds))}).", "", *table, "",
                  "Each run:", "", *per_seed(records, anchor)]
    lines += ["", "## Findings", "", *note("findings")]
    save_markdown(stem.with_suffix(".md"), lines)
