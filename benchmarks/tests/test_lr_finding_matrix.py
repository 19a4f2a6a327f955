"""The LR-finding matrix (benchmarks/lr_finding_matrix.py), its report and the LR range test, against values
worked out by hand."""

from __future__ import annotations

import math

import pytest
from benchmark_modules import load_benchmark

from hdet_scale import range_test

matrix = load_benchmark("lr_finding_matrix")
report = load_benchmark("lr_finding_matrix_report")
lr_finding = load_benchmark("lr_finding")


# ------------------------------------------------------------------------------------------ range test
def test_a_range_test_records_its_lrs_stops_where_the_loss_diverges_and_picks():
    test = range_test.RangeTest(20)
    assert test.lr(0) == 1e-6 and test.lr(19) == pytest.approx(1.0)
    losses = [5.0] * 12 + [4.0, 3.0, 2.0, 1.9] + [1000.0]
    over = [test.add(loss) for loss in losses]
    assert over[:-1] == [False] * 16 and over[-1]  # the smoothed loss passed 4x its best at the 17th step
    assert test.lrs == [test.lr(step) for step in range(17)]
    assert test.pick() == range_test.steepest_descent(test.lrs, test.smoothed)
    with pytest.raises(ValueError, match="at least 13 steps"):
        range_test.RangeTest(12)


def test_the_ramp_goes_from_its_first_lr_to_its_last_in_equal_ratios():
    lrs = [range_test.ramp_lr(step, steps=5, lr_min=1e-4, lr_max=1.0) for step in range(5)]
    assert lrs == pytest.approx([1e-4, 1e-3, 1e-2, 1e-1, 1.0])


def test_the_smoothed_loss_is_a_debiased_moving_average_and_stops_at_four_times_its_best():
    smoother = range_test.SmoothedLoss(beta=0.5)
    # 0.5 * 4 / (1 - 0.5) = 4; (0.5 * 2 + 0.5 * 2) / (1 - 0.25) = 8/3; (0.5 * 2 + 0.5 * 20) / (1 - 0.125) = 12.57
    assert smoother.add(4.0) == pytest.approx(4.0)
    assert smoother.add(2.0) == pytest.approx(2.0 / 0.75)
    assert not smoother.diverged(2.0 / 0.75)
    high = smoother.add(20.0)
    assert high == pytest.approx(11.0 / 0.875) and smoother.best == pytest.approx(2.0 / 0.75)
    assert smoother.diverged(high)  # 12.57 > 4 x 2.67
    assert smoother.diverged(math.nan)


def test_the_pick_is_the_steepest_descent_after_the_first_ten_points_and_before_the_last():
    lrs = [10.0 ** (k / 4) for k in range(20)]
    # a steep drop among the first 10 points, which the pick leaves out, then flat; then a descent that is steepest
    # between points 13 and 14, then flat, then a jump at the end that the pick leaves out too
    smoothed = [9.0, 5.0] + [5.0] * 8 + [5.0, 4.9, 4.7, 4.0, 3.9, 3.85, 3.85, 3.85, 3.85, 0.0]
    # central slopes from point 10: 4.9-5.0 (one-sided) -0.1, (4.7-5.0)/2 -0.15, (4.0-4.9)/2 -0.45,
    # (3.9-4.7)/2 -0.4, ...: the most negative at point 12 (4.7)
    assert range_test.steepest_descent(lrs, smoothed) == lrs[12]
    assert range_test.steepest_descent(lrs[:11], smoothed[:11]) is None  # one point is left: no slope


# ---------------------------------------------------------------------------------------------- matrix
PLAN = {"common": {"nproc": 4, "grid_side": 2},
        "settings": [{"name": "a", "holdout": False, "args": {"steps": 100, "seeds": [0, 1]}},
                     {"name": "b", "holdout": False, "args": {"steps": 100, "seeds": [2]}},
                     {"name": "h", "holdout": True, "args": {"steps": 100, "seeds": [9]}}]}


def test_design_settings_run_unless_holdout_is_asked_for_and_unknown_names_are_refused():
    assert [entry["name"] for entry in matrix.selected(PLAN, matrix.parse_args([]))] == ["a", "b"]
    assert [entry["name"] for entry in matrix.selected(PLAN, matrix.parse_args(["--holdout"]))] == ["h"]
    assert [entry["name"] for entry in matrix.selected(PLAN, matrix.parse_args(["--only", "b", "h"]))] == ["b", "h"]
    with pytest.raises(SystemExit, match="no setting named c"):
        matrix.selected(PLAN, matrix.parse_args(["--only", "c"]))
    with pytest.raises(SystemExit):  # a holdout runs the default variant only
        matrix.parse_args(["--holdout", "--variants", "paper"])
    # ... from the usual starts, which may be split over invocations, and from no other
    assert matrix.parse_args(["--holdout", "--start_factors", "1", "10"]).start_factors == [1.0, 10.0]
    with pytest.raises(SystemExit):
        matrix.parse_args(["--holdout", "--start_factors", "2"])


