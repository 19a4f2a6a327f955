"""HDET's cost on a training loop of one engine (plain DDP, FSDP2 or DeepSpeed ZeRO): step time, sync time
and bytes, measured in one interleaved run.

    python benchmarks/overhead.py [--engine ddp|fsdp|deepspeed] [--stages 1 2 3] [--ranks 4] [--steps N] [--quick]
                                  [--backend auto|gloo|nccl]

The script spawns ``--ranks`` processes (gloo on CPU, or nccl with one rank per GPU when enough GPUs are
visible; ``--backend`` overrides). ``--engine ddp``: every rank a replica (``ranks_per_replica = 1``), the
baseline plain DDP. ``--engine fsdp``: replicas of ``--shards`` ranks (default 2) on the 2-D mesh
``("replicate", "shard")``, HDET through ``engines.fsdp.wrap`` in global gradient mode, the baseline native
2-D HSDP (``fully_shard(block, mesh=mesh)`` on the same mesh: reduce-scatter inside a replica, all-reduce of
the shard across replicas). Both shard the model block by block. ``--engine deepspeed``: every ZeRO stage of
``--stages`` (default 1 2 3) in one run, their variants interleaved together; HDET through
``engines.deepspeed.initialize`` with the settings in the config's ``"hdet"`` section (replicas of
``--shards`` ranks, ZeRO sharding inside a replica, global gradient mode), the baseline plain
``deepspeed.initialize`` with ZeRO at the same stage over all ranks, which is what one would run without
HDET (DeepSpeed has no hybrid sharding to compare with). Both take a torch AdamW, so nothing JIT-compiles.
Every plain engine is built before the HDET ones: DeepSpeed keeps the last model-parallel unit process-wide,
and a plain engine built after an HDET engine would shard over one replica. Each stage gets its own part of
the results. Measured:

1. Step time. The baseline training of a residual MLP (~1.2M parameters) against the same training with
   HDET attached (``hdet.step(loss)`` after every ``optimizer.step()``; DeepSpeed: inside ``engine.step()``)
   at sync interval T = 10, 100, 1000. Every variant keeps its own model, optimizer and HDET state and
   they run round-robin in blocks of ``--block`` steps, the order rotating every round, so machine noise
   hits all variants alike. The first round is a warm-up and is dropped. A step's time is the mean over
   the ranks. Reported: median and interquartile range per variant; the median over rounds of the ratio
   of the HDET block's median step to the plain block's median step in the same round (the per-step hot
   path: the sync steps hardly move a median); the ratio of total times (everything, syncs included); and
   an estimate from the components, (hot path + sync time / T) / plain step, which is far less noisy.
   The hot path is the measured time of ``hdet.step(loss)`` on non-sync steps plus the cost of HDET's
   step-scoped LR hooks around ``optimizer.step()`` (timed on an optimizer with no gradients, where the
   hooks are most of the work). DeepSpeed's hot path also holds the all-reduce of the gradients across
   replicas that HDET adds in global mode, counted at the time of ``average_tensors`` in section 2 (same
   bytes); the estimate leaves out that ZeRO then shards over a replica instead of all ranks, which the
   direct ratios include. The auto-LR controller runs at every sync (``warmup_steps = 0``).
2. Sync time. ``hdet.sync()`` (bucketed averaging of all parameters, FSDP and DeepSpeed: of each rank's
   local shards, over the cross-replica group, the tiny loss gather, the finiteness check and the
   controller) at several ``bucket_mb``, and ``comm.average_tensors`` alone at the default bucket, against
   one flat ``all_reduce`` of a single fp32 tensor of the same number of bytes over the cross-replica group,
   interleaved per repetition with a barrier before each operation. A repetition's time is the slowest
   rank's; the ratio to the flat all-reduce is taken per repetition.
3. Bytes. ``SyncReport.bytes_averaged`` per sync in ``global`` and ``local`` gradient mode, the gradient
   bytes all-reduced across replicas per step in global mode (counted by a DDP comm hook, FSDP: by the HDET
   handle's all-reduce hook, DeepSpeed: by ``engine.hdet``, next to the estimate "gradient bytes = parameter
   bytes", FSDP and DeepSpeed: shard bytes), and the resulting cross-replica bytes per step for each T. These
   are payload bytes; a ring all-reduce moves about 2(n-1)/n times the payload per rank.
4. Peak memory, in a launch of its own before the timed one. The plain engine, HDET in global and HDET in
   local gradient mode, each built from a fresh model and trained ``MEMORY_STEPS`` steps at
   T = ``MEMORY_SYNC_INTERVAL`` (so the window holds syncs) inside one measurement window, after one
   unmetered run of the same variant (one-time set-up is left out): the peak of the memory in use in the
   window above its start (model, engine, gradients, optimizer states, HDET's state and the sync's buckets)
   and what is still in use at its end, the maximum over ranks. CUDA: the caching allocator's statistics.
   CPU: the kernel's peak resident set size, reset at the window's start, with glibc told to map every
   block of 64 KiB or more by itself, so a freed tensor leaves the resident set and the next variant's
   tensors are not served from memory an earlier one freed. Memory does not depend on T beyond whether a
   sync happens, so one T.

All timings are ratios against a baseline measured in the same run. Rank 0 writes
``<out>/overhead_<engine>_<cpu|gpu>[_quick].json`` and ``.md`` with the machine, the command and the tables
(DeepSpeed with other than the default stages: ``overhead_deepspeed_zero<stages>_...``).
"""

