"""The overhead benchmark's variants: the model, the baseline and HDET training loops of each engine (plain DDP,
FSDP2, DeepSpeed ZeRO), and the settings every rank shares. See ``overhead.py`` for what is measured."""

# No ``from __future__ import annotations``: DDP checks a comm hook's annotations against the real classes.
import dataclasses
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import with_measured_defaults
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from hdet_scale import HDETConfig, HDETEnsemble, ReplicaTopology, SyncReport
from hdet_scale.config import AutoLRConfig
from hdet_scale.engines import ddp, fsdp

LR = 1e-3  # AdamW's LR in every variant
DEFAULT_CONTROLLER = {**dataclasses.asdict(AutoLRConfig(range_test=0).filled()), "start": 0, "stop": 10**9}
"""The library's controller (``AutoLRConfig()`` without the range test, which holds the LR) moving at every sync and
never holding: the most a sync's signal costs (its times are shares of a run; here the run has no set length)."""
SIGNALS: dict[str, dict[str, Any]] = {"probe": {}, "averaged": {"average_window": 0.5},
                                      "default": DEFAULT_CONTROLLER}
"""Controller signals whose cost is measured, each with a probe batch scoring the replicas at every sync (global
gradient mode): the probe alone on the last iterate (one forward per sync), the probe scoring each replica's
weights averaged over the last half of the interval (one more copy of this rank's local parameters, an in-place
update per step inside the window), and the library's default controller (the ``log`` controller on weights
averaged over the last quarter of the interval). Results recorded earlier also hold ``displacement`` and
``progress``, signals since removed from the library."""


@dataclass(frozen=True)
class Settings:
    """Everything a rank needs to run the benchmark (picklable for the spawned processes)."""

    engine: str
    stages: tuple[int, ...]  # the ZeRO stages of a DeepSpeed run, else empty
    ranks: int
    ranks_per_replica: int
    backend: str
    steps: int
    block: int
    sync_intervals: tuple[int, ...]
    bucket_mbs: tuple[float, ...]
    sync_reps: int
    hook_reps: int
    width: int
    depth: int
    batch: int
    out: str
    quick: bool
    note: str
    command: str


