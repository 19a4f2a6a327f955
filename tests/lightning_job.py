"""A Lightning run with HDETCallback for tests/e2e/test_lightning_e2e.py, launched under torchrun on CPU ranks.

    torchrun --nproc_per_node 4 tests/lightning_job.py --out DIR --mode global --ranks_per_replica 1 --epochs 2
    torchrun --nproc_per_node 4 tests/lightning_job.py --jobs JOBS.json

The second form runs each job of JOBS.json (a list of argument lists) in turn in one launch: importing Lightning costs
each rank seconds, more than a job's fit. Each rank writes its output of a job to ``DIR/log.<rank>.txt``.

A small regression model, AdamW, 10 batches per rank per epoch, HDET syncing every 5 optimizer steps. Rank 0
writes ``DIR/record.pt``: every rank's flat parameters after each optimizer step (after HDET's step, so after a
sync on sync steps) and just before each sync, each rank's micro-batch losses as training_step computed them,
and the final parameters. Checkpoints go to ``DIR/checkpoints`` (``epoch=E-step=S.ckpt`` at every epoch end, and
``last.ckpt``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import parameters_to_vector
from torch.utils.data import DataLoader, TensorDataset

from hdet_scale.comm import shut_down_and_exit
from hdet_scale.integrations.lightning import HDETCallback, shard
from hdet_scale.probe import batch_probe

SYNC_INTERVAL = 5
BATCHES_PER_EPOCH = 10


class Scale(nn.Module):
    """A float ``scaling`` on the output, as transformers attention modules have one: HDET's attention_scale knob
    explores it (--explore_scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.scaling = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scaling


class Regression(pl.LightningModule):
    def __init__(self, sharded: bool = False, probe: bool = False, coupled_decay: bool = False) -> None:
        super().__init__()
        self.sharded = sharded
        self.probe = probe
        self.coupled_decay = coupled_decay
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1), Scale())
        self.losses: list[float] = []
        self.validated: list[tuple[int, torch.Tensor]] = []

    def loss(self, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return (self.net(inputs).squeeze(1) - targets).pow(2).mean()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """With a validation loader (--validate): every rank's parameters at each validation's first batch."""
        if batch_idx == 0:
            self.validated.append((self.trainer.global_step, rows(self)))

    def on_fit_start(self) -> None:
        """With --probe: docs/engines.md's way to give HDETCallback a probe (this runs after the callback's)."""
        if self.probe:
            hdet = next(callback for callback in self.trainer.callbacks if isinstance(callback, HDETCallback))
            hdet.ensemble.set_probe(batch_probe(self.trainer.strategy.model, held_out_batch(),
                                                lambda _, batch: self.loss(batch)))

    def configure_model(self) -> None:
        if self.sharded:
            self.net = shard(self, self.net, block_classes=[nn.Linear])

    def configure_optimizers(self) -> Any:
        # --coupled_decay: Adam adds the weight decay to the gradient, so each replica's moments are its own
        optimizer = torch.optim.Adam(self.parameters(), lr=0.02, weight_decay=0.1) if self.coupled_decay \
            else torch.optim.AdamW(self.parameters(), lr=0.02)
        return {"optimizer": optimizer, "lr_scheduler": {
            "scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.05 * s)),
            "interval": "step"}}


class Recorder(pl.Callback):
    """Gathers every rank's parameters after each optimizer step and before each sync (listed after HDET's
    callback, so its hooks run after HDET's)."""

    def __init__(self, hdet: HDETCallback) -> None:
        self.hdet = hdet
        self.after: dict[int, torch.Tensor] = {}
        self.before_sync: dict[int, torch.Tensor] = {}
        self.held_out_before_sync: dict[int, list[float]] = {}
        self._last_step = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.hdet.ensemble.add_pre_sync_hook(lambda step: self.before_sync.__setitem__(step, rows(pl_module)))
        self.hdet.ensemble.add_pre_sync_hook(lambda step: self.held_out_before_sync.__setitem__(
            step, held_out_losses(pl_module)))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = self.hdet.ensemble.global_step
        if step != self._last_step:
            self._last_step = step
            self.after[step] = rows(pl_module)


def held_out_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The same 16 samples on every rank."""
    inputs = torch.randn(16, 8, generator=torch.Generator().manual_seed(7))
    return inputs, inputs.sum(1).sin()


def held_out_losses(module: Regression) -> list[float]:
    """Every rank's loss on ``held_out_batch`` (a collective), in eval mode and without gradients, as a probe."""
    module.eval()
    with torch.no_grad():
        loss = float(module.loss(held_out_batch()))
    module.train()
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, loss)
    return losses


