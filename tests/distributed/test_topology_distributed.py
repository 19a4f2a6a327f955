"""Replica groups on gloo ranks: ranks that disagree on the replica size are stopped before any group is built.

The layout arithmetic without processes is in tests/unit/test_topology.py."""

from __future__ import annotations

import os

import pytest

from distributed import run_ranks
from hdet_scale import HDETConfig, HDETConfigError, ReplicaTopology


def build_on_uneven_nodes(rank: int, world: int, engine: str) -> str:
    from torch import nn

    from hdet_scale.engines.fsdp import wrap

    # ranks 0 (and 1 of 3) on a node of 2 ranks, the last alone on another: each node's launcher gives its own
    # count; of 3 ranks, 2 do not divide the world on the first node while 1 does on the other
    os.environ["LOCAL_WORLD_SIZE"] = "1" if rank == world - 1 else "2"
    with pytest.raises(HDETConfigError) as caught:
        if engine == "fsdp":  # FSDP2 builds its mesh from the replica size
            wrap(nn.Linear(2, 2), HDETConfig(ranks_per_replica="node"), block_classes=[])
        else:  # DDP and DeepSpeed build their groups from it
            ReplicaTopology.build(HDETConfig(ranks_per_replica="node"))
    return str(caught.value)


@pytest.mark.parametrize("engine", ["groups", "fsdp"])
@pytest.mark.parametrize("world", [2, 3])
def test_nodes_with_different_rank_counts_are_refused_on_every_rank(engine, world):
    """The ranks built different groups (or meshes) and waited for each other until the collectives' timeout; of
    3 ranks, FSDP2's first node refused alone and the other waited."""
    messages = run_ranks(build_on_uneven_nodes, world, engine, timeout=60)
    for rank, message in enumerate(messages):
        assert message.startswith(f"the ranks disagree on ranks_per_replica: 2 on rank 0 but 1 on rank {world - 1}")
        assert f"(this is rank {rank})" in message


def build_even(rank: int, world: int) -> tuple[int, int]:
    import torch.distributed as dist

    # torch before 2.13 has no all_gather_single (the library supports torch 2.6 and later)
    if hasattr(dist, "all_gather_single"):
        del dist.all_gather_single
    topology = ReplicaTopology.build(HDETConfig(ranks_per_replica=2))
    return topology.num_replicas, topology.position


def test_ranks_that_agree_build_their_groups_with_the_collectives_of_every_supported_torch():
    """The check that the ranks agree called all_gather_single, which torch has only from 2.13 on: every attach
    failed on the torch versions before it."""
    assert run_ranks(build_even, 4) == [(2, 0), (2, 1), (2, 0), (2, 1)]


def build_twice_and_after_a_new_default_group(rank: int, world: int) -> list[bool]:
    import torch
    import torch.distributed as dist

    from hdet_scale.engines.zero import ReplicaMPU

    config = HDETConfig(ranks_per_replica=2)
    first, second = ReplicaTopology.build(config), ReplicaTopology.build(config)
    first_mpu, second_mpu = ReplicaMPU(first), ReplicaMPU(second)
    reused = [first.cross_replica_group is second.cross_replica_group,
              first.intra_replica_group is second.intra_replica_group,
              first_mpu.get_model_parallel_group() is second_mpu.get_model_parallel_group()]
    store = dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    anew = ReplicaTopology.build(config)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=anew.cross_replica_group)  # the new groups work in the new default group
    return [*reused, anew.cross_replica_group is not first.cross_replica_group,
            total.item() == float(rank % 2 + rank % 2 + 2)]


def test_a_second_run_in_one_process_takes_the_groups_of_the_first():
    """Each attach built new groups: a hyperparameter search's trials (or fit() again) piled up NCCL communicators
    and gloo threads until the process ended. A default group made anew gets groups of its own."""
    assert run_ranks(build_twice_and_after_a_new_default_group, 4) == [[True] * 5] * 4


def groups_kept_until_shut_down(rank: int, world: int) -> list[bool]:
    import gc
    import weakref

    from hdet_scale.comm import shut_down
    from hdet_scale.engines.fsdp import build_mesh

    config = HDETConfig(ranks_per_replica=2)
    same_mesh = build_mesh(config, "cpu") is build_mesh(config, "cpu")
    group = weakref.ref(ReplicaTopology.build(config).cross_replica_group)
    gc.collect()
    kept = group() is not None  # the cache holds it for the next run in this process
    shut_down()
    return [same_mesh, kept, group() is None]


def test_the_groups_kept_for_later_runs_go_with_shut_down():
    """FSDP2's mesh was built anew at every wrap; and the groups kept for later runs outlived shut_down, whose
    purpose is that no group's threads live into the interpreter's exit."""
    assert run_ranks(groups_kept_until_shut_down, 4) == [[True] * 3] * 4


def fsdp_auto_on_one_node(rank: int, world: int) -> int:
    from torch import nn

    from hdet_scale.engines.fsdp import wrap

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # one node of 2 ranks, started without WORLD_SIZE in the environment
    os.environ.pop("WORLD_SIZE", None)
    _, hdet = wrap(nn.Linear(2, 2), HDETConfig(ranks_per_replica="auto"), block_classes=[])
    return hdet.topology.num_replicas


def test_fsdp2_auto_on_one_node_reads_the_world_size_of_the_process_group():
    """Resolved without the world size, "auto" read the launcher's WORLD_SIZE, and without one took the whole node
    as one replica, where it means two replicas on a single node."""
    assert run_ranks(fsdp_auto_on_one_node, 2) == [2, 2]
