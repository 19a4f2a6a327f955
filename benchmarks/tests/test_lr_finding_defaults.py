"""The library's HDET defaults are the ones benchmarks/lr_finding.py measured, and its variants keep the controller
they ran with (the library's other config tests are tests/unit/test_config.py, which imports nothing from
benchmarks/)."""

import dataclasses

import pytest
from benchmark_modules import load_benchmark

from hdet_scale import HDETConfig, load_config
from hdet_scale.config import AutoLRConfig
from hdet_scale.resolve import resolve


def config_the_benchmark_ran(lr_finding, variant: str, directory) -> HDETConfig:
    """The HDET config benchmarks/lr_finding.py's worker runs ``variant`` with in its default setting (written by
    ``worker_args`` over the benchmark's pinned defaults and start)."""
    args = lr_finding.parse_args([])
    lr_finding.worker_args(args, {"method": "hdet", "variant": variant, "lr": 1e-3, "seed": 0}, directory)
    return load_config(directory / "hdet.json")


def test_defaults_are_the_lr_finding_benchmarks_default_variant(tmp_path):
    """The library's defaults are the controller benchmarks/lr_finding.py measured best (its DEFAULT_VARIANT): the
    HDET config its worker ran (written by ``worker_args``, over the benchmark's pinned defaults and start) is the
    library's default config for that run, and the variant's shares give the same for any run's length."""
    lr_finding = load_benchmark("lr_finding")
    variant = lr_finding.VARIANTS[lr_finding.DEFAULT_VARIANT]
    assert variant["probe"]  # a probe set: the averaged-weight window applies
    ran = config_the_benchmark_ran(lr_finding, lr_finding.DEFAULT_VARIANT, tmp_path)
    args = lr_finding.parse_args([])
    library = HDETConfig(sync_interval=args.sync_interval, ranks_per_replica=1).for_run(args.steps)
    assert ran.auto_lr.window(probing=True) == library.auto_lr.window(probing=True) == 0.25
    assert dataclasses.replace(ran.auto_lr, average_window=None).filled() == library.auto_lr.filled()
    assert (ran.alpha, ran.spread, ran.gradient_mode) == (library.alpha, library.spread, library.gradient_mode)
    controller = {key: value for key, value in variant["hdet"]["auto_lr"].items() if key != "average_window"}
    measured = HDETConfig.from_dict({**variant["hdet"], "auto_lr": controller})
    for steps in (1500, 300_000):
        assert HDETConfig().for_run(steps) == measured.for_run(steps)
    config = HDETConfig().for_run(1500)
    assert (config.alpha, config.spread, config.auto_lr.mode) == (0.5, "log", "log")
    assert (config.auto_lr.start, config.auto_lr.stop) == (30, 375)
    assert (config.auto_lr.sigma, config.auto_lr.step_size, config.auto_lr.max_log_step) == (1.0, 2.5, 0.5)
    assert (config.auto_lr.beta, config.auto_lr.rise_only_after) == (0.5, 0.43)
    assert config.auto_lr.initial_scale == pytest.approx(0.1)
    assert AutoLRConfig().window(probing=False) == 0.0  # no probe: nothing to score averaged weights
    resolve(HDETConfig(), world_size=8)


def test_the_no_probe_variant_is_the_default_without_a_probe(tmp_path):
    """benchmarks/lr_finding.py's ``tenth_rise_start2_no_probe`` runs the library's default controller as a loop
    without a probe batch gets it: the worker sets no probe, and no averaged-weight window is asked for (one would
    only warn that it does nothing)."""
    lr_finding = load_benchmark("lr_finding")
    args = lr_finding.parse_args([])
    run = {"method": "hdet", "variant": f"{lr_finding.DEFAULT_VARIANT}_no_probe", "lr": 1e-3, "seed": 0}
    assert "--probe" not in lr_finding.worker_args(args, run, tmp_path)
    ran = load_config(tmp_path / "hdet.json").auto_lr
    library = HDETConfig(sync_interval=args.sync_interval, ranks_per_replica=1).for_run(args.steps).auto_lr
    assert ran.window(probing=False) == 0.0  # the benchmark pins an unset window to the 0 it measured before
    assert dataclasses.replace(ran, average_window=None).filled() == library.filled()


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