# ----------------------------------------------------------------------------------------------- model
class ResidualMLP(nn.Module):
    """Pre-norm residual MLP blocks (LayerNorm, 4x expansion, GELU) and a linear classifier head."""

    def __init__(self, width: int, depth: int, classes: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def build_model(settings: Settings, device: torch.device) -> ResidualMLP:
    """The same initial weights for every variant."""
    torch.manual_seed(0)
    return ResidualMLP(settings.width, settings.depth).to(device)


def hdet_config(settings: Settings, sync_interval: int, *, gradient_mode: str = "global",
                bucket_mb: float = 25.0, auto_lr: dict[str, Any] | None = None) -> HDETConfig:
    """Paper spread, no metrics file, and the controller updating at every sync (its worst case); ``auto_lr``
    adds controller settings (a signal)."""
    return HDETConfig.from_dict(with_measured_defaults(
        {"sync_interval": sync_interval, "gradient_mode": gradient_mode, "bucket_mb": bucket_mb,
         "ranks_per_replica": settings.ranks_per_replica, "auto_lr": {"start": 0, **(auto_lr or {})}}))


# ---------------------------------------------------------------------------------------------- clock
class Clock:
    """Wall-clock seconds that include the device's queued work (a CUDA sync under nccl)."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


# ------------------------------------------------------------------------------------------ trainers
@dataclass
class Trainer:
    """One variant of the training loop with its own model, optimizer and (optionally) HDET.

    ``optimizer`` is the torch optimizer that HDET's LR hooks wrap.
    """

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    hdet: HDETEnsemble | None
    clock: Clock
    step_seconds: list[float] = field(default_factory=list)
    hdet_seconds: list[float] = field(default_factory=list)
    sync_steps: list[int] = field(default_factory=list)
    reports: list[SyncReport] = field(default_factory=list)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        start = self.clock()
        loss = F.cross_entropy(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        if self.hdet is not None:
            before = time.perf_counter()
            report = self.hdet.step(loss)
            self.record_hdet_step(time.perf_counter() - before, report)
        self.step_seconds.append(self.clock() - start)

    def record_hdet_step(self, seconds: float, report: SyncReport | None) -> None:
        """Books one ``hdet.step`` call of the step being timed."""
        self.hdet_seconds.append(seconds)
        if report is not None:
            self.sync_steps.append(len(self.step_seconds))
            self.reports.append(report)


@dataclass
class DeepSpeedTrainer(Trainer):
    """DeepSpeed's own loop; ``model`` is the DeepSpeed engine, and with HDET attached its ``hdet.step`` runs
    inside ``engine.step()``, so the ensemble's ``step`` is wrapped to time it there."""

    def __post_init__(self) -> None:
        if self.hdet is None:
            return
        untimed_step = self.hdet.step

        def timed_step(*args: Any, **kwargs: Any) -> SyncReport | None:
            before = time.perf_counter()
            report = untimed_step(*args, **kwargs)
            self.record_hdet_step(time.perf_counter() - before, report)
            return report

        self.hdet.step = timed_step  # type: ignore[method-assign]

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        start = self.clock()
        loss = F.cross_entropy(self.model(x), y)
        self.model.backward(loss)
        self.model.step()
        self.step_seconds.append(self.clock() - start)


@dataclass
class SameLayoutDeepSpeedTrainer(DeepSpeedTrainer):
    """DeepSpeed's own loop on an engine whose data-parallel group is a replica: DeepSpeed reads the
    model-parallel unit process-wide during backward and step, so it is set around them as HDET's engine does."""

    mpu: Any = None

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        from hdet_scale.engines.deepspeed import replica_groups

        with replica_groups(self.mpu):
            super().train_step(x, y)


# ------------------------------------------------------------------------------------------- engines
def counting_hook(state: list[int], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook that counts the gradient bytes it all-reduces."""
    state[0] += bucket.buffer().numel() * bucket.buffer().element_size()
    return default_hooks.allreduce_hook(None, bucket)


class Engine(ABC):
    """Builds the variants of one training engine: the baseline and HDET trainers, each from a fresh model."""

    title = ""
    baseline = ""
    part = ""
    """Names this engine's part of the results when one run measures several (DeepSpeed's ZeRO stages)."""
    gradient_average_in_hot_path = False
    """Whether HDET itself all-reduces the gradients across replicas every step in global mode, where the
    baseline's engine reduces gradients over all ranks in its own way."""
    refreshes_copies = False
    """Whether the engine rewrites copies of the parameters from the averaged master after a sync (ZeRO's
    low-precision parameters and their gathering inside the replica), timed apart in section 2."""

    def __init__(self, settings: Settings, device: torch.device) -> None:
        self.settings = settings
        self.device = device
        self.clock = Clock(device)

    @abstractmethod
    def plain_trainer(self) -> Trainer: ...

    @abstractmethod
    def hdet_trainer(self, name: str, config: HDETConfig) -> Trainer: ...

    def same_layout_trainer(self) -> Trainer | None:
        """Training with HDET's layout (ranks, groups, collectives) and none of HDET's own work, where that
        layout differs from the baseline's; None where the baseline has it already (DDP, FSDP2's HSDP)."""
        return None

    def signal_trainer(self, name: str, sync_interval: int, signal: str) -> Trainer:
        """HDET with the controller signal ``signal`` (a key of ``SIGNALS``) and a probe: the loss on one fixed
        batch, the same on every replica."""
        trainer = self.hdet_trainer(name, hdet_config(self.settings, sync_interval, auto_lr=SIGNALS[signal]))
        generator = torch.Generator().manual_seed(4000)
        x = torch.randn(self.settings.batch, self.settings.width, generator=generator).to(self.device)
        y = torch.randint(0, 16, (self.settings.batch,), generator=generator).to(self.device)
        trainer.hdet.set_probe(lambda: F.cross_entropy(trainer.model(x), y))
        return trainer

    @abstractmethod
    def counting(self) -> tuple[Trainer, Callable[[], int]]:
        """A trainer in global gradient mode and a function that reads the bytes of gradients this rank has
        all-reduced across replicas so far."""


Attach = Callable[[torch.optim.Optimizer], HDETEnsemble]


class ModuleEngine(Engine):
    """An engine that wraps the model and leaves the optimizer to the training loop (DDP, FSDP2)."""

    @abstractmethod
    def plain(self, model: nn.Module) -> nn.Module: ...

    @abstractmethod
    def hdet(self, model: nn.Module, config: HDETConfig) -> tuple[nn.Module, Attach]:
        """The model wrapped for HDET and the function that attaches HDET to its optimizer."""

    def plain_trainer(self) -> Trainer:
        model = self.plain(build_model(self.settings, self.device))
        return Trainer("plain", model, torch.optim.AdamW(model.parameters(), lr=LR), None, self.clock)

    def hdet_trainer(self, name: str, config: HDETConfig) -> Trainer:
        model, attach = self.hdet(build_model(self.settings, self.device), config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        return Trainer(name, model, optimizer, attach(optimizer), self.clock)


class DDPEngine(ModuleEngine):
    """Every rank a replica; the baseline is plain DDP over all ranks."""

    title = "plain DDP"
    baseline = "plain DDP"

    def __init__(self, settings: Settings, device: torch.device) -> None:
        super().__init__(settings, device)
        self.ddp_kwargs: dict[str, Any] = {"device_ids": [device]} if device.type == "cuda" else {}
        self.topology = ReplicaTopology.build(hdet_config(settings, settings.sync_intervals[0]))

    def plain(self, model: nn.Module) -> nn.Module:
        return DistributedDataParallel(model, **self.ddp_kwargs)

    def hdet(self, model: nn.Module, config: HDETConfig) -> tuple[nn.Module, Attach]:
        model = ddp.wrap_model(model, config, self.topology, **self.ddp_kwargs)
        return model, lambda optimizer: ddp.attach(model, optimizer, config, topology=self.topology)

    def counting(self) -> tuple[Trainer, Callable[[], int]]:
        """Plain DDP with a comm hook that counts what it all-reduces."""
        counted = [0]
        trainer = self.plain_trainer()
        trainer.model.register_comm_hook(counted, counting_hook)
        return trainer, lambda: counted[0]


class FSDPEngine(ModuleEngine):
    """Replicas of ``ranks_per_replica`` ranks on the 2-D mesh (replicate, shard); the baseline is native 2-D
    HSDP on the same mesh."""

    title = "FSDP2"
    baseline = "native 2-D HSDP"

    def __init__(self, settings: Settings, device: torch.device) -> None:
        super().__init__(settings, device)
        shape = (settings.ranks // settings.ranks_per_replica, settings.ranks_per_replica)
        self.mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
        self.topology = fsdp.topology_from_mesh(self.mesh, hdet_config(settings, settings.sync_intervals[0]))

    def plain(self, model: nn.Module) -> nn.Module:
        for block in model.blocks:
            fully_shard(block, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)
        return model

    def wrap(self, model: nn.Module, config: HDETConfig) -> tuple[nn.Module, fsdp.HDETFSDP]:
        return fsdp.wrap(model, config, block_classes=(nn.Sequential,), mesh=self.mesh)

    def hdet(self, model: nn.Module, config: HDETConfig) -> tuple[nn.Module, Attach]:
        model, handle = self.wrap(model, config)
        return model, handle.attach

    def counting(self) -> tuple[Trainer, Callable[[], int]]:
        """HDET's global-mode model without an ensemble, whose handle counts what its all-reduce hook sends
        across replicas."""
        model, handle = self.wrap(build_model(self.settings, self.device), hdet_config(self.settings, 10**9))
        trainer = Trainer("global", model, torch.optim.AdamW(model.parameters(), lr=LR), None, self.clock)
        return trainer, lambda: handle.gradient_bytes_across_replicas


class DeepSpeedEngine(Engine):
    """One ZeRO stage: HDET through ``engines.deepspeed.initialize`` with replicas of ``ranks_per_replica``
    ranks; the baseline is plain ``deepspeed.initialize`` with ZeRO at the same stage over all ranks."""

    title = "DeepSpeed ZeRO"
    baseline = "plain DeepSpeed, ZeRO at the same stage over all ranks"
    gradient_average_in_hot_path = True
    refreshes_copies = True  # stages 1-3: the low-precision parameters, gathered (1/2) or re-partitioned (3)

    def __init__(self, settings: Settings, device: torch.device, stage: int) -> None:
        super().__init__(settings, device)
        # Imported here: a DDP or FSDP2 run does not need DeepSpeed's slow import and its accelerator banner.
        import deepspeed

        from hdet_scale.engines import deepspeed as hdet_deepspeed

        self.initialize_plain, self.initialize_hdet = deepspeed.initialize, hdet_deepspeed.initialize
        self.part = f"ZeRO-{stage}"
        self.ds_config = {"train_micro_batch_size_per_gpu": settings.batch, "gradient_accumulation_steps": 1,
                          "zero_optimization": {"stage": stage}}

    def engine(self, initialize: Callable[..., tuple[Any, ...]], config: dict[str, Any]) -> Any:
        """A DeepSpeed engine over a fresh model and AdamW; ``basic_optimizer`` is that AdamW."""
        model = build_model(self.settings, self.device)
        engine, *_ = initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR), config=config)
        return engine

    def plain_trainer(self) -> Trainer:
        engine = self.engine(self.initialize_plain, self.ds_config)
        if engine.dp_world_size != self.settings.ranks:
            raise RuntimeError(
                f"the plain DeepSpeed engine shards over {engine.dp_world_size} ranks, not all {self.settings.ranks}: "
                "an HDET engine built before it left its replica groups process-wide; build plain engines first"
            )
        return DeepSpeedTrainer("plain", engine, engine.basic_optimizer, None, self.clock)

    def hdet_trainer(self, name: str, config: HDETConfig) -> Trainer:
        engine = self.engine(self.initialize_hdet, {**self.ds_config, "hdet": config.to_dict()})
        return DeepSpeedTrainer(name, engine, engine.basic_optimizer, engine.hdet.ensemble, self.clock)

    def same_layout_trainer(self) -> Trainer:
        """Plain DeepSpeed on HDET's layout: ZeRO inside each replica, then the gradients averaged across
        replicas by one flat all-reduce before the step, as hierarchical data parallelism would be written by
        hand (no finiteness guard, no multipliers, no ensemble)."""
        from hdet_scale.engines.deepspeed import replica_groups
        from hdet_scale.engines.zero import ReplicaMPU, ZeroAdapter

        topology = ReplicaTopology.build(hdet_config(self.settings, 10**9))  # the config gives the replica size
        mpu = ReplicaMPU(topology)
        model = build_model(self.settings, self.device)
        with replica_groups(mpu):
            engine, *_ = self.initialize_plain(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                                               config=self.ds_config, mpu=mpu)
        if engine.dp_world_size != topology.ranks_per_replica:
            raise RuntimeError(f"the same-layout engine shards over {engine.dp_world_size} ranks, not the "
                               f"{topology.ranks_per_replica} of a replica")
        gradients, take_model_step = ZeroAdapter(engine).gradient_tensors, engine._take_model_step

        def averaged_model_step(*args: Any, **kwargs: Any) -> Any:
            tensors = gradients()
            flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
            dist.all_reduce(flat, group=topology.cross_replica_group)
            flat.div_(topology.num_replicas)
            torch._foreach_copy_(tensors, [mean.view_as(tensor) for mean, tensor in
                                           zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)])
            return take_model_step(*args, **kwargs)

        engine._take_model_step = averaged_model_step
        return SameLayoutDeepSpeedTrainer("same_layout", engine, engine.basic_optimizer, None, self.clock, mpu=mpu)

    def counting(self) -> tuple[Trainer, Callable[[], int]]:
        trainer = self.hdet_trainer("global", hdet_config(self.settings, 10**9))
        return trainer, lambda: trainer.model.hdet.gradient_bytes_across_replicas


def build_engines(settings: Settings, device: torch.device) -> list[Engine]:
    """The engines one run measures, in the same order on every rank (each builds process groups)."""
    if settings.engine == "deepspeed":
        return [DeepSpeedEngine(settings, device, stage) for stage in settings.stages]
    return [{"ddp": DDPEngine, "fsdp": FSDPEngine}[settings.engine](settings, device)]

