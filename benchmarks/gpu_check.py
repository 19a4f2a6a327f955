"""One command for a lent GPU: what HDET costs on CUDA, per step, per sync and in memory, and whether it makes the
host wait for the device between syncs. The same code runs on the CPU (``--device cpu``), so it cannot rot between
GPU loans.

    PYTHONPATH=$PWD PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out "$OUT/gpu_check"  # one GPU, ~6 min
    python3 benchmarks/gpu_check.py --device cpu --quick --out /tmp/gpu_check   # the dry run (benchmarks/tests)

Each engine and preset runs in processes of its own (a failure or a hang there costs only that run), each section
of a run apart (one that fails on any rank is recorded as failed on every rank, the others go on), and the results
so far are written after every section, so a run stopped at its time limit keeps what it measured. ``--budget_s``
(default 480) skips what would start after it, and the final files are written in any case.

Two ranks share the device over gloo (NCCL refuses two ranks on one GPU), each rank a replica, global gradient
mode, bf16 (autocast around DDP's forward; FSDP2's ``MixedPrecisionPolicy``), the library's default controller
moving at every sync with a probe batch. The two ranks' kernels share the device, and gloo carries every
gradient through host memory: step times are those of this setting, not of a cluster (hence the compute-only
baseline below). For each engine (DDP, FSDP2) and preset:

1. **Step time.** Plain training (DDP over both ranks; FSDP2: native HSDP on the same (2, 1) mesh), the same
   without its gradient transfer (the compute a step costs where the transfer is free: DDP's ``no_sync``, FSDP2
   over each rank alone) and HDET at T = 10 take alternate steps on the same batches. Each step is timed in
   three parts with the device drained at each boundary: forward and backward (the gradient all-reduce, the same
   bytes in plain and HDET), ``optimizer.step()``
   (with HDET's LR hooks) and ``hdet.step(loss)``; the slowest rank's time counts. HDET's own work per step
   between syncs is the paired difference of the first two parts plus ``hdet.step``; a sync's own work is its
   time less one flat all-reduce of the same bytes over the same ranks (the transfer). The ratio at T = 10,
   100 and 1000 is (plain step + own work + sync / T) / plain step, and the same with the sync's own work only;
   over the compute-only step, (compute step + own work + the sync's own work / T) / compute step.
2. **Host-device synchronization** between syncs (CUDA only): ``torch.cuda.set_sync_debug_mode("warn")``
   around ``optimizer.step()`` (HDET's LR hooks) and ``hdet.step`` in the eight steps after a sync's first (the
   averaged-weight window's among them), for plain and HDET,
   and around HDET's gradient average (the body of its DDP comm hook and FSDP2 all-reduce hook) on a bucket of
   25 MiB over a group of one rank under NCCL. Forward and backward are not checked as a whole: gloo's own CUDA
   path synchronizes inside every all-reduce, plain or HDET.
3. **Peak GPU memory** (CUDA only): each of plain, HDET and HDET without the averaged-weight window trained
   through a sync once unmetered (one-time allocations such as cuBLAS's workspace), then again from a fresh
   model on a clean allocator; the peak above the allocator's start, per rank.
4. **DDP's gradient hook** (DDP only): forward and backward with DDP's built-in C++ all-reduce, with the same
   and a finiteness check of the averaged gradients that decides whether the step runs (the guard without a
   Python hook: it skips every replica's step when any one replica's gradient is non-finite; the device is
   drained at every timing boundary, so its host synchronization's cost in a real loop does not show), with
   torch's own Python ``allreduce_hook`` (what any Python hook costs) and with HDET's replica-safe mean
   (``healthy_mean_hook``), on alternate steps over the same batches; the slowest rank's median of each, the
   paired medians of each over the built-in all-reduce and of HDET's hook over torch's. Last in each run (and
   left out with ``--no_profile``), every rank profiles three passes with each after one warm-up pass, and rank
   0's profile is kept (``hook_profile.py``): the operations whose self time, on the host and on the device,
   differs most between HDET's hook and torch's.
5. **The sync's local work** (rank 0 alone, on a group of one rank, so nothing crosses a wire): averaging the
   preset's fp32 parameters as a sync does (``average_tensors`` with the finiteness check: packing, the check,
   the division while unpacking), less one flat all-reduce of the same bytes on that group, over one
   device-to-device copy of the same bytes. ``comm_model.py`` uses this ratio in place of the CPU's.

Writes ``<out>.json`` and ``<out>.md`` (default ``$OUT/gpu_check`` where the device machine sets ``OUT``, else
``benchmarks/results/gpu_check``; a CPU run defaults to ``gpu_check_cpu``); ``<out>_partial.json`` holds the
results so far while it runs, and a record whose run did not finish says so (``incomplete``). What the numbers
mean is written by hand into the Markdown's note blocks, which a rewrite keeps.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shlex
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import RESULTS, MiB, machine_info, note, save_markdown, table_header, table_row, write_json
from hook_profile import profile_hooks, profile_markdown
from overhead_engines import DEFAULT_CONTROLLER
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from hdet_scale import HDETConfig, HDETEnsemble, ReplicaTopology
from hdet_scale.averaging import average_tensors
from hdet_scale.comm import HealthyMean, all_finite, free_port, healthy_mean_hook
from hdet_scale.engines import ddp, fsdp
from hdet_scale.lm.model import build_model, next_token_loss
from hdet_scale.param_groups import transformer_blocks
from hdet_scale.probe import batch_probe

RANKS = 2
SYNC_INTERVAL = 10
AMORTIZED_AT = (10, 100, 1000)
BUCKET_BYTES = 25 * MiB  # the library's default bucket_mb
COPIES_PER_TIMING = 20  # device-to-device copies timed together for the copy baseline
VOCAB = 256


@dataclass(frozen=True)
class Settings:
    """What every rank needs (picklable for the spawned ranks)."""

    device: str
    presets: tuple[str, ...]
    engines: tuple[str, ...]
    steps: int
    warmup: int
    batch: int
    seq_len: int
    reps: int
    debug_steps: int
    deadline: float  # time.time() after which no section starts
    profile: bool


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--presets", nargs="+", default=None, help="model presets (default: small 125m; "
                                                                   "--quick: tiny)")
    parser.add_argument("--engines", nargs="+", choices=("ddp", "fsdp"), default=["ddp", "fsdp"])
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each variant")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--reps", type=int, default=20, help="repetitions of each local-work timing")
    parser.add_argument("--quick", action="store_true", help="a dry run: preset tiny, few steps, short sequences")
    parser.add_argument("--out", type=Path, default=None, help="results stem (.json, .md; default $OUT/gpu_check "
                                                               "where OUT is set)")
    parser.add_argument("--budget_s", type=float, default=480.0, help="no section starts after this many seconds")
    parser.add_argument("--no_profile", action="store_true", help="leave out the profile of DDP's gradient hooks")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible; use --device cpu for the dry run")
    if args.quick:
        args.presets = args.presets or ["tiny"]
        args.steps, args.batch, args.seq_len, args.reps = min(args.steps, 10), 2, 32, 3
    args.presets = args.presets or ["small", "125m"]
    stem = "gpu_check" if args.device == "cuda" else "gpu_check_cpu"
    args.out = args.out or (Path(os.environ["OUT"]) / stem if os.environ.get("OUT") else RESULTS / stem)
    return args


# ------------------------------------------------------------------------------------------ device helpers
def drain(device: torch.device) -> None:
    """Waits for the device's queued work (a step boundary of the timings)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(device: torch.device, work: Callable[[], Any], reps: int) -> float:
    """The median wall time of ``work`` over ``reps`` runs after one untimed run, the device drained around each."""
    work()
    times = []
    for _ in range(reps):
        drain(device)
        start = time.perf_counter()
        work()
        drain(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gathered(values: list[float]) -> list[list[float]]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, values)
    return out


