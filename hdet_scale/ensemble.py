"""The HDET orchestrator: fan-out between syncs, converge and re-assign at every sync.

Engine-agnostic: an ``EngineAdapter`` says which tensors to average and which optimizer holds the LRs.
The training loop calls ``step(loss)`` once per optimizer step, after ``optimizer.step()``; every
``sync_interval`` steps that call averages the replicas, updates the controller and re-assigns the
multipliers. Between syncs it does no communication.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hdet_scale.comm import average_tensors, gather_rows
from hdet_scale.config import HDETConfig
from hdet_scale.controller import Controller, ControllerState, PaperDecay, softmax_weights
from hdet_scale.engines.base import EngineAdapter
from hdet_scale.knobs import Bounds, Knob, OptimizerGroupKnob, ValueKnob, configured_knobs, lr_knobs
from hdet_scale.lr_hooks import StepScopedValues
from hdet_scale.metrics import MetricsWriter
from hdet_scale.spread import PermutationStream, multipliers
from hdet_scale.topology import ReplicaTopology
from hdet_scale.warm_init import add_warm_noise

logger = logging.getLogger(__name__)

LossLike = float | torch.Tensor


@dataclass
class ExploredValue:
    """One explored hyperparameter with its own spread, permutation and controller (eq. 9)."""

    knob: Knob
    stream: PermutationStream
    multipliers: list[float]
    paper_decay: PaperDecay | None = None
    permutation: list[int] = field(default_factory=list)
    state: ControllerState = field(default_factory=ControllerState)

    @property
    def name(self) -> str:
        return self.knob.name

    @property
    def is_lr(self) -> bool:
        return isinstance(self.knob, OptimizerGroupKnob) and self.knob.key == "lr"


@dataclass
class SyncReport:
    """What one sync did; also the metrics line (``as_record``)."""

    step: int
    replica_losses: list[float | None]
    probe_losses: list[float] | None
    excluded_replicas: list[int]
    weights: list[float] | None
    controller_updated: bool
    values: dict[str, dict[str, Any]]
    sync_seconds: float
    bytes_averaged: int
    bytes_gathered: int

    def as_record(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "replica_losses": self.replica_losses,
            "probe_losses": self.probe_losses,
            "excluded_replicas": self.excluded_replicas,
            "weights": self.weights,
            "controller_updated": self.controller_updated,
            "values": self.values,
            "sync_seconds": self.sync_seconds,
            "bytes_averaged": self.bytes_averaged,
            "bytes_gathered": self.bytes_gathered,
        }


class HDETEnsemble:
    """Hyperparameter-Divergent Ensemble Training over any engine.

    Build it after the engine has wrapped (and broadcast) the model: with ``warm_init.enabled`` it adds each
    replica's eq. 10 noise to the weights at construction.

    Args:
        config: HDET settings (validated here).
        adapter: the engine adapter (see ``hdet_scale.engines``).
        topology: the replica layout; built from the default process group when omitted.
        paper_decay: per param group, the schedule's floor and length, for ``auto_lr.mode='paper'``.
    """

    def __init__(self, config: HDETConfig, adapter: EngineAdapter, *, topology: ReplicaTopology | None = None,
                 paper_decay: Sequence[PaperDecay] | None = None) -> None:
        config.validate()
        config = config.resolved()
        self.config = config
        self.adapter = adapter
        self.topology = topology or ReplicaTopology.build(config)
        if self.topology.ranks_per_replica != config.ranks_per_replica:
            raise ValueError(
                f"the topology has {self.topology.ranks_per_replica} ranks per replica but the config says "
                f"ranks_per_replica={config.ranks_per_replica}; build both from the same config"
            )
        if getattr(adapter.optimizer, "_hdet_attached", False):
            raise ValueError("this optimizer already has HDET attached; call close() on the other ensemble first")
        groups = adapter.optimizer.param_groups
        if config.auto_lr.enabled and config.auto_lr.mode == "paper" and paper_decay is None:
            raise ValueError(
                "auto_lr.mode='paper' needs the base schedule's floor and length: use HDETOneCycleLR, pass "
                "paper_decay=[PaperDecay(total_steps, floor), ...] (one per param group), or use mode 'scale'"
            )
        if paper_decay is not None and len(paper_decay) != len(groups):
            raise ValueError(f"paper_decay has {len(paper_decay)} entries for {len(groups)} param groups")
        # Only the LR follows the paper's controller mode; every other knob moves a scale on its base value.
        self._controllers = {"lr": Controller(config.auto_lr),
                             "other": Controller(dataclasses.replace(config.auto_lr, mode="scale"))}
        self._explored: list[ExploredValue] = []
        for index, knob in enumerate(lr_knobs(adapter.optimizer)):
            self._explore(knob, paper_decay[index] if paper_decay is not None else None)
        for knob in configured_knobs(config.explore, adapter.optimizer, adapter.module):
            self._explore(knob)
        self._metrics = MetricsWriter(config.metrics_path, is_writer=self.topology.rank == 0)
        self._step = 0
        self._last_sync_step = 0  # the start counts: replicas are identical there
        # Float64 accumulators on the loss's device, updated in place: no host sync, one kernel per loss.
        self._loss_sum = torch.zeros((), dtype=torch.float64)
        self._loss_count = 0
        self._micro_sum = torch.zeros((), dtype=torch.float64)
        self._micro_count = 0
        self._warned_no_loss = False
        self._pre_sync_hooks: list[Callable[[int], None]] = []
        self._probe: Callable[[], LossLike] | None = None
        if config.warm_init.enabled:
            add_warm_noise(adapter, self.topology, nu=config.warm_init.nu, seed=config.seed)
        step_scoped = [explored for explored in self._explored if explored.knob.step_scoped]
        self._step_scoped = StepScopedValues(
            adapter.optimizer, [(explored.knob.group_index, explored.knob.key) for explored in step_scoped],
            lambda index, scheduled: self._value(step_scoped[index], scheduled))
        self._apply_knobs()
        adapter.optimizer._hdet_attached = True

    def _explore(self, knob: Knob, paper_decay: PaperDecay | None = None) -> ExploredValue:
        if any(explored.name == knob.name for explored in self._explored):
            raise ValueError(f"'{knob.name}' is explored already")
        alpha = self.config.alpha if knob.alpha is None else knob.alpha
        explored = ExploredValue(knob=knob, stream=PermutationStream(knob.name, self.config.seed),
                                 multipliers=multipliers(self.topology.num_replicas, alpha), paper_decay=paper_decay)
        explored.permutation = explored.stream.draw(self.topology.num_replicas)
        self._explored.append(explored)
        return explored

    def add_knob(self, name: str, getter: Callable[[], float], setter: Callable[[float], None], *,
                 alpha: float | None = None, low: float = -math.inf, high: float = math.inf) -> None:
        """Explores a user-defined scalar: its base is ``getter()`` now, and ``setter(value)`` receives this
        replica's value at the start and after every sync. Call it on every rank before the first step."""
        if self._step:
            raise RuntimeError(f"add_knob('{name}') after {self._step} steps: add knobs before training starts")
        explored = self._explore(ValueKnob(name, float(getter()), Bounds(low=low, high=high), alpha, setter))
        explored.knob.apply(self._value(explored, explored.knob.scheduled()))

    def value(self, name: str) -> float:
        """This replica's current value of the explored hyperparameter ``name`` (e.g. ``"label_smoothing"``,
        ``"lr/0"``: for optimizer knobs, the value the next ``optimizer.step()`` uses)."""
        for explored in self._explored:
            if explored.name == name:
                return self._value(explored, explored.knob.scheduled())
        raise KeyError(f"'{name}' is not explored; explored: {[explored.name for explored in self._explored]}")

    def _apply_knobs(self) -> None:
        """Gives this replica its values of the knobs that are not set inside ``optimizer.step()``."""
        for explored in self._explored:
            if not explored.knob.step_scoped:
                explored.knob.apply(self._value(explored, explored.knob.scheduled()))

    # ------------------------------------------------------------------------------------ the loop
    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far (``step()`` calls)."""
        return self._step

    @property
    def at_sync_point(self) -> bool:
        """True right after a sync (or at the start), where every replica holds the same parameters: the
        only place a checkpoint of one model is the whole truth."""
        return self._last_sync_step == self._step

    def observe(self, loss: LossLike) -> None:
        """Records one micro-batch loss; the step's loss is the mean of the micro-batches observed."""
        self._micro_sum = _accumulate(self._micro_sum, loss)
        self._micro_count += 1

    def step(self, loss: LossLike | Sequence[LossLike] | None = None) -> SyncReport | None:
        """Call once per optimizer step, after ``optimizer.step()``.

        ``loss`` is this step's loss (a float or scalar tensor; a sequence is taken as its micro-batch
        losses), or None when the losses were passed to ``observe`` or are not available. Tensors stay on
        their device until the next sync, so this adds no host-device synchronization. Returns the sync
        report on sync steps, else None.
        """
        if loss is not None and not isinstance(loss, (list, tuple)) and not self._micro_count:
            self._loss_sum = _accumulate(self._loss_sum, loss)  # the common case: one loss per step
            self._loss_count += 1
        else:
            for item in [] if loss is None else loss if isinstance(loss, (list, tuple)) else [loss]:
                self.observe(item)
            if self._micro_count:
                self._loss_sum = _accumulate(self._loss_sum, self._micro_sum, scale=1.0 / self._micro_count)
                self._loss_count += 1
                self._micro_sum.zero_()
                self._micro_count = 0
        self._step += 1
        if self._step % self.config.sync_interval == 0:
            return self.sync()
        return None

    def add_pre_sync_hook(self, hook: Callable[[int], None]) -> None:
        """Calls ``hook(step)`` at the start of every sync, while the replicas still differ (e.g. to score
        each replica or to inspect its weights before they are averaged)."""
        self._pre_sync_hooks.append(hook)

    def set_probe(self, probe: Callable[[], LossLike] | None) -> None:
        """Scores every replica at each sync, before averaging: ``probe()`` returns this rank's loss on a
        held-out batch that is the same on every replica (see ``hdet_scale.probe.batch_probe``), and the
        controller is driven by those losses (blended with the interval losses by ``auto_lr.probe_weight``).
        Called on every rank, inside ``torch.no_grad()``; None removes the probe."""
        self._probe = probe

    def sync(self) -> SyncReport:
        """Averages the replicas, updates the controller and re-assigns the multipliers (collective).

        ``step`` calls it every ``sync_interval`` steps; call it directly to end on one model between those
        (e.g. before a final export or a preemption checkpoint). The next regular sync stays at the next
        multiple of ``sync_interval``.
        """
        for hook in self._pre_sync_hooks:
            hook(self._step)
        started = time.perf_counter()
        topo, cfg = self.topology, self.config
        probe_loss = self._run_probe()
        tensors = self.adapter.averaged_tensors()
        if cfg.average_optimizer_state:
            tensors += self.adapter.optimizer_state_tensors()
        loss_sum = float(self._loss_sum)
        params_finite = _all_finite(tensors)
        table = gather_rows([loss_sum, float(self._loss_count), float(params_finite), probe_loss],
                            world_size=topo.world_size)
        gathered_bytes = table.numel() * table.element_size()
        replica_losses, finite = _per_replica(table, topo)
        probe_losses = _per_replica_probe(table, topo) if self._probe is not None else None
        contributors = [r for r in range(topo.num_replicas) if finite[r]]
        if not contributors:
            raise FloatingPointError(
                f"HDET sync at step {self._step}: every replica has non-finite loss or parameters "
                f"(replica losses {replica_losses}); nothing was averaged. Lower the LR or alpha, or resume "
                "from the last checkpoint"
            )
        sent = average_tensors(tensors, topo.cross_replica_group, contribute=finite[topo.replica_index],
                               num_contributors=len(contributors), bucket_bytes=int(cfg.bucket_mb * 2**20))
        self.adapter.after_average()
        excluded = [r for r in range(topo.num_replicas) if not finite[r]]
        if not finite[topo.replica_index]:
            self.adapter.recover_excluded()
        if excluded:
            logger.warning("HDET step %d: replicas %s had non-finite values and were left out of the average",
                           self._step, excluded)

        trained_with = {explored.name: self._replica_values(explored) for explored in self._explored}
        weights, updated = self._update_controller(self._controller_signal(replica_losses, probe_losses))
        for explored in self._explored:
            explored.permutation = explored.stream.draw(topo.num_replicas)
        self._apply_knobs()
        values = self._value_report(trained_with)
        self._loss_sum.zero_()
        self._loss_count = 0
        self._last_sync_step = self._step

        report = SyncReport(step=self._step, replica_losses=replica_losses, probe_losses=probe_losses,
                            excluded_replicas=excluded,
                            weights=weights, controller_updated=updated, values=values,
                            sync_seconds=time.perf_counter() - started, bytes_averaged=sent,
                            bytes_gathered=gathered_bytes)
        self._metrics.write(report.as_record())
        return report

    def _run_probe(self) -> float:
        if self._probe is None:
            return math.nan
        with torch.no_grad():
            loss = self._probe()
        return float(loss.detach().reshape(()) if isinstance(loss, torch.Tensor) else loss)

    # ------------------------------------------------------------------------------- the controller
    def _controller_signal(self, replica_losses: list[float | None],
                           probe_losses: list[float] | None) -> list[float | None]:
        """The losses the controller compares: the interval losses, the probe losses, or their blend."""
        weight = self.config.auto_lr.probe_weight
        if probe_losses is None or weight == 0.0:
            return replica_losses
        if weight == 1.0:
            return list(probe_losses)
        return [None if train is None else weight * probe + (1.0 - weight) * train
                for train, probe in zip(replica_losses, probe_losses, strict=True)]

    def _update_controller(self, replica_losses: list[float | None]) -> tuple[list[float] | None, bool]:
        cfg = self.config.auto_lr
        if not cfg.enabled or self._step < cfg.warmup_steps or self.topology.num_replicas == 1:
            return None, False
        if any(loss is None for loss in replica_losses):
            if not self._warned_no_loss:
                warnings.warn("HDET: step() got no loss on some replica during a sync interval; the auto-LR "
                              "controller skips updates until every replica reports losses", stacklevel=3)
                self._warned_no_loss = True
            return None, False
        weights = softmax_weights(replica_losses, cfg.sigma)
        for explored in self._explored:
            controller = self._controllers["lr" if explored.is_lr else "other"]
            explored.state = controller.update(
                explored.state, weights=weights, replica_multipliers=self._replica_multipliers(explored),
                scheduled_value=explored.knob.scheduled(), step=self._step,
                sync_interval=self.config.sync_interval, paper_decay=explored.paper_decay,
            )
        return weights, True

    def _replica_multipliers(self, explored: ExploredValue) -> list[float]:
        return [explored.multipliers[slot] for slot in explored.permutation]

    def _base_value(self, explored: ExploredValue, scheduled: float) -> float:
        """The controller's base: scheduled * scale (``paper`` mode: its own), kept inside the knob's bounds."""
        state = explored.state
        base = state.owned_base if state.owned_base is not None else scheduled * state.scale
        return explored.knob.bounds.clamp(base)

    def _value(self, explored: ExploredValue, scheduled: float) -> float:
        """This replica's value: base times its multiplier rho_{pi(r)}, kept inside the knob's bounds."""
        rho = explored.multipliers[explored.permutation[self.topology.replica_index]]
        return explored.knob.bounds.clamp(self._base_value(explored, scheduled) * rho)

    # --------------------------------------------------------------------------------- reporting
    def _lr_explored(self) -> list[ExploredValue]:
        return [explored for explored in self._explored if explored.is_lr]

    def lr_multiplier(self, group_index: int = 0) -> float:
        """This replica's multiplier rho_{pi(r)} on param group ``group_index`` for the current interval."""
        explored = self._lr_explored()[group_index]
        return explored.multipliers[explored.permutation[self.topology.replica_index]]

    def current_lrs(self) -> list[float]:
        """The LR each param group trains with on this replica at the next optimizer step."""
        return [self._value(explored, explored.knob.scheduled()) for explored in self._lr_explored()]

    def _replica_values(self, explored: ExploredValue) -> list[float]:
        base = self._base_value(explored, explored.knob.scheduled())
        return [explored.knob.bounds.clamp(base * rho) for rho in self._replica_multipliers(explored)]

    def _value_report(self, trained_with: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
        """Per explored value: what the replicas trained with (aligned with the interval's losses), the
        controller's new state, and what they train with next."""
        report = {}
        for explored in self._explored:
            report[explored.name] = {
                "replica_values": trained_with[explored.name],
                "base": self._base_value(explored, explored.knob.scheduled()),
                "scale": explored.state.scale,
                "delta": explored.state.last_delta,
                "velocity": explored.state.velocity,
                "next_replica_values": self._replica_values(explored),
            }
        return report

    # ------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Controller, generator and interval state. No rank id: a rank's multipliers are re-derived from
        the topology, so the state loads on any world size. Between syncs it also holds this rank's interval
        loss accumulator (identical replicas make the state rank-independent at sync points)."""
        return {
            "step": self._step,
            "last_sync_step": self._last_sync_step,
            "num_replicas": self.topology.num_replicas,
            "loss_sum": float(self._loss_sum),
            "loss_count": self._loss_count,
            "explored": {
                explored.name: {
                    "permutation": list(explored.permutation),
                    "controller": explored.state.state_dict(),
                    "stream": explored.stream.state_dict(),
                }
                for explored in self._explored
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores ``state_dict()``; with a different replica count the permutations are drawn afresh."""
        saved = state["explored"]
        names = [explored.name for explored in self._explored]
        if sorted(saved) != sorted(names):
            raise ValueError(f"HDET state explores {sorted(saved)} but this run explores {sorted(names)}; "
                             "the optimizer's param groups must match the checkpoint's")
        same_layout = state["num_replicas"] == self.topology.num_replicas
        for explored in self._explored:
            entry = saved[explored.name]
            explored.state = ControllerState(**entry["controller"])
            explored.stream.load_state_dict(entry["stream"])
            explored.permutation = (list(entry["permutation"]) if same_layout
                                    else explored.stream.draw(self.topology.num_replicas))
        self._apply_knobs()
        self._step = int(state["step"])
        # States saved before this field existed were taken at regular sync points.
        self._last_sync_step = int(state.get("last_sync_step", self._step - self._step % self.config.sync_interval))
        self._loss_sum.fill_(float(state["loss_sum"]))
        self._loss_count = int(state["loss_count"])
        self._micro_sum.zero_()
        self._micro_count = 0

    def close(self) -> None:
        """Removes the optimizer hooks and returns every knob to its base value; the optimizer then trains at
        the scheduled values."""
        self._step_scoped.remove()
        for explored in self._explored:
            if not explored.knob.step_scoped:
                explored.knob.apply(explored.knob.scheduled())
        self.adapter.optimizer._hdet_attached = False


# ------------------------------------------------------------------------------------------- helpers
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


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    # A tensor's min and max are finite exactly when all of it is; aminmax reads it once with no full-size
    # temporary (isfinite makes several), and the extrema are checked on the device with one host sync per
    # device. A norm would overflow on large but finite weights.
    extrema: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.numel():
            extrema.setdefault(tensor.device, []).append(torch.stack(torch.aminmax(tensor)).float())
    return all(bool(torch.isfinite(torch.cat(values)).all()) for values in extrema.values())


def _per_replica_probe(table: torch.Tensor, topo: ReplicaTopology) -> list[float]:
    """A replica's probe loss: the mean over its ranks (each may score its own part of the probe batch)."""
    return [float(table[topo.replica_ranks(replica), 3].mean()) for replica in range(topo.num_replicas)]


def _per_replica(table: torch.Tensor, topo: ReplicaTopology) -> tuple[list[float | None], list[bool]]:
    """Replica loss = mean over its ranks of their interval means; finite = finite loss and parameters."""
    losses: list[float | None] = []
    finite: list[bool] = []
    for replica in range(topo.num_replicas):
        rows = table[topo.replica_ranks(replica)]
        with_loss = rows[rows[:, 1] > 0]
        loss = float((with_loss[:, 0] / with_loss[:, 1]).mean()) if len(with_loss) else None
        losses.append(loss)
        finite.append(bool(rows[:, 2].all()) and (loss is None or math.isfinite(loss)))
    return losses, finite
