"""The overhead benchmark's overhead estimates from measured components, against values worked out by hand."""

from __future__ import annotations

import dataclasses
import json

import pytest
from benchmark_modules import BENCHMARKS, load_benchmark

from hdet_scale.config import AutoLRConfig

timing = load_benchmark("overhead_timing")
engines = load_benchmark("overhead_engines")


def _median(seconds: float) -> dict[str, float]:
    return {"median": seconds}


STEPS = {
    "plain": {"step_s": _median(0.010)},
    "hdet_T10": {"hdet_step_call_s": _median(50e-6), "sync_seconds_report": _median(0.040)},
    "hdet_T10_probe": {"hdet_step_call_s": _median(50e-6), "sync_seconds_report": _median(0.050)},
    "hdet_T10_averaged": {"hdet_step_call_s": _median(650e-6), "sync_seconds_report": _median(0.055)},
    "hdet_T10_default": {"hdet_step_call_s": _median(300e-6), "sync_seconds_report": _median(0.054)},
}
SYNC = {"ops": {"hdet.sync bucket_mb=25": {"seconds": _median(0.030)},
                "average_tensors bucket_mb=25": {"seconds": _median(0.002)}}}
HOOKS = {"hook_s": 20e-6}


def test_each_signal_is_estimated_from_its_own_hot_path_and_syncs():
    costs = timing.signal_costs(STEPS, SYNC, HOOKS, 10, gradient_average=False)
    assert list(costs) == ["hdet_T10", "hdet_T10_probe", "hdet_T10_averaged", "hdet_T10_default"]
    # (hot path 650 us + hooks 20 us + sync 55 ms / 10) / plain 10 ms
    assert costs["hdet_T10_averaged"]["estimate"] == pytest.approx((650 + 20 + 5500) / 10_000)
    assert costs["hdet_T10"]["estimate"] == pytest.approx((50 + 20 + 4000) / 10_000)
    assert costs["hdet_T10_default"]["estimate"] == pytest.approx((300 + 20 + 5400) / 10_000)
    assert (costs["hdet_T10_probe"]["hot_path_s"], costs["hdet_T10_probe"]["sync_s"]) == (50e-6, 0.050)


def test_the_gradient_all_reduce_counts_on_every_step_where_hdet_runs_it():
    costs = timing.signal_costs(STEPS, SYNC, HOOKS, 10, gradient_average=True)
    assert costs["hdet_T10_averaged"]["estimate"] == pytest.approx((650 + 20 + 2000 + 5500) / 10_000)
    # the intervals' estimates use section 2's sync time instead: (50 + 20 + 2000 + 30000 / 10) / 10000
    steps = {**STEPS, "hdet_T100": {"hdet_step_call_s": _median(50e-6)}}
    estimates = timing.estimates(steps, SYNC, HOOKS, (10, 100), gradient_average=True)
    assert estimates == pytest.approx({"hdet_T10": (50 + 20 + 2000 + 3000) / 10_000,
                                       "hdet_T100": (50 + 20 + 2000 + 300) / 10_000})


def test_the_default_signal_is_the_librarys_controller_moving_at_every_sync():
    """The ``default`` row measures what a user's run pays while the controller moves: the library's controller
    settings without the range test (not the benchmark's pinned older ones), with the probe scoring the last
    quarter's average."""
    settings = load_benchmark("overhead").parse_args(["--engine", "ddp", "--backend", "gloo"])
    ran = engines.hdet_config(settings, 10, auto_lr=engines.SIGNALS["default"]).auto_lr
    assert (ran.start, ran.stop) == (0, 10**9)
    assert ran.filled() == dataclasses.replace(AutoLRConfig(range_test=0).filled(), start=0, stop=10**9)
    assert ran.window(probing=True) == 0.25


@pytest.mark.parametrize("engine", ["ddp", "fsdp", "deepspeed"])
def test_the_report_renders_every_committed_table_as_committed(tmp_path, engine):
    """Every table line of the committed results page comes back from its JSON: FSDP2's holds the
    ``displacement`` and ``progress`` signals, since removed from the library and from ``SIGNALS``; DeepSpeed's
    holds the same-layout baseline and the engine refresh."""
    rendered = render_committed(tmp_path, engine)
    committed = (BENCHMARKS / "results" / f"overhead_{engine}_cpu.md").read_text()
    tables = [[line for line in text.splitlines() if line.startswith("|")] for text in (rendered, committed)]
    assert tables[0] == tables[1]


