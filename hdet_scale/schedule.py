"""HDET on a learning-rate scheduler: the paper's drop-in OneCycleLR, a wrapper for any scheduler, and the
replay of a schedule an HDET run discovered.

The first two keep the scheduler's own behaviour for the base schedule (``get_last_lr()`` and ``param_groups``
always show the base values) and apply each replica's multiplier only inside ``optimizer.step()``, so
multipliers cannot compound with chainable schedulers. ``step(loss)`` replaces ``step()``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler, OneCycleLR

from hdet_scale.config import HDETConfig
from hdet_scale.controller import PaperDecay
from hdet_scale.engines.ddp import DDPAdapter, check_gradient_mean
from hdet_scale.ensemble import HDETEnsemble
from hdet_scale.handle import HDETHandle
from hdet_scale.knobs import group_names
from hdet_scale.metrics import SyncReport
from hdet_scale.notices import warn
from hdet_scale.replay import OPTIMIZER_KEYS, ScheduleFileError, optimizer_entry, read_schedule
from hdet_scale.resolve import load_config
from hdet_scale.scores import LossLike
from hdet_scale.topology import ReplicaTopology

ConfigSource = HDETConfig | Mapping[str, Any] | str | os.PathLike[str] | None


def resolve_config(source: ConfigSource, overrides: Mapping[str, Any]) -> HDETConfig:
    """A validated config from ``source`` with keyword ``overrides`` on top: a nested section given as a dict
    changes the fields it names, one given as its dataclass (``AutoLRConfig(...)``) replaces the section."""
    config = load_config(source)
    return load_config(config.changed(**overrides)) if overrides else config


class HDETScheduler(HDETHandle):
    """Puts HDET on any torch LR scheduler (cosine, LambdaLR, warmup-stable-decay, chained...).

    Call ``step(loss)`` where you called ``scheduler.step()``, after ``optimizer.step()``. ``paper`` mode
    needs ``paper_decay`` (the schedule's floor and length per param group); ``scale`` mode needs nothing.

    Args:
        scheduler: the base schedule, already built on its optimizer.
        hdet_config: an HDETConfig, a dict, a JSON path, or None for defaults.
        model: optional model whose floating-point buffers are averaged with the parameters.
        topology: the replica layout; built from the default process group when omitted.
        paper_decay: per param group, for ``auto_lr.mode='paper'``.
        total_steps: the run's length in optimizer steps (the default controller starts and stops at shares of
            it; the scheduler does not say).
        state: the ``state_dict()`` of the scheduler this run continues, for a model whose weights are loaded
            already: restored here, without new warm-init noise (else call ``load_state_dict`` after building).
        **hdet_fields: config fields overriding ``hdet_config`` (e.g. ``sync_interval=100``).
    """

    def __init__(self, scheduler: LRScheduler, *, hdet_config: ConfigSource = None, model: nn.Module | None = None,
                 topology: ReplicaTopology | None = None, paper_decay: list[PaperDecay] | None = None,
                 total_steps: int | None = None, state: Mapping[str, Any] | None = None,
                 **hdet_fields: Any) -> None:
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError("HDETScheduler steps its scheduler after every optimizer step, with no metric, and "
                            "ReduceLROnPlateau steps on one: keep calling plateau.step(metric) where you evaluate, and "
                            "attach HDET with hdet_scale.engines.ddp.attach(model, optimizer, config), calling "
                            "hdet.step(loss) after each optimizer step")
        config = resolve_config(hdet_config, hdet_fields)
        check_gradient_mean(model, config)
        self.scheduler = scheduler
        self.hdet = HDETEnsemble(config, DDPAdapter(scheduler.optimizer, model), topology=topology,
                                 paper_decay=paper_decay, total_steps=total_steps,
                                 state=None if state is None else state["hdet"])
        if state is not None:
            self._load_scheduler(state["scheduler"])

    def _attached(self) -> HDETEnsemble:
        return self.hdet

    def step(self, loss: LossLike | None = None) -> SyncReport | None:
        """Advances the base schedule, then HDET (which syncs every ``sync_interval`` calls). While an LR range
        test runs (``auto_lr.range_test``) the schedule holds: the run starts again after it."""
        if not self.hdet.ramping:
            self.hdet.record_step_bases()  # a step an AMP scaler skipped trained (would have) at the base before
            self.scheduler.step()
        return self.hdet.step(loss)

    def get_last_lr(self) -> list[float]:
        """The base schedule's LRs (this replica's are ``hdet.current_lrs()``)."""
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "hdet": self.hdet.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_scheduler(state["scheduler"])
        self.hdet.load_state_dict(state["hdet"])

    def _load_scheduler(self, state: dict[str, Any]) -> None:
        """Loads the base schedule's state and puts its values into the param groups (``restore_group_values``)."""
        self.scheduler.load_state_dict(state)
        restore_group_values(self.scheduler)


