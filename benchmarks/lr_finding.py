"""LR-finding benchmark: does one HDET run started at a wrong LR end as well as the best run of an LR sweep?

A byte-level Llama on the embedded standard-library corpus, ``--nproc`` CPU ranks on gloo, every rank a replica
(global gradients, the paper's layout), AdamW on a schedule (``cosine`` with linear warm-up by default,
``onecycle``, ``wsd``), the same token budget for every run. Each run is ``benchmarks/lr_finding_worker.py``
under torchrun; runs share launches (start-up costs more than a short run). Methods:

* ``sweep``: plain data parallel on a grid of factor sqrt(10) around ``--grid_center`` (extended until the
  best LR, by mean held-out loss over the seeds, has ``--grid_side`` points on each side). It gives the
  sweep-best LR and its held-out loss: the anchor.
* ``hdet``: HDET started at ``--start_factors`` times the sweep-best LR, for each controller ``--variants``. A
  variant that starts from the library's LR range test runs from every start with the first seed only; where
  those runs end alike, the other seeds' one run stands for all starts (``one_run_for_every_start``).
* ``range_test``: the LR range test (``hdet_scale.range_test``: 100 steps of an exponential LR ramp, the LR of the
  smoothed loss's steepest descent), then one plain run at the LR it picked; once per seed, whatever the start.
* ``proxy``: LR transfer from a proxy: a sweep on the model at half the width (``--proxy_seeds``, the same
  grid), its best LR reused for plain runs of the full model.
* ``schedulefree``: schedule-free AdamW (warm-up, no schedule) from the same start factors.
* ``prodigy``: Prodigy at LR 1.0 on the schedule (its recommended setting).

    .venv/bin/python benchmarks/lr_finding.py                                  # everything, default setting
    .venv/bin/python benchmarks/lr_finding.py --methods sweep --seeds 0       # the sweep alone, one seed
    .venv/bin/python benchmarks/lr_finding.py --methods hdet --variants tenth_rise --start_factors 0.1 10
    .venv/bin/python benchmarks/lr_finding.py --steps 300 --out /tmp/lrf --runs_dir /tmp/lrf_runs   # a quick try

Results accumulate in ``<out>.json`` (a run recorded with the same setting is not rerun) with ``<out>.md`` and
figures next to it; the runs import ``hdet_scale`` as committed at HEAD (exported once), so edits to the
working tree cannot leak into a long benchmark. ``--report_only`` rewrites the results from what is recorded.

Code: this file runs the methods on one setting (``run_setting``; ``lr_finding_matrix.py`` runs it on many);
``lr_finding_report.py`` writes the Markdown and the figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import (
    REPO,
    RESULTS,
    head_commit,
    machine_info,
    read_json,
    repo_relative,
    snapshot_source,
    torchrun_command,
    write_json,
)
from common import hdet_config as checked_hdet_config
from lr_finding_report import write_report

from hdet_scale.spread import multipliers

WORKER = "lr_finding_worker.py"
"""The worker script, run from the snapshot of the benchmarks (``snapshot_source``)."""
METHODS = ("sweep", "hdet", "range_test", "proxy", "schedulefree", "prodigy")
SQRT10 = math.sqrt(10.0)
DEFAULT_START_FACTORS = (0.1, 1 / SQRT10, 1.0, SQRT10, 10.0)
"""Where HDET and schedule-free start, over the sweep-best LR: 10x off either way and between."""


def tenth(alpha: float = 0.5, **auto_lr: Any) -> dict[str, Any]:
    """``tenth_start_early_hold`` (the ``log`` controller on half-interval averaged weights scored on a probe batch,
    starting at a tenth of the given LR, moving from 5% to 25% of the run) with ``auto_lr`` fields changed."""
    return {"hdet": {"alpha": alpha, "spread": "log",
                     "auto_lr": {"mode": "log", "sigma": 1.0, "step_size": 2.5, "max_log_step": 0.5,
                                 "average_window": 0.5, "stop": 0.25, "initial_scale": 0.1, **auto_lr}},
            "probe": True}


def rise(**auto_lr: Any) -> dict[str, Any]:
    """``tenth_rise`` (``tenth`` with beta 0.5, a quarter-interval window and the LR only rising after 0.35 of the
    controller's window) with ``auto_lr`` fields changed."""
    return tenth(**{"beta": 0.5, "average_window": 0.25, "rise_only_after": 0.35, **auto_lr})


def without_probe(variant: dict[str, Any]) -> dict[str, Any]:
    """``variant`` scored by the replicas' interval training losses: no probe batch, no averaged weights."""
    auto_lr = {key: value for key, value in variant["hdet"]["auto_lr"].items() if key != "average_window"}
    return {"hdet": {**variant["hdet"], "auto_lr": auto_lr}, "probe": False}


def range_start(variant: dict[str, Any], at: float = 1.0, low: float = 0.1, high: float = 10.0) -> dict[str, Any]:
    """``variant`` started at ``at`` times the LR the range test picks (run first, from the same initial weights),
    its scale bounded to [``low``, ``high``] times that LR."""
    auto_lr = {**variant["hdet"]["auto_lr"], "initial_scale": at, "scale_min": low, "scale_max": high}
    return {"hdet": {**variant["hdet"], "auto_lr": auto_lr}, "probe": variant["probe"], "range_start": True}


def library_range(variant: dict[str, Any], low: float = 0.1, high: float = 10.0) -> dict[str, Any]:
    """``variant`` started by the library's own LR range test (``auto_lr.range_test``, 100 steps inside the run,
    every replica at once): the spread's top replica at the pick, the scale bounded to [``low``, ``high``] times
    where it starts."""
    auto_lr = {key: value for key, value in variant["hdet"]["auto_lr"].items() if key != "initial_scale"}
    auto_lr.update(range_test=100, scale_min=low, scale_max=high)
    return {"hdet": {**variant["hdet"], "auto_lr": auto_lr}, "probe": variant["probe"]}


LOG_SPREAD = multipliers(4, 0.5, "log")
"""The earlier default's LR multipliers on the matrix's 4 replicas."""
MEAN_OVER_TOP = statistics.fmean(LOG_SPREAD) / max(LOG_SPREAD)
"""The mean of the log spread's multipliers over its largest (4 replicas, alpha 0.5): where the average of
``range_top_hold``'s replicas trains, relative to the pick."""

VARIANTS: dict[str, dict[str, Any]] = {
    # name -> HDET settings beside the common ones (alpha, T, gradient mode, seed, controller start), and
    # whether a probe batch scores the replicas. The default, the paper's controller and the variants the findings
    # compare against; the others tried are described in benchmarks/README.md ("LR-finding variants tried"), and
    # every recorded run keeps the HDET config it ran with ("hdet_config" in the results JSON)
    "paper": {"hdet": {"alpha": 1 / 9, "auto_lr": {"mode": "paper"}}, "probe": False},
    # the scale-free controller on the probe batch's scores of the last iterates, moving to the end of the run
    "log": {"hdet": {"alpha": 1.0, "spread": "log", "auto_lr": {"mode": "log", "sigma": 1.0, "step_size": 1.0}},
            "probe": True},
    # An earlier default: the log controller on half-interval averaged weights (the spread [0.67, 1.5] x base),
    # starting at a tenth of the given LR (a too-high LR early does damage no later LR undoes, a too-low one is
    # climbed out of) and moving with beta 0.9 from 5% to 25% of the run, then holding the scale
    "tenth_start_early_hold": tenth(),
    # The signals lean above the best LR early (steps 75-175) and below it from ~12% of the run on: a known sign of
    # bias in each phase. beta 0.5 and a quarter-interval window, with the controller only raising the LR after 35%
    # of its window (12% of the run) up to its stop (auto_lr.rise_only_after): a late signal to lower the LR is what
    # the bias gives even at the best LR, one to raise it goes against the bias
    "tenth_rise": rise(),
    # ... starting the climb earlier: the controller from 2% of the run (inside the LR warm-up), the one-sided
    # phase still from 12% of the run (0.43 of the window 2%-25%)
    "tenth_rise_start2": rise(rise_only_after=0.43, start=0.02),
    # The default without a probe batch, as in a user's own loop or under Lightning when none is set: the replicas'
    # interval training losses drive the controller and no weights are averaged
    "tenth_rise_start2_no_probe": without_probe(rise(rise_only_after=0.43, start=0.02)),
    # Started at the LR range test's pick (what a practitioner would run first), whatever LR was given:
    # ... held there (the spread and the averaging alone)
    "range_hold": range_start(rise(rise_only_after=0.43, start=0.02), low=1.0, high=1.0),
    # ... the default controller moving from there, up to 10x either way
    "range_rise": range_start(rise(rise_only_after=0.43, start=0.02)),
    # On cosine_tiny both trailed the plain run at the pick (+0.034, +0.070 against +0.002): the pick is 1.4-2.4x
    # the best LR there, and the spread's top replica trains at 1.5 times it. Held at the pick with half the spread
    # ([0.8, 1.25] x base) ...
    "range_narrow_hold": range_start(rise(alpha=0.25, rise_only_after=0.43, start=0.02), low=1.0, high=1.0),
    # ... or with the spread's top replica at the pick (the base at 1/1.5 of it)
    "range_top_hold": range_start(rise(rise_only_after=0.43, start=0.02), at=1 / 1.5, low=1 / 1.5,
                                  high=1 / 1.5),
    # ... and the default controller moving from there (on cosine_tiny it only lost; does it help where the pick
    # is below the best LR?)
    "range_top_rise": range_start(rise(rise_only_after=0.43, start=0.02), at=1 / 1.5, low=0.1 / 1.5,
                                  high=10 / 1.5),
    # ... and without the spread, every replica at range_top_hold's mean LR (1.046 / 1.5 of the pick): what the
    # spread and averaging cost, or give, against one LR at the same mean
    "range_top_mean_no_spread": range_start(rise(alpha=0.0, rise_only_after=0.43, start=0.02), at=MEAN_OVER_TOP,
                                            low=MEAN_OVER_TOP, high=MEAN_OVER_TOP),
    # range_top_hold as the library runs it (auto_lr.range_test): the test inside the run, on every replica, its
    # steps before the run's; what a default of the library would ship
    "library_range_hold": library_range(rise(rise_only_after=0.43, start=0.02), low=1.0, high=1.0),
    # The library's defaults as a user gets them (chosen on the design settings of lr_finding_matrix.md): the LR range
    # test at the start, then every replica at 0.7 times its pick, held, unspread: range_top_mean_no_spread as the
    # library runs it. (Until 2026-11-27 the default spread the replicas with the fastest at the pick, as
    # library_range_hold; its runs are kept as range_spread_top_at_pick.)
    "default": {"hdet": {}, "probe": True, "library": True},
    # The library's defaults exploring AdamW's weight decay too (each replica at 0.5-1.5 times the base, the
    # controller moving the base): what an LR range test cannot find
    "default_weight_decay": {"hdet": {"explore": {"weight_decay": {"alpha": 0.5}}}, "probe": True, "library": True},
}
DEFAULT_VARIANT = "default"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--hidden", type=int, default=None, help="override the preset's hidden size")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--schedule", choices=("cosine", "onecycle", "wsd"), default="cosine")
    parser.add_argument("--sync_interval", type=int, default=25, help="T of every HDET run")
    parser.add_argument("--weight_decay", type=float, default=None,
                        help="AdamW's weight decay in every run (default: the worker's, 0.01)")
    parser.add_argument("--controller_start", type=float, default=0.05,
                        help="the controller's first update, as a share of the steps (the LR warm-up's end)")
    parser.add_argument("--nproc", type=int, default=4, help="ranks = replicas")
    parser.add_argument("--parallel", type=int, default=1,
                        help="launches (one per seed) at a time: 1 on a 2-core machine; more where cores (and a "
                             "GPU the ranks share) are free")
    parser.add_argument("--runs_per_launch", type=int, default=0,
                        help="at most this many runs per launch (0: all of a seed's); short launches lose less "
                             "when a benchmark is stopped, long ones pay the start-up less often")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--start_factors", type=float, nargs="+", default=list(DEFAULT_START_FACTORS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--methods", nargs="+", default=["sweep", "hdet", "schedulefree", "prodigy"],
                        choices=METHODS)
    parser.add_argument("--proxy_seeds", type=int, nargs="+", default=None,
                        help="proxy: seeds of the half-width sweep (default: the first of --seeds; a "
                             "practitioner's proxy sweep has one)")
    parser.add_argument("--grid_center", type=float, default=3e-3, help="the sweep's first grid point")
    parser.add_argument("--grid_side", type=int, default=3, help="sweep points needed on each side of the best")
    parser.add_argument("--out", type=Path, default=RESULTS / "lr_finding", help="results stem (.json, .md)")
    parser.add_argument("--runs_dir", type=Path, default=REPO / "runs" / "lr_finding")
    parser.add_argument("--report_only", action="store_true")
    return parser.parse_args(argv)