def slowest_rank(values: list[float]) -> list[float]:
    """Per index, the largest of the ranks' values (collective)."""
    return [max(column) for column in zip(*gathered(values), strict=True)]


# ----------------------------------------------------------------------------------------------- variants
@dataclass
class Variant:
    """One training loop: a model, its AdamW and (for HDET) its ensemble."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    hdet: HDETEnsemble | None
    autocast: bool
    guarded: bool = False  # the step runs only when every averaged gradient is finite (section 4)
    no_transfer: bool = False  # its gradients are not averaged across the ranks (the compute-only baseline)


class Builder:
    """Builds fresh variants of one engine and preset (the same initial weights every time)."""

    def __init__(self, engine: str, preset: str, settings: Settings, device: torch.device) -> None:
        self.engine, self.preset, self.settings, self.device = engine, preset, settings, device
        self.mesh = None
        if engine == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(device.type, (RANKS, 1), mesh_dim_names=("replicate", "shard"))
        generator = torch.Generator().manual_seed(1000 + dist.get_rank())  # each rank its own data
        self.batches = [self._batch(generator) for _ in range(4)]
        self.probe_batch = self._batch(torch.Generator().manual_seed(2000))

    def _batch(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, VOCAB, (self.settings.batch, self.settings.seq_len + 1), generator=generator)
        return tokens[:, :-1].to(self.device), tokens[:, 1:].to(self.device)

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return build_model(self.preset, vocab_size=VOCAB, seq_len=self.settings.seq_len).to(self.device)

    def mixed_precision(self) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def plain(self, name: str = "plain", *, no_transfer: bool = False) -> Variant:
        model = self.model()
        if self.engine == "ddp":
            kwargs = {"device_ids": [self.device]} if self.device.type == "cuda" else {}
            model = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
        else:
            from torch.distributed.fsdp import fully_shard

            # without the transfer: FSDP2 over this rank alone (the mesh's shard dimension), which sends nothing
            mesh = self.mesh["shard"] if no_transfer else self.mesh
            for block in transformer_blocks(model):
                fully_shard(block, mesh=mesh, mp_policy=self.mixed_precision())
            fully_shard(model, mesh=mesh, mp_policy=self.mixed_precision())
        return Variant(name, model, torch.optim.AdamW(model.parameters(), lr=1e-4), None, self.engine == "ddp",
                       no_transfer=no_transfer)

    def hdet(self, name: str = "hdet", **auto_lr: Any) -> Variant:
        config = HDETConfig.from_dict({"sync_interval": SYNC_INTERVAL, "ranks_per_replica": 1,
                                       "gradient_mode": "global", "auto_lr": {**DEFAULT_CONTROLLER, **auto_lr}})
        if self.engine == "ddp":
            kwargs = {"device_ids": [self.device]} if self.device.type == "cuda" else {}
            topology = ReplicaTopology.build(config)
            model = ddp.wrap_model(self.model(), config, topology, **kwargs)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            ensemble = ddp.attach(model, optimizer, config, topology=topology)
        else:
            model, handle = fsdp.wrap(self.model(), config, mp_policy=self.mixed_precision(), mesh=self.mesh)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            ensemble = handle.attach(optimizer)
        variant = Variant(name, model, optimizer, ensemble, self.engine == "ddp")
        ensemble.set_probe(batch_probe(model, self.probe_batch, lambda m, b: self.loss(variant, b)))
        return variant

    def loss(self, variant: Variant, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        context = torch.autocast(self.device.type, dtype=torch.bfloat16) if variant.autocast \
            else contextlib.nullcontext()
        with context:
            return next_token_loss(variant.model, *batch)


@dataclass
class StepTimes:
    forward_backward: float
    optimizer: float
    hdet: float
    sync_bytes: int | None  # the bytes a sync at this step averaged; None between syncs


def forward_backward(builder: Builder, variant: Variant, batch: tuple[torch.Tensor, torch.Tensor]
                     ) -> tuple[torch.Tensor, bool]:
    """The loss after forward and backward, and whether the optimizer may step: always, or for a guarded
    variant only when every averaged gradient is finite (decided on the host here; a fused optimizer could skip
    on the device instead)."""
    variant.optimizer.zero_grad(set_to_none=True)
    skips_transfer = variant.no_transfer and isinstance(variant.model, torch.nn.parallel.DistributedDataParallel)
    with variant.model.no_sync() if skips_transfer else contextlib.nullcontext():  # FSDP2's is over one rank
        loss = builder.loss(variant, batch)
        loss.backward()
    may_step = not variant.guarded or all_finite(
        [param.grad for param in variant.model.parameters() if param.grad is not None])
    return loss, may_step


def timed_step(builder: Builder, variant: Variant, index: int,
               region: Callable[[str], contextlib.AbstractContextManager] | None = None) -> StepTimes:
    """One training step, timed in three parts with the device drained at each boundary; ``region(part)``
    wraps each part (the synchronization check)."""
    region = region or (lambda part: contextlib.nullcontext())
    batch = builder.batches[index % len(builder.batches)]
    drain(builder.device)
    start = time.perf_counter()
    with region("forward_backward"):
        loss, may_step = forward_backward(builder, variant, batch)
    drain(builder.device)
    backward_done = time.perf_counter()
    with region("optimizer"):
        if may_step:
            variant.optimizer.step()
    drain(builder.device)
    optimizer_done = time.perf_counter()
    report = None
    if variant.hdet is not None:
        with region("hdet_step"):
            report = variant.hdet.step(loss.detach())
    drain(builder.device)
    return StepTimes(backward_done - start, optimizer_done - backward_done, time.perf_counter() - optimizer_done,
                     None if report is None else report.bytes_averaged)


# ------------------------------------------------------------------------------------------- 1. step time
def step_time(builder: Builder, settings: Settings) -> dict[str, Any]:
    """Plain, plain without its gradient transfer and HDET on alternate steps; HDET's own work between syncs and
    per sync, and the ratios over the plain step and over the compute-only one."""
    plain, compute, hdet = builder.plain(), builder.plain("compute_only", no_transfer=True), builder.hdet()
    steps: dict[str, list[StepTimes]] = {"plain": [], "compute_only": [], "hdet": []}
    for index in range(settings.warmup + settings.steps):
        for variant in (plain, compute, hdet):
            times = timed_step(builder, variant, index)
            if index >= settings.warmup:
                steps[variant.name].append(times)
    parts = {name: {part: slowest_rank([getattr(t, part) for t in times]) for part in
                    ("forward_backward", "optimizer", "hdet")} for name, times in steps.items()}
    synced = [t.sync_bytes is not None for t in steps["hdet"]]
    def whole_steps(name: str) -> list[float]:
        return [fb + opt for fb, opt in zip(parts[name]["forward_backward"], parts[name]["optimizer"], strict=True)]

    plain_step, compute_step = whole_steps("plain"), whole_steps("compute_only")
    between = [i for i, s in enumerate(synced) if not s]
    at_sync = [i for i, s in enumerate(synced) if s]

    def paired(part: str) -> float:
        return statistics.median(parts["hdet"][part][i] - parts["plain"][part][i] for i in between)

    # hdet.step's mean, not median: the averaged-weight window works in a fixed share of the steps
    own = {"forward_backward": paired("forward_backward"), "optimizer": paired("optimizer"),
           "hdet_step": statistics.fmean(parts["hdet"]["hdet"][i] for i in between)}
    sync = statistics.median(parts["hdet"]["hdet"][i] for i in at_sync) if at_sync else float("nan")
    sync_bytes = max((t.sync_bytes or 0 for t in steps["hdet"]), default=0)
    flat = torch.zeros(max(1, sync_bytes // 4), device=builder.device)
    transfer = max(slowest_rank([median_seconds(builder.device, lambda: dist.all_reduce(flat), settings.reps)]))
    plain_median, compute_median = statistics.median(plain_step), statistics.median(compute_step)
    own_step, own_sync = sum(own.values()), max(0.0, sync - transfer)
    result = {
        "plain_step_ms": 1e3 * plain_median,
        "hdet_step_between_syncs_ms": 1e3 * statistics.median(
            parts["hdet"]["forward_backward"][i] + parts["hdet"]["optimizer"][i] + parts["hdet"]["hdet"][i]
            for i in between),
        "own_work_per_step_ms": {part: 1e3 * value for part, value in own.items()},
        "sync_ms": 1e3 * sync, "sync_bytes": sync_bytes, "flat_all_reduce_ms": 1e3 * transfer,
        "syncs_timed": len(at_sync), "steps_timed": len(synced),
        "ratio": {str(t): (plain_median + own_step + sync / t) / plain_median for t in AMORTIZED_AT},
        "ratio_own_work_only": {str(t): (plain_median + own_step + own_sync / t) / plain_median
                                for t in AMORTIZED_AT},
        "compute_step_ms": 1e3 * compute_median,
        "ratio_over_compute": {str(t): (compute_median + own_step + own_sync / t) / compute_median
                               for t in AMORTIZED_AT},
    }
    for variant in (plain, hdet):
        if variant.hdet is not None:
            variant.hdet.close()
    return result


# ---------------------------------------------------------------------------- 2. host-device synchronization
UNCHECKED_PART = "forward_backward"
"""The part of a step not checked in place: gloo's CUDA all-reduce inside it synchronizes, plain or HDET."""


