"""The adapter interface: what an engine answers for the engine-agnostic core (see ``hdet_scale.engines``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hdet_scale.topology import collective_device


def optimizer_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters, each once, in param-group order (the same on every rank)."""
    seen: set[int] = set()
    params = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def floating_state(entry: dict[str, Any]) -> list[torch.Tensor]:
    """An optimizer state entry's floating-point tensors in key order, without step counters."""
    return [entry[key] for key in sorted(entry)
            if isinstance(entry[key], torch.Tensor) and entry[key].is_floating_point() and key != "step"]


AVERAGEABLE_MAGNITUDE = torch.finfo(torch.float32).max / 2**12
"""The largest magnitude a buffer averaged across replicas may hold: the average sums the replicas' values in fp32,
and a mask filled with a dtype's lowest value (``torch.finfo(dtype).min``) would add up past it to -inf."""


def averageable(buffer: torch.Tensor) -> bool:
    """Whether the replicas can average ``buffer``: all finite, and small enough to sum (``AVERAGEABLE_MAGNITUDE``)."""
    return bool((buffer.abs() <= AVERAGEABLE_MAGNITUDE).all())


class AveragedBuffers:
    """A model's floating-point buffers the replicas average (BatchNorm's statistics), less the constants: those
    that held a value they cannot average on some rank when HDET attached (``averageable``), such as an additive
    attention mask's -inf or ``finfo.min`` (rebuilt or not), which an average would turn to -inf or NaN and which
    would mark every replica as diverged at every sync. One that turns averageable on every rank (a quantization
    observer's +-inf start, filled in by the forward) is averaged from the sync that finds it so on (``refresh``).
    Call it for the buffers averaged now."""

    def __init__(self, module: nn.Module | None) -> None:
        """Collective where the process group is up: every rank must average the same buffers, so a buffer that
        cannot be averaged on any rank is a constant on all of them (a module not broadcast before HDET attached
        may hold one on some ranks only)."""
        self._module = module
        self._constants: list[str] = []
        if module is None:
            return
        floating = [(name, buffer) for name, buffer in module.named_buffers() if buffer.is_floating_point()]
        constant = _over_ranks([not averageable(buffer) for _, buffer in floating], dist.ReduceOp.MAX)
        self._constants = [name for (name, _), flag in zip(floating, constant, strict=True) if flag]

    def __call__(self) -> list[torch.Tensor]:
        if self._module is None:
            return []
        return [buffer for name, buffer in self._module.named_buffers()
                if buffer.is_floating_point() and name not in self._constants]

    def refresh(self) -> list[torch.Tensor]:
        """Takes as averaged from now on every constant that is averageable now on every rank (collective where the
        process group is up: at the end of a sync, for the interval that starts), and returns them, in the same order
        on every rank, for the sync to average them now: the replicas are then one model until the next. Every rank
        must average the same tensors: a constant averageable on some ranks only, or there on some only, stays one;
        one gone from every rank is forgotten."""
        if not self._constants:
            return []
        buffers = dict(self._module.named_buffers())
        # per constant: 0 gone, 1 not averageable, 2 averageable; the lowest and (negated) the highest over the ranks
        states = [0 if name not in buffers else 1 + averageable(buffers[name]) for name in self._constants]
        extremes = _over_ranks([*states, *(-state for state in states)], dist.ReduceOp.MIN)
        lowest, highest = extremes[:len(states)], [-state for state in extremes[len(states):]]
        turned = [name for name, low in zip(self._constants, lowest, strict=True) if low == 2]
        self._constants = [name for name, low, high in zip(self._constants, lowest, highest, strict=True)
                           if low < 2 and high > 0]  # gone from every rank: nothing left to keep apart
        return [buffers[name] for name in turned]


def _over_ranks(values: Sequence[int], op: dist.ReduceOp) -> list[int]:
    """Each of ``values`` reduced by ``op`` over every rank (collective where the process group is up; else
    ``values``)."""
    reduced = torch.tensor(values, dtype=torch.int32, device=collective_device())
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(reduced, op=op)
    return reduced.tolist()


@dataclass(frozen=True)
class ParameterShard:
    """One trained parameter as this rank holds it: what warm noisy initialization (eq. 10) asks an engine.

    ``local`` is one contiguous range of the flattened parameter, starting at ``flat_offset``; the core draws
    the noise of that range only, in fixed chunks of the flattened parameter, so the noise does not depend on
    how the parameter is sharded and no rank ever draws the whole of a large parameter.
    """

    full_shape: torch.Size
    """The shape of the whole parameter (the same on every rank)."""
    local: torch.Tensor
    """This rank's master values of the parameter (fp32 under mixed precision), contiguous, edited in place:
    the whole parameter where it is not sharded, else this rank's part of it, empty if it holds none. Never
    padding."""
    flat_offset: int = 0
    """Where ``local`` starts in the flattened parameter: it holds elements ``[flat_offset, flat_offset +
    local.numel())``."""


