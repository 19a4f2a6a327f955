"""What each replica scored over a sync interval, and which replicas are healthy enough to average.

Between syncs every rank accumulates its step losses on the loss's device (``IntervalLoss``: no host
synchronization). At a sync every rank contributes a row (interval loss sum and count, whether its loss and
tensors are finite, probe loss) to a table gathered with the average itself, and ``ReplicaScores`` reduces the rows
to one score per replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hdet_scale.topology import ReplicaTopology

LossLike = float | torch.Tensor


class IntervalLoss:
    """This rank's step losses since the last sync: a float64 sum and a count.

    A step's loss is either given whole (``add_step(loss)``) or as the mean of the micro-batch losses
    ``observe``d since the last step. Tensor losses stay on their device, added in place: one kernel per
    loss and no host-device synchronization until the sync reads the sum.
    """

    def __init__(self) -> None:
        self._sum = torch.zeros((), dtype=torch.float64)
        self.count = 0
        self._micro_sum = torch.zeros((), dtype=torch.float64)
        self._micro_count = 0

    def observe(self, loss: LossLike) -> None:
        """Records one micro-batch loss of the current step."""
        self._micro_sum = _accumulate(self._micro_sum, loss)
        self._micro_count += 1

    def add_step(self, loss: LossLike | Sequence[LossLike] | None) -> None:
        """Ends a step: ``loss`` is its loss, a sequence of its micro-batch losses, or None (the micro-batch
        losses ``observe``d, if any; else the step has no loss). A loss given after ``observe`` is a ValueError:
        it would count as one more micro-batch."""
        if loss is not None and self._micro_count:
            raise ValueError(f"step() was given a loss after observe() gave this step {self._micro_count} "
                             "micro-batch loss(es): give a step's losses one way, either observe() each micro-batch "
                             "and call step() without a loss, or pass them all to step()")
        if loss is not None and not isinstance(loss, (list, tuple)):
            self._sum = _accumulate(self._sum, loss)  # the common case: one loss per step
            self.count += 1
            return
        for item in [] if loss is None else loss if isinstance(loss, (list, tuple)) else [loss]:
            self.observe(item)
        if self._micro_count:
            self._sum = _accumulate(self._sum, self._micro_sum, scale=1.0 / self._micro_count)
            self.count += 1
            self._micro_sum.zero_()
            self._micro_count = 0

    def total(self) -> float:
        """The sum of the interval's step losses (a host synchronization when they are on a device)."""
        return float(self._sum)

    def reset(self) -> None:
        """Starts a new interval. The micro-batch losses of a step in progress (a sync between its micro-batches)
        stay: that step ends in the new interval."""
        self._sum.zero_()
        self.count = 0

    def restore(self, total: float, count: int) -> None:
        """Continues an interval saved as ``total()`` and ``count``; drops unfinished micro-batches."""
        self._sum.fill_(float(total))
        self.count = int(count)
        self._micro_sum.zero_()
        self._micro_count = 0


@dataclass(frozen=True)
class ReplicaScores:
    """One sync's per-replica view, the same on every rank."""

    losses: list[float | None]
    """Each replica's interval loss (the mean over its ranks of their interval means); None where no rank
    of the replica reported a loss."""
    probe_losses: list[float] | None
    """Each replica's probe loss (mean over its ranks), or None without a probe."""
    healthy: list[bool]
    """False where any averaged tensor or optimizer state of a replica is non-finite: it is left out of the mean
    (a non-finite loss alone is the worst score, not a reason to leave the replica out)."""
    bytes_gathered: int

    @classmethod
    def from_table(cls, table: torch.Tensor, topology: ReplicaTopology, *, with_probe: bool) -> ReplicaScores:
        """The scores from the gathered rows, one per global rank: (loss sum, loss count, tensors and optimizer
        state finite as 0/1, probe loss or NaN)."""
        rows = [table[topology.replica_ranks(replica)] for replica in range(topology.num_replicas)]
        losses = [_replica_loss(replica_rows) for replica_rows in rows]
        healthy = [bool(replica_rows[:, 2].all()) for replica_rows in rows]
        probe_losses = [float(replica_rows[:, 3].mean()) for replica_rows in rows] if with_probe else None
        return cls(losses=losses, probe_losses=probe_losses, healthy=healthy,
                   bytes_gathered=table.numel() * table.element_size())

    @property
    def excluded(self) -> list[int]:
        """The replicas left out of the average."""
        return [replica for replica, healthy in enumerate(self.healthy) if not healthy]

    def controller_signal(self, probe_weight: float) -> list[float | None]:
        """The losses the controller compares: the interval losses, the probe losses, or their blend
        ``probe_weight * probe + (1 - probe_weight) * interval``."""
        if self.probe_losses is None or probe_weight == 0.0:
            return self.losses
        if probe_weight == 1.0:
            return list(self.probe_losses)
        return [None if train is None else probe_weight * probe + (1.0 - probe_weight) * train
                for train, probe in zip(self.losses, self.probe_losses, strict=True)]


def _replica_loss(rows: torch.Tensor) -> float | None:
    with_loss = rows[rows[:, 1] > 0]
    return float((with_loss[:, 0] / with_loss[:, 1]).mean()) if len(with_loss) else None


def _accumulate(total: torch.Tensor, loss: LossLike, scale: float = 1.0) -> torch.Tensor:
    """Adds ``scale * loss`` to the float64 scalar ``total`` in place, moving ``total`` to the loss's device
    the first time a loss arrives from another device; returns the accumulator to keep."""
    if not isinstance(loss, torch.Tensor):
        return total.add_(float(loss) * scale)
    if loss.numel() != 1:
        raise ValueError(f"HDET needs a scalar loss, got a tensor of shape {tuple(loss.shape)}")
    if total.device != loss.device:
        total = total.to(loss.device)
    return total.add_(loss.detach().reshape(()), alpha=scale)
