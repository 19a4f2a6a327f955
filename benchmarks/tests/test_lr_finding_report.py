"""The LR-finding benchmark's report (benchmarks/lr_finding_report.py) against hand-computed tables."""

import json

from benchmark_modules import load_benchmark

from hdet_scale import HDETConfig
from hdet_scale.config import REMOVED_SETTINGS

report = load_benchmark("lr_finding_report")

SQRT10 = 10 ** 0.5
BEST_LR = 10 ** -2.5  # the grid's sqrt(10) steps: 1e-3, BEST_LR, 1e-2


def hdet(variant, factor, seed, heldout, ratio=1.0):
    return {"method": "hdet", "variant": variant, "start_factor": factor, "seed": seed, "heldout": heldout,
            "final_lr_ratio": ratio}


def record(runs):
    # sweep means: 0.001 -> 1.4, 0.00316 -> 1.1 (the best), 0.01 -> 1.3
    sweep = [{"lr": lr, "seed": seed, "heldout": heldout}
             for lr, values in ((1e-3, (1.3, 1.5)), (BEST_LR, (1.0, 1.2)), (1e-2, (1.2, 1.4)))
             for seed, heldout in enumerate(values)]
    return {"best_lr": BEST_LR, "default_variant": "chosen", "sweep": sweep, "runs": runs}


def test_the_headline_is_the_default_variants_excess_over_the_sweep_best_and_plain_dp():
    runs = [hdet("chosen", 1.0, 0, 1.11, 2.0), hdet("chosen", 1.0, 1, 1.13, 8.0),
            hdet("chosen", SQRT10, 0, 1.12), hdet("chosen", SQRT10, 1, 1.12),
            hdet("other", 1.0, 0, 5.0)]
    rec = record(runs)
    rows = report.headline(rec, report.sweep_table(rec))[-2:]
    # factor 1: mean 1.12, +0.020 over the best (within 0.03) but +0.020 over plain DP at that LR (not within 0.01);
    # final LR ratio: geometric mean of 2 and 8 = 4
    assert rows[0] == "| 1 | 0.00316 | 1.120 ± 0.014 (2) | +0.020 | +0.000 | 4.00 | no |"
    # factor sqrt(10): +0.020 over the best; plain DP at 0.01: 1.3, +0.200
    assert rows[1] == "| 3.16 | 0.01 | 1.120 ± 0.000 (2) | +0.020 | +0.200 | 1.00 | yes |"


def test_the_variants_figure_shows_the_variants_with_three_seeds_at_every_default_start():
    full = [hdet(name, factor, seed, 1.2) for name in ("chosen", "full") for factor in (0.1, 10.0)
            for seed in range(3)]
    short_seed = [hdet("two_seeds", factor, seed, 1.2) for factor in (0.1, 10.0) for seed in range(2)]
    one_start = [hdet("one_start", 0.1, seed, 1.2) for seed in range(3)]
    repeated = [hdet("same_seed_thrice", factor, 0, 1.2) for factor in (0.1, 10.0) for _ in range(3)]
    rec = record(full + short_seed + one_start + repeated)
    assert report.full_grid_variants(rec) == ["chosen", "full"]


def test_without_the_default_variant_no_variant_has_the_full_grid():
    assert report.full_grid_variants(record([hdet("full", 0.1, seed, 1.2) for seed in range(3)])) == []


def test_every_variant_defined_has_recorded_runs_and_every_recorded_run_a_definition():
    """A variant in benchmarks/lr_finding.py that never ran is a setting the results say nothing about, and a
    recorded run must say what it ran: by a variant VARIANTS still defines, or, for a variant since dropped, by the
    HDET config it ran with recorded on the run (``hdet_config``, and whether a probe batch scored it). Read from
    the committed results: the benchmark's own setting, its new seeds, its GPU run, the matrix of settings and the
    weight-decay demonstration."""
    lr_finding, common = load_benchmark("lr_finding"), load_benchmark("common")
    results = lr_finding.read_json(lr_finding.RESULTS / "lr_finding.json")
    others = [lr_finding.read_json(lr_finding.RESULTS / f"lr_finding_{name}.json") for name in ("new_seeds", "gpu")]
    matrices = [lr_finding.read_json(lr_finding.RESULTS / f"{name}.json")
                for name in ("lr_finding_matrix", "weight_decay_finding")]
    runs = [run for record in (results, *others) for run in record["runs"]]
    runs += [run for matrix in matrices for setting in matrix["settings"] for run in setting["runs"]]
    hdet_runs = [run for run in runs if run["method"] == "hdet"]
    assert set(lr_finding.VARIANTS) <= {run["variant"] for run in hdet_runs}
    undefined = [run for run in hdet_runs if run["variant"] not in lr_finding.VARIANTS]
    assert undefined  # the variants dropped from VARIANTS
    for run in undefined:
        ran = common.with_todays_names(run["hdet_config"])
        config = HDETConfig.from_dict(ran | {"auto_lr": {"range_test": 0, **{  # none before the range test
            key: value for key, value in ran.get("auto_lr", {}).items()
            if key not in REMOVED_SETTINGS["auto_lr"]}}})  # what it ran, as far as today's library reads it
        assert config.seed == run["seed"] and isinstance(run["probe"], bool), run["variant"]
    assert all(matrix["default_variant"] == lr_finding.DEFAULT_VARIANT for matrix in matrices)
    assert results["default_variant"] in lr_finding.VARIANTS  # the benchmark's own setting: the controller's


