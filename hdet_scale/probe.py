"""A low-noise controller signal: every replica scored on the same held-out batch at each sync.

The interval training loss compares replicas on different batches, so part of their loss differences is
batch noise. A probe batch shared by all replicas removes that part: the replicas differ only in their
weights. One forward pass per rank per sync, before the replicas are averaged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

Batch = Any
"""A tensor, or a (nested) tuple, namedtuple, list, dict or other mapping of tensors and plain values."""


def batch_probe(model: nn.Module, batch: Batch, loss_fn: Callable[[nn.Module, Batch], torch.Tensor], *,
                device: torch.device | str | None = None) -> Callable[[], torch.Tensor]:
    """A probe for ``HDETEnsemble.set_probe``: ``loss_fn(model, batch)`` on one fixed batch, in eval mode.

    The batch is taken from global rank 0 once (collective: every rank calls this, each with a batch of the
    same structure, e.g. its own draw from the held-out data), so every replica scores the same samples.
    During the probe the model is in eval mode (no dropout), then every submodule back in its previous mode.

    Args:
        model: the wrapped model (DDP, FSDP2 or a DeepSpeed engine); every rank of a replica runs it.
        batch: this rank's candidate batch; rank 0's is used everywhere.
        loss_fn: the scalar loss of ``model`` on ``batch``.
        device: where the batch lives for the forward pass; default: the device of ``model``'s parameters.
    """
    if device is None:
        device = next(model.parameters()).device
    shared = _from_rank0(batch)
    shared = _to(shared, torch.device(device))

    def probe() -> torch.Tensor:
        modes = [(module, module.training) for module in model.modules()]
        model.eval()
        try:
            return loss_fn(model, shared)
        finally:
            model.train(modes[0][1])
            for module, training in modes:  # a submodule kept in eval mode (frozen BatchNorm) stays there
                module.training = training

    return probe


def no_probe_warning(reason: str, fix: str) -> str:
    """The warning an integration gives when it runs the controller without a probe: ``reason`` says why there
    is none, ``fix`` how to give one."""
    return (f"HDET: {reason}, so the auto-LR controller compares the replicas on their own training batches, "
            f"which settle on lower LRs and end worse than one held-out batch scored by every replica (measured in "
            f"hdet_scale's benchmarks/results/lr_finding.md): {fix}")


def _from_rank0(batch: Batch) -> Batch:
    if not (dist.is_available() and dist.is_initialized()):
        return batch
    holder = [_to(batch, torch.device("cpu"))]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _to(batch: Batch, device: torch.device) -> Batch:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {key: _to(value, device) for key, value in batch.items()}
    if isinstance(batch, Mapping):  # e.g. transformers' BatchEncoding, what its collators give
        return type(batch)({key: _to(value, device) for key, value in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple takes its fields one by one
        return type(batch)(*(_to(value, device) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(value, device) for value in batch)
    return batch
