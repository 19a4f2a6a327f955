"""HDET for PyTorch Lightning: one callback adds it to a ``Trainer`` under ``DDPStrategy`` or, with FSDP2 replicas
of several ranks, under ``ModelParallelStrategy``.

    trainer = Trainer(strategy="ddp", devices=4, callbacks=[HDETCallback({"sync_interval": 100})])
    trainer.fit(module, datamodule)        # under torchrun, srun, or Lightning's own launcher

``DDPStrategy``: every rank, or every group of ``ranks_per_replica`` ranks, is a replica. DDP averages gradients
over all ranks (``gradient_mode: "global"``, where a diverged replica's gradient is left out) or, in ``local``
mode, inside the replica only: the callback gives Lightning's DDP model that communication hook before the
first step.

``ModelParallelStrategy``: each replica shards the model with FSDP2 over its ``ranks_per_replica`` ranks; the
module's ``configure_model`` does it in one line, ``self.model = shard(self, self.model)`` (Lightning's own
device mesh is not used).

Where it reaches Lightning:

- ``on_fit_start``: the optimizer (one, automatic optimization) and the DDP model exist; HDET is attached, and a
  checkpoint's HDET state (restored through this callback's ``state_dict``) is continued without new warm-init
  noise.
- ``on_train_batch_end``: the micro-batch loss (Lightning hands it over divided by ``accumulate_grad_batches``:
  multiplied back here); after the batch that stepped the optimizer (``on_before_optimizer_step`` saw it), HDET
  steps, and syncs every ``sync_interval`` optimizer steps.
- Lightning's SLURM auto-requeue signal handler: held back to the end of the step where every rank has the signal
  (its checkpoint would otherwise sync wherever each rank is in its step).
- ``on_train_epoch_end`` and ``on_train_end``: the replicas are averaged, so the checkpoint that Lightning writes
  after an epoch and the model after ``fit`` are one model.
- ``trainer.save_checkpoint``, which every Lightning checkpoint goes through (``ModelCheckpoint``'s, the SLURM
  auto-requeue's, ``OnExceptionCheckpoint``'s, your own): one taken between syncs gets a sync of its own first, so
  it holds the one model of the ensemble; during the LR range test none is written (a resumed run
  could not take the test up again; a job requeued then starts over, having trained none of its steps), and rank 0
  warns. ``ModelCheckpoint(every_n_train_steps=k)`` needs ``k`` a multiple of ``sync_interval`` (checked), so its
  checkpoints add no syncs.

LR range test (``auto_lr.range_test``): the run starts with it, on the first batches. Its steps are not the run's:
``trainer.global_step`` stays 0 through them (so ``ModelCheckpoint`` saves nothing there, and ``max_steps`` counts
the run's steps only), the LR schedulers do not step (the schedule starts from its first step after the test), and
a run given in epochs of finite data gets the epochs the test's batches take on top (it stops once it has trained
``trainer.estimated_stepping_batches`` steps, the length ``for_run`` gets).

Refused with one line before training: manual optimization, several optimizers, ``FSDPStrategy`` (FSDP1, which
needs a GPU), ``ModelParallelStrategy`` without ``shard`` or splitting the data fewer ways than the world, a
``DDPStrategy`` with a communication hook of its own, every other strategy (``DeepSpeedStrategy``: use
``hdet_scale.engines.deepspeed``), checkpoints every ``k`` steps between syncs, and a resume from a checkpoint
without HDET's state.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import threading
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hdet_scale.comm import AgreedFlag, cpu_group
from hdet_scale.config import HDETConfig, HDETConfigError
from hdet_scale.engines.ddp import attach_to_wrapped
from hdet_scale.engines.fsdp import HDETFSDP
from hdet_scale.engines.fsdp import wrap as fsdp_wrap
from hdet_scale.ensemble import HDETEnsemble
from hdet_scale.extras import require
from hdet_scale.handle import HDETHandle
from hdet_scale.metrics import SyncReport
from hdet_scale.notices import no_replica_optimizer_warning, warn
from hdet_scale.probe import no_probe_warning
from hdet_scale.range_test import HeldScheduler, epochs_with_test, unheld
from hdet_scale.resolve import run_length_error
from hdet_scale.schedule import resolve_config
from hdet_scale.topology import check_world_size, with_replica_size

require("lightning", "lightning", "hdet_scale.integrations.lightning")
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.plugins.environments import SLURMEnvironment  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy  # noqa: E402

REPLICA_OPTIMIZERS = "replica_optimizers"
"""In the callback's checkpoint state, in ``local`` gradient mode under ``DDPStrategy``: replica r >= 1's optimizer
state by r (Lightning saves rank 0's, replica 0's, as the optimizer's)."""


class HDETCallback(pl.Callback, HDETHandle):
    """Hyperparameter-Divergent Ensemble Training in a Lightning ``Trainer``.

    Args:
        hdet_config: an HDETConfig, a dict, a JSON path, or None for defaults.
        **hdet_fields: config fields overriding ``hdet_config`` (e.g. ``sync_interval=100``).

    It is the run's HDET handle (``HDETHandle``: ``set_probe``, ``sync``, ``value``, ``last_report``...) once
    ``fit`` starts; Lightning's optimizer steps take HDET's steps (during an LR range test, the test's: ``ramping``
    is True and ``trainer.global_step`` stays 0).
    """

    loop_feeds_hdet = "HDETCallback hands HDET each loss and steps it after every Lightning optimizer step"

    def __init__(self, hdet_config: HDETConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
                 **hdet_fields: Any) -> None:
        self.config = resolve_config(hdet_config, hdet_fields)
        self._given_config = self.config  # each fit() is a run of its own length
        self._ensemble: HDETEnsemble | None = None
        self._restored: dict[str, Any] | None = None
        self._replica_optimizers: dict[int, dict[str, Any]] | None = None  # from a checkpoint, for on_train_start
        self._stepped = False
        self._stop_at: int | None = None  # the run's length, where the range test lengthened the loop's epochs
        self._schedulers_held = False  # while the range test runs
        self._fsdp: HDETFSDP | None = None  # set by shard() under ModelParallelStrategy
        self._mixed_states_told = False  # FSDP2: a checkpoint of replicas whose optimizer states differ, said once
        self._fitting = False  # from on_fit_start to teardown: _ensemble is this fit's, not an earlier fit's
        self._resumed = False  # a checkpoint's HDET state restored for the current fit
        # Lightning's SLURM auto-requeue handler, held back to a step's end (_defer_slurm_requeue)
        self._requeue: tuple[int, Callable[[int, FrameType | None], Any]] | None = None
        self._requeue_asked = False
        self._requeue_vote = AgreedFlag(None)
        self._given_max_epochs: int | None = None  # the Trainer's, where the range test lengthened them

    # ------------------------------------------------------------------------------------ checks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._fitting = False  # also after a fit that raised (Lightning calls no teardown then): before any restore
        self._stepped = False  # nor an optimizer step that fit saw and HDET did not
        self._resumed = False  # a checkpoint's HDET state restored for this fit
        check_strategy(trainer.strategy)
        if _sharded(trainer):  # its device mesh exists by now
            check_data_parallel(trainer.strategy, trainer.world_size)
        check_checkpoint_steps(trainer.checkpoint_callbacks, self._given_config.sync_interval)
        if not pl_module.automatic_optimization:
            raise HDETConfigError("HDETCallback needs automatic optimization (the callback steps HDET after "
                                  "Lightning's optimizer step); with manual optimization use "
                                  "hdet_scale.engines.ddp.attach and call ensemble.step(loss) yourself")

    # ------------------------------------------------------------------------------------ events
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise HDETConfigError(f"HDETCallback explores one optimizer's param groups; configure_optimizers "
                                  f"returned {len(trainer.optimizers)}")
        finetuning = next((type(callback).__name__ for callback in trainer.callbacks
                           if isinstance(callback, pl.callbacks.BaseFinetuning)), None)
        if finetuning is not None:  # it adds param groups as it unfreezes, which HDET refuses at that step
            raise HDETConfigError(f"HDETCallback needs every param group from the start, and {finetuning} adds them "
                                  "as it unfreezes: give configure_optimizers every group (frozen parameters skip "
                                  "their steps), or leave one of the two callbacks out")
        if self._ensemble is not None:  # an earlier fit()'s: off its optimizer (a module may return it again)
            self._ensemble.close()
        steps = trainer.estimated_stepping_batches
        self._stop_at = None  # not the length of an earlier fit()
        self._mixed_states_told = False
        laid_out = _laid_out(self._given_config, trainer)  # not the length of an earlier fit()
        if math.isfinite(steps):
            self.config = laid_out.for_run(int(steps))
            if self.config.auto_lr.range_test:
                self._add_epochs_for_range_test(trainer, int(steps))
        else:
            self.config = laid_out
            replicas = check_world_size(self.config, trainer.world_size)
            error = run_length_error(self.config, replicas, "this Trainer's length is unknown (an iterable dataset, "
                                                            "or max_time alone, without max_steps): set max_steps")
            if error is not None:
                raise error
        self._save_at_sync_points(trainer)
        if _sharded(trainer):
            if self._fsdp is None:
                raise HDETConfigError("under ModelParallelStrategy, shard the model with "
                                      "hdet_scale.integrations.lightning.shard in configure_model: "
                                      "self.model = shard(self, self.model)")
            self._fsdp.config = self.config
            self._ensemble = self._fsdp.attach(trainer.optimizers[0])
            self._fitting = True  # its checkpoint's state comes after this hook, in load_state_dict
            if self._restored is not None:
                self._ensemble.load_state_dict(self._restored)
            self._restored = None
            return
        self._ensemble = attach_to_wrapped(trainer.strategy.model, trainer.optimizers[0], self.config,
                                          state=self._restored)
        self._fitting = True
        self._restored = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ensemble = self._attached()
        topology = ensemble.topology
        saved, self._replica_optimizers = self._replica_optimizers, None
        # Lightning restored rank 0's (replica 0's) optimizer state on every rank; under FSDP2 its distributed
        # checkpoint holds one state per shard, the replicas' mixed (docs/engines.md)
        if saved is not None and topology.replica_index and self._fsdp is None:
            if topology.replica_index in saved:
                trainer.optimizers[0].load_state_dict(saved[topology.replica_index])
            elif ensemble.replicas_own_optimizer_state and not topology.position:
                warn(no_replica_optimizer_warning("HDETCallback: the checkpoint", topology.replica_index, "Lightning"))
        if trainer.ckpt_path is not None and not self._resumed:
            raise HDETConfigError(
                f"fit(ckpt_path='{trainer.ckpt_path}') resumes a checkpoint without HDET's state (saved without "
                "HDETCallback): HDET would start over on its trained weights (new warm-init noise, a new LR range "
                "test that resets the optimizer); resume from a checkpoint taken with HDETCallback, or load the "
                "weights into the module and fit without ckpt_path")
        fix = ("set one in the LightningModule's on_fit_start (it runs after the callback's): "
               "hdet.set_probe(batch_probe(self.trainer.strategy.model, held_out_batch, loss_fn)), from "
               "hdet_scale.probe")
        if ensemble.needs_probe:
            raise ensemble.probe_missing_error(fix)
        if ensemble.ramping:  # known only now: a checkpoint's state (loaded by now) ends the test before it starts
            self._hold_schedulers(trainer)
        self._defer_slurm_requeue(trainer)
        if ensemble.wants_probe and trainer.global_rank == 0:
            warn(no_probe_warning("HDETCallback has no probe", fix))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self._stepped = True
        # Lightning steps its schedulers after the optimizer, also where an AMP scaler skipped it, and before the
        # batch's end, where HDET steps: this step's base is the one of now.
        self._attached().record_step_bases()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        # The range test ended with the last batch; its schedulers were held until here, past the steps Lightning
        # takes after that batch's hooks (plateau schedulers, epoch-interval ones at an epoch's end).
        if self._schedulers_held and not self._attached().ramping:
            self._release_schedulers(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        ensemble = self._attached()
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            ensemble.observe(loss.detach() * trainer.accumulate_grad_batches)
        self._take_pending_step(trainer)
        if ensemble.ramping:  # the test's steps are not the run's: no validation on its ramping replicas
            trainer.fit_loop.epoch_loop._skip_next_val = True
        if self._requeue is not None and self._requeue_vote.poll(self._requeue_asked):
            number, handler = self._requeue
            self._requeue = None
            signal.signal(number, handler)
            handler(number, None)  # every rank, at the same step's end: its checkpoint, then the requeue

    def _defer_slurm_requeue(self, trainer: pl.Trainer) -> None:
        """Lightning's SLURM auto-requeue saves a checkpoint from inside its signal handler, wherever each rank is in
        its step (in the middle of a backward, say), and the checkpoint's sync would run there: the signal is only
        noted, and every rank runs Lightning's handler at the end of the step where they agree on it (one step
        after the first rank got it)."""
        environment = trainer._accelerator_connector.cluster_environment
        if not (isinstance(environment, SLURMEnvironment) and environment.auto_requeue) \
                or threading.current_thread() is not threading.main_thread():
            return
        number = environment.requeue_signal
        handler = signal.getsignal(number)
        if not callable(handler):  # Lightning set none (a handler of the user's came first)
            return
        self._requeue, self._requeue_asked = (number, handler), False
        self._requeue_vote = AgreedFlag(self._gather_group if dist.is_initialized() else None)
        signal.signal(number, self._note_requeue)

    def _note_requeue(self, number: int, frame: FrameType | None) -> None:
        self._requeue_asked = True

    def _take_pending_step(self, trainer: pl.Trainer) -> None:
        """HDET's step for the optimizer step Lightning took (``on_before_optimizer_step`` saw it), once: at the end
        of its batch, or earlier where a checkpoint comes first (a callback listed before this one saving in its
        ``on_train_batch_end``; the batch's loss then counts in the next step's)."""
        if not self._stepped:
            return
        self._stepped = False
        ensemble = self._attached()
        if ensemble.ramping:
            ensemble.step()
            _uncount_optimizer_step(trainer)
            return
        self._record(ensemble.step(), trainer)
        if self._stop_at is not None and ensemble.global_step >= self._stop_at:
            trainer.should_stop = True

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning validates after the epoch's last batch and before its epoch-end hooks: the one model first.
        if not trainer.sanity_checking:
            self._sync_if_apart(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sync_if_apart(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._release_schedulers(trainer)  # none left held, unless the fit stopped during the range test
        self._sync_if_apart(trainer)
        if self._ensemble is not None and not self.ramping:  # trainer.validate() or test() after fit()
            self._ensemble.apply_base_values()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning restores a checkpoint's callback state for validate, test and predict too: a later fit is a run
        # of its own unless it resumes (a fit consumes what it restored by its first batch)
        self._restored = self._replica_optimizers = None
        self._fitting = False
        self._requeue = None  # Lightning puts the signal handlers back itself
        self._requeue_vote.finish()
        self._give_back_max_epochs(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning runs no callback's teardown after a fit that raised: the Trainer a later fit reuses gets its own
        # epochs and schedulers back here
        self._release_schedulers(trainer)
        self._give_back_max_epochs(trainer)

    def _give_back_max_epochs(self, trainer: pl.Trainer) -> None:
        if self._given_max_epochs is not None:  # the range test's epochs were this fit's only
            trainer.fit_loop.max_epochs, self._given_max_epochs = self._given_max_epochs, None

    # ------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """HDET's state (controller, permutations, step), saved in Lightning's checkpoint; under ``DDPStrategy``,
        where the replicas' optimizer states differ (``HDETEnsemble.optimizer_states_differ``: ``local`` gradient
        mode), also every other replica's, gathered to rank 0, which writes the checkpoint (collective: Lightning
        calls it on every rank). Under ``ModelParallelStrategy`` states that differ are said once a fit."""
        if self._ensemble is None:
            return dict(self._restored or {})
        state = self._ensemble.state_dict()
        differ = self._ensemble.optimizer_states_differ()
        if differ and self._fsdp is None:
            state[REPLICA_OPTIMIZERS] = self._gather_replica_optimizers()
        elif differ and not self._mixed_states_told:
            self._mixed_states_told = True
            if self._ensemble.topology.rank == 0:
                warn("HDETCallback: the replicas' optimizer states differ (local gradient mode, or weight decay added "
                     "to the gradient) and Lightning's distributed checkpoint keeps one per shard, so a fit resumed "
                     "from it gives every replica a mix of them; set average_optimizer_state: true, or checkpoint "
                     "with hdet_scale.engines.fsdp_checkpoint in your own loop")
        return state

    def _gather_replica_optimizers(self) -> dict[int, dict[str, Any]] | None:
        """Each replica r >= 1's optimizer state (from its first rank, on the CPU), by replica, on rank 0; None on
        the other ranks."""
        topology = self._attached().topology
        own = None
        if topology.replica_index and not topology.position:
            state = self._attached().adapter.optimizer.state_dict()
            state["state"] = {index: {key: value.cpu() if isinstance(value, torch.Tensor) else value
                                      for key, value in entry.items()} for index, entry in state["state"].items()}
            own = (topology.replica_index, state)
        gathered: list[Any] | None = [None] * topology.world_size if topology.rank == 0 else None
        torch.distributed.gather_object(own, gathered, dst=0, group=self._gather_group)
        return None if gathered is None else dict(item for item in gathered if item is not None)

    @functools.cached_property
    def _gather_group(self) -> torch.distributed.ProcessGroup | None:
        """Where the replicas' optimizer states travel: on the CPU (over NCCL, rank 0 would stage world-size times the
        largest on its GPU). Made at the first checkpoint, which every rank takes."""
        return cpu_group()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continues a checkpoint's HDET state (kept until ``fit`` attaches HDET, when it is restored first; an
        earlier fit's ensemble is not the one it continues)."""
        state_dict = dict(state_dict)
        self._resumed = True
        self._replica_optimizers = state_dict.pop(REPLICA_OPTIMIZERS, None) or {}  # {}: a resume without them
        if self._ensemble is not None and self._fitting:  # ModelParallelStrategy restores after on_fit_start
            self._ensemble.load_state_dict(state_dict)
        else:
            self._restored = dict(state_dict)

    # ------------------------------------------------------------------------------------ internals
    def _attached(self) -> HDETEnsemble:
        if self._ensemble is None:
            raise RuntimeError("HDETCallback has not attached yet: it attaches in on_fit_start (under a spawning "
                               "strategy such as 'ddp_spawn', in the spawned processes only: read the metrics file)")
        return self._ensemble

    @property
    def ramping(self) -> bool:
        """True while the run's LR range test runs (``auto_lr.range_test``)."""
        return self._ensemble is not None and self._ensemble.ramping

    def _sync_if_apart(self, trainer: pl.Trainer) -> None:
        if self._ensemble is not None and not self.ramping and not self._ensemble.at_sync_point:
            self._record(self._ensemble.sync(), trainer)

    def _save_at_sync_points(self, trainer: pl.Trainer) -> None:
        """Puts every checkpoint of ``trainer`` on a sync point: ``trainer.save_checkpoint`` (the class's, so a later
        fit does not wrap it twice) syncs first between syncs, and writes nothing during the range test."""
        save = type(trainer).save_checkpoint.__get__(trainer)

        @functools.wraps(save)
        def save_checkpoint(*args: Any, **kwargs: Any) -> None:
            self._take_pending_step(trainer)  # the checkpoint holds the steps Lightning counts
            if self.ramping:
                if trainer.global_rank == 0:
                    warn("HDETCallback: no checkpoint is written during the LR range test (auto_lr.range_test), "
                         "which a resumed run could not take up again; a run started again now starts over, having "
                         "trained none of its own steps yet")
                return
            self._sync_if_apart(trainer)
            save(*args, **kwargs)

        trainer.save_checkpoint = save_checkpoint

    def _add_epochs_for_range_test(self, trainer: pl.Trainer, run_steps: int) -> None:
        """Gives a run bounded by epochs of finite data the epochs that the range test's batches take on top, and
        stops it once it has trained ``run_steps`` steps. On a resumed run too: its data epochs are the first
        run's, which the test shifted."""
        batches = trainer.num_training_batches
        if trainer.max_epochs in (None, -1) or not math.isfinite(batches):
            return  # Lightning goes over the data until max_steps: the run's steps alone are counted
        steps_per_epoch = math.ceil(batches / trainer.accumulate_grad_batches)
        self._given_max_epochs = trainer.max_epochs
        trainer.fit_loop.max_epochs = epochs_with_test(trainer.max_epochs, run_steps, self.config.auto_lr.range_test,
                                                       steps_per_epoch)
        self._stop_at = run_steps

    def _hold_schedulers(self, trainer: pl.Trainer) -> None:
        """Every LR scheduler of the Trainer holds (its ``step()`` does nothing) until ``_release_schedulers``."""
        for config in trainer.lr_scheduler_configs:
            config.scheduler = HeldScheduler(config.scheduler)
        self._schedulers_held = True

    def _release_schedulers(self, trainer: pl.Trainer) -> None:
        for config in trainer.lr_scheduler_configs:
            config.scheduler = unheld(config.scheduler)
        self._schedulers_held = False

    def _record(self, report: SyncReport | None, trainer: pl.Trainer) -> None:
        """Logs a sync's scalars (loss, base, scale, replica values) to the Trainer's
        loggers (W&B, TensorBoard, CSV: whatever the Trainer has; they write on rank 0)."""
        if report is None:
            return
        for logger in trainer.loggers:
            logger.log_metrics(report.scalars(), step=trainer.global_step)


def _uncount_optimizer_step(trainer: pl.Trainer) -> None:
    """Takes the optimizer step just taken out of ``trainer.global_step`` (Lightning's count of completed optimizer
    steps): a step of the range test is not one of the run, so ``max_steps`` and ``ModelCheckpoint`` count the run's
    steps only."""
    epoch_loop = trainer.fit_loop.epoch_loop
    progress = epoch_loop.automatic_optimization.optim_progress.optimizer.step
    for tracker in (progress.total, progress.current):
        tracker.ready -= 1
        tracker.completed -= 1
    # the step loggers write at (LearningRateMonitor, self.log), counted up once this batch ends: HDET's sync
    # scalars, logged at global_step, stay in line with them
    epoch_loop._batches_that_stepped -= 1


def shard(pl_module: pl.LightningModule, model: nn.Module, **fsdp_options: Any) -> nn.Module:
    """``configure_model``'s one line under ``ModelParallelStrategy``: ``self.model = shard(self, self.model)``.

    Shards ``model`` (a submodule of ``pl_module``) with FSDP2 inside each replica of the ``HDETCallback`` in the
    module's Trainer (``hdet_scale.engines.fsdp.wrap``; ``fsdp_options`` are its keyword arguments, e.g.
    ``mp_policy``, ``block_classes``). Called again (Lightning may call ``configure_model`` once per stage), it
    returns the model already sharded.
    """
    callbacks = [callback for callback in pl_module.trainer.callbacks if isinstance(callback, HDETCallback)]
    if len(callbacks) != 1:
        raise HDETConfigError(f"shard() needs exactly one HDETCallback in the Trainer's callbacks, found "
                              f"{len(callbacks)}")
    callback = callbacks[0]
    if callback._fsdp is not None:
        return callback._fsdp.model
    device_type = pl_module.trainer.strategy.root_device.type
    wrapped, callback._fsdp = fsdp_wrap(model, _laid_out(callback.config, pl_module.trainer),
                                        device_type=device_type, **fsdp_options)
    return wrapped


def _laid_out(config: HDETConfig, trainer: pl.Trainer) -> HDETConfig:
    """``config`` with its replica size a number: ``"node"`` is the Trainer's devices per node (Lightning's own
    launcher and srun set no LOCAL_WORLD_SIZE), ``"auto"`` a node's ranks under ModelParallelStrategy (FSDP2
    shards inside a replica) and one rank under DDP."""
    return with_replica_size(config, auto="node" if _sharded(trainer) else "rank", world_size=trainer.world_size,
                             node_size=trainer.num_devices)


def _sharded(trainer: pl.Trainer) -> bool:
    """Whether the Trainer's strategy is ModelParallelStrategy, where FSDP2 shards each replica."""
    return type(trainer.strategy).__name__ == "ModelParallelStrategy"


def check_checkpoint_steps(checkpoint_callbacks: list[Any], sync_interval: int) -> None:
    """``ModelCheckpoint(every_n_train_steps=k)``: ``k`` a multiple of ``sync_interval``, else each of its
    checkpoints would add a sync (see ``HDETCallback._save_at_sync_points``); raises HDETConfigError naming it."""
    for callback in checkpoint_callbacks:
        every = getattr(callback, "_every_n_train_steps", 0) or 0
        if every % sync_interval:
            raise HDETConfigError(
                f"ModelCheckpoint(every_n_train_steps={every}) checkpoints between HDET syncs (every {sync_interval} "
                "steps), where the replicas differ: each checkpoint would add a sync of its own; use a multiple of "
                f"sync_interval={sync_interval}, or checkpoint at epoch ends")


def check_data_parallel(strategy: Any, world_size: int) -> None:
    """Under ``ModelParallelStrategy`` Lightning splits the data over its ``data_parallel`` mesh dimension: every
    rank needs batches of its own (FSDP2 shards a replica's model, not its batch), so that dimension must span
    the world; raises HDETConfigError naming the fix."""
    size = strategy.device_mesh["data_parallel"].size()
    if size != world_size:
        raise HDETConfigError(
            f"ModelParallelStrategy splits the data {size} ways (data_parallel_size) over {world_size} ranks, so "
            f"ranks would train on the same batches; HDET's replicas shard the model with FSDP2 and every rank needs "
            f"its own: pass ModelParallelStrategy(data_parallel_size={world_size}, tensor_parallel_size=1)")


def check_strategy(strategy: Any) -> None:
    """DDP (several processes), FSDP2 replicas (``ModelParallelStrategy``) or one device; anything else is refused
    in one line."""
    name = type(strategy).__name__
    if name == "ModelParallelStrategy":
        return
    if name == "FSDPStrategy":
        raise HDETConfigError("HDETCallback does not support FSDPStrategy (FSDP1, which needs a GPU): use "
                              "strategy='ddp', or FSDP2 through hdet_scale.engines.fsdp in your own loop")
    if name == "XLAStrategy":  # a DDPStrategy by class, not DDP
        raise HDETConfigError("HDETCallback does not support XLAStrategy: use strategy='ddp' on GPUs or CPUs")
    if name == "DeepSpeedStrategy":
        raise HDETConfigError("HDETCallback does not support DeepSpeedStrategy: use hdet_scale.engines.deepspeed "
                              "(deepspeed.initialize with HDET's replica groups) in your own loop")
    if isinstance(strategy, DDPStrategy) and (strategy._ddp_comm_hook or strategy._ddp_comm_wrapper):
        raise HDETConfigError("DDPStrategy(ddp_comm_hook=...) under HDETCallback: HDET sets DDP's gradient average "
                              "itself (gradient_mode), and DDP takes one communication hook; remove ddp_comm_hook "
                              "and ddp_comm_wrapper")
    if isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)):  # DeepSpeedStrategy is a DDPStrategy too
        return
    raise HDETConfigError(f"HDETCallback supports DDPStrategy (strategy='ddp'), not {name}")

