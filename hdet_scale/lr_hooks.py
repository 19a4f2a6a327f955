"""Per-replica optimizer hyperparameters (LR, weight decay) that never compound with the scheduler.

Schedulers (torch's and DeepSpeed's) write the *scheduled* LR into ``param_groups`` every step, and some
read it back (``ExponentialLR`` multiplies the current value). HDET therefore sets a replica's values only
for the duration of ``optimizer.step()``: a pre-hook replaces each explored entry's scheduled value by this
replica's value and a post-hook puts the scheduled value back. Outside ``step()`` the groups always hold
the base schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

Entry = tuple[int, str]
"""(param group index, key), e.g. (0, "lr")."""

GROUP_TAG = "hdet_group"
"""Written into every param group: its index. ZeRO-1/2 step the base optimizer one group at a time, with
``param_groups`` briefly holding only that group, so a group is recognised by its tag, not its position."""


class StepScopedValues:
    """Installs the hooks on ``optimizer``; ``resolve(entry_index, scheduled)`` gives the value to use for
    ``entries[entry_index]``."""

    def __init__(self, optimizer: torch.optim.Optimizer, entries: Sequence[Entry],
                 resolve: Callable[[int, float], float]) -> None:
        self._by_group: dict[int, list[tuple[int, str]]] = {}
        for entry_index, (group_index, key) in enumerate(entries):
            self._by_group.setdefault(group_index, []).append((entry_index, key))
        for index, group in enumerate(optimizer.param_groups):
            group[GROUP_TAG] = index
        self._resolve = resolve
        self._scheduled: list[tuple[dict[str, Any], str, Any]] = []
        self._handles = [optimizer.register_step_pre_hook(self._apply),
                         optimizer.register_step_post_hook(self._restore)]

    def _apply(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._scheduled = []
        for position, group in enumerate(optimizer.param_groups):
            for entry_index, key in self._by_group.get(group.get(GROUP_TAG, position), []):
                scheduled = group[key]
                if isinstance(scheduled, torch.Tensor):
                    # Tensor LRs (capturable/fused optimizers) must stay the same tensor object.
                    self._scheduled.append((group, key, scheduled.clone()))
                    scheduled.fill_(self._resolve(entry_index, float(scheduled)))
                else:
                    self._scheduled.append((group, key, scheduled))
                    group[key] = self._resolve(entry_index, scheduled)

    def _restore(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group, key, scheduled in self._scheduled:
            if isinstance(group[key], torch.Tensor):
                group[key].copy_(scheduled)
            else:
                group[key] = scheduled
        self._scheduled = []

    def remove(self) -> None:
        """Uninstalls the hooks (the optimizer then trains at the scheduled values)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
