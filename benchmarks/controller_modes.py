"""Which auto-LR controller mode should be the default: ``scale`` or ``paper``?

Runs the DDP demo (``hdet_scale.lm.demo_ddp``: a tiny byte-level Llama on the stdlib corpus, 4 ranks on gloo,
``HDETOneCycleLR``, global gradients, T = 25) as one ``torchrun`` subprocess per row and seed:

* plain data parallel (alpha 0, auto-LR off; bit-identical to DDP) at LR / 3, LR, 3 LR and 10 LR (the LR
  check: LR = 3e-3 is the demo's default),
* HDET with the ``scale`` controller and with the ``paper`` controller at LR (alpha 0.25), at 3 LR (alpha
  0.5, the colleague's "too high" LR) and at 10 LR (alpha 0.5, one seed), the controller starting after
  ``start = steps / 4`` (inside OneCycle's ramp, which peaks at 0.3 * steps),
* one diagnostic ``paper`` row at LR whose controller starts after OneCycle's peak (``start = 0.4 *
  steps``), to tell a bad take-over point from a bad decay, and one row at 3 LR with alpha 0.5 and the
  controller off, to tell the controller's effect from the spread's.

For every run it records the final train and held-out loss of the averaged model (the demo's own
evaluation: 8 fixed batches each), the mean replica loss of the last sync interval, the controller's final
scale and base LR, the base LR at every sync, the spread of the replicas' interval losses (what sigma acts
on), the wall time and the exact command. It writes ``benchmarks/results/controller_modes.json`` and a short
Markdown summary ``controller_modes.md`` next to it. The runs use ``hdet_scale`` as committed at HEAD,
exported once, so concurrent edits to the working tree do not leak into them.

    .venv/bin/python benchmarks/controller_modes.py [--steps 400] [--seeds 2] [--quick]

``--quick`` (200 steps, one seed) is a smoke run and writes under ``runs/`` instead of ``benchmarks/results``.
The full default run (18 runs) takes 18-25 minutes on 2 CPU cores. Losses are comparable between rows
(same model init, data stream and evaluation batches per seed); wall times are not when the CPU is shared.
"""

from __future__ import annotations

import argparse
import math
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import (
    ONECYCLE_FLOOR_DIV,
    REPO,
    RESULTS,
    bullets,
    hdet_config,
    head_commit,
    machine_info,
    note,
    read_jsonl,
    save_markdown,
    snapshot_source,
    table_header,
    table_row,
    torchrun_command,
    with_todays_names,
    write_json,
)

RESULTS_STEM = RESULTS / "controller_modes"
QUICK_STEM = REPO / "runs" / "controller_modes_quick" / "controller_modes"
RUNS_DIR = REPO / "runs" / "controller_modes"
NPROC = 4
SYNC_INTERVAL = 25
SIGMA = 0.1
CONTROLLER_START = 0.25  # the controller start as a fraction of the run: inside OneCycle's ramp (peak at 0.3)
FINAL_LINE = re.compile(r"final train loss (\S+)\s+held-out loss (\S+)")

# The colleague's report (400 steps, 4 replicas, global gradients, T = 25): row name -> (final loss, scale).
COLLEAGUE = {
    "dp@LR": (1.57, None),
    "scale@LR": (1.58, None),
    "paper@LR": (2.01, None),
    "dp@3LR": (2.59, None),
    "scale@3LR": (2.33, 0.62),
}


@dataclass(frozen=True)
class Row:
    """One configuration: HDET with controller ``mode``, or without a controller when ``mode`` is None
    (plain data parallel when alpha is 0 as well)."""

    name: str
    lr_factor: float
    alpha: float
    mode: str | None
    warmup_fraction: float = CONTROLLER_START
    """Controller start as a fraction of the run's steps (ignored without a controller)."""
    first_seed_only: bool = False
    """Check rows run only the first seed to keep the benchmark short."""
    purpose: str = ""


