"""Bucketed averaging over cross-replica groups on 4 real gloo ranks (2 replicas x 2 positions).

This file holds the tests on gloo ranks; the tests that start no process are in tests/unit/test_comm.py and the tests
that start a launcher or script as a subprocess are in tests/e2e/test_comm_e2e.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from distributed import run_ranks
from hdet_scale import HDETConfig, ReplicaTopology
from hdet_scale.averaging import average_replica_gradients, average_tensors
from hdet_scale.comm import HealthyMean, gather_rows, healthy_mean_hook

SHAPES_AND_DTYPES = [
    ((3, 5), torch.float32),
    ((0,), torch.float32),  # an empty shard
    ((7,), torch.bfloat16),
    ((2, 2), torch.float16),
    ((4,), torch.float64),
    ((1000,), torch.float32),  # spans many buckets at the tiny bucket size below
    ((0, 3), torch.bfloat16),
    ((2, 3, 2, 2), torch.float32),  # laid out channels_last (a convolution weight): dense, not contiguous
    ((2, 3, 2, 2, 2), torch.bfloat16),  # channels_last_3d
]
LAYOUTS = {4: torch.channels_last, 5: torch.channels_last_3d}


def rank_tensors(rank: int, position: int) -> list[torch.Tensor]:
    """Each rank's local shards: the same shapes at the same position in every replica, values by rank."""
    generator = torch.Generator().manual_seed(rank)
    shapes = SHAPES_AND_DTYPES if position == 0 else list(reversed(SHAPES_AND_DTYPES))
    tensors = [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for shape, dtype in shapes]
    return [t.to(memory_format=LAYOUTS[t.dim()]) if t.dim() in LAYOUTS else t for t in tensors]


