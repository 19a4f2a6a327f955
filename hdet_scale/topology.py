"""Which replica a rank belongs to, and the process groups HDET talks over.

Ranks are laid out replica-major: replica ``r`` holds global ranks ``[r*S, (r+1)*S)`` for ``S`` ranks per
replica, so with ``S`` = GPUs per node a replica is a node and the heavy per-step traffic stays inside it.
The rank at position ``p`` of every replica holds the same shard, so the cross-replica group of position
``p`` is ``{p, S + p, 2S + p, ...}``: averaging over it never mixes different shards.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from hdet_scale.config import HDETConfig
from hdet_scale.config_checks import HDETConfigError

Built = TypeVar("Built")
_BUILT: dict[Hashable, tuple[dist.ProcessGroup, object]] = {}


def built_once(key: Hashable, build: Callable[[], Built]) -> Built:
    """``build()``'s groups for ``key``, built once per default process group (collective the first time: every
    rank calls it, in the same order). A process that trains more than once (a hyperparameter search's trials,
    ``fit`` again) takes the groups of its first run: new ones each time would each hold an NCCL communicator's
    GPU memory, or gloo's threads, until the process ends. A default group made anew (after
    ``destroy_process_group``) gets new ones."""
    world = dist.group.WORLD
    cached = _BUILT.get(key)
    if cached is None or cached[0] is not world:
        cached = _BUILT[key] = (world, build())
    return cached[1]  # type: ignore[return-value]


def forget_built() -> None:
    """Drops the groups ``built_once`` keeps: their threads end with their last reference (``comm.shut_down``)."""
    _BUILT.clear()


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
        config = with_replica_size(config)
        if not (dist.is_available() and dist.is_initialized()):
            if config.ranks_per_replica != 1:
                raise ValueError(
                    f"ranks_per_replica={config.ranks_per_replica} needs torch.distributed to be initialized "
                    "(launch with torchrun or deepspeed), or set ranks_per_replica to 1 for a single process"
                )
            return cls.single_process()
        world_size, rank = dist.get_world_size(), dist.get_rank()
        per = config.ranks_per_replica
        check_same_replica_size(per, rank, world_size)
        check_world_size(config, world_size)
        layout = cls(rank=rank, world_size=world_size, ranks_per_replica=per)

        def build_groups() -> ReplicaTopology:
            cross = None
            if layout.num_replicas > 1:
                cross, _ = dist.new_subgroups_by_enumeration([layout.cross_replica_ranks(p) for p in range(per)])
            # Built even for one-rank replicas: local-mode DDP needs a group to average gradients within.
            intra, _ = dist.new_subgroups_by_enumeration([layout.replica_ranks(r)
                                                          for r in range(layout.num_replicas)])
            return dataclasses.replace(layout, cross_replica_group=cross, intra_replica_group=intra)

        return built_once(("replicas", per), build_groups)


def check_same_replica_size(per_replica: int, rank: int, world_size: int) -> None:
    """An HDETConfigError on every rank unless every rank has the same replica size (one small all-reduce, a
    collective: every rank calls it before it builds groups): ranks that disagree (nodes with different numbers of
    ranks under ``"node"``, or different configs) would build different groups and wait for each other forever."""
    # each rank's size in its own slot of a summed table: an all-reduce, which every backend and torch version has
    sizes = torch.zeros(world_size, dtype=torch.int64, device=collective_device())
    sizes[rank] = per_replica
    dist.all_reduce(sizes)
    sizes = sizes.tolist()
    if len(set(sizes)) > 1:
        other = next(r for r, size in enumerate(sizes) if size != sizes[0])
        raise HDETConfigError(
            f"the ranks disagree on ranks_per_replica: {sizes[0]} on rank 0 but {sizes[other]} on rank {other} "
            f"(this is rank {rank}); with nodes of different numbers of ranks set ranks_per_replica to a number "
            "that divides every node's ranks, the same in every rank's config"
        )


def with_replica_size(config: HDETConfig, *, auto: str = "rank", world_size: int | None = None,
                      node_size: int | None = None) -> HDETConfig:
    """``config`` with ``ranks_per_replica`` as a number: ``"node"`` is ``node_size`` where the caller knows it
    (a Lightning Trainer's devices), else read from the launcher's LOCAL_WORLD_SIZE (torchrun) or LOCAL_SIZE
    (deepspeed); ``"auto"`` as ``auto`` says: ``"rank"``, 1; ``"node"``, a node, except where that would leave one
    replica (every rank on one node): then the largest replica that still gives two or more (half of the world
    size when it is even), so a first run on one machine explores too. ``world_size`` defaults to the launcher's
    WORLD_SIZE."""
    value = config.ranks_per_replica
    if value == "auto":
        if auto not in ("rank", "node"):
            raise ValueError(f"auto must be 'rank' or 'node', got {auto!r}")
        value = 1 if auto == "rank" else _node_but_two_replicas(world_size, node_size)
    if value == "node":
        value = node_size or ranks_per_node(config.ranks_per_replica)
    return config if value == config.ranks_per_replica else dataclasses.replace(config, ranks_per_replica=value)


def check_world_size(config: HDETConfig, world_size: int, *, auto: str = "rank") -> int:
    """How many replicas ``world_size`` ranks form under ``config`` (``auto`` as in ``with_replica_size``); an
    HDETConfigError where they do not split evenly."""
    per_replica = with_replica_size(config, auto=auto, world_size=world_size).ranks_per_replica
    if world_size < 1 or world_size % per_replica != 0:
        source = "" if per_replica == config.ranks_per_replica else f" (from '{config.ranks_per_replica}')"
        raise HDETConfigError(
            f"ranks_per_replica={per_replica}{source} does not divide the world size {world_size}; "
            "set ranks_per_replica to a divisor of the number of ranks (e.g. the GPUs per node)"
        )
    return world_size // per_replica


def launcher_ranks_per_node() -> int | None:
    """The launcher's ranks on this node: LOCAL_WORLD_SIZE (torchrun) or LOCAL_SIZE (deepspeed launcher); None where
    neither is set."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(name, "").isdigit() and int(os.environ[name]) >= 1:
            return int(os.environ[name])
    return None


def ranks_per_node(given: str = "node") -> int:
    """``launcher_ranks_per_node``, or an HDETConfigError naming ``given`` (the ranks_per_replica that asked for
    them) where the launcher set neither."""
    ranks = launcher_ranks_per_node()
    if ranks is not None:
        return ranks
    meaning = " (on a sharded engine: a node)" if given == "auto" else ""
    raise HDETConfigError(
        f"ranks_per_replica='{given}'{meaning} needs the ranks per node from the launcher (LOCAL_WORLD_SIZE under "
        "torchrun, LOCAL_SIZE under the deepspeed launcher), and neither is set; set ranks_per_replica to a number"
    )


def _node_but_two_replicas(world_size: int | None, node_size: int | None) -> int:
    """A node's ranks (``node_size``, else the launcher's), or where the whole world is one node, the largest
    divisor of the world size that leaves two replicas or more (the world size over its smallest prime factor; 1
    for one rank)."""
    per_node = node_size or ranks_per_node("auto")
    if world_size is None and os.environ.get("WORLD_SIZE", "").isdigit():
        world_size = int(os.environ["WORLD_SIZE"])
    if world_size is None or world_size // per_node >= 2 or world_size % per_node:
        return per_node
    smallest_factor = next((f for f in range(2, math.isqrt(world_size) + 1) if world_size % f == 0), world_size)
    return world_size // smallest_factor


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device collectives of ``group`` (the default group when None) need: under NCCL the GPU the default group
    is bound to (``init_process_group(device_id=...)``; DeepSpeed binds it to the local rank's before anything sets
    the current device), else the current GPU; else the CPU."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)).lower():
        bound = getattr(dist.group.WORLD, "bound_device_id", None)
        return bound if bound is not None else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