def setting(args: argparse.Namespace) -> dict[str, Any]:
    """What makes runs comparable: recorded runs are reused only under the same setting."""
    keys = ("preset", "hidden", "layers", "steps", "batch_size", "seq_len", "schedule", "sync_interval",
            "controller_start", "nproc")
    # the worker's weight decay unless one is given: settings recorded before the option stay the same
    optional = {"weight_decay": args.weight_decay} if args.weight_decay is not None else {}
    return {**{key: getattr(args, key) for key in keys}, **optional}


# ------------------------------------------------------------------------------------------------ runs
def run_key(run: dict[str, Any]) -> tuple:
    return run["method"], run.get("variant"), f"{run['lr']:.6g}", run["seed"]


def proxy_hidden(args: argparse.Namespace) -> int:
    """The proxy model's hidden size: half the full model's."""
    from hdet_scale.lm.model import PRESETS

    return (args.hidden or PRESETS[args.preset]["hidden_size"]) // 2


def variant_config(args: argparse.Namespace, variant: dict[str, Any], seed: int) -> dict[str, Any]:
    """The HDET config an HDET run of ``variant`` trains with: the setting's T, every rank a replica, global
    gradients and the run's seed, with the variant's fields over the library's defaults (variants marked
    ``library``: the default and what adds to it) or over the defaults the older variants were measured with
    (``common.with_measured_defaults``, the controller's start from ``--controller_start``)."""
    run_fields = {"sync_interval": args.sync_interval, "ranks_per_replica": 1, "gradient_mode": "global",
                  "seed": seed}
    if variant.get("library"):  # the library's defaults as a user gets them, with what the variant adds
        from hdet_scale.config import HDETConfig

        config = {**variant["hdet"], **run_fields}
        HDETConfig.from_dict(config)
        return config
    config = {**json.loads(json.dumps(variant["hdet"])), **run_fields}
    auto_lr = config.setdefault("auto_lr", {})
    auto_lr.setdefault("start", args.controller_start)  # a variant's own wins
    for name in ("start", "stop"):  # shares of the run to steps, as train.py resolves them (HDETConfig.for_run)
        if isinstance(auto_lr.get(name), float):
            auto_lr[name] = round(auto_lr[name] * args.steps)
    return checked_hdet_config(**config)


