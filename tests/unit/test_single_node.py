"""A first run on one machine explores: sharded engines get two replicas by default, and a run left with one
replica while HDET is set to explore says so once, on rank 0 and in train.py's header.

This file holds the tests that start no process; the tests on gloo ranks are in
tests/distributed/test_single_node_distributed.py and the tests that start a launcher or script as a subprocess are
in tests/e2e/test_single_node_e2e.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

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
