import pytest

from hdet_scale import HDETConfig, ReplicaTopology
from hdet_scale.config import HDETConfigError
from hdet_scale.topology import with_replica_size


def test_replica_major_layout():
    layout = ReplicaTopology(rank=6, world_size=8, ranks_per_replica=4)
    assert (layout.num_replicas, layout.replica_index, layout.position) == (2, 1, 2)
    assert layout.replica_ranks(1) == [4, 5, 6, 7]
    assert layout.cross_replica_ranks(2) == [2, 6]  # the same shard position in every replica
    assert [ReplicaTopology(rank, 8, 4).replica_index for rank in range(8)] == [0] * 4 + [1] * 4


def test_every_rank_a_replica_is_the_papers_setting():
    layout = ReplicaTopology(rank=3, world_size=4, ranks_per_replica=1)
    assert (layout.num_replicas, layout.replica_index, layout.position) == (4, 3, 0)
    assert layout.cross_replica_ranks(0) == [0, 1, 2, 3]


def test_without_torch_distributed_there_is_one_replica():
    assert ReplicaTopology.build(HDETConfig()).num_replicas == 1
    with pytest.raises(ValueError, match="needs torch.distributed to be initialized"):
        ReplicaTopology.build(HDETConfig(ranks_per_replica=2))


def test_a_node_given_by_the_caller_needs_no_launcher_variable(monkeypatch):
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    node = HDETConfig(ranks_per_replica="node")
    assert with_replica_size(node, node_size=4).ranks_per_replica == 4
    auto = HDETConfig(ranks_per_replica="auto")
    assert with_replica_size(auto, auto="node", world_size=8, node_size=4).ranks_per_replica == 4  # two nodes
    assert with_replica_size(auto, auto="node", world_size=4, node_size=4).ranks_per_replica == 2  # one node: halves
    with pytest.raises(HDETConfigError, match="ranks_per_replica='node' needs the ranks per node"):
        with_replica_size(node)
