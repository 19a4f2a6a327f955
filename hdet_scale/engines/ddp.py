"""Plain torch.distributed / DistributedDataParallel: every rank (or group of ranks) is a full replica.

The model is wrapped in DDP over all ranks, and a communication hook sets how its gradients are averaged:
``global`` mode over all ranks (the paper's eq. 2: every replica applies the same all-reduced gradient with its
own LR), ``local`` mode over the replica's own ranks only, so replicas meet only at syncs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from hdet_scale.adapter import AveragedBuffers, EngineAdapter, ParameterShard, optimizer_parameters
from hdet_scale.comm import HealthyMean, broadcast_from_rank0, healthy_mean_hook
from hdet_scale.config import HDETConfig, HDETConfigError
from hdet_scale.controller import PaperDecay
from hdet_scale.ensemble import HDETEnsemble
from hdet_scale.topology import ReplicaTopology, with_replica_size


def _unwrap(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, DistributedDataParallel) else module


class DDPAdapter(EngineAdapter):
    """Averages the optimizer's parameters (and the module's floating buffers, e.g. BatchNorm statistics).

    Args:
        optimizer: the torch optimizer over the replica's full parameters.
        module: optional model (DDP-wrapped or not) whose floating-point buffers are averaged too.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, module: nn.Module | None = None) -> None:
        self._optimizer = optimizer
        self._module = _unwrap(module) if module is not None else None
        self.averaged_buffers = AveragedBuffers(self._module)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def module(self) -> nn.Module | None:
        return self._module

    def warm_init_shards(self) -> list[ParameterShard]:
        return [ParameterShard(param.shape, param) for param in self._parameters()]

    def averaged_tensors(self) -> list[torch.Tensor]:
        return self._parameters() + self.averaged_buffers()

    def _parameters(self) -> list[torch.Tensor]:
        return [param.data for param in optimizer_parameters(self._optimizer)]


def wrap_model(model: nn.Module, config: HDETConfig, topology: ReplicaTopology,
               **ddp_kwargs: Any) -> DistributedDataParallel:
    """Wraps ``model`` in DDP over all ranks, averaging gradients as ``config.gradient_mode`` asks
    (``install_gradient_mean``).

    All replicas start from global rank 0's weights (one broadcast over all ranks), so they agree whatever
    each rank's seed was. Attach HDET after wrapping: its warm-init noise must come after DDP's own
    start-up broadcast.
    """
    if not dist.is_initialized():
        raise RuntimeError("wrap_model needs torch.distributed initialized (launch with torchrun)")
    if "process_group" in ddp_kwargs:
        raise ValueError("wrap_model builds DDP over all ranks and averages gradients as config.gradient_mode "
                         "says (global or local); do not pass a process_group")
    broadcast_from_rank0(model)
    wrapped = DistributedDataParallel(model, **ddp_kwargs)
    install_gradient_mean(wrapped, config, topology)
    return wrapped


def install_gradient_mean(model: DistributedDataParallel, config: HDETConfig, topology: ReplicaTopology) -> None:
    """Sets how a DDP model built over all ranks averages gradients. ``global``: over all ranks, leaving out a
    rank whose gradient bucket holds a non-finite value (its replica diverged), so one replica never ends the
    run; ``local``: over the replica's own ranks only. A model set so already (a framework's second run on the
    same DDP model) stays as it is: DDP takes one communication hook only."""
    wanted = _gradient_mean(config.gradient_mode, topology.ranks_per_replica)
    installed = getattr(model, "_hdet_gradient_mean", None)
    if installed == wanted:
        return
    if installed is not None:
        raise HDETConfigError(f"this DDP model averages its gradients {installed} already, and DDP takes one "
                              f"communication hook: wrap the model in a new DDP for {wanted}")
    if config.gradient_mode == "global":
        model.register_comm_hook(HealthyMean(None), healthy_mean_hook)
    else:
        model.register_comm_hook(topology.intra_replica_group, allreduce_hook)
    model._hdet_gradient_mean = wanted


def check_gradient_mean(model: nn.Module | None, config: HDETConfig) -> None:
    """Refuses a DDP model over several ranks whose gradients are not averaged as ``config.gradient_mode`` says:
    a ``DistributedDataParallel(model)`` of the user's own averages over all ranks whatever the mode, and leaves
    no diverged replica out."""
    if not isinstance(model, DistributedDataParallel) or model.process_group.size() == 1:
        return
    installed = getattr(model, "_hdet_gradient_mean", None)
    wanted = _gradient_mean(config.gradient_mode, with_replica_size(config).ranks_per_replica)
    if installed != wanted:
        built = "without HDET's gradient mean" if installed is None else f"to average its gradients {installed}"
        raise HDETConfigError(
            f"the model is a DistributedDataParallel built {built}, and this run averages them {wanted}: build it "
            "with hdet_scale.engines.ddp.wrap_model(model, config, topology) and the same config instead of "
            "DistributedDataParallel(model)")


def _gradient_mean(mode: str, ranks_per_replica: int) -> str:
    """How a DDP model averages its gradients under HDET, in words (the replica size matters in local mode only)."""
    return f"for gradient_mode '{mode}'" + (f", ranks_per_replica={ranks_per_replica}" if mode == "local" else "")


def attach_to_wrapped(wrapped: nn.Module, optimizer: torch.optim.Optimizer, config: HDETConfig, *,
                      paper_decay: Sequence[PaperDecay] | None = None,
                      state: dict[str, Any] | None = None, total_steps: int | None = None) -> HDETEnsemble:
    """Attaches HDET to a model that a framework (accelerate, Lightning) wrapped in DDP over all ranks: DDP's
    gradient average becomes ``config.gradient_mode``'s (``install_gradient_mean``) and the ensemble is built over
    ``optimizer``. DDP has broadcast rank 0's weights already, so the replicas start identical; ``state``
    continues a checkpoint's HDET state (no new warm-init noise); ``total_steps`` is the run's length (see
    ``HDETEnsemble``)."""
    topology = ReplicaTopology.build(config)
    if topology.world_size > 1:
        if not isinstance(wrapped, DistributedDataParallel):
            raise RuntimeError(f"HDET needs the model wrapped in DDP on {topology.world_size} ranks, got "
                               f"{type(wrapped).__name__}")
        install_gradient_mean(wrapped, config, topology)
    return HDETEnsemble(config, DDPAdapter(optimizer, wrapped), topology=topology, paper_decay=paper_decay,
                        state=state, total_steps=total_steps)


def attach(model: nn.Module | None, optimizer: torch.optim.Optimizer, config: HDETConfig, *,
           topology: ReplicaTopology | None = None,
           paper_decay: Sequence[PaperDecay] | None = None, state: dict[str, Any] | None = None,
           total_steps: int | None = None) -> HDETEnsemble:
    """Attaches HDET to a DDP training loop; call ``ensemble.step(loss)`` after every ``optimizer.step()``.
    ``state``: the ``state_dict()`` of the run this one continues, whose weights are loaded already (they get
    no warm-init noise again); ``total_steps``: the run's length in optimizer steps (the default controller
    starts and stops at shares of it)."""
    check_gradient_mean(model, config)
    return HDETEnsemble(config, DDPAdapter(optimizer, model), topology=topology, paper_decay=paper_decay,
                        state=state, total_steps=total_steps)
