"""Per-replica optimizer hyperparameters (LR, weight decay) that never compound with the scheduler.

Schedulers (torch's and DeepSpeed's) write the *scheduled* LR into ``param_groups`` every step, and some
read it back (``ExponentialLR`` multiplies the current value). HDET therefore sets a replica's values only
for the duration of ``optimizer.step()``: a pre-hook replaces each explored entry's scheduled value by this
replica's value and a post-hook puts the scheduled value back. Outside ``step()`` the groups always hold
the base schedule.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

Entry = tuple[int, str]
"""(param group index, key), e.g. (0, "lr")."""

GROUP_TAG = "hdet_group"
"""Written into every param group: its index. ZeRO-1/2 step the base optimizer one group at a time, with
``param_groups`` briefly holding only that group, so a group is recognised by its tag, not its position. The
tags are written again after every ``load_state_dict``, which replaces the groups by the saved ones (a state
saved without HDET has no tags)."""


class StepScopedValues:
    """Installs the hooks on ``optimizer``; ``resolve(entry_index, scheduled)`` gives the value to use for
    ``entries[entry_index]``."""

    def __init__(self, optimizer: torch.optim.Optimizer, entries: Sequence[Entry],
                 resolve: Callable[[int, float], float]) -> None:
        self._by_group: dict[int, list[tuple[int, str]]] = {}
        for entry_index, (group_index, key) in enumerate(entries):
            self._by_group.setdefault(group_index, []).append((entry_index, key))
        _tag_groups(optimizer)
        self._resolve = resolve
        self._scheduled: list[tuple[dict[str, Any], str, Any]] = []
        self._handles = [optimizer.register_step_pre_hook(self._apply),
                         optimizer.register_step_post_hook(self._restore),
                         optimizer.register_load_state_dict_post_hook(_tag_groups)]
        self._unwrap_step = _restore_on_error(optimizer, self._restore)

    def _apply(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        added = next((position for position, group in enumerate(optimizer.param_groups) if GROUP_TAG not in group),
                     None)
        if added is not None:
            raise RuntimeError(
                f"param group {added} was added to the optimizer after HDET attached (add_param_group): HDET would "
                "neither explore its values nor scale its LR as the other groups'; give the optimizer every param "
                "group before HDET attaches (a group unfrozen later can start with requires_grad=False)")
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

    def _restore(self, *_: Any) -> None:
        """Puts the scheduled values back (a no-op when they are back already)."""
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
        self._unwrap_step()


def _tag_groups(optimizer: torch.optim.Optimizer) -> None:
    for index, group in enumerate(optimizer.param_groups):
        group[GROUP_TAG] = index


def _restore_on_error(optimizer: torch.optim.Optimizer, restore: Callable[[], None]) -> Callable[[], None]:
    """Makes ``optimizer.step`` put the scheduled values back when it raises (the post-hook then never runs:
    e.g. a loop that catches an out-of-memory error and skips the batch), so a replica's value never stays in
    ``param_groups`` to be scaled again by the next step or read by a scheduler. Returns the undo."""
    step = optimizer.step

    def restoring_step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        try:
            return step(*args, **kwargs)
        except BaseException:
            restore()
            raise

    # A bound method, like the step it replaces: torch's LR schedulers wrap ``optimizer.step.__func__``.
    optimizer.step = types.MethodType(functools.wraps(step)(restoring_step), optimizer)
    wrapped = optimizer.step

    def undo() -> None:
        if optimizer.__dict__.get("step") == wrapped:  # else something wrapped it since: leave it be
            optimizer.step = step

    return undo
