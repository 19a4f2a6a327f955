"""Quality benchmark: the paper's Table 1 in miniature, its Figures 2-3, and which way the controller moves.

A tiny byte-level Llama (``hdet_scale.lm.model`` preset ``tiny``) on the embedded standard-library corpus,
4 CPU ranks on gloo = 4 replicas (the paper's layout: every rank a replica, global gradients), AdamW with
OneCycleLR, the same token budget for every run. Each run is ``benchmarks/quality_worker.py`` under torchrun;
the runs of one group and seed share one torchrun launch (importing transformers in 4 processes on 2 cores
costs about half a minute, more than a short run). Groups:

* ``sweep``: plain data parallel over the LR grid (``--grid``, factors of 3 so that 9x is two points up).
  It picks the rows' LRs (``select_lrs``): Baseline-High is the smallest grid LR at which plain DP is
  unstable (non-finite, ending above its starting loss, or a spike of ``SPIKE_NATS`` above its best so far),
  Baseline-Low is High / 9 (the paper's ratio), and must be stable. The direction study starts from the
  sweep's best LR / 9 ("too low") and the largest stable grid LR above the best ("too high").
* ``main``: Baseline-Low, Baseline-High, HDET without auto-LR, HDET without warm init, HDET full, HDET in
  local gradient mode (all HDET rows at the High LR, alpha 1/9 as in the paper), schedule-free AdamW (at the
  sweep's best LR: it gets a tuned LR) and Prodigy (LR 1.0, its default).
* ``hdet_sweep``: HDET full with alpha 0.25 and 0.5, short and long T, and the ``paper`` controller mode.
* ``direction``: HDET (alpha 0.5, no warm init) from the too-low and the too-high LR, short and long T, both
  controller modes, with and without a probe batch; reports where the controller took the base LR.

    .venv/bin/python benchmarks/quality.py --quick                      # smoke run, ~3 min, under runs/
    .venv/bin/python benchmarks/quality.py --groups sweep main --seeds 0
    .venv/bin/python benchmarks/quality.py --groups direction --seeds 0 1 --rows dir_low_T10_scale_noprobe

Results accumulate in ``benchmarks/results/quality_cpu.{json,md}`` (a run already there with the same
settings is not rerun unless ``--rerun``), plots under ``benchmarks/results/quality/``. The runs import
``hdet_scale`` as committed at HEAD (exported once), so edits to the working tree cannot leak into them.
``--report_only`` rewrites the results from the runs recorded; the hand-written notes of the ``.md`` are kept.

Code: this file runs the groups; ``quality_rows.py`` holds the settings, the rows and the LR choice,
``quality_runs.py`` launches the worker and reads a run back, ``quality_report.py`` writes the results.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import REPO, RESULTS, head_commit, machine_info, read_json, snapshot_source, utc_now, write_json
from quality_report import findings, make_plots, missing_runs, row_summary, write_markdown
from quality_rows import GROUPS, NPROC, QUICK, Row, Settings, build_rows, resolve_lr, select_lrs
from quality_runs import collect, launch, worker_args

RESULTS_STEM = RESULTS / "quality_cpu"
PLOTS_DIR = RESULTS / "quality"


def record_result(s: Settings, rows: list[Row], records: list[dict[str, Any]], invocations: list[dict[str, Any]],
                  commit: str, plots: Path) -> dict[str, Any]:
    """The JSON record of every run so far: the machine, the settings, the commands, the LRs the sweep chose,
    the per-row summaries and findings, the figures (drawn under ``plots``) and the runs."""
    by_row: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        mine = sorted((r for r in records if r["row"] == row.name), key=lambda r: r["seed"])
        if mine:
            by_row[row.name] = mine
    summary = {name: {**row_summary(mine), "group": mine[0]["group"]} for name, mine in by_row.items()}
    sweep = {r["lr"]: r for r in records if r["group"] == "sweep" and r["seed"] == 0}
    result: dict[str, Any] = {"machine": machine_info(backend="gloo (CPU)", ranks=NPROC,
                                                      packages=("torch", "transformers"), git_commit=commit),
                              "settings": s.key(), "invocations": invocations, "lrs": None}
    try:
        result["lrs"] = select_lrs(sweep) if sweep else None
    except ValueError as error:
        result["lrs_error"] = str(error)
    result["summary"] = summary
    result["findings"] = findings(summary, result["lrs"], records)
    result["figures"] = make_plots(records, plots, s.steps) if records else []
    result["runs"] = records
    return result


def write_results(stem: Path, result: dict[str, Any], missing: list[str]) -> None:
    """Writes the record to ``stem.json`` and its page to ``stem.md``."""
    write_json(stem.with_suffix(".json"), result)
    write_markdown(stem.with_suffix(".md"), result, missing)
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.md')}", flush=True)


def sweep_lrs(records: list[dict[str, Any]], quick: bool) -> dict[str, float]:
    """The LRs the rows take from the recorded sweep; a quick run, too short for a real instability, takes the
    grid's ends."""
    sweep = {r["lr"]: r for r in records if r["group"] == "sweep" and r["seed"] == 0}
    try:
        return select_lrs(sweep)
    except ValueError as error:
        if not quick:
            raise SystemExit(f"cannot choose the LRs: {error}") from None
        grid = sorted(sweep)
        return {"low": grid[0], "high": grid[-1], "best": grid[0], "too_low": grid[0], "too_high": grid[-1]}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", nargs="+", choices=GROUPS, default=list(GROUPS))
    parser.add_argument("--rows", nargs="+", default=None, help="only these row names (see --list)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds (the sweep always runs seed 0)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 40 steps, results under runs/")
    parser.add_argument("--rerun", action="store_true", help="rerun runs that already have results")
    parser.add_argument("--report_only", action="store_true", help="rewrite the results and plots, run nothing")
    parser.add_argument("--list", action="store_true", help="print the row names and exit")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the asked-for groups, rows and seeds, then rewrites the results and plots."""
    args = parse_args(argv)
    s = QUICK if args.quick else Settings()
    rows = build_rows(s)
    if args.list:
        for row in rows:
            print(f"{row.group:10s} {row.name}")
        return 0
    runs_dir = REPO / "runs" / ("quality_quick" if args.quick else "quality")
    stem = runs_dir / "quality_cpu" if args.quick else RESULTS_STEM
    plots = runs_dir / "plots" if args.quick else PLOTS_DIR
    runs_dir.mkdir(parents=True, exist_ok=True)
    data = read_json(stem.with_suffix(".json"), {})
    if data and data.get("settings") != json.loads(json.dumps(s.key())):
        raise SystemExit(f"{stem.with_suffix('.json')} holds runs with other settings; move it away to start over")
    records: list[dict[str, Any]] = data.get("runs", [])
    invocations = data.get("invocations", [])
    commit = head_commit()
    source = snapshot_source(commit, runs_dir)
    invocation = {"date": utc_now(), "commit": commit,
                  "command": shlex.join([".venv/bin/python", "benchmarks/quality.py", *(argv or sys.argv[1:])])}

    def save() -> None:
        write_results(stem, record_result(s, rows, records, invocations, commit, plots), missing_runs(rows, records))

    if args.report_only:
        by_name = {row.name: row for row in rows}
        for index, r in enumerate(records):  # recompute from the run's files where this machine still has them
            if (REPO / r["run_dir"] / "result.json").is_file() and r["row"] in by_name:
                records[index] = collect(by_name[r["row"]], r["seed"], s, r["lr"], REPO / r["run_dir"], r["command"])
        save()
        return 0
    invocations.append(invocation)
    done = {(r["row"], r["seed"]) for r in records}
    for group in [g for g in GROUPS if g in args.groups]:
        mine = [row for row in rows if row.group == group and (args.rows is None or row.name in args.rows)]
        for seed in [0] if group == "sweep" else args.seeds:
            lrs = None if group == "sweep" else sweep_lrs(records, args.quick)
            batch = []
            for row in mine:
                if (row.name, seed) in done and not args.rerun:
                    continue
                lr = resolve_lr(row, lrs)
                run_dir = runs_dir / f"{row.name}_s{seed}"
                batch.append((row, seed, lr, run_dir, worker_args(row, seed, s, lr, run_dir)))
            if batch:
                done.update(run_batch(group, batch, s, source, runs_dir, records))
                save()
    return 0


def run_batch(group: str, batch: list[tuple[Row, int, float, Path, list[str]]], s: Settings, source: Path,
              runs_dir: Path, records: list[dict[str, Any]]) -> set[tuple[str, int]]:
    """Runs ``batch`` in one torchrun launch and puts each run's record into ``records`` (replacing an older
    record of the same row and seed); returns the (row, seed) of the runs that left a result."""
    print(f"{group} seed {batch[0][1]}: {len(batch)} runs ({', '.join(b[0].name for b in batch)})", flush=True)
    started = time.perf_counter()
    command = launch(batch, source, runs_dir)
    recorded = set()
    for row, seed, lr, run_dir, _ in batch:
        if not (run_dir / "result.json").is_file():
            print(f"warning: {row.name} seed {seed} left no result", file=sys.stderr)
            continue
        records[:] = [r for r in records if (r["row"], r["seed"]) != (row.name, seed)]
        records.append(collect(row, seed, s, lr, run_dir, command))
        recorded.add((row.name, seed))
    print(f"  {time.perf_counter() - started:.0f} s", flush=True)
    return recorded


if __name__ == "__main__":
    sys.exit(main())
