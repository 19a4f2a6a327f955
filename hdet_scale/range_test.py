"""The LR range test a run can start with (``auto_lr.range_test``), by the rule of Lightning's ``Tuner.lr_find`` and
fastai's ``lr_find``: train for a number of steps while the LR grows exponentially from ``LR_MIN`` to ``LR_MAX``,
smooth the losses, and pick the LR where the smoothed loss falls fastest.

The loss is an exponential moving average with ``beta`` 0.98, divided by ``1 - beta^(i+1)`` so the first values
are not pulled towards zero; the ramp stops once the smoothed loss exceeds ``DIVERGED_OVER_BEST`` times its lowest
value (``SmoothedLoss.diverged``); the pick is the LR of the most negative slope of the smoothed loss per step,
leaving out the first ``SKIP_BEGIN`` and the last ``SKIP_END`` steps. The ensemble (``HDETEnsemble``) runs it on
every replica at once and then starts the run again from the weights it had before the test.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hdet_scale.adapter import EngineAdapter
from hdet_scale.comm import gather_rows
from hdet_scale.scores import IntervalLoss, LossLike

LR_MIN, LR_MAX = 1e-6, 1.0
MEAN_LR_OVER_PICK = 0.7
"""Where the replicas' mean LR goes after the test, over the LR it picked: on most settings measured the steepest
descent of a 100-step ramp lands above the LR that is best over a whole run (1.4-3.2 times it with cosine and
warm-up-stable-decay schedules), and 0.7 times the pick did best where the default was chosen
(benchmarks/results/lr_finding_matrix.md)."""
BETA = 0.98
DIVERGED_OVER_BEST = 4.0
SKIP_BEGIN, SKIP_END = 10, 1


def ramp_lr(step: int, *, steps: int, lr_min: float = LR_MIN, lr_max: float = LR_MAX) -> float:
    """The LR of 0-based ``step`` of a ramp that goes from ``lr_min`` at step 0 to ``lr_max`` at step
    ``steps - 1``, equal ratios per step."""
    return lr_min * (lr_max / lr_min) ** (step / max(1, steps - 1))


class SmoothedLoss:
    """The debiased moving average of the losses seen so far, and whether the ramp should stop."""

    def __init__(self, beta: float = BETA) -> None:
        self.beta, self.average, self.count, self.best = beta, 0.0, 0, math.inf

    def add(self, loss: float) -> float:
        """Takes the next loss and returns the smoothed value for it."""
        self.average = self.beta * self.average + (1 - self.beta) * loss
        self.count += 1
        smoothed = self.average / (1 - self.beta ** self.count)
        self.best = min(self.best, smoothed)
        return smoothed

    def diverged(self, smoothed: float) -> bool:
        """The ramp stops: ``smoothed`` is above ``DIVERGED_OVER_BEST`` times the best so far (or not finite); for
        a loss that goes below 0 (a log-likelihood of continuous data), as far above the best as that is above a
        positive best: ``DIVERGED_OVER_BEST - 1`` times its size."""
        rise = smoothed - self.best
        return not math.isfinite(smoothed) or (self.count > 1 and rise > (DIVERGED_OVER_BEST - 1) * abs(self.best))


def steepest_descent(lrs: Sequence[float], smoothed: Sequence[float]) -> float | None:
    """The LR at the most negative slope of ``smoothed`` (central differences per step, one-sided at the ends),
    after leaving out the first ``SKIP_BEGIN`` and last ``SKIP_END`` points and any non-finite one; None when
    fewer than two points are left."""
    kept = [(lr, loss) for lr, loss in list(zip(lrs, smoothed, strict=True))[SKIP_BEGIN:len(lrs) - SKIP_END]
            if math.isfinite(loss)]
    if len(kept) < 2:
        return None
    losses = [loss for _, loss in kept]
    last = len(losses) - 1
    slopes = [losses[1] - losses[0],
              *((losses[i + 1] - losses[i - 1]) / 2 for i in range(1, last)),
              losses[last] - losses[last - 1]]
    return kept[min(range(len(slopes)), key=slopes.__getitem__)][0]


class RangeTest:
    """One range test of ``steps`` steps: the LR of each step, the losses seen, the pick."""

    def __init__(self, steps: int) -> None:
        if steps < SKIP_BEGIN + SKIP_END + 2:
            raise ValueError(f"a range test needs at least {SKIP_BEGIN + SKIP_END + 2} steps, got {steps}")
        self.steps = steps
        self.lrs: list[float] = []
        self.smoothed: list[float] = []
        self._smoother = SmoothedLoss()

    def lr(self, step: int) -> float:
        """The LR of 0-based ``step`` of the test."""
        return ramp_lr(step, steps=self.steps)

    def add(self, loss: float) -> bool:
        """Records the loss of the test's next step (run at ``lr`` of that step); True when the test is over
        (its last step, or the smoothed loss diverged)."""
        self.lrs.append(self.lr(len(self.lrs)))
        self.smoothed.append(self._smoother.add(loss))
        return len(self.lrs) == self.steps or self._smoother.diverged(self.smoothed[-1])

    def pick(self) -> float | None:
        """The LR the test picks (``steepest_descent``), None when it saw too few finite losses."""
        return steepest_descent(self.lrs, self.smoothed)


def epochs_with_test(epochs: int, run_steps: int, test_steps: int, steps_per_epoch: int) -> int:
    """The epochs a loop bounded by epochs needs for a run of ``run_steps`` optimizer steps after a range test of
    ``test_steps`` (``epochs`` the loop has already, if more)."""
    return max(epochs, math.ceil((run_steps + test_steps) / steps_per_epoch))


class HeldScheduler:
    """Stands in for a loop's LR scheduler while the range test runs: ``step()`` does nothing, so the schedule starts
    from its first step with the run; everything else is the scheduler's (``scheduler``, to put it back)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


