"""The HDET orchestrator: fan-out between syncs, converge and re-assign at every sync.

Engine-agnostic: an ``EngineAdapter`` says which tensors to average and which optimizer holds the LRs.
The training loop calls ``step(loss)`` once per optimizer step, after ``optimizer.step()``; every
``sync_interval`` steps that call averages the replicas, updates the controller and re-assigns the
multipliers. Between syncs it does no communication.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from hdet_scale.adapter import EngineAdapter
from hdet_scale.averaging import average_healthy, average_tensors
from hdet_scale.comm import bits_fingerprint, gather_rows
from hdet_scale.config import HDETConfig, HDETConfigError
from hdet_scale.config_rules import PROBE_ONLY_KNOBS, check_scale_step, check_spread_alpha
from hdet_scale.controller import Controller, ControllerState, PaperDecay
from hdet_scale.explored import ExploredValue
from hdet_scale.knobs import (
    Bounds,
    Knob,
    ValueKnob,
    configured_knobs,
    fold_attention_scale,
    group_names,
    is_configured_name,
    lr_knobs,
)
from hdet_scale.lr_hooks import StepScopedValues
from hdet_scale.metrics import MetricsWriter, SyncReport
from hdet_scale.notices import warn
from hdet_scale.range_test import MEAN_LR_OVER_PICK, RangeTest, RangeTestStart
from hdet_scale.resolve import (
    check_attachable,
    few_updates_warning,
    late_start_warning,
    resolve,
    run_length_error,
    single_replica_warning,
    unread_settings_warnings,
)
from hdet_scale.scorer import ReplicaScorer
from hdet_scale.scores import LossLike, ReplicaScores
from hdet_scale.topology import ReplicaTopology
from hdet_scale.warm_init import WarmNoise, add_warm_noise

logger = logging.getLogger(__name__)


class HDETEnsemble:
    """Hyperparameter-Divergent Ensemble Training over any engine.

    Build it after the engine has wrapped (and broadcast) the model: on a fresh start with
    ``warm_init.enabled`` it adds each replica's eq. 10 noise to the weights at construction. A run that
    continues from a checkpoint whose weights are loaded already passes the checkpoint's ``state``, so the
    loaded weights are not noised again.

    Args:
        config: HDET settings; resolved for the run here (``resolve``), which leaves a config a front door
            resolved as it is.
        adapter: the engine adapter (see ``hdet_scale.engines``).
        topology: the replica layout; built from the default process group when omitted.
        paper_decay: per param group, the schedule's floor and length, for ``auto_lr.mode='paper'``.
        state: the ``state_dict()`` of the run this one continues (no warm init), or None for a fresh start.
        total_steps: the run's length in optimizer steps, for the controller's start and stop given as shares of
            the run (``auto_lr.start``/``stop`` as floats, the defaults): ``config.for_run(total_steps)``.
    """

    def __init__(self, config: HDETConfig, adapter: EngineAdapter, *, topology: ReplicaTopology | None = None,
                 paper_decay: Sequence[PaperDecay] | None = None, state: Mapping[str, Any] | None = None,
                 total_steps: int | None = None) -> None:
        # shares of the run without total_steps stay (refused below where the controller would run)
        config = resolve(config, total_steps=total_steps)
        self.config = config
        self.adapter = adapter
        self.topology = topology or ReplicaTopology.build(config)
        check_attachable(config, adapter, self.topology, paper_decay, fresh_start=state is None)
        self._controllers = {"lr": Controller(config.auto_lr), "other": Controller(config.auto_lr.for_other_knobs())}
        self._explored: list[ExploredValue] = []
        for index, knob in enumerate(lr_knobs(adapter.optimizer)):
            self._explore(knob, paper_decay[index] if paper_decay is not None else None)
        for knob in configured_knobs(config.explore, adapter.optimizer, adapter.module):
            self._explore(knob)
        self._metrics = MetricsWriter(config.metrics_path, is_writer=self.topology.rank == 0)
        self._step = 0
        self._stepped = False  # any step taken, of the range test or of the run
        self._settings_said = False  # the first step (also of a resumed run) warns of settings the run does not read
        self._last_sync_step: int | None = 0  # set by _start_from_weights, or by a loaded state
        self._scorer = ReplicaScorer(config.auto_lr, config.sync_interval)
        self._warned_no_loss = False
        self._probing = False  # value("label_smoothing") reads 0 while the probe runs
        self._closed = False
        self._at_base = False  # apply_base_values gave every replica the base values, until the next sync
        self._pre_sync_hooks: list[Callable[[int], None]] = []
        self._buckets: list[torch.Tensor] = []  # the sync's bucket memory, reused from one sync to the next
        self._last_report: SyncReport | None = None
        # add_knob values of a loaded state, by name: restored when add_knob adds them, before the first step
        self._awaited_knobs: dict[str, tuple[Mapping[str, Any], bool]] = {}
        self._range_start: RangeTestStart | None = None
        self.range_test_pick: float | None = None
        """The LR the run's range test picked (``auto_lr.range_test``), once it has run; None without one."""
        self._range_test_picked = True  # False once a range test picked nothing: the LR stays the one given
        self._warm_noise: WarmNoise | None = None  # the noise the fresh start added, for a start afresh to replace
        if state is None:
            self._start_from_weights()
        step_scoped = [explored for explored in self._explored if explored.knob.step_scoped]
        self._step_scoped = StepScopedValues(
            adapter.optimizer, [(explored.knob.group_index, explored.knob.key) for explored in step_scoped],
            lambda index, scheduled: self._step_value(step_scoped[index], scheduled))
        try:
            self._apply_knobs()
            if state is not None:
                self.load_state_dict(state)
        except BaseException:
            self.close()  # a retry would otherwise find this attempt's hooks and scale the LR twice
            raise
        adapter.optimizer._hdet_attached = True
        if self.topology.rank == 0 and self.single_replica_warning:
            warn(self.single_replica_warning)
        if self.topology.rank == 0 and self.few_updates_warning:
            warn(self.few_updates_warning)
        late_start = late_start_warning(config, self.topology.num_replicas, total_steps,
                                        explores_others=self._explores_others)
        if self.topology.rank == 0 and late_start:
            warn(late_start)

    def _start_from_weights(self) -> None:
        """A fresh start from the weights the replicas hold now (alike on every rank): each replica's warm-init
        noise, and the range test's copy of them to come back to."""
        config, adapter = self.config, self.adapter
        self._last_sync_step = 0  # the start counts: replicas are identical there (unless noised)
        if config.warm_init.enabled:
            self._warm_noise = add_warm_noise(adapter, self.topology, nu=config.warm_init.nu, seed=config.seed,
                                              replacing=self._warm_noise)
            self._last_sync_step = None  # the replicas differ until the first sync
        if config.auto_lr.range_test:
            self._range_start = RangeTestStart.before(RangeTest(config.auto_lr.range_test), adapter)

    def weights_loaded(self, what: str = "loading weights after HDET attached") -> bool:
        """Takes weights loaded into every replica alike after HDET attached, without HDET's state (``what``: the
        load, for the error). Before the first step (of the range test or the run) the run starts afresh from them
        (collective with warm init): each replica's warm-init noise in place of the first one's (taken out of the
        parts the load left as they were), and the LR range test comes back to them, not to the weights HDET
        attached to. During the range test a RuntimeError: it would come back to the earlier weights. Later
        nothing: the next sync averages the replicas as they are. Returns whether the run started afresh."""
        self._check_open("weights_loaded")
        if self._range_start is not None and self._range_start.test.lrs:
            raise RuntimeError(f"{what} during the LR range test (auto_lr.range_test), which would put back the "
                               "weights it started from: load the weights to start from before the first step")
        if self._stepped:
            return False
        self._start_from_weights()
        return True

    @property
    def single_replica_warning(self) -> str | None:
        """What this run loses when it has one replica while HDET is set to explore; None otherwise."""
        return single_replica_warning(self.config, self.topology,
                                      explores=any(max(explored.multipliers) > 1 for explored in self._explored))

    @property
    def few_updates_warning(self) -> str | None:
        """What the controller cannot do when fewer syncs fall between its start and its stop than it needs to
        climb its whole range; else None."""
        return few_updates_warning(self.config, self.topology.num_replicas)

    def _explore(self, knob: Knob, paper_decay: PaperDecay | None = None) -> ExploredValue:
        if any(explored.name == knob.name for explored in self._explored):
            raise ValueError(f"'{knob.name}' is explored already")
        explored = ExploredValue.start(knob, seed=self.config.seed, num_replicas=self.topology.num_replicas,
                                       alpha=self.config.spread_alpha(lr=knob.is_lr) if knob.alpha is None
                                       else knob.alpha,
                                       spread=self.config.spread, paper_decay=paper_decay)
        top = max(explored.multipliers)
        past = knob.past_probability(top)
        if past is not None:
            raise HDETConfigError(
                f"explore.{knob.name}: the replica at the top of its spread (x{top:.3g}) would train with {past}, a "
                "probability of 1 or more (held just below 1: a dropout drops every unit, a label smoothing leaves "
                f"no label): lower explore.{knob.name}.alpha, or the value it multiplies")
        if explored.is_lr:  # one replica has no controller to climb from a low start
            explored.state = ControllerState(scale=self.config.auto_lr.initial_scale
                                             if self.topology.num_replicas > 1 else 1.0)
        self._explored.append(explored)
        return explored

    def add_knob(self, name: str, getter: Callable[[], float], setter: Callable[[float], None], *,
                 alpha: float | None = None, low: float = -math.inf, high: float = math.inf) -> None:
        """Explores a user-defined scalar: its base is ``getter()`` now, and ``setter(value)`` receives this
        replica's value at the start and after every sync. Call it on every rank before the first step; a run
        that continues a checkpoint adds the checkpoint's own knobs before or after loading its state.
        ``alpha``: its spread ratio, above 0 (below 1 on a linear spread); None: the top-level ``alpha``."""
        self._check_open("add_knob")
        saved = self._awaited_knobs.get(name)
        if self._step and saved is None:
            raise RuntimeError(f"add_knob('{name}') after {self._step} steps: add knobs before training starts")
        field = f"add_knob('{name}', alpha=...)" + (" (the top-level alpha)" if alpha is None else "")
        spread_alpha = self.config.spread_alpha(lr=False) if alpha is None else alpha
        check_spread_alpha(field, spread_alpha, self.config.spread, explored=True)
        check_scale_step(self.config.auto_lr.filled(), spread_alpha, self.config.spread, field)
        error = run_length_error(self.config, self.topology.num_replicas, "pass total_steps= when attaching",
                                 explores_others=True)
        if error is not None:
            raise error
        base = float(getter())
        if saved is None and not (math.isfinite(base) and base != 0.0):
            raise HDETConfigError(f"add_knob('{name}'): its getter gives {base}, and the replicas explore multiples "
                                  "of it (every multiple of 0 is 0): start it at a finite value other than 0")
        explored = self._explore(ValueKnob(name, base, Bounds(low=low, high=high), alpha, setter, from_model=True))
        if saved is not None:
            explored.load_state_dict(saved[0], same_layout=saved[1])
            del self._awaited_knobs[name]
        explored.knob.apply(explored.value(self.topology.replica_index))

    def explores(self, name: str) -> bool:
        """Whether the hyperparameter ``name`` is explored (e.g. ``"label_smoothing"``, ``"lr/0"``)."""
        return any(explored.name == name for explored in self._explored)

    def value(self, name: str) -> float:
        """This replica's current value of the explored hyperparameter ``name`` (e.g. ``"label_smoothing"``,
        ``"lr/0"``: for optimizer knobs, the value the next ``optimizer.step()`` uses, during the run's LR range
        test that test's LR)."""
        explored = self._explored_named(name)
        if self._closed:  # its hooks are gone: the optimizer steps with the schedule's values, the rest hold the base
            return explored.knob.scheduled() if explored.knob.step_scoped else explored.base()
        if self._probing and name == "label_smoothing":
            return 0.0
        if self._at_base and not explored.knob.step_scoped:  # apply_base_values, until the next sync
            return explored.base()
        ramp = self._range_test_lr(explored)
        return explored.value(self.topology.replica_index) if ramp is None else ramp

    def base(self, name: str) -> float:
        """The base every replica's value of ``name`` is a multiple of now: the schedule's value times the
        controller's scale (``paper`` mode: the base it owns); for optimizer knobs, that of the next step."""
        return self._explored_named(name).base()

    def _explored_named(self, name: str) -> ExploredValue:
        for explored in self._explored:
            if explored.name == name:
                return explored
        raise KeyError(f"'{name}' is not explored; explored: {[explored.name for explored in self._explored]}")

    def _step_value(self, explored: ExploredValue, scheduled: float) -> float:
        """This replica's value of a value set inside ``optimizer.step()`` (LR, weight decay) for the step about to
        run: the range test's LR while it runs, else base times multiplier."""
        ramp = self._range_test_lr(explored)
        if ramp is not None:
            return ramp
        return explored.applied_value(self.topology.replica_index, scheduled, self._steps_in_interval)

    def _range_test_lr(self, explored: ExploredValue) -> float | None:
        """The LR of the range test's next step for an explored LR while the test runs; None otherwise."""
        if self._range_start is None or not explored.is_lr:
            return None
        return self._range_start.lr(explored.knob.group_index, len(self._range_start.test.lrs))

    def _apply_knobs(self) -> None:
        """Gives this replica its values of the knobs that are not set inside ``optimizer.step()``."""
        self._at_base = False
        for explored in self._explored:
            if not explored.knob.step_scoped:
                explored.knob.apply(explored.value(self.topology.replica_index))

    # ------------------------------------------------------------------------------------ the loop
    @property
    def global_step(self) -> int:
        """Optimizer steps of the run taken so far (``step()`` calls; an LR range test's are not the run's)."""
        return self._step

    @property
    def last_report(self) -> SyncReport | None:
        """The most recent sync's report (also a line of ``metrics_path``); None before the first."""
        return self._last_report

    @property
    def ensemble(self) -> HDETEnsemble:
        """Itself: the ensemble is the HDET handle of a loop that attaches it to its optimizer directly (DDP's
        ``attach``), and answers every call of ``hdet_scale.handle.HDETHandle``."""
        return self

    @property
    def ramping(self) -> bool:
        """True while the run's LR range test runs (``auto_lr.range_test``). The test's steps are not steps of the
        run (``global_step`` stays 0): a loop should count them apart, hold its LR schedule meanwhile
        (``HDETScheduler`` and ``hdet_scale.lm.train`` do), and take no checkpoint; ``while hdet.global_step <
        total_steps`` runs them all."""
        return self._range_start is not None

    @property
    def _steps_in_interval(self) -> int:
        """The optimizer steps taken since the last sync (since the start before the first)."""
        return self._step - (self._last_sync_step or 0)

    @property
    def replicas_own_optimizer_state(self) -> bool:
        """True where the settings make the replicas' optimizer states differ at a sync point (``local`` gradient
        mode, the state not averaged, 2+ replicas): a checkpoint then needs each replica's, not one rank's.
        ``optimizer_states_differ`` also finds the states that differ in ``global`` mode."""
        return (self.config.gradient_mode == "local" and not self.config.average_optimizer_state
                and self.topology.num_replicas > 1)

    def optimizer_states_differ(self) -> bool:
        """Whether some replica's optimizer state differs from replica 0's now, so that a checkpoint taken now needs
        each replica's; where not, replica 0's alone serves every replica (collective in ``global`` gradient mode:
        every rank calls it). They differ where ``replicas_own_optimizer_state`` says so, and are alike with one
        replica or averaged at a sync point. In ``global`` mode every replica steps with the same gradients, so
        their states are alike unless the optimizer adds the weights into them (weight decay added to the
        gradient, as torch.optim.Adam and SGD do): there each rank fingerprints its state's bits and compares it with
        the other replicas' at its position."""
        if self.replicas_own_optimizer_state:
            return True
        if self.topology.num_replicas == 1 or self.config.average_optimizer_state:
            return False
        fingerprint = bits_fingerprint(self.adapter.optimizer_state_tensors())
        table = gather_rows([fingerprint >> 32, fingerprint & 0xFFFFFFFF], world_size=self.topology.world_size)
        return any(len({tuple(row) for row in table[self.topology.cross_replica_ranks(position)].tolist()}) > 1
                   for position in range(self.topology.ranks_per_replica))

    @property
    def wants_probe(self) -> bool:
        """True where a probe would drive a controller (it is on, with 2+ replicas) and none is set."""
        return self._scorer.probe is None and self._controller_moves_any and self.topology.num_replicas > 1

    @property
    def needs_probe(self) -> bool:
        """True where ``wants_probe`` and the controller moves a value it compares on a probe alone
        (``PROBE_ONLY_KNOBS``: dropout, label smoothing): without one, the controller refuses to move."""
        return self.wants_probe and any(explored.name in PROBE_ONLY_KNOBS for explored in self._explored)

    def probe_missing_error(self, fix: str) -> HDETConfigError:
        """The error where ``needs_probe``; ``fix`` says how to set a probe where the caller runs."""
        names = [explored.name for explored in self._explored if explored.name in PROBE_ONLY_KNOBS]
        return HDETConfigError(f"explore.{names[0]} needs a probe batch: a replica's training loss rises with its own "
                               f"{names[0].replace('_', ' ')} whatever it is worth, so the controller compares the "
                               f"replicas on one held-out batch, scored with neither; {fix}")

    @property
    def _controller_moves_any(self) -> bool:
        """Whether the controller is on for some explored value: the LR (without a range test) or another."""
        return self.config.auto_lr.moves_any(any(not explored.is_lr for explored in self._explored))

    @property
    def at_sync_point(self) -> bool:
        """True right after a sync (or at the start, unless warm init has made the replicas differ), where every
        replica holds the same parameters: the only place a checkpoint of one model is the whole truth."""
        return self._last_sync_step == self._step

    def apart_error(self, what: str) -> str | None:
        """Why ``what`` (a checkpoint, an export: of one model) cannot be taken now and what to do, None where it
        can (``at_sync_point``)."""
        if self.at_sync_point:
            return None
        if self._step == 0:
            return (f"{what} is taken where the replicas are one model, and before the first step warm init keeps "
                    f"their starts apart: take it after the first sync (every {self.config.sync_interval} steps)")
        return (f"{what} is taken at sync points, where the replicas are one model; step {self._step} is between "
                f"syncs (every {self.config.sync_interval} steps): take it right after one, or sync first "
                "(hdet.sync(); engine.hdet.sync() under DeepSpeed)")

    def check_one_model(self, what: str) -> None:
        """Refuses ``what`` (an export of the model) between syncs, where each replica holds a model of its own and
        rank 0's would stand for the ensemble's, silently; with one replica there is one model anyway."""
        error = self.apart_error(what)
        if self.topology.num_replicas > 1 and error is not None:
            raise RuntimeError(error)

    def observe(self, loss: LossLike) -> None:
        """Records one micro-batch loss; the step's loss is the mean of the micro-batches observed."""
        self._check_open("observe")
        self._scorer.interval.observe(loss)

    def step(self, loss: LossLike | Sequence[LossLike] | None = None) -> SyncReport | None:
        """Call once per optimizer step, after ``optimizer.step()``.

        ``loss`` is this step's loss (a float or scalar tensor; a sequence is taken as its micro-batch
        losses), or None when the losses were passed to ``observe`` or are not available. Tensors stay on
        their device until the next sync, so this adds no host-device synchronization. Returns the sync
        report on sync steps, else None. While the run's LR range test runs it takes one step of it.
        """
        self._check_open("step")
        if self._awaited_knobs:
            raise RuntimeError(f"the loaded HDET state explores {sorted(self._awaited_knobs)} with add_knob: call "
                               "add_knob for each on every rank before the first step")
        if not self._settings_said and self.topology.rank == 0:  # the first step: every add_knob is in
            self._settings_said = True
            lr_spread = any(len(set(explored.multipliers)) > 1 for explored in self._lr_explored())
            for line in unread_settings_warnings(self.config, self.topology.num_replicas, lr_spread=lr_spread,
                                                 explores_others=self._explores_others):
                warn(line)
        self._stepped = True
        if self._range_start is not None:
            self._range_test_step(loss)
            return None
        steps_to_sync = -(self._step + 1) % self.config.sync_interval
        self._scorer.add_step(loss, steps_to_sync, self.adapter.averaged_tensors)  # first: it may refuse the loss
        self.record_step_bases()
        self._step += 1
        if self._step % self.config.sync_interval == 0:
            return self.sync()
        return None

    def record_step_bases(self) -> None:
        """Records, for the optimizer step about to run or just skipped (an AMP overflow), the base of each explored
        value as of now, where that step has not recorded its own: values set at syncs hold theirs for the whole
        step, and a value set inside ``optimizer.step()`` records its base there, which a step that runs still does
        after this. ``step()`` calls it; call it earlier where a schedule advances between a skipped step and
        ``step()`` (``HDETScheduler``, ``HDETOneCycleLR`` and the Lightning callback do; a loop of your own with an
        AMP scaler calls it before ``scheduler.step()``), else the skipped step is recorded at the next step's base.
        Nothing during the LR range test, whose steps are none of the run's."""
        self._check_open("record_step_bases")
        if self._range_start is not None:
            return
        steps_in_interval = self._steps_in_interval + 1
        for explored in self._explored:
            if len(explored.applied_bases) < steps_in_interval:
                explored.applied_bases.append(explored.base())

    @property
    def _explores_others(self) -> bool:
        return any(not explored.is_lr for explored in self._explored)

    def _range_test_step(self, loss: LossLike | Sequence[LossLike] | None) -> None:
        """One step of the run's range test; at its end every replica back to its first weights and the LR's
        scale from the pick: the replicas' mean LR at ``MEAN_LR_OVER_PICK`` times it."""
        if not self._range_start.add_step(self._scorer.interval, loss, self.topology.world_size):
            return
        start, self._range_start = self._range_start, None
        start.restore(self.adapter)
        self.range_test_pick = pick = start.test.pick()
        self._range_test_picked = pick is not None
        if pick is None:
            warn("the LR range test saw too few finite losses to pick an LR; the run goes on at the LR it was given")
        scale = 1.0
        for explored in self._lr_explored():
            if pick is not None:
                scale = MEAN_LR_OVER_PICK * pick / (start.peaks[0] * explored.mean_multiplier())
            explored.state = ControllerState(scale=scale)
        self._metrics.write({"step": self._step, "range_test": {"lrs": start.test.lrs, "smoothed": start.test.smoothed,
                                                                "picked_lr": pick, "scale": scale}})

    def add_pre_sync_hook(self, hook: Callable[[int], None]) -> None:
        """Calls ``hook(step)`` at the start of every sync, while the replicas still differ (e.g. to score
        each replica or to inspect its weights before they are averaged)."""
        self._pre_sync_hooks.append(hook)

    def set_probe(self, probe: Callable[[], LossLike] | None) -> None:
        """Scores every replica at each sync, before averaging: ``probe()`` returns this rank's loss on a
        held-out batch that is the same on every replica (see ``hdet_scale.probe.batch_probe``), and the
        controller is driven by those losses (blended with the interval losses by ``auto_lr.probe_weight``).
        Called on every rank, inside ``torch.no_grad()``, before the first step (the window of averaged weights,
        ``auto_lr.average_window``, follows it); None removes the probe."""
        self._scorer.set_probe(None if probe is None else self._unsmoothed(probe))

    def _unsmoothed(self, probe: Callable[[], LossLike]) -> Callable[[], LossLike]:
        """``probe`` with ``value("label_smoothing")`` at 0 while it runs: a loss that reads it scores the replicas
        on the plain loss, which the smoothing they trained with does not raise."""
        def unsmoothed() -> LossLike:
            self._probing = True
            try:
                return probe()
            finally:
                self._probing = False

        return unsmoothed

    # ------------------------------------------------------------------------------------ a sync
    def sync(self) -> SyncReport | None:
        """Averages the replicas, updates the controller and re-assigns the multipliers (collective); returns its
        report, or None where the replicas are one model already (``at_sync_point``: no step since the last sync)
        or where the run has taken no step yet (the replicas keep their starts, which warm init makes differ on
        purpose), where it does nothing and writes no metrics line.

        ``step`` calls it every ``sync_interval`` steps; call it directly to end on one model between those
        (e.g. before a final export or a preemption checkpoint). Such an extra sync averages, scores and
        re-assigns, and the interval starts over, but the controller moves at the regular syncs only (the
        multiples of ``sync_interval``), so a run's controller makes the same number of updates however often it
        is checkpointed; the next regular sync stays at the next multiple of ``sync_interval``, and its update
        takes the Delta of every part of the interval, each weighed by its steps.
        """
        self._check_open("sync")
        if self._range_start is not None:
            raise RuntimeError(f"the LR range test is running (step {len(self._range_start.test.lrs)} of "
                               f"{self._range_start.test.steps}): syncs start after it")
        if self.at_sync_point or self._step == 0:  # no step yet: the replicas at their starts (warm init's apart)
            return None
        # Out of inference mode (Lightning's validation hooks run under it on an accelerator): memory the sync
        # keeps for the next one must be normal tensors, which that sync writes into outside it.
        with torch.inference_mode(False), torch.no_grad():
            return self._sync()

    def _sync(self) -> SyncReport:
        for hook in self._pre_sync_hooks:
            hook(self._step)
        started = time.perf_counter()
        bucket_bytes = int(self.config.bucket_mb * 2**20)
        tensors = self._sync_tensors()
        averages_state = self.config.average_optimizer_state
        state = [] if averages_state else self.adapter.optimizer_state_tensors()
        row = self._scorer.row(tensors, state, self.adapter,
                               state_layout=self.adapter.optimizer_state_layout() if averages_state else 0)
        scores, sent = average_healthy(tensors, row, self.topology,
                                       self.adapter, step=self._step, with_probe=self._scorer.probe is not None,
                                       bucket_bytes=bucket_bytes, memory=self._buckets,
                                       with_optimizer_state=self.config.average_optimizer_state)
        trained_with = {explored.name: explored.trained_values() for explored in self._explored}
        applied = {explored.name: (explored.applied_bases, explored.replica_multipliers())
                   for explored in self._explored}
        weights = self._update_values(scores)  # paper mode takes over from the interval's last base
        for explored in self._explored:
            explored.applied_bases = []
        self._reassign()
        self._scorer.reset()
        # for the next interval, whose window of weights starts now; a buffer turned finite on every rank is
        # averaged at once, not left as each replica has it until the next sync (a checkpoint now would take replica
        # 0's)
        turned = self.adapter.refresh_averaged_buffers()  # the same on every rank
        if turned:
            average_tensors(turned, self.topology.cross_replica_group, bucket_bytes=bucket_bytes)
        self._last_sync_step = self._step
        report = SyncReport(step=self._step, replica_losses=scores.losses, probe_losses=scores.probe_losses,
                            excluded_replicas=scores.excluded, weights=weights, controller_updated=weights is not None,
                            values={explored.name: explored.report(trained_with[explored.name],
                                                                   *applied[explored.name])
                                    for explored in self._explored},
                            sync_seconds=time.perf_counter() - started, bytes_averaged=sent,
                            bytes_gathered=scores.bytes_gathered)
        if self._metrics.path is not None:  # the record is a deep copy: only when there is a file to write
            self._metrics.write(report.as_record())
        self._last_report = report
        return report

    def _sync_tensors(self) -> list[torch.Tensor]:
        """This rank's tensors to average: its master shard, and its optimizer state when configured."""
        tensors = self.adapter.averaged_tensors()
        if self.config.average_optimizer_state:
            tensors += self.adapter.optimizer_state_tensors()
        return tensors

    def _controller_moves_at(self, step: int) -> bool:
        """Whether a sync at ``step`` updates the controller: a regular sync (a multiple of ``sync_interval``), the
        controller on for some value (the LR without a range test, or another), 2+ replicas, past its start and not
        past its stop (the same on every rank)."""
        cfg = self.config.auto_lr
        return (step % self.config.sync_interval == 0 and self.topology.num_replicas > 1
                and self._controller_moves_any and step >= cfg.start and (cfg.stop is None or step <= cfg.stop))

    def _update_values(self, scores: ReplicaScores) -> list[float] | None:
        """Moves every explored value's controller by eq. 4's weights; returns the weights, or None when the
        controller does not update at this sync (an extra sync, off, warming up, one replica, or a replica without
        loss). An extra sync's weights are kept for the next regular update (``ExploredValue.keep_part``), and
        dropped where that one does not update."""
        cfg, interval = self.config.auto_lr, self.config.sync_interval
        regular = self._step % interval == 0
        if not regular and self.needs_probe:
            return None  # the regular sync says what is missing
        moves = self._controller_moves_at(-(-self._step // interval) * interval)  # at this or the next regular sync
        weights = self._scored_weights(scores, warn_unscored=regular) if moves else None
        for explored in self._explored:
            if weights is None or (explored.is_lr and not cfg.moves_lr):  # the range test picked it: it holds
                continue
            controller = self._controllers["lr" if explored.is_lr else "other"]
            if regular:
                explored.update(controller, weights=weights, steps=self._steps_in_interval, step=self._step,
                                sync_interval=interval)
            else:
                explored.keep_part(controller, weights=weights, steps=self._steps_in_interval)
        if regular:
            for explored in self._explored:
                explored.forget_parts()
        return weights if regular else None

    def _scored_weights(self, scores: ReplicaScores, *, warn_unscored: bool) -> list[float] | None:
        """Eq. 4's weights of this sync's replica scores; None where some replica has none to compare."""
        if self.needs_probe:
            raise self.probe_missing_error("set one with hdet.set_probe before the first step")
        # a replica left out of the average scores worst, whatever its loss: its weights are what failed
        signal = [loss if healthy else math.nan for loss, healthy in
                  zip(scores.controller_signal(self.config.auto_lr.probe_weight), scores.healthy, strict=True)]
        if not any(loss is not None and math.isfinite(loss) for loss in signal):
            return None  # no replica scored: nothing to compare (a non-finite score alone is the worst one)
        if any(loss is None for loss in signal):
            if warn_unscored and not self._warned_no_loss:
                warn("HDET: step() got no loss on some replica during a sync interval; the auto-LR "
                     "controller skips updates until every replica reports losses")
                self._warned_no_loss = True
            return None
        return self._controllers["lr"].weights(signal)

    def _reassign(self) -> None:
        """Draws every explored value's next permutation and applies this replica's new values."""
        for explored in self._explored:
            explored.redraw()
        self._apply_knobs()

    # ------------------------------------------------------------------------------------ reporting
    def _lr_explored(self) -> list[ExploredValue]:
        return [explored for explored in self._explored if explored.is_lr]

    def lr_multiplier(self, group_index: int = 0) -> float:
        """This replica's multiplier rho_{pi(r)} on param group ``group_index`` for the current interval."""
        return self._lr_explored()[group_index].multiplier(self.topology.replica_index)

    def found_lr_factor(self) -> float | None:
        """The factor HDET found on the schedule's LR (first param group), by the range test or the controller: the
        LR it found over the one given. None where neither sets it (the controller off or with one replica, or
        ``paper`` mode, which owns the LR, or a range test that picked nothing) or while the range test runs."""
        cfg = self.config.auto_lr
        if self.ramping:
            return None
        if cfg.range_test:  # the test's pick holds, whatever the replicas and the controller
            return self._lr_explored()[0].state.scale if self._range_test_picked else None
        if not cfg.moves_lr or cfg.mode == "paper" or self.topology.num_replicas < 2:
            return None
        return self._lr_explored()[0].state.scale

    def current_lrs(self) -> list[float]:
        """The LR each param group trains with on this replica at the next optimizer step (during the run's LR
        range test, the test's)."""
        return [self.value(explored.name) for explored in self._lr_explored()]

    # ------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Controller, generator and interval state. No rank id: a rank's multipliers are re-derived from
        the topology, so the state loads on any world size. Between syncs it also holds this rank's interval
        loss accumulator (identical replicas make the state rank-independent at sync points), but not the
        probe's window of averaged weights (``auto_lr.average_window``, a copy of the weights): the first sync
        after a resume between syncs scores the weights averaged since the resume. Not while the run's LR range
        test runs: a resumed run could not take it up again."""
        if self._range_start is not None:
            raise RuntimeError("HDET's state was asked for during the LR range test (auto_lr.range_test), which a "
                               "resumed run could not take up again: checkpoint once `ramping` is False")
        return {
            "step": self._step,
            "last_sync_step": self._last_sync_step,
            "num_replicas": self.topology.num_replicas,
            "loss_sum": self._scorer.interval.total(),
            "loss_count": self._scorer.interval.count,
            "range_test_picked": self._range_test_picked,
            "explored": {explored.name: explored.state_dict() for explored in self._explored},
        }

    def check_state(self, state: Mapping[str, Any]) -> list[str]:
        """A ValueError unless ``load_state_dict`` can continue ``state`` in this run (it explores the same values);
        an engine asks before it loads a checkpoint's model. Returns the names of the saved ``add_knob`` values this
        run has not added yet, which wait for their ``add_knob`` call."""
        saved = state["explored"]
        names = [explored.name for explored in self._explored]
        awaited = [name for name in saved if name not in names and not is_configured_name(name)]
        # earlier versions explored the weight decay of a group without one too (every multiple of 0 is 0)
        optimizer = self.adapter.optimizer
        undecayed = {f"weight_decay/{name}" for index, name in enumerate(group_names(optimizer))
                     if optimizer.param_groups[index].get("weight_decay", 0.0) == 0}
        if sorted(set(saved) - set(awaited) - undecayed) != sorted(names):
            raise ValueError(f"HDET state explores {sorted(saved)} but this run explores {sorted(names)}; "
                             "the optimizer's param groups and HDET's explore settings must match the checkpoint's")
        return awaited

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores ``state_dict()``; with a different replica count the permutations are drawn afresh. A state
        saved by an earlier version loads too: keys it holds for settings since removed (``start_probe_loss``, the
        controller's ``updates``, ``log_scale_sum`` and ``scales_averaged``) are ignored."""
        self._check_open("load_state_dict")
        awaited = self.check_state(state)
        saved = state["explored"]
        self._range_start = None  # a saved run is past its range test (none is saved during one)
        self._stepped = True
        same_layout = state["num_replicas"] == self.topology.num_replicas
        self._awaited_knobs = {name: (saved[name], same_layout) for name in awaited}
        for explored in self._explored:
            # Its applied_bases become the saved ones (the steps since the saved state's last sync): loading an
            # optimizer's state may run a step at LR 0 to create it (torch.distributed.checkpoint does), and
            # that is no step of the run.
            explored.load_state_dict(saved[explored.name], same_layout=same_layout)
        self._apply_knobs()
        self._step = int(state["step"])
        # States saved before this field existed were taken at regular sync points.
        last_sync = state.get("last_sync_step", self._step - self._step % self.config.sync_interval)
        self._last_sync_step = None if last_sync is None else int(last_sync)
        self._scorer.reset()
        self._scorer.interval.restore(state["loss_sum"], state["loss_count"])
        self._range_test_picked = bool(state.get("range_test_picked", True))  # earlier versions: it picked
        if self.config.auto_lr.range_test and self._range_test_picked:
            # The LR the test picked holds at the replicas' mean: it stays there on another replica count or spread,
            # whose mean multiplier differs (on a log spread)
            for explored in self._lr_explored():
                saved_mean = saved[explored.name].get("mean_multiplier")  # none in a state of an earlier version
                if saved_mean is not None:
                    explored.state.scale *= saved_mean / explored.mean_multiplier()

    def _check_open(self, what: str) -> None:
        if self._closed:  # each would put the replicas' own values back into the model, or step them
            raise RuntimeError(f"{what}() after close(): HDET no longer runs on this optimizer; attach a new "
                               "ensemble to train with it again")

    def fold_found_attention_scale(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Where ``attention_scale`` is explored: multiplies the scale the controller found (``base``) into ``state``,
        ``model``'s full state dict for an export, whose config rebuilds every attention module's own softmax scale,
        so that the exported model computes what the averaged one trained at (``knobs.fold_attention_scale``);
        warns for modules it cannot fold into. Call where ``state`` is complete (rank 0's)."""
        if not self.explores("attention_scale"):
            return
        explored = self._explored_named("attention_scale")
        unfolded = fold_attention_scale(model, state, explored.knob.own_factors(explored.base()))
        if unfolded:
            warn(f"the exported model's config rebuilds the softmax scale of {', '.join(unfolded)} as it was, and "
                 f"the run found {explored.base():g} times it (explore.attention_scale): their weights cannot carry "
                 "the factor (no query projection of their own, or a query norm whose output does not scale with its "
                 "weights); multiply their `scaling` by it after loading")

    def apply_base_values(self) -> None:
        """Gives every replica the base value of each knob set outside the optimizer step (``base``: what the
        controller found, e.g. the attention scale the weights trained at) until the next sync gives each its own
        again: for an evaluation or an export at the end of training, where each rank would otherwise score with its
        replica's value. ``value`` says the base meanwhile (a loss that reads ``value("label_smoothing")``)."""
        for explored in self._explored:
            if not explored.knob.step_scoped:
                explored.knob.apply(explored.base())
        self._at_base = True

    @contextlib.contextmanager
    def one_model_values(self) -> Iterator[None]:
        """Inside the block every replica holds the base value of each knob set outside the optimizer step
        (``apply_base_values``) and ``value("label_smoothing")`` reads 0 (until ``close()``); after it, each replica
        its own values again (unless they were at the base before). For an evaluation of the one model a sync point
        holds: scored at the values an export carries, on the plain loss, not at each rank's replica's."""
        was_at_base, self._probing = self._at_base, True
        self.apply_base_values()
        try:
            yield
        finally:
            self._probing = False
            if not was_at_base and not self._closed:
                self._apply_knobs()

    def close(self) -> None:
        """Removes the optimizer hooks and gives every replica the base value of each knob set outside the optimizer
        step (``apply_base_values``); the optimizer then trains at the scheduled values."""
        self._step_scoped.remove()
        self._closed = True
        self.apply_base_values()
        self._buckets.clear()
        self.adapter.optimizer._hdet_attached = False

