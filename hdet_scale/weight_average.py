"""Each replica's weights averaged over the last part of a sync interval, for the probe to score.

The last iterate of a replica at a higher LR oscillates more across the loss valley: its loss carries a
noise term that a lower LR does not have, while its faster progress along the valley only shows after the
LR decays. Scoring a running average of the iterate instead (as SWA, LAWA and schedule-free evaluate)
removes most of that noise term and keeps the progress, so a too-low LR no longer wins the comparison on
noise alone (``AutoLRConfig.average_window``).

The average is of this rank's local tensors (its shard of the master weights, and floating buffers): it
stays sharded on FSDP2 and ZeRO. It is kept in fp32 for bf16 and fp16 tensors: a running mean in bf16 adds
``(x - mean) / n``, which stops moving once that is below half of bf16's 8-bit precision, so over a window of
tens of steps it stayed near the window's first iterate. It is transient: checkpoints are taken at sync points,
where it is empty.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence

import torch


class WindowAverage:
    """The running mean of some tensors over the last ``ceil(fraction * sync_interval)`` steps of an interval.

    Call ``observe`` after every optimizer step with the number of steps to the next regular sync; ``swapped_in
    puts the mean into the tensors for the duration of a block (e.g. the probe); ``reset`` at every sync.
    """

    def __init__(self, fraction: float, sync_interval: int) -> None:
        self.window = math.ceil(fraction * sync_interval) if fraction > 0 else 0
        """The steps averaged: the last ``window`` before each regular sync (0: none)."""
        self._mean: list[torch.Tensor] = []
        self.count = 0
        """Iterates averaged so far in this interval."""

    @property
    def enabled(self) -> bool:
        return self.window > 0

    @torch.no_grad()
    def observe(self, steps_to_sync: int, tensors: Callable[[], Sequence[torch.Tensor]]) -> None:
        """Adds the current iterate (``tensors()``) when it is in the window, the last ``window`` steps before the
        next regular sync: ``steps_to_sync`` more steps to it (0 on its own step). Counted to the regular sync, not
        from the last one, so that an interval an extra sync cut short still averages its last steps."""
        if not self.enabled or steps_to_sync >= self.window:
            return
        current = list(tensors())
        if self.count == 0:
            if len(self._mean) != len(current) or any(m.shape != c.shape or m.dtype != _mean_dtype(c)
                                                      for m, c in zip(self._mean, current, strict=True)):
                self._mean = [tensor.detach().to(_mean_dtype(tensor), copy=True) for tensor in current]
            else:
                torch._foreach_copy_(self._mean, current)
        else:
            weight = 1.0 / (self.count + 1)
            same = [index for index, (m, c) in enumerate(zip(self._mean, current, strict=True)) if m.dtype == c.dtype]
            if same:
                torch._foreach_lerp_([self._mean[i] for i in same], [current[i] for i in same], weight)
            for mean, tensor in zip(self._mean, current, strict=True):
                if mean.dtype != tensor.dtype:  # one widened copy at a time, not of every tensor at once
                    mean.lerp_(tensor.to(mean.dtype), weight)
        self.count += 1

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_in(self, tensors: Sequence[torch.Tensor], refresh: Callable[[], None]) -> Iterator[bool]:
        """Inside the block ``tensors`` hold the mean (``refresh()`` is called after writing them, e.g. to update
        low-precision copies), after it their own values again, also where the swap or ``refresh()`` raised;
        yields whether a mean was swapped in (not when no step of this interval fell in the window, e.g. at an early
        sync)."""
        if self.count == 0:
            yield False
            return
        swapped: list[torch.Tensor] = []  # those holding the mean, their own values in its memory
        try:
            self._swap(tensors, swapped)
            refresh()
            yield True
        finally:
            self._swap(swapped)
            refresh()

    def _swap(self, tensors: Sequence[torch.Tensor], swapped: list[torch.Tensor] | None = None) -> None:
        """Exchanges the values of ``tensors`` and the mean one tensor at a time, so a swap needs memory for the
        largest tensor only, not a third copy of them all; appends each to ``swapped`` once done. Without
        ``swapped``: those a swap that stopped part way exchanged, the first of the mean's."""
        means = self._mean if swapped is not None else self._mean[:len(tensors)]
        for tensor, mean in zip(tensors, means, strict=True):
            held = tensor.clone()
            tensor.copy_(mean)
            mean.copy_(held)
            if swapped is not None:
                swapped.append(tensor)

    def reset(self) -> None:
        """Starts a new interval (the memory of the mean is kept for the next one)."""
        self.count = 0


def _mean_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a running mean of ``tensor`` is kept in: fp32 for bf16 and fp16, else its own."""
    return torch.promote_types(tensor.dtype, torch.float32)
