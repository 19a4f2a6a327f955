"""Where a DDP gradient hook's time goes: rank 0's operations (torch.profiler) in a few forward and backward
passes with each hook, for ``gpu_check.py``'s section 4 (its paired medians say how much each hook costs; this
says on what)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from common import table_header, table_row
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, schedule

PROFILED_STEPS = 3
SHOWN_OPERATIONS = 12


def profile_hooks(names: Sequence[str], step: Callable[[int, int], None], device: torch.device) -> dict[str, Any]:
    """``step(hook_index, step_index)`` runs one forward and backward with hook ``names[hook_index]`` on every
    rank (collective) and drains the device. Every rank profiles one warm-up and ``PROFILED_STEPS`` passes of each
    hook, behind a barrier each (the same profiler overhead everywhere). Returns rank 0's calls, self time on the
    host and self time on the device of each operation and kernel, per step in µs (empty on the other ranks).
    A host operation's own kernels count as device events of their own, not in the operation's device time."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profiles: dict[str, Any] = {"steps": PROFILED_STEPS, "device_times": device.type == "cuda", "hooks": {}}
    for hook_index, name in enumerate(names):
        with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=PROFILED_STEPS, repeat=1)) \
                as recorder:
            for step_index in range(1 + PROFILED_STEPS):
                dist.barrier()
                step(hook_index, step_index)
                recorder.step()
        if dist.get_rank() == 0:
            profiles["hooks"][name] = {
                event.key: {"calls": event.count / PROFILED_STEPS,
                            "self_cpu_us": event.self_cpu_time_total / PROFILED_STEPS,
                            "self_device_us": event.self_device_time_total / PROFILED_STEPS
                            if event.device_type != DeviceType.CPU and not event.is_user_annotation else 0.0}
                for event in recorder.key_averages()}
    # a device whose profiler records no kernel (CUPTI unavailable, with a warning) has no device times to show
    profiles["device_times"] = device.type == "cuda" and any(
        stats["self_device_us"] > 0 for hook in profiles["hooks"].values() for stats in hook.values())
    return profiles


def profile_markdown(run_name: str, profiles: dict[str, Any], baseline: str, hook: str) -> list[str]:
    """Each hook's total self time per step, then the operations whose self time differs most between ``hook``
    and ``baseline`` (by CPU time, and by device time where measured)."""
    hooks = profiles["hooks"]
    if not hooks:
        return []
    kinds = ("self_cpu_us", "self_device_us") if profiles["device_times"] else ("self_cpu_us",)
    lines = [f"`{run_name}`, rank 0, {profiles['steps']} forward and backward passes per hook, µs per step:", "",
             *table_header("hook", *(f"{kind[:-3].replace('_', ' ')}, whole pass" for kind in kinds)),
             *(table_row(name, *(f"{sum(op[kind] for op in ops.values()):.0f}" for kind in kinds))
               for name, ops in hooks.items()), ""]
    empty = {"calls": 0.0, "self_cpu_us": 0.0, "self_device_us": 0.0}
    for kind in kinds:
        differences = sorted(set(hooks[hook]) | set(hooks[baseline]), key=lambda key: -abs(
            hooks[hook].get(key, empty)[kind] - hooks[baseline].get(key, empty)[kind]))
        lines += [f"The operations whose {kind[:-3].replace('_', ' ')} differs most, {hook} against {baseline} "
                  "(µs per step, calls per step in brackets):", "",
                  *table_header("operation", baseline, hook, "difference"),
                  *(table_row(f"`{key}`", *(f"{hooks[name].get(key, empty)[kind]:.0f} "
                                            f"({hooks[name].get(key, empty)['calls']:g})" for name in (baseline, hook)),
                              f"{hooks[hook].get(key, empty)[kind] - hooks[baseline].get(key, empty)[kind]:+.0f}")
                    for key in differences[:SHOWN_OPERATIONS]), ""]
    return lines
