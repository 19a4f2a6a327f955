"""Bucketed averaging over cross-replica groups on 4 real gloo ranks (2 replicas x 2 positions)."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from hdet_scale import HDETConfig, ReplicaTopology
from hdet_scale.comm import average_tensors, gather_rows

SHAPES_AND_DTYPES = [
    ((3, 5), torch.float32),
    ((0,), torch.float32),  # an empty shard
    ((7,), torch.bfloat16),
    ((2, 2), torch.float16),
    ((4,), torch.float64),
    ((1000,), torch.float32),  # spans many buckets at the tiny bucket size below
    ((0, 3), torch.bfloat16),
]


def rank_tensors(rank: int, position: int) -> list[torch.Tensor]:
    """Each rank's local shards: the same shapes at the same position in every replica, values by rank."""
    generator = torch.Generator().manual_seed(rank)
    shapes = SHAPES_AND_DTYPES if position == 0 else list(reversed(SHAPES_AND_DTYPES))
    return [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for shape, dtype in shapes]


FP32_ELEMENTS = sum(torch.Size(shape).numel() for shape, dtype in SHAPES_AND_DTYPES if dtype != torch.float64)
BUCKET_SIZES = [
    64,  # many buckets, a tensor split across several
    4 * FP32_ELEMENTS // 3,  # three buckets, the last one filling exactly at the end
    4 * FP32_ELEMENTS,  # one bucket, exactly full
    25 * 2**20,  # the default: one partly filled bucket
]


def averaging(rank: int, world: int) -> list[int]:
    topology = ReplicaTopology.build(HDETConfig(ranks_per_replica=2))
    return [averaging_with(rank, world, topology, bucket_bytes) for bucket_bytes in BUCKET_SIZES]


def averaging_with(rank: int, world: int, topology: ReplicaTopology, bucket_bytes: int) -> int:
    peers = topology.cross_replica_ranks(topology.position)
    mine = rank_tensors(rank, topology.position)
    sent = average_tensors(mine, topology.cross_replica_group, contribute=True, num_contributors=2,
                           bucket_bytes=bucket_bytes)
    # Independent: rebuild the peers' tensors and average them in fp64.
    peer_tensors = [rank_tensors(peer, topology.position) for peer in peers]
    tolerance = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-6, torch.float64: 1e-12}
    for index, tensor in enumerate(mine):
        expected = torch.stack([p[index].double() for p in peer_tensors]).mean(0)
        assert tensor.dtype == peer_tensors[0][index].dtype and tensor.shape == peer_tensors[0][index].shape
        assert torch.allclose(tensor.double(), expected, rtol=tolerance[tensor.dtype], atol=tolerance[tensor.dtype])

    # A non-contributing replica sends zeros and receives the contributors' mean, bit for bit.
    survivors = rank_tensors(rank, topology.position)
    reference = [t.clone() for t in rank_tensors(peers[0], topology.position)]
    if topology.replica_index == 1:
        survivors[0].fill_(float("nan"))
    average_tensors(survivors, topology.cross_replica_group, contribute=topology.replica_index == 0,
                    num_contributors=1, bucket_bytes=bucket_bytes)
    for got, want in zip(survivors, reference, strict=True):
        assert torch.equal(got, want)

    with pytest.raises(ValueError, match="non-contiguous"):
        average_tensors([torch.zeros(4, 4).t()], topology.cross_replica_group, contribute=True,
                        num_contributors=2, bucket_bytes=bucket_bytes)
    with pytest.raises(TypeError, match="floating-point tensors only"):
        average_tensors([torch.zeros(3, dtype=torch.int64)], topology.cross_replica_group, contribute=True,
                        num_contributors=2, bucket_bytes=bucket_bytes)

    table = gather_rows([float(rank), 2.0 * rank], world_size=world)
    assert table.tolist() == [[float(r), 2.0 * r] for r in range(world)]
    return sent


def test_bucketed_average_matches_an_independent_mean():
    assert FP32_ELEMENTS % 3 == 0
    sent = run_ranks(averaging, 4)
    assert sent == [[FP32_ELEMENTS * 4 + 4 * 8] * len(BUCKET_SIZES)] * 4  # fp32 buckets, fp64 kept as fp64


def test_one_replica_averages_nothing():
    tensor = torch.ones(3)
    assert average_tensors([tensor], None, contribute=True, num_contributors=1, bucket_bytes=64) == 0
    assert torch.equal(tensor, torch.ones(3))
