"""The quality benchmark's runs: the worker's command line for a row, the torchrun launch of a batch of runs,
and each run's record read back from its files (losses, divergence, where the controller took the LR)."""

from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import BENCHMARKS, ONECYCLE_FLOOR_DIV, REPO, read_jsonl, repo_relative, torchrun_command
from quality_rows import NPROC, Row, Settings

WORKER = BENCHMARKS / "quality_worker.py"
SPIKE_NATS = 0.25
"""A run that climbs this far above the lowest loss it had reached has crashed (the paper's Baseline-High
"stabilizing at 4.169" after reaching far less), even if it ends below its starting loss. Why 0.25 and not
the 0.5 first used: the sweep's note in ``benchmarks/results/quality_cpu.md``."""
DIRECTION_BAND = 0.02  # |scale - 1| below this: the controller did not move the LR


# ------------------------------------------------------------------------------------------ running
def worker_args(row: Row, seed: int, s: Settings, lr: float, run_dir: Path) -> list[str]:
    """The worker's arguments for ``row`` (and writes its HDET config into ``run_dir``)."""
    args = ["--preset", s.preset, "--steps", str(s.steps), "--batch_size", str(s.batch_size),
            "--seq_len", str(s.seq_len), "--lr", f"{lr:.6g}", "--optimizer", row.optimizer, "--seed", str(seed),
            "--log_every", str(s.log_every), "--eval_every", str(s.eval_every), "--out", str(run_dir)]
    if row.hdet is not None:
        config = json.loads(json.dumps(row.hdet))
        config["seed"] = seed
        config["auto_lr"]["start"] = round(s.controller_start * s.steps)
        config["metrics_path"] = str(run_dir / "hdet_metrics.jsonl")
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "hdet.json").write_text(json.dumps(config, indent=1) + "\n")
        args += ["--hdet_config", str(run_dir / "hdet.json")]
    if row.probe:
        args.append("--probe")
    return args


