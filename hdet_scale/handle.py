"""The one shape of HDET handle that every way of attaching it hands back: ``HDETEnsemble`` itself (DDP's
``attach``), the schedulers (``HDETScheduler``, ``HDETOneCycleLR``), FSDP2's ``wrap``, DeepSpeed's ``engine.hdet``
and the Trainer and Lightning callbacks all answer the same calls, so a loop reads the same on every engine."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from hdet_scale.ensemble import HDETEnsemble
from hdet_scale.metrics import SyncReport
from hdet_scale.scores import LossLike


class HDETHandle(ABC):
    """``step(loss)``, ``sync()``, ``set_probe(fn)``, ``value(name)``, ``add_knob(...)``, ``close()``,
    ``state_dict()``, ``load_state_dict()``, ``last_report``, ``global_step``, ``ramping``, ``found_lr_factor()``,
    ``record_step_bases()`` and ``ensemble`` on every engine. A
    subclass says where its ensemble is (``_attached``); one whose loop steps HDET itself (DeepSpeed's
    ``engine.step()``, the integrations) refuses ``step`` and ``observe``."""

    loop_feeds_hdet: ClassVar[str | None] = None
    """How this handle's loop hands HDET each loss and takes its steps, where it does: ``step`` and ``observe``
    then refuse (a loss observed twice would count twice), naming it."""

    @abstractmethod
    def _attached(self) -> HDETEnsemble:
        """The ensemble behind the handle, or a clear error where it is not attached yet."""

    @property
    def ensemble(self) -> HDETEnsemble:
        """The engine-agnostic orchestrator behind this handle."""
        return self._attached()

    def step(self, loss: LossLike | None = None) -> SyncReport | None:
        """Call after every ``optimizer.step()``: HDET's step (a sync every ``sync_interval`` calls)."""
        self._refuse_where_the_loop_feeds_hdet("step")
        return self._attached().step(loss)

    def record_step_bases(self) -> None:
        """With an AMP scaler, which skips a step on an overflow: call before ``scheduler.step()``, so that a
        skipped step is recorded (metrics, replay) at its own base, not the next step's
        (``HDETEnsemble.record_step_bases``)."""
        self._attached().record_step_bases()

    def observe(self, loss: LossLike) -> None:
        """Adds a micro-batch loss to the step under way, for ``step()`` without a loss (gradient accumulation)."""
        self._refuse_where_the_loop_feeds_hdet("observe")
        self._attached().observe(loss)

    def _refuse_where_the_loop_feeds_hdet(self, call: str) -> None:
        if self.loop_feeds_hdet is not None:
            raise RuntimeError(f"{self.loop_feeds_hdet}: do not call {call}()")

    def current_lrs(self) -> list[float]:
        """The LR of each param group this replica trains with at the next optimizer step."""
        return self._attached().current_lrs()

    def lr_multiplier(self, group_index: int = 0) -> float:
        """This replica's multiplier on param group ``group_index`` for the current interval."""
        return self._attached().lr_multiplier(group_index)

    def weights_loaded(self) -> bool:
        """Call on every rank after loading the weights to start from (a pretrained model) once HDET has attached,
        before the first step: the run starts from them (each replica's warm-init noise; the LR range test comes
        back to them, not to the weights HDET attached to). ``HDETEnsemble.weights_loaded``."""
        return self._attached().weights_loaded()

    def sync(self) -> SyncReport | None:
        """A sync now, between the regular ones (collective: every rank calls it), e.g. before an export; None
        where the replicas are one model already (right after a sync) or no step has been taken
        (``HDETEnsemble.sync``)."""
        return self._attached().sync()

    def check_one_model(self, what: str) -> None:
        """Refuses ``what`` (an export of the model) between syncs (``HDETEnsemble.check_one_model``)."""
        self._attached().check_one_model(what)

    def set_probe(self, probe: Callable[[], LossLike] | None) -> None:
        """Scores the replicas on a held-out batch at each sync (``HDETEnsemble.set_probe``)."""
        self._attached().set_probe(probe)

    def value(self, name: str) -> float:
        """This replica's current value of an explored hyperparameter (``"lr/0"``, ``"label_smoothing"``...)."""
        return self._attached().value(name)

    def add_knob(self, name: str, getter: Callable[[], float], setter: Callable[[float], None], *,
                 alpha: float | None = None, low: float = -math.inf, high: float = math.inf) -> None:
        """Explores a scalar of your own (``HDETEnsemble.add_knob``): on every rank, before the first step."""
        self._attached().add_knob(name, getter, setter, alpha=alpha, low=low, high=high)

    def close(self) -> None:
        """Returns every explored value to its base and removes HDET's optimizer hooks (``HDETEnsemble.close``)."""
        self._attached().close()

    @property
    def last_report(self) -> SyncReport | None:
        """The most recent sync's report; None before the first."""
        return self._attached().last_report

    @property
    def global_step(self) -> int:
        """Optimizer steps of the run HDET has counted (an LR range test's are not the run's)."""
        return self._attached().global_step

    @property
    def ramping(self) -> bool:
        """True while the LR range test the run starts with runs (``auto_lr.range_test``): a loop of
        ``while hdet.global_step < total_steps`` runs its steps before the run's."""
        return self._attached().ramping

    def found_lr_factor(self) -> float | None:
        """The factor HDET found on the schedule's LR, by the range test or the controller (None where neither
        sets it)."""
        return self._attached().found_lr_factor()

    def state_dict(self) -> dict[str, Any]:
        """HDET's state for a checkpoint (taken at a sync point)."""
        return self._attached().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores ``state_dict()``."""
        self._attached().load_state_dict(state)


HDETHandle.register(HDETEnsemble)  # the ensemble answers every call itself
