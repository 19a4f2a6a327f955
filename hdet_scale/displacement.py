"""A displacement signal for the LR: do consecutive sync-to-sync moves of the averaged weights agree?

Mechanic (Cutkosky et al. 2023) tunes a step-size scale by the sign of <g, Delta>: the gradient at the new
point against the move that led there. Moved to the sync level, with the next move standing in for the
gradient (the T steps after a sync sum the gradients met from the new average on, so ``d_next`` is about
``-eta T g``): if the averaged weights keep moving the way they moved last interval (cosine of ``d_k`` and
``d_(k+1)`` above 0), the steps were too short and the LR may rise; if they turn back (below 0, a zig-zag
across the valley), the steps overshoot and it should fall. The signal needs no gradients and no replica
comparison, so the short-horizon bias of comparing replicas' losses does not enter it
(``AutoLRConfig.displacement``).

Memory: this rank's shard of the previous average and of the previous move (two copies of the shard it
averages). Not checkpointed: after a resume the signal restarts and returns a value from the third sync on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist


class DisplacementSignal:
    """``update`` at every sync, right after the average, returns the cosine of the last two moves."""

    def __init__(self) -> None:
        self._previous_average: list[torch.Tensor] | None = None
        self._previous_move: list[torch.Tensor] | None = None

    @torch.no_grad()
    def update(self, averaged: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> float | None:
        """Takes this rank's tensors right after a sync's average; returns cos(d_k, d_(k+1)) over the whole model
        (summed over the ranks of ``group``, the replica, when they hold shards: collective), or None while
        there are fewer than two moves."""
        if self._previous_average is None:
            self._previous_average = [tensor.detach().clone() for tensor in averaged]
            return None
        first_move = self._previous_move is None
        if first_move:
            self._previous_move = [torch.empty_like(tensor) for tensor in averaged]
        sums = torch.zeros(3, dtype=torch.float64, device=averaged[0].device if averaged else "cpu")
        for tensor, before, move in zip(averaged, self._previous_average, self._previous_move, strict=True):
            now = (tensor - before).reshape(-1)
            if not first_move:
                old = move.reshape(-1)
                sums += torch.stack([torch.dot(old, now), torch.dot(old, old), torch.dot(now, now)]).double()
            move.copy_(now.view_as(move))
            before.copy_(tensor)
        if first_move:
            return None
        if group is not None:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        dot, old_norm, new_norm = sums.tolist()
        return dot / math.sqrt(old_norm * new_norm) if old_norm > 0 and new_norm > 0 else 0.0

    def reset(self) -> None:
        """Forgets the moves (e.g. when the weights were replaced by a checkpoint's)."""
        self._previous_average = self._previous_move = None
