"""What an engine adapter answers for the engine-agnostic core."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class EngineAdapter(ABC):
    """The engine-specific half of HDET: where the state lives and how to refresh it."""

    @property
    @abstractmethod
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer whose ``param_groups`` hold the scheduled LRs (DeepSpeed: the base optimizer)."""

    @abstractmethod
    def averaged_tensors(self) -> list[torch.Tensor]:
        """This rank's master copy of its shard: the tensors averaged in place over the cross-replica group.

        The list must have the same shapes in the same order on every rank of a cross-replica group.
        """

    def optimizer_state_tensors(self) -> list[torch.Tensor]:
        """This rank's floating-point optimizer state (moments; not step counters), in parameter order, as
        local tensors: averaged with the parameters when ``average_optimizer_state`` is on."""
        tensors = []
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                state = self.optimizer.state.get(param, {})
                for key in sorted(state):
                    value = state[key]
                    if isinstance(value, torch.Tensor) and value.is_floating_point() and key != "step":
                        tensors.append(value.to_local() if hasattr(value, "to_local") else value)
        return tensors

    def warm_init_tensors(self) -> list[torch.Tensor]:
        """The full (unsharded) parameters that warm noisy initialization perturbs (eq. 10)."""
        raise NotImplementedError(f"{type(self).__name__} does not support warm_init yet; set warm_init.enabled "
                                  "to false")

    def after_average(self) -> None:  # noqa: B027 (a default no-op, not an abstract method)
        """Refreshes derived copies (e.g. low-precision parameters) from the averaged master tensors."""

    def recover_excluded(self) -> None:
        """Called on a replica that was left out of an average for non-finite values, after it received the
        mean: drops optimizer state that may hold the non-finite values, so training continues cleanly."""
        self.optimizer.state.clear()