def worker_args(args: argparse.Namespace, run: dict[str, Any], run_dir: Path) -> list[str]:
    """The worker's arguments for ``run`` (writes its HDET config into ``run_dir``)."""
    words = ["--preset", args.preset, "--steps", str(args.steps), "--batch_size", str(args.batch_size),
             "--seq_len", str(args.seq_len), "--schedule", args.schedule, "--lr", f"{run['lr']:.8g}",
             "--seed", str(run["seed"]), "--out", str(run_dir)]
    hidden = proxy_hidden(args) if run["method"] == "proxy_sweep" else args.hidden
    words += [item for key, value in (("hidden", hidden), ("layers", args.layers),
                                      ("weight_decay", args.weight_decay)) if value is not None
              for item in (f"--{key}", str(value))]
    if run["method"] == "range_probe":
        return [*words, "--range_test"]
    if run["method"] in ("schedulefree", "prodigy"):
        return [*words, "--optimizer", run["method"]]
    if run["method"] == "hdet":
        variant = VARIANTS[run["variant"]]
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "hdet.json").write_text(json.dumps(variant_config(args, variant, run["seed"]), indent=1) + "\n")
        words += ["--hdet_config", str(run_dir / "hdet.json")] + (["--probe"] if variant["probe"] else [])
        words += ["--range_start"] if variant.get("range_start") else []
    return words