class SyncWatch:
    """Records every host-device synchronization inside a part of a step (CUDA's sync debug mode as "warn": the
    part runs on as it would, and each synchronizing call is noted where it is made)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.found: dict[str, list[str]] = {}

    @contextlib.contextmanager
    def region(self, part: str) -> Iterator[None]:
        if part == UNCHECKED_PART:
            yield
            return

        def noted(message: Any, *_: Any, **__: Any) -> None:  # warnings' own display, called where the warning is
            if "synchroniz" in str(message):
                self.found.setdefault(part, []).append(where(traceback.extract_stack()[:-1], str(message)))

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = noted
            if self.device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                if self.device.type == "cuda":
                    torch.cuda.set_sync_debug_mode(0)


def where(frames: traceback.StackSummary, message: str) -> str:
    """The innermost frame of ``frames`` in hdet_scale (else the innermost outside the warnings machinery), as
    file:line, and the message."""
    frames = [frame for frame in frames if Path(frame.filename).name != "warnings.py"]
    ours = [frame for frame in frames if "hdet_scale" in frame.filename]
    frame = (ours or list(frames))[-1]
    return f"{Path(frame.filename).name}:{frame.lineno}: {message.splitlines()[0]}"


def synchronizations(builder: Builder, settings: Settings, alone: dist.ProcessGroup) -> dict[str, Any]:
    """The synchronizations of plain and HDET in the steps after a sync, and of HDET's gradient average on a
    group of this rank alone (CUDA only)."""
    if builder.device.type != "cuda":
        return {"checked": False, "why": "CUDA's sync debug mode needs a GPU"}
    result: dict[str, Any] = {"checked": True, "steps": settings.debug_steps}
    watch, average = SyncWatch(builder.device), HealthyMean(alone)
    bucket = torch.randn(BUCKET_BYTES // 4, device=builder.device)
    average(bucket)  # unwatched: NCCL sets its communicator up on first use
    drain(builder.device)
    with watch.region("gradient_average"):
        average(bucket)
    drain(builder.device)
    result["gradient_average"] = watch.found.get("gradient_average", [])
    for variant in (builder.plain(), builder.hdet()):
        for index in range(SYNC_INTERVAL + 1):  # through the first sync
            timed_step(builder, variant, index)
        watch = SyncWatch(builder.device)
        for index in range(settings.debug_steps):
            timed_step(builder, variant, index, watch.region)
        result[variant.name] = {part: sorted(set(places)) for part, places in watch.found.items()}
        if variant.hdet is not None:
            variant.hdet.close()
    return result


def measured_peak(builder: Builder, make: Callable[[], Variant]) -> tuple[str, float]:
    """A fresh variant's name and its peak allocated MiB above the start, trained through one sync."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(builder.device)
    start = torch.cuda.memory_allocated(builder.device)
    variant = make()
    for index in range(SYNC_INTERVAL + 2):
        timed_step(builder, variant, index)
    peak = (torch.cuda.max_memory_allocated(builder.device) - start) / MiB
    if variant.hdet is not None:
        variant.hdet.close()
    return variant.name, peak


