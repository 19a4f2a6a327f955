"""The library's HDET defaults are the ones benchmarks/lr_finding.py measured, and its variants keep the controller
they ran with (the library's other config tests are tests/unit/test_config.py, which imports nothing from
benchmarks/)."""

import dataclasses

import pytest
from benchmark_modules import load_benchmark

from hdet_scale import HDETConfig, load_config
from hdet_scale.resolve import resolve


def config_the_benchmark_ran(lr_finding, variant: str, directory) -> HDETConfig:
    """The HDET config benchmarks/lr_finding.py's worker runs ``variant`` with in its default setting (written by
    ``worker_args`` over the benchmark's pinned defaults and start)."""
    args = lr_finding.parse_args([])
    lr_finding.worker_args(args, {"method": "hdet", "variant": variant, "lr": 1e-3, "seed": 0}, directory)
    return load_config(directory / "hdet.json")


def test_defaults_are_the_lr_finding_benchmarks_default_variant(tmp_path):
    """The library's defaults are what benchmarks/lr_finding.py's DEFAULT_VARIANT runs: the HDET config its worker
    wrote (over the benchmark's pinned defaults) is the library's default config for that run, and that is the LR
    range test at the start, then every replica at 0.7 times its pick, held and unspread, as
    ``range_top_mean_no_spread`` measured it on the design settings (no spread, its controller bounded to the
    replicas' mean of the earlier default, 1.046 / 1.5 = 0.6975 times the pick)."""
    from hdet_scale.range_test import MEAN_LR_OVER_PICK

    lr_finding = load_benchmark("lr_finding")
    assert lr_finding.VARIANTS[lr_finding.DEFAULT_VARIANT]["probe"]
    ran = config_the_benchmark_ran(lr_finding, lr_finding.DEFAULT_VARIANT, tmp_path)
    args = lr_finding.parse_args([])
    library = HDETConfig(sync_interval=args.sync_interval, ranks_per_replica=1).for_run(args.steps)
    assert ran.for_run(args.steps).auto_lr == library.auto_lr
    assert (ran.alpha, ran.spread, ran.gradient_mode) == (library.alpha, library.spread, library.gradient_mode)
    assert (library.auto_lr.range_test, library.auto_lr.initial_scale, library.auto_lr.moves_lr) == (100, 1.0, False)
    assert (ran.spread_alpha(lr=True), ran.spread_alpha(lr=False)) == (0.0, 0.5)  # the LR unspread
    measured = config_the_benchmark_ran(lr_finding, "range_top_mean_no_spread", tmp_path)
    bounds = measured.auto_lr.filled()
    assert measured.alpha == 0.0 and bounds.scale_min == bounds.scale_max == pytest.approx(0.6975, abs=1e-4)
    assert MEAN_LR_OVER_PICK == pytest.approx(bounds.scale_min, abs=0.003)
    resolve(HDETConfig(), world_size=8)


def test_benchmark_variants_keep_the_controller_they_were_measured_with(tmp_path):
    """A benchmark variant that does not name a controller field gets the value it was measured with, not a later
    library default: the lr_finding variants before ``tenth_rise`` move both ways with beta 0.9, and those without
    a start of their own start at the benchmark's --controller_start (5%), not the library's 2%."""
    common, lr_finding = load_benchmark("common"), load_benchmark("lr_finding")
    old = HDETConfig.from_dict(common.hdet_config(**lr_finding.VARIANTS["tenth_start_early_hold"]["hdet"]))
    assert (old.auto_lr.filled().beta, old.auto_lr.filled().rise_only_after) == (0.9, 1.0)
    new = HDETConfig.from_dict(common.hdet_config(**lr_finding.VARIANTS["tenth_rise"]["hdet"]))
    assert (new.auto_lr.filled().beta, new.auto_lr.filled().rise_only_after) == (0.5, 0.35)
    for variant, start in (("tenth_rise", 75), ("tenth_rise_start2", 30)):  # of the setting's 1,500 steps
        ran = config_the_benchmark_ran(lr_finding, variant, tmp_path).auto_lr
        assert (ran.start, ran.stop) == (start, 375)


def test_a_settings_weight_decay_reaches_every_worker_and_names_the_setting(tmp_path):
    """A setting's ``--weight_decay`` reaches every worker and names the setting, while settings recorded without
    it stay as they were (their runs are still found)."""
    lr_finding = load_benchmark("lr_finding")
    plain = {"method": "sweep", "lr": 1e-3, "seed": 0}
    assert "--weight_decay" not in lr_finding.worker_args(lr_finding.parse_args([]), plain, tmp_path)
    assert "weight_decay" not in lr_finding.setting(lr_finding.parse_args([]))
    args = lr_finding.parse_args(["--weight_decay", "1.0"])
    words = lr_finding.worker_args(args, plain, tmp_path)
    assert words[words.index("--weight_decay") + 1] == "1.0"
    assert lr_finding.setting(args)["weight_decay"] == 1.0


