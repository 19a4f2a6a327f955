"""The two engines ``hdet_scale.lm.train`` runs on, behind one small interface.

Each backend owns the model, optimizer, LR schedule and HDET handle of one engine and answers what the
training loop needs: one optimizer step over a list of micro-batches, a forward-only loss, the scheduled
LR, an early sync, checkpoints and the final export. Everything HDET does stays in the engine adapters.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from hdet_scale.comm import on_rank0
from hdet_scale.config import HDETConfig
from hdet_scale.ensemble import HDETEnsemble
from hdet_scale.lm.checkpoints import deepspeed_tag, latest_tag, point_latest, remove_unused, write_manifest
from hdet_scale.lm.model import next_token_loss
from hdet_scale.metrics import SyncReport
from hdet_scale.schedule import ReplaySchedule
from hdet_scale.topology import ReplicaTopology

Batch = tuple[torch.Tensor, torch.Tensor]


def warmup_cosine(total_steps: int, warmup_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """The LR factor at a step: linear warm-up to 1 over ``warmup_steps``, then a cosine down to
    ``min_lr_ratio`` at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def base_schedule(optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> LRScheduler:
    """train.py's schedule: the replayed one (``--replay_schedule``), else warm-up + cosine."""
    if args.replay_schedule:
        return ReplaySchedule(optimizer, args.replay_schedule)
    return LambdaLR(optimizer, warmup_cosine(args.steps, args.warmup_steps, args.min_lr_ratio))


def adamw(parameters: Any, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW with the usual LLM-pretraining betas (0.9, 0.95)."""
    return torch.optim.AdamW(parameters, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)


class Backend(ABC):
    """One engine's model, optimizer, schedule and HDET handle."""

    ensemble: HDETEnsemble
    topology: ReplicaTopology
    device: torch.device

    @property
    @abstractmethod
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step on each rank (gradient accumulation)."""

    @property
    @abstractmethod
    def micro_batch_size(self) -> int:
        """Sequences per micro-batch on each rank."""

    @abstractmethod
    def forward_backward(self, batch: Batch, *, index: int, of: int) -> torch.Tensor:
        """Forward and backward on micro-batch ``index`` of ``of`` in this optimizer step; returns its loss (a
        detached tensor on the device, not synchronized)."""

    @abstractmethod
    def optimizer_step(self, losses: list[torch.Tensor]) -> SyncReport | None:
        """The optimizer's and the LR schedule's step after the micro-batches, then HDET's step with their
        ``losses``; returns the sync report when HDET synced at this step."""

    @abstractmethod
    def sync(self) -> SyncReport:
        """An HDET sync now, between the regular ones (collective)."""

    @abstractmethod
    def loss(self, batch: Batch) -> torch.Tensor:
        """The loss of ``batch`` without gradients (collective under sharding: every rank calls it)."""

    @abstractmethod
    def train(self, mode: bool) -> None:
        """Training or evaluation mode."""

    @property
    @abstractmethod
    def module(self) -> nn.Module:
        """What a forward pass runs: the wrapped model (FSDP2) or the engine (DeepSpeed)."""

    @abstractmethod
    def save(self, directory: Path, extra: Mapping[str, Any], run: Mapping[str, Any]) -> Path:
        """A checkpoint at a sync point in ``directory`` (collective), with ``run`` (what made it) in its
        manifest, written once every file is complete; returns where it went."""

    @abstractmethod
    def load(self, path: Path) -> dict[str, Any]:
        """Restores the checkpoint at ``path`` (replica r takes saved replica r mod n's optimizer state, n the
        number of replicas that saved theirs) and returns its ``extra``."""

    def label_smoothing(self) -> float:
        """This replica's label smoothing when HDET explores it, else none."""
        return self.ensemble.value("label_smoothing") if self.ensemble.explores("label_smoothing") else 0.0

    @abstractmethod
    def export(self, path: Path) -> None:
        """Writes the one model of the ensemble for transformers' ``from_pretrained`` (collective, at a sync
        point)."""


# ------------------------------------------------------------------------------------------ FSDP2
class FSDPBackend(Backend):
    """FSDP2 under torchrun: each replica shards the model over its ranks (``fully_shard`` per block)."""

    CHECKPOINT = "latest"

    def __init__(self, model: nn.Module, config: HDETConfig, args: argparse.Namespace, device: torch.device) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from hdet_scale.engines import fsdp

        self.device = device
        self.args = args
        policy = None
        if args.dtype == "bf16":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        self.model, self.hdet = fsdp.wrap(model.to(device), config, mp_policy=policy, device_type=device.type)
        self.optimizer = adamw(self.model.parameters(), args)
        self.ensemble = self.hdet.attach(self.optimizer, total_steps=args.steps)
        self.topology = self.hdet.topology
        self.scheduler = base_schedule(self.optimizer, args)

    @property
    def micro_batches(self) -> int:
        return self.args.grad_accum

    @property
    def micro_batch_size(self) -> int:
        return self.args.micro_batch_size

    def forward_backward(self, batch: Batch, *, index: int, of: int) -> torch.Tensor:
        if index == 0:
            self.optimizer.zero_grad(set_to_none=True)
        # Gradients are reduced (and averaged across replicas in global mode) once, on the last micro-batch.
        self.model.set_requires_gradient_sync(index == of - 1)
        loss = next_token_loss(self.model, batch[0].to(self.device), batch[1].to(self.device),
                               label_smoothing=self.label_smoothing())
        (loss / of).backward()
        return loss.detach()

    def optimizer_step(self, losses: list[torch.Tensor]) -> SyncReport | None:
        if self.args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.grad_clip)
        self.optimizer.step()
        if not self.ensemble.ramping:  # an LR range test holds the schedule: the run starts again after it
            self.scheduler.step()
        return self.hdet.step(losses)

    def sync(self) -> SyncReport:
        return self.ensemble.sync()

    @torch.no_grad()
    def loss(self, batch: Batch) -> torch.Tensor:
        return next_token_loss(self.model, batch[0].to(self.device), batch[1].to(self.device))

    def train(self, mode: bool) -> None:
        self.model.train(mode)

    @property
    def module(self) -> nn.Module:
        return self.model

    def save(self, directory: Path, extra: Mapping[str, Any], run: Mapping[str, Any]) -> Path:
        from hdet_scale.engines.fsdp_checkpoint import save_checkpoint

        path = directory / self.CHECKPOINT
        step = self.ensemble.global_step
        save_checkpoint(path, self.model, self.optimizer, self.hdet,
                        extra_state={**extra, "scheduler": self.scheduler.state_dict()},
                        finalize=lambda complete: write_manifest(complete, dict(run), step))
        return path

    def load(self, path: Path) -> dict[str, Any]:
        from hdet_scale.engines.fsdp_checkpoint import load_checkpoint

        extra = load_checkpoint(path, self.model, self.optimizer, self.hdet)
        self.scheduler.load_state_dict(extra.pop("scheduler"))
        return extra

    def export(self, path: Path) -> None:
        from hdet_scale.engines.fsdp_checkpoint import save_pretrained

        if self.device.type == "cpu":
            # transformers' save_pretrained imports DeepSpeed (through accelerate) when it is installed, which
            # then warns that it found no GPU: on this path DeepSpeed is not used, and the CPU is no surprise.
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        save_pretrained(self.model, path)


# -------------------------------------------------------------------------------------- DeepSpeed
class DeepSpeedBackend(Backend):
    """DeepSpeed ZeRO 0-3 under the deepspeed launcher; the JSON's optimizer and scheduler win over
    train.py's AdamW and warm-up + cosine."""

    def __init__(self, model: nn.Module, config: HDETConfig, args: argparse.Namespace,
                 ds_config: dict[str, Any], device: torch.device) -> None:
        from hdet_scale.engines import deepspeed as hdet_deepspeed

        # DeepSpeed calls collectives torch has deprecated, warning at every step: not the user's business.
        deprecated = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
        warnings.filterwarnings("ignore", message=deprecated, category=FutureWarning)

        self.device = device
        self.args = args
        optimizer = None if "optimizer" in ds_config else adamw(model.parameters(), args)
        schedule = None
        if "scheduler" not in ds_config:
            schedule = lambda built: base_schedule(built, args)  # noqa: E731 (DeepSpeed calls it with its optimizer)
        launch_args = argparse.Namespace(**{**vars(args), "deepspeed_config": None, "hdet_config": None})
        self.engine, _, _, _ = hdet_deepspeed.initialize(
            args=launch_args, model=model, optimizer=optimizer,
            model_parameters=model.parameters() if optimizer is None else None, lr_scheduler=schedule,
            config=ds_config, hdet_config=config, total_steps=args.steps)
        self.hdet = self.engine.hdet
        self.ensemble = self.hdet.ensemble
        self.topology = self.hdet.topology

    @property
    def micro_batches(self) -> int:
        return int(self.engine.gradient_accumulation_steps())

    @property
    def micro_batch_size(self) -> int:
        return int(self.engine.train_micro_batch_size_per_gpu())

    def forward_backward(self, batch: Batch, *, index: int, of: int) -> torch.Tensor:
        # DeepSpeed scales the loss by its accumulation steps itself, and steps (and HDET with it) on the last
        loss = next_token_loss(self.engine, batch[0].to(self.device), batch[1].to(self.device),
                               label_smoothing=self.label_smoothing())
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    def optimizer_step(self, losses: list[torch.Tensor]) -> SyncReport | None:
        return self.hdet.last_report if self.hdet.synced else None  # engine.step() stepped HDET on the last

    def sync(self) -> SyncReport:
        return self.hdet.sync()

    @torch.no_grad()
    def loss(self, batch: Batch) -> torch.Tensor:
        return next_token_loss(self.engine, batch[0].to(self.device), batch[1].to(self.device))

    def train(self, mode: bool) -> None:
        self.engine.train(mode)

    @property
    def module(self) -> nn.Module:
        return self.engine

    def save(self, directory: Path, extra: Mapping[str, Any], run: Mapping[str, Any]) -> Path:
        tag = deepspeed_tag(self.ensemble.global_step)
        # On the disk when it returns; 'latest' is written here, after the manifest, so it never names a checkpoint
        # without one.
        self.hdet.save_checkpoint(directory, tag=tag, client_state={"train": dict(extra)}, save_latest=False)

        def complete() -> None:  # rank 0's reading of the files alone: a rank failing to read leaves none waiting
            previous = latest_tag(directory)
            write_manifest(directory / tag, dict(run), self.ensemble.global_step)
            point_latest(directory, tag)
            if previous not in (None, tag):
                refused = remove_unused(directory / previous)  # the new checkpoint is complete: the run goes on
                if refused:
                    print(refused, file=sys.stderr, flush=True)

        on_rank0(complete, f"writing the checkpoint {directory / tag}")
        return directory / tag

    def load(self, path: Path) -> dict[str, Any]:
        _, client_state = self.hdet.load_checkpoint(path.parent, tag=path.name)
        return dict(client_state.get("train", {}))

    def export(self, path: Path) -> None:
        self.hdet.save_pretrained(path)

