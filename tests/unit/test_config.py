import argparse
import dataclasses
import json
import math
import typing
import warnings

import pytest
import torch

from hdet_scale import (
    HDETConfig,
    HDETConfigError,
    HDETEnsemble,
    ReplicaTopology,
    add_hdet_args,
    config_rules,
    load_config,
)
from hdet_scale.config import AutoLRConfig
from hdet_scale.controller import controller_updates, sync_interval_for_run, updates_to_climb, window_share
from hdet_scale.engines.ddp import DDPAdapter
from hdet_scale.resolve import resolve, stuck_start_error, unread_settings_warnings
from hdet_scale.schedule import resolve_config
from hdet_scale.topology import check_world_size, with_replica_size


def test_the_papers_settings():
    config = HDETConfig.paper()
    assert (config.alpha, config.spread, config.sync_interval) == (pytest.approx(1 / 9), "linear", 1000)
    lr = config.for_run(10**6).auto_lr
    assert (lr.mode, lr.start, lr.stop, lr.beta, lr.sigma, lr.step_size, lr.initial_scale) == \
        ("paper", 100_000, None, 0.9, 0.1, 0.5, 1.0)
    assert config.warm_init.nu == 0.01 and config.gradient_mode == "global"
    assert HDETConfig.paper(sync_interval=50).sync_interval == 50
    # a section given as a mapping changes the fields it names: the paper's controller stays (it became 'log')
    changed = HDETConfig.paper(auto_lr={"start": 5000}).auto_lr
    assert (changed.mode, changed.start) == ("paper", 5000)
    assert HDETConfig.paper(auto_lr=AutoLRConfig(start=5000)).auto_lr.mode == "log"  # a whole section replaces


@pytest.mark.parametrize(("mode", "sigma", "step_size", "range_test", "start_steps", "stop_steps"), [
    ("log", 1.0, 2.5, 100, 20, 250), ("scale", 0.1, 0.5, 100, 50, None), ("paper", 0.1, 0.5, 0, 50, None)])
def test_unset_controller_fields_take_their_modes_defaults(mode, sigma, step_size, range_test, start_steps,
                                                           stop_steps):
    lr = HDETConfig.from_dict({"auto_lr": {"mode": mode}}).for_run(1000).auto_lr
    assert (lr.sigma, lr.step_size, lr.start, lr.stop) == (sigma, step_size, start_steps, stop_steps)
    assert (lr.range_test, lr.initial_scale) == (range_test, 1.0)  # the range test picks where the LR starts
    # without a range test the log controller climbs from a tenth of the LR
    without_test = HDETConfig.from_dict({"auto_lr": {"mode": mode, "range_test": 0}}).for_run(1000).auto_lr
    assert without_test.initial_scale == pytest.approx(0.1 if mode == "log" else 1.0)
    # what the user gives wins, and a start or stop in steps replaces the default share
    lr = HDETConfig.from_dict({"auto_lr": {"mode": mode, "sigma": 0.3, "start": 7}}).for_run(1000).auto_lr
    assert (lr.sigma, lr.start) == (0.3, 7)
    # the controller off trains at the LR given ("spread and averaging only"): no range test unless asked for
    off = HDETConfig.from_dict({"auto_lr": {"enabled": False}}).for_run(1000).auto_lr
    assert (off.range_test, off.initial_scale) == (0, 1.0)
    assert HDETConfig.from_dict({"auto_lr": {"enabled": False, "range_test": 50}}).auto_lr.filled().range_test == 50


def test_overrides_merge_onto_the_given_fields_not_the_filled_ones():
    """A dict of overrides (HDETScheduler's keywords, the tests' launcher) changes the mode or the start as if
    given with the rest: the first config's unset fields stay unset."""
    merged = resolve_config(HDETConfig(), {"auto_lr": {"mode": "scale", "start": 10}})
    lr = merged.for_run(1000).auto_lr
    assert (lr.mode, lr.start, lr.sigma, lr.stop, lr.initial_scale) == ("scale", 10, 0.1, None, 1.0)


def test_a_scale_range_that_leaves_out_the_default_start_names_it():
    with pytest.raises(HDETConfigError, match=r"must bracket auto_lr.initial_scale=0.1 \(the 'log' mode's default\), "
                                              r"where the controller starts .*: lower scale_min or raise scale_max"):
        HDETConfig.from_dict({"auto_lr": {"range_test": 0, "scale_min": 0.5}})
    # with the range test (the default) the scale starts at its pick, 1, whatever the mode's default
    with pytest.raises(HDETConfigError, match=r"initial_scale=1 \(the LR range test's pick\), where "):
        HDETConfig.from_dict({"auto_lr": {"scale_min": 2.0}})


@pytest.mark.parametrize("values, said", [
    ({"auto_lr.range_test": 0}, """settings of 'auto_lr' go inside it, {"auto_lr": {"range_test": ...}}"""),
    ({"range_test": 0}, """it is a setting of 'auto_lr', written {"auto_lr": {"range_test": ...}}"""),
    ({"nu": 0.1}, """it is a setting of 'warm_init', written {"warm_init": {"nu": ...}}"""),
    ({"auto_lr": {"rangetest": 0}}, "(did you mean 'auto_lr.range_test'?). Known settings of 'auto_lr': "),
    ({"explore": {"weight_decay": True}}, """explore.weight_decay must be a JSON object ({}: its defaults; or e.g. """),
    ({"auto_lr": {"range_test": True}}, "(its steps, 100 is usual; 0: no test), got True"),
    ({"auto_lr": {"start": -1}}, "or a float in [0, 1) (a share of the run), got -1"),
])
def test_a_setting_written_in_the_wrong_place_or_shape_is_told_where_it_goes(values, said):
    """The docs write settings as auto_lr.range_test; written so in the JSON (or flat) the error listed the top
    level's settings alone."""
    with pytest.raises(HDETConfigError) as raised:
        HDETConfig.from_dict(values)
    assert said in str(raised.value)