# No ``from __future__ import annotations``: DDP checks a comm hook's annotations against the real classes.
import argparse
import ctypes
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from hdet_scale import HDETConfig, HDETEnsemble, ReplicaTopology, SyncReport
from hdet_scale.comm import average_tensors
from hdet_scale.engines import ddp, fsdp

MiB = 2**20
LR = 1e-3  # AdamW's LR in every variant
DEEPSPEED_STAGES = (1, 2, 3)
# Per engine: timed steps per variant, steps per block, sync repetitions, LR-hook repetitions. DeepSpeed runs
# 4 variants per ZeRO stage and a ZeRO-3 step costs several plain ones, so it takes fewer steps.
RUN_LENGTHS = {
    "ddp": {"full": (1000, 50, 40, 3000), "quick": (200, 25, 10, 500)},
    "fsdp": {"full": (250, 25, 20, 1000), "quick": (200, 25, 10, 500)},
    "deepspeed": {"full": (200, 20, 20, 1000), "quick": (10, 5, 5, 200)},
}
MEMORY_SYNC_INTERVAL, MEMORY_STEPS = 2, 4  # section 4: two syncs in the window
TARGETS = {100: 0.01, 1000: 0.002}  # the project's step-time overhead targets per T (reported, not asserted)


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


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=tuple(RUN_LENGTHS), default="ddp", help="the training engine")
    parser.add_argument("--stages", type=int, nargs="+", choices=(1, 2, 3), default=list(DEEPSPEED_STAGES),
                        help="deepspeed: the ZeRO stages, measured interleaved in one run")
    parser.add_argument("--ranks", type=int, default=4, help="processes; one per GPU under nccl")
    parser.add_argument("--shards", type=int, default=2,
                        help="fsdp, deepspeed: ranks per replica (the shard group)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per variant (default ddp 1000, fsdp 250, deepspeed 200, quick 200, "
                             "deepspeed quick 10); T=1000 needs >= ~950 to sync")
    parser.add_argument("--block", type=int, default=None, help="steps per variant per round (default 50, "
                                                                "fsdp 25, deepspeed 20, quick 25, "
                                                                "deepspeed quick 5)")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                        help="auto: nccl when at least --ranks GPUs are visible, else gloo")
    parser.add_argument("--quick", action="store_true", help="a short smoke run (T=1000 then never syncs)")
    parser.add_argument("--note", default="", help="context recorded with the results (e.g. what else ran)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                        help="directory for the JSON and markdown results")
    args = parser.parse_args(argv)
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= args.ranks else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < args.ranks:
        parser.error(f"nccl needs one GPU per rank: {args.ranks} ranks, {torch.cuda.device_count()} GPUs")
    steps, block, sync_reps, hook_reps = RUN_LENGTHS[args.engine]["quick" if args.quick else "full"]
    steps, block = args.steps or steps, args.block or block
    per_replica = 1 if args.engine == "ddp" else args.shards
    if args.ranks < 2 * per_replica or args.ranks % per_replica or steps < block or block < 2:
        parser.error("need --ranks a multiple of --shards, at least 2 replicas, and --steps >= --block >= 2")
    return Settings(
        engine=args.engine, stages=tuple(sorted(set(args.stages))) if args.engine == "deepspeed" else (),
        ranks=args.ranks, ranks_per_replica=per_replica, backend=backend, steps=steps,
        block=block, sync_intervals=(10, 100, 1000), bucket_mbs=(1.0, 4.0, 25.0), sync_reps=sync_reps,
        hook_reps=hook_reps,
        width=192, depth=4, batch=16, out=args.out, quick=args.quick, note=args.note,
        command=shlex.join(["python", *sys.argv]),
    )


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
                bucket_mb: float = 25.0) -> HDETConfig:
    """Paper spread, no metrics file, and the controller updating at every sync (its worst case)."""
    config = HDETConfig(sync_interval=sync_interval, gradient_mode=gradient_mode, bucket_mb=bucket_mb,
                        ranks_per_replica=settings.ranks_per_replica)
    config.auto_lr.warmup_steps = 0
    config.validate()
    return config


# ------------------------------------------------------------------------------------------- helpers
class Clock:
    """Wall-clock seconds that include the device's queued work (a CUDA sync under nccl)."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles and mean (needs at least one value)."""
    if len(values) == 1:
        return {"median": values[0], "q1": values[0], "q3": values[0], "mean": values[0], "n": 1}
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": median, "q1": q1, "q3": q3, "mean": statistics.fmean(values), "n": len(values)}


def gather(values: list[float]) -> list[list[float]]:
    """Every rank's list (collective)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, values)
    return out


def per_index(lists: list[list[float]], reduce: Callable[[list[float]], float]) -> list[float]:
    """Reduces the ranks' lists index by index (e.g. the mean or max over ranks of each step)."""
    return [reduce(list(column)) for column in zip(*lists, strict=True)]


class PeakMemory:
    """Memory in use on ``device`` inside a ``with`` block, counted from its start: ``peak_bytes`` (the most at
    any moment, every thread included) and ``retained_bytes`` (still in use at its end).

    CUDA reads the caching allocator's statistics. The CPU allocator keeps none, so on CPU (Linux) the kernel's
    peak resident set size is reset at the start (``/proc/self/clear_refs``) and read at the end. That counts
    tensors exactly only when freed blocks go back to the kernel: call ``map_every_large_block`` first.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_bytes = self.retained_bytes = 0
        self._base = 0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
            self._base = resident_bytes()["VmRSS"]
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak, now = torch.cuda.max_memory_allocated(self.device), torch.cuda.memory_allocated(self.device)
        else:
            sizes = resident_bytes()
            peak, now = sizes["VmHWM"], sizes["VmRSS"]
        self.peak_bytes, self.retained_bytes = peak - self._base, now - self._base


def map_every_large_block() -> None:
    """Makes glibc map every block of 64 KiB or more by itself, as ``PeakMemory`` on CPU needs: with its default
    sliding mmap threshold glibc serves later tensors from its heap, which the resident set never gives back."""
    m_mmap_threshold = -3  # glibc's malloc.h
    if not ctypes.CDLL(None).mallopt(m_mmap_threshold, 64 * 1024):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed: the CPU memory measurement needs glibc")


def resident_bytes() -> dict[str, int]:
    """This process's current (VmRSS) and peak (VmHWM) resident set size in bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {name: int(fields[name].split()[0]) * 1024 for name in ("VmRSS", "VmHWM")}  # reported in kB


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


