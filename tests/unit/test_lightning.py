"""HDETCallback in real multi-process Lightning runs (torchrun, 4 CPU ranks, DDPStrategy on gloo).

Each launch is ``tests/lightning_job.py``; its record holds every rank's parameters after each optimizer step
and just before each sync, so the checks compare with averages computed here.

This file holds the tests that start no process; the tests that start a launcher or script as a subprocess are in
tests/e2e/test_lightning_e2e.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch


def test_strategies_and_loops_it_cannot_serve_are_refused():
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    from hdet_scale.config import HDETConfigError
    from hdet_scale.integrations.lightning import HDETCallback, check_strategy

    with pytest.raises(HDETConfigError, match="does not support FSDPStrategy \\(FSDP1, which needs a GPU\\)"):
        check_strategy(FSDPStrategy())
    with pytest.raises(HDETConfigError, match="does not support DeepSpeedStrategy"):
        check_strategy(DeepSpeedStrategy.__new__(DeepSpeedStrategy))  # its constructor wants DeepSpeed's GPU build
    from lightning.pytorch.strategies import XLAStrategy

    with pytest.raises(HDETConfigError, match="does not support XLAStrategy"):  # a DDPStrategy by class
        check_strategy(XLAStrategy.__new__(XLAStrategy))  # its constructor wants torch_xla
    import lightning.pytorch as pl

    class Manual(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False)
    with pytest.raises(HDETConfigError, match="needs automatic optimization"):
        HDETCallback().setup(trainer, Manual(), "fit")


def test_shares_of_a_run_of_unknown_length_are_refused_before_attaching():
    """An iterable dataset without max_steps: Lightning estimates an infinite run, so the default controller
    start (2% of the run) has no step; with 2 replicas the callback says so before HDET attaches."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy

    from hdet_scale.config import HDETConfigError
    from hdet_scale.integrations.lightning import HDETCallback

    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    trainer = SimpleNamespace(optimizers=[optimizer], callbacks=[], estimated_stepping_batches=float("inf"),
                              world_size=2, num_devices=2, strategy=DDPStrategy())
    callback = HDETCallback(auto_lr={"range_test": 0})
    callback.config = callback.config.for_run(1000)  # what an earlier fit() of 1000 steps resolved
    with pytest.raises(HDETConfigError, match=r"^auto_lr.start=0.02 is a share of the run, and the controller "
                                              r"moving the LR needs the run's length for it: this Trainer's length "
                                              r"is unknown .*: set max_steps, or "
                                              r"give auto_lr.start as a step \(an int\)$"):
        callback.on_fit_start(trainer, None)


def test_a_state_restored_for_validation_is_not_a_later_fits():
    """Lightning restores a checkpoint's callback states for validate(ckpt_path=...) too; a fit after it without a
    checkpoint is a fresh run (warm-init noise, range test), not the validated checkpoint's continuation."""
    import lightning.pytorch as pl

    from hdet_scale.integrations.lightning import HDETCallback

    callback = HDETCallback()
    callback.load_state_dict({"step": 40, "explored": {}})
    assert callback.state_dict()["step"] == 40  # held for the fit that restored it
    callback.teardown(pl.Trainer(accelerator="cpu", devices=1, logger=False), pl.LightningModule(), "validate")
    assert callback.state_dict() == {}


def regression(*, keeps_its_optimizer: bool = False) -> Any:
    """A LightningModule: a linear regression trained with SGD (made once and returned to every fit, where it
    ``keeps_its_optimizer``)."""
    import lightning.pytorch as pl

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(4, 1)
            self.optimizer = None

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            return (self.net(inputs).squeeze(1) - targets).pow(2).mean()

        def configure_optimizers(self):
            optimizer = self.optimizer or torch.optim.SGD(self.parameters(), lr=0.01)
            if keeps_its_optimizer:
                self.optimizer = optimizer
            return optimizer

    return Regression()