def restore_group_values(scheduler: LRScheduler, step: Callable[[], None] | None = None) -> None:
    """Puts a just-loaded ``scheduler``'s values of its restored step into its optimizer's param groups: building it
    set the groups to its first step's, over what an optimizer state loaded before it had restored, and the first
    resumed step would train there. The LRs are in its state; a scheduler that cycles momentum too (OneCycleLR,
    CyclicLR) computes both from its step count alone, so that step's are computed again, the count left as it was
    (torch's own order check, which warns, included). ``step``: the scheduler's own step, where its class adds to
    it."""
    if not getattr(scheduler, "cycle_momentum", False):
        for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
        return
    count = scheduler._step_count
    scheduler.last_epoch -= 1
    scheduler._step_count = max(count, 2)  # past torch's check of a first step taken before optimizer.step()
    (step or scheduler.step)()
    scheduler._step_count = count


class HDETOneCycleLR(OneCycleLR, HDETHandle):
    """Drop-in replacement for ``torch.optim.lr_scheduler.OneCycleLR`` with HDET (the paper's interface).

    Same arguments and defaults as OneCycleLR, plus the keyword-only HDET settings. Use
    ``scheduler.step(loss)`` after ``optimizer.step()``. In one process without a process group there is
    one replica and the LRs and momenta are exactly OneCycleLR's (without the LR range test: ``auto_lr`` with
    ``range_test`` 0). Under torch.distributed each replica
    trains at its own multiple of the schedule and replicas are averaged every ``sync_interval`` steps.

    Keyword-only args:
        hdet_config: an HDETConfig, a dict, a JSON path, or None for defaults.
        model: optional model whose floating-point buffers are averaged with the parameters.
        topology: the replica layout; built from the default process group when omitted.
        state: the ``state_dict()`` of the scheduler this run continues, for a model whose weights are loaded
            already: restored here, without new warm-init noise (else call ``load_state_dict`` after building).
        **hdet_fields: config fields overriding ``hdet_config`` (e.g. ``sync_interval=100``).

    In ``paper`` mode the controller takes the LR over at the end of the warm-up (``pct_start`` of the run, where
    it ends before the run does) unless ``auto_lr.start`` says otherwise.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, max_lr: float | list[float], total_steps: int | None = None,
                 epochs: int | None = None, steps_per_epoch: int | None = None, pct_start: float = 0.3,
                 anneal_strategy: str = "cos", cycle_momentum: bool = True,
                 base_momentum: float | list[float] = 0.85, max_momentum: float | list[float] = 0.95,
                 div_factor: float = 25.0, final_div_factor: float = 1e4, three_phase: bool = False,
                 last_epoch: int = -1, *, hdet_config: ConfigSource = None, model: nn.Module | None = None,
                 topology: ReplicaTopology | None = None, state: Mapping[str, Any] | None = None,
                 **hdet_fields: Any) -> None:
        config = resolve_config(hdet_config, hdet_fields)
        if config.auto_lr.mode == "paper" and config.auto_lr.start is None and pct_start < 1:
            # The paper's controller takes over after the warm-up (S_warm): from the schedule's peak, not on its rise.
            config = dataclasses.replace(config, auto_lr=dataclasses.replace(config.auto_lr, start=float(pct_start)))
        check_gradient_mean(model, config)
        topology = topology or ReplicaTopology.build(config)  # layout errors before OneCycleLR touches anything
        self.hdet: HDETEnsemble | None = None  # OneCycleLR.__init__ calls step() before HDET exists
        super().__init__(optimizer, max_lr, total_steps=total_steps, epochs=epochs,
                         steps_per_epoch=steps_per_epoch, pct_start=pct_start, anneal_strategy=anneal_strategy,
                         cycle_momentum=cycle_momentum, base_momentum=base_momentum, max_momentum=max_momentum,
                         div_factor=div_factor, final_div_factor=final_div_factor, three_phase=three_phase,
                         last_epoch=last_epoch)
        # Only paper mode decays to the floor: in the others a group at max_lr 0 (a frozen one) has none to give.
        floors = ([PaperDecay(total_steps=self.total_steps, floor=group["min_lr"]) for group in optimizer.param_groups]
                  if config.auto_lr.mode == "paper" else None)
        self.hdet = HDETEnsemble(config, DDPAdapter(optimizer, model), topology=topology, paper_decay=floors,
                                 total_steps=self.total_steps,
                                 state=None if state is None else state["hdet_state"])
        if state is not None:
            self._load_one_cycle({key: value for key, value in state.items() if key != "hdet_state"})

    def _attached(self) -> HDETEnsemble:
        if self.hdet is None:
            raise RuntimeError("HDETOneCycleLR is still being built: HDET is attached at the end of its __init__")
        return self.hdet

    def step(self, loss: LossLike | None = None) -> SyncReport | None:  # type: ignore[override]
        """Advances OneCycleLR, then HDET (which syncs every ``sync_interval`` calls); OneCycleLR holds while an
        LR range test runs (``auto_lr.range_test``)."""
        if self.hdet is None:
            super().step()
            return None
        if not self.hdet.ramping:
            self.hdet.record_step_bases()  # a step an AMP scaler skipped trained (would have) at the base before
            super().step()
        return self.hdet.step(loss)

    def state_dict(self) -> dict[str, Any]:
        state = {key: value for key, value in super().state_dict().items() if key != "hdet"}
        state["hdet_state"] = self.hdet.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        hdet_state = state.pop("hdet_state")
        self._load_one_cycle(state)
        self.hdet.load_state_dict(hdet_state)

    def _load_one_cycle(self, state: dict[str, Any]) -> None:
        """OneCycleLR's state, and its LR and momentum of the restored step in the param groups
        (``restore_group_values``)."""
        OneCycleLR.load_state_dict(self, state)
        restore_group_values(self, lambda: OneCycleLR.step(self))  # not HDET's step too


FROM_THE_FILE = ("values", "_entries", "steps")
"""``ReplaySchedule`` attributes read from its file, not from a saved state."""


class ReplaySchedule(LRScheduler):
    """Replays the schedule an HDET run discovered, without HDET: step k of this run uses, per param group, the
    base LR (and weight decay, where it was explored) that step k of the HDET run used: the centre of its
    replicas' spread (with an LR spread, each replica trained at the base times its multiplier).

    The file comes from ``python -m hdet_scale.tools.report RUN.jsonl --export-schedule schedule.json``. It is a torch
    LR scheduler: call ``step()`` after ``optimizer.step()``. Param groups are matched by name (their ``name``
    entry, else their index), and every group needs its ``lr/<group>``. Past the file's last step the last
    values hold, with one warning. Other explored values (``dropout``, ``label_smoothing``) are not optimizer
    entries: read them with ``value(name)``. Momentum is not in the file (OneCycleLR's cycling of it is not
    replayed): the optimizer's own holds.

    Args:
        optimizer: the optimizer whose param groups it sets.
        schedule: the schedule file's path.
        last_epoch: as for every torch LR scheduler (-1: a fresh start).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: str | os.PathLike[str],
                 last_epoch: int = -1) -> None:
        loaded = read_schedule(schedule)
        self.steps: int = loaded["steps"]
        self.values: dict[str, list[float]] = loaded["values"]
        names = group_names(optimizer)
        self._entries: dict[str, list[tuple[int, list[float]]]] = {key: [] for key in OPTIMIZER_KEYS}
        for name, bases in self.values.items():
            entry = optimizer_entry(name)
            if entry is None:
                continue
            key, group = entry
            if group not in names:
                raise ScheduleFileError(f"{schedule}: {name!r} is for param group {group!r}; the optimizer's "
                                        f"groups are {names} (group names must match the run that wrote it)")
            self._entries[key].append((names.index(group), bases))
        missing = sorted(set(range(len(names))) - {index for index, _ in self._entries["lr"]})
        if missing:
            raise ScheduleFileError(f"{schedule}: no lr for param group(s) {[names[i] for i in missing]} (it has "
                                    f"{sorted(self.values)}): replay it on an optimizer with the run's groups")
        self._warned_past_end = False
        super().__init__(optimizer, last_epoch)

    def _at(self, bases: list[float]) -> float:
        # last_epoch == steps after the run's last step too, whose scheduler.step() asks for a value no step uses:
        # one past it, a step did
        if self.last_epoch > self.steps and not self._warned_past_end:
            self._warned_past_end = True
            warn(f"ReplaySchedule: past the replayed schedule's {self.steps} steps; its last values hold")
        return bases[min(self.last_epoch, self.steps - 1)]

    def get_lr(self) -> list[float]:
        """The bases of the optimizer step about to run (step ``last_epoch + 1`` of the replayed run)."""
        lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        for index, bases in self._entries["lr"]:
            lrs[index] = self._at(bases)
        return lrs

    def step(self, epoch: int | None = None) -> None:
        """Moves to the next step: LRs through torch's scheduler machinery, weight decays alongside."""
        super().step(epoch)
        self._set_weight_decays()

    def _set_weight_decays(self) -> None:
        """The replayed weight decays of the step about to run, in their param groups."""
        for index, bases in self._entries["weight_decay"]:
            self.optimizer.param_groups[index]["weight_decay"] = self._at(bases)

    def state_dict(self) -> dict[str, Any]:
        """The position and torch's scheduler state, without the schedule itself (it stays in its file)."""
        return {key: value for key, value in super().state_dict().items() if key not in FROM_THE_FILE}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the position, and the restored step's LRs and weight decays in the param groups
        (``restore_group_values``); what the file says (its length, its values) stays the file's, also from a state
        saved by an earlier version, which held its length."""
        super().load_state_dict({key: value for key, value in state_dict.items() if key not in FROM_THE_FILE})
        restore_group_values(self)
        self._set_weight_decays()

    def value(self, name: str) -> float:
        """The replayed base of any explored value (e.g. ``"label_smoothing"``) for the step about to run."""
        if name not in self.values:
            raise KeyError(f"{name!r} is not in the replayed schedule; it has {sorted(self.values)}")
        return self._at(self.values[name])