# ------------------------------------------------------------------------------------------- engines
def counting_hook(state: list[int], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook that counts the gradient bytes it all-reduces."""
    state[0] += bucket.buffer().numel() * bucket.buffer().element_size()
    return default_hooks.allreduce_hook(None, bucket)


class Engine(ABC):
    """Builds the variants of one training engine: the baseline and HDET trainers, each from a fresh model."""

    title = ""
    baseline = ""
    local_mode_note = ""
    memory_note = ""
    """Where HDET's memory differs from the baseline's in this engine (the mechanism, for section 4)."""
    part = ""
    """Names this engine's part of the results when one run measures several (DeepSpeed's ZeRO stages)."""
    gradient_average_in_hot_path = False
    """Whether HDET itself all-reduces the gradients across replicas every step in global mode, where the
    baseline's engine reduces gradients over all ranks in its own way."""

    def __init__(self, settings: Settings, device: torch.device) -> None:
        self.settings = settings
        self.device = device
        self.clock = Clock(device)

    @abstractmethod
    def plain_trainer(self) -> Trainer: ...

    @abstractmethod
    def hdet_trainer(self, name: str, config: HDETConfig) -> Trainer: ...

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
    local_mode_note = ("In local mode with one rank per replica DDP's gradient all-reduce stays inside the replica "
                       "(here a single rank), so the syncs are the only cross-replica traffic.")
    memory_note = ("HDET keeps nothing beside the training state; its peak is higher by the sync's buckets: each "
                   "holds min(bucket_mb, the averaged bytes) and at most two are alive, so here (a model under "
                   "bucket_mb) one copy of the parameters. With large models the peak grows by 2 x bucket_mb at most.")

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
    local_mode_note = ("In local mode the gradient reduce-scatter stays inside the replica and there is no "
                       "cross-replica gradient all-reduce, so the syncs are the only cross-replica traffic. "
                       "Both modes also reduce-scatter the full gradient inside the replica every step.")
    memory_note = ("HDET keeps nothing beside the training state, and the same mesh shards the same way. A sync "
                   "runs after the optimizer step, when the unsharded parameters and activations of the step are "
                   "freed, so its buckets (local shards, at most 2 x bucket_mb) fit under the training peak.")

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
    local_mode_note = ("In local mode ZeRO's gradient reduction stays inside the replica and nothing crosses "
                       "replicas between syncs. Both modes also reduce the full gradient inside the replica "
                       "every step.")
    gradient_average_in_hot_path = True
    memory_note = ("The retained difference is the replicas themselves, not HDET's state: with HDET, ZeRO shards "
                   "over the ranks of one replica instead of all ranks (here 2 of 4), so each rank holds twice the "
                   "optimizer-state and fp32 master shard (ZeRO-1/2) and also the parameter and gradient shard "
                   "(ZeRO-3), as under any hybrid sharding. The peak adds the sync's buckets (local shards, at "
                   "most 2 x bucket_mb).")

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

    def counting(self) -> tuple[Trainer, Callable[[], int]]:
        trainer = self.hdet_trainer("global", hdet_config(self.settings, 10**9))
        return trainer, lambda: trainer.model.hdet.gradient_bytes_across_replicas


def build_engines(settings: Settings, device: torch.device) -> list[Engine]:
    """The engines one run measures, in the same order on every rank (each builds process groups)."""
    if settings.engine == "deepspeed":
        return [DeepSpeedEngine(settings, device, stage) for stage in settings.stages]
    return [{"ddp": DDPEngine, "fsdp": FSDPEngine}[settings.engine](settings, device)]


# --------------------------------------------------------------------------------- 1. step time
def hdet_trainers(settings: Settings, engine: Engine) -> list[Trainer]:
    """HDET at each sync interval."""
    return [engine.hdet_trainer(f"hdet_T{interval}", hdet_config(settings, interval))
            for interval in settings.sync_intervals]