ROWS = (
    Row("dp@LR/3", 1 / 3, 0.0, None, first_seed_only=True, purpose="LR check"),
    Row("dp@LR", 1.0, 0.0, None, purpose="baseline"),
    Row("scale@LR", 1.0, 0.25, "scale", purpose="candidate default"),
    Row("paper@LR", 1.0, 0.25, "paper", purpose="candidate default"),
    Row("paper@LR,late", 1.0, 0.25, "paper", warmup_fraction=0.4, first_seed_only=True,
        purpose="diagnostic: controller starts after OneCycle's peak"),
    Row("dp@3LR", 3.0, 0.0, None, purpose="LR check, baseline at the colleague's 3x LR"),
    Row("spread@3LR", 3.0, 0.5, None, first_seed_only=True,
        purpose="alpha 0.5 with the controller off: what the spread and averaging cost by themselves"),
    Row("scale@3LR", 3.0, 0.5, "scale", purpose="the colleague's recovery test"),
    Row("paper@3LR", 3.0, 0.5, "paper", purpose="the colleague's recovery test"),
    Row("dp@10LR", 10.0, 0.0, None, first_seed_only=True, purpose="LR check, baseline at a clearly too-high LR"),
    Row("scale@10LR", 10.0, 0.5, "scale", first_seed_only=True, purpose="recovery from a clearly too-high LR"),
    Row("paper@10LR", 10.0, 0.5, "paper", first_seed_only=True, purpose="recovery from a clearly too-high LR"),
)
LR_LABELS = ("LR", "3LR", "10LR")


def row_config(row: Row, steps: int, metrics_path: Path) -> dict[str, Any]:
    """The HDET JSON for ``row``; plain data parallel is alpha 0 with the controller off."""
    auto_lr = {"enabled": False} if row.mode is None else {
        "enabled": True, "mode": row.mode, "start": round(row.warmup_fraction * steps), "sigma": SIGMA}
    return hdet_config(alpha=row.alpha, sync_interval=SYNC_INTERVAL, gradient_mode="global",
                       metrics_path=str(metrics_path), auto_lr=auto_lr)