def test_the_weight_decay_variant_is_the_default_exploring_weight_decay_too(tmp_path):
    """``default_weight_decay`` runs the library's defaults with AdamW's weight decay explored besides the LR."""
    lr_finding = load_benchmark("lr_finding")
    ran = config_the_benchmark_ran(lr_finding, "default_weight_decay", tmp_path)
    default = config_the_benchmark_ran(lr_finding, lr_finding.DEFAULT_VARIANT, tmp_path)
    explored = {knob.name for knob in dataclasses.fields(ran.explore) if getattr(ran.explore, knob.name) is not None}
    assert explored == {"weight_decay"} and ran.explore.weight_decay.alpha == 0.5
    assert ran.auto_lr == default.auto_lr and ran.alpha == default.alpha
    assert default.explore == type(default.explore)()  # the default explores nothing besides the LR


def runs_with_fake_results(lr_finding, monkeypatch, heldout_of, seeds=(0, 1, 2), factors=(0.1, 1.0, 10.0),
                           recorded=()):
    """The HDET runs ``one_run_for_every_start`` records for the default variant, each launched run ending at
    ``heldout_of(run)`` (None: diverged at step 7) with its LR at 0.02 (its scale 0.02 / its LR), on the machine
    ``"here"``, with ``recorded`` runs there before; and the runs it launched."""
    launched = []

    def execute(args, todo, source, record, save):
        launched.extend(todo)
        record["runs"] += [{**run, "heldout": heldout_of(run), "scales": [[50, 0.02 / run["lr"]]],
                            "diverged_at_step": None if heldout_of(run) else 7, "ran_on": "here"} for run in todo]

    monkeypatch.setattr(lr_finding, "execute", execute)
    args = lr_finding.parse_args(["--seeds", *map(str, seeds)])
    record = {"runs": [{"method": "hdet", "variant": "default", "scales": [[50, 0.02 / run["lr"]]],
                        "diverged_at_step": None, **run} for run in recorded]}
    lr_finding.one_run_for_every_start(args, record, None, lambda: None, "default", list(factors))
    return record["runs"], launched


def test_a_variant_that_starts_from_the_range_test_runs_each_seed_once_where_the_first_seed_shows_it(monkeypatch):
    lr_finding = load_benchmark("lr_finding")
    assert lr_finding.starts_from_range_test("default") and not lr_finding.starts_from_range_test("paper")
    runs, launched = runs_with_fake_results(lr_finding, monkeypatch, lambda run: 3.0 + run["seed"])
    assert sorted((run["seed"], run["lr"]) for run in launched) == [(0, 0.1), (0, 1.0), (0, 10.0), (1, 0.1), (2, 0.1)]
    assert sorted((run["seed"], run["lr"], run["heldout"], run.get("copy_of_lr")) for run in runs) == [
        (0, 0.1, 3.0, None), (0, 1.0, 3.0, None), (0, 10.0, 3.0, None),
        (1, 0.1, 4.0, None), (1, 1.0, 4.0, 0.1), (1, 10.0, 4.0, 0.1),
        (2, 0.1, 5.0, None), (2, 1.0, 5.0, 0.1), (2, 10.0, 5.0, 0.1)]
    # a copy ends on the LR its run ended on, whatever LR it stands for
    assert [lr_finding.final_lr_ratio(run, 0.01) for run in runs] == pytest.approx([2.0] * 9)


def test_a_seed_that_diverged_from_every_start_is_recorded_diverged_at_every_start(monkeypatch):
    lr_finding = load_benchmark("lr_finding")
    runs, launched = runs_with_fake_results(lr_finding, monkeypatch, lambda run: 3.0 if run["seed"] != 1 else None)
    assert len(launched) == 5 and len(runs) == 9
    assert sorted(run["lr"] for run in runs if run["seed"] == 1 and run["heldout"] is None) == [0.1, 1.0, 10.0]


def test_where_the_first_seeds_starts_end_apart_every_seed_runs_from_every_start(monkeypatch):
    lr_finding = load_benchmark("lr_finding")
    runs, launched = runs_with_fake_results(lr_finding, monkeypatch, lambda run: 3.0 + run["lr"])
    assert len(launched) == len(runs) == 9 and not any("copy_of_lr" in run for run in runs)