def run_dir_of(args: argparse.Namespace, run: dict[str, Any]) -> Path:
    name = "_".join(str(part) for part in (run["method"], run.get("variant") or "", f"lr{run['lr']:.3g}",
                                          f"seed{run['seed']}") if part != "")
    return args.runs_dir / name


def execute(args: argparse.Namespace, todo: list[dict[str, Any]], source: Path, record: dict[str, Any],
            save: Callable[[], None]) -> None:
    """Runs ``todo`` one seed per launch (at most ``--runs_per_launch`` runs each), ``--parallel`` launches at a
    time, recording each launch's runs and calling ``save`` as it ends (a stopped benchmark loses at most the
    launches under way)."""
    waiting, where = [], ran_on(source.name)
    for seed in sorted({run["seed"] for run in todo}):
        runs = [run for run in todo if run["seed"] == seed]
        size = args.runs_per_launch or len(runs)
        waiting += [runs[first:first + size] for first in range(0, len(runs), size)]
    running: list[tuple[list[dict[str, Any]], Path, list[str], subprocess.Popen]] = []
    while waiting or running:
        while waiting and len(running) < args.parallel:
            batch = waiting.pop(0)
            args.runs_dir.mkdir(parents=True, exist_ok=True)
            spec = args.runs_dir / f"launch_{run_dir_of(args, batch[0]).name}.json"
            spec.write_text(json.dumps([worker_args(args, run, run_dir_of(args, run)) for run in batch]) + "\n")
            command = torchrun_command(args.nproc, str(source / "benchmarks" / WORKER), "--batch", str(spec))
            path = os.pathsep.join(filter(None, (str(source), os.environ.get("PYTHONPATH"))))
            env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
            log = spec.with_suffix(".log").open("w")
            running.append((batch, spec, command, subprocess.Popen(command, cwd=REPO, env=env, stdout=log,
                                                                    stderr=subprocess.STDOUT, text=True)))
            log.close()  # the child holds its own copy
        finished = _wait_any([launch[3] for launch in running])
        batch, spec, command, process = running.pop(finished)
        if process.returncode != 0:
            print(f"warning: {spec.name} exited {process.returncode}; see {spec.with_suffix('.log')}", file=sys.stderr)
        for run in batch:
            _record(args, run, record, where)
        record["invocations"].append(f"PYTHONPATH={shlex.quote(str(source))} {shlex.join(command)}")
        save()


