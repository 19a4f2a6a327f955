"""HDET for ``transformers.Trainer``: one call adds it to a Trainer under DDP or DeepSpeed ZeRO 0-3.

    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    hdet = add_hdet(trainer, {"sync_interval": 100, "metrics_path": "runs/hdet.jsonl"})
    trainer.train()                       # under torchrun / accelerate launch / deepspeed

A ``TrainerCallback`` cannot do it alone: its events carry the model and the optimizer but not the loss of a
step, and under DeepSpeed the replica layout must be decided when the engine is built, inside ``train()``,
before any callback runs. ``add_hdet`` therefore adds an ``HDETCallback`` and makes narrow, instance-level
changes to that one Trainer:

- ``trainer.training_step`` (Trainer's documented override point) also hands each micro-batch loss to HDET;
  a step's loss is the sum of its micro-batch losses, i.e. the loss Trainer logs.
- ``trainer.train`` notes the checkpoint a run resumes from (HDET's state is read from it). Each ``train()``
  is a run of its own: with ``model_init`` (``hyperparameter_search``) HDET attaches to each run's new model and
  optimizer.
- ``trainer._save_checkpoint`` writes HDET's state into each checkpoint (below), ``trainer.evaluate`` syncs first
  during training, and ``trainer._save`` (what ``save_model`` and ``push_to_hub`` write) carries, outside a
  checkpoint, the attention scale the run found in the query weights where it is explored.
- DeepSpeed only: while ``trainer.train()`` runs, ``deepspeed.initialize`` called for this Trainer's model
  (accelerate calls it from ``accelerator.prepare``) is answered by ``hdet_scale.engines.deepspeed.initialize``,
  which builds the engine with HDET's replica groups, so ZeRO shards and reduces inside a replica. Every
  other call goes to DeepSpeed unchanged, and the change is undone when ``train()`` returns.
- With an LR range test only (below): ``trainer.set_initial_training_values`` gives the loop more epochs, and
  ``trainer.lr_scheduler`` is a stand-in whose ``step()`` does nothing while the test runs.

Engines:

- **DDP** (several processes, no DeepSpeed or FSDP): accelerate's DDP over all ranks is HDET's ``global``
  gradient mode; ``local`` mode gives DDP a communication hook that averages gradients inside the replica
  only. Every rank is a replica by default (``ranks_per_replica: "auto"`` is 1).
- **DeepSpeed ZeRO 0-3** (``TrainingArguments(deepspeed=...)``): HDET's DeepSpeed adapter, both gradient
  modes. ``ranks_per_replica: "auto"`` is 1 on ZeRO-0 and a node on ZeRO-1/2/3. ``train_batch_size`` stays
  the batch of one optimizer step over all ranks.
- **Not supported**, each a clear error from ``add_hdet`` before training: Trainer's FSDP setting, a
  ``parallelism_config`` (HSDP, tensor, context or sequence parallelism), ``nn.DataParallel`` over several
  GPUs in one process, a model spread over devices, and the DeepSpeed settings HDET's adapter refuses
  (offload, fp16, ZeRO++ hpZ and qgZ, a model built under ``deepspeed.zero.Init``).

LR range test (``auto_lr.range_test``, by default): the run starts with it, on the Trainer's first batches. Its steps
are not the run's: the Trainer's ``global_step`` stays 0 through them (no log, evaluation or checkpoint is taken
there; one a callback asks for is skipped, and rank 0 warns once a ``train()``), its ``lr_scheduler`` does not
step (the schedule starts from its first step after the test), and the loop gets enough epochs for them on top of
``max_steps`` (or ``num_train_epochs``): the run trains its full length after the test, and ``for_run`` gets that
length. The Trainer's first logged loss leaves the test's losses out
(where the Trainer keeps their sum on itself, ``_tr_loss``, as transformers 5 does).

Checkpoints: under DDP, Trainer checkpoints are taken at sync points (``save_steps`` a multiple of
``sync_interval``, checked; one another callback asks for between syncs gets a sync of its own first) and carry
HDET's state (under DDP in ``hdet_state.pt``, and where the replicas' optimizer states differ from rank 0's, as in
``local`` gradient mode, also each other replica's; under DeepSpeed in the engine's checkpoint, which
``hdet_scale.engines.deepspeed`` writes with each replica's files), which ``train(resume_from_checkpoint=...)``
restores; a checkpoint without it is refused. An evaluation during training between syncs (``eval_steps`` or
epochs that are no multiple of ``sync_interval``, a callback's) gets a sync first too, so it scores the one model. At
the end of training the replicas are averaged once more (``sync_at_end``) so ``trainer.save_model()`` writes the
ensemble's model, with the attention scale found folded in.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hdet_scale.config import HDETConfig, HDETConfigError
from hdet_scale.controller import PaperDecay
from hdet_scale.engines.ddp import attach_to_wrapped
from hdet_scale.ensemble import HDETEnsemble
from hdet_scale.extras import require
from hdet_scale.handle import HDETHandle
from hdet_scale.integrations.hf_trainer_checks import check_saving, check_trainer
from hdet_scale.metrics import SyncReport
from hdet_scale.notices import no_replica_optimizer_warning, warn
from hdet_scale.probe import batch_probe, no_probe_warning
from hdet_scale.range_test import HeldScheduler, epochs_with_test, unheld
from hdet_scale.resolve import load_config
from hdet_scale.topology import ReplicaTopology

require("transformers", "trainer", "hdet_scale.integrations.hf_trainer")
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments  # noqa: E402
from transformers.trainer import OPTIMIZER_NAME  # noqa: E402
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR  # noqa: E402

STATE_FILE = "hdet_state.pt"
"""In a Trainer checkpoint folder: HDET's state (controller, permutations, step), written by global rank 0."""