def one_device_fit(hdet, module: Any = None, **trainer_args) -> Any:
    """A fit of ``module`` (default: a new ``regression()``) in this process on one CPU device (one replica), 10
    batches an epoch (``callbacks_before``: listed before ``hdet``); returns the Trainer."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    inputs = torch.randn(40, 4, generator=torch.Generator().manual_seed(1))
    ckpt_path = trainer_args.pop("ckpt_path", None)
    callbacks = [*trainer_args.pop("callbacks_before", []), hdet, *trainer_args.pop("callbacks", [])]
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=callbacks, **trainer_args)
    trainer.fit(module or regression(), DataLoader(TensorDataset(inputs, inputs.sum(1)), batch_size=4),
                ckpt_path=ckpt_path)
    return trainer


@pytest.mark.filterwarnings("ignore")
def test_a_later_fit_is_not_cut_to_an_earlier_fits_length():
    """A fit in epochs with an LR range test stops once it has trained its own steps; a later fit of the same callback
    that is bounded by max_steps alone trains all of its."""
    from hdet_scale.integrations.lightning import HDETCallback

    hdet = HDETCallback({"sync_interval": 5, "auto_lr": {"range_test": 15, "start": 5, "stop": 100}})
    assert one_device_fit(hdet, max_epochs=2).global_step == hdet.global_step == 20
    assert one_device_fit(hdet, max_epochs=-1, max_steps=40).global_step == hdet.global_step == 40


@pytest.mark.filterwarnings("ignore")
def test_a_later_fit_that_resumes_continues_the_checkpoints_hdet_state(tmp_path):
    """A fit of the same callback that resumes from a checkpoint continues its HDET state, not the fresh state of a
    run of its own (it was loaded into the earlier fit's ensemble, and the fit restarted HDET at step 0)."""
    from hdet_scale.integrations.lightning import HDETCallback

    hdet = HDETCallback({"sync_interval": 5, "auto_lr": {"range_test": 0, "start": 5, "stop": 100}})
    first = one_device_fit(hdet, max_epochs=1)
    first.save_checkpoint(tmp_path / "epoch1.ckpt")
    assert hdet.global_step == 10
    resumed = one_device_fit(hdet, max_epochs=2, ckpt_path=tmp_path / "epoch1.ckpt")
    assert resumed.global_step == hdet.global_step == 20


@pytest.mark.filterwarnings("ignore")
def test_a_fit_that_resumes_after_one_that_raised_continues_the_checkpoints_hdet_state(tmp_path):
    """Lightning calls no teardown after a fit that raised: the callback still took itself for that fit's, and a
    resume with it loaded the checkpoint's HDET state into the failed fit's ensemble (HDET restarted at step 0)."""
    from hdet_scale.integrations.lightning import HDETCallback

    hdet = HDETCallback({"sync_interval": 5, "auto_lr": {"range_test": 0, "start": 5, "stop": 100}})
    one_device_fit(hdet, max_epochs=1).save_checkpoint(tmp_path / "epoch1.ckpt")
    failing = regression()

    def fail(batch, batch_idx):
        raise RuntimeError("a node went down")

    failing.training_step = fail
    with pytest.raises(RuntimeError, match="a node went down"):
        one_device_fit(hdet, failing, max_epochs=1)
    resumed = one_device_fit(hdet, max_epochs=2, ckpt_path=tmp_path / "epoch1.ckpt")
    assert resumed.global_step == hdet.global_step == 20


@pytest.mark.filterwarnings("ignore")
def test_a_trainer_that_fits_again_after_a_fit_that_raised_during_the_range_test_trains_its_own_epochs():
    """The range test's epochs were added to the Trainer's max_epochs at the fit's start and given back only in a
    teardown, which Lightning does not run after a fit that raised: the same Trainer's next fit trained twice as
    long, and kept the lengthened max_epochs as the user's."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from hdet_scale.integrations.lightning import HDETCallback

    hdet = HDETCallback({"sync_interval": 5, "auto_lr": {"range_test": 15, "start": 5, "stop": 100}})
    inputs = torch.randn(40, 4, generator=torch.Generator().manual_seed(1))
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[hdet], max_epochs=2)
    failing = regression()

    def fail(batch, batch_idx):
        raise RuntimeError("interrupted during the range test")

    failing.training_step = fail
    with pytest.raises(RuntimeError, match="interrupted during the range test"):
        trainer.fit(failing, DataLoader(TensorDataset(inputs, inputs.sum(1)), batch_size=4))
    assert trainer.max_epochs == 2
    trainer.fit(regression(), DataLoader(TensorDataset(inputs, inputs.sum(1)), batch_size=4))
    assert trainer.global_step == hdet.global_step == 20 and trainer.max_epochs == 2


@pytest.mark.filterwarnings("ignore")
def test_a_finetuning_callback_that_adds_param_groups_later_is_refused_at_the_start():
    """BaseFinetuning adds a param group as it unfreezes, which HDET refuses at that step: hours into a run."""
    import lightning.pytorch as pl

    from hdet_scale import HDETConfigError
    from hdet_scale.integrations.lightning import HDETCallback

    class UnfreezeLater(pl.callbacks.BaseFinetuning):
        def freeze_before_training(self, pl_module):
            pass

        def finetune_function(self, pl_module, current_epoch, optimizer):
            pass

    hdet = HDETCallback({"sync_interval": 5, "auto_lr": {"range_test": 0, "start": 5, "stop": 100}})
    with pytest.raises(HDETConfigError, match="UnfreezeLater adds them as it unfreezes"):
        one_device_fit(hdet, max_epochs=1, callbacks=[UnfreezeLater()])


@pytest.mark.filterwarnings("ignore")
def test_a_later_fit_attaches_to_an_optimizer_an_earlier_fit_trained():
    """A module that keeps its optimizer returns the same one to every fit: the earlier fit's HDET lets go of it."""
    from hdet_scale.integrations.lightning import HDETCallback

    hdet = HDETCallback({"sync_interval": 5, "auto_lr": {"range_test": 0, "start": 5, "stop": 100}})
    module = regression(keeps_its_optimizer=True)
    assert one_device_fit(hdet, module, max_epochs=1).global_step == hdet.global_step == 10
    assert one_device_fit(hdet, module, max_epochs=1).global_step == hdet.global_step == 10


@pytest.mark.filterwarnings("ignore")
def test_a_replica_of_a_node_is_the_trainers_devices_without_a_torchrun_variable(monkeypatch):
    """Lightning's own launcher and srun set no LOCAL_WORLD_SIZE: ranks_per_replica 'node' (and 'auto' under
    ModelParallelStrategy) failed, asking for the launcher's variable; the Trainer's devices per node are a node."""
    from hdet_scale.integrations.lightning import HDETCallback

    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    hdet = HDETCallback({"sync_interval": 5, "ranks_per_replica": "node", "auto_lr": {"range_test": 0}})
    assert one_device_fit(hdet, max_epochs=1).global_step == hdet.global_step == 10
    assert hdet.config.ranks_per_replica == 1


def saving_when(path: Any, asks: Any) -> Any:
    """A callback, listed after HDET's, that calls ``trainer.save_checkpoint(path)`` after the first batch where
    ``asks(trainer)`` (as Lightning's SLURM requeue handler or OnExceptionCheckpoint would, at any step)."""
    import lightning.pytorch as pl

    class SaveWhenAsked(pl.Callback):
        asked = False

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if not self.asked and asks(trainer):
                self.asked = True
                trainer.save_checkpoint(path)

    return SaveWhenAsked()


def hdet_state_in(checkpoint: Any) -> dict:
    state = torch.load(checkpoint, weights_only=False)
    (key,) = [key for key in state["callbacks"] if key.startswith("HDETCallback")]
    return state["callbacks"][key]


def test_a_checkpoint_between_syncs_gets_a_sync_first(tmp_path):
    """trainer.save_checkpoint at step 7 of a run syncing every 5: the checkpoint holds the one model, right after a
    sync of its own (it held rank 0's replica, with a warning)."""
    from hdet_scale.integrations.lightning import HDETCallback

    hdet = HDETCallback({"sync_interval": 5, "auto_lr": {"range_test": 0, "start": 5, "stop": 100}})
    asker = saving_when(tmp_path / "step7.ckpt", lambda trainer: trainer.global_step == 7)
    one_device_fit(hdet, max_epochs=1, callbacks=[asker])
    state = hdet_state_in(tmp_path / "step7.ckpt")
    assert state["step"] == state["last_sync_step"] == 7


def test_no_checkpoint_is_written_during_the_range_test(tmp_path):
    """trainer.save_checkpoint during the LR range test (SLURM's requeue save, say) writes nothing and warns, and
    the run goes on (the callback's state raised, so the requeue never happened)."""
    from hdet_scale.integrations.lightning import HDETCallback
    from hdet_scale.notices import HDETWarning

    hdet = HDETCallback({"sync_interval": 5, "auto_lr": {"range_test": 15, "start": 5, "stop": 100}})
    asker = saving_when(tmp_path / "test.ckpt", lambda trainer: hdet.ramping)
    with pytest.warns(HDETWarning, match="no checkpoint is written during the LR range test"):
        trainer = one_device_fit(hdet, max_epochs=1, callbacks=[asker])
    assert asker.asked and not (tmp_path / "test.ckpt").exists()
    assert trainer.global_step == hdet.global_step == 10


def test_checkpoints_every_k_steps_between_syncs_are_refused():
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from hdet_scale.config import HDETConfigError
    from hdet_scale.integrations.lightning import HDETCallback

    def trainer_checkpointing_every(steps: int | None) -> Any:
        return pl.Trainer(accelerator="cpu", devices=1, logger=False,
                          callbacks=[ModelCheckpoint(every_n_train_steps=steps)])

    HDETCallback(sync_interval=5).setup(trainer_checkpointing_every(10), regression(), "fit")
    HDETCallback(sync_interval=5).setup(trainer_checkpointing_every(None), regression(), "fit")
    with pytest.raises(HDETConfigError, match=r"^ModelCheckpoint\(every_n_train_steps=7\) checkpoints between HDET "
                                              r"syncs \(every 5 steps\).*use a multiple of sync_interval=5"):
        HDETCallback(sync_interval=5).setup(trainer_checkpointing_every(7), regression(), "fit")


def test_a_checkpoint_a_callback_before_hdets_takes_holds_the_step_lightning_counts(tmp_path):
    """A callback listed before HDET's that saves in its on_train_batch_end saw Lightning's optimizer step taken
    and HDET's not yet: the checkpoint held HDET one step behind Lightning, and a resumed run stayed so (each later
    sync one step late)."""
    from hdet_scale.integrations.lightning import HDETCallback

    hdet = HDETCallback({"sync_interval": 5, "auto_lr": {"range_test": 0, "start": 5, "stop": 100}})
    asker = saving_when(tmp_path / "step7.ckpt", lambda trainer: trainer.global_step == 7)
    trainer = one_device_fit(hdet, max_epochs=1, callbacks_before=[asker])
    state = hdet_state_in(tmp_path / "step7.ckpt")
    assert state["step"] == state["last_sync_step"] == 7
    assert trainer.global_step == hdet.global_step == 10  # no step taken twice


@pytest.mark.filterwarnings("ignore")
def test_a_resume_from_a_checkpoint_without_hdets_state_is_refused(tmp_path):
    """Lightning restores nothing into a callback whose state the checkpoint lacks: HDET started over on the trained
    weights (warm-init noise, a new range test resetting the optimizer) at Lightning's step N."""
    import lightning.pytorch as pl

    from hdet_scale.config import HDETConfigError
    from hdet_scale.integrations.lightning import HDETCallback

    one_device_fit(pl.Callback(), max_epochs=1).save_checkpoint(tmp_path / "plain.ckpt")
    hdet = HDETCallback({"sync_interval": 5, "auto_lr": {"range_test": 0, "start": 5, "stop": 100}})
    with pytest.raises(HDETConfigError, match=r"resumes a checkpoint without HDET's state .*; resume from a "
                                              r"checkpoint taken with HDETCallback"):
        one_device_fit(hdet, max_epochs=2, ckpt_path=tmp_path / "plain.ckpt")


@pytest.mark.filterwarnings("ignore")
def test_the_range_test_runs_no_validation_leaves_the_log_steps_in_line_and_the_epochs_as_given():
    """During the range test Lightning validated the ramping replicas (EarlyStopping read those scores), its loggers
    wrote at a step the test's batches had moved past HDET's, and the epochs added for the test stayed on the
    Trainer after fit."""
    from hdet_scale.integrations.lightning import HDETCallback

    hdet = HDETCallback({"sync_interval": 5, "auto_lr": {"range_test": 15, "start": 5, "stop": 100}})
    module = regression()
    validated_while = []

    def validation_step(batch, batch_idx):
        validated_while.append(hdet.ramping)

    module.validation_step = validation_step
    from torch.utils.data import DataLoader, TensorDataset

    module.val_dataloader = lambda: DataLoader(TensorDataset(torch.randn(4, 4), torch.randn(4)), batch_size=4)
    trainer = one_device_fit(hdet, module, max_epochs=2, val_check_interval=5, num_sanity_val_steps=0)
    assert trainer.global_step == hdet.global_step == 20
    assert validated_while and not any(validated_while)  # validations after the test only
    assert trainer.fit_loop.epoch_loop._batches_that_stepped == trainer.global_step
    assert trainer.max_epochs == 2


def test_a_ddp_communication_hook_of_the_users_and_a_data_split_short_of_the_world_are_refused():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from hdet_scale.config import HDETConfigError
    from hdet_scale.integrations.lightning import check_data_parallel, check_strategy

    with pytest.raises(HDETConfigError, match=r"DDPStrategy\(ddp_comm_hook=...\) under HDETCallback: HDET sets"):
        check_strategy(DDPStrategy(ddp_comm_hook=allreduce_hook))
    check_strategy(DDPStrategy())

    def strategy_splitting_data(ways: int) -> Any:  # ModelParallelStrategy's mesh, as its setup made it
        return SimpleNamespace(device_mesh={"data_parallel": SimpleNamespace(size=lambda: ways)})

    check_data_parallel(strategy_splitting_data(4), 4)
    with pytest.raises(HDETConfigError, match=r"splits the data 1 ways .* over 4 ranks.*pass "
                                              r"ModelParallelStrategy\(data_parallel_size=4, tensor_parallel_size=1\)"):
        check_data_parallel(strategy_splitting_data(1), 4)


@pytest.mark.filterwarnings("ignore")
def test_lightnings_slurm_requeue_saves_at_the_end_of_the_step_not_inside_its_signal_handler(tmp_path, monkeypatch):
    """Lightning's SLURM auto-requeue ran its save from inside its signal handler, wherever each rank was (here in
    the middle of a training step, before its backward): HDET's sync ran there. The signal is now noted and the
    handler runs at the step's end, where every rank agrees on it; the requeue still follows the save."""
    import os
    import signal

    from hdet_scale.integrations.lightning import HDETCallback

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    requeued = tmp_path / "requeued"
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {requeued}\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    for name, value in {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "hdet-test", "SLURM_JOB_ID": "4242",
                        "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
                        "SLURM_NODELIST": "localhost"}.items():
        monkeypatch.setenv(name, value)
    hdet = HDETCallback({"sync_interval": 5, "auto_lr": {"range_test": 0, "start": 5, "stop": 100}})
    module = regression()
    training_step = module.training_step

    def signalled_in_step_7(batch, batch_idx):
        loss = training_step(batch, batch_idx)
        if module.trainer.global_step == 7 and not requeued.exists():
            os.kill(os.getpid(), signal.SIGUSR1)  # Slurm's --signal=USR1@T, in the middle of the step
        return loss

    module.training_step = signalled_in_step_7
    one_device_fit(hdet, module, max_epochs=1, default_root_dir=tmp_path)
    saved = torch.load(tmp_path / "hpc_ckpt_1.ckpt", weights_only=False)
    state = hdet_state_in(tmp_path / "hpc_ckpt_1.ckpt")
    assert saved["global_step"] == state["step"] == state["last_sync_step"] == 8  # the step's end, one model
    assert requeued.read_text() == "requeue 4242\n"


@pytest.mark.filterwarnings("ignore")
def test_a_skipped_optimizer_step_is_recorded_at_its_own_base_not_the_next(tmp_path):
    """Lightning steps its schedulers after the optimizer step, also one an AMP scaler skipped (no optimizer.step()
    call, so no base recorded there), and before the batch's end, where HDET steps: that step was recorded at the
    next step's LR, and a replay ran one value early there. The precision plugin here skips the second step as
    Lightning's mixed precision does on an overflow (the closure and its hooks run, ``optimizer.step`` does not)."""
    import json

    from lightning.pytorch.plugins.precision import Precision

    from hdet_scale.integrations.lightning import HDETCallback

    scheduled = []

    class SkipsTheSecondStep(Precision):
        def optimizer_step(self, optimizer, model, closure, **kwargs):
            scheduled.append(optimizer.param_groups[0]["lr"])
            if len(scheduled) != 2:
                return super().optimizer_step(optimizer, model, closure, **kwargs)
            result = closure()
            self._after_closure(model, optimizer)
            return result

    module = regression()

    def configure_optimizers():
        optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
        decay = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "step"}}

    module.configure_optimizers = configure_optimizers
    metrics = tmp_path / "metrics.jsonl"
    hdet = HDETCallback({"sync_interval": 3, "metrics_path": str(metrics),
                         "auto_lr": {"enabled": False, "range_test": 0}})
    one_device_fit(hdet, module, max_epochs=1, limit_train_batches=3, plugins=[SkipsTheSecondStep()])
    assert len(set(scheduled)) == 3
    line = json.loads(metrics.read_text().splitlines()[-1])
    assert line["step"] == 3 and line["values"]["lr/0"]["applied_bases"] == pytest.approx(scheduled)