def _wait_any(processes: list[subprocess.Popen]) -> int:
    """The index of the first of ``processes`` to end (polled: launches last minutes)."""
    while True:
        for index, process in enumerate(processes):
            if process.poll() is not None:
                return index
        time.sleep(1.0)


def ran_on(commit: str) -> str:
    """Where a run's last bits come from: the code's commit and this boot of this machine (the same run on
    another machine can end 0.01 apart after 1,500 steps of float rounding going another way)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{commit} on {boot.read_text().strip() if boot.exists() else platform.node()}"


def _record(args: argparse.Namespace, run: dict[str, Any], record: dict[str, Any], where: str) -> None:
    """Adds ``run``'s result (when its worker wrote one) to ``record``, with where it ran (``ran_on``)."""
    run_dir = run_dir_of(args, run)
    result = read_json(run_dir / "result.json")
    if result is None:
        return
    if run["method"] == "range_probe":
        record.setdefault("range_probes", []).append({**run, **result["range_test"], "run_dir": repo_relative(run_dir)})
        print(f"  range test seed {run['seed']}: picked LR {result['range_test']['picked_lr']}", flush=True)
        return
    entry = {**run, "heldout": _finite(result["heldout"]) if result["diverged_at_step"] is None else None,
             "train": result["train"], "diverged_at_step": result["diverged_at_step"],
             "wall_seconds": round(result["wall_seconds"], 1), "scales": result["scales"],
             "deltas": result.get("deltas"), "range_pick": result.get("range_pick"),
             "run_dir": repo_relative(run_dir), "ran_on": where}
    if result.get("other_scales"):  # where the controller took the other explored values, over their start
        entry["other_scales"] = result["other_scales"]
    if run["method"] == "hdet":  # what it ran, readable after the variant changes or leaves VARIANTS
        entry |= {"hdet_config": read_json(run_dir / "hdet.json"), "probe": VARIANTS[run["variant"]]["probe"]}
    entry["final_lr_ratio"] = final_lr_ratio(entry, record.get("best_lr"))
    record.setdefault(RUNS_KEY.get(run["method"], "runs"), []).append(entry)
    print(f"  {run['method']:<12} {run.get('variant') or '':<13} lr {run['lr']:.3g} seed {run['seed']}: "
          f"held-out {entry['heldout']}", flush=True)