REPLICA_OPTIMIZER_FILE = "hdet_optimizer_replica{}.pt"
"""In a Trainer checkpoint folder, in ``local`` gradient mode: replica r's optimizer state (r >= 1), written by its
first rank. Each replica's moments follow its own gradients there, and the Trainer saves rank 0's only."""


class HDETCallback(TrainerCallback, HDETHandle):
    """The HDET side of one ``transformers.Trainer``; made and installed by ``add_hdet``. Once training begins it is
    the run's HDET handle (``HDETHandle``: ``set_probe``, ``sync``, ``value``, ``last_report``...); the Trainer's
    optimizer steps take HDET's steps (during an LR range test, the test's: ``ramping`` is True and the Trainer's
    ``global_step`` stays 0).

    Attributes:
        config: the HDET settings.
        engine: ``"ddp"`` or ``"deepspeed"``.
        deepspeed: under DeepSpeed, the engine's ``HDETDeepSpeed`` handle (``engine.hdet``), else None.
    """

    loop_feeds_hdet = "the Trainer hands HDET each loss and takes its steps with its optimizer's"

    def __init__(self, trainer: Trainer, config: HDETConfig, engine: str, *,
                 paper_decay: Sequence[PaperDecay] | None = None, sync_at_end: bool = True,
                 probe: bool = True) -> None:
        self.trainer = trainer
        self.config = config
        self._given_config = config  # each train() is a run of its own length (model_init: a fresh model too)
        self._resume_folder: Path | None = None  # the checkpoint the current train() resumes from
        self.engine = engine
        self.paper_decay = paper_decay
        self.sync_at_end = sync_at_end
        self.probe = probe
        self._ensemble: HDETEnsemble | None = None
        self.deepspeed: Any = None
        self._step_in_range_test = False  # the Trainer's current optimizer step is one of the LR range test's
        self._counts_before_test: tuple[int, float] = (0, 0.0)  # the Trainer's tokens and flos before the test
        self._logged_report: SyncReport | None = None  # the last sync report given to the Trainer's loggers
        self._training = False  # between on_train_begin and on_train_end
        self._said_no_save = False  # a checkpoint asked for during this train()'s range test was warned about
        self._in_checkpoint = False  # the Trainer's model is saved into one of its checkpoints, not exported

    # ------------------------------------------------------------------------------------ reporting
    def _attached(self) -> HDETEnsemble:
        if self._ensemble is None:
            raise RuntimeError("HDET attaches when trainer.train() starts; call this during or after training")
        return self._ensemble

    def sync(self) -> SyncReport | None:
        """A sync now, between the regular ones (collective: every rank calls it); None where the replicas are one
        model already (right after a sync)."""
        with self._replica_groups():
            return self.ensemble.sync()

    @property
    def topology(self) -> ReplicaTopology:
        """The replica layout (this rank's replica, the groups between replicas)."""
        return self.ensemble.topology

    # ------------------------------------------------------------------------------------- events
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        check_saving(args, self._given_config)  # a hyperparameter_search trial may set save_steps
        self._training, self._said_no_save = True, False
        if self.engine == "deepspeed":
            if self.deepspeed is None:
                raise RuntimeError("the DeepSpeed engine was built without HDET: call trainer.train() on the "
                                   "Trainer add_hdet was given, after add_hdet")
            self._ensemble = self.deepspeed.ensemble
        else:
            if self._ensemble is not None:  # an earlier train() of this Trainer (model_init, hyperparameter_search)
                self._ensemble.close()
            self.config = self._given_config.for_run(state.max_steps)
            self._ensemble = self._attach_ddp(kwargs["optimizer"],
                                              self._saved_state(state) if state.global_step else None)
            if state.global_step:
                self._load_replica_optimizer()
        if self.probe:
            self._set_probe(self._ensemble)
        if self._ensemble.needs_probe:
            raise self._ensemble.probe_missing_error(
                "give the Trainer an eval_dataset (add_hdet's probe scores its first batch)"
                + (", and leave add_hdet's probe on" if not self.probe else ""))
        # a train() that raised during its range test left its scheduler held: the Trainer keeps a scheduler given
        self.trainer.lr_scheduler = unheld(self.trainer.lr_scheduler)
        if self._ensemble.ramping:
            self.trainer.lr_scheduler = HeldScheduler(self.trainer.lr_scheduler)
            self._counts_before_test = (state.num_input_tokens_seen, self.trainer.current_flos)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        # Read before the step: under DeepSpeed HDET steps inside it, so the test's last step ends the test there.
        self._step_in_range_test = self.ramping

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.ramping:  # an epoch of the range test's batches: its end is none of the run's
            control.should_log = control.should_evaluate = control.should_save = False

    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                          **kwargs: Any) -> None:
        if self._step_in_range_test:
            # The Trainer counts this step next (then DefaultFlowCallback decides on it): a step of the range test
            # is not one of the run, whose global_step stays 0 until the test ends.
            state.global_step -= 1

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        ensemble = self.ensemble
        in_range_test = self._step_in_range_test
        if self.engine != "deepspeed":  # under DeepSpeed HDET stepped inside engine.step(), with the optimizer step
            ensemble.step()
        if in_range_test:
            # DefaultFlowCallback judged this step as step 0 of the run, whose logs, evaluations and checkpoints
            # (state_dict() refuses during the test) start after the test.
            control.should_log = control.should_evaluate = control.should_save = False
            if not ensemble.ramping:
                self._end_range_test()
            return
        # DefaultFlowCallback (which runs first) asks for the final save and the stop here: end on one model.
        ending = control.should_training_stop or state.global_step >= state.max_steps
        if (control.should_save or ending and self.sync_at_end) and not self.at_sync_point:
            self.sync()
        self._log_sync()

    def _before_evaluation(self) -> None:
        """Every ``trainer.evaluate()`` during training (the Trainer's own, at ``eval_steps`` or an epoch's end, or a
        callback's) first syncs between syncs, as a checkpoint does, so that it scores the one model, not each rank's
        replica (early stopping and the best-model choice act on it). After ``train()`` nothing is synced
        (``sync_at_end`` said whether the replicas end as one)."""
        if self._training and not self.ramping and not self.at_sync_point:
            self.sync()
            self._log_sync()

    def _log_sync(self) -> None:
        """Gives a sync's scalars (``SyncReport.scalars``: the replicas' losses, each explored value's base, scale and
        replica values) to the Trainer's loggers (``report_to``), once: the LR the Trainer logs is its schedule's,
        not the one the run trains at."""
        report = self.ensemble.last_report
        if report is not None and report is not self._logged_report:
            self._logged_report = report
            control = self.trainer.control
            should_log = control.should_log
            self.trainer.log(report.scalars())
            control.should_log = should_log  # the callbacks' on_log clears it: the Trainer's own log of the step comes

    def _save_checkpoint(self, trial: Any) -> bool:
        """Writes HDET's files into the checkpoint the Trainer is about to take, before its own: the Trainer deletes
        its older checkpoints (``save_total_limit``) at the end of the same call, so a kill after it must find them
        in the newest. First a sync between the regular ones, so the checkpoint holds the one model of the
        ensemble. Under DeepSpeed the engine's checkpoint, which the Trainer takes, holds HDET's state and each
        replica's files. Returns whether the Trainer takes its checkpoint: not during the LR range test (a warning
        says so, once a train()), which a resumed run could not take up again; the Trainer's ``on_save`` callbacks
        are called all the same."""
        if self.ramping:
            if self.ensemble.topology.rank == 0 and not self._said_no_save:
                warn("HDETCallback: no checkpoint is written during the LR range test (auto_lr.range_test), which a "
                     "resumed run could not take up again: a callback set control.should_save; have it wait until "
                     "the callback's `ramping` is False")
            self._said_no_save = True
            return False
        if not self.at_sync_point:
            self.sync()
            self._log_sync()
        if self.engine == "deepspeed":
            return True
        trainer, ensemble = self.trainer, self.ensemble
        args = trainer.args
        # the Trainer's own folder rule: a hyperparameter search trial has a run folder
        folder = Path(trainer._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
        topology = ensemble.topology
        if args.should_save:  # where the Trainer writes its own files: global rank 0, or each node's first rank
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(ensemble.state_dict(), folder / STATE_FILE)
        # the Trainer saves no optimizer state with save_only_model either
        if (not args.save_only_model and ensemble.optimizer_states_differ() and topology.replica_index
                and not topology.position):
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(ensemble.adapter.optimizer.state_dict(),
                       folder / REPLICA_OPTIMIZER_FILE.format(topology.replica_index))
        return True

    def _exported_state(self, state: dict | None) -> dict | None:
        """The state dict the Trainer saves its model with (``save_model``; None: the model's own): outside a
        checkpoint, with the attention scale the run found folded into the query weights where it is explored
        (``HDETEnsemble.fold_found_attention_scale``), since the saved config rebuilds each module's own scale.
        A checkpoint keeps the weights as they are: its HDET state gives the scale back on resume."""
        ensemble = self._ensemble
        if (self._in_checkpoint or not self.trainer.args.should_save or ensemble is None
                or not ensemble.explores("attention_scale")):  # a rank that writes nothing: nothing to fold
            return state
        folded = dict(self.trainer.model.state_dict() if state is None else state)
        ensemble.fold_found_attention_scale(self.trainer.model, folded)
        return folded

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._training = False
        self.trainer.lr_scheduler = unheld(self.trainer.lr_scheduler)  # held where it stopped during the range test
        if self.sync_at_end and self._ensemble is not None and not self.ramping and not self.at_sync_point:
            self.sync()
        if self._ensemble is not None and not self.ramping:  # trainer.evaluate() and save_model() after train()
            self._log_sync()
            self._ensemble.apply_base_values()

    @property
    def ramping(self) -> bool:
        """True while the run's LR range test runs (``auto_lr.range_test``)."""
        return self._ensemble is not None and self._ensemble.ramping

    @property
    def at_sync_point(self) -> bool:
        """True at the start and right after a sync: every replica holds the same parameters."""
        return self._ensemble is None or self._ensemble.at_sync_point

    # ------------------------------------------------------------------------------------ internals
    def _end_range_test(self) -> None:
        """After the range test's last step: the scheduler steps again, and the loss the Trainer logs first is the
        run's (transformers 5 keeps the sum of the losses since the last log on the Trainer), as are the input
        tokens and floating-point operations it counts."""
        trainer = self.trainer
        trainer.lr_scheduler = unheld(trainer.lr_scheduler)
        trainer.state.num_input_tokens_seen, trainer.current_flos = self._counts_before_test
        logged_loss = getattr(trainer, "_tr_loss", None)
        if isinstance(logged_loss, torch.Tensor):
            logged_loss.zero_()

    def _set_probe(self, ensemble: HDETEnsemble) -> None:
        """Scores the replicas at every sync on the first batch of the Trainer's eval dataloader (rank 0's, the
        first dataset of a dict), with the Trainer's own loss; without an eval_dataset, says so once."""
        if not ensemble.wants_probe:
            return
        trainer = self.trainer
        dataset = trainer.eval_dataset
        if dataset is None:
            if ensemble.topology.rank == 0:
                warn(no_probe_warning("the Trainer has no eval_dataset", "give it one (add_hdet's probe "
                                      "scores its first batch), or pass probe=False to add_hdet"))
            return
        loader = trainer.get_eval_dataloader(next(iter(dataset)) if isinstance(dataset, dict) else None)

        def probe_loss(model: Any, inputs: Any) -> torch.Tensor:
            # prepared anew at every sync, as the Trainer prepares each batch: compute_loss takes the labels out of
            # the dict it gets (a label smoother, compute_loss_func), and DeepSpeed's bf16 needs float inputs cast
            return trainer.compute_loss(model, trainer._prepare_inputs(inputs))

        ensemble.set_probe(batch_probe(trainer.model_wrapped, next(iter(loader)), probe_loss,
                                       device=trainer.args.device))

    def _attach_ddp(self, optimizer: Any, state: dict[str, Any] | None) -> HDETEnsemble:
        """Builds the ensemble over the torch optimizer inside accelerate's wrapper, on accelerate's DDP model
        (warm-init noise on a fresh start only: a resumed run's ``state`` continues from the checkpoint's
        weights, which Trainer has loaded)."""
        return attach_to_wrapped(self.trainer.model_wrapped, getattr(optimizer, "optimizer", optimizer), self.config,
                                 paper_decay=self.paper_decay, state=state)

    def _attach_deepspeed(self, engine: Any) -> None:
        self.deepspeed = engine.hdet
        # The Trainer resumes (and loads its best model) through engine.load_checkpoint: a checkpoint without
        # HDET's state is refused before DeepSpeed reads it, as under DDP.
        engine.load_checkpoint = engine.hdet.load_checkpoint
        ensemble = engine.hdet.ensemble
        observe = ensemble.observe

        def observe_unscaled(loss: Any) -> None:
            observe(self._step_share(loss))

        ensemble.observe = observe_unscaled

    def _observe(self, loss: torch.Tensor) -> None:
        if self.engine != "deepspeed" and self._ensemble is not None:
            self._ensemble.observe(self._step_share(loss))

    def _step_share(self, loss: Any) -> Any:
        """A micro-batch's loss as HDET observes it. Trainer scales each to its share of the step (divided by the
        accumulation steps, or by the step's token count), and the shares sum to the step's loss it logs; HDET
        takes a step's loss as the mean of what it observes, so each share counts once per micro-batch."""
        # older transformers releases have no current_gradient_accumulation_steps (nor a shorter last window)
        return loss * getattr(self.trainer, "current_gradient_accumulation_steps",
                              self.trainer.args.gradient_accumulation_steps)

    def _saved_state(self, state: TrainerState) -> dict[str, Any]:
        """HDET's state saved in the Trainer checkpoint this run resumes from (noted by ``train``, which every
        resume goes through)."""
        path = self._resume_folder / STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"resuming at step {state.global_step} but '{path}' does not exist: HDET saves it in every Trainer "
                "checkpoint it takes; resume from one of those")
        return torch.load(path, map_location="cpu", weights_only=True)

    def _load_replica_optimizer(self) -> None:
        """Gives replica r >= 1 its own optimizer state back where the replicas' differ (the Trainer loaded rank 0's,
        which is replica 0's, on every rank). A checkpoint without it (saved where the replicas' states were alike,
        or with fewer replicas) leaves replica 0's, and says so where this run's replicas own theirs; one without
        the Trainer's (``save_only_model``) leaves every replica's fresh, as the Trainer does."""
        topology = self.ensemble.topology
        if not topology.replica_index or not (self._resume_folder / OPTIMIZER_NAME).is_file():
            return
        path = self._resume_folder / REPLICA_OPTIMIZER_FILE.format(topology.replica_index)
        if path.is_file():
            # on the CPU: the file's tensors name the device of the rank that saved it
            self.ensemble.adapter.optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        elif self.ensemble.replicas_own_optimizer_state and not topology.position:
            warn(no_replica_optimizer_warning(f"'{self._resume_folder}'", topology.replica_index, "the Trainer"))

    def _resuming_from(self, resume_from_checkpoint: Any) -> None:
        """Notes the checkpoint folder a ``train(resume_from_checkpoint=...)`` resumes from (True: the Trainer's last
        in its output_dir), where HDET's state is read."""
        if resume_from_checkpoint is True:
            from transformers.trainer_utils import get_last_checkpoint

            last = get_last_checkpoint(self.trainer.args.output_dir)
            self._resume_folder = None if last is None else Path(last)
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            self._resume_folder = Path(resume_from_checkpoint)
        else:
            self._resume_folder = None

    @contextlib.contextmanager
    def _replica_groups(self) -> Iterator[None]:
        if self.deepspeed is None:
            yield
            return
        from hdet_scale.engines.deepspeed import replica_groups

        with replica_groups(self.deepspeed.engine.mpu):
            yield