FP32_ELEMENTS = sum(torch.Size(shape).numel() for shape, dtype in SHAPES_AND_DTYPES if dtype != torch.float64)
BUCKET_SIZES = [
    64,  # many buckets, a tensor split across several; the 1000-value tensor is all-reduced in place
    4 * FP32_ELEMENTS // 3,  # a few buckets; the 1000-value tensor in place
    4 * FP32_ELEMENTS,  # everything packed: one bucket, and a second for what the count displaced
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

    # The buckets a caller keeps between calls (the ensemble's, between syncs) serve the next: the same mean.
    memory: list[torch.Tensor] = []
    for _ in range(2):
        again = rank_tensors(rank, topology.position)
        average_tensors(again, topology.cross_replica_group, bucket_bytes=bucket_bytes, memory=memory)
        for got, want in zip(again, mine, strict=True):
            assert torch.equal(got, want)

    # A non-contributing replica sends zeros and receives the contributors' mean, bit for bit, whether the host
    # knows it or only the device does, or the replica has a non-finite value anywhere.
    reference = [t.clone() for t in rank_tensors(peers[0], topology.position)]
    excluded = topology.replica_index == 1
    for how in ("host", "device", "non-finite"):
        survivors = rank_tensors(rank, topology.position)
        if excluded:
            survivors[0 if topology.position == 0 else -1][1, 1] = float("nan" if how == "host" else "inf")
        contribute = {"host": not excluded, "device": torch.tensor(not excluded), "non-finite": True}[how]
        average_tensors(survivors, topology.cross_replica_group, contribute=contribute,
                        skip_non_finite=how == "non-finite", bucket_bytes=bucket_bytes)
        for got, want in zip(survivors, reference, strict=True):
            assert torch.equal(got, want), how
    # No member finite: NaN, what a plain mean gives (zeros hid it: a step on zeros, as if all were well); no member
    # contributing by choice: zeros.
    broken = rank_tensors(rank, topology.position)
    broken[-1][(0,) * broken[-1].dim()] = float("inf")
    average_tensors(broken, topology.cross_replica_group, skip_non_finite=True, bucket_bytes=bucket_bytes)
    assert all(tensor.isnan().all() for tensor in broken)
    idle = rank_tensors(rank, topology.position)
    average_tensors(idle, topology.cross_replica_group, contribute=False, bucket_bytes=bucket_bytes)
    assert all(tensor.eq(0).all() for tensor in idle)

    # The score table rides in the first bucket: each rank's row, summed exactly; a check that refuses leaves
    # every tensor as it was.
    def row(r: int) -> list[float]:
        return [1.0 / 3 + r, float("nan") if r == 2 else 1e6 * r]

    rider = torch.zeros(world, 2, dtype=torch.float64)
    rider[rank] = torch.tensor(row(rank), dtype=torch.float64)
    seen = []
    untouched = rank_tensors(rank, topology.position)
    with pytest.raises(FloatingPointError, match="refused"):
        average_tensors(untouched, topology.cross_replica_group, rider=rider, bucket_bytes=bucket_bytes,
                        check=lambda summed: seen.append(summed.clone()) or _refuse())
    for got, want in zip(untouched, rank_tensors(rank, topology.position), strict=True):
        assert torch.equal(got, want)
    peers_rows = torch.tensor([row(r) for r in peers], dtype=torch.float64)
    assert torch.allclose(seen[0][peers], peers_rows, rtol=1e-13, equal_nan=True)  # hi + lo: ~48 bits
    assert seen[0][[r for r in range(world) if r not in peers]].eq(0).all()  # not in this group: zeros

    with pytest.raises(ValueError, match="non-contiguous"):
        average_tensors([torch.zeros(4, 4).t()], topology.cross_replica_group, bucket_bytes=bucket_bytes)
    with pytest.raises(TypeError, match="floating-point tensors only"):
        average_tensors([torch.zeros(3, dtype=torch.int64)], topology.cross_replica_group,
                        bucket_bytes=bucket_bytes)

    table = gather_rows([float(rank), 2.0 * rank], world_size=world)
    assert table.tolist() == [[float(r), 2.0 * r] for r in range(world)]
    return sent


def _refuse() -> None:
    raise FloatingPointError("refused by the test")


def test_bucketed_average_matches_an_independent_mean():
    sent = run_ranks(averaging, 4)
    # fp32 values, fp64 values kept as fp64, and one contributor count (fp32: the first kind packed)
    assert sent == [[FP32_ELEMENTS * 4 + 4 * 8 + 4] * len(BUCKET_SIZES)] * 4


class _ComputeCounter(TorchDispatchMode):
    """Counts the operators that compute (not views) dispatched while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def operators_per_average(rank: int, world: int) -> list[int]:
    counts = []
    for tensors in (20, 200):
        values = [torch.full((10,), float(rank + i)) for i in range(tensors)]
        with _ComputeCounter() as counter:  # a flag as the guard gives it: read once (CPU) or masked (accelerator)
            average_tensors(values, dist.group.WORLD, bucket_bytes=2**20, contribute=torch.tensor(True))
        assert torch.allclose(values[7], torch.full((10,), 7.5))  # the mean of 7 and 8
        counts.append(counter.count)
    return counts


def test_packing_masking_and_unpacking_cost_the_same_operators_for_any_number_of_tensors():
    """On a GPU every operator is a kernel launch: one per tensor and pass made a sync's local work cost as much
    as its transfer. Ten times the tensors in one bucket dispatch the same operators. (The finiteness check is
    one fused pass per device on an accelerator, and one sum per tensor on the CPU, where that is several times
    faster.)"""
    for few, many in run_ranks(operators_per_average, 2):
        assert few == many


def healthy_means(rank: int, world: int) -> None:
    values = torch.arange(6, dtype=torch.float64) + 10 * rank  # rank r holds 10 r, 10 r + 1, ...
    for dtype in (torch.float32, torch.bfloat16):
        tensor = values.to(dtype)
        if rank == 1:
            tensor[2] = float("nan")
        sent = HealthyMean(dist.group.WORLD)(tensor)
        healthy = [r for r in range(world) if r != 1]
        expected = torch.stack([torch.arange(6, dtype=torch.float64) + 10 * r for r in healthy]).mean(0)
        assert torch.allclose(tensor.double(), expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)
        assert sent == 7 * tensor.element_size()  # the values and the count, in their own dtype
    everyone = torch.full((3,), float("inf"))
    HealthyMean(dist.group.WORLD)(everyone)
    assert everyone.isnan().all()  # nobody finite: NaN, as a plain mean (a GradScaler then skips the step)


def test_gradient_mean_leaves_out_non_finite_members():
    run_ranks(healthy_means, 4)


def replica_gradients(rank: int, world: int) -> None:
    """2 replicas of 2 ranks; replica 1's second shard holds an inf, its first is finite."""
    topology = ReplicaTopology.build(HDETConfig(ranks_per_replica=2))
    shards = lambda r: [torch.full((3,), float(r + 1)), torch.full((2,), 10.0 * (r + 1))]  # noqa: E731
    mine = shards(rank)
    if rank == 3:
        mine[1][0] = float("inf")
    average_replica_gradients(mine, topology, bucket_bytes=64)
    # replica 1 is left out whole: every rank holds replica 0's shard of its position
    for got, want in zip(mine, shards(topology.position), strict=True):
        assert torch.equal(got, want), (rank, got, want)
    # no replica finite: NaN, so the engine's overflow check skips the step
    nothing = [torch.full((3,), math.inf if topology.position == 0 else 1.0)]
    average_replica_gradients(nothing, topology, bucket_bytes=64)
    assert torch.isnan(nothing[0]).all()


def test_a_replica_whose_gradient_shards_are_not_all_finite_is_left_out_whole():
    """Judged rank by rank, replica 1's finite shard entered the mean and its other shard did not."""
    run_ranks(replica_gradients, 4)


def pool_after_ddp_steps(rank: int, world: int) -> tuple[int, int]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(3)])  # 3.2 MB of gradients
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = HealthyMean(dist.group.WORLD)
    ddp.register_comm_hook(state, healthy_mean_hook)
    for _ in range(3):
        ddp(torch.randn(4, 512)).sum().backward()
    return state.pool.pooled_bytes(), sum(p.numel() for p in model.parameters())


