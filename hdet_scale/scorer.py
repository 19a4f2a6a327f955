"""How a replica is scored over a sync interval: its step losses, the probe (a held-out batch every replica is
scored on at a sync) and the weights averaged over the interval's end that the probe scores."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from hdet_scale.adapter import EngineAdapter
from hdet_scale.comm import all_finite
from hdet_scale.config import AutoLRConfig
from hdet_scale.notices import warn
from hdet_scale.scores import IntervalLoss, LossLike
from hdet_scale.weight_average import WindowAverage


class ReplicaScorer:
    """This rank's side of the sync's score table: the interval's losses, the probe and its averaged weights."""

    def __init__(self, auto_lr: AutoLRConfig, sync_interval: int) -> None:
        self._auto_lr = auto_lr
        self._sync_interval = sync_interval
        self.interval = IntervalLoss()
        self.probe: Callable[[], LossLike] | None = None
        self._window = WindowAverage(auto_lr.window(probing=False), sync_interval)
        self._warned_no_probe = False

    def set_probe(self, probe: Callable[[], LossLike] | None) -> None:
        """Scores every replica with ``probe()`` at each sync (None: the interval losses alone); the window of
        averaged weights (``auto_lr.average_window``) follows it."""
        self.probe = probe
        self._window = WindowAverage(self._auto_lr.window(probe is not None), self._sync_interval)

    def add_step(self, loss: LossLike | Sequence[LossLike] | None,
                 steps_to_sync: int, tensors: Callable[[], list[torch.Tensor]]) -> None:
        """One optimizer step's loss, and its weights into the interval's average where the probe scores one
        (``steps_to_sync``: the steps from this one to the next regular sync, 0 on the sync's own)."""
        self.interval.add_step(loss)
        if not self._window.enabled:
            return
        if self.probe is None:
            if not self._warned_no_probe:
                warn("auto_lr.average_window needs a probe (hdet.set_probe): without one the interval "
                     "losses drive the controller and no weights are averaged")
                self._warned_no_probe = True
            return
        self._window.observe(steps_to_sync, tensors)

    def row(self, tensors: list[torch.Tensor], state: list[torch.Tensor], adapter: EngineAdapter, *,
            state_layout: int = 0) -> list[float]:
        """This rank's row of the sync's score table: its interval loss sum and step count, whether ``tensors``
        (what the sync averages) and ``state`` (the optimizer state it does not) are all finite (else its replica
        is left out of the average; a non-finite loss alone is only the worst score), its probe loss (NaN: no
        probe) on its weights averaged over the window, how many elements ``tensors`` hold, and
        ``state_layout``: which parameters the optimizer state among ``tensors`` is of
        (``EngineAdapter.optimizer_state_layout``; 0 where it is not among them)."""
        healthy = all_finite(tensors) and all_finite(state)
        with self._window.swapped_in(adapter.averaged_tensors(), adapter.after_average):
            probe = self._run_probe()
        return [self.interval.total(), float(self.interval.count), float(healthy),
                math.nan if probe is None else probe, float(sum(tensor.numel() for tensor in tensors)),
                float(state_layout % 2**52)]  # exact as a float64

    def _run_probe(self) -> float | None:
        if self.probe is None:
            return None
        with torch.no_grad():
            loss = self.probe()
        return float(loss.detach().reshape(()) if isinstance(loss, torch.Tensor) else loss)

    def reset(self) -> None:
        """A new interval: no losses, no averaged weights."""
        self.interval.reset()
        self._window.reset()