def test_each_recorded_run_of_a_variant_still_defined_ran_its_definition(tmp_path):
    """Where a run records its HDET config and its variant is still defined, the benchmark's worker writes the same
    config for it today (less the removed settings' values that meant "off")."""
    lr_finding, common = load_benchmark("lr_finding"), load_benchmark("common")
    for name in ("lr_finding", "lr_finding_new_seeds", "lr_finding_gpu"):
        record = lr_finding.read_json(lr_finding.RESULTS / f"{name}.json")
        args = lr_finding.parse_args([])
        for key, value in record["setting"].items():
            setattr(args, key, value)
        kept = [run for run in record["runs"] if run["method"] == "hdet" and run["variant"] in lr_finding.VARIANTS]
        assert kept and all("hdet_config" in run for run in kept)
        for run in kept:
            words = lr_finding.worker_args(args, run, tmp_path)
            now = json.loads((tmp_path / "hdet.json").read_text())
            recorded = common.with_todays_names(run["hdet_config"])
            ran = recorded if "auto_lr" not in recorded else {  # the library's defaults: as recorded
                **recorded, "auto_lr": {"range_test": 0,  # runs from before the range test had none
                                        **{key: value for key, value in recorded["auto_lr"].items()
                                           if key != "hold_average" or value != 0.0}}}
            assert now == ran, (name, run["variant"])
            assert ("--probe" in words) == run["probe"]


def test_every_variant_line_is_told_apart_and_the_legend_fits_the_figure():
    """40 variants with the full grid (more than the palette's colours and than one legend column holds): no two
    lines share a colour and a dash, and the legend beside the variants' panel stays inside the saved figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["chosen", *(f"variant_{index:02d}" for index in range(39))]
    rec = record([hdet(name, factor, seed, 1.2 + index / 1000) for index, name in enumerate(names)
                  for factor in (0.1, 1.0, 10.0) for seed in range(3)])
    fig = report.heldout_figure(rec, report.sweep_table(rec))
    try:
        variants_ax = fig.axes[1]
        drawn = [line for line in variants_ax.get_lines() if line.get_label().startswith("HDET")]
        assert len(drawn) == 40
        assert len({(line.get_color(), line.get_linestyle()) for line in drawn}) == 40
        fig.canvas.draw()
        legend, figure = variants_ax.get_legend().get_window_extent(), fig.bbox
        assert figure.x0 <= legend.x0 and legend.x1 <= figure.x1 and figure.y0 <= legend.y0 and legend.y1 <= figure.y1
    finally:
        plt.close(fig)


def test_a_finished_hdet_run_is_recorded_with_the_config_it_ran_and_whether_it_probed(tmp_path):
    lr_finding = load_benchmark("lr_finding")
    args = lr_finding.parse_args(["--runs_dir", str(tmp_path)])
    run = {"method": "hdet", "variant": "default", "lr": 1e-3, "seed": 7, "start_factor": 1.0}
    run_dir = lr_finding.run_dir_of(args, run)
    lr_finding.worker_args(args, run, run_dir)  # writes the run's hdet.json, as a launch does
    lr_finding.write_json(run_dir / "result.json", {"heldout": 1.5, "train": 1.4, "diverged_at_step": None,
                                                    "wall_seconds": 3.0, "scales": [[25, 1.0]]})
    recorded = {"best_lr": 1e-3}
    lr_finding._record(args, run, recorded, lr_finding.ran_on("abc123"))
    entry = recorded["runs"][0]
    assert entry["ran_on"].startswith("abc123 on ") and entry["ran_on"] == lr_finding.ran_on("abc123")
    assert entry["hdet_config"] == {"sync_interval": args.sync_interval, "ranks_per_replica": 1,
                                    "gradient_mode": "global", "seed": 7}
    assert entry["probe"] is True and entry["heldout"] == 1.5
