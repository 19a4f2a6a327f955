import argparse
import json

import pytest

from hdet_scale import HDETConfig, HDETConfigError, add_hdet_args, load_config


def test_defaults_are_the_papers():
    config = HDETConfig()
    assert config.alpha == pytest.approx(1 / 9)
    assert config.sync_interval == 1000
    assert config.auto_lr.warmup_steps == 100_000
    assert (config.auto_lr.beta, config.auto_lr.sigma, config.auto_lr.step_size) == (0.9, 0.1, 0.5)
    assert config.warm_init.nu == 0.01
    assert config.gradient_mode == "global" and config.auto_lr.mode == "scale"
    config.validate(world_size=8)


def test_round_trip_through_dict_and_json(tmp_path):
    config = HDETConfig.from_dict({"alpha": 0.25, "sync_interval": 10, "ranks_per_replica": 2,
                                   "gradient_mode": "local", "auto_lr": {"mode": "paper", "sigma": 0.05},
                                   "warm_init": {"enabled": True}})
    assert config.auto_lr.sigma == 0.05 and config.auto_lr.beta == 0.9 and config.warm_init.enabled
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
        ({"alpha": -0.1}, r"alpha must be a number in \[0.0, 1.0\), got -0.1"),
        ({"alpha": 1.0}, r"alpha must be a number in \[0.0, 1.0\), got 1.0 \(alpha >= 1 makes the lowest"),
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
        ({"auto_lr": {"warmup_steps": -1}}, r"auto_lr.warmup_steps must be an integer >= 0"),
        ({"auto_lr": {"scale_min": 2.0}}, r"must bracket auto_lr.initial_scale=1.0"),
        ({"auto_lr": {"initial_scale": 0.05}}, r"scale_min=0.1 and auto_lr.scale_max=10.0 must bracket "
                                               r"auto_lr.initial_scale=0.05"),
        ({"auto_lr": {"initial_scale": 0}}, r"auto_lr.initial_scale must be a number in \(0.0, inf\)"),
        ({"auto_lr": {"initial_scale": 0.5, "mode": "paper"}}, r"initial_scale=0.5 needs the controller on"),
        ({"auto_lr": {"initial_scale": 0.5, "enabled": False}}, r"initial_scale=0.5 needs the controller on"),
        ({"auto_lr": {"enabled": "yes"}}, r"auto_lr.enabled must be true or false"),
        ({"warm_init": {"nu": -0.01}}, r"warm_init.nu must be a number in \[0.0, inf\)"),
        ({"average_optimizer_state": 1}, r"average_optimizer_state must be true or false"),
        ({"alpah": 0.1}, r"unknown HDET setting 'alpah'; did you mean 'alpha'\?"),
        ({"auto_lr": {"lambda": 0.5}}, r"unknown HDET setting 'auto_lr.lambda'"),
        ({"auto_lr": 3}, r"auto_lr must be a JSON object"),
        ({"spread": "cubic"}, r"spread must be one of 'linear', 'log', got 'cubic'"),
        ({"auto_lr": {"max_log_step": 0}}, r"auto_lr.max_log_step must be a number in \(0.0, inf\)"),
        ({"auto_lr": {"average_window": 1.0}}, r"auto_lr.average_window must be a number in \[0.0, 1.0\)"),
        ({"auto_lr": {"displacement": -1}}, r"auto_lr.displacement must be a number in \[0.0, inf\)"),
        ({"auto_lr": {"displacement": 0.5, "mode": "paper"}}, r"auto_lr.displacement works in 'scale' and 'log'"),
    ],
)
def test_bad_values_name_the_field(values, message):
    with pytest.raises(HDETConfigError, match=message):
        HDETConfig.from_dict(values)


def test_world_size_must_divide():
    config = HDETConfig(ranks_per_replica=4)
    with pytest.raises(HDETConfigError, match="ranks_per_replica=4 does not divide the world size 6"):
        config.validate(world_size=6)
    assert config.num_replicas(8) == 2


