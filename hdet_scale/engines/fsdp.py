"""PyTorch FSDP2: a replica is a group of ranks that shards one model with ``fully_shard``.

The ranks form a 2-D mesh ``("replicate", "shard")``: each replica shards the model over its row of the
mesh, and the rank at shard position ``p`` of every replica holds the same shard, so averaging each rank's
local shards over the ``"replicate"`` column averages like with like. ``global`` gradient mode adds an
all-reduce hook that averages the reduce-scattered gradient over the column (what native 2-D HSDP does);
``local`` mode leaves it out, so replicas meet only at syncs.

    model, hdet = wrap(model, config)                       # under torchrun, after init_process_group
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    hdet.attach(optimizer)                                  # or attach(optimizer, paper_decay=...)
    ...
        loss.backward(); optimizer.step(); scheduler.step()
        hdet.step(loss)
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from hdet_scale.adapter import AveragedBuffers, EngineAdapter, ParameterShard, optimizer_parameters
from hdet_scale.comm import HealthyMean, broadcast_from_rank0
from hdet_scale.config import HDETConfig
from hdet_scale.controller import PaperDecay
from hdet_scale.ensemble import HDETEnsemble
from hdet_scale.handle import HDETHandle
from hdet_scale.notices import warn
from hdet_scale.param_groups import transformer_blocks
from hdet_scale.resolve import resolve
from hdet_scale.topology import (
    ReplicaTopology,
    built_once,
    check_same_replica_size,
    check_world_size,
    with_replica_size,
)


def build_mesh(config: HDETConfig, device_type: str | None = None) -> DeviceMesh:
    """The (replicate, shard) mesh for ``config.ranks_per_replica`` (``"auto"``: a node), on ``device_type``
    (default: cuda if available, else cpu). Replica-major: replica r holds ranks [r*S, (r+1)*S)."""
    if not dist.is_initialized():
        raise RuntimeError("the FSDP2 adapter needs torch.distributed initialized (launch with torchrun)")
    world = dist.get_world_size()
    config = with_replica_size(config, auto="node", world_size=world)
    check_same_replica_size(config.ranks_per_replica, dist.get_rank(), world)
    check_world_size(config, world)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    shape = (world // config.ranks_per_replica, config.ranks_per_replica)
    # once per default process group, as the replica groups (a second fit() or trial reuses it)
    return built_once(("mesh", device_type, shape),
                      lambda: init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard")))


def topology_from_mesh(mesh: DeviceMesh, config: HDETConfig) -> ReplicaTopology:
    """The replica topology whose groups are the mesh's columns (cross-replica) and rows (intra-replica)."""
    if mesh.mesh_dim_names != ("replicate", "shard"):
        raise ValueError(f"the mesh must have dims ('replicate', 'shard'), got {mesh.mesh_dim_names}")
    replicas, per_replica = mesh.shape
    config = with_replica_size(config, auto="node", world_size=replicas * per_replica)
    if per_replica != config.ranks_per_replica:
        raise ValueError(f"the mesh has {per_replica} ranks per replica but the config says ranks_per_replica="
                         f"{config.ranks_per_replica}; build the mesh with build_mesh(config)")
    if mesh.mesh.flatten().tolist() != list(range(replicas * per_replica)):
        raise ValueError("the mesh must be replica-major over ranks 0..world-1 (as build_mesh makes it)")
    return ReplicaTopology(rank=dist.get_rank(), world_size=dist.get_world_size(), ranks_per_replica=per_replica,
                           cross_replica_group=mesh.get_group("replicate") if replicas > 1 else None,
                           intra_replica_group=mesh.get_group("shard"))


