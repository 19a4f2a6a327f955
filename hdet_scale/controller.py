"""The auto-LR controller (paper eqs. 4-9): pure, deterministic math with no communication.

It takes the replicas' interval losses and the values they trained with, and returns the new base state.
Every rank runs it on identical gathered inputs, so every rank computes identical outputs.

Three modes (see ``AutoLRConfig.mode``):

* ``scale``: values are ``schedule(t) * scale * rho``. The hypergradient is taken relative to the replicas'
  mean value, ``Delta_rel = (sum_r w_r rho_r - mean rho) / mean rho`` (eqs. 5-6 over eta bar); momentum smooths
  it; ``scale <- scale * (1 + lambda * v)`` clamped to [scale_min, scale_max], where the velocity pointing past the
  bound is dropped. The base schedule keeps its shape.
* ``paper``: after the warm-up the controller owns the base value ``b``: ``Delta = b * Delta_rel``,
  ``v <- beta v + (1 - beta) Delta`` and ``b <- max(b (1 - gamma) + lambda v, floor)``, with gamma chosen so
  that ``(1 - gamma)^K = floor / b`` over the K remaining syncs. This is eqs. 5-7 on the replicas' mean value
  ``b * mean rho`` (eta bar), divided through by ``mean rho``: with a linear spread (mean rho = 1, the paper's)
  ``b`` is eta bar itself. Eq. 8 as printed,
  ``1 - exp(-log(f_div / f_final) / K)``, is negative for OneCycleLR's defaults (it would grow the LR
  400x); this implements the stated intent, a geometric decay to OneCycleLR's floor.
* ``log``: scale-free. Eq. 4's weights come from z-scored losses, ``w_r = softmax(-(L_r - mean) / (s
  sigma))`` with ``s`` the replicas' loss standard deviation, so the temperature is in units of how much
  the replicas differ, not in nats; ``Delta_log = sum_r w_r log rho_r - mean log rho`` (a weighted mean of log
  multipliers from their plain mean, 0 when the weights are equal); ``v <- beta v + (1 - beta)
  Delta_log``; ``log scale <- log scale + clip(lambda v, +-max_log_step)``, clamped as in ``scale`` mode. A step
  up and a step down by the same factor weigh alike, and the signal keeps its strength where loss gaps shrink (low
  LRs).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hdet_scale.config import AutoLRConfig, HDETConfig
from hdet_scale.config_checks import is_step


def softmax_weights(losses: Sequence[float], sigma: float) -> list[float]:
    """Eq. 4: w_r = softmax((mean L - L_r) / sigma). Non-finite losses get weight 0 (the worst replica)."""
    finite = [loss for loss in losses if math.isfinite(loss)]
    if not finite:
        raise ValueError("every replica's loss is non-finite: the controller has no signal")
    mean = sum(finite) / len(finite)
    scores = [(mean - loss) / sigma if math.isfinite(loss) else -math.inf for loss in losses]
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = sum(exps)
    return [e / total for e in exps]


def zscore_weights(losses: Sequence[float], sigma: float) -> list[float]:
    """``log`` mode's eq. 4: softmax(-(L_r - mean) / (s sigma)) with ``s`` the population standard deviation of
    the finite losses; equal weights when they are all equal. Non-finite losses get weight 0."""
    finite = [loss for loss in losses if math.isfinite(loss)]
    if not finite:
        raise ValueError("every replica's loss is non-finite: the controller has no signal")
    mean = sum(finite) / len(finite)
    spread = math.sqrt(sum((loss - mean) ** 2 for loss in finite) / len(finite))
    if spread == 0.0:
        return [1.0 / len(finite) if math.isfinite(loss) else 0.0 for loss in losses]
    return softmax_weights([(loss - mean) / spread for loss in losses], sigma)


def relative_hypergradient(weights: Sequence[float], replica_multipliers: Sequence[float]) -> float:
    """Eqs. 5-6 divided by the mean value: (sum_r w_r rho_r - mean rho) / mean rho, with ``weights`` summing to 1.

    The mean is the replicas' own (eq. 5's eta bar): a log spread's multipliers average above 1, and measured
    from 1 instead its equal weights would read as a hypergradient. Exactly 0 when alpha = 0.
    """
    mean = math.fsum(replica_multipliers) / len(replica_multipliers)
    return math.fsum(w * (rho - mean) for w, rho in zip(weights, replica_multipliers, strict=True)) / mean


def log_hypergradient(weights: Sequence[float], replica_multipliers: Sequence[float]) -> float:
    """``log`` mode's Delta: sum_r w_r log rho_r - mean log rho, the weighted mean of the replicas' log multipliers
    from their plain mean (0 at equal weights also on a linear spread, whose log multipliers average below 0)."""
    logs = [math.log(rho) for rho in replica_multipliers]
    mean = math.fsum(logs) / len(logs)
    return math.fsum(w * (log - mean) for w, log in zip(weights, logs, strict=True))


def momentum(velocity: float, delta: float, beta: float) -> float:
    """Eq. 7 (left): v <- beta v + (1 - beta) Delta."""
    return beta * velocity + (1.0 - beta) * delta


def decay_to_floor(current: float, floor: float, num_syncs: int) -> float:
    """Eq. 8 as intended: the gamma with (1 - gamma)^K = floor / current, i.e. reach ``floor`` in K syncs."""
    if num_syncs < 1:
        raise ValueError(f"num_syncs must be >= 1, got {num_syncs}")
    if current <= 0 or floor <= 0:
        raise ValueError(f"decay needs positive values, got current={current}, floor={floor}")
    return 1.0 - (floor / current) ** (1.0 / num_syncs)


@dataclass
class ControllerState:
    """The controller's state for one explored value."""

    velocity: float = 0.0
    """v of eq. 7: relative (dimensionless) in ``scale`` mode, in log units in ``log`` mode, in value units in
    ``paper`` mode."""

    scale: float = 1.0
    """``scale`` and ``log`` mode: the multiplicative scale on the base schedule."""

    owned_base: float | None = None
    """``paper`` mode: the base value the controller owns after the warm-up (None before)."""

    gamma: float = 0.0
    """``paper`` mode: the per-sync decay rate fixed when the controller took over."""

    last_delta: float = 0.0
    """The last Delta (for metrics): relative in ``scale`` mode, in log units in ``log`` mode, absolute in
    ``paper`` mode."""

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> ControllerState:
        """Restores ``state_dict()``, also one saved by an earlier version with the fields of removed settings
        (``REMOVED_FIELDS``), which are dropped."""
        return cls(**{key: value for key, value in state.items() if key not in REMOVED_FIELDS})