def test_only_the_lr_follows_the_paper_mode_and_the_rise_only_phase():
    lr = AutoLRConfig(mode="log", beta=0.7, rise_only_after=0.3)
    other = lr.for_other_knobs()
    assert (other.mode, other.beta, other.filled().rise_only_after) == ("log", 0.7, 1.0)
    assert AutoLRConfig(mode="paper").for_other_knobs().mode == "scale"


def test_the_window_and_the_share_of_the_controllers_window():
    lr = HDETConfig.from_dict({"auto_lr": {"average_window": 0.2, "start": 100,
                                           "stop": 400}}).for_run(1000).auto_lr
    assert lr.window(True) == 0.2 and AutoLRConfig(average_window=0.3).window(False) == 0.3  # as given
    # the share of the window 100-400 at a step; none without a stop
    assert [window_share(lr, step) for step in (40, 100, 190, 400, 700)] == pytest.approx([-0.2, 0.0, 0.3, 1.0, 2.0])
    assert window_share(AutoLRConfig(), 190) is None


@pytest.mark.parametrize("key", ["hold_average", "average_window_late", "displacement", "hypergradient",
                                 "progress_target", "bias_correction"])
def test_a_removed_setting_is_refused_as_removed(tmp_path, key):
    """A config of an earlier version that still names a setting since removed is refused in one line that says
    so (not as an unknown key, with a guess at what was meant), from a JSON file, a mapping or a section."""
    path = tmp_path / "hdet.json"
    path.write_text(json.dumps({"alpha": 0.5, "auto_lr": {"mode": "log", key: 0.5}}))
    message = rf"^HDET setting 'auto_lr.{key}' was removed \(it measured no better than the default controller"
    for load in (lambda: HDETConfig.from_json(path), lambda: load_config(str(path)),
                 lambda: HDETConfig(auto_lr={key: 0.5})):
        with pytest.raises(HDETConfigError, match=message) as error:
            load()
        text = str(error.value)
        assert "\n" not in text and "unknown" not in text and "did you mean" not in text
    with pytest.raises(HDETConfigError, match=rf"unknown HDET setting '{key}'"):  # removed from auto_lr only
        HDETConfig.from_dict({key: 0.5})


def test_round_trip_through_dict_and_json(tmp_path):
    config = HDETConfig.from_dict({"alpha": 0.25, "sync_interval": 10, "ranks_per_replica": 2,
                                   "gradient_mode": "local", "auto_lr": {"mode": "paper", "sigma": 0.05},
                                   "warm_init": {"enabled": True}})
    assert config.auto_lr.sigma == 0.05 and config.auto_lr.beta is None and config.warm_init.enabled
    assert config.auto_lr.filled().beta == 0.9
    path = tmp_path / "hdet.json"
    path.write_text(json.dumps(config.to_dict()))
    assert HDETConfig.from_json(path) == config


def test_argparse_helper_and_load_config(tmp_path, monkeypatch):
    path = tmp_path / "hdet.json"
    path.write_text(json.dumps({"alpha": 0.5, "ranks_per_replica": 2}))
    parser = add_hdet_args(argparse.ArgumentParser())
    args = parser.parse_args(["--hdet_config", str(path)])
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert load_config(args).alpha == 0.5
    assert load_config(parser.parse_args([])) == HDETConfig()
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(HDETConfigError, match="ranks_per_replica=2 does not divide the world size 3"):
        load_config(args)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"alpha": -0.1, "spread": "linear"}, r"alpha must be a number in \[0.0, 1.0\), got -0.1"),
        ({"alpha": -0.1}, r"alpha must be a number in \[0.0, inf\), got -0.1"),
        ({"alpha": 1.0, "spread": "linear"},
         r"alpha must be a number in \[0.0, 1.0\), got 1.0 \(alpha >= 1 makes the lowest"),
        ({"sync_interval": 0}, r"sync_interval must be an integer >= 1, got 0"),
        ({"sync_interval": 2.5}, r"sync_interval must be an integer >= 1, got 2.5"),
        ({"ranks_per_replica": 0}, r"ranks_per_replica must be an integer >= 1 or one of 'auto', 'node', got 0"),
        ({"ranks_per_replica": "gpu"}, r"ranks_per_replica must be an integer >= 1 or one of 'auto', 'node'"),
        ({"gradient_mode": "hybrid"}, r"gradient_mode must be one of 'global', 'local', got 'hybrid'"),
        ({"bucket_mb": 0}, r"bucket_mb must be a number in \(0.0, inf\)"),
        ({"auto_lr": {"sigma": 0}}, r"auto_lr.sigma must be a number in \(0.0, inf\), got 0"),
        ({"auto_lr": {"sigma": -1.0}}, r"auto_lr.sigma must be a number in \(0.0, inf\)"),
        ({"auto_lr": {"beta": 1.0}}, r"auto_lr.beta must be a number in \[0.0, 1.0\), got 1.0"),
        ({"auto_lr": {"beta": -0.5}}, r"auto_lr.beta must be a number in \[0.0, 1.0\)"),
        ({"auto_lr": {"mode": "magic"}}, r"auto_lr.mode must be one of 'scale', 'paper'"),
        ({"auto_lr": {"start": -1}}, r"auto_lr.start must be an integer >= 0"),
        ({"auto_lr": {"scale_min": 2.0, "mode": "scale"}},
         r"must bracket auto_lr.initial_scale=1 \(the LR range test's pick\)"),
        ({"auto_lr": {"initial_scale": 0.05, "range_test": 0}},
         r"scale_min=0.1 and auto_lr.scale_max=10.0 must bracket auto_lr.initial_scale=0.05"),
        ({"auto_lr": {"initial_scale": 0}}, r"auto_lr.initial_scale must be a number in \(0.0, inf\)"),
        ({"auto_lr": {"initial_scale": 0.5, "mode": "paper"}}, r"initial_scale=0.5 needs the controller on"),
        ({"auto_lr": {"initial_scale": 0.5, "enabled": False, "range_test": 0}},
         r"initial_scale=0.5 needs the controller on"),
        ({"auto_lr": {"enabled": "yes"}}, r"auto_lr.enabled must be true or false"),
        ({"warm_init": {"nu": -0.01}}, r"warm_init.nu must be a number in \[0.0, inf\)"),
        ({"average_optimizer_state": 1}, r"average_optimizer_state must be true or false"),
        ({"alpah": 0.1}, r"unknown HDET setting 'alpah' \(did you mean 'alpha'\?\)"),
        ({"auto_lr": {"lambda": 0.5}}, r"unknown HDET setting 'auto_lr.lambda'"),
        ({"auto_lr": 3}, r"auto_lr must be a JSON object"),
        ({"spread": "cubic"}, r"spread must be one of 'linear', 'log', got 'cubic'"),
        # the alpha a log spread allows was refused first, as if the spread were linear
        ({"spread": "Log", "alpha": 2.0}, r"spread must be one of 'linear', 'log', got 'Log'"),
        ({"metrics_path": ""}, r"metrics_path must be a file path string or null \(no metrics file\), got ''"),
        ({"auto_lr": {"max_log_step": 0}}, r"auto_lr.max_log_step must be a number in \(0.0, inf\)"),
        ({"auto_lr": {"average_window": 1.0}}, r"auto_lr.average_window must be a number in \[0.0, 1.0\)"),
    ],
)
def test_bad_values_name_the_field(values, message):
    with pytest.raises(HDETConfigError, match=message):
        HDETConfig.from_dict(values)


