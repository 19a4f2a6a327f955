"""The quality benchmark's pure helpers against hand-computed values (no training runs here)."""

from __future__ import annotations

import math

import pytest
from benchmark_modules import load_benchmark

grid = load_benchmark("quality_rows")
runs = load_benchmark("quality_runs")
report = load_benchmark("quality_report")
common = load_benchmark("common")


# ------------------------------------------------------------------------------------------ divergence
def test_divergence_stable_run():
    result = runs.divergence(5.5, [4.0, 3.2, 3.0, 2.9], 2.8)
    assert result == {"diverged": False, "spike": 0.0, "unstable": False}


def test_divergence_spike_counts_from_the_best_so_far():
    # Best 2.5 at the third point, then 3.1: a climb of 0.6 >= 0.25 although it ends far below its start.
    result = runs.divergence(5.5, [4.0, 3.0, 2.5, 3.1, 2.9], 2.9)
    assert result["spike"] == pytest.approx(0.6)
    assert result["unstable"] and not result["diverged"]


def test_divergence_small_spike_is_noise():
    result = runs.divergence(5.5, [3.0, 2.7, 2.9, 2.6], 2.6)  # climb 0.2 < 0.25
    assert result["spike"] == pytest.approx(0.2)
    assert not result["unstable"]


def test_divergence_final_above_start_and_nonfinite():
    assert runs.divergence(5.5, [4.0], 5.6)["diverged"]
    assert runs.divergence(5.5, [4.0, math.nan], math.nan) == {"diverged": True, "spike": 0.0, "unstable": True}
    # A non-finite logged loss makes the run unstable even if the final model evaluates fine.
    assert runs.divergence(5.5, [4.0, math.inf, 3.0], 3.0)["unstable"]


# ---------------------------------------------------------------------------------------------- spread
def test_spread_of_three_seeds():
    result = report.spread([1.0, 2.0, 4.0])
    # mean 7/3; sample variance ((4/3)^2 + (1/3)^2 + (5/3)^2) / 2 = 42/18 = 7/3
    assert result["mean"] == pytest.approx(7 / 3)
    assert result["std"] == pytest.approx(math.sqrt(7 / 3))
    assert (result["min"], result["max"], result["n"], result["nonfinite"]) == (1.0, 4.0, 3, 0)


def test_spread_leaves_out_nonfinite_seeds_and_counts_them():
    result = report.spread([2.0, math.nan, 3.0, math.inf])
    assert result["mean"] == pytest.approx(2.5)
    assert result["std"] == pytest.approx(math.sqrt(0.5))
    assert (result["n"], result["nonfinite"]) == (2, 2)
    assert report.spread([5.0])["std"] == 0.0
    nothing = report.spread([math.nan])
    assert math.isnan(nothing["mean"]) and nothing["n"] == 0 and nothing["nonfinite"] == 1


# -------------------------------------------------------------------------------------------- LR grid
def sweep(losses: dict[float, float], unstable: set[float]) -> dict[float, dict]:
    return {lr: {"final_train_loss": loss, "unstable": lr in unstable} for lr, loss in losses.items()}


GRID = {1e-3: 2.4, 3e-3: 2.2, 9e-3: 2.1, 2.7e-2: 2.15, 8.1e-2: 2.6, 2.43e-1: 4.0}


def test_select_lrs_by_hand():
    # 8.1e-2 and 2.43e-1 unstable; the smallest unstable LR with a stable LR 9x below it is 8.1e-2 (9e-3 stable).
    lrs = grid.select_lrs(sweep(GRID, {8.1e-2, 2.43e-1}))
    assert lrs["high"] == 8.1e-2 and lrs["low"] == 9e-3
    assert lrs["best"] == 9e-3  # lowest stable loss 2.1
    assert lrs["too_low"] == 1e-3  # best / 9
    assert lrs["too_high"] == 2.7e-2  # the largest stable LR above the best


def test_select_lrs_skips_an_unstable_lr_without_a_stable_one_nine_times_below():
    # 3e-3 is unstable (a fluke) but 3e-3 / 9 is not in the grid; 2.7e-2 / 9 = 3e-3 is unstable too, so the
    # first qualifying high LR is 8.1e-2 (9e-3 stable).
    lrs = grid.select_lrs(sweep(GRID, {3e-3, 2.7e-2, 8.1e-2}))
    assert (lrs["high"], lrs["low"]) == (8.1e-2, 9e-3)
    assert lrs["best"] == 9e-3 and lrs["too_high"] == 2.43e-1 and lrs["too_low"] == 1e-3


def test_select_lrs_best_at_the_bottom_and_no_stable_lr_above_it():
    lrs = grid.select_lrs(sweep({1e-3: 2.0, 3e-3: 2.2, 9e-3: 3.0, 2.7e-2: 3.5}, {9e-3, 2.7e-2}))
    assert (lrs["high"], lrs["low"], lrs["best"]) == (9e-3, 1e-3, 1e-3)
    assert lrs["too_low"] == 1e-3  # 1e-3 / 9 is off the grid: the lowest grid LR
    assert lrs["too_high"] == 3e-3


def test_select_lrs_errors_name_the_fix():
    with pytest.raises(ValueError, match="upwards"):
        grid.select_lrs(sweep(GRID, set()))
    with pytest.raises(ValueError, match="downwards"):
        grid.select_lrs(sweep({1e-3: 9.0, 3e-3: 9.0}, {1e-3, 3e-3}))