# ---------------------------------------------------------------------------------------------- 3. memory
def peak_memory(builder: Builder) -> dict[str, Any]:
    """Each variant's peak allocated memory above a clean allocator's start, trained through one sync (CUDA)."""
    if builder.device.type != "cuda":
        return {"checked": False, "why": "the caching allocator's statistics need a GPU"}
    result: dict[str, Any] = {"checked": True}
    for make in (builder.plain, builder.hdet, lambda: builder.hdet("hdet_no_window", average_window=0.0)):
        measured_peak(builder, make)  # unmetered: one-time allocations are not the variant's
        name, peak = measured_peak(builder, make)
        result[name + "_mib"] = max(slowest_rank([peak]))
    extra = result["hdet_mib"] - result["plain_mib"]
    result["hdet_over_plain"] = result["hdet_mib"] / result["plain_mib"]
    result["window_share_of_extra"] = (result["hdet_mib"] - result["hdet_no_window_mib"]) / extra if extra > 0 \
        else None
    return result


# ------------------------------------------------------------------------------------- 4. DDP's gradient hook
GRADIENT_HOOKS = ("built_in", "built_in_guarded", "python_allreduce_hook", "hdet_healthy_mean")
"""DDP's gradient average four ways: its C++ all-reduce, the same with a finiteness guard before the step,
torch's Python ``allreduce_hook``, HDET's hook."""