class EngineAdapter(ABC):
    """The engine-specific half of HDET: where the state lives and how to refresh it."""

    @property
    @abstractmethod
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer whose ``param_groups`` hold the scheduled LRs (DeepSpeed: the base optimizer)."""

    @property
    def module(self) -> nn.Module | None:
        """The model, where knobs that live in it (dropout, attention scale) are found; None if unknown."""
        return None

    @abstractmethod
    def averaged_tensors(self) -> list[torch.Tensor]:
        """This rank's master copy of its shard: the tensors averaged in place over the cross-replica group.

        The list must have the same shapes in the same order on every rank of a cross-replica group.
        """

    averaged_buffers: AveragedBuffers | None = None
    """The model's buffers the replicas average, for adapters that average any."""

    def refresh_averaged_buffers(self) -> list[torch.Tensor]:
        """At the end of a sync, for the next interval: see ``AveragedBuffers.refresh``; returns the buffers it
        turned from constants into averaged ones, to average now."""
        return [] if self.averaged_buffers is None else self.averaged_buffers.refresh()

    def optimizer_state_tensors(self) -> list[torch.Tensor]:
        """This rank's floating-point optimizer state (moments; not step counters), in parameter order, as
        local tensors: averaged with the parameters when ``average_optimizer_state`` is on."""
        return [tensor.to_local() if hasattr(tensor, "to_local") else tensor
                for _, moments in self._state_moments() for tensor in moments]

    def optimizer_state_layout(self) -> int:
        """Which parameters ``optimizer_state_tensors`` come from, as one number: the sum over them of (the
        parameter's index + 1) x its state's elements. A torch optimizer makes a parameter's state at its first
        step, so ranks whose replicas have not all stepped every parameter hold states of different parameters,
        which this tells apart where their sizes alike would not."""
        return sum((index + 1) * sum(tensor.numel() for tensor in moments) for index, moments in self._state_moments())

    def _state_moments(self) -> list[tuple[int, list[torch.Tensor]]]:
        """Each parameter's index (in the optimizer's order) and its floating-point state tensors, by key (not
        step counters); a parameter without state has none."""
        return [(index, floating_state(self.optimizer.state.get(param, {})))
                for index, param in enumerate(param for group in self.optimizer.param_groups
                                              for param in group["params"])]

    def warm_init_shards(self) -> list[ParameterShard]:
        """Every trained parameter as this rank holds its master copy, for warm noisy initialization (eq. 10).

        The order must be the same on every rank and must not depend on the sharding: a parameter's index in
        it seeds its noise.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support warm_init; set warm_init.enabled "
                                  "to false")

    @property
    def shards_parameters(self) -> bool:
        """True when the ranks of a replica hold disjoint parts of each parameter (``warm_init_shards`` then
        covers a parameter only over the whole replica); False when every rank holds whole parameters."""
        return False

    def after_average(self) -> None:  # noqa: B027 (a default no-op, not an abstract method)
        """Refreshes derived copies (e.g. low-precision parameters) from the master tensors after HDET edited
        them in place (averaging, warm-init noise)."""

    def peak_lrs(self) -> list[float]:
        """Each param group's peak LR as its schedule gives it (what an LR range test's pick is measured against):
        OneCycleLR's ``max_lr``, else the LR the optimizer was built with, which torch's schedulers keep as
        ``initial_lr``, else its LR now."""
        return [float(group.get("max_lr", group.get("initial_lr", group["lr"])))
                for group in self.optimizer.param_groups]

    def restart_optimizer_state(self) -> None:
        """Starts this rank's optimizer state afresh (every tensor of it zeroed, and step counts kept as Python
        ints, as DeepSpeed's Adams keep them, set to 0: a new Adam's bias correction), keeping its entries, so a
        checkpoint saved after it holds every key a resumed run loads: on a replica left out of an average for
        non-finite values, and after an LR range test. Where a new torch optimizer's state starts other than at
        zeros (NAdam, Rprop, Adagrad, ASGD) those entries take its starting values; SGD with dampening is the one
        left different: its first momentum is the damped gradient, not the gradient."""
        optimizer = self.optimizer
        starts = {id(param): _starting_values(optimizer, group) for group in optimizer.param_groups
                  for param in group["params"]}
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    value.fill_(starts.get(id(param), {}).get(key, 0))
                elif isinstance(value, int) and not isinstance(value, bool):
                    state[key] = 0


def _starting_values(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> dict[str, float]:
    """The state entries a new ``optimizer`` starts other than at 0 for a parameter of ``group``, by key: NAdam's
    ``mu_product`` at 1, Rprop's step sizes and ASGD's ``eta`` at the LR, ASGD's ``mu`` at 1, Adagrad's sums at its
    ``initial_accumulator_value``."""
    if isinstance(optimizer, torch.optim.NAdam):
        return {"mu_product": 1.0}
    if isinstance(optimizer, torch.optim.Rprop):
        return {"step_size": float(group["lr"])}
    if isinstance(optimizer, torch.optim.ASGD):
        return {"eta": float(group["lr"]), "mu": 1.0}
    if isinstance(optimizer, torch.optim.Adagrad):
        return {"sum": float(group["initial_accumulator_value"])}
    return {}