def gpu_of_this_machine() -> dict[str, str]:
    """``{"gpu": name}`` when the workers will find a GPU (every rank then runs on one), else nothing."""
    import torch

    return {"gpu": torch.cuda.get_device_name(0)} if torch.cuda.is_available() else {}


def _finite(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


RUNS_KEY = {"sweep": "sweep_runs", "proxy_sweep": "proxy_sweep_runs"}
"""Where a method's runs are recorded, when not in ``runs``."""


def final_lr_ratio(run: dict[str, Any], best_lr: float | None) -> float | None:
    """The LR the run ended on before the schedule's own decay (its start LR times the controller's last
    effective scale) over the sweep-best LR; None for Prodigy, whose LR is its own estimate."""
    if best_lr is None or run["method"] == "prodigy":
        return None
    scale = run["scales"][-1][1] if run["scales"] else 1.0
    return run["lr"] * scale / best_lr


# ------------------------------------------------------------------------------------------- phases
def sweep_best(record: dict[str, Any], key: str = "sweep_runs") -> tuple[float | None, list[float]]:
    """The LR of the sweep recorded under ``key`` with the lowest mean held-out loss over its seeds (a diverged
    seed counts as +inf), and the grid's LRs, sorted."""
    by_lr: dict[float, list[float]] = {}
    for run in record.get(key, []):
        by_lr.setdefault(run["lr"], []).append(math.inf if run["heldout"] is None else run["heldout"])
    if not by_lr:
        return None, []
    return min(by_lr, key=lambda lr: statistics.fmean(by_lr[lr])), sorted(by_lr)


def sweep(args: argparse.Namespace, record: dict[str, Any], source: Path, save: Callable[[], None],
          method: str = "sweep", seeds: list[int] | None = None) -> None:
    """Runs the grid of ``method`` (the sweep, or the proxy's), extending it until the best LR has
    ``--grid_side`` points on each side."""
    grid = [args.grid_center * SQRT10 ** k for k in range(-args.grid_side, args.grid_side + 1)]
    while True:
        todo = pending(record, [{"method": method, "lr": lr, "seed": seed} for lr in grid
                                for seed in (seeds or args.seeds)])
        execute(args, todo, source, record, save)
        best, lrs = sweep_best(record, RUNS_KEY[method])
        index = lrs.index(best)
        below, above = index, len(lrs) - 1 - index
        if below >= args.grid_side and above >= args.grid_side:
            return
        grid = [best * SQRT10 ** k for k in range(-args.grid_side, args.grid_side + 1)]


def pending(record: dict[str, Any], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    done = {run_key(run) for key in ("sweep_runs", "proxy_sweep_runs", "runs") for run in record.get(key, [])}
    done |= {run_key(run) for run in record.get("range_probes", [])}
    return [run for run in runs if run_key(run) not in done]


def picked_runs(args: argparse.Namespace, record: dict[str, Any], source: Path, save: Callable[[], None],
                method: str, lrs: dict[int, float]) -> None:
    """Plain runs of the full model at the LR ``lrs`` gives each seed, recorded as ``method``: a sweep run at the
    same LR and seed is the same run, and is copied rather than run again."""
    todo = []
    for run in pending(record, [{"method": method, "variant": method, "lr": lr, "seed": seed}
                                for seed, lr in lrs.items()]):
        same = [done for done in record["sweep_runs"]
                if done["seed"] == run["seed"] and math.isclose(done["lr"], run["lr"])]
        if same:
            record["runs"].append({**same[0], **run})
        else:
            todo.append(run)
    execute(args, todo, source, record, save)


def range_tests(args: argparse.Namespace, record: dict[str, Any], source: Path, save: Callable[[], None]) -> None:
    """The range test for each seed, then a plain run at each seed's pick."""
    execute(args, pending(record, [{"method": "range_probe", "lr": 1.0, "seed": seed} for seed in args.seeds]),
            source, record, save)
    picks = {probe["seed"]: probe["picked_lr"] for probe in record.get("range_probes", [])
             if probe["seed"] in args.seeds and probe["picked_lr"] is not None}
    picked_runs(args, record, source, save, "range_test", picks)


def proxy_transfer(args: argparse.Namespace, record: dict[str, Any], source: Path, save: Callable[[], None]) -> None:
    """The half-width sweep, then plain runs of the full model at its best LR."""
    sweep(args, record, source, save, method="proxy_sweep", seeds=args.proxy_seeds or args.seeds[:1])
    record["proxy_best_lr"], _ = sweep_best(record, "proxy_sweep_runs")
    picked_runs(args, record, source, save, "proxy", {seed: record["proxy_best_lr"] for seed in args.seeds})


def starts_from_range_test(variant: str) -> bool:
    """Whether HDET runs of ``variant`` start with the library's LR range test: its ramp goes over fixed LRs
    and the run goes on from its pick, so the LR a run is given should not change it."""
    if not VARIANTS[variant].get("library"):
        return False
    from hdet_scale.config import HDETConfig

    return bool(HDETConfig.from_dict(VARIANTS[variant]["hdet"]).auto_lr.filled().range_test)


def bitwise_comparable(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The largest share of ``runs`` that ran with one commit on one machine (``ran_on``; runs recorded before it
    was, together): only those can be expected to end alike to the last bit."""
    groups: dict[str | None, list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault(run.get("ran_on"), []).append(run)
    return max(groups.values(), key=len)


def one_run_for_every_start(args: argparse.Namespace, record: dict[str, Any], source: Path,
                            save: Callable[[], None], variant: str, starts: list[float]) -> None:
    """HDET runs of ``variant`` (one that starts from the range test) from ``starts``, one run per seed: the first
    seed runs from every start, and where its runs end alike (of those ``bitwise_comparable``: the same held-out
    loss to the last bit, or a divergence at the same step), each other seed runs from one start (or has run
    before) and that run is recorded for its other starts too (``copy_of_lr`` names the LR it ran from; its scales
    are over the LR it stands for). Where they differ, the copies go and every seed runs from every start."""
    first, *others = args.seeds

    def of_variant(run: dict[str, Any]) -> bool:
        return (run["method"], run.get("variant")) == ("hdet", variant)

    def recorded(seed: int) -> list[dict[str, Any]]:
        return [run for run in record["runs"] if of_variant(run) and run["seed"] == seed]

    def runs(seed: int, lrs: list[float]) -> list[dict[str, Any]]:
        return [{"method": "hdet", "variant": variant, "lr": lr, "seed": seed} for lr in lrs]

    todo = runs(first, starts) + [run for seed in others if not recorded(seed) for run in runs(seed, starts[:1])]
    execute(args, pending(record, todo), source, record, save)
    first_runs = recorded(first)
    if not all(any(math.isclose(run["lr"], lr) for run in first_runs) for lr in starts):
        print(f"warning: {variant} has no run of seed {first} from every start (see the launch logs); its other "
              "seeds wait for them", file=sys.stderr)
        return
    if len({(run["heldout"], run["diverged_at_step"]) for run in bitwise_comparable(first_runs)}) == 1:
        for seed in others:
            ran = [run for run in recorded(seed) if "copy_of_lr" not in run]
            for run in pending(record, runs(seed, starts)) if ran else []:
                ratio = ran[0]["lr"] / run["lr"]
                record["runs"].append({**ran[0], **run, "copy_of_lr": ran[0]["lr"],
                                       "scales": [[step, scale * ratio] for step, scale in ran[0]["scales"]]})
        save()
        return
    print(f"warning: {variant}'s runs of seed {first} end differently from different starts; every seed runs "
          "from every start", file=sys.stderr)
    record["runs"] = [run for run in record["runs"] if not (of_variant(run) and "copy_of_lr" in run)]
    execute(args, pending(record, [run for seed in others for run in runs(seed, starts)]), source, record, save)


def run_setting(args: argparse.Namespace, record: dict[str, Any], save: Callable[[], None],
                commit: str | None = None) -> dict[str, Any]:
    """Runs ``args.methods`` on the setting of ``args`` into ``record`` (a new record if it holds another setting)
    with ``hdet_scale`` and the workers as of ``commit`` (default: HEAD), calling ``save`` after every launch, and
    returns the record with its summary keys (``best_lr``, ``sweep``, each run's ``start_factor`` and
    ``final_lr_ratio``) filled in."""
    commit = commit or head_commit()
    if record.get("setting") != setting(args):
        record.clear()
        record.update(setting=setting(args), sweep_runs=[], runs=[], invocations=[])
    record["default_variant"] = DEFAULT_VARIANT
    if not args.report_only:  # a report rewritten elsewhere keeps the machine its runs ran on
        record["machine"] = machine_info(backend="gloo", ranks=args.nproc, packages=("torch", "transformers"),
                                         **gpu_of_this_machine())
        source = snapshot_source(commit, args.runs_dir)
        record["hdet_scale_commit"] = commit
        if "sweep" in args.methods:
            sweep(args, record, source, save)
        record["best_lr"], _ = sweep_best(record)
        if record["best_lr"] is None:
            raise SystemExit("lr_finding: no sweep recorded; run --methods sweep first")
        if "range_test" in args.methods:
            range_tests(args, record, source, save)
        if "proxy" in args.methods:
            proxy_transfer(args, record, source, save)
        starts = [record["best_lr"] * factor for factor in args.start_factors]
        todo = []
        if "hdet" in args.methods:
            todo += [{"method": "hdet", "variant": variant, "lr": lr, "seed": seed}
                     for variant in args.variants if not starts_from_range_test(variant)
                     for lr in starts for seed in args.seeds]
            for variant in filter(starts_from_range_test, args.variants):
                one_run_for_every_start(args, record, source, save, variant, starts)
        if "schedulefree" in args.methods:
            todo += [{"method": "schedulefree", "variant": "schedulefree", "lr": lr, "seed": seed}
                     for lr in starts for seed in args.seeds]
        if "prodigy" in args.methods:
            todo += [{"method": "prodigy", "variant": "prodigy", "lr": 1.0, "seed": seed} for seed in args.seeds]
        execute(args, pending(record, todo), source, record, save)
    record["best_lr"], _ = sweep_best(record)
    record["sweep"] = [{"lr": run["lr"], "seed": run["seed"], "heldout": run["heldout"]}
                       for run in record["sweep_runs"]]
    for run in record["runs"]:
        run["start_factor"] = run["lr"] / record["best_lr"] if run["method"] in START_METHODS else None
        run["final_lr_ratio"] = final_lr_ratio(run, record["best_lr"])
    return record


OPTIMIZER_PACKAGES = {"schedulefree": "schedulefree", "prodigy": "prodigyopt"}
"""The package each baseline optimizer's method imports (the ``bench`` extra)."""


def check_packages(methods: list[str]) -> None:
    """Stops, in one line, where one of ``methods`` needs a package that is not installed."""
    missing = [package for method, package in OPTIMIZER_PACKAGES.items()
               if method in methods and importlib.util.find_spec(package) is None]
    if missing:
        raise SystemExit(f"lr_finding: --methods {' '.join(methods)} need {', '.join(missing)}, not installed here: "
                         "pip install -e '.[bench]'")


START_METHODS = ("hdet", "schedulefree")
"""The methods that start from the LR a user gives (the others pick their own)."""


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.report_only:
        check_packages(args.methods)
    path = args.out.with_suffix(".json")
    record = read_json(path) or {}
    run_setting(args, record, lambda: write_json(path, record))
    write_json(path, record)
    write_report(args.out, record)


if __name__ == "__main__":
    main()