def run_step_benchmark(settings: Settings, trainers: list[Trainer], device: torch.device) -> int:
    """Round-robin blocks of steps, rotating the order every round; returns the warm-up steps per variant."""
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())  # each rank its own data
    batches = [(torch.randn(settings.batch, settings.width, generator=generator).to(device),
                torch.randint(0, 16, (settings.batch,), generator=generator).to(device)) for _ in range(8)]
    rounds = 1 + -(-settings.steps // settings.block)  # one warm-up round, then enough for --steps
    for round_index in range(rounds):
        shift = round_index % len(trainers)
        for trainer in trainers[shift:] + trainers[:shift]:
            for step in range(settings.block):
                x, y = batches[step % len(batches)]
                trainer.train_step(x, y)
    return settings.block


def hook_overhead(settings: Settings, engine: Engine, plain: torch.optim.Optimizer) -> dict[str, float]:
    """Seconds HDET's step-scoped LR hooks add to ``optimizer.step()``: timed on fresh optimizers, whose
    parameters have no gradients (the step itself then does almost nothing), alternating with and without
    HDET; ``plain`` is the baseline's."""
    hooked_trainer = engine.hdet_trainer("hooks", hdet_config(settings, 10**9))
    samples: dict[str, list[float]] = {"plain": [], "hooked": []}
    for _ in range(settings.hook_reps):
        for name, optimizer in (("plain", plain), ("hooked", hooked_trainer.optimizer)):
            start = time.perf_counter()
            optimizer.step()
            samples[name].append(time.perf_counter() - start)
    hooked_trainer.hdet.close()
    plain_median, hooked_median = statistics.median(samples["plain"]), statistics.median(samples["hooked"])
    return {"plain_step_s": plain_median, "hooked_step_s": hooked_median,
            "hook_s": max(0.0, hooked_median - plain_median)}


def analyse_steps(settings: Settings, trainers: list[Trainer], warmup: int) -> dict[str, Any]:
    """Per-variant statistics over the ranks' gathered step times (collective; the sync reports are this
    rank's own)."""
    result: dict[str, Any] = {}
    step_times: dict[str, list[float]] = {}
    for trainer in trainers:
        times = per_index(gather(trainer.step_seconds), statistics.fmean)[warmup:]
        step_times[trainer.name] = times
        syncs = [index - warmup for index in trainer.sync_steps if index >= warmup]
        entry: dict[str, Any] = {"step_s": summary(times), "timed_steps": len(times), "syncs_timed": len(syncs)}
        if trainer.hdet is not None:
            sync_set = set(trainer.sync_steps)
            hot = [s for i, s in enumerate(per_index(gather(trainer.hdet_seconds), statistics.fmean))
                   if i >= warmup and i not in sync_set]
            entry["hdet_step_call_s"] = summary(hot)
            if syncs:
                entry["sync_step_s"] = summary([times[i] for i in syncs])
                entry["sync_seconds_report"] = summary([r.sync_seconds for r in trainer.reports])
        result[trainer.name] = entry
    plain = step_times["plain"]
    for trainer in trainers[1:]:
        times = step_times[trainer.name]
        ratios = [statistics.median(times[s: s + settings.block]) / statistics.median(plain[s: s + settings.block])
                  for s in range(0, len(times), settings.block)]
        result[trainer.name]["block_median_ratio"] = summary(ratios)
        result[trainer.name]["total_time_ratio"] = sum(times) / sum(plain)
    return result


# --------------------------------------------------------------------------------- 2. sync time
def run_sync_benchmark(settings: Settings, engine: Engine, device: torch.device) -> dict[str, Any]:
    """hdet.sync() per bucket size and average_tensors alone vs one flat all_reduce of the same bytes."""
    ensembles = {f"hdet.sync bucket_mb={bucket_mb:g}": engine.hdet_trainer(
        "sync", hdet_config(settings, 10**9, bucket_mb=bucket_mb)).hdet for bucket_mb in settings.bucket_mbs}
    some_ensemble = next(iter(ensembles.values()))
    topology = some_ensemble.topology
    group = topology.cross_replica_group
    tensors = some_ensemble.adapter.averaged_tensors()  # what a sync averages on this rank
    payload_bytes = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.zeros(payload_bytes // 4, dtype=torch.float32, device=device)
    loss = torch.tensor(1.0, device=device)

    def timed_sync(hdet: HDETEnsemble) -> Callable[[], float]:
        def run() -> float:
            hdet.step(loss)  # one interval loss, so the gather and the controller do their real work
            dist.barrier(group=group)
            start = engine.clock()
            hdet.sync()
            return engine.clock() - start
        return run

    def timed(operation: Callable[[], object]) -> Callable[[], float]:
        def run() -> float:
            dist.barrier(group=group)
            start = engine.clock()
            operation()
            return engine.clock() - start
        return run

    # name -> (timed operation, bucket size in MiB or None for the flat all-reduce)
    operations: dict[str, tuple[Callable[[], float], float | None]] = {
        "flat all_reduce": (timed(lambda: dist.all_reduce(flat, group=group)), None),
        "average_tensors bucket_mb=25": (timed(lambda: average_tensors(
            tensors, group, contribute=True, num_contributors=topology.num_replicas, bucket_bytes=25 * MiB)), 25.0),
        **{name: (timed_sync(hdet), hdet.config.bucket_mb) for name, hdet in ensembles.items()},
    }
    names = list(operations)
    samples: dict[str, list[float]] = {name: [] for name in names}
    warmup = 2
    for rep in range(warmup + settings.sync_reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            seconds = operations[name][0]()
            if rep >= warmup:
                samples[name].append(seconds)
    slowest = {name: per_index(gather(values), max) for name, values in samples.items()}
    result: dict[str, Any] = {"payload_bytes": payload_bytes, "warmup_reps": warmup, "ops": {}}
    for name, (_, bucket_mb) in operations.items():
        ratios = [a / b for a, b in zip(slowest[name], slowest["flat all_reduce"], strict=True)]
        buckets = 1 if bucket_mb is None else -(-payload_bytes // int(bucket_mb * MiB))
        result["ops"][name] = {"buckets": buckets, "seconds": summary(slowest[name]),
                               "ratio_vs_flat": summary(ratios)}
    return result


# ------------------------------------------------------------------------------------------ 3. bytes
def run_bytes(settings: Settings, engine: Engine, device: torch.device,
              global_reports: list[SyncReport]) -> dict[str, Any]:
    """Bytes averaged per sync in both gradient modes and the cross-replica gradient bytes per step in global
    mode."""
    generator = torch.Generator().manual_seed(2000 + dist.get_rank())
    x = torch.randn(settings.batch, settings.width, generator=generator).to(device)
    y = torch.randint(0, 16, (settings.batch,), generator=generator).to(device)

    measured_steps = 3
    local = engine.hdet_trainer("local", hdet_config(settings, 2, gradient_mode="local"))
    counting, counted = engine.counting()
    for _ in range(measured_steps):
        for trainer in (local, counting):
            trainer.train_step(x, y)

    param_bytes = sum(t.numel() * t.element_size() for t in local.hdet.adapter.averaged_tensors())
    grad_bytes_per_step = counted() // measured_steps
    per_sync = {"global": global_reports[0].bytes_averaged, "local": local.reports[0].bytes_averaged}
    per_step = {
        f"T{interval}": {
            "global": grad_bytes_per_step + per_sync["global"] / interval,
            "local": per_sync["local"] / interval,
        }
        for interval in settings.sync_intervals
    }
    return {
        "param_bytes": param_bytes,
        "grad_bytes_per_step_estimate": param_bytes,
        "grad_bytes_per_step_measured": grad_bytes_per_step,
        "bytes_averaged_per_sync": per_sync,
        "bytes_gathered_per_sync": global_reports[0].bytes_gathered,
        "cross_replica_bytes_per_step": per_step,
    }


# ----------------------------------------------------------------------------------------- 4. memory
def metered(settings: Settings, device: torch.device, build: Callable[[], Trainer]) -> dict[str, int]:
    """Builds a trainer and trains it ``MEMORY_STEPS`` steps inside one ``PeakMemory`` window; the maximum
    over ranks of the window's peak and retained bytes (collective). The trainer is dropped afterwards."""
    generator = torch.Generator().manual_seed(3000 + dist.get_rank())
    x = torch.randn(settings.batch, settings.width, generator=generator).to(device)
    y = torch.randint(0, 16, (settings.batch,), generator=generator).to(device)
    gc.collect()
    with PeakMemory(device) as meter:
        trainer = build()
        for _ in range(MEMORY_STEPS):
            trainer.train_step(x, y)
    if trainer.hdet is not None:
        trainer.hdet.close()
    del trainer
    gc.collect()
    peak, retained = (max(column) for column in zip(*gather([meter.peak_bytes, meter.retained_bytes]), strict=True))
    return {"peak_bytes": peak, "retained_bytes": retained}


def measure_memory(settings: Settings, device: torch.device) -> dict[str, dict[str, dict[str, int]]]:
    """Section 4 of every engine part: the plain engine, then HDET in both gradient modes."""
    engines = build_engines(settings, device)

    def after_warmup(build: Callable[[], Trainer]) -> dict[str, int]:
        # A variant's first run in a process sets up what then stays (thread pools, a process group's first
        # collectives: about 2 MiB for HDET's groups here), which is not what each run of it costs.
        metered(settings, device, build)
        return metered(settings, device, build)

    # All plain engines before any HDET engine, for the same reason as in ``measure``.
    plain = {engine.part: after_warmup(engine.plain_trainer) for engine in engines}
    return {engine.part: {"plain": plain[engine.part], **{
        f"hdet_{mode}": after_warmup(lambda engine=engine, mode=mode: engine.hdet_trainer(
            mode, hdet_config(settings, MEMORY_SYNC_INTERVAL, gradient_mode=mode)))
        for mode in ("global", "local")}} for engine in engines}


# ------------------------------------------------------------------------------------------ reports
def machine_info(settings: Settings, device: torch.device) -> dict[str, Any]:
    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu": cpu,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        **({"deepspeed": importlib.metadata.version("deepspeed")} if settings.engine == "deepspeed" else {}),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "backend": settings.backend,
        "ranks": settings.ranks,
        "torch_threads_per_rank": torch.get_num_threads(),
    }


def estimates(steps: dict[str, Any], sync: dict[str, Any], hooks: dict[str, float], intervals: Sequence[int], *,
              gradient_average: bool) -> dict[str, float]:
    """Overhead from the components: (hdet.step hot path + LR hooks + sync / T) / plain median step, the hot
    path with HDET's gradient all-reduce across replicas when ``gradient_average``."""
    plain = steps["plain"]["step_s"]["median"]
    sync_seconds = sync["ops"]["hdet.sync bucket_mb=25"]["seconds"]["median"]
    hot = hooks["hook_s"]
    if gradient_average:
        hot += sync["ops"]["average_tensors bucket_mb=25"]["seconds"]["median"]
    return {f"hdet_T{t}": (steps[f"hdet_T{t}"]["hdet_step_call_s"]["median"] + hot + sync_seconds / t) / plain
            for t in intervals}


def result_parts(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, measurements) of each engine part: DeepSpeed's ZeRO stages, else the one unlabelled part."""
    return list(data["stages"].items()) if "stages" in data else [("", data)]


def write_markdown(path: Path, data: dict[str, Any]) -> None:
    m, cfg, engine = data["machine"], data["settings"], data["engine"]
    parts = result_parts(data)
    per_rank = "" if cfg["ranks_per_replica"] == 1 else ", local shards per rank"
    lines = [
        f"# HDET overhead on {engine['title']}",
        "",
        f"Command: `{cfg['command']}`",
        "",
        f"Machine: {m['nproc']} CPUs ({m['cpu']}), GPU: {m['gpu'] or 'none'}; torch {m['torch']}, "
        + (f"deepspeed {m['deepspeed']}, " if "deepspeed" in m else "")
        + f"backend {m['backend']}, {m['ranks']} ranks ({m['ranks'] // cfg['ranks_per_replica']} replicas x "
        f"{cfg['ranks_per_replica']} rank(s)), {m['torch_threads_per_rank']} torch thread(s) per rank; "
        f"{m['date_utc']}; load average {data['load_average']['start']} at start, "
        f"{data['load_average']['end']} at end; run took {data['runtime_s']:.0f} s.",
        "",
        f"Model: residual MLP, {data['model_params']:,} parameters ({parts[0][1]['bytes']['param_bytes'] / MiB:.2f} "
        f"MiB fp32{per_rank}), batch {cfg['batch']} per rank, AdamW. Baseline (\"plain\"): {engine['baseline']}. "
        "HDET: global gradient mode, alpha 1/9, auto-LR updating at every sync, no metrics file.",
        "",
        "**Noise.** " + data["noise_note"] + (f" Context of this run: {cfg['note']}" if cfg["note"] else ""),
        "",
    ]
    heading = "##"
    if "stages" in data:
        lines += stage_summary_markdown(cfg, parts)
        heading = "###"
    for label, part in parts:
        if label:
            lines += [f"## {label}", ""]
        lines += part_markdown(cfg, engine, part, heading)
    path.write_text("\n".join(lines))


def stage_summary_markdown(cfg: dict[str, Any], parts: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """One table of the step-time ratios of every stage."""
    lines = [
        f"## Step-time ratio HDET / plain per stage ({cfg['steps']} timed steps per variant, blocks of "
        f"{cfg['block']}, all stages' variants round-robin in one run; details per stage below)",
        "",
        "| stage | T | hot-path ratio, median over rounds (IQR) | total-time ratio | estimate from components |",
        "|---|---|---|---|---|",
    ]
    for label, part in parts:
        for interval in cfg["sync_intervals"]:
            name = f"hdet_T{interval}"
            entry, r = part["step_time"][name], part["step_time"][name]["block_median_ratio"]
            lines.append(f"| {label} | {interval} | {r['median']:.3f} ({r['q1']:.3f}-{r['q3']:.3f}) | "
                         f"{entry['total_time_ratio']:.3f} | {1 + part['estimated_overhead'][name]:.4f} |")
    return [*lines, ""]


def part_markdown(cfg: dict[str, Any], engine: dict[str, Any], part: dict[str, Any], heading: str) -> list[str]:
    """Sections 1-4 of one engine part."""
    steps, sync, nbytes, hooks = part["step_time"], part["sync_time"], part["bytes"], part["hook_overhead"]
    gradient_average = engine["gradient_average_in_hot_path"]
    hdet_step = "`ensemble.step()` inside `engine.step()`" if gradient_average else "`hdet.step(loss)`"
    ms = 1e3
    per_rank = "" if cfg["ranks_per_replica"] == 1 else ", local shards per rank"
    lines = [
        f"{heading} 1. Step time ({cfg['steps']} timed steps per variant, blocks of {cfg['block']}, round-robin)",
        "",
        "| variant | syncs timed | median step ms (IQR) | hot-path ratio vs plain, median over rounds (IQR) "
        "| total-time ratio | estimate from components | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, entry in steps.items():
        s = entry["step_s"]
        row = f"| {name} | {entry['syncs_timed']} | {s['median'] * ms:.2f} ({s['q1'] * ms:.2f}-{s['q3'] * ms:.2f}) |"
        if name == "plain":
            lines.append(row + " 1 | 1 | 1 | |")
            continue
        r = entry["block_median_ratio"]
        interval = int(name.removeprefix("hdet_T"))
        target = f"<= {1 + TARGETS[interval]:.3f}" if interval in TARGETS else ""
        lines.append(row + f" {r['median']:.3f} ({r['q1']:.3f}-{r['q3']:.3f}) | {entry['total_time_ratio']:.3f} "
                     f"| {1 + part['estimated_overhead'][name]:.4f} | {target} |")
    gradient_row = []
    if gradient_average:
        gradient_row = [f"| gradient all-reduce across replicas (`average_tensors` bucket_mb=25, section 2) | "
                        f"{sync['ops']['average_tensors bucket_mb=25']['seconds']['median'] * 1e6:.1f} |"]
    lines += [
        "",
        "Hot-path ratio: per round, the HDET block's median step over the plain block's median step (a median "
        "hardly sees the sync steps). Total-time ratio: all timed steps, syncs included; "
        + ("one sync per 1000 steps is within its noise. " if steps["hdet_T1000"]["syncs_timed"] else
           "T=1000 does not sync within the timed steps, so its sync cost enters only the estimate. ")
        + f"Estimate from components: 1 + (median time of {hdet_step} on non-sync steps + LR-hook cost + "
        + ("gradient all-reduce across replicas + " if gradient_average else "")
        + "median `hdet.sync()` at bucket_mb 25 from section 2 / T) / plain median step."
        + (" It leaves out that ZeRO shards over the 2 ranks of a replica instead of all ranks (a larger "
           "optimizer shard per rank, collectives over fewer ranks), which the direct ratios include."
           if gradient_average else ""),
        "",
        "| hot-path component | median µs |",
        "|---|---|",
        *[f"| {hdet_step}, non-sync step, {name} | {entry['hdet_step_call_s']['median'] * 1e6:.1f} |"
          for name, entry in steps.items() if name != "plain"],
        f"| LR hooks around `optimizer.step()` (hooked {hooks['hooked_step_s'] * 1e6:.1f} - plain "
        f"{hooks['plain_step_s'] * 1e6:.1f}, no gradients) | {hooks['hook_s'] * 1e6:.1f} |",
        *gradient_row,
        "",
        "Sync steps in training (step time of the steps that synced, median): " + ", ".join(
            f"{name} {entry['sync_step_s']['median'] * ms:.1f} ms over {entry['sync_step_s']['n']}"
            for name, entry in steps.items() if "sync_step_s" in entry) +
        f"; plain median step {steps['plain']['step_s']['median'] * ms:.1f} ms. These include the rank skew "
        "that a plain step absorbs in the next gradient all-reduce.",
        "",
        f"{heading} 2. Sync time ({sync['payload_bytes'] / MiB:.2f} MiB of parameters{per_rank}, "
        f"{cfg['sync_reps']} repetitions, slowest rank; the flat all_reduce runs over the cross-replica group)",
        "",
        "| operation | buckets | median ms (IQR) | ratio vs flat all_reduce, paired median (IQR) |",
        "|---|---|---|---|",
    ]
    for name, entry in sync["ops"].items():
        s, r = entry["seconds"], entry["ratio_vs_flat"]
        lines.append(f"| {name} | {entry['buckets']} | {s['median'] * ms:.2f} ({s['q1'] * ms:.2f}-"
                     f"{s['q3'] * ms:.2f}) | {r['median']:.3f} ({r['q1']:.3f}-{r['q3']:.3f}) |")
    lines += [
        "",
        "`hdet.sync` minus `average_tensors` is the loss gather (a second, tiny collective), the finiteness "
        "check of every parameter and the controller"
        + (", and ZeRO refreshing its parameters from the averaged master" if gradient_average else "")
        + "; `average_tensors` minus the flat all-reduce is packing the buckets, the division and unpacking.",
        "",
        f"{heading} 3. Bytes (payload per rank; a ring all-reduce moves about 2(n-1)/n times this per rank)",
        "",
        f"Parameter bytes{per_rank} {nbytes['param_bytes']:,}; cross-replica gradient all-reduce per step in "
        "global mode: "
        f"{nbytes['grad_bytes_per_step_measured']:,} measured (estimate = parameter bytes "
        f"{nbytes['grad_bytes_per_step_estimate']:,}). Loss gather per sync: {nbytes['bytes_gathered_per_sync']} "
        "bytes.",
        "",
        "| gradient mode | bytes averaged per sync | cross-replica bytes per step, T=" +
        " | T=".join(str(t) for t in cfg["sync_intervals"]) + " |",
        "|---|---|" + "---|" * len(cfg["sync_intervals"]),
    ]
    for mode in ("global", "local"):
        per_step = " | ".join(f"{nbytes['cross_replica_bytes_per_step'][f'T{t}'][mode]:,.0f}"
                              for t in cfg["sync_intervals"])
        lines.append(f"| {mode} | {nbytes['bytes_averaged_per_sync'][mode]:,} | {per_step} |")
    return [*lines, "", engine["local_mode_note"], "", *memory_markdown(part["memory"], heading, per_rank),
            engine["memory_note"], ""]


def memory_markdown(memory: dict[str, dict[str, int]], heading: str, per_rank: str) -> list[str]:
    """Section 4: each variant's peak and retained memory against the plain engine's."""
    plain = memory["plain"]
    lines = [
        f"{heading} 4. Peak memory (build the model and engine, then {MEMORY_STEPS} steps at T = "
        f"{MEMORY_SYNC_INTERVAL}, in a launch of its own; memory in use in that window above its start"
        f"{per_rank}, maximum over ranks)",
        "",
        "| variant | peak MiB | peak vs plain | retained at the end MiB | retained vs plain |",
        "|---|---|---|---|---|",
    ]
    for name, entry in memory.items():
        peak = "" if name == "plain" else (f"{(entry['peak_bytes'] - plain['peak_bytes']) / MiB:+.2f} MiB "
                                           f"({entry['peak_bytes'] / plain['peak_bytes']:.3f}x)")
        kept = "" if name == "plain" else f"{(entry['retained_bytes'] - plain['retained_bytes']) / MiB:+.2f} MiB"
        lines.append(f"| {name} | {entry['peak_bytes'] / MiB:.2f} | {peak} | {entry['retained_bytes'] / MiB:.2f} "
                     f"| {kept} |")
    return [*lines, "", "Peak: the most memory in use at once in the window (parameters, gradients, optimizer "
            "states, activations, the engine's buffers, HDET's state and a sync's buckets); retained: what is "
            "still in use after the last step, with the trainer alive. Each variant ran once unmetered first, so "
            "one-time set-up (thread pools, a new process group's first collectives) is left out. CPU: the "
            "kernel's peak resident set size, reset at the window's start, with glibc mapping every block of "
            "64 KiB or more by itself (page granular; small allocations add some noise); CUDA: "
            "`torch.cuda.max_memory_allocated`.", ""]


# ------------------------------------------------------------------------------------------- ranks
def start_rank(rank: int, settings: Settings, store_path: str) -> torch.device:
    """Sets up one rank of a launch (environment, device, process group); returns its device."""
    # What a launcher sets: DeepSpeed asserts LOCAL_RANK even when the process group already exists.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(settings.ranks),
                      LOCAL_WORLD_SIZE=str(settings.ranks))
    # ZeRO calls torch.distributed collectives that torch has deprecated, and torch warns at every call.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    if settings.backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // settings.ranks))
        device = torch.device("cpu")
    dist.init_process_group(settings.backend, init_method=f"file://{store_path}", rank=rank,
                            world_size=settings.ranks, timeout=datetime.timedelta(minutes=10))
    return device


def memory_worker(rank: int, settings: Settings, store_path: str, memory_path: str) -> None:
    """One rank of the memory launch (section 4); rank 0 writes the measurements to ``memory_path``."""
    device = start_rank(rank, settings, store_path)
    if device.type == "cpu":
        map_every_large_block()
    try:
        memory = measure_memory(settings, device)
        gc.collect()  # models go before process groups, as in ``worker``
        if rank == 0:
            Path(memory_path).write_text(json.dumps(memory))
    finally:
        dist.destroy_process_group()


def worker(rank: int, settings: Settings, store_path: str, memory_path: str) -> None:
    """One rank of the timed launch: sections 1-3; rank 0 adds section 4 from ``memory_path`` and writes the
    results."""
    started = time.perf_counter()
    load_start = os.getloadavg()
    device = start_rank(rank, settings, store_path)
    try:
        engine_info, measured = measure(settings, device, started)
        # Every model is gone before the process groups are: a DDP reducer that outlives destroy_process_group
        # ends its gloo group itself, holding the GIL, and deadlocks when a gloo thread still has to release
        # a tensor of the last collective (seen under heavy load).
        gc.collect()
        runtime = max(gather([time.perf_counter() - started]))[0]
        if rank == 0:
            data = {
                "benchmark": "overhead",
                "engine": engine_info,
                "machine": machine_info(settings, device),
                "settings": asdict(settings),
                "model_params": sum(p.numel() for p in build_model(settings, torch.device("cpu")).parameters()),
                "load_average": {"start": [round(v, 2) for v in load_start],
                                 "end": [round(v, 2) for v in os.getloadavg()]},
                "runtime_s": runtime,
                "noise_note": noise_note(settings),
                "targets_step_overhead": {f"T{t}": v for t, v in TARGETS.items()},
            }
            for part, memory in json.loads(Path(memory_path).read_text()).items():
                measured[part]["memory"] = memory
            if settings.stages:
                data["stages"] = measured
            else:
                data.update(measured[""])
            out = Path(settings.out)
            out.mkdir(parents=True, exist_ok=True)
            where = "gpu" if device.type == "cuda" else "cpu"
            stages = "" if settings.stages in ((), DEEPSPEED_STAGES) else "_zero" + "".join(map(str, settings.stages))
            stem = f"overhead_{settings.engine}{stages}_{where}{'_quick' if settings.quick else ''}"
            (out / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
            write_markdown(out / f"{stem}.md", data)
            print(f"wrote {out / stem}.json and .md in {runtime:.0f} s")
    finally:
        dist.destroy_process_group()


def measure(settings: Settings, device: torch.device, started: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Sections 1-3 of every engine part (keyed by ``Engine.part``) and what names the engine."""
    engines = build_engines(settings, device)
    # Every baseline comes before any HDET variant: DeepSpeed keeps the model-parallel unit process-wide, so a
    # plain engine built after an HDET engine would shard over that engine's replica only.
    plains = [engine.plain_trainer() for engine in engines]
    idle_plain_optimizers = [engine.plain_trainer().optimizer for engine in engines]  # for the LR-hook timing
    trainer_groups = [[plain, *hdet_trainers(settings, engine)] for engine, plain in zip(engines, plains, strict=True)]
    warmup = run_step_benchmark(settings, [trainer for group in trainer_groups for trainer in group], device)
    progress(started, "step time")
    measured = {}
    for engine, trainers, idle_plain in zip(engines, trainer_groups, idle_plain_optimizers, strict=True):
        hooks = hook_overhead(settings, engine, idle_plain)
        steps = analyse_steps(settings, trainers, warmup)
        sync = run_sync_benchmark(settings, engine, device)
        measured[engine.part] = {
            "step_time": steps,
            "hook_overhead": hooks,
            "sync_time": sync,
            "estimated_overhead": estimates(steps, sync, hooks, settings.sync_intervals,
                                            gradient_average=engine.gradient_average_in_hot_path),
            "bytes": run_bytes(settings, engine, device, trainers[1].reports),
        }
        progress(started, " ".join(filter(None, (engine.part, "sync time and bytes"))))
    engine = engines[0]
    engine_info = {"name": settings.engine, "title": engine.title, "baseline": engine.baseline,
                   "local_mode_note": engine.local_mode_note, "memory_note": engine.memory_note,
                   "gradient_average_in_hot_path": engine.gradient_average_in_hot_path}
    return engine_info, measured


def progress(started: float, section: str) -> None:
    """Rank 0 prints the elapsed time after each section."""
    if dist.get_rank() == 0:
        print(f"[{time.perf_counter() - started:6.1f} s] {section} done", flush=True)


def noise_note(settings: Settings) -> str:
    if settings.backend == "nccl":
        return ("GPU timings include a CUDA synchronize at the end of every step; ratios come from variants "
                "interleaved in the same run.")
    cores = os.cpu_count() or 1
    return (f"{settings.ranks} gloo ranks share {cores} CPU core(s) with whatever else runs on the machine, so "
            "step times swing by several percent from block to block. The ratios compare variants interleaved "
            "in the same run and the IQRs show the spread; a 1% or 0.2% overhead is below what the direct "
            "ratios can resolve here, which is what the estimate from components is for.")


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        memory_path = os.path.join(tmp, "memory.json")
        mp.spawn(memory_worker, args=(settings, os.path.join(tmp, "memory_store"), memory_path),
                 nprocs=settings.ranks, join=True)
        mp.spawn(worker, args=(settings, os.path.join(tmp, "store"), memory_path), nprocs=settings.ranks, join=True)


if __name__ == "__main__":
    main()