class FSDPAdapter(EngineAdapter):
    """Averages each rank's local shards of the FSDP2 parameters (fp32 under a bf16 parameter policy)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._model = model
        self._optimizer = optimizer
        self.averaged_buffers = AveragedBuffers(model)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def module(self) -> nn.Module:
        return self._model

    @property
    def shards_parameters(self) -> bool:
        return True

    def averaged_tensors(self) -> list[torch.Tensor]:
        self._reshard()
        # the optimizer's parameters, as DDP's: frozen ones (a LoRA base) are one in every replica already
        tensors = [param.to_local() for param in optimizer_parameters(self._optimizer)]
        return tensors + self.averaged_buffers()

    def warm_init_shards(self) -> list[ParameterShard]:
        self._reshard()
        shards = []
        for param in optimizer_parameters(self._optimizer):
            if not isinstance(param, DTensor):
                raise ValueError(f"the optimizer holds a parameter of shape {tuple(param.shape)} that FSDP2 does not "
                                 "shard: build the optimizer from the wrapped model's parameters only")
            shards.append(ParameterShard(param.shape, param.to_local(), _flat_offset(param)))
        return shards

    def after_average(self) -> None:
        # A forward that no backward follows (the probe's, an evaluation's) leaves the root module's parameters
        # unsharded, holding the values from before the average: the next forward would train on them.
        self._reshard()

    def _reshard(self) -> None:
        # Parameters left unsharded (reshard_after_forward=False) are resharded first: the registered
        # DTensors must be the shards, or ranks would edit different things.
        for module in self._model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def _flat_offset(param: DTensor) -> int:
    """Where this rank's shard starts in the flattened parameter: FSDP2 shards dim 0 like ``torch.chunk``, so a
    shard is the rows ``[p * ceil(n / S), ...)`` of the shard group's rank p (empty past the end)."""
    if tuple(param.placements) != (Shard(0),):
        raise ValueError(f"warm_init expects FSDP2's dim-0 sharding, got placements {param.placements}")
    rows = param.shape[0] if param.dim() else 1
    chunk = -(-rows // param.device_mesh.size())
    row_numel = param.numel() // rows if rows else 0
    return min(param.device_mesh.get_local_rank() * chunk, rows) * row_numel


class HDETFSDP(HDETHandle):
    """The HDET handle of an FSDP2-wrapped model (``HDETHandle``): ``attach(optimizer)`` once, then
    ``step(loss)`` after every ``optimizer.step()``. Returned by ``wrap``.

    Attributes:
        model: the FSDP2-wrapped model.
        mesh: the ``("replicate", "shard")`` device mesh it is sharded on (a replica is a row).
    """

    def __init__(self, model: nn.Module, config: HDETConfig, topology: ReplicaTopology, mesh: DeviceMesh) -> None:
        self.model = model
        self.config = config
        self.topology = topology
        self.mesh = mesh
        self._ensemble: HDETEnsemble | None = None
        self.gradient_bytes_across_replicas = 0
        """Payload bytes of gradients this rank all-reduced across replicas (``global`` mode's every-step
        traffic); HDET's own sync traffic is in each ``SyncReport``."""
        self._gradient_mean = HealthyMean(topology.cross_replica_group) if topology.num_replicas > 1 else None

    def average_gradient_across_replicas(self, gradient: torch.Tensor) -> None:
        """FSDP2's all-reduce hook in ``global`` mode: the reduce-scattered shard, averaged over the replicas
        whose shard is all finite (a diverged replica contributes nothing and receives the others' mean)."""
        self.gradient_bytes_across_replicas += self._gradient_mean(gradient)

    def attach(self, optimizer: torch.optim.Optimizer, *,
               paper_decay: Sequence[PaperDecay] | None = None, total_steps: int | None = None) -> HDETEnsemble:
        """Attaches HDET to the optimizer built over the wrapped model's parameters; with ``warm_init.enabled``
        this adds each replica's eq. 10 noise to the shards (collective: every rank calls it). ``total_steps``:
        the run's length in optimizer steps (the default controller starts and stops at shares of it)."""
        model_params = {id(p) for p in self.model.parameters()}
        foreign = next((p for p in optimizer_parameters(optimizer) if id(p) not in model_params), None)
        if foreign is not None:
            raise ValueError(f"the optimizer holds a parameter of shape {tuple(foreign.shape)} that is not one of the "
                             "wrapped model's: build it from model.parameters() after wrap()")
        self._ensemble = HDETEnsemble(self.config, FSDPAdapter(self.model, optimizer), topology=self.topology,
                                      paper_decay=paper_decay, total_steps=total_steps)
        return self._ensemble

    def _attached(self) -> HDETEnsemble:
        if self._ensemble is None:
            raise RuntimeError("call hdet.attach(optimizer) first: HDET needs the optimizer built over the wrapped "
                               "model's parameters")
        return self._ensemble


_HANDLES: weakref.WeakKeyDictionary[nn.Module, weakref.ref[HDETFSDP]] = weakref.WeakKeyDictionary()
"""The handle ``wrap`` returned with each model it wrapped (weakly: neither keeps the other alive)."""


def handle_of(model: nn.Module) -> HDETFSDP | None:
    """The HDET handle ``wrap`` returned with ``model``, while it lives and once attached to an optimizer; else
    None."""
    found = _HANDLES.get(model)
    handle = None if found is None else found()
    return handle if handle is not None and handle._ensemble is not None else None

def wrap(model: nn.Module, config: HDETConfig, *, mp_policy: MixedPrecisionPolicy | None = None,
         reshard_after_forward: bool = True, offload_policy: OffloadPolicy | None = None,
         block_classes: Iterable[type[nn.Module]] | None = None, mesh: DeviceMesh | None = None,
         device_type: str | None = None) -> tuple[nn.Module, HDETFSDP]:
    """Shards ``model`` with FSDP2 inside each replica and returns it with its HDET handle.

    Args:
        model: the model, on the device it trains on (or CPU for gloo); identical weights on every rank are
            not required: global rank 0's are broadcast to all before sharding.
        config: HDET settings; ``ranks_per_replica`` is the shard-group size (``"auto"``: a node).
        mp_policy, reshard_after_forward, offload_policy: FSDP2's own options, applied to every block and
            the root (the root's parameters stay unsharded after forward whatever ``reshard_after_forward``:
            backward needs them at once). With ``CPUOffloadPolicy`` the shards HDET averages and noises live on
            the CPU; under NCCL a sync averages them through buckets on the GPU.
        block_classes: module classes to shard one by one; default: the decoder layers of transformers
            models (``_no_split_modules``), else only the root.
        mesh: a ("replicate", "shard") mesh; default ``build_mesh(config, device_type)``.
        device_type: the mesh's device type when building it.
    """
    # the world size is checked in build_mesh, after the ranks agree on the replica size: a rank refusing alone
    # (nodes of different rank counts) would leave the others waiting in that agreement
    world_size = dist.get_world_size() if dist.is_initialized() else None
    config = resolve(with_replica_size(config, auto="node", world_size=world_size), auto="node")
    if not any(param.requires_grad for param in model.parameters()):
        raise ValueError(f"{type(model).__name__} has no trainable parameters: nothing for HDET to train")
    if any(tensor.is_meta for tensor in itertools.chain(model.parameters(), model.buffers())):
        raise ValueError(f"{type(model).__name__} has tensors on the meta device: materialize it before wrap "
                         "(model.to_empty(device=...) and its initialization), whose broadcast of rank 0's weights "
                         "makes the replicas start alike")
    classes = None if block_classes is None else tuple(block_classes)
    blocks = transformer_blocks(model, classes)
    if classes and not blocks:
        raise ValueError(f"none of block_classes {[c.__name__ for c in classes]} is in {type(model).__name__}: pass "
                         "the classes of its repeated blocks, or [] to shard it as one unit")
    if not blocks and classes is None:
        warn(f"no transformer blocks found in {type(model).__name__}; sharding it as one unit "
             "(pass block_classes to shard block by block)")
    mesh = mesh or build_mesh(config, device_type)
    topology = topology_from_mesh(mesh, config)
    broadcast_from_rank0(model)  # replicas start identical whatever each rank's seed was
    options: dict[str, Any] = {"mesh": mesh["shard"], "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    if offload_policy is not None:
        options["offload_policy"] = offload_policy
    for block in blocks:
        fully_shard(block, **options)
    # The root's parameters are needed again at once by backward: kept unsharded after forward, as fully_shard's
    # own default does for a root (None, which torch before 2.8 refuses)
    fully_shard(model, **{**options, "reshard_after_forward": False})
    hdet = HDETFSDP(model, config, topology, mesh)
    _HANDLES[model] = weakref.ref(hdet)
    if config.gradient_mode == "global" and topology.cross_replica_group is not None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(hdet.average_gradient_across_replicas)
    return model, hdet