def test_a_setting_becomes_lr_findings_arguments():
    args = matrix.setting_args(PLAN, PLAN["settings"][0], matrix.parse_args([]), ["sweep"])
    assert (args.steps, args.seeds, args.nproc, args.grid_side, args.methods) == (100, [0, 1], 4, 2, ["sweep"])
    assert args.runs_dir.name == "a"


def test_a_holdout_is_judged_by_the_default_it_first_ran_with():
    default = {"method": "hdet", "variant": lr_finding.DEFAULT_VARIANT}
    earlier = {"name": "h", "holdout": True, "runs": [{"method": "hdet", "variant": "paper"}]}
    with pytest.raises(SystemExit, match="already ran HDET variant paper"):
        matrix.check_holdout(earlier, seen=False)
    matrix.check_holdout({"name": "h", "holdout": True, "runs": [default]}, seen=False)
    matrix.check_holdout({"name": "h", "holdout": True, "runs": []}, seen=False)
    # the current default runs on a holdout an earlier default judged only when asked for, and only there
    matrix.check_holdout(earlier, seen=True)
    matrix.check_holdout({"name": "h", "holdout": True, "runs": [*earlier["runs"], default]}, seen=True)
    for unjudged in ([], [default]):
        with pytest.raises(SystemExit, match="was not judged by an earlier default"):
            matrix.check_holdout({"name": "h", "holdout": True, "runs": unjudged}, seen=True)
    with pytest.raises(SystemExit):
        matrix.parse_args(["--seen_holdout"])
    assert matrix.parse_args(["--holdout", "--seen_holdout"]).seen_holdout


def test_a_changed_setting_is_refused_and_an_imported_one_keeps_only_its_seeds_and_variants(tmp_path, monkeypatch):
    run_args = matrix.setting_args(PLAN, PLAN["settings"][0], matrix.parse_args([]), ["sweep"])
    old = {"name": "a", "setting": {**lr_finding.setting(run_args), "steps": 50}}
    with pytest.raises(SystemExit, match="no longer the one its recorded runs ran"):
        matrix.record_of({"settings": [old]}, PLAN["settings"][0], run_args)
    source = {"setting": lr_finding.setting(run_args),
              "sweep_runs": [{"lr": 1e-3, "seed": seed, "heldout": 1.0} for seed in (0, 1, 5)],
              "runs": [{"method": "hdet", "variant": variant, "seed": 0} for variant in (lr_finding.DEFAULT_VARIANT,
                                                                                       "paper")]
              + [{"method": "prodigy", "variant": "prodigy", "seed": 1}]}
    path = tmp_path / "old.json"
    path.write_text(__import__("json").dumps(source))
    monkeypatch.setattr(matrix, "REPO", tmp_path)
    record = matrix.record_of({"settings": []}, {**PLAN["settings"][0], "import_from": "old.json"}, run_args)
    assert [run["seed"] for run in record["sweep_runs"]] == [0, 1]
    assert [run["variant"] for run in record["runs"]] == [lr_finding.DEFAULT_VARIANT, "prodigy"]


# ---------------------------------------------------------------------------------------------- report
BEST = 1e-3


def record(runs: list[dict]) -> dict:
    # sweep: 1e-3 -> 1.0 (the best), 3.16e-3 -> 1.1
    sweep = [{"lr": lr, "seed": seed, "heldout": value} for lr, value in ((BEST, 1.0), (BEST * 10 ** 0.5, 1.1))
             for seed in (0, 1)]
    return {"name": "s", "holdout": False, "best_lr": BEST, "sweep": sweep, "runs": runs,
            "setting": {"steps": 100}, "default_variant": "d"}


def hdet(factor: float, seed: int, heldout: float) -> dict:
    return {"method": "hdet", "variant": "d", "start_factor": factor, "seed": seed, "heldout": heldout,
            "lr": BEST * factor}


def test_the_summary_row_gives_each_starts_excess_their_mean_and_the_baselines():
    runs = [hdet(factor, seed, 1.0 + 0.01 * index) for index, factor in enumerate(report.START_FACTORS)
            for seed in (0, 1)]
    runs += [{"method": "range_test", "variant": "range_test", "start_factor": None, "seed": seed, "heldout": value}
             for seed, value in ((0, 1.02), (1, 1.04))]
    row = report.summary_rows([record(runs)], "d")[-1]
    # excess +0.00 .. +0.04 (mean +0.02); the range test's mean 1.03: +0.03; no proxy, schedule-free or Prodigy;
    # 3.16x meets +0.03 exactly, 10x (+0.04) misses it and is worse than the range test; at 1x +0.02 is more than
    # 0.01 over plain DP at the best LR
    assert row == ("| s | +0.000 | +0.010 | +0.020 | +0.030 | +0.040 | +0.020 | +0.030 | - | - | - | "
                   "no: 10x, plain DP at 1x, range test |")