def unheld(scheduler: Any) -> Any:
    """``scheduler`` without the ``HeldScheduler`` around it, also where several are: one left on a loop by a run
    that raised during its test, and another put around it by the next run."""
    while isinstance(scheduler, HeldScheduler):
        scheduler = scheduler.scheduler
    return scheduler


@dataclass
class RangeTestStart:
    """A range test at the start of a run: the test, the weights every replica goes back to after it, and each
    param group's peak LR (the test ramps the first group's LR; the others keep their ratio to it)."""

    test: RangeTest
    snapshot: list[torch.Tensor]
    peaks: list[float]
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    """The module's buffers the replicas do not average, as they were, by name, on the CPU (a large attention mask
    need not take the accelerator's memory twice): they would keep what the test's LRs made them (BatchNorm's
    ``num_batches_tracked``, a quantization observer's running range)."""

    @classmethod
    def before(cls, test: RangeTest, adapter: EngineAdapter) -> RangeTestStart:
        """The start of ``test``: a copy of the weights and buffers every replica holds now, and the peak LRs."""
        averaged = adapter.averaged_tensors()
        snapshot = [tensor.detach().clone() for tensor in averaged]
        averaged_at = {tensor.data_ptr() for tensor in averaged}
        module = adapter.module
        buffers = {} if module is None else {name: buffer.detach().to("cpu", copy=True)
                                             for name, buffer in module.named_buffers()
                                             if buffer.data_ptr() not in averaged_at}
        return cls(test, snapshot, adapter.peak_lrs(), buffers)

    def lr(self, group_index: int, step: int) -> float:
        """Param group ``group_index``'s LR at 0-based ``step`` of the test."""
        return self.test.lr(step) * self.peaks[group_index] / self.peaks[0]

    def add_step(self, interval: IntervalLoss, loss: LossLike | Sequence[LossLike] | None, world_size: int) -> bool:
        """Takes one step of the test: its loss (a sequence: the micro-batches'; None: those ``observe``d into
        ``interval``) as the mean over every rank (one small all-reduce); True once the test is over. A rank
        without a loss for the step stops every rank, after the all-reduce (raising before it would leave the
        others waiting there)."""
        interval.add_step(loss)
        table = gather_rows([interval.total(), interval.count], world_size=world_size)
        interval.reset()
        without = (table[:, 1] == 0).nonzero().flatten().tolist()
        if without:
            raise ValueError(f"the LR range test (auto_lr.range_test) needs every step's loss, and rank {without[0]} "
                             "gave none: pass it to step() on every rank, or observe() the micro-batch losses")
        return self.test.add(float(table[:, 0].mean()))

    @torch.no_grad()
    def restore(self, adapter: EngineAdapter) -> None:
        """Every replica back to the weights and buffers it had before the test, with a fresh optimizer state."""
        for tensor, saved in zip(adapter.averaged_tensors(), self.snapshot, strict=True):
            tensor.copy_(saved)
        if adapter.module is not None:
            for name, buffer in adapter.module.named_buffers():
                if name in self.buffers and buffer.shape == self.buffers[name].shape:
                    buffer.copy_(self.buffers[name])
        adapter.after_average()
        adapter.restart_optimizer_state()