# --------------------------------------------------------------------------------- controller direction
def sync(step: int, base: float, scale: float, delta: float, updated: bool = True) -> dict:
    return {"step": step, "controller_updated": updated,
            "values": {"lr/0": {"base": base, "scale": scale, "delta": delta}}}


def test_direction_scale_mode_reads_the_scale():
    syncs = [sync(10, 1.0, 1.0, 0.0, updated=False), sync(20, 1.0, 1.1, 0.1), sync(30, 1.0, 1.21, 0.1),
             sync(40, 1.0, 1.1, -0.1)]
    result = runs.controller_direction(syncs, {s: 1.0 for s in range(1, 41)}, "scale", 10)
    assert result["updates"] == 3 and result["ratio_end"] == pytest.approx(1.1)
    assert result["ratio_gmean"] == pytest.approx((1.1 * 1.21 * 1.1) ** (1 / 3))
    assert result["up_fraction"] == pytest.approx(2 / 3) and result["direction"] == "up"


def test_direction_paper_mode_against_its_own_decay():
    # Schedule: max 1.0, value 0.64 at the first update (step 20 of 40, T 10): 2 remaining syncs; floor 0.04
    # (floor_div 25), so the decay keeps sqrt(0.04 / 0.64) = 0.25 per sync: 0.16, then 0.04.
    schedule = {s: 1.0 if s < 20 else 0.64 for s in range(1, 41)}
    syncs = [sync(20, 0.08, 1.0, -0.01), sync(30, 0.04, 1.0, -0.01)]  # half the decay path, then on the floor
    result = runs.controller_direction(syncs, schedule, "paper", 10, floor_div=25.0)
    assert result["ratio_end"] == pytest.approx(1.0)  # both on the floor
    assert result["ratio_gmean"] == pytest.approx(math.sqrt(0.5 * 1.0))
    assert result["direction"] == "down" and result["up_fraction"] == 0.0


def test_direction_without_updates():
    result = runs.controller_direction([sync(10, 1.0, 1.0, 0.0, updated=False)], {10: 1.0})
    assert result["direction"] == "none" and math.isnan(result["ratio_end"])


def test_onecycle_schedule_matches_torch_at_the_peak():
    schedule = runs.onecycle_schedule(0.01, 100)
    assert max(schedule.values()) == pytest.approx(0.01)
    assert max(schedule, key=schedule.get) == 29  # OneCycle ends its ramp at pct_start * total - 1
    assert schedule[100] < 0.01 / 25  # annealed below the starting LR at the end


def test_rows_share_the_token_budget_and_cover_the_brief():
    rows = grid.build_rows(grid.Settings())
    names = {row.name for row in rows}
    assert {"baseline_low", "baseline_high", "hdet_no_autolr", "hdet_no_warm", "hdet_full", "hdet_local",
            "schedulefree", "prodigy"} <= names
    direction = [row for row in rows if row.group == "direction"]
    default_step = [row for row in direction if row.meta["lambda"] == 0.5]
    assert len(default_step) == 16  # 2 starts x 2 T x 2 modes x probe on/off
    assert {row.meta["mode"] for row in direction} == {"scale", "paper"}
    bold = [row for row in direction if row.meta["lambda"] == 2.0]  # 2 starts x 2 T, scale mode with the probe
    assert len(bold) == 4 and all(row.probe and row.hdet["auto_lr"]["step_size"] == 2.0 for row in bold)
    assert all(row.hdet["auto_lr"]["step_size"] == row.meta["lambda"] for row in direction)
    full = next(row for row in rows if row.name == "hdet_full")
    assert full.hdet["warm_init"]["enabled"] and full.hdet["auto_lr"]["enabled"] and full.lr == "high"
    assert not next(row for row in rows if row.name == "hdet_no_autolr").hdet["auto_lr"]["enabled"]
    assert next(row for row in rows if row.name == "hdet_local").hdet["gradient_mode"] == "local"


# ------------------------------------------------------------------------------------- hand-written notes
def test_a_rewrite_keeps_the_hand_written_notes(tmp_path):
    page = tmp_path / "quality_cpu.md"
    common.save_markdown(page, ["# Title", "", "Table 1", "", *common.note("caveats"), "", "end", ""])
    assert page.read_text() == "# Title\n\nTable 1\n\n<!-- note: caveats -->\n<!-- end note -->\n\nend\n"
    # Written by hand: into the block, and a block the writer no longer places.
    page.write_text(page.read_text().replace("<!-- note: caveats -->\n", "<!-- note: caveats -->\n- Shared machine.\n")
                    + "\n<!-- note: gone -->\nOld text.\n<!-- end note -->\n")
    common.save_markdown(page, ["# Title", "", "Table 2", "", *common.note("caveats"), "", "end"])
    assert page.read_text() == ("# Title\n\nTable 2\n\n<!-- note: caveats -->\n- Shared machine.\n<!-- end note -->"
                                "\n\nend\n\n<!-- note: gone -->\nOld text.\n<!-- end note -->\n")
    assert common.notes_in(page.read_text()) == {"caveats": "- Shared machine.\n", "gone": "Old text.\n"}
