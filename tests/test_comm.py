"""Bucketed averaging over cross-replica groups on 4 real gloo ranks (2 replicas x 2 positions)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from hdet_scale import HDETConfig, ReplicaTopology
from hdet_scale.comm import average_tensors, gather_rows, healthy_mean_, pack_healthy, unpack_healthy_mean

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
    sent = average_tensors(mine, topology.cross_replica_group, bucket_bytes=bucket_bytes)
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
                    bucket_bytes=bucket_bytes)
    for got, want in zip(survivors, reference, strict=True):
        assert torch.equal(got, want)

    # The same, decided on the device: a replica whose part of a bucket is non-finite is left out of that
    # bucket only (with one bucket per tensor here, of that tensor only).
    poisoned = rank_tensors(rank, topology.position)
    first = 0 if topology.position == 0 else len(poisoned) - 1  # the (3, 5) fp32 tensor
    if topology.replica_index == 1:
        poisoned[first][1, 1] = float("inf")
    average_tensors(poisoned, topology.cross_replica_group, skip_non_finite=True, bucket_bytes=bucket_bytes)
    if bucket_bytes == 64 and topology.position == 0:  # 15 values a bucket: the (3, 5) tensor is one bucket
        assert torch.equal(poisoned[first], reference[first])
        assert torch.allclose(poisoned[2].double(), torch.stack([p[2].double() for p in peer_tensors]).mean(0),
                              rtol=1e-2, atol=1e-2)  # the next bucket: both replicas
    assert all(torch.isfinite(tensor).all() for tensor in poisoned)

    with pytest.raises(ValueError, match="non-contiguous"):
        average_tensors([torch.zeros(4, 4).t()], topology.cross_replica_group, bucket_bytes=bucket_bytes)
    with pytest.raises(TypeError, match="floating-point tensors only"):
        average_tensors([torch.zeros(3, dtype=torch.int64)], topology.cross_replica_group,
                        bucket_bytes=bucket_bytes)

    table = gather_rows([float(rank), 2.0 * rank], world_size=world)
    assert table.tolist() == [[float(r), 2.0 * r] for r in range(world)]
    return sent


def expected_bytes(bucket_bytes: int) -> int:
    """fp32 buckets and an fp64 one (fp64 kept as fp64), each bucket ending in its contributor count."""
    sent = 0
    for numel, itemsize in ((FP32_ELEMENTS, 4), (4, 8)):
        per_bucket = min(bucket_bytes // itemsize - 1, numel)  # payload elements beside the count
        sent += (numel + -(-numel // per_bucket)) * itemsize
    return sent


def test_bucketed_average_matches_an_independent_mean():
    assert FP32_ELEMENTS % 3 == 0
    sent = run_ranks(averaging, 4)
    assert sent == [[expected_bytes(size) for size in BUCKET_SIZES]] * 4
    assert expected_bytes(25 * 2**20) == (FP32_ELEMENTS + 1) * 4 + (4 + 1) * 8


def test_one_replica_averages_nothing():
    tensor = torch.ones(3)
    assert average_tensors([tensor], None, bucket_bytes=64) == 0
    assert torch.equal(tensor, torch.ones(3))


def healthy_means(rank: int, world: int) -> None:
    values = torch.arange(6, dtype=torch.float64) + 10 * rank  # rank r holds 10 r, 10 r + 1, ...
    for dtype in (torch.float32, torch.bfloat16):
        tensor = values.to(dtype)
        if rank == 1:
            tensor[2] = float("nan")
        sent = healthy_mean_(tensor, dist.group.WORLD)
        healthy = [r for r in range(world) if r != 1]
        expected = torch.stack([torch.arange(6, dtype=torch.float64) + 10 * r for r in healthy]).mean(0)
        assert torch.allclose(tensor.double(), expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)
        assert sent == 7 * tensor.element_size()  # the values and the count, in their own dtype
    everyone = torch.full((3,), float("inf"))
    healthy_mean_(everyone, dist.group.WORLD)
    assert healthy_mean_(torch.ones(2), None) == 0  # one replica: no group, nothing to do
    assert torch.equal(everyone, torch.zeros(3))  # nobody contributed: zeros, not a division by zero


def test_gradient_mean_leaves_out_non_finite_members():
    run_ranks(healthy_means, 4)


def test_packing_counts_exactly_in_low_precision():
    packed = pack_healthy(torch.tensor([2.0, 4.0], dtype=torch.bfloat16), 4)
    assert packed.dtype == torch.bfloat16 and packed.tolist() == [0.5, 1.0, 1.0]
    assert pack_healthy(torch.ones(2, dtype=torch.bfloat16), 257).dtype == torch.float32  # 257 is not a bf16
    assert pack_healthy(torch.tensor([1.0, -math.inf]), 2).tolist() == [0.0, 0.0, 0.0]
    out = torch.empty(2, dtype=torch.bfloat16)
    summed = torch.tensor([1.5, 3.0, 3.0])  # three of four members contributed
    assert unpack_healthy_mean(summed, out, 4).tolist() == [2.0, 4.0]