def gradient_hooks(builder: Builder, settings: Settings) -> dict[str, Any]:
    """Forward and backward of plain DDP with each of ``GRADIENT_HOOKS`` on alternate steps over the same batches:
    the slowest rank's median (ms) and the paired medians of each over the built-in all-reduce and of HDET's hook
    over torch's Python hook."""
    variants = hook_variants(builder)
    times: dict[str, list[float]] = {name: [] for name in GRADIENT_HOOKS}
    for index in range(settings.warmup + settings.steps):
        for variant in variants:
            step = timed_step(builder, variant, index)
            if index >= settings.warmup:
                times[variant.name].append(step.forward_backward)
    slowest = {name: slowest_rank(values) for name, values in times.items()}
    result: dict[str, Any] = {f"{name}_ms": 1e3 * statistics.median(values) for name, values in slowest.items()}
    pairs = [(name, "built_in") for name in GRADIENT_HOOKS[1:]] + [("hdet_healthy_mean", "python_allreduce_hook")]
    for after, before in pairs:
        result[f"{after}_over_{before}_ms"] = 1e3 * statistics.median(
            a - b for a, b in zip(slowest[after], slowest[before], strict=True))
    return result


def hook_variants(builder: Builder) -> list[Variant]:
    """Plain DDP with each of ``GRADIENT_HOOKS``."""
    variants = []
    for name in GRADIENT_HOOKS:
        variant = builder.plain(name)
        variant.guarded = name == "built_in_guarded"
        if name == "python_allreduce_hook":
            variant.model.register_comm_hook(None, allreduce_hook)
        elif name == "hdet_healthy_mean":
            variant.model.register_comm_hook(HealthyMean(None), healthy_mean_hook)
        variants.append(variant)
    return variants


def hook_profile(builder: Builder) -> dict[str, Any]:
    """Rank 0's profile of a few forward and backward passes with each of ``GRADIENT_HOOKS`` (``hook_profile.py``)."""
    variants = hook_variants(builder)

    def profiled_pass(hook: int, index: int) -> None:
        forward_backward(builder, variants[hook], builder.batches[index % len(builder.batches)])
        drain(builder.device)

    return profile_hooks(GRADIENT_HOOKS, profiled_pass, builder.device)


