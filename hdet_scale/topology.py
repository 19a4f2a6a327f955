"""Which replica a rank belongs to, and the process groups HDET talks over.

Ranks are laid out replica-major: replica ``r`` holds global ranks ``[r*S, (r+1)*S)`` for ``S`` ranks per
replica, so with ``S`` = GPUs per node a replica is a node and the heavy per-step traffic stays inside it.
The rank at position ``p`` of every replica holds the same shard, so the cross-replica group of position
``p`` is ``{p, S + p, 2S + p, ...}``: averaging over it never mixes different shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hdet_scale.config import HDETConfig


@dataclass(frozen=True)
class ReplicaTopology:
    """This rank's place in the (replica, position) grid and the groups along each axis."""

    rank: int
    world_size: int
    ranks_per_replica: int
    cross_replica_group: dist.ProcessGroup | None = None
    """Ranks holding the same shard position in every replica (None when there is one replica)."""
    intra_replica_group: dist.ProcessGroup | None = None
    """The ranks of this rank's replica (None without torch.distributed)."""

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.ranks_per_replica

    @property
    def replica_index(self) -> int:
        return self.rank // self.ranks_per_replica

    @property
    def position(self) -> int:
        """Position (shard index) of this rank inside its replica."""
        return self.rank % self.ranks_per_replica

    def replica_of(self, rank: int) -> int:
        return rank // self.ranks_per_replica

    def replica_ranks(self, replica: int) -> list[int]:
        start = replica * self.ranks_per_replica
        return list(range(start, start + self.ranks_per_replica))

    def cross_replica_ranks(self, position: int) -> list[int]:
        return [r * self.ranks_per_replica + position for r in range(self.num_replicas)]

    @classmethod
    def single_process(cls) -> ReplicaTopology:
        """One rank, one replica: what HDET uses when no process group is initialized."""
        return cls(rank=0, world_size=1, ranks_per_replica=1)

    @classmethod
    def build(cls, config: HDETConfig) -> ReplicaTopology:
        """Creates the groups for the initialized default process group (collective: every rank calls it).

        Without an initialized process group this is the single-process topology.
        """
        config = config.resolved()
        if not (dist.is_available() and dist.is_initialized()):
            if config.ranks_per_replica != 1:
                raise ValueError(
                    f"ranks_per_replica={config.ranks_per_replica} needs torch.distributed to be initialized "
                    "(launch with torchrun or deepspeed), or set ranks_per_replica to 1 for a single process"
                )
            return cls.single_process()
        world_size, rank = dist.get_world_size(), dist.get_rank()
        config.validate_world_size(world_size)
        per = config.ranks_per_replica
        layout = cls(rank=rank, world_size=world_size, ranks_per_replica=per)
        cross = None
        if layout.num_replicas > 1:
            cross, _ = dist.new_subgroups_by_enumeration([layout.cross_replica_ranks(p) for p in range(per)])
        # Built even for one-rank replicas: local-mode DDP needs a group to average gradients within.
        intra, _ = dist.new_subgroups_by_enumeration([layout.replica_ranks(r) for r in range(layout.num_replicas)])
        return cls(rank=rank, world_size=world_size, ranks_per_replica=per,
                   cross_replica_group=cross, intra_replica_group=intra)


def collective_device() -> torch.device:
    """The device collectives of the default group need: the current GPU under NCCL, else the CPU."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
