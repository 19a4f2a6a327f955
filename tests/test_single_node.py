"""A first run on one machine explores: sharded engines get two replicas by default, and a run left with one
replica while HDET is set to explore says so once, on rank 0 and in train.py's header."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from launcher import SHORT, launch, torchrun
from torch import nn

from distributed import run_ranks
from hdet_scale import AutoLRConfig, HDETConfig, HDETEnsemble, ReplicaTopology
from hdet_scale.engines.ddp import DDPAdapter
from hdet_scale.topology import with_replica_size


@pytest.mark.parametrize(("per_node", "world", "expected"), [
    (8, 8, 4),  # one 8-GPU box: 2 replicas of 4
    (8, 16, 8),  # 2 nodes: a replica per node
    (6, 6, 3),
    (3, 3, 1),  # 3 ranks: 3 replicas of 1
    (1, 1, 1),  # one rank: nothing to split
    (4, 6, 4),  # a node that does not divide the world: left to the layout check
])
def test_auto_replica_size_leaves_two_replicas_on_one_node(monkeypatch, per_node, world, expected):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert with_replica_size(HDETConfig(), auto="node").ranks_per_replica == expected
    assert with_replica_size(HDETConfig(), auto="node", world_size=2 * per_node).ranks_per_replica == per_node
    assert with_replica_size(HDETConfig()).ranks_per_replica == 1  # unsharded engines: every rank a replica
    assert with_replica_size(HDETConfig(ranks_per_replica="node")).ranks_per_replica == per_node  # asked for: kept


def ensemble(config: HDETConfig) -> HDETEnsemble:
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    return HDETEnsemble(config, DDPAdapter(optimizer), topology=ReplicaTopology.single_process())


def test_one_replica_is_said_once_where_hdet_would_explore():
    with pytest.warns(UserWarning, match=r"HDET has ONE replica \(1 rank\(s\), ranks_per_replica=1\)"):
        hdet = ensemble(HDETConfig())
    assert "plain data parallel" in hdet.single_replica_warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # nothing to explore: nothing lost
        quiet = ensemble(HDETConfig(spread="linear", alpha=0.0, auto_lr=AutoLRConfig(mode="scale", enabled=False)))
    assert quiet.single_replica_warning is None


def fsdp_default(rank: int, world: int) -> tuple[int, float]:
    from hdet_scale.engines.fsdp import wrap

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # two replicas: no one-replica warning
        model, hdet = wrap(nn.Sequential(nn.Linear(4, 4)), HDETConfig(), block_classes=[])
        hdet.attach(torch.optim.SGD(model.parameters(), lr=0.1), total_steps=100_000)
    return hdet.topology.num_replicas, hdet.ensemble.lr_multiplier()


def test_fsdp2_on_one_node_has_two_replicas_by_default():
    results = run_ranks(fsdp_default, 2)  # the launcher's LOCAL_WORLD_SIZE is 2: one node of 2 ranks
    assert [replicas for replicas, _ in results] == [2, 2]
    assert sorted(rho for _, rho in results) == pytest.approx([1 / 1.5, 1.5])  # the default: alpha 0.5, log


def deepspeed_one_replica(rank: int, world: int) -> list[str]:
    from test_deepspeed import build, ds_config

    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build(ds_config(1, hdet={"ranks_per_replica": world}), seed=0)
    return [str(warning.message) for warning in caught if "ONE replica" in str(warning.message)]


def test_deepspeed_with_one_replica_warns_once_on_rank_zero():
    rank0, rank1 = run_ranks(deepspeed_one_replica, 2)
    assert len(rank0) == 1 and "2 rank(s), ranks_per_replica=2" in rank0[0]
    assert rank1 == []


@pytest.mark.e2e
def test_train_header_warns_of_one_replica(tmp_path):
    hdet = tmp_path / "hdet.json"
    hdet.write_text(json.dumps({"ranks_per_replica": 2, "sync_interval": 5}))
    result = launch([*torchrun(2), *SHORT[:2], "--steps", "5", *SHORT[4:], "--hdet_config", str(hdet),
                     "--out", str(tmp_path)], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    header = result.stdout.split("HDET train:")[1].splitlines()
    assert "replicas=1 ranks_per_replica=2" in header[0]
    assert header[1].startswith("WARNING: HDET has ONE replica (2 rank(s), ranks_per_replica=2)")