def test_replica_size_by_name(monkeypatch):
    """'node' is the launcher's ranks per node; 'auto' is a rank for unsharded engines and a node for sharded."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "8")  # the deepspeed launcher's name
    assert HDETConfig(ranks_per_replica="node").resolved().ranks_per_replica == 8
    assert HDETConfig().resolved(auto="node").ranks_per_replica == 8
    assert HDETConfig().resolved().ranks_per_replica == 1
    assert HDETConfig(ranks_per_replica=2).resolved(auto="node").ranks_per_replica == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's name wins where both are set
    assert HDETConfig(ranks_per_replica="node").num_replicas(16) == 4
    with pytest.raises(HDETConfigError, match=r"ranks_per_replica=4 \(from 'node'\) does not divide the world size 6"):
        HDETConfig(ranks_per_replica="node").validate(world_size=6)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("LOCAL_SIZE")
    with pytest.raises(HDETConfigError, match="ranks_per_replica='node' needs the ranks per node"):
        HDETConfig().resolved(auto="node")


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


def test_a_log_spread_takes_any_alpha():
    assert HDETConfig.from_dict({"alpha": 1.0, "spread": "log"}).alpha == 1.0  # multipliers 1/2 .. 2
    with pytest.raises(HDETConfigError, match="spread 'log' allows it"):
        HDETConfig.from_dict({"alpha": 1.0})


def test_the_controller_start_as_a_share_of_the_run():
    config = HDETConfig.from_dict({"auto_lr": {"start_fraction": 0.05}})
    assert config.auto_lr.start_fraction == 0.05
    run = config.for_run(1500)
    assert (run.auto_lr.warmup_steps, run.auto_lr.start_fraction) == (75, None)  # 0.05 x 1500
    assert config.for_run(7).auto_lr.warmup_steps == 0  # round(0.35)
    assert HDETConfig.from_dict({"auto_lr": {"start_fraction": 0.1}}).for_run(7).auto_lr.warmup_steps == 1
    plain = HDETConfig()
    assert plain.for_run(10) is plain  # warmup_steps as given
    with pytest.raises(HDETConfigError, match="give one of them"):
        HDETConfig.from_dict({"auto_lr": {"start_fraction": 0.1, "warmup_steps": 10}})
    with pytest.raises(HDETConfigError, match=r"auto_lr.start_fraction must be a number in \[0.0, 1.0\)"):
        HDETConfig.from_dict({"auto_lr": {"start_fraction": 1.0}})
    with pytest.raises(HDETConfigError, match="total_steps"):
        config.for_run(0)


def test_a_start_fraction_without_the_runs_length_is_refused():
    import torch

    from hdet_scale import HDETEnsemble
    from hdet_scale.engines.ddp import DDPAdapter
    from hdet_scale.topology import ReplicaTopology

    config = HDETConfig.from_dict({"ranks_per_replica": 1, "auto_lr": {"start_fraction": 0.1}})
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    topology = ReplicaTopology(world_size=1, rank=0, ranks_per_replica=1)
    with pytest.raises(HDETConfigError, match=r"needs the run's length: pass config.for_run\(total_steps\)"):
        HDETEnsemble(config, DDPAdapter(optimizer), topology=topology)
    with pytest.warns(UserWarning, match="ONE replica"):
        HDETEnsemble(config.for_run(100), DDPAdapter(optimizer), topology=topology).close()


def test_a_start_fraction_survives_the_round_trip():
    config = HDETConfig.from_dict({"auto_lr": {"start_fraction": 0.2}})
    assert HDETConfig.from_dict(config.to_dict()) == config


def test_the_controller_stop_as_steps_or_a_share_of_the_run():
    config = HDETConfig.from_dict({"auto_lr": {"start_fraction": 0.05, "stop_fraction": 0.5}}).for_run(1500)
    assert (config.auto_lr.warmup_steps, config.auto_lr.stop_steps) == (75, 750)
    assert (config.auto_lr.start_fraction, config.auto_lr.stop_fraction) == (None, None)
    assert HDETConfig.from_dict({"auto_lr": {"stop_steps": 300}}).auto_lr.stop_steps == 300
    with pytest.raises(HDETConfigError, match="give one of them"):
        HDETConfig.from_dict({"auto_lr": {"stop_steps": 300, "stop_fraction": 0.5}})
    with pytest.raises(HDETConfigError, match=r"auto_lr.stop_fraction must be a number in \(0.0, 1.0\]"):
        HDETConfig.from_dict({"auto_lr": {"stop_fraction": 0.0}})
    with pytest.raises(HDETConfigError, match="work in 'scale' and 'log' mode"):
        HDETConfig.from_dict({"auto_lr": {"mode": "paper", "stop_steps": 10}})
