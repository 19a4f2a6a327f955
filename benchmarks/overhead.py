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
HDET. DeepSpeed has no hybrid sharding (MiCS left it in 0.19), so a second baseline, ``same_layout``, runs
HDET's layout without HDET: plain ``deepspeed.initialize`` sharding inside each replica (HDET's replica
model-parallel unit) and one flat all-reduce of the reduced gradients across replicas before each step. HDET
over ``same_layout`` is HDET's own work; ``same_layout`` over plain is what the layout costs or saves. All take a
torch AdamW, so nothing JIT-compiles. Every plain engine is built before the HDET ones: DeepSpeed keeps the last
model-parallel unit process-wide, and a plain engine built after an HDET engine would shard over one replica.
Each stage gets its own part of the results. Measured:

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
   direct ratios include. The auto-LR controller runs at every sync (``auto_lr.start = 0``). In the same
   round-robin, HDET at the shortest T with each controller signal of ``overhead_engines.SIGNALS`` (a probe
   batch scoring the replicas, the averaged-weight probe, the default controller), estimated from their own
   hot path and syncs (section 1b).
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
4. Peak memory, in a launch of its own before the timed one. The plain engine, HDET in global and HDET in local
   gradient mode, HDET with each controller signal, each built from a fresh model and trained ``MEMORY_STEPS``
   steps at T = ``MEMORY_SYNC_INTERVAL`` (so the window holds syncs) inside one measurement window, after one
   unmetered run of the same variant (one-time set-up is left out): the peak of the memory in use in the window
   above its start (model, engine, gradients, optimizer states, HDET's state and the sync's buckets) and what is
   still in use at its end, the maximum over ranks. CUDA: the caching allocator's statistics. CPU: the kernel's
   peak resident set size, reset at the window's start, with glibc told to map every block of 64 KiB or more by
   itself, so a freed tensor leaves the resident set and the next variant's tensors are not served from memory an
   earlier one freed. Memory does not depend on T beyond whether a sync happens, so one T.

All timings are ratios against a baseline measured in the same run. Rank 0 writes
``<out>/overhead_<engine>_<cpu|gpu>[_quick].json`` and ``.md`` with the machine, the command and the tables
(DeepSpeed with other than the default stages: ``overhead_deepspeed_zero<stages>_...``). What the numbers mean
is written by hand into the ``.md``'s note blocks, which a new run keeps (see ``overhead_report.py``).

Code: this file runs the launches; ``overhead_engines.py`` builds the variants, ``overhead_timing.py`` measures
sections 1-3, ``overhead_memory.py`` section 4, and ``overhead_report.py`` writes the Markdown.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shlex
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import cpu_model, machine_info, write_json
from overhead_engines import Settings, build_engines, build_model
from overhead_memory import map_every_large_block, measure_memory
from overhead_report import TARGETS, write_markdown
from overhead_timing import (
    analyse_steps,
    estimates,
    gather,
    hdet_trainers,
    hook_overhead,
    run_bytes,
    run_step_benchmark,
    run_sync_benchmark,
    signal_costs,
)