def add_hdet(trainer: Trainer, hdet_config: HDETConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
             *, paper_decay: Sequence[PaperDecay] | None = None, sync_at_end: bool = True,
             probe: bool = True) -> HDETCallback:
    """Adds HDET to ``trainer`` and returns its callback; call it before ``trainer.train()`` on every rank.

    Args:
        trainer: a ``transformers.Trainer`` (or subclass) set up for DDP or DeepSpeed ZeRO 0-3.
        hdet_config: HDET settings (an ``HDETConfig``, a dict, a JSON path, or None for the defaults).
        paper_decay: per param group, the schedule's floor and length, for ``auto_lr.mode='paper'``.
        sync_at_end: average the replicas when training ends between syncs, so the Trainer's model after
            ``train()`` is the ensemble's model on every rank.
        probe: score every replica at each sync on the first batch of ``trainer.eval_dataset`` (the same batch
            on every replica, the controller's low-noise signal; ``per_device_eval_batch_size`` samples). With
            no eval_dataset the controller uses the training losses, and rank 0 warns once.

    Raises:
        HDETConfigError: a bad HDET field, a replica size that does not divide the world, a Trainer setting HDET
            does not support (each named, with the fix).
    """
    if getattr(trainer, "_hdet_callback", None) is not None:
        raise ValueError("HDET is added to this Trainer already")
    config = load_config(hdet_config, world_size=None)
    engine = check_trainer(trainer, config)
    range_test = config.auto_lr.filled().range_test
    if range_test:
        _add_epochs_for_range_test(trainer, range_test)
    callback = HDETCallback(trainer, config, engine, paper_decay=paper_decay, sync_at_end=sync_at_end,
                            probe=probe)
    trainer.add_callback(callback)
    trainer._hdet_callback = callback

    training_step = trainer.training_step

    @functools.wraps(training_step)
    def observing_training_step(*args: Any, **kwargs: Any) -> torch.Tensor:
        loss = training_step(*args, **kwargs)
        callback._observe(loss)
        return loss

    trainer.training_step = observing_training_step
    save_checkpoint = trainer._save_checkpoint

    @functools.wraps(save_checkpoint)
    def save_checkpoint_with_hdet(model: Any, trial: Any = None, *args: Any, **kwargs: Any) -> None:
        if callback._save_checkpoint(trial):
            callback._in_checkpoint = True
            try:
                save_checkpoint(model, trial, *args, **kwargs)  # older transformers releases pass metrics too
            finally:
                callback._in_checkpoint = False

    trainer._save_checkpoint = save_checkpoint_with_hdet
    save = trainer._save

    @functools.wraps(save)
    def save_with_found_attention_scale(output_dir: str | None = None, state_dict: dict | None = None,
                                        *args: Any, **kwargs: Any) -> None:
        save(output_dir, callback._exported_state(state_dict), *args, **kwargs)

    trainer._save = save_with_found_attention_scale
    evaluate = trainer.evaluate

    @functools.wraps(evaluate)
    def evaluate_one_model(*args: Any, **kwargs: Any) -> Any:
        callback._before_evaluation()
        return evaluate(*args, **kwargs)

    trainer.evaluate = evaluate_one_model
    train = trainer.train

    @functools.wraps(train)
    def train_with_hdet(*args: Any, **kwargs: Any) -> Any:
        resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        callback._resuming_from(resume)
        if engine != "deepspeed":
            return train(*args, **kwargs)
        with _hdet_deepspeed_initialize(trainer, callback):
            return train(*args, **kwargs)

    trainer.train = train_with_hdet
    return callback


