"""Warm noisy initialization (paper eq. 10): theta_r = theta_0 + eps_r, eps_r ~ N(0, nu^2 ||theta_0||^2 / d).

The norm and the parameter count d are taken over the whole model, across the shards of a replica. Each
replica draws its own noise and all ranks of a replica draw the same: parameter ``i``'s noise is drawn as a
full tensor from a generator seeded by (config seed, replica, ``i``), and every rank adds the part it holds.
The noise of a replica therefore depends on nothing but those, whatever the engine and however it shards.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hdet_scale.adapter import EngineAdapter, ParameterShard
from hdet_scale.spread import stream_seed
from hdet_scale.topology import ReplicaTopology, collective_device


def noise_std(square_sum: float, count: int, nu: float) -> float:
    """Eq. 10's standard deviation nu * ||theta|| / sqrt(d) from ||theta||^2 and d."""
    return nu * math.sqrt(square_sum / count) if count else 0.0


def replica_noise(shape: torch.Size, *, seed: int, replica_index: int, index: int) -> torch.Tensor:
    """Standard normal fp32 noise of parameter ``index`` for replica ``replica_index`` (CPU, the full shape)."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(stream_seed(seed, f"warm_init/{replica_index}/{index}"))
    return torch.randn(shape, generator=generator, dtype=torch.float32)


@torch.no_grad()
def add_warm_noise(adapter: EngineAdapter, topology: ReplicaTopology, *, nu: float, seed: int) -> float:
    """Adds this replica's eq. 10 noise to the engine's master parameters in place; returns the std used.

    Collective over the replica when the engine shards parameters (one all-reduce of two numbers); call it
    on every rank, after the engine has broadcast the starting weights. The low-precision copies the forward
    pass uses are refreshed afterwards (``adapter.after_average()``).
    """
    shards = adapter.warm_init_shards()
    count = sum(math.prod(shard.full_shape) for shard in shards)
    square_sum, held = _square_sum_and_count(shards, topology if adapter.shards_parameters else None)
    if held != count:
        raise RuntimeError(
            f"{type(adapter).__name__}.warm_init_shards() holds {held} elements over the replica's ranks for "
            f"{count} in its parameters: every element must be held exactly once (no padding, no gaps)"
        )
    std = noise_std(square_sum, count, nu)
    for index, shard in enumerate(shards):
        noise = replica_noise(shard.full_shape, seed=seed, replica_index=topology.replica_index, index=index) * std
        part = shard.take_local(noise)
        if part.shape != shard.local.shape:
            raise RuntimeError(f"{type(adapter).__name__}: take_local gave shape {tuple(part.shape)} for a local "
                               f"part of shape {tuple(shard.local.shape)} (parameter {index})")
        shard.local.add_(part.to(device=shard.local.device, dtype=shard.local.dtype))
    adapter.after_average()
    return std


def _square_sum_and_count(shards: list[ParameterShard], topology: ReplicaTopology | None) -> tuple[float, int]:
    """||theta||^2 (in fp64) and the number of elements over the local parts, summed over the replica's
    ranks when ``topology`` is given (the parts are then disjoint pieces of the parameters)."""
    totals = torch.zeros(2, dtype=torch.float64)
    for shard in shards:
        totals[0] += shard.local.detach().double().square().sum().cpu()
        totals[1] += shard.local.numel()
    if topology is not None and topology.ranks_per_replica > 1:
        totals = totals.to(collective_device())
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=topology.intra_replica_group)
    square_sum, held = totals.tolist()
    return square_sum, int(held)