# ------------------------------------------------------------------------------------------ 5. local work
def local_work(preset: str, settings: Settings, device: torch.device, group: dist.ProcessGroup) -> dict[str, Any]:
    """Rank 0's sync of the preset's fp32 parameters on a group of itself alone (no wire), against one flat
    all-reduce of the same bytes on that group and one device-to-device copy of them."""
    torch.manual_seed(0)
    tensors = [p.data for p in build_model(preset, vocab_size=VOCAB, seq_len=settings.seq_len).to(device).parameters()]
    numel = sum(t.numel() for t in tensors)
    flat, copy = torch.zeros(numel, device=device), torch.empty(numel, device=device)
    memory: list[torch.Tensor] = []
    times = {
        # several copies a timing: one small copy is a launch and a synchronization, not the copy's bandwidth
        "copy": median_seconds(device, lambda: [copy.copy_(flat) for _ in range(COPIES_PER_TIMING)],
                               settings.reps) / COPIES_PER_TIMING,
        "flat_all_reduce": median_seconds(device, lambda: dist.all_reduce(flat, group=group), settings.reps),
        "average_tensors": median_seconds(device, lambda: average_tensors(
            tensors, group, bucket_bytes=BUCKET_BYTES, skip_non_finite=True, memory=memory), settings.reps),
    }
    local = max(0.0, times["average_tensors"] - times["flat_all_reduce"])
    return {"bytes": numel * 4, **{f"{name}_ms": 1e3 * value for name, value in times.items()},
            "local_work_ms": 1e3 * local, "local_work_over_copy": local / times["copy"],
            "copy_bytes_per_s": 2 * numel * 4 / times["copy"]}


# -------------------------------------------------------------------------------------------------- ranks
COLLECTIVE_TIMEOUT = timedelta(seconds=90)
"""Long enough for any collective of a 125m model over gloo, short enough that a rank left waiting by a rank that
failed alone costs a run little of the budget."""
BUDGET_EXHAUSTED = "the time budget (--budget_s) ran out before it started"


def sections(engine: str, settings: Settings) -> dict[str, Callable[[Builder, Settings, dist.ProcessGroup], Any]]:
    """A run's sections in their order: the step time first (the numbers a user wants most), the profile last."""
    found: dict[str, Callable[[Builder, Settings, dist.ProcessGroup], Any]] = {
        "step_time": lambda builder, settings, alone: step_time(builder, settings),
        "memory": lambda builder, settings, alone: peak_memory(builder),
        "synchronizations": synchronizations,
    }
    if engine == "ddp":
        found["gradient_hooks"] = lambda builder, settings, alone: gradient_hooks(builder, settings)
        if settings.profile:
            found["hook_profile"] = lambda builder, settings, alone: hook_profile(builder)
    return found