def test_the_ddp_hooks_pool_keeps_one_buffer_per_bucket_after_ddp_rebuilds_them():
    """DDP rebuilds its buckets after the first step (in the order the gradients came). The pool keeps the
    buffers the later steps use, one copy of the gradients, not the first step's too (a second copy)."""
    for pooled, parameters in run_ranks(pool_after_ddp_steps, 2):
        # each fp32 bucket packs its gradients and one contributor count: the gradients once, a count a bucket
        counts = (pooled - 4 * parameters) / 4
        assert counts == int(counts) and 1 <= counts <= 6  # at most one bucket a parameter tensor, 6 of them


def ddp_hook_groups_destroyed_right_after_training(rank: int, world: int) -> None:
    for _ in range(12):  # a race: with the group in the hook's callback, a run of 12 rounds aborted every time
        group = dist.new_group()
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(3)])
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(HealthyMean(group), healthy_mean_hook)
        for _ in range(3):
            ddp(torch.randn(4, 512)).sum().backward()
        del ddp
        dist.destroy_process_group(group)
        del group  # the last reference here: none is left for the hook's callback, freed on gloo's thread


def test_a_group_destroyed_right_after_the_ddp_hooks_last_step_does_not_abort_the_process():
    """The hook's callback runs and is freed on gloo's thread; if it held the group, the group's last reference
    could drop there once the main thread destroyed it, and a gloo group freed on its own thread aborts the
    process (a thread cannot join itself)."""
    run_ranks(ddp_hook_groups_destroyed_right_after_training, 2)
