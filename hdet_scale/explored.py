"""One explored hyperparameter: its spread, permutation and controller state, and the values they give.

A replica's value is ``base * rho_{pi(r)}`` (eq. 1 and eq. 9), where the base is the schedule's value times
the controller's scale (``paper`` mode: the base the controller owns), every value kept inside the knob's
bounds. The ensemble owns one ``ExploredValue`` per explored hyperparameter and param group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hdet_scale.controller import Controller, ControllerState, PaperDecay
from hdet_scale.knobs import Knob
from hdet_scale.spread import PermutationStream, multipliers


@dataclass
class ExploredValue:
    """One explored hyperparameter with its own spread, permutation and controller (eq. 9)."""

    knob: Knob
    stream: PermutationStream
    multipliers: list[float]
    """Eq. 1's multipliers rho, indexed by slot."""
    paper_decay: PaperDecay | None = None
    permutation: list[int] = field(default_factory=list)
    """Entry r is the slot of replica r for the current interval."""
    state: ControllerState = field(default_factory=ControllerState)
    applied_bases: list[float] = field(default_factory=list)
    """The base every optimizer step of the current interval used, in order (the replay's record)."""
    parts_delta_x_steps: float = 0.0
    """The sum of steps x Delta over the parts of the interval that extra syncs ended (``keep_part``)."""
    parts_steps: int = 0
    """The steps of those parts: the next regular update takes the step-weighted mean of every part's Delta."""

    @classmethod
    def start(cls, knob: Knob, *, seed: int, num_replicas: int, alpha: float, spread: str = "linear",
              paper_decay: PaperDecay | None = None) -> ExploredValue:
        """The value at the start of training: the multipliers for ``alpha`` (eq. 1, or ``spread="log"``) and
        the stream's first permutation."""
        explored = cls(knob=knob, stream=PermutationStream(knob.name, seed),
                       multipliers=multipliers(num_replicas, alpha, spread), paper_decay=paper_decay)
        explored.redraw()
        return explored

    @property
    def name(self) -> str:
        return self.knob.name

    @property
    def num_replicas(self) -> int:
        return len(self.multipliers)

    @property
    def is_lr(self) -> bool:
        return self.knob.is_lr

    # ------------------------------------------------------------------------------------ values
    def base(self, scheduled: float | None = None) -> float:
        """The controller's base: ``scheduled * scale`` (``paper`` mode: its own), inside the knob's bounds.

        ``scheduled`` is the schedule's value now; by default the knob's (``knob.scheduled()``)."""
        if self.state.owned_base is not None:
            return self.knob.bounds.clamp(self.state.owned_base)
        scheduled = self.knob.scheduled() if scheduled is None else scheduled
        return self.knob.bounds.clamp(scheduled * self.state.scale)

    def multiplier(self, replica: int) -> float:
        """rho_{pi(r)}: the multiplier replica ``replica`` trains with in the current interval."""
        return self.multipliers[self.permutation[replica]]

    def applied_value(self, replica: int, scheduled: float | None, step_in_interval: int) -> float:
        """``value`` for the optimizer step about to run, the interval's ``step_in_interval``-th (from 0), recording
        that step's base in ``applied_bases``. A step whose optimizer runs several times (ZeRO-3 steps it once per
        sub-group) keeps one base: each call records over the last."""
        base = self.base(scheduled)
        del self.applied_bases[step_in_interval:]
        self.applied_bases.append(base)
        return self._on_base(base, replica)

    def mean_multiplier(self) -> float:
        """The replicas' mean multiplier: their mean value over the base (1 on a linear spread; above 1 on a log
        spread, by how much depending on the replica count)."""
        return math.fsum(self.multipliers) / len(self.multipliers)

    def replica_multipliers(self) -> list[float]:
        """Every replica's multiplier for the current interval, by replica."""
        return [self.multiplier(replica) for replica in range(self.num_replicas)]

    def value(self, replica: int, scheduled: float | None = None) -> float:
        """Replica ``replica``'s value: base times its multiplier, inside the knob's bounds."""
        return self._on_base(self.base(scheduled), replica)

    def _on_base(self, base: float, replica: int) -> float:
        return self.knob.bounds.clamp(base * self.multiplier(replica))

    def replica_values(self) -> list[float]:
        """Every replica's value now, by replica."""
        return [self.value(replica) for replica in range(self.num_replicas)]

    def scale_on_schedule(self) -> float:
        """The base over the schedule's value now: the controller's scale, or in ``paper`` mode, once it owns the
        base, that base over what the schedule would give (NaN where the schedule gives 0)."""
        if self.state.owned_base is None:
            return self.state.scale
        scheduled = self.knob.scheduled()
        return self.base() / scheduled if scheduled else math.nan

    def last_base(self) -> float:
        """The base the interval's last step trained with; the base now where no step has run since the last sync.
        At a sync the schedule has already moved on to the next step's value."""
        return self.applied_bases[-1] if self.applied_bases else self.base()

    def trained_values(self) -> list[float]:
        """Every replica's value at the interval's last step, by replica: what its losses were trained with."""
        base = self.last_base()
        return [self._on_base(base, replica) for replica in range(self.num_replicas)]

    # ------------------------------------------------------------------------------------ a sync
    def keep_part(self, controller: Controller, *, weights: Sequence[float], steps: int) -> None:
        """Keeps the Delta of eq. 4's ``weights`` over the ``steps`` since the last sync, which an extra sync ends
        and the controller does not move at: the next regular update weighs it by its steps beside the interval's
        other parts (each with its own multipliers), so a cut interval moves the controller on all of its evidence.
        A probe on averaged weights (``auto_lr.average_window``) scores a part that ends before the window the
        interval's last steps span on the part's last weights."""
        self.parts_delta_x_steps += steps * controller.hypergradient(weights, self.replica_multipliers())
        self.parts_steps += steps

    def forget_parts(self) -> None:
        """Drops the kept parts (a regular sync where the controller does not move)."""
        self.parts_delta_x_steps, self.parts_steps = 0.0, 0

    def update(self, controller: Controller, *, weights: Sequence[float], steps: int, step: int,
               sync_interval: int) -> None:
        """Moves the controller state by one sync from eq. 4's ``weights`` over the last ``steps`` steps, with the
        parts of the interval before them that extra syncs ended (``keep_part``), each weighed by its steps."""
        delta = controller.hypergradient(weights, self.replica_multipliers())
        if self.parts_steps:
            delta = (self.parts_delta_x_steps + steps * delta) / (self.parts_steps + steps)
        self.forget_parts()
        self.state = controller.update(self.state, delta=delta, trained_base=self.last_base(), step=step,
                                       sync_interval=sync_interval, paper_decay=self.paper_decay,
                                       value_bounds=self._scale_bounds())

    def _scale_bounds(self) -> tuple[float, float] | None:
        """The scales, on the schedule's value now, that put the base at the knob's low bound and the top replica's
        value at its high one (``Knob.highest_base``): past them a value stays clamped while the scale would wind
        on, and the controller would credit a replica with a multiplier it does not train at. None where the
        schedule gives 0 or no finite value."""
        scheduled = self.knob.scheduled()
        if not math.isfinite(scheduled) or scheduled == 0.0:
            return None
        highest = self.knob.highest_base() / max(self.multipliers)
        low, high = sorted((self.knob.bounds.low / scheduled, highest / scheduled))
        return low, high

    def redraw(self) -> None:
        """Draws the next interval's permutation (eq. 9's re-assignment)."""
        self.permutation = self.stream.draw(self.num_replicas)

    def report(self, trained_with: list[float], applied_bases: list[float],
               trained_multipliers: list[float]) -> dict[str, Any]:
        """The metrics entry: what the replicas trained with (aligned with the interval's losses), the base every
        step of the interval used and each replica's multiplier on it, the controller's new state, and what the
        replicas train with next."""
        return {
            "replica_values": trained_with,
            "applied_bases": applied_bases,
            "replica_multipliers": trained_multipliers,
            "base": self.base(),
            "scale": self.scale_on_schedule(),
            "delta": self.state.last_delta,
            "velocity": self.state.velocity,
            "next_replica_values": self.replica_values(),
        }

    # ------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        state = {"permutation": list(self.permutation), "controller": self.state.state_dict(),
                 "stream": self.stream.state_dict(), "applied_bases": list(self.applied_bases),
                 "parts_delta_x_steps": self.parts_delta_x_steps, "parts_steps": self.parts_steps,
                 "mean_multiplier": self.mean_multiplier()}
        knob = self.knob.state()
        if knob:
            state["knob"] = knob
        return state

    def load_state_dict(self, state: dict[str, Any], *, same_layout: bool) -> None:
        """Restores ``state_dict()``; with another replica count (``same_layout`` False) the permutation is
        drawn afresh from the restored stream. The bases of the interval's steps taken so far come back too (a
        state saved between syncs; none in one of an earlier version), so the next sync records every step's, and so
        do the parts of the interval extra syncs ended (a preemption checkpoint's sync)."""
        self.state = ControllerState.from_state_dict(state["controller"])
        self.knob.load_state(state.get("knob", {}))  # none in a state of an earlier version
        self.applied_bases = [float(base) for base in state.get("applied_bases", [])]
        self.parts_delta_x_steps = float(state.get("parts_delta_x_steps", 0.0))  # a state saved at a regular sync
        self.parts_steps = int(state.get("parts_steps", 0))
        self.stream.load_state_dict(state["stream"])
        if same_layout:
            self.permutation = list(state["permutation"])
        else:
            self.redraw()
