"""Two runs of the overhead benchmark side by side: the hot-path ratio and the sync against one flat all-reduce,
before and after a change, per engine (and ZeRO stage), in one table.

    python benchmarks/overhead_compare.py --before runs/overhead_before --after benchmarks/results \
        --out benchmarks/results/overhead_before_after

Both folders hold ``overhead_<engine>_cpu.json`` files written by ``overhead.py``; run the two back to back on
an idle machine (each run's ratios are against a baseline measured in the same run, so machine noise cancels
within a run, not between runs).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from common import note, read_json, save_markdown, table_header, table_row, write_json
from overhead_report import result_parts

ENGINES = ("ddp", "fsdp", "deepspeed")
SYNC = "hdet.sync bucket_mb=25"


def summary(part: dict[str, Any]) -> dict[str, float]:
    """A part's hot-path ratios (median over rounds of HDET's block median step / plain's, per T) and its sync
    and bucketed average against one flat all-reduce of the same bytes (median)."""
    ratios = {name: part["step_time"][name]["block_median_ratio"]["median"]
              for name in part["step_time"] if name != "plain"}
    ops = part["sync_time"]["ops"]
    return {**ratios, "sync_vs_flat": ops[SYNC]["ratio_vs_flat"]["median"],
            "average_vs_flat": ops["average_tensors bucket_mb=25"]["ratio_vs_flat"]["median"]}


def compare(before_dir: Path, after_dir: Path) -> dict[str, Any]:
    rows = {}
    for engine in ENGINES:
        runs = {which: read_json(folder / f"overhead_{engine}_cpu.json")
                for which, folder in (("before", before_dir), ("after", after_dir))}
        if None in runs.values():
            continue
        for which, data in runs.items():
            for name, part in result_parts(data):
                key = f"{engine} {name}".strip()
                rows.setdefault(key, {})[which] = summary(part)
                rows[key][f"{which}_note"] = data["settings"]["note"]
    return {"rows": rows}


def markdown(record: dict[str, Any]) -> list[str]:
    lines = ["# HDET's overhead before and after", "",
             "Hot path: HDET's step over plain training's (median over rounds of the blocks' median step times), at "
             "T = 10 / 100 / 1000. Sync: a whole `hdet.sync()` at 25 MiB buckets, and the bucketed average alone, "
             "over one flat all-reduce of the same bytes on the cross-replica group. From `overhead.py`'s JSON of "
             "two runs; each row's runs are named under it.", "",
             *table_header("engine", "hot path T10", "T100", "T1000", "sync / flat all-reduce",
                           "average / flat all-reduce")]
    for engine, row in record["rows"].items():
        for which in ("before", "after"):
            if which not in row:
                continue
            values = row[which]
            lines.append(table_row(f"{engine} {which}", *(f"{values[f'hdet_T{t}']:.3f}" for t in (10, 100, 1000)),
                                   f"{values['sync_vs_flat']:.2f}x", f"{values['average_vs_flat']:.2f}x"))
    notes = sorted({row[f"{which}_note"] for row in record["rows"].values() for which in ("before", "after")
                    if f"{which}_note" in row})
    return [*lines, "", "Runs: " + "; ".join(notes), "", "## What the numbers say", "", *note("findings")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="results stem (.json, .md)")
    args = parser.parse_args()
    record = compare(args.before, args.after)
    write_json(args.out.with_suffix(".json"), record)
    save_markdown(args.out.with_suffix(".md"), markdown(record))


if __name__ == "__main__":
    main()