def _add_epochs_for_range_test(trainer: Trainer, test_steps: int) -> None:
    """Gives ``trainer``'s loop enough epochs of its data for ``test_steps`` range-test steps before the run's
    ``max_steps``: the Trainer stops at ``max_steps`` (the test's steps are not counted), but its loop also ends
    after its epochs, which would cut the run short by the test's steps."""
    set_values = getattr(trainer, "set_initial_training_values", None)
    if set_values is None:
        raise HDETConfigError("auto_lr.range_test needs a Trainer with set_initial_training_values, where HDET adds "
                              "the test's steps to the loop: upgrade transformers, or set auto_lr.range_test to 0")

    @functools.wraps(set_values)
    def with_range_test_epochs(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
        epochs, steps_per_epoch, *values, max_steps = set_values(*args, **kwargs)
        # without a dataloader length the Trainer already loops over the data until max_steps
        epochs = epochs_with_test(epochs, max_steps, test_steps, steps_per_epoch)
        return (epochs, steps_per_epoch, *values, max_steps)

    trainer.set_initial_training_values = with_range_test_epochs


@contextlib.contextmanager
def _hdet_deepspeed_initialize(trainer: Trainer, callback: HDETCallback) -> Iterator[None]:
    """Answers ``deepspeed.initialize`` for ``trainer.model`` with HDET's, for the duration of the block."""
    import deepspeed

    from hdet_scale.engines import deepspeed as hdet_deepspeed

    original = deepspeed.initialize

    def initialize(*args: Any, **kwargs: Any) -> Any:
        if args or kwargs.get("model") is not trainer.model:
            return original(*args, **kwargs)
        deepspeed.initialize = original  # HDET's initialize builds the engine with DeepSpeed's own
        try:
            # The run's length for auto_lr.start/stop given as shares: Trainer sets its state only after this call.
            steps = optimizer_steps(trainer)
            callback.config = callback._given_config.for_run(steps) if steps is not None else callback._given_config
            engine, optimizer, loader, scheduler = hdet_deepspeed.initialize(
                **kwargs, hdet_config=callback.config, paper_decay=callback.paper_decay)
        finally:
            deepspeed.initialize = initialize
        callback._attach_deepspeed(engine)
        return engine, optimizer, loader, scheduler

    deepspeed.initialize = initialize
    try:
        yield
    finally:
        deepspeed.initialize = original


def optimizer_steps(trainer: Trainer) -> int | None:
    """The run's optimizer steps as Trainer counts them: ``max_steps``, or ``num_train_epochs`` times the
    training data's batches per epoch in optimizer steps (gradient accumulation rounds a last partial group up);
    None when the data has no length."""
    args = trainer.args
    if args.max_steps > 0:
        return args.max_steps
    try:
        batches = len(trainer.get_train_dataloader())
    except TypeError:  # an iterable dataset: Trainer then needs max_steps itself
        return None
    accumulation = args.gradient_accumulation_steps
    per_epoch = max(batches // accumulation + int(batches % accumulation > 0), 1)
    return math.ceil(args.num_train_epochs * per_epoch)