def rows(module: nn.Module) -> torch.Tensor:
    """Every rank's flat (full, unsharded) parameters, one row per rank (a collective)."""
    flat = parameters_to_vector([param.full_tensor() if isinstance(param, DTensor) else param
                                 for param in module.parameters()]).detach()
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return torch.stack(gathered)


@contextlib.contextmanager
def output_into(path: Path) -> Iterator[None]:
    """This process's stdout and stderr (its file descriptors: Lightning's logging and warnings too) go to
    ``path`` inside the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in enumerate(saved, start=1):
            os.dup2(copy, fd)
            os.close(copy)


def run_each(parser: argparse.ArgumentParser, fit: Callable[[argparse.Namespace], None]) -> None:
    """``fit`` for the command line's arguments, or for each job of ``--jobs FILE`` in turn, each rank's output of a
    job in ``OUT/log.<rank>.txt``; then shuts the process group down."""
    given = sys.argv[1:]
    jobs = json.loads(Path(given[1]).read_text()) if given[:1] == ["--jobs"] and len(given) == 2 else [given]
    for job in jobs:
        args = parser.parse_args(job)
        args.out.mkdir(parents=True, exist_ok=True)
        with output_into(args.out / f"log.{os.environ['RANK']}.txt"):
            fit(args)
    shut_down_and_exit()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", default="global")
    parser.add_argument("--ranks_per_replica", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--strategy", choices=("ddp", "model_parallel"), default="ddp")
    parser.add_argument("--probe", action="store_true", help="a probe set in the module's on_fit_start")
    parser.add_argument("--sync_interval", type=int, default=SYNC_INTERVAL)
    parser.add_argument("--validate", action="store_true", help="validate at every epoch end")
    parser.add_argument("--coupled_decay", action="store_true", help="Adam with weight decay instead of AdamW")
    parser.add_argument("--explore_scale", action="store_true", help="explore the output's scaling (local mode)")
    run_each(parser, fit)


def fit(args: argparse.Namespace) -> None:
    """One job: a fit of ``args``, its record written by rank 0."""
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    world = int(os.environ["WORLD_SIZE"])
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(world * BATCHES_PER_EPOCH * 4, 8, generator=generator)
    data = TensorDataset(inputs, inputs.sum(1).sin())
    hdet = HDETCallback({"alpha": 0.5, "sync_interval": args.sync_interval, "gradient_mode": args.mode,
                         "ranks_per_replica": args.ranks_per_replica, "metrics_path": str(args.out / "hdet.jsonl"),
                         # one run whatever --epochs (no shares of the run); the probe scores the last iterate
                         "auto_lr": {"start": args.sync_interval, "stop": 100, "mode": "log", "sigma": 1.0,
                                     "average_window": 0, "range_test": 0},
                         **({"explore": {"attention_scale": {"alpha": 0.5}}} if args.explore_scale else {})})
    recorder = Recorder(hdet)
    checkpoints = ModelCheckpoint(dirpath=args.out / "checkpoints", save_last=True, save_top_k=-1)
    # Lightning's mesh only splits the data here (every rank its own batches); HDET shards inside its replicas.
    strategy = "ddp" if args.strategy == "ddp" else ModelParallelStrategy(data_parallel_size=world,
                                                                           tensor_parallel_size=1)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=args.epochs,
                         accumulate_grad_batches=args.accumulate, callbacks=[hdet, recorder, checkpoints],
                         logger=CSVLogger(args.out, name="csv", version=0), enable_progress_bar=False,
                         enable_model_summary=False)
    module = Regression(sharded=args.strategy == "model_parallel", probe=args.probe,
                        coupled_decay=args.coupled_decay)
    validation = DataLoader(TensorDataset(*held_out_batch()), batch_size=4) if args.validate else None
    trainer.fit(module, DataLoader(data, batch_size=4), validation, ckpt_path=args.resume)
    losses = [None] * world
    dist.all_gather_object(losses, module.losses)
    final = rows(module)
    scalings = [None] * world  # each rank's output scaling after fit(): what validate() or test() would score with
    dist.all_gather_object(scalings, module.net[-1].scaling)
    if trainer.global_rank == 0:
        torch.save({"after": recorder.after, "before_sync": recorder.before_sync, "losses": losses, "final": final,
                    "hdet_step": hdet.ensemble.global_step, "held_out_before_sync": recorder.held_out_before_sync,
                    "validated": module.validated, "scalings": scalings,
                    "scale_found": hdet.ensemble.base("attention_scale") if args.explore_scale else None},
                   args.out / "record.pt")


if __name__ == "__main__":
    main()