def launch(batch: list[tuple[Row, int, float, Path, list[str]]], source: Path, runs_dir: Path) -> str:
    """Runs a batch of runs in one torchrun job; returns its command line."""
    spec = runs_dir / f"batch_{batch[0][0].group}_{batch[0][1]}.json"
    spec.write_text(json.dumps([args for *_, args in batch]) + "\n")
    command = torchrun_command(NPROC, str(WORKER), "--batch", str(spec))
    env = {**os.environ, "PYTHONPATH": str(source), "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    (runs_dir / f"{spec.stem}.log").write_text(done.stdout + done.stderr)
    for line in done.stdout.splitlines():
        if "final train loss" in line:
            print("   ", line, flush=True)
    if done.returncode != 0:
        print(f"warning: batch {spec.name} exited {done.returncode}; see {runs_dir / (spec.stem + '.log')}",
              file=sys.stderr)
    return f"PYTHONPATH={shlex.quote(str(source))} {shlex.join(command)}"


# ------------------------------------------------------------------------------------- reading a run
def collect(row: Row, seed: int, s: Settings, lr: float, run_dir: Path, command: str) -> dict[str, Any]:
    """The run's record from its files (``result.json``, ``loss.jsonl``, ``hdet_metrics.jsonl``)."""
    result = json.loads((run_dir / "result.json").read_text())
    lines = read_jsonl(run_dir / "loss.jsonl")
    curve = [[line["step"], float(line["loss"])] for line in lines if "loss" in line]
    held = [[line["step"], float(line["heldout_loss"])] for line in lines if "heldout_loss" in line]
    final_train, final_held = float(result["final_train_loss"]), float(result["final_heldout_loss"])
    if result["diverged_at_step"] is not None:  # stopped early: whatever the model holds is not a result
        final_train = final_held = math.nan
    record = {"row": row.name, "group": row.group, "label": row.label, "seed": seed, "lr": lr,
              "optimizer": row.optimizer, "probe": row.probe, "meta": row.meta,
              "start_train_loss": result["start_train_loss"], "final_train_loss": final_train,
              "final_heldout_loss": final_held, "diverged_at_step": result["diverged_at_step"],
              "wall_seconds": round(result["wall_seconds"], 2), "tokens": result["tokens"],
              "loss_curve": curve, "heldout_curve": held, "run_dir": repo_relative(run_dir),
              "command": command, "hdet_config": row.hdet and json.loads((run_dir / "hdet.json").read_text())}
    record.update(divergence(result["start_train_loss"], [loss for _, loss in curve], final_train))
    syncs = read_jsonl(run_dir / "hdet_metrics.jsonl")
    if syncs:
        record["controller"] = controller_direction(syncs, onecycle_schedule(lr, s.steps), row.hdet["auto_lr"]["mode"],
                                                    row.hdet["sync_interval"])
        record["base_lr_per_sync"] = [[sync["step"], sync["values"]["lr/0"]["base"],
                                       sync["values"]["lr/0"]["scale"]] for sync in syncs]
    return record


def divergence(start_loss: float, curve: Sequence[float], final_loss: float,
               spike_nats: float = SPIKE_NATS) -> dict[str, Any]:
    """How a run failed, if it did.

    ``diverged``: the final loss is non-finite or not below the starting loss (the brief's definition);
    ``spike``: the largest climb of the logged training loss above the lowest loss reached before it;
    ``unstable``: diverged, a non-finite logged loss, or a spike of at least ``spike_nats``.
    """
    diverged = not math.isfinite(final_loss) or final_loss >= start_loss
    best, spike, nonfinite = math.inf, 0.0, False
    for loss in curve:
        if not math.isfinite(loss):
            nonfinite = True
            continue
        if best < math.inf:
            spike = max(spike, loss - best)
        best = min(best, loss)
    return {"diverged": diverged, "spike": spike,
            "unstable": diverged or nonfinite or spike >= spike_nats}


def controller_direction(syncs: Sequence[dict[str, Any]], schedule: dict[int, float], mode: str = "scale",
                         sync_interval: int = 1, floor_div: float = ONECYCLE_FLOOR_DIV) -> dict[str, Any]:
    """Where the controller took the base LR, from HDET's sync lines (``values["lr/0"]``).

    ``ratio`` is the base LR over where it would be without the controller's votes: ``scale`` mode, the
    scale (the base over the plain schedule); ``paper`` mode, the owned base over the pure geometric decay
    from the schedule's value at the first update to OneCycle's floor (``max(schedule) / floor_div``) over the
    remaining syncs, which that mode follows by itself. ``ratio_end`` is its last value, ``ratio_gmean`` its
    geometric mean over the updates, ``up_fraction`` the share of updates whose Delta (eqs. 5-6, ``delta``)
    pointed up, ``direction`` up/down/flat (outside 1 +- DIRECTION_BAND) from ``ratio_end`` in ``scale`` mode
    and from ``ratio_gmean`` in ``paper`` mode (whose base and decay path both end on the floor: ratio 1).
    """
    updated = [sync for sync in syncs if sync.get("controller_updated")]
    if not updated:
        return {"updates": 0, "ratio_end": math.nan, "ratio_gmean": math.nan, "up_fraction": math.nan,
                "direction": "none"}
    if mode == "scale":
        ratios = [sync["values"]["lr/0"]["scale"] for sync in updated]
    else:
        first = updated[0]["step"]
        start, floor = schedule[first], max(schedule.values()) / floor_div
        remaining = max(1, (len(schedule) - first) // sync_interval)
        keep = (floor / start) ** (1.0 / remaining) if start > floor else 1.0  # 1 - gamma of the controller
        ratios = [sync["values"]["lr/0"]["base"] / max(start * keep ** (k + 1), floor)
                  for k, sync in enumerate(updated)]
    gmean = math.exp(statistics.fmean(math.log(r) for r in ratios))
    ups = sum(sync["values"]["lr/0"]["delta"] > 0 for sync in updated) / len(updated)
    end = ratios[-1]
    basis = end if mode == "scale" else gmean
    direction = "up" if basis > 1 + DIRECTION_BAND else "down" if basis < 1 - DIRECTION_BAND else "flat"
    return {"updates": len(updated), "ratio_end": end, "ratio_gmean": gmean, "up_fraction": ups,
            "direction": direction}


def onecycle_schedule(max_lr: float, total_steps: int) -> dict[int, float]:
    """OneCycleLR's LR (defaults) after each of ``total_steps`` steps: the schedule HDET's base follows."""
    import torch

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=max_lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=max_lr, total_steps=total_steps)
    values = {}
    for step in range(1, total_steps + 1):
        optimizer.step()
        scheduler.step()  # HDETOneCycleLR steps the schedule before its sync: the base at step s is this one
        values[step] = optimizer.param_groups[0]["lr"]
    return values

