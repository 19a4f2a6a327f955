"""A first run on one machine explores: sharded engines get two replicas by default, and a run left with one
replica while HDET is set to explore says so once, on rank 0 and in train.py's header.

This file holds the tests on gloo ranks; the tests that start no process are in tests/unit/test_single_node.py and
the tests that start a launcher or script as a subprocess are in tests/e2e/test_single_node_e2e.py.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from distributed import run_ranks
from hdet_scale import HDETConfig


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
    # the default: the range test picks the LR, which the replicas share unspread (alpha unset)
    assert [rho for _, rho in results] == [1.0, 1.0]


def deepspeed_one_replica(rank: int, world: int) -> list[str]:
    from test_deepspeed import ds_config
    from test_deepspeed_distributed import build

    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build(ds_config(1, hdet={"ranks_per_replica": world}), seed=0)
    return [str(warning.message) for warning in caught if "ONE replica" in str(warning.message)]


def test_deepspeed_with_one_replica_warns_once_on_rank_zero():
    rank0, rank1 = run_ranks(deepspeed_one_replica, 2)
    assert len(rank0) == 1 and "2 rank(s), ranks_per_replica=2" in rank0[0]
    assert rank1 == []
