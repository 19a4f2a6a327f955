"""The weight-decay demonstration's report (benchmarks/weight_decay_report.py) against values worked out by hand."""

from __future__ import annotations

import pytest
from benchmark_modules import load_benchmark

report = load_benchmark("weight_decay_report")


def record(weight_decay: float | None, sweep: dict[float, list[float]], best_lr: float,
           runs: list[dict]) -> dict:
    setting = {"steps": 100} | ({"weight_decay": weight_decay} if weight_decay is not None else {})
    return {"setting": setting, "best_lr": best_lr, "sweep_runs": [{}],
            "sweep": [{"lr": lr, "seed": seed, "heldout": value} for lr, values in sweep.items()
                      for seed, value in enumerate(values)],
            "runs": runs}


def run(method: str, variant: str, seed: int, heldout: float | None, **extra) -> dict:
    start = 1.0 if method == "hdet" else None
    return {"method": method, "variant": variant, "seed": seed, "heldout": heldout, "start_factor": start, **extra}


def test_each_method_is_measured_against_the_best_plain_run_over_every_weight_decay(tmp_path):
    usual = record(None, {1e-3: [1.30, 1.32], 3e-3: [1.15, 1.17], 1e-2: [1.20, 1.22]}, 3e-3,
                   [run("range_test", "range_test", 0, 1.18), run("range_test", "range_test", 1, 1.20)])
    wrong = record(1.0, {3e-3: [1.34, 1.36]}, 3e-3, [
        run("range_test", "range_test", 0, 1.30), run("range_test", "range_test", 1, 1.32),
        run("hdet", "default", 0, 1.28), run("hdet", "default", 1, 1.30),
        run("hdet", "default_weight_decay", 0, 1.17, other_scales={"weight_decay/0": [[25, 1.0], [50, 0.1]]}),
        run("hdet", "default_weight_decay", 1, 1.19, other_scales={"weight_decay/0": [[25, 0.5], [50, 0.25]]})])
    table, anchor = report.summary([wrong, usual])
    # the anchor is the best plain mean over both settings: the usual weight decay's (1.15 + 1.17) / 2
    assert anchor == pytest.approx(1.16)
    rows = [line.split(" | ") for line in table[2:]]
    assert [row[0].strip("| ") for row in rows] == ["0.01", "1"]  # the worker's weight decay named, sorted
    usual_row, wrong_row = rows
    assert usual_row[1].startswith("+0.000") and usual_row[2].startswith("+0.030") and usual_row[3] == "-"
    # weight decay 1: plain 1.35, range test 1.31, HDET 1.29, exploring 1.18, over 1.16; sd of two values 0.0141
    assert [cell.split(" ± ")[0] for cell in wrong_row[1:5]] == ["+0.190", "+0.150", "+0.130", "+0.020"]
    assert wrong_row[4].endswith("± 0.014")
    # the weight decay each exploring run ended on: 1.0 x its last scale
    assert wrong_row[5].strip("| ") == "0.1, 0.25"
    report.write_weight_decay_report(tmp_path / "out", {"settings": [wrong, usual], "settings_file": "x.json"})
    page = (tmp_path / "out.md").read_text()
    assert "Anchor: 1.1600" in page and "| 1 | `default_weight_decay` | 1 | - | +0.030 |" in page


def test_hdet_started_elsewhere_is_left_out_a_diverged_method_says_so_and_the_worker_decay_is_the_workers(tmp_path):
    usual = record(None, {3e-3: [1.15, 1.17]}, 3e-3, [
        run("hdet", "default", 0, 1.20), {**run("hdet", "default", 1, 9.0), "start_factor": 10.0},
        run("range_test", "range_test", 0, None)])
    table, anchor = report.summary([usual])
    row = table[-1].split(" | ")
    assert row[0] == "| 0.01" and row[2] == "diverged" and row[3] == "+0.040 ± 0.000"  # 10x left out
    assert report.WORKER_WEIGHT_DECAY == load_benchmark("lr_finding_worker").parse_args(
        ["--out", "x", "--lr", "1e-3"]).weight_decay