DEEPSPEED_STAGES = (1, 2, 3)
# Per engine: timed steps per variant, steps per block, sync repetitions, LR-hook repetitions. DeepSpeed runs
# 4 variants per ZeRO stage and a ZeRO-3 step costs several plain ones, so it takes fewer steps.
RUN_LENGTHS = {
    "ddp": {"full": (1000, 50, 40, 3000), "quick": (200, 25, 10, 500)},
    "fsdp": {"full": (250, 25, 20, 1000), "quick": (200, 25, 10, 500)},
    "deepspeed": {"full": (200, 20, 20, 1000), "quick": (10, 5, 5, 200)},
}


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    """The command line (see the module docstring) as the settings every rank gets."""
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
            for part, memory in json.loads(Path(memory_path).read_text()).items():
                measured[part]["memory"] = memory
            data = {
                "benchmark": "overhead",
                "engine": engine_info,
                "machine": machine(settings, device),
                "settings": asdict(settings),
                "model_params": sum(p.numel() for p in build_model(settings, torch.device("cpu")).parameters()),
                "load_average": {"start": [round(v, 2) for v in load_start],
                                 "end": [round(v, 2) for v in os.getloadavg()]},
                "runtime_s": runtime,
                "targets_step_overhead": {f"T{t}": v for t, v in TARGETS.items()},
                **({"stages": measured} if settings.stages else measured[""]),
            }
            stem = Path(settings.out) / results_stem(settings, device)
            write_json(stem.with_suffix(".json"), data, indent=2)
            write_markdown(stem.with_suffix(".md"), data)
            print(f"wrote {stem}.json and .md in {runtime:.0f} s")
    finally:
        dist.destroy_process_group()


def machine(settings: Settings, device: torch.device) -> dict[str, Any]:
    """The machine and software of this run (rank 0's view)."""
    return machine_info(
        backend=settings.backend, ranks=settings.ranks, date_key="date_utc",
        packages=("torch", "deepspeed") if settings.engine == "deepspeed" else ("torch",),
        cpu_affinity=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        cpu=cpu_model(), gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        torch_threads_per_rank=torch.get_num_threads(),
    )


def results_stem(settings: Settings, device: torch.device) -> str:
    """``overhead_<engine>[_zero<stages>]_<cpu|gpu>[_quick]``; the stages only when not the default ones."""
    where = "gpu" if device.type == "cuda" else "cpu"
    stages = "" if settings.stages in ((), DEEPSPEED_STAGES) else "_zero" + "".join(map(str, settings.stages))
    return f"overhead_{settings.engine}{stages}_{where}{'_quick' if settings.quick else ''}"


def measure(settings: Settings, device: torch.device, started: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Sections 1-3 of every engine part (keyed by ``Engine.part``) and what names the engine."""
    engines = build_engines(settings, device)
    # Every baseline comes before any HDET variant: DeepSpeed keeps the model-parallel unit process-wide, so a
    # plain engine built after an HDET engine would shard over that engine's replica only.
    plains = [engine.plain_trainer() for engine in engines]
    idle_plain_optimizers = [engine.plain_trainer().optimizer for engine in engines]  # for the LR-hook timing
    same_layouts = [engine.same_layout_trainer() for engine in engines]
    trainer_groups = [[plain, *filter(None, [same_layout]), *hdet_trainers(settings, engine)]
                      for engine, plain, same_layout in zip(engines, plains, same_layouts, strict=True)]
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
            "signal_costs": signal_costs(steps, sync, hooks, settings.sync_intervals[0],
                                         gradient_average=engine.gradient_average_in_hot_path),
            "bytes": run_bytes(settings, engine, device, next(t for t in trainers if t.hdet is not None).reports),
        }
        progress(started, " ".join(filter(None, (engine.part, "sync time and bytes"))))
    engine = engines[0]
    engine_info = {"name": settings.engine, "title": engine.title, "baseline": engine.baseline,
                   "gradient_average_in_hot_path": engine.gradient_average_in_hot_path}
    return engine_info, measured


def progress(started: float, section: str) -> None:
    """Rank 0 prints the elapsed time after each section."""
    if dist.get_rank() == 0:
        print(f"[{time.perf_counter() - started:6.1f} s] {section} done", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """The memory launch, then the timed launch, each on ``--ranks`` fresh processes."""
    settings = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        memory_path = os.path.join(tmp, "memory.json")
        mp.spawn(memory_worker, args=(settings, os.path.join(tmp, "memory_store"), memory_path),
                 nprocs=settings.ranks, join=True)
        mp.spawn(worker, args=(settings, os.path.join(tmp, "store"), memory_path), nprocs=settings.ranks, join=True)


if __name__ == "__main__":
    main()
