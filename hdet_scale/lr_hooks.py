"""Per-replica LRs that never compound with the LR scheduler.

Schedulers (torch's and DeepSpeed's) write the *scheduled* LR into ``param_groups`` every step, and some
read it back (``ExponentialLR`` multiplies the current value). HDET therefore scales the LR only for the
duration of ``optimizer.step()``: a pre-hook replaces each group's scheduled LR by this replica's value and
a post-hook puts the scheduled value back. Outside ``step()`` the groups always hold the base schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class StepScopedLR:
    """Installs the hooks on ``optimizer``; ``resolve(group_index, scheduled_lr)`` gives the LR to use."""

    def __init__(self, optimizer: torch.optim.Optimizer, resolve: Callable[[int, float], float]) -> None:
        self._resolve = resolve
        self._scheduled: list[Any] = []
        self._handles = [optimizer.register_step_pre_hook(self._apply),
                         optimizer.register_step_post_hook(self._restore)]

    def _apply(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._scheduled = [group["lr"] for group in optimizer.param_groups]
        for index, group in enumerate(optimizer.param_groups):
            scheduled = group["lr"]
            if isinstance(scheduled, torch.Tensor):
                # Tensor LRs (capturable/fused optimizers) must stay the same tensor object.
                self._scheduled[index] = scheduled.clone()
                scheduled.fill_(self._resolve(index, float(scheduled)))
            else:
                group["lr"] = self._resolve(index, scheduled)

    def _restore(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group, scheduled in zip(optimizer.param_groups, self._scheduled, strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].copy_(scheduled)
            else:
                group["lr"] = scheduled
        self._scheduled = []

    def remove(self) -> None:
        """Uninstalls the hooks (the optimizer then trains at the scheduled LRs)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
