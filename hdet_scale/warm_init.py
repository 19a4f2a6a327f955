"""Warm noisy initialization (paper eq. 10): theta_r = theta_0 + eps_r, eps_r ~ N(0, nu^2 ||theta_0||^2 / d).

The norm and the parameter count d are taken over the whole model, across the shards of a replica. Each
replica draws its own noise and all ranks of a replica draw the same: the flattened parameter ``i`` is cut
into fixed chunks of ``NOISE_CHUNK`` elements, chunk ``k``'s noise comes from a generator seeded by (config
seed, replica, ``i``, ``k``), and every rank draws only the chunks its part overlaps. The noise of a replica
therefore depends on nothing but those, however the engine shards (ZeRO stage, ranks per replica), and a rank's
time and memory follow its own shard, not the largest parameter. ``i`` counts the parameters in the engine's order
(``warm_init_shards``): the optimizer's param groups under DDP and FSDP2, the module's under ZeRO, so a model whose
optimizer lists its parameters otherwise than the module (decay and no-decay groups) draws other noise under
ZeRO than under DDP or FSDP2, from the same distribution.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hdet_scale.adapter import EngineAdapter, ParameterShard
from hdet_scale.comm import bits_fingerprint
from hdet_scale.spread import stream_seed
from hdet_scale.topology import ReplicaTopology, collective_device

NOISE_CHUNK = 2**20
"""Elements per independently seeded piece of a flattened parameter's noise (4 MiB of fp32)."""


def noise_std(square_sum: float, count: int, nu: float) -> float:
    """Eq. 10's standard deviation nu * ||theta|| / sqrt(d) from ||theta||^2 and d."""
    return nu * math.sqrt(square_sum / count) if count else 0.0


def noise_pieces(numel: int, start: int, stop: int, *, seed: int, replica_index: int,
                 index: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Standard normal fp32 noise (CPU) of elements ``[start, stop)`` of the flattened parameter ``index``
    (``numel`` elements) for replica ``replica_index``, one chunk at a time: (position in the range, piece)."""
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"elements [{start}, {stop}) are not within a parameter of {numel}")
    for chunk in range(start // NOISE_CHUNK, -(-stop // NOISE_CHUNK)):
        first = chunk * NOISE_CHUNK
        generator = torch.Generator(device="cpu")
        generator.manual_seed(stream_seed(seed, f"warm_init/{replica_index}/{index}/{chunk}"))
        noise = torch.randn(min(NOISE_CHUNK, numel - first), generator=generator, dtype=torch.float32)
        yield max(first - start, 0), noise[max(start - first, 0): stop - first]


def replica_noise(numel: int, start: int, stop: int, *, seed: int, replica_index: int, index: int) -> torch.Tensor:
    """The noise of ``noise_pieces`` as one tensor."""
    pieces = [piece for _, piece in noise_pieces(numel, start, stop, seed=seed, replica_index=replica_index,
                                                  index=index)]
    return torch.cat(pieces) if pieces else torch.empty(0)


@dataclass(frozen=True)
class WarmNoise:
    """The noise ``add_warm_noise`` added on a rank: its std, and the fingerprint of each shard's local part right
    after it (``comm.bits_fingerprint``), by which a later start finds the parts a load left holding it."""

    std: float
    fingerprints: tuple[int, ...]


@torch.no_grad()
def add_warm_noise(adapter: EngineAdapter, topology: ReplicaTopology, *, nu: float, seed: int,
                   replacing: WarmNoise | None = None) -> WarmNoise:
    """Adds this replica's eq. 10 noise to the engine's master parameters in place; returns what it added.

    ``replacing``: the noise an earlier call added, on a start afresh from weights loaded since; it is first taken
    out of every part the load left as it was (else such a part would end at theta_0 + 2 eps), and the new std is
    that of the weights then. Collective over the replica when the engine shards parameters (one all-reduce of two
    numbers); call it on every rank, after the engine has broadcast the starting weights. The low-precision copies
    the forward pass uses are refreshed afterwards (``adapter.after_average()``).
    """
    shards = adapter.warm_init_shards()
    if replacing is not None:
        for index, shard in enumerate(shards):
            if index < len(replacing.fingerprints) and bits_fingerprint([shard.local]) == replacing.fingerprints[index]:
                _add_noise(shard, index, -replacing.std, seed=seed, replica_index=topology.replica_index)
    count = sum(math.prod(shard.full_shape) for shard in shards)
    square_sum, held = _square_sum_and_count(shards, topology if adapter.shards_parameters else None)
    if held != count:
        raise RuntimeError(
            f"{type(adapter).__name__}.warm_init_shards() holds {held} elements over the replica's ranks for "
            f"{count} in its parameters: every element must be held exactly once (no padding, no gaps)"
        )
    std = noise_std(square_sum, count, nu)
    for index, shard in enumerate(shards):
        _add_noise(shard, index, std, seed=seed, replica_index=topology.replica_index)
    adapter.after_average()
    return WarmNoise(std, tuple(bits_fingerprint([shard.local]) for shard in shards))


def _add_noise(shard: ParameterShard, index: int, std: float, *, seed: int, replica_index: int) -> None:
    """Adds ``std`` times the replica's noise of parameter ``index`` to the shard's local part."""
    # A parameter in another memory format (channels_last) takes its noise in its logical element order.
    contiguous = shard.local.contiguous()
    local = contiguous.view(-1)
    for at, piece in noise_pieces(math.prod(shard.full_shape), shard.flat_offset, shard.flat_offset + local.numel(),
                                  seed=seed, replica_index=replica_index, index=index):
        local[at: at + piece.numel()].add_(piece.to(device=local.device, dtype=local.dtype), alpha=std)
    if contiguous is not shard.local:
        shard.local.copy_(contiguous)


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