def test_new_starts_reuse_each_later_seeds_earlier_run_once_the_first_seed_ran_them_all(monkeypatch):
    lr_finding = load_benchmark("lr_finding")
    before = [{"lr": 1.0, "seed": seed, "heldout": 3.0 + seed} for seed in (0, 1, 2)]
    runs, launched = runs_with_fake_results(lr_finding, monkeypatch, lambda run: 3.0 + run["seed"],
                                            factors=(0.1, 10.0), recorded=before)
    assert sorted((run["seed"], run["lr"]) for run in launched) == [(0, 0.1), (0, 10.0)]
    assert sorted((run["seed"], run["lr"], run.get("copy_of_lr")) for run in runs if run["seed"]) == [
        (1, 0.1, 1.0), (1, 1.0, None), (1, 10.0, 1.0), (2, 0.1, 1.0), (2, 1.0, None), (2, 10.0, 1.0)]
    # the first seed's earlier run, on the same machine, ended apart from its new ones: the copies made before go,
    # every start runs
    copies = [{k: v for k, v in run.items() if k not in ("heldout", "scales", "diverged_at_step")}
              for run in runs if "copy_of_lr" in run]
    before[0].update(heldout=2.5, ran_on="here")
    runs, launched = runs_with_fake_results(lr_finding, monkeypatch, lambda run: 3.0 + run["seed"],
                                            factors=(0.1, 10.0), recorded=[*before, *copies])
    assert len(launched) == 6 and not any("copy_of_lr" in run for run in runs)


def test_a_first_seeds_run_from_another_machine_is_not_compared_bit_for_bit(monkeypatch):
    lr_finding = load_benchmark("lr_finding")
    # seed 0's run from 1x ran elsewhere (or before runs said where) and ended apart: its new runs, alike, decide
    for elsewhere in ({"ran_on": "there"}, {}):
        before = [{"lr": 1.0, "seed": seed, "heldout": 3.0 + seed + (0.5 if seed == 0 else 0), **elsewhere}
                  for seed in (0, 1, 2)]
        runs, launched = runs_with_fake_results(lr_finding, monkeypatch, lambda run: 3.0 + run["seed"],
                                                factors=(0.1, 1.0, 10.0), recorded=before)
        assert sorted((run["seed"], run["lr"]) for run in launched) == [(0, 0.1), (0, 10.0)]
        assert sorted((run["seed"], run["lr"], run["heldout"], run.get("copy_of_lr")) for run in runs) == [
            (0, 0.1, 3.0, None), (0, 1.0, 3.5, None), (0, 10.0, 3.0, None),
            (1, 0.1, 4.0, 1.0), (1, 1.0, 4.0, None), (1, 10.0, 4.0, 1.0),
            (2, 0.1, 5.0, 1.0), (2, 1.0, 5.0, None), (2, 10.0, 5.0, 1.0)]


def test_a_first_seed_without_a_run_from_every_start_leaves_the_other_seeds_waiting(monkeypatch, capsys):
    lr_finding = load_benchmark("lr_finding")
    launched: list[list[tuple[int, float]]] = []
    monkeypatch.setattr(lr_finding, "execute", lambda args, todo, source, record, save: launched.append(
        [(run["seed"], run["lr"]) for run in todo]))  # every launch fails: nothing is recorded
    args = lr_finding.parse_args(["--seeds", "0", "1"])
    record = {"runs": []}
    lr_finding.one_run_for_every_start(args, record, None, lambda: None, "default", [0.1, 1.0])
    # one launch: the first seed from every start, the other from the first start only; nothing after it
    assert launched == [[(0, 0.1), (0, 1.0), (1, 0.1)]]
    assert record["runs"] == []
    assert "default has no run of seed 0 from every start" in capsys.readouterr().err


def test_a_baseline_whose_optimizer_is_not_installed_stops_before_any_run(monkeypatch, tmp_path):
    lr_finding = load_benchmark("lr_finding")
    monkeypatch.setattr(lr_finding, "OPTIMIZER_PACKAGES", {"prodigy": "no_such_optimizer_package"})
    monkeypatch.setattr(lr_finding, "run_setting", lambda *args: pytest.fail("a setting was run"))
    with pytest.raises(SystemExit, match=r"need no_such_optimizer_package.*pip install -e '\.\[bench\]'"):
        lr_finding.main(["--methods", "sweep", "prodigy", "--out", str(tmp_path / "lr_finding")])
    matrix = load_benchmark("lr_finding_matrix")  # which runs every setting's sweeps before any Prodigy run
    with pytest.raises(SystemExit, match=r"need no_such_optimizer_package"):
        matrix.main(["--methods", "sweep", "prodigy"])