def run_one(row: Row, seed: int, steps: int, base_lr: float, source: Path) -> dict[str, Any]:
    """Runs one torchrun job on the package in ``source`` and returns its losses, controller trajectory,
    wall time and command."""
    run_dir = RUNS_DIR / f"{row.name.replace('@', '_at_').replace('/', '_div_').replace(',', '_')}_seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = run_dir / "hdet_metrics.jsonl"
    config = row_config(row, steps, metrics_path)
    config_path = run_dir / "hdet.json"
    write_json(config_path, config, indent=2)
    max_lr = base_lr * row.lr_factor
    command = torchrun_command(NPROC, "-m", "hdet_scale.lm.demo_ddp", "--steps", str(steps),
                               "--max_lr", f"{max_lr:.6g}", "--seed", str(seed), "--out", str(run_dir),
                               "--hdet_config", str(config_path))
    started = time.perf_counter()
    done = subprocess.run(command, cwd=source, capture_output=True, text=True)
    wall = time.perf_counter() - started
    match = FINAL_LINE.search(done.stdout)
    output = done.stdout + done.stderr
    diverged = done.returncode != 0 and "FloatingPointError" in output  # HDET's all-replicas-non-finite stop
    (run_dir / "stdout.txt").write_text(output)
    if match is None and not diverged:
        raise RuntimeError(f"{row.name} seed {seed} failed (exit {done.returncode}); see {run_dir / 'stdout.txt'}")
    syncs = read_jsonl(metrics_path)
    lr = [sync["values"]["lr/0"] for sync in syncs]
    # The metrics file writes non-finite floats as strings ("nan"); float() reads them back.
    losses = [[float(loss) for loss in sync["replica_losses"]] for sync in syncs if None not in sync["replica_losses"]]
    spreads = [max(row) - min(row) for row in losses if all(map(math.isfinite, row))]
    return {
        "row": row.name,
        "seed": seed,
        "max_lr": max_lr,
        "diverged": diverged,
        "final_train_loss": math.inf if diverged else float(match.group(1)),
        "heldout_loss": math.inf if diverged else float(match.group(2)),
        "last_interval_loss": statistics.fmean(losses[-1]) if losses else math.nan,
        "final_scale": lr[-1]["scale"],
        "final_base": lr[-1]["base"],
        "base_lr_per_sync": [[sync["step"], value["base"]] for sync, value in zip(syncs, lr, strict=True)],
        "median_replica_loss_spread": statistics.median(spreads) if spreads else None,
        "wall_seconds": round(wall, 1),
        "command": f"cd {source} && {shlex.join(command)}",
        "hdet_config": config,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per row: mean and per-seed values of the losses and controller outputs."""
    summary: dict[str, dict[str, Any]] = {}
    for row in ROWS:
        mine = [run for run in runs if run["row"] == row.name]
        if not mine:
            continue
        entry: dict[str, Any] = {"purpose": row.purpose, "alpha": row.alpha, "mode": row.mode,
                                 "seeds": [run["seed"] for run in mine], "max_lr": mine[0]["max_lr"]}
        for key in ("final_train_loss", "heldout_loss", "last_interval_loss", "final_scale", "final_base",
                    "wall_seconds"):
            values = [run[key] for run in mine]
            entry[key] = {"mean": statistics.fmean(values), "per_seed": values}
        summary[row.name] = entry
    return summary


def _fmt(values: list[float], digits: int = 3) -> str:
    """The mean, then the per-seed values in parentheses when there are several."""
    mean = statistics.fmean(values)
    text = f"{mean:.{digits}f}"
    return text + (f" ({', '.join(f'{v:.{digits}f}' for v in values)})" if len(values) > 1 else "")


def _controller_cell(row: Row, entry: dict[str, Any]) -> str:
    """Where the controller ended: the scale (``scale`` mode) or the base LR it owns (``paper`` mode)."""
    if row.mode == "scale":
        return f"scale {_fmt(entry['final_scale']['per_seed'], 2)}"
    if row.mode == "paper":
        return f"base {statistics.fmean(entry['final_base']['per_seed']):.1e}"
    return ""


def _paper_takeover(runs: list[dict[str, Any]], row_name: str) -> str:
    """How the paper controller's base LR moves once it owns it (first seed of ``row_name``)."""
    run = next(run for run in runs if run["row"] == row_name)
    warmup = with_todays_names(run["hdet_config"])["auto_lr"]["start"]
    trajectory = dict(run["base_lr_per_sync"])
    first = min(step for step in trajectory if step >= warmup)  # the first update
    before, after = trajectory[first - SYNC_INTERVAL], trajectory[first + SYNC_INTERVAL]
    floor = run["max_lr"] / ONECYCLE_FLOOR_DIV
    at_floor = [step for step, base in trajectory.items() if step >= first and base <= floor * 1.001]
    end = f"at OneCycle's floor {floor:.1e} from step {at_floor[0]}" if at_floor else \
        f"ends at {trajectory[max(trajectory)]:.1e} (floor {floor:.1e})"
    return (f"{row_name} (seed {run['seed']}): schedule {before:.1e} at step {first - SYNC_INTERVAL}, then "
            f"{trajectory[first]:.1e}, {after:.1e} (x{after / trajectory[first]:.2f} per sync), {end}")


def verdict(summary: dict[str, dict[str, Any]]) -> list[str]:
    """Plain statements of what the numbers say, derived from them (so they stay true on a re-run)."""
    key = "final_train_loss"
    lines = []
    wins = {"scale": 0, "paper": 0}
    for lr in LR_LABELS:
        scale, paper, dp = (summary.get(f"{name}@{lr}") for name in ("scale", "paper", "dp"))
        if scale is None or paper is None or dp is None:
            continue
        diffs = [p - s for s, p in zip(scale[key]["per_seed"], paper[key]["per_seed"], strict=True)]
        better = "scale" if statistics.fmean(diffs) > 0 else "paper"
        wins[better] += 1
        beats_dp = sum(s < d for s, d in zip(scale[key]["per_seed"], dp[key]["per_seed"], strict=False))
        lines.append(
            f"At {lr}: `{better}` ends lower; paper minus scale train loss {statistics.fmean(diffs):+.3f} "
            f"(per seed {', '.join(f'{d:+.3f}' for d in diffs)}). Minus plain DP at the same LR: scale "
            f"{scale[key]['mean'] - dp[key]['mean']:+.3f} (lower than DP in {beats_dp} of "
            f"{len(scale[key]['per_seed'])} seeds), paper {paper[key]['mean'] - dp[key]['mean']:+.3f}."
        )
    if wins["scale"] and not wins["paper"]:
        beats_dp = [lr for lr in LR_LABELS if f"scale@{lr}" in summary and f"dp@{lr}" in summary
                    and summary[f"scale@{lr}"][key]["mean"] < summary[f"dp@{lr}"][key]["mean"]]
        lines.append("Evidence supports keeping `scale` as the default" + (
            f"; it also ends below plain DP at {', '.join(beats_dp)}." if beats_dp else
            ", but neither mode ends below plain data parallel at any LR tried."))
    elif wins["paper"] and not wins["scale"]:
        lines.append("Evidence supports making `paper` the default.")
    else:
        lines.append("Evidence is mixed between the modes across the LRs tried; no default is clearly better.")
    lines += _controller_effect(summary, "3LR")
    paper = summary.get("paper@LR")
    if paper is not None:
        lines.append(f"The colleague's paper mode at LR ended at {COLLEAGUE['paper@LR'][0]:.2f}; here "
                     f"{paper[key]['mean']:.3f} train, "
                     f"{paper['heldout_loss']['mean']:.3f} held-out loss.")
    scale, dp = summary.get("scale@3LR"), summary.get("dp@3LR")
    if scale is not None and dp is not None:
        reproduced = scale[key]["mean"] < dp[key]["mean"]
        lines.append(
            f"The colleague's scale controller beat plain DP at 3x LR ({COLLEAGUE['scale@3LR'][0]:.2f} vs "
            f"{COLLEAGUE['dp@3LR'][0]:.2f}, scale {COLLEAGUE['scale@3LR'][1]:.2f}). "
            f"{'Reproduced' if reproduced else 'Not reproduced'} here: {scale[key]['mean']:.3f} vs "
            f"{dp[key]['mean']:.3f} train loss, scale {scale['final_scale']['mean']:.2f}."
        )
    return lines


def _controller_effect(summary: dict[str, dict[str, Any]], lr: str) -> list[str]:
    """The scale controller against the same spread without a controller, and the spread against plain DP,
    on the seed the spread-only row ran."""
    spread, scale, dp = (summary.get(f"{name}@{lr}") for name in ("spread", "scale", "dp"))
    if spread is None or scale is None or dp is None:
        return []
    seed = spread["seeds"][0]

    def train(entry: dict[str, Any]) -> float:
        return entry["final_train_loss"]["per_seed"][entry["seeds"].index(seed)]

    return [f"At {lr}, seed {seed}: the scale controller minus the same spread without a controller "
            f"{train(scale) - train(spread):+.3f}; that spread without a controller minus plain DP "
            f"{train(spread) - train(dp):+.3f} (train loss)."]


def write_markdown(path: Path, info: dict[str, Any], settings: dict[str, Any], runs: list[dict[str, Any]],
                   summary: dict[str, dict[str, Any]]) -> None:
    """A short table and the plain verdict, keeping the hand-written ``caveats`` note of the page at ``path``."""
    lines = [
        "# Auto-LR controller modes: `scale` vs `paper`",
        "",
        f"`benchmarks/controller_modes.py`, {info['date']}, {info['nproc']} CPU cores, torch {info['torch']}, "
        f"commit {info['git_commit'][:12]}. Demo: tiny byte-level Llama, {NPROC} ranks (gloo), "
        f"{settings['steps']} steps, OneCycle, T = {SYNC_INTERVAL}, global gradients, sigma = {SIGMA}, "
        f"LR = {settings['base_lr']:g}, controller from step {round(CONTROLLER_START * settings['steps'])} "
        "(inside OneCycle's ramp, "
        f"peak at step {round(0.3 * settings['steps'])}). Losses in nats; mean over seeds, per seed in "
        "parentheses; lower is better.",
        "",
        *note("caveats"),
        "",
        *table_header("row", "alpha", "train loss", "held-out loss", "last-interval loss", "controller at end",
                      "colleague's"),
    ]
    for row in ROWS:
        entry = summary.get(row.name)
        if entry is None:
            continue
        reported = COLLEAGUE.get(row.name)
        colleague = "" if reported is None else f"{reported[0]:.2f}" + (
            f", scale {reported[1]:.2f}" if reported[1] is not None else "")
        lines.append(table_row(row.name, f"{row.alpha:g}", *[_fmt(entry[key]["per_seed"]) for key in (
            "final_train_loss", "heldout_loss", "last_interval_loss")], _controller_cell(row, entry), colleague))
    lines += ["", "## What it says", "", *bullets(verdict(summary))]
    paper_rows = [row.name for row in ROWS if row.mode == "paper" and row.name in summary
                  and not any(run["diverged"] for run in runs if run["row"] == row.name)]
    lines += [f"- Paper mode's base LR: {_paper_takeover(runs, name)}." for name in paper_rows]
    spreads = [run["median_replica_loss_spread"] for run in runs if run["median_replica_loss_spread"] is not None
               and run["hdet_config"]["alpha"] > 0]
    if spreads:
        lines.append(f"- sigma = {SIGMA}: the median max-min spread of the replicas' interval losses at a sync was "
                     f"{statistics.median(spreads):.3f} nats (HDET rows), so the softmax weights are neither "
                     "uniform nor one-hot at this temperature.")
    below = sum(run["heldout_loss"] < run["final_train_loss"] for run in runs)
    lines += [
        f"- The held-out split is every 20th file of the demo's corpus; its loss is below the train loss in {below} "
        f"of {len(runs)} runs. The colleague did not say which loss they quoted; train loss (random windows of the "
        "training files) is the one the verdict uses.",
        "",
        f"Full per-run data (commands, per-sync base LR, wall times): `{RESULTS_STEM.name}.json`.",
    ]
    save_markdown(path, lines)


def main() -> None:
    """Runs every row and seed, then writes the JSON and Markdown results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per run")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per row (check rows run the first only)")
    parser.add_argument("--base_lr", type=float, default=3e-3, help="LR: OneCycle peak of the main rows")
    parser.add_argument("--quick", action="store_true", help="smoke run: 200 steps, 1 seed, results under runs/")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.seeds = 200, 1
    stem = QUICK_STEM if args.quick else RESULTS_STEM
    settings = {"steps": args.steps, "seeds": args.seeds, "base_lr": args.base_lr, "nproc_per_node": NPROC,
                "sync_interval": SYNC_INTERVAL, "sigma": SIGMA, "quick": args.quick}
    commit = head_commit()
    source = snapshot_source(commit, RUNS_DIR)
    info = machine_info(backend="gloo (CPU)", ranks=NPROC, packages=("torch", "transformers"), git_commit=commit)
    runs = []
    for row in ROWS:
        for seed in range(1 if row.first_seed_only else args.seeds):
            run = run_one(row, seed, args.steps, args.base_lr, source)
            print(f"{row.name:14s} seed {seed}  train {run['final_train_loss']:.4f}  held-out "
                  f"{run['heldout_loss']:.4f}  scale {run['final_scale']:.3f}  base {run['final_base']:.2e}  "
                  f"{run['wall_seconds']:.0f} s", flush=True)
            runs.append(run)
    summary = summarize(runs)
    result = {"machine": info, "settings": settings, "summary": summary, "verdict": verdict(summary), "runs": runs}
    write_json(stem.with_suffix(".json"), result)
    write_markdown(stem.with_suffix(".md"), info, settings, runs, summary)
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.md')}")
    if any(run["diverged"] for run in runs):
        print("warning: some runs diverged (their losses are recorded as inf)", file=sys.stderr)


if __name__ == "__main__":
    main()
