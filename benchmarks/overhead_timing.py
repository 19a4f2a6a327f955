"""The overhead benchmark's timed sections: 1. step time of interleaved variants and HDET's hot path, 2. the
sync against one flat all-reduce of the same bytes, 3. the bytes crossing replicas (see ``overhead.py``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from common import REFRESH, MiB
from overhead_engines import SIGNALS, Engine, Settings, Trainer, hdet_config

from hdet_scale import HDETEnsemble, SyncReport
from hdet_scale.averaging import average_tensors


# ------------------------------------------------------------------------------------------- helpers
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


# --------------------------------------------------------------------------------- 1. step time
def hdet_trainers(settings: Settings, engine: Engine) -> list[Trainer]:
    """HDET at each sync interval, then with each controller signal at the shortest one (``signal_name``)."""
    interval = settings.sync_intervals[0]
    return [*[engine.hdet_trainer(f"hdet_T{t}", hdet_config(settings, t)) for t in settings.sync_intervals],
            *[engine.signal_trainer(signal_name(interval, signal), interval, signal) for signal in SIGNALS]]


def signal_name(interval: int, signal: str) -> str:
    return f"hdet_T{interval}_{signal}"


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
    for trainer in trainers[1:]:
        result[trainer.name].update(step_ratios(step_times[trainer.name], step_times["plain"], settings.block))
        if "same_layout" in step_times and trainer.hdet is not None:
            result[trainer.name]["vs_same_layout"] = step_ratios(step_times[trainer.name], step_times["same_layout"],
                                                                 settings.block)
    return result


def step_ratios(times: list[float], baseline: list[float], block: int) -> dict[str, Any]:
    """Per round, the median step of a variant's block over the baseline's block in the same round (summarized
    over rounds), and the ratio of their total times."""
    ratios = [statistics.median(times[s: s + block]) / statistics.median(baseline[s: s + block])
              for s in range(0, len(times), block)]
    return {"block_median_ratio": summary(ratios), "total_time_ratio": sum(times) / sum(baseline)}


# --------------------------------------------------------------------------------- 2. sync time
def run_sync_benchmark(settings: Settings, engine: Engine, device: torch.device) -> dict[str, Any]:
    """hdet.sync() per bucket size, average_tensors alone and, where the engine has one, its refresh of its
    parameter copies after the average, each against one flat all_reduce of the same bytes."""
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

    def buckets(bucket_mb: float) -> int:
        return -(-payload_bytes // int(bucket_mb * MiB))

    # name -> (timed operation, collectives of the payload: None for the refresh, which all-reduces none)
    operations: dict[str, tuple[Callable[[], float], int | None]] = {
        "flat all_reduce": (timed(lambda: dist.all_reduce(flat, group=group)), 1),
        "average_tensors bucket_mb=25": (timed(lambda: average_tensors(tensors, group, bucket_bytes=25 * MiB)),
                                         buckets(25.0)),
        **{name: (timed_sync(hdet), buckets(hdet.config.bucket_mb)) for name, hdet in ensembles.items()},
    }
    if engine.refreshes_copies:
        operations[REFRESH] = (timed(some_ensemble.adapter.after_average), None)
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
    for name, (_, count) in operations.items():
        ratios = [a / b for a, b in zip(slowest[name], slowest["flat all_reduce"], strict=True)]
        result["ops"][name] = {"buckets": count, "seconds": summary(slowest[name]),
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


def estimates(steps: dict[str, Any], sync: dict[str, Any], hooks: dict[str, float], intervals: Sequence[int], *,
              gradient_average: bool) -> dict[str, float]:
    """Overhead from the components: (hdet.step hot path + LR hooks + sync / T) / plain median step, the hot
    path with HDET's gradient all-reduce across replicas when ``gradient_average``."""
    plain = steps["plain"]["step_s"]["median"]
    sync_seconds = sync["ops"]["hdet.sync bucket_mb=25"]["seconds"]["median"]
    hot = _hot_path_beside_step(sync, hooks, gradient_average)
    return {f"hdet_T{t}": (steps[f"hdet_T{t}"]["hdet_step_call_s"]["median"] + hot + sync_seconds / t) / plain
            for t in intervals}


def signal_costs(steps: dict[str, Any], sync: dict[str, Any], hooks: dict[str, float], interval: int, *,
                 gradient_average: bool) -> dict[str, dict[str, float]]:
    """For HDET at T = ``interval`` and each signal variant: the hot path (the median of the ensemble's step on
    non-sync steps), the median of its own syncs (``SyncReport.sync_seconds``: the probe's forward and the
    averaged weights' swap included) and the overhead estimated from those, as in ``estimates``."""
    plain = steps["plain"]["step_s"]["median"]
    beside = _hot_path_beside_step(sync, hooks, gradient_average)
    costs = {}
    for name in (f"hdet_T{interval}", *(signal_name(interval, signal) for signal in SIGNALS)):
        hot, own_sync = steps[name]["hdet_step_call_s"]["median"], steps[name]["sync_seconds_report"]["median"]
        costs[name] = {"hot_path_s": hot, "sync_s": own_sync, "estimate": (hot + beside + own_sync / interval) / plain}
    return costs


def _hot_path_beside_step(sync: dict[str, Any], hooks: dict[str, float], gradient_average: bool) -> float:
    """What HDET adds to every step besides its own step call: the LR hooks, and the gradient all-reduce
    across replicas when ``gradient_average``."""
    extra = hooks["hook_s"]
    if gradient_average:
        extra += sync["ops"]["average_tensors bucket_mb=25"]["seconds"]["median"]
    return extra