def test_targets_need_every_start_and_name_what_missed():
    runs = [hdet(factor, 0, 1.0) for factor in report.START_FACTORS[:-1]]
    assert report.summary_rows([record(runs)], "d")[-1].endswith(" | - |")  # 10x has not run
    runs.append(hdet(10.0, 0, 1.05))
    runs[2]["heldout"] = 1.02  # factor 1: +0.02 over plain DP at the best LR
    assert report.summary_rows([record(runs)], "d")[-1].endswith(" | no: 10x, plain DP at 1x |")


def test_a_holdout_that_judged_an_earlier_default_shows_that_default_by_name():
    runs = [{**hdet(factor, 0, 1.01), "variant": "old"} for factor in report.START_FACTORS]
    held = {**record(runs), "holdout": True}
    assert report.summary_rows([held], "d")[2:] == [
        "| s (the earlier default `old`) | +0.010 | +0.010 | +0.010 | +0.010 | +0.010 | +0.010 | - | - | - | - | yes |"]
    # a design setting shows the default (here: not run)
    assert report.summary_rows([record(runs)], "d")[-1].startswith("| s | - | - | - |")
    # the default run there after its choice gets a row of its own; the earlier default still judges the holdout
    held["runs"] += [hdet(1.0, 0, 1.02)]
    rows = report.summary_rows([held], "d")[2:]
    assert rows[0].startswith("| s (the earlier default `old`) | +0.010 |")
    assert rows[1].startswith("| s (the default, run after its choice: seen, not held out) | - | - | +0.020 | - |")
    # a holdout the default judged shows it plainly
    assert report.summary_rows([{**record([hdet(1.0, 0, 1.02)]), "holdout": True}], "d")[-1].startswith(
        "| s | - | - | +0.020 |")


def test_where_the_signal_balances_by_share_of_the_run():
    # 100 steps; updates at steps 5 and 55 (tenths 0 and 5); the scale before each is the previous sync's
    run = {**hdet(1.0, 0, 1.0), "scales": [[0, 1.0], [5, 2.0], [50, 1.0], [55, 1.0]],
           "deltas": [[5, 0.2], [55, -0.1]]}
    copy = {**run, "lr": run["lr"] * 10, "copy_of_lr": run["lr"]}  # the same run, recorded for another start
    other = {**run, "variant": "e", "deltas": [[5, 0.4]]}  # another variant reading the same signal
    points = report.signal_points(record([run, copy, other]), ("d", "e"))
    assert [tuple(round(value, 9) for value in point) for point in points] == [
        (0.05, 0.0, 0.2), (0.55, 0.0, -0.1), (0.05, 0.0, 0.4)]
    assert len(report.signal_points(record([run, copy, other]), ("d",))) == 2
    # the table: tenth 0 raised at 1x, tenth 5 lowered at 1x, the tenths without an update blank
    assert report.balance_lines([record([run])], ("d",))[-1] == "| s | >1.00 |  |  |  |  | <1.00 |  |  |  |  |"
    # tenth 2: +0.3 at 1x (log 0), -0.1 at 10^0.5: the sign changes 3/4 of the way, at 10^(0.375); tenth 7 says
    # lower at 1x and 10^0.5 (below 1x); tenth 4 says raise at 10^-0.5 and 1x (above 1x); tenth 5 lowers below
    # and raises above, which is no balance
    many = [(0.25, 0.0, 0.3), (0.22, 0.5, -0.1), (0.7, 0.0, -0.2), (0.71, 0.5, -0.3), (0.4, -0.5, 0.1),
            (0.4, 0.0, 0.2), (0.5, 0.0, -0.1), (0.5, 0.5, 0.1)]
    balance = report.balance_by_share(many)
    assert balance[2][0] == "=" and balance[2][1] == pytest.approx(10 ** 0.375)
    assert balance[7] == ("<", 1.0) and balance[4] == (">", 1.0) and balance[5] is None
    assert [report.balance_cell(balance[share]) for share in (2, 4, 5, 7)] == ["2.37", ">1.00", "-", "<1.00"]


def test_every_variant_the_matrix_runs_is_defined():
    assert lr_finding.DEFAULT_VARIANT in lr_finding.VARIANTS
    assert {"range_hold", "range_rise"} <= set(lr_finding.VARIANTS)


def test_each_holdout_setting_has_seeds_no_other_setting_uses():
    files = (matrix.SETTINGS, matrix.BENCHMARKS / "lr_finding_matrix_holdout2.json")
    plans = [matrix.read_json(path) for path in files]
    entries = [entry for plan in plans for entry in plan["settings"]]
    assert len(entries) == 8
    for entry in entries:
        others = {seed for other in entries if other is not entry for seed in other["args"]["seeds"]}
        if entry["holdout"]:
            assert others.isdisjoint(entry["args"]["seeds"]), entry["name"]
    assert all(entry["holdout"] for entry in plans[1]["settings"])  # the second holdout holds no design setting