def test_world_size_must_divide():
    config = HDETConfig(ranks_per_replica=4)
    with pytest.raises(HDETConfigError, match="ranks_per_replica=4 does not divide the world size 6"):
        resolve(config, world_size=6)
    assert check_world_size(config, 8) == 2


def test_replica_size_by_name(monkeypatch):
    """'node' is the launcher's ranks per node; 'auto' is a rank for unsharded engines and a node for sharded."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "8")  # the deepspeed launcher's name
    assert with_replica_size(HDETConfig(ranks_per_replica="node")).ranks_per_replica == 8
    assert with_replica_size(HDETConfig(), auto="node").ranks_per_replica == 8
    assert with_replica_size(HDETConfig()).ranks_per_replica == 1
    assert with_replica_size(HDETConfig(ranks_per_replica=2), auto="node").ranks_per_replica == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's name wins where both are set
    assert check_world_size(HDETConfig(ranks_per_replica="node"), 16) == 4
    with pytest.raises(HDETConfigError, match=r"ranks_per_replica=4 \(from 'node'\) does not divide the world size 6"):
        resolve(HDETConfig(ranks_per_replica="node"), world_size=6)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("LOCAL_SIZE")
    # the value the user gave ("auto", the default) is named, not the "node" it stands for on a sharded engine
    with pytest.raises(HDETConfigError, match=r"ranks_per_replica='auto' \(on a sharded engine: a node\) needs the "
                                              "ranks per node"):
        with_replica_size(HDETConfig(), auto="node")


def test_bad_json_files(tmp_path):
    with pytest.raises(HDETConfigError, match="no such file"):
        HDETConfig.from_json(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{alpha: 1")
    with pytest.raises(HDETConfigError, match="is not valid JSON"):
        HDETConfig.from_json(broken)
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    with pytest.raises(HDETConfigError, match="must hold a JSON object"):
        HDETConfig.from_json(listing)


def test_sections_given_as_mappings_are_built_and_checked():
    """HDETConfig(auto_lr={...}) used to fail inside validation with an AttributeError on the dict."""
    config = HDETConfig(auto_lr={"mode": "scale"}, explore={"weight_decay": {"alpha": 0.3}}, warm_init={"nu": 0.02})
    assert config == HDETConfig.from_dict({"auto_lr": {"mode": "scale"}, "explore": {"weight_decay": {"alpha": 0.3}},
                                           "warm_init": {"nu": 0.02}})
    with pytest.raises(HDETConfigError, match=r"unknown HDET setting 'auto_lr.mdoe' \(did you mean 'auto_lr.mode'"):
        HDETConfig(auto_lr={"mdoe": "scale"})
    with pytest.raises(HDETConfigError, match="explore.dropout must be a JSON object .*, got 0.1"):
        HDETConfig(explore={"dropout": 0.1})
    with pytest.raises(HDETConfigError,
                       match=r"auto_lr must be a mapping of settings or an instance of AutoLRConfig, got \[1\]"):
        HDETConfig(auto_lr=[1])
    # a JSON's null section went on to fail inside validation with an AttributeError (a traceback from train.py)
    for section in ("auto_lr", "warm_init", "explore"):
        with pytest.raises(HDETConfigError, match=f"^{section} must be a mapping of settings, got null"):
            HDETConfig.from_dict({section: None})
    assert HDETConfig.from_dict({"explore": {"dropout": None}}).explore.dropout is None  # a knob's null: unexplored


def test_keyword_sections_given_as_their_dataclass_replace_the_section():
    """HDETScheduler(..., auto_lr=AutoLRConfig(range_test=0)) was refused ('must be a JSON object'), though
    HDETConfig itself takes sections as their dataclasses."""
    from hdet_scale.schedule import resolve_config

    config = resolve_config({"auto_lr": {"mode": "scale", "sigma": 0.3}},
                            {"auto_lr": AutoLRConfig(range_test=0), "warm_init": {"nu": 0.02}})
    assert config.auto_lr == AutoLRConfig(range_test=0)  # the whole section: its mode and sigma unset again
    assert config.warm_init.nu == 0.02
    assert resolve_config({"auto_lr": {"mode": "scale", "sigma": 0.3}}, {"auto_lr": {"range_test": 0}}).auto_lr == \
        AutoLRConfig(mode="scale", sigma=0.3, range_test=0)  # a dict changes the fields it names


def test_an_unset_alpha_spreads_what_a_controller_moves_and_leaves_an_lr_the_range_test_picked_unspread():
    default = HDETConfig()  # the range test picks the LR, which holds: nothing reads a spread of it
    assert default.alpha is None
    assert (default.spread_alpha(lr=True), default.spread_alpha(lr=False)) == (0.0, 0.5)
    moving = HDETConfig(auto_lr={"range_test": 0})  # the controller moves the LR, reading its spread
    assert (moving.spread_alpha(lr=True), moving.spread_alpha(lr=False)) == (0.5, 0.5)
    given = HDETConfig(alpha=0.25)  # given, it is the spread of everything explored, range test or not
    assert (given.spread_alpha(lr=True), given.spread_alpha(lr=False)) == (0.25, 0.25)
    assert HDETConfig.paper().spread_alpha(lr=True) == pytest.approx(1 / 9)


def test_a_log_spread_takes_any_alpha():
    assert HDETConfig.from_dict({"alpha": 1.0, "spread": "log"}).alpha == 1.0  # multipliers 1/2 .. 2
    with pytest.raises(HDETConfigError, match="spread 'log' allows it"):
        HDETConfig.from_dict({"alpha": 1.0, "spread": "linear"})


def test_the_controller_start_as_a_share_of_the_run():
    config = HDETConfig.from_dict({"auto_lr": {"start": 0.05}})
    assert config.auto_lr.start == 0.05
    assert config.for_run(1500).auto_lr.start == 75  # 0.05 x 1500
    assert config.for_run(7).auto_lr.start == 0  # round(0.35)
    assert HDETConfig.from_dict({"auto_lr": {"start": 0.1}}).for_run(7).auto_lr.start == 1
    fixed = HDETConfig.from_dict({"auto_lr": {"start": 5, "stop": 8}}).for_run(10).auto_lr
    assert (fixed.start, fixed.stop) == (5, 8)  # steps, as given
    with pytest.raises(HDETConfigError, match=r"auto_lr.start must be a number in \[0.0, 1.0\), got 1.0 \(a float "
                                              r"is a share of the run; give a step as an int\)"):
        HDETConfig.from_dict({"auto_lr": {"start": 1.0}})
    with pytest.raises(HDETConfigError, match=r"auto_lr.start must be an integer >= 0 \(a step\) or a float"):
        HDETConfig.from_dict({"auto_lr": {"start": "10%"}})
    with pytest.raises(HDETConfigError, match="total_steps"):
        config.for_run(0)


@pytest.mark.parametrize(("old", "new"), [("warmup_steps", "start"), ("start_fraction", "start"),
                                          ("stop_steps", "stop"), ("stop_fraction", "stop")])
def test_the_earlier_names_of_the_start_and_stop_are_refused_with_the_new_one(old, new):
    with pytest.raises(HDETConfigError, match=rf"^HDET setting 'auto_lr.{old}' is now 'auto_lr.{new}' \(a step as "
                                              r"an int, a share of the run as a float\): rename it$"):
        HDETConfig.from_dict({"auto_lr": {old: 10}})


def test_a_start_as_a_share_without_the_runs_length_is_refused():
    import torch

    from hdet_scale import HDETEnsemble
    from hdet_scale.engines.ddp import DDPAdapter
    from hdet_scale.topology import ReplicaTopology

    # the defaults: start and stop are shares of the run
    config = HDETConfig.from_dict({"ranks_per_replica": 1, "sync_interval": 5, "auto_lr": {"range_test": 0}})
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    two_replicas = ReplicaTopology(world_size=2, rank=0, ranks_per_replica=1)
    # after a range test the LR holds at its pick: with no other value explored no controller needs the length
    HDETEnsemble(HDETConfig(ranks_per_replica=1), DDPAdapter(optimizer), topology=two_replicas).close()
    # why the controller runs, where the user gave nothing of it
    with pytest.raises(HDETConfigError, match=r"auto_lr.start=0.02 is a share of the run, and the controller moving "
                                              r"the explored values needs the run's length for it"):
        HDETEnsemble(HDETConfig.from_dict({"ranks_per_replica": 1, "explore": {"weight_decay": {}}}),
                     DDPAdapter(optimizer), topology=two_replicas)
    with pytest.raises(HDETConfigError, match=r"auto_lr.start=0.02 is a share of the run, and the controller moving "
                                              r"the LR needs the run's length for it: pass total_steps= when "
                                              r"attaching"):
        HDETEnsemble(config, DDPAdapter(optimizer), topology=two_replicas)
    hdet = HDETEnsemble(config, DDPAdapter(optimizer), topology=two_replicas, total_steps=100)
    assert (hdet.config.auto_lr.start, hdet.config.auto_lr.stop) == (2, 25)
    hdet.close()
    # one replica has no controller: nothing to place, and the LR is the one given (no low start)
    with pytest.warns(UserWarning, match="ONE replica"):
        alone = HDETEnsemble(config, DDPAdapter(optimizer), topology=ReplicaTopology.single_process())
    assert alone.current_lrs() == [0.1]
    alone.close()


def test_a_start_as_a_share_survives_the_round_trip():
    config = HDETConfig.from_dict({"auto_lr": {"start": 0.2}})
    assert HDETConfig.from_dict(config.to_dict()) == config


def test_the_controller_stop_as_steps_or_a_share_of_the_run():
    config = HDETConfig.from_dict({"auto_lr": {"start": 0.05, "stop": 0.5}}).for_run(1500)
    assert (config.auto_lr.start, config.auto_lr.stop) == (75, 750)
    assert HDETConfig.from_dict({"auto_lr": {"stop": 300}}).auto_lr.stop == 300
    with pytest.raises(HDETConfigError, match=r"auto_lr.stop must be a number in \(0.0, 1.0\]"):
        HDETConfig.from_dict({"auto_lr": {"stop": 0.0}})
    with pytest.raises(HDETConfigError, match="auto_lr.stop works in 'scale' and 'log' mode"):
        HDETConfig.from_dict({"auto_lr": {"mode": "paper", "stop": 10}})


def test_the_rise_only_phase_is_checked():
    assert HDETConfig.from_dict({"auto_lr": {"rise_only_after": 0.35}}).auto_lr.rise_only_after == 0.35
    with pytest.raises(HDETConfigError, match=r"auto_lr.rise_only_after must be a number in \[0.0, 1.0\]"):
        HDETConfig.from_dict({"auto_lr": {"rise_only_after": 1.5}})
    with pytest.raises(HDETConfigError, match=r"auto_lr.rise_only_after=0.2 works in 'scale' and 'log' mode"):
        HDETConfig.from_dict({"auto_lr": {"mode": "paper", "rise_only_after": 0.2}})
    with pytest.raises(HDETConfigError, match=r"auto_lr.rise_only_after=0.2 is a share of the controller's window "
                                              r"up to its stop: give auto_lr.stop"):
        HDETConfig.from_dict({"auto_lr": {"mode": "scale", "rise_only_after": 0.2}})  # scale mode: no stop
    assert HDETConfig.from_dict({"auto_lr": {"mode": "scale", "stop": 9, "rise_only_after": 0.2}}).auto_lr.stop == 9


@pytest.mark.parametrize(("mode", "sync_interval", "updates"),
                         [("log", 1, 24), ("log", 2, 12), ("log", 3, 8), ("log", 10, 2),
                          ("scale", 5, 5), ("scale", 10, 2), ("short", 1, 9)])
def test_a_controller_window_too_short_to_climb_says_so(mode, sync_interval, updates):
    """Start 2, stop 25 (the log default's shares of 100 steps; scale mode is given 5-25): the syncs at every T-th
    step from the start up to and including the stop update the controller. The log default climbs from a tenth of
    the LR to 10x it in ceil(log(100) / 0.5) = 10 updates, and warns below that; scale mode has no largest step and
    warns below 4. A window shorter than the updates it needs (36 steps: 1-9) says that no sync interval is
    enough."""
    import torch

    from hdet_scale import HDETEnsemble
    from hdet_scale.engines.ddp import DDPAdapter
    from hdet_scale.topology import ReplicaTopology

    auto_lr = {"mode": "log", "range_test": 0} if mode != "scale" else {"mode": mode, "start": 0.05, "stop": 0.25,
                                                                          "range_test": 0}
    config = HDETConfig.from_dict({"sync_interval": sync_interval, "ranks_per_replica": 1, "auto_lr": auto_lr})
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    hdet = HDETEnsemble(config, DDPAdapter(optimizer), total_steps=36 if mode == "short" else 100,
                        topology=ReplicaTopology(world_size=2, rank=1, ranks_per_replica=1))
    assert controller_updates(hdet.config) == updates
    if updates >= (4 if mode == "scale" else 10):
        assert hdet.few_updates_warning is None
    elif mode == "log":
        assert hdet.few_updates_warning == (
            f"the auto-LR controller moves only between steps 2 and 25, where sync_interval={sync_interval} gives "
            f"it {updates} update(s); climbing from auto_lr.initial_scale=0.1 to scale_max=10 at max_log_step=0.5 "
            "a sync takes 10, so a too-low LR may not climb all the way: set sync_interval to 2 or less for 10")
    elif mode == "scale":
        assert hdet.few_updates_warning == (
            f"the auto-LR controller moves only between steps 5 and 25, where sync_interval={sync_interval} gives "
            "it 2 update(s): set sync_interval to 5 or less for 4")
    else:  # 36 steps: the window 1-9 holds 9 syncs even at T = 1, so no sync_interval is enough
        assert hdet.few_updates_warning == (
            "the auto-LR controller moves only between steps 1 and 9, where sync_interval=1 gives it 9 update(s); "
            "climbing from auto_lr.initial_scale=0.1 to scale_max=10 at max_log_step=0.5 a sync takes 10, so a "
            "too-low LR may not climb all the way: the window is shorter than 10 steps: train longer, or widen it "
            "(auto_lr.start, stop), or narrow the climb (auto_lr.initial_scale, scale_max, "
            "max_log_step)")
    hdet.close()


@pytest.mark.parametrize("auto_lr", [{"mode": "scale", "range_test": 0, "start": 5000},
                                     {"mode": "paper", "range_test": 0, "start": 100_000}])
def test_a_controller_that_starts_past_the_runs_end_says_it_never_moves(auto_lr):
    """A start past the end turned the controller off without a word (the paper's start, 100,000 steps, on any
    shorter run; a start in steps on a run shorter than that)."""
    import torch

    from hdet_scale import HDETEnsemble, PaperDecay
    from hdet_scale.engines.ddp import DDPAdapter
    from hdet_scale.topology import ReplicaTopology

    config = HDETConfig.from_dict({"sync_interval": 10, "ranks_per_replica": 1, "auto_lr": auto_lr})
    for steps, warned in ((3000, True), (200_000, False)):
        optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hdet = HDETEnsemble(config, DDPAdapter(optimizer), total_steps=steps,
                                paper_decay=[PaperDecay(steps, 0.01)] if auto_lr["mode"] == "paper" else None,
                                topology=ReplicaTopology(world_size=2, rank=0, ranks_per_replica=1))
        said = [str(warning.message) for warning in caught if "never moves" in str(warning.message)]
        assert said == ([f"the auto-LR controller starts at step {auto_lr['start']} (auto_lr.start) and this run has "
                         f"{steps} steps: it never moves a value, and the run trains at the values it was given; set "
                         f"auto_lr.start below {steps} (or as a share of the run, e.g. 0.02), or auto_lr.enabled to "
                         "false"] if warned else [])
        hdet.close()


def test_one_cycle_warns_of_a_controller_that_starts_after_its_run():
    """HDETOneCycleLR knows its run's length but did not pass it on: the paper's controller, from step 100,000,
    stayed off in a run of 1,000 steps without a word."""
    import torch

    from hdet_scale import HDETOneCycleLR
    from hdet_scale.topology import ReplicaTopology

    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler = HDETOneCycleLR(optimizer, max_lr=0.1, total_steps=1000, hdet_config=HDETConfig.paper(),
                                   topology=ReplicaTopology(world_size=2, rank=0, ranks_per_replica=1))
    assert any("starts at step 100000 (auto_lr.start) and this run has 1000 steps" in str(warning.message)
               for warning in caught)
    scheduler.hdet.close()


def test_a_controller_that_would_never_leave_its_low_start_is_refused():
    """With no sync between the controller's start and stop, a start at a tenth of the LR held for the whole run:
    train.py used to train 300 steps at 0.1 x --lr after a warning that did not say so."""
    import torch

    from hdet_scale import HDETEnsemble
    from hdet_scale.engines.ddp import DDPAdapter
    from hdet_scale.topology import ReplicaTopology

    message = (r"sync_interval=400 puts no sync between the auto-LR controller's start \(step 6\) and stop \(step "
               r"75\): it would never move from auto_lr.initial_scale=0.1, and the whole run would train at 0.1 x the "
               r"given LR; set sync_interval to 75 or less, or auto_lr.initial_scale to 1")
    two = ReplicaTopology(world_size=2, rank=1, ranks_per_replica=1)
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(HDETConfigError, match=message):
        HDETEnsemble(HDETConfig(sync_interval=400, ranks_per_replica=1, auto_lr=AutoLRConfig(range_test=0)),
                     DDPAdapter(optimizer), total_steps=300,
                     topology=two)
    for fine in ({"sync_interval": 75}, {"sync_interval": 400, "auto_lr": {"initial_scale": 1.0}}):
        config = HDETConfig.from_dict({"ranks_per_replica": 1, **fine})
        HDETEnsemble(config, DDPAdapter(optimizer), total_steps=300, topology=two).close()
    assert stuck_start_error(HDETConfig(sync_interval=400).for_run(300), num_replicas=1) is None  # no controller


@pytest.mark.parametrize(("steps", "interval"), [(100, 1), (300, 5), (1000, 10), (1500, 25), (59_900, 500),
                                                 (60_000, 1000), (10**6, 1000)])
def test_the_sync_interval_for_a_run_gives_the_controller_its_measured_updates(steps, interval):
    """The largest round T whose default window (2% to 25% of the run) holds 14 updates. 100 steps: 2-25, T = 1
    gives 24, T = 2 only 2, ..., 24 (12). 300: 6-75, T = 5 gives 10, 15, ..., 75 (14), T = 10 only 10, ..., 70 (7).
    1000: 20-250, T = 10 gives 24, T = 20 20, ..., 240 (12). 60,000: 1200-15000, T = 1000 gives 2000, ..., 15000
    (14); 59,900: 1198-14975, T = 1000 gives 2000, ..., 14000 (13). A million steps: capped at the library's
    1000."""
    assert sync_interval_for_run(steps) == interval


@pytest.mark.parametrize(("auto_lr", "updates"),
                         [({}, 10),  # the log default: ceil(log(10 / 0.1) / 0.5) = ceil(9.21)
                          ({"initial_scale": 1.0, "max_log_step": 0.25}, 10),  # ceil(log(10) / 0.25) = ceil(9.21)
                          ({"initial_scale": 0.5, "scale_max": 2.0, "max_log_step": 0.7}, 4),  # ceil(1.98), then 4
                          ({"initial_scale": math.exp(-1), "scale_max": math.exp(1)}, 4),  # exactly 2 / 0.5
                          ({"initial_scale": math.exp(-1), "scale_max": math.exp(2)}, 6),  # exactly 3 / 0.5
                          ({"max_log_step": math.log(100) / 14}, 14),  # exactly 14 steps, not 15 by rounding
                          ({"mode": "scale"}, 4)])  # no largest step
def test_updates_to_climb_by_hand(auto_lr, updates):
    assert updates_to_climb(AutoLRConfig(**{"range_test": 0, **auto_lr}).filled()) == updates


@pytest.mark.parametrize(("auto_lr", "updates"), [({"start": 0, "stop": 30}, 3),
                                                  ({"start": 11, "stop": 29}, 1),
                                                  ({"start": 20, "stop": 20}, 1),
                                                  ({"start": 21, "stop": 29}, 0)])
def test_controller_updates_counts_the_syncs_from_start_to_stop(auto_lr, updates):
    """T = 10: syncs at 10, 20, 30; step 0 is no sync, and the start and the stop both count."""
    config = HDETConfig.from_dict({"sync_interval": 10, "auto_lr": {"mode": "scale", **auto_lr}})
    assert controller_updates(config) == updates


def test_controller_updates_is_none_without_a_stop():
    assert controller_updates(HDETConfig.paper()) is None


def test_a_run_without_a_controller_needs_no_run_length_even_with_a_stop():
    """One replica (or auto_lr off): the default start stays a share of an unknown run, and an explicit stop is
    no reason to place it; the LR is the one given."""
    import torch

    from hdet_scale import HDETEnsemble
    from hdet_scale.engines.ddp import DDPAdapter
    from hdet_scale.topology import ReplicaTopology

    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    alone = ReplicaTopology.single_process()
    with pytest.warns(UserWarning, match="ONE replica"):
        hdet = HDETEnsemble(HDETConfig.from_dict({"auto_lr": {"stop": 300, "range_test": 0}}), DDPAdapter(optimizer),
                            topology=alone)
    assert hdet.few_updates_warning is None and hdet.current_lrs() == [0.1]
    hdet.close()
    off = HDETConfig.from_dict({"auto_lr": {"enabled": False, "stop": 300}})
    hdet = HDETEnsemble(off, DDPAdapter(optimizer), topology=ReplicaTopology(world_size=2, rank=0,
                                                                             ranks_per_replica=1))
    assert hdet.few_updates_warning is None
    hdet.close()


def test_a_config_is_checked_when_made_and_cannot_change_after():
    with pytest.raises(HDETConfigError, match="sync_interval"):
        HDETConfig(sync_interval=0)
    config = HDETConfig(sync_interval=5)
    with pytest.raises(HDETConfigError, match="alpha"):
        dataclasses.replace(config, alpha=-1.0)  # a changed copy is checked as well
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.sync_interval = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.auto_lr.range_test = 5


def test_the_ensemble_reads_the_config_resolved_at_the_front_door_without_checking_it_again(monkeypatch):
    config = resolve(HDETConfig(sync_interval=5, auto_lr={"range_test": 0}), total_steps=100)
    assert resolve(config, total_steps=100) is config
    monkeypatch.setattr(config_rules, "validate", lambda *_: pytest.fail("checked again below the front door"))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    hdet = HDETEnsemble(config, DDPAdapter(optimizer), topology=ReplicaTopology.single_process(), total_steps=100)
    assert hdet.config is config


def test_each_named_choice_is_the_literal_its_field_is_annotated_with():
    hints = {"": typing.get_type_hints(HDETConfig), "auto_lr.": typing.get_type_hints(AutoLRConfig)}
    for path, choices in config_rules.CHOICES.items():
        prefix, _, name = path.rpartition(".")
        assert typing.get_args(hints[prefix + "." if prefix else ""][name]) == choices, path
    replica_size = typing.get_args(hints[""]["ranks_per_replica"])
    assert replica_size[0] is int and typing.get_args(replica_size[1]) == config_rules.REPLICA_SIZE_NAMES


def test_alpha_zero_is_refused_where_the_controller_would_move_the_lr():
    """No spread gives the controller nothing to compare: the default log controller stayed at its first tenth of
    the LR for the whole run, without a word."""
    with pytest.raises(HDETConfigError, match=r"alpha=0 .* never move the LR from auto_lr.initial_scale=0.1 \(the "
                                              r"'log' mode's default\) times the given LR for the whole run"):
        HDETConfig.from_dict({"alpha": 0, "auto_lr": {"range_test": 0}})
    with pytest.raises(HDETConfigError, match=r"initial_scale=2 times the given LR"):
        HDETConfig.from_dict({"alpha": 0, "auto_lr": {"mode": "scale", "range_test": 0, "initial_scale": 2.0}})
    # accepted (a config is made only where it validates):
    HDETConfig.from_dict({"alpha": 0, "auto_lr": {"enabled": False}})  # plain data parallel
    HDETConfig.from_dict({"alpha": 0})  # the range test picks the LR, which holds
    HDETConfig.from_dict({"alpha": 0, "auto_lr": {"mode": "paper"}})  # eq. 8 decays it still
    # the LR at the given one while dropout is explored
    HDETConfig.from_dict({"alpha": 0, "auto_lr": {"mode": "scale", "range_test": 0},
                          "gradient_mode": "local", "explore": {"dropout": {"alpha": 0.3}}})
    pinned = {"range_test": 0, "initial_scale": 0.5, "scale_min": 0.5, "scale_max": 0.5}  # held where it is given
    assert HDETConfig.from_dict({"alpha": 0, "auto_lr": pinned}).auto_lr.filled().initial_scale == 0.5


def test_a_stop_before_the_start_is_refused_and_says_how_ints_and_floats_read():
    """"stop": 1 (meant as the run's end) is step 1: a log controller's error told the user to set initial_scale
    to 1, a scale controller only warned that its window was short."""
    with pytest.raises(HDETConfigError, match=r"auto_lr.stop=10 comes before auto_lr.start=20: an int is a step"):
        HDETConfig.from_dict({"auto_lr": {"range_test": 0, "start": 20, "stop": 10}}).for_run(1000)
    with pytest.raises(HDETConfigError, match=r"stop=0.1 comes before auto_lr.start=0.2: an int"):
        HDETConfig.from_dict({"auto_lr": {"mode": "scale", "range_test": 0, "start": 0.2, "stop": 0.1}})
    stop_at_one = HDETConfig.from_dict({"auto_lr": {"range_test": 0, "stop": 1}})  # the default start is a share
    with pytest.raises(HDETConfigError, match=r"auto_lr.stop=1 comes before auto_lr.start=0.02 \(step 1 before "
                                              r"step 20\): an int is a step and a float a share of the run \(1.0: "):
        stop_at_one.for_run(1000)
    assert HDETConfig.from_dict({"auto_lr": {"stop": 1.0}}).for_run(1000).auto_lr.stop == 1000
    kept_off = HDETConfig.from_dict({"auto_lr": {"start": 2000}}).for_run(1000).auto_lr  # starts past the end
    assert (kept_off.start, kept_off.stop) == (2000, 250)
    # a controller with nothing to move has no window to order: off, or the range test's LR held and nothing else
    for auto_lr in ({"enabled": False, "start": 100}, {"start": 100}):
        assert HDETConfig.from_dict({"auto_lr": auto_lr}).for_run(300).auto_lr.start == 100
    with pytest.raises(HDETConfigError, match="auto_lr.stop=0.25 comes before auto_lr.start=100"):  # weight decay
        HDETConfig.from_dict({"auto_lr": {"start": 100}, "explore": {"weight_decay": {}}}).for_run(300)


@pytest.mark.parametrize("values, explores_others, lr_spread, said", [
    # the controller off: its own fields do nothing (average_window still sets the probe's scored weights)
    ({"auto_lr": {"enabled": False, "beta": 0.8, "mode": "scale", "average_window": 0.2}}, False, True,
     ["auto_lr.mode, auto_lr.beta set for the auto-LR controller, which is off (auto_lr.enabled is false): they do "
      "nothing in this run; remove them, or set auto_lr.enabled to true"]),
    ({"auto_lr": {"enabled": False}}, False, True, []),
    # the range test picks the LR, which holds, and nothing else is explored
    ({"auto_lr": {"mode": "scale", "step_size": 1.0}}, False, False,
     ["auto_lr.mode, auto_lr.step_size set for the auto-LR controller, which moves nothing in this run: the LR range "
      "test (auto_lr.range_test=100; it runs unless set to 0) picks the LR, which then holds, and no other value is "
      "explored (explore, add_knob). Set auto_lr.range_test to 0 for the controller to move the LR, or remove them"]),
    ({"auto_lr": {"mode": "scale", "step_size": 1.0}}, True, False, []),  # it moves the other value
    ({"auto_lr": {"range_test": 50}}, False, False, []),  # nothing given for a controller
    ({"auto_lr": {"average_window": 0.2}}, False, False, []),  # the probe's scores read it
    # no spread of LRs and nothing else explored: the controller has nothing to compare
    ({"alpha": 0, "auto_lr": {"mode": "scale", "range_test": 0}}, False, False,
     ["alpha=0 gives every replica the same LR, so the auto-LR controller has no losses to compare and no other value "
      "is explored: it moves nothing in this run, and the LR stays the one given. Set alpha above 0 for the "
      "controller to move the LR, or auto_lr.enabled to false"]),
    ({"alpha": 0, "auto_lr": {"mode": "scale", "range_test": 0}}, True, False, []),  # the other value moves
    ({"alpha": 0, "auto_lr": {"mode": "paper"}}, False, False, []),  # eq. 8 decays the LR still
    ({"alpha": 0, "auto_lr": {"range_test": 0, "initial_scale": 0.5, "scale_min": 0.5, "scale_max": 0.5}}, False,
     False, []),  # held where it is given, on purpose
    # a field of another mode
    ({"auto_lr": {"mode": "scale", "range_test": 0, "max_log_step": 0.2}}, False, True,
     ["auto_lr.max_log_step=0.2 is read in 'log' mode only, and auto_lr.mode is 'scale': it does nothing in this run; "
      "remove it, or set auto_lr.mode to 'log'"]),
    ({"auto_lr": {"range_test": 0, "max_log_step": 0.2}}, False, True, []),
])
def test_settings_that_do_nothing_in_the_run_are_named_with_the_fix(values, explores_others, lr_spread, said):
    """A controller setting that a run does not read was taken without a word: the controller turned off with its
    fields left in, a scale-mode step size under the range test's held LR, alpha 0 with nothing else to compare,
    ``max_log_step`` outside ``log`` mode."""
    config = resolve(HDETConfig.from_dict({"ranks_per_replica": 1, **values}), total_steps=1000)
    assert unread_settings_warnings(config, 2, explores_others=explores_others, lr_spread=lr_spread) == said
    assert unread_settings_warnings(config, 1, explores_others=explores_others, lr_spread=lr_spread) == []


def test_the_first_step_says_what_the_runs_settings_do_not_move():
    """The ensemble reads the LR's spread from its replicas' multipliers at the first step (after every add_knob)
    and warns on rank 0, once."""
    config = HDETConfig.from_dict({"alpha": 0, "sync_interval": 100, "ranks_per_replica": 1,
                                   "auto_lr": {"mode": "scale", "range_test": 0}})
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    hdet = HDETEnsemble(config, DDPAdapter(optimizer), total_steps=1000,
                        topology=ReplicaTopology(world_size=2, rank=0, ranks_per_replica=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hdet.step(1.0)
        hdet.step(1.0)
    assert [str(warning.message) for warning in caught] == [
        "alpha=0 gives every replica the same LR, so the auto-LR controller has no losses to compare and no other "
        "value is explored: it moves nothing in this run, and the LR stays the one given. Set alpha above 0 for the "
        "controller to move the LR, or auto_lr.enabled to false"]
    state = hdet.state_dict()
    hdet.close()
    resumed = HDETEnsemble(config, DDPAdapter(optimizer), total_steps=1000, state=state,
                           topology=ReplicaTopology(world_size=2, rank=0, ranks_per_replica=1))
    with warnings.catch_warnings(record=True) as caught:  # a resumed run is told too
        warnings.simplefilter("always")
        resumed.step(1.0)
    assert [str(warning.message) for warning in caught] == [
        "alpha=0 gives every replica the same LR, so the auto-LR controller has no losses to compare and no other "
        "value is explored: it moves nothing in this run, and the LR stays the one given. Set alpha above 0 for the "
        "controller to move the LR, or auto_lr.enabled to false"]
    resumed.close()