@pytest.mark.parametrize("engine", ["fsdp"])
def test_the_report_says_what_the_removed_signals_were(tmp_path, engine):
    assert set(engines.SIGNALS) == {"probe", "averaged", "default"}
    rendered = render_committed(tmp_path, engine)
    assert "| hdet_T10_displacement |" in rendered and "| hdet_T10_progress |" in rendered
    assert "`displacement` (a signal since removed from the library)" in rendered
    assert "`progress` (the progress hypergradient, since removed from the library)" in rendered


def test_the_same_layout_baseline_gets_its_rows_columns_and_legend(tmp_path):
    """DeepSpeed's committed run measured the same-layout baseline: its row in each stage's table, HDET's ratios
    against it in two more columns (read from the JSON), and the legend that says what it is."""
    data = json.loads((BENCHMARKS / "results" / "overhead_deepspeed_cpu.json").read_text())
    rendered = render_committed(tmp_path, "deepspeed")
    zero1 = data["stages"]["ZeRO-1"]["step_time"]
    layout = zero1["same_layout"]["block_median_ratio"]
    first_layout_row = next(line for line in rendered.splitlines() if line.startswith("| same_layout |"))  # ZeRO-1's
    assert first_layout_row.split(" | ")[3] == f"{layout['median']:.3f} ({layout['q1']:.3f}-{layout['q3']:.3f})"
    vs_layout = zero1["hdet_T100"]["vs_same_layout"]
    row = next(line for line in rendered.splitlines() if line.startswith("| ZeRO-1 | 100 |"))
    assert row.split(" | ")[-2].startswith(f"{vs_layout['block_median_ratio']['median']:.3f} (")
    assert row.endswith(f"| {vs_layout['total_time_ratio']:.3f} |")
    assert "HDET's layout without HDET" in rendered


def render_committed(tmp_path, engine: str) -> str:
    """The results page the report writes from the committed JSON of ``engine``."""
    report = load_benchmark("overhead_report")
    data = json.loads((BENCHMARKS / "results" / f"overhead_{engine}_cpu.json").read_text())
    path = tmp_path / "overhead.md"
    report.write_markdown(path, data)
    return path.read_text()


def test_the_legend_names_only_the_signals_a_results_file_holds():
    report = load_benchmark("overhead_report")
    costs = timing.signal_costs(STEPS, SYNC, HOOKS, 10, gradient_average=False)
    steps = {name: {**entry, "block_median_ratio": {"median": 1.0, "q1": 1.0, "q3": 1.0}, "total_time_ratio": 1.0}
             for name, entry in STEPS.items()}
    legend = report.signals_markdown({"sync_intervals": [10]}, {"step_time": steps, "signal_costs": costs}, "##",
                                     False)[-1]
    assert "`averaged` also adds" in legend and "`default` is the library's default controller" in legend
    assert "displacement" not in legend and "progress" not in legend


def test_a_sync_spread_over_the_steps_between_syncs_is_a_share_of_a_plain_step():
    report = load_benchmark("overhead_report")
    assert report.amortized_share(0.030, 100, 0.010) == pytest.approx(0.03)  # 30 ms / 100 steps / 10 ms
    sync = {"payload_bytes": 2**20, "ops": {"hdet.sync bucket_mb=25": {
        "buckets": 1, "seconds": {"median": 0.030, "q1": 0.025, "q3": 0.035},
        "ratio_vs_flat": {"median": 3.0, "q1": 2.5, "q3": 3.5}}}}
    lines = report.sync_markdown({"sync_reps": 20}, sync, 0.010, "##", "", False)
    assert "| hdet.sync bucket_mb=25 | 1 | 30.00 (25.00-35.00) | 3.000 (2.500-3.500) | 3.00% | 0.30% |" in lines
    costs = timing.signal_costs(STEPS, SYNC, HOOKS, 10, gradient_average=False)
    steps = {name: {**entry, "block_median_ratio": {"median": 1.0, "q1": 1.0, "q3": 1.0}, "total_time_ratio": 1.0}
             for name, entry in STEPS.items()}
    rows = report.signals_markdown({"sync_intervals": [10]}, {"step_time": steps, "signal_costs": costs}, "##",
                                   False)
    default = next(line for line in rows if line.startswith("| hdet_T10_default |"))
    assert default.split(" | ")[5] == "5.40%"  # its own sync, 54 ms, over 100 steps of 10 ms