REMOVED_FIELDS = ("updates", "log_scale_sum", "scales_averaged", "anchor")
"""``ControllerState`` fields of earlier versions, kept by the settings that left the library (the update count of
``auto_lr.bias_correction``, the running log-scale mean of ``auto_lr.hold_average``, the range test's pick the
controller's bounds were relative to when it moved on from it): a checkpoint holding them still loads."""


@dataclass(frozen=True)
class PaperDecay:
    """What ``paper`` mode needs from the base schedule: where it ends and when."""

    total_steps: int
    """The schedule's length in optimizer steps, >= 1."""
    floor: float
    """The schedule's final value, > 0: eq. 8 decays geometrically to it, which no decay reaches at 0."""

    def __post_init__(self) -> None:
        if isinstance(self.total_steps, bool) or not isinstance(self.total_steps, int) or self.total_steps < 1:
            raise ValueError(f"PaperDecay.total_steps must be an integer >= 1, got {self.total_steps!r}")
        if isinstance(self.floor, bool) or not isinstance(self.floor, (int, float)) or not 0 < self.floor < math.inf:
            raise ValueError(f"PaperDecay.floor must be a finite number > 0 (the schedule's final value; a geometric "
                             f"decay never reaches 0), got {self.floor!r}")


class Controller:
    """Applies eqs. 5-8 to one explored value's state; stateless itself."""

    def __init__(self, config: AutoLRConfig) -> None:
        self.config = config.filled()

    def weights(self, losses: Sequence[float]) -> list[float]:
        """Eq. 4's weights of the replicas' losses (``log`` mode: of their z-scores)."""
        if self.config.mode == "log":
            return zscore_weights(losses, self.config.sigma)
        return softmax_weights(losses, self.config.sigma)

    def hypergradient(self, weights: Sequence[float], replica_multipliers: Sequence[float]) -> float:
        """Eqs. 5-6 from eq. 4's ``weights``, ``replica_multipliers[r]`` being rho_{pi(r)}, the multiplier replica r
        trained with: relative to the replicas' mean value (``scale`` and ``paper`` mode), in log units (``log``
        mode). ``update`` takes it, or a step-weighted mean of several (an interval cut by extra syncs)."""
        if self.config.mode == "log":
            return log_hypergradient(weights, replica_multipliers)
        return relative_hypergradient(weights, replica_multipliers)

    def update(self, state: ControllerState, *, delta: float, trained_base: float, step: int, sync_interval: int,
               paper_decay: PaperDecay | None = None,
               value_bounds: tuple[float, float] | None = None) -> ControllerState:
        """One sync's update from the interval's ``delta`` (``hypergradient``). ``trained_base`` is the base the
        interval's last step trained with (eq. 5's eta at kT over the multipliers; ``paper`` mode takes over from it
        at its first update). ``value_bounds``: the scales that keep every replica's value inside its own bounds
        (the base at the low one, the top replica at the high one: a probability's 0 and 1), kept within after
        [scale_min, scale_max] (``scale`` and ``log`` mode)."""
        cfg = self.config
        if cfg.mode == "log":
            velocity = self._one_sided(momentum(state.velocity, delta, cfg.beta), step)
            log_step = min(max(cfg.step_size * velocity, -cfg.max_log_step), cfg.max_log_step)
            scale, velocity = self._clamp(state.scale * math.exp(log_step), velocity, value_bounds)
            return ControllerState(velocity=velocity, scale=scale, last_delta=delta)
        delta_rel = delta
        if cfg.mode == "scale":
            velocity = self._one_sided(momentum(state.velocity, delta_rel, cfg.beta), step)
            scale, velocity = self._clamp(state.scale * (1.0 + cfg.step_size * velocity), velocity, value_bounds)
            return ControllerState(velocity=velocity, scale=scale, last_delta=delta_rel)
        if paper_decay is None:
            raise ValueError(
                "auto_lr.mode='paper' needs the base schedule's floor and length: use HDETOneCycleLR, or pass "
                "paper_decay=PaperDecay(total_steps, floor) to the ensemble"
            )
        base, gamma = state.owned_base, state.gamma
        if base is None:
            base = trained_base
            remaining = max(1, (paper_decay.total_steps - step) // sync_interval)
            gamma = decay_to_floor(base, paper_decay.floor, remaining) if base > paper_decay.floor else 0.0
        delta = base * delta_rel
        velocity = momentum(state.velocity, delta, cfg.beta)
        new_base = max(base * (1.0 - gamma) + cfg.step_size * velocity, paper_decay.floor)
        return ControllerState(velocity=velocity, owned_base=new_base, gamma=gamma, last_delta=delta)

    def _one_sided(self, velocity: float, step: int) -> float:
        """``velocity``, stopped at 0 past ``auto_lr.rise_only_after`` of the controller's window: the scale then
        only rises."""
        share = window_share(self.config, step)
        if share is None or self.config.rise_only_after >= 1.0:
            return velocity
        return max(velocity, 0.0) if share > self.config.rise_only_after else velocity

    def _clamp(self, scale: float, velocity: float,
               value_bounds: tuple[float, float] | None) -> tuple[float, float]:
        """``scale`` inside [scale_min, scale_max], then inside ``value_bounds``, and ``velocity`` with nothing left
        pointing past a bound the scale stopped at: momentum that wound on there would hold the scale at the bound
        for as many updates after the evidence turned as it took to unwind (a label smoothing's scale at 10 on a
        base of 0.3, pinned below 1)."""
        bounds = ((self.config.scale_min, self.config.scale_max), *([value_bounds] if value_bounds else []))
        for low, high in bounds:
            scale = min(max(scale, low), high)
        for low, high in bounds:  # where a value's bounds lie outside the controller's, the scale ends past both
            if scale >= high:
                velocity = min(velocity, 0.0)
            elif scale <= low:
                velocity = max(velocity, 0.0)
        return scale, velocity


# ------------------------------------------------------------------------------------ the controller's window
MIN_CONTROLLER_UPDATES = 4
"""Fewer controller updates than this (or than ``updates_to_climb``) in its window are warned about."""
ROUND_SYNC_INTERVALS = (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000)
"""The sync intervals ``sync_interval_for_run`` picks from: round numbers, so that checkpoint and evaluation
intervals can be multiples of them, up to the library's default."""
MEASURED_CONTROLLER_UPDATES = 14
"""The controller updates in the default window of benchmarks/lr_finding.py's default setting (T = 25, 1,500 steps),
where the defaults were measured: ``updates_to_climb`` (10) and four more."""


def window_share(config: AutoLRConfig, step: int) -> float | None:
    """How far ``step`` is into the controller's window, from ``start`` (an unresolved start counts as 0) to
    ``stop``, both steps as ``HDETConfig.for_run`` resolves them: 0 at the start, 1 at the stop, below 0 before and
    above 1 after; None without a stop. The one-sided phase (``rise_only_after``) is placed by this share."""
    if not is_step(config.stop):
        return None
    start = config.start if is_step(config.start) else 0
    return (step - start) / max(config.stop - start, 1)


def updates_to_climb(config: AutoLRConfig) -> int:
    """How many controller updates the LR needs to climb from ``initial_scale`` to ``scale_max`` at the largest
    step, ``max_log_step`` a sync (``log`` mode: the reach of a too-low start), at least MIN_CONTROLLER_UPDATES.
    Other modes have no largest step: MIN_CONTROLLER_UPDATES."""
    lr = config.filled()
    if lr.mode != "log" or lr.initial_scale >= lr.scale_max:
        return MIN_CONTROLLER_UPDATES
    # less a hair: a climb of exactly n steps (log(100) / (log(100) / 14)) must not round up to n + 1
    climb = math.ceil(math.log(lr.scale_max / lr.initial_scale) / lr.max_log_step - 1e-9)
    return max(MIN_CONTROLLER_UPDATES, climb)


def controller_updates(config: HDETConfig) -> int | None:
    """How many syncs the controller updates at: those from ``auto_lr.start`` to ``stop`` inclusive, in steps
    (``for_run`` applied); None where it has no stop."""
    lr = config.auto_lr
    if lr.stop is None:
        return None
    first = -(-max(lr.start, 1) // config.sync_interval) * config.sync_interval
    return len(range(first, lr.stop + 1, config.sync_interval))


def sync_interval_for_run(total_steps: int) -> int:
    """The sync interval for a run of ``total_steps`` with the default controller: the largest of
    ``ROUND_SYNC_INTERVALS`` whose window (2% to 25% of the run) holds ``MEASURED_CONTROLLER_UPDATES`` updates, 1
    where none does (a run that short is warned about at start). 5 for 300 steps, 25 for 1,500, 1000 from about
    60,000."""
    for interval in reversed(ROUND_SYNC_INTERVALS):
        if controller_updates(HDETConfig(sync_interval=interval).for_run(total_steps)) >= MEASURED_CONTROLLER_UPDATES:
            return interval
    return 1
