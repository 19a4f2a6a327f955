"""A Lightning run that starts with an LR range test, for tests/e2e/test_lightning_e2e.py (torchrun, CPU ranks).

    torchrun --nproc_per_node 2 tests/lightning_range_job.py --out DIR --epochs 2 --checkpoint_every 5

or with ``--jobs JOBS.json``, several jobs in one launch, as lightning_job.py runs them.

lightning_job.py's regression module and data (10 batches per rank per epoch, AdamW with a LambdaLR stepped every
step), HDET with ``auto_lr.range_test`` and every rank a replica. Rank 0 writes ``DIR/record.pt``: for every
optimizer step on every rank, whether it was the test's, the LR it trained with and the scheduler's LR; Lightning's
``global_step`` after each; every rank's weights before training, before the test's last step and at the run's
first step; and the step of each checkpoint saved. Checkpoints go to ``DIR/checkpoints`` (``--ask_saves``: also
``DIR/asked.ckpt``, with every rank's weights right after it).
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_job import BATCHES_PER_EPOCH, Regression, rows, run_each
from torch.utils.data import DataLoader, TensorDataset

from hdet_scale.integrations.lightning import HDETCallback

SYNC_INTERVAL = 5


class RangeRecorder(pl.Callback):
    """Listed after HDET's callback: its hooks run after HDET's."""

    def __init__(self, hdet: HDETCallback) -> None:
        self.hdet = hdet
        self.steps: list[tuple[bool, float, float]] = []
        self.global_steps: list[int] = []
        self.saves: list[tuple[int, bool]] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.run_start: dict[str, Any] = {}
        self.max_epochs_in_fit: int | None = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.max_epochs_in_fit = trainer.max_epochs

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        config = trainer.lr_scheduler_configs[0]
        # A pre-hook registered after HDET's sees the LR this replica's step trains with.
        self.hdet.ensemble.adapter.optimizer.register_step_pre_hook(lambda optimizer, *_: self.steps.append(
            (self.hdet.ramping, optimizer.param_groups[0]["lr"], config.scheduler.get_last_lr()[0])))
        self.weights["first"] = rows(pl_module)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.hdet.ramping:
            self.weights["test"] = rows(pl_module)  # the last one: moved by every test step but the last
        elif not self.run_start:
            optimizer = self.hdet.ensemble.adapter.optimizer
            self.weights["run_start"] = rows(pl_module)
            self.run_start = {"value": self.hdet.value("lr/0"),
                              "fresh_optimizer": all(not torch.is_tensor(value) or not value.any()
                                                     for state in optimizer.state.values()
                                                     for value in state.values())}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.global_steps.append(trainer.global_step)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        self.saves.append((trainer.global_step, self.hdet.ramping))


class AskToSave(pl.Callback):
    """Listed after HDET's callback: calls ``trainer.save_checkpoint`` on the test's third batch and at the run's
    step ``ASKED_STEP`` (between syncs), as Lightning's SLURM requeue handler would, and takes every rank's weights
    right after the second."""

    def __init__(self, hdet: HDETCallback, out: Path) -> None:
        self.hdet, self.out = hdet, out
        self.test_batches = 0
        self.weights: torch.Tensor | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.hdet.ramping:
            self.test_batches += 1
            if self.test_batches == 3:
                trainer.save_checkpoint(self.out / "asked_in_test.ckpt")
        elif trainer.global_step == ASKED_STEP and self.weights is None:
            trainer.save_checkpoint(self.out / "asked.ckpt")
            self.weights = rows(pl_module)


ASKED_STEP = 7


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--range_test", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--max_steps", type=int, default=-1)
    parser.add_argument("--checkpoint_every", type=int, default=None, help="ModelCheckpoint every n train steps")
    parser.add_argument("--ask_saves", action="store_true", help="ask for checkpoints in the test and between syncs")
    run_each(parser, fit)


def fit(args: argparse.Namespace) -> None:
    """One job: a fit of ``args``, its record written by rank 0."""
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    world = int(os.environ["WORLD_SIZE"])
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(world * BATCHES_PER_EPOCH * 4, 8, generator=generator)
    data = TensorDataset(inputs, inputs.sum(1).sin())
    hdet = HDETCallback({"alpha": 0.5, "spread": "linear", "sync_interval": SYNC_INTERVAL,
                         "metrics_path": str(args.out / "hdet.jsonl"),
                         "auto_lr": {"start": SYNC_INTERVAL, "stop": 100, "mode": "log", "sigma": 1.0,
                                     "average_window": 0, "range_test": args.range_test}})
    recorder = RangeRecorder(hdet)
    callbacks: list[pl.Callback] = [hdet, recorder]
    asker = AskToSave(hdet, args.out)
    if args.ask_saves:
        callbacks.append(asker)
    if args.checkpoint_every:
        callbacks.append(ModelCheckpoint(dirpath=args.out / "checkpoints", every_n_train_steps=args.checkpoint_every,
                                         save_top_k=-1))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_epochs=args.epochs,
                         max_steps=args.max_steps, callbacks=callbacks, logger=False,
                         enable_checkpointing=bool(args.checkpoint_every), enable_progress_bar=False,
                         enable_model_summary=False)
    module = Regression()
    trainer.fit(module, DataLoader(data, batch_size=4))
    steps: list = [None] * world
    dist.all_gather_object(steps, recorder.steps)
    if trainer.global_rank == 0:
        torch.save({"steps": steps, "global_steps": recorder.global_steps, "saves": recorder.saves,
                    "weights": recorder.weights, "run_start": recorder.run_start,
                    "hdet_step": hdet.ensemble.global_step, "trainer_step": trainer.global_step,
                    "pick": hdet.ensemble.range_test_pick, "max_epochs": recorder.max_epochs_in_fit,
                    "max_epochs_after": trainer.max_epochs,
                    "asked_weights": asker.weights}, args.out / "record.pt")


if __name__ == "__main__":
    main()