def agreed(work: Callable[..., Any], *args: Any) -> Any:
    """``work(*args)`` on every rank; where it failed on any rank, ``{"error": ...}`` on every rank (collective:
    every rank learns of the others' failures, so all go on to the next section together)."""
    try:
        result, failure = work(*args), None
    except Exception as error:  # noqa: BLE001 - one failing section must not cost the others' results
        result, failure = None, "".join(traceback.format_exception_only(error)).strip()
        print(f"rank {dist.get_rank()} failed: {failure}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    failures = gathered(failure)
    first = next(((rank, text) for rank, text in enumerate(failures) if text is not None), None)
    return result if first is None else {"error": f"rank {first[0]}: {first[1]}"}


def groups_of_one_rank(device: torch.device) -> list[dist.ProcessGroup]:
    """A group of each rank alone (NCCL on a GPU: section 2's gradient average, section 5's sync)."""
    return [dist.new_group([member], backend="nccl" if device.type == "cuda" else "gloo") for member in range(RANKS)]


def none(*_: Any) -> None:
    """What a rank without a part in a section does."""


def run_rank(rank: int, settings: Settings, port: int, job: tuple[str, ...], piece: str) -> None:
    """One job on one rank: ``("local_work",)`` (section 5, every preset) or ``(engine, preset)`` (sections 1-4),
    rank 0 writing what is done to ``piece`` after every section."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS, timeout=COLLECTIVE_TIMEOUT)
    device = torch.device(settings.device, 0) if settings.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    done: dict[str, Any] = {}

    def write() -> None:
        if rank == 0:
            Path(piece).write_text(json.dumps(done))

    alone = agreed(groups_of_one_rank, device)
    if isinstance(alone, dict):  # the groups of one rank failed: nothing here can run
        done["error"] = alone["error"]
    elif job == ("local_work",):
        for preset in settings.presets:
            done[preset] = agreed(local_work if rank == 0 else none, preset, settings, device, alone[0])
            write()
    else:
        engine, preset = job
        builder = agreed(Builder, engine, preset, settings, device)
        if isinstance(builder, dict):
            done["error"] = builder["error"]
        else:
            for name, section in sections(engine, settings).items():
                started = time.perf_counter()
                if time.time() > settings.deadline:
                    done[name] = {"skipped": BUDGET_EXHAUSTED}
                    continue
                done[name] = agreed(section, builder, settings, alone[rank])
                if rank == 0:
                    print(f"{engine}/{preset} {name}: {time.perf_counter() - started:.0f} s", flush=True)
                write()
    write()
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ report
def measured(run: dict[str, Any], section: str) -> dict[str, Any] | None:
    """A run's section where it was measured; None where it failed, was skipped or does not exist."""
    found = run.get(section)
    return found if isinstance(found, dict) and not {"error", "skipped"} & found.keys() else None


def failures(record: dict[str, Any]) -> list[str]:
    """One line for each job, run or section that did not finish."""
    lines = [f"- {line}" for line in record.get("incomplete", [])]
    lines += [f"- the sync's local work on `{preset}`: {work['error']}" for preset, work in record["local_work"].items()
              if "error" in work]
    for name, run in record["runs"].items():
        if "error" in run:
            lines.append(f"- `{name}` failed: {run['error']}")
        for section, found in run.items():
            if isinstance(found, dict) and {"error", "skipped"} & found.keys():
                lines.append(f"- `{name}` {section}: {found.get('error') or found.get('skipped')}")
    return lines


def markdown(record: dict[str, Any]) -> list[str]:
    m, s = record["machine"], record["settings"]
    device = m.get("gpu") or "the CPU (a dry run: the timings say nothing about a GPU)"
    lines = ["# HDET on a GPU: step time, host synchronization, memory and the sync's local work", "",
             f"Device: {device}; torch {m['torch']}, {m['date']}. {RANKS} ranks share it over gloo, each a "
             f"replica (global gradient mode), bf16, batch {s['batch']} x {s['seq_len']} tokens per rank, the "
             "library's default controller moving at every sync with a probe batch. The two ranks' kernels share "
             "the device and gloo carries the gradients through host memory: the plain step is mostly that "
             "transfer, hence the ratios over the compute-only step too. Command: "
             f"`{record['command']}`. How each number is measured: the docstring of `benchmarks/gpu_check.py`.", "",
             "## Step time and the amortized sync", "",
             "Baselines: plain training on the same ranks (DDP over both ranks; FSDP2: native HSDP on the same "
             "mesh), and the same step without its gradient transfer (compute only). Own work: HDET's extra time "
             "in a step between syncs (paired medians). Sync: `hdet.step` on a sync step; transfer: one flat "
             "all-reduce of the sync's bytes over the same ranks.", "",
             *table_header("engine / preset", "plain step ms", "compute-only step ms", "HDET step between syncs ms",
                           "own work per step ms", "sync ms (transfer ms)",
                           *(f"HDET / plain at T = {t}" for t in AMORTIZED_AT),
                           *(f"own work only, T = {t}" for t in AMORTIZED_AT),
                           *(f"own work / compute-only step, T = {t}" for t in AMORTIZED_AT))]
    for name, run in record["runs"].items():
        t = measured(run, "step_time")
        if t is None:
            continue
        own = t["own_work_per_step_ms"]
        lines.append(table_row(name, f"{t['plain_step_ms']:.2f}", f"{t['compute_step_ms']:.2f}",
                               f"{t['hdet_step_between_syncs_ms']:.2f}",
                               f"{sum(own.values()):+.3f} (fwd/bwd {own['forward_backward']:+.3f}, optimizer "
                               f"{own['optimizer']:+.3f}, hdet.step {own['hdet_step']:.3f})",
                               f"{t['sync_ms']:.1f} ({t['flat_all_reduce_ms']:.1f})",
                               *(f"{t['ratio'][str(x)]:.4f}" for x in AMORTIZED_AT),
                               *(f"{t['ratio_own_work_only'][str(x)]:.4f}" for x in AMORTIZED_AT),
                               *(f"{t['ratio_over_compute'][str(x)]:.4f}" for x in AMORTIZED_AT)))
    failed = failures(record)
    if failed:
        lines += ["", "Not measured:", "", *failed]
    lines += ["", "## Host-device synchronization between syncs", ""]
    for name, run in record["runs"].items():
        sync = measured(run, "synchronizations")
        if sync is None:
            continue
        if not sync["checked"]:
            lines.append(f"- `{name}`: not checked ({sync['why']}).")
            continue
        for variant in ("plain", "hdet"):
            found = sync[variant]
            lines.append(f"- `{name}` {variant}, optimizer.step and hdet.step: " + ("none" if not found else
                         "; ".join(f"{part}: {', '.join(places)}" for part, places in found.items())))
        lines.append(f"- `{name}` HDET's gradient average (one rank, NCCL): "
                     + (", ".join(sync["gradient_average"]) or "none"))
    lines += ["", "## Peak memory per rank", "",
              *table_header("engine / preset", "plain MiB", "HDET MiB", "HDET without the window MiB",
                            "HDET / plain", "window's share of HDET's extra")]
    for name, run in record["runs"].items():
        memory = measured(run, "memory") or {}
        if memory.get("checked"):
            share = memory["window_share_of_extra"]
            lines.append(table_row(name, f"{memory['plain_mib']:.1f}", f"{memory['hdet_mib']:.1f}",
                                   f"{memory['hdet_no_window_mib']:.1f}", f"{memory['hdet_over_plain']:.3f}",
                                   "-" if share is None else f"{share:.0%}"))
    lines += ["", "## DDP's gradient average: what the hook costs", "",
              "Forward and backward of plain DDP (no ensemble) on the same batches, four ways to average the "
              "gradients: the built-in C++ all-reduce; the same with a finiteness check of the averaged gradients "
              "that decides whether the step runs (the guard without a Python hook, which skips every replica's "
              "step when one replica's gradient is non-finite); torch's Python `allreduce_hook`; HDET's "
              "replica-safe hook. Differences are paired medians (ms, and % of the built-in pass).", "",
              *table_header("engine / preset", "built-in C++ all-reduce ms", "guard before the step over built-in",
                            "Python hook over built-in", "HDET's hook over built-in", "HDET's hook over Python hook")]

    def difference(hooks: dict[str, float], key: str) -> str:
        return f"{hooks[key]:+.3f} ms ({hooks[key] / hooks['built_in_ms']:+.1%})" if key in hooks else "-"

    for name, run in record["runs"].items():
        hooks = measured(run, "gradient_hooks")
        if hooks:
            lines.append(table_row(name, f"{hooks['built_in_ms']:.2f}",
                                   *(difference(hooks, f"{hook}_over_built_in_ms") for hook in GRADIENT_HOOKS[1:]),
                                   difference(hooks, "hdet_healthy_mean_over_python_allreduce_hook_ms")))
    profiled = [(name, profile) for name, run in record["runs"].items()
                if (profile := measured(run, "hook_profile")) is not None]
    if profiled:
        lines += ["", "Where each hook's time goes (torch.profiler, self time of each operation):", ""]
        for name, profiles in profiled:
            lines += profile_markdown(name, profiles, baseline="python_allreduce_hook", hook="hdet_healthy_mean")
    lines += ["", "## The sync's local work", "",
              "Baseline: one device-to-device copy of the same bytes (the preset's fp32 parameters).", "",
              *table_header("preset", "MiB", "copy ms", "flat all-reduce, 1 rank ms", "average_tensors ms",
                            "local work ms", "local work / copy")]
    for preset, work in record["local_work"].items():
        if "error" in work:
            continue
        lines.append(table_row(preset, f"{work['bytes'] / MiB:.1f}", f"{work['copy_ms']:.3f}",
                               f"{work['flat_all_reduce_ms']:.3f}", f"{work['average_tensors_ms']:.3f}",
                               f"{work['local_work_ms']:.3f}", f"{work['local_work_over_copy']:.2f}"))
    return [*lines, "", "## Findings", "", *note("findings"), "", "## Caveats", "", *note("caveats")]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.time()
    settings = Settings(device=args.device, presets=tuple(args.presets), engines=tuple(args.engines),
                        steps=args.steps, warmup=SYNC_INTERVAL + 2, batch=args.batch, seq_len=args.seq_len,
                        reps=args.reps, debug_steps=SYNC_INTERVAL - 2,  # the steps between two syncs, window too
                        deadline=started + args.budget_s, profile=not args.no_profile)
    partial = args.out.parent / f"{args.out.name}_partial.json"
    partial.parent.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"local_work": {}, "runs": {}, "incomplete": []}
    jobs = [("local_work",), *((engine, preset) for engine in settings.engines for preset in settings.presets)]
    for job in jobs:
        name = "/".join(job)
        if time.time() > settings.deadline:
            record["incomplete"].append(f"{name}: {BUDGET_EXHAUSTED}")
            continue
        piece = args.out.parent / f"{args.out.name}_{name.replace('/', '_')}.json"
        piece.unlink(missing_ok=True)
        run_started = time.time()
        try:  # processes of its own: a failure, a hang or a crash at exit here costs this job alone
            mp.spawn(run_rank, args=(settings, free_port(), job, str(piece)), nprocs=RANKS, join=True)
            failure = None
        except Exception as error:  # noqa: BLE001 - the other jobs still run
            failure = "".join(traceback.format_exception_only(error)).strip()
        done = json.loads(piece.read_text()) if piece.is_file() else {}
        piece.unlink(missing_ok=True)
        if failure is not None:
            record["incomplete"].append(f"{name}: its processes failed ({failure.splitlines()[0]})")
        if job == ("local_work",):
            record["local_work"] = {preset: work for preset, work in done.items() if preset != "error"}
        else:
            record["runs"][name] = {**done, "wall_seconds": time.time() - run_started}
        partial.write_text(json.dumps(record))
        print(f"{name}: {time.time() - run_started:.0f} s", flush=True)
    gpu = {"gpu": torch.cuda.get_device_name(0)} if args.device == "cuda" else {}
    record = {"settings": asdict(settings), **record,
              "machine": machine_info(backend="gloo", ranks=RANKS, packages=("torch", "transformers"), **gpu),
              "command": shlex.join([Path(sys.executable).name, "benchmarks/gpu_check.py",
                                     *(argv if argv is not None else sys.argv[1:])])}
    write_json(args.out.with_suffix(".json"), record)
    save_markdown(args.out.with_suffix(".md"), markdown(record))
    partial.unlink(missing_ok=True)
    return record


if __name__ == "__main__":
    main()
