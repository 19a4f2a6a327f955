"""The quality benchmark's grid: its settings, every row of every group, and the LRs the rows take from the
plain-DP sweep (see ``quality.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from common import hdet_config

NPROC = 4
"""Ranks per run, every rank a replica (the paper's layout)."""
GROUPS = ("sweep", "main", "hdet_sweep", "direction")
LOW_HIGH_RATIO = 9.0  # the paper's Baseline-High / Baseline-Low


@dataclass(frozen=True)
class Settings:
    """What every run of one benchmark shares (runs with other settings are not merged)."""

    # What each run trains (the worker's arguments; the same token budget for every run).
    steps: int = 400
    batch_size: int = 8
    seq_len: int = 64
    log_every: int = 10
    eval_every: int = 100
    preset: str = "tiny"
    # HDET's sync intervals, and when its controller starts.
    t_main: int = 25
    t_short: int = 10
    t_long: int = 100
    controller_start: float = 0.25
    """auto_lr.start as a fraction of the run."""
    # The plain-DP sweep's max LRs (factors of 3, so that 9x is two points up).
    grid: tuple[float, ...] = (1e-3, 3e-3, 9e-3, 2.7e-2, 8.1e-2, 2.43e-1, 7.29e-1)

    @property
    def tokens(self) -> int:
        """The tokens each run trains on (over all ranks)."""
        return self.steps * NPROC * self.batch_size * self.seq_len

    def key(self) -> dict[str, Any]:
        """The settings as the results record them (a record with other settings is not added to)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


QUICK = Settings(steps=40, t_main=10, t_short=5, t_long=20, log_every=5, eval_every=20,
                 grid=(3e-3, 2.7e-2, 2.43e-1))


@dataclass(frozen=True)
class Row:
    """One configuration. ``lr`` names where its LR comes from: a grid value, ``low``, ``high``, ``best``,
    ``too_low``, ``too_high`` or ``prodigy`` (1.0)."""

    name: str
    group: str
    lr: str | float
    hdet: dict[str, Any] | None = None
    optimizer: str = "adamw"
    probe: bool = False
    label: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


def row_config(*, alpha: float, sync_interval: int, auto_lr: bool = True, mode: str = "scale",
               warm_init: bool = True, gradient_mode: str = "global", step_size: float = 0.5) -> dict[str, Any]:
    """A row's HDET config, every setting the rows vary written out (``worker_args`` adds the seed, the
    controller's start and the metrics path per run)."""
    return hdet_config(alpha=alpha, sync_interval=sync_interval, gradient_mode=gradient_mode,
                       auto_lr={"enabled": auto_lr, "mode": mode, "step_size": step_size},
                       warm_init={"enabled": warm_init})


def build_rows(s: Settings) -> list[Row]:
    """Every row of every group for settings ``s``."""
    rows = [Row(f"dp_lr{lr:g}", "sweep", lr, label=f"plain DP, max LR {lr:g}") for lr in s.grid]
    paper_alpha = 1 / 9
    rows += [
        Row("baseline_low", "main", "low", label="Baseline-Low (plain DP)"),
        Row("baseline_high", "main", "high", label="Baseline-High (plain DP, 9x)"),
        Row("hdet_no_autolr", "main", "high", row_config(alpha=paper_alpha, sync_interval=s.t_main, auto_lr=False),
            label="HDET w/o auto-LR"),
        Row("hdet_no_warm", "main", "high", row_config(alpha=paper_alpha, sync_interval=s.t_main, warm_init=False),
            label="HDET w/o warm init"),
        Row("hdet_full", "main", "high", row_config(alpha=paper_alpha, sync_interval=s.t_main), label="HDET (full)"),
        Row("hdet_local", "main", "high",
            row_config(alpha=paper_alpha, sync_interval=s.t_main, gradient_mode="local"),
            label="HDET full, local gradients"),
        Row("schedulefree", "main", "best", optimizer="schedulefree", label="schedule-free AdamW (best DP LR)"),
        Row("prodigy", "main", 1.0, optimizer="prodigy", label="Prodigy (LR 1.0)"),
    ]
    rows += [
        Row("hdet_full_a0.25", "hdet_sweep", "high", row_config(alpha=0.25, sync_interval=s.t_main),
            label="HDET full, alpha 0.25", meta={"alpha": 0.25, "T": s.t_main, "mode": "scale"}),
        Row("hdet_full_a0.5", "hdet_sweep", "high", row_config(alpha=0.5, sync_interval=s.t_main),
            label="HDET full, alpha 0.5", meta={"alpha": 0.5, "T": s.t_main, "mode": "scale"}),
        Row(f"hdet_full_T{s.t_short}", "hdet_sweep", "high", row_config(alpha=paper_alpha, sync_interval=s.t_short),
            label=f"HDET full, T {s.t_short}", meta={"alpha": paper_alpha, "T": s.t_short, "mode": "scale"}),
        Row(f"hdet_full_T{s.t_long}", "hdet_sweep", "high", row_config(alpha=paper_alpha, sync_interval=s.t_long),
            label=f"HDET full, T {s.t_long}", meta={"alpha": paper_alpha, "T": s.t_long, "mode": "scale"}),
        Row("hdet_full_paper", "hdet_sweep", "high", row_config(alpha=paper_alpha, sync_interval=s.t_main,
                                                                  mode="paper"),
            label="HDET full, paper controller", meta={"alpha": paper_alpha, "T": s.t_main, "mode": "paper"}),
    ]
    for start in ("too_low", "too_high"):
        for sync in (s.t_short, s.t_long):
            for mode in ("scale", "paper"):
                for probe in (False, True):
                    name = f"dir_{start.replace('too_', '')}_T{sync}_{mode}_{'probe' if probe else 'noprobe'}"
                    rows.append(Row(name, "direction", start,
                                    row_config(alpha=0.5, sync_interval=sync, mode=mode, warm_init=False),
                                    probe=probe, label=name,
                                    meta={"start": start, "T": sync, "mode": mode, "probe": probe, "lambda": 0.5}))
        # A bolder step (lambda 2 instead of 0.5) with the probe's cleaner signal: can the controller cover a
        # 9x-too-low LR within the run once its votes point the right way?
        for sync in (s.t_short, s.t_main):
            name = f"dir_{start.replace('too_', '')}_T{sync}_scale_probe_lambda2"
            rows.append(Row(name, "direction", start,
                            row_config(alpha=0.5, sync_interval=sync, warm_init=False, step_size=2.0),
                            probe=True, label=name,
                            meta={"start": start, "T": sync, "mode": "scale", "probe": True, "lambda": 2.0}))
    return rows


# ------------------------------------------------------------------------------------------------ LRs
def select_lrs(sweep: dict[float, dict[str, Any]], ratio: float = LOW_HIGH_RATIO) -> dict[str, Any]:
    """The rows' LRs from the plain-DP sweep (``{lr: {"unstable": bool, "final_train_loss": float}}``).

    ``high``: the smallest LR that is unstable and whose ``1/ratio`` is a stable grid LR; ``low``: high /
    ratio; ``best``: the stable LR with the lowest final training loss; ``too_low``: best / ratio if it is in
    the grid, else the lowest grid LR; ``too_high``: the largest stable LR above best (else ``high``).
    Raises ValueError when no grid LR is unstable or none is stable.
    """
    lrs = sorted(sweep)
    stable = [lr for lr in lrs if not sweep[lr]["unstable"]]
    if not stable:
        raise ValueError("no grid LR is stable: extend --grid downwards")

    def in_grid(value: float) -> float | None:
        return next((lr for lr in lrs if math.isclose(lr, value, rel_tol=0.02)), None)

    high = next((lr for lr in lrs if sweep[lr]["unstable"] and (low := in_grid(lr / ratio)) is not None
                 and not sweep[low]["unstable"]), None)
    if high is None:
        raise ValueError(f"no grid LR is unstable with a stable LR {ratio:g}x below it: extend --grid upwards")
    best = min(stable, key=lambda lr: sweep[lr]["final_train_loss"])
    too_low = in_grid(best / ratio) or lrs[0]
    above = [lr for lr in stable if lr > best]
    return {"low": in_grid(high / ratio), "high": high, "best": best, "too_low": too_low,
            "too_high": above[-1] if above else high}


def resolve_lr(row: Row, lrs: dict[str, float] | None) -> float:
    """The max LR of ``row``: its own, or the one ``lrs`` (from ``select_lrs``) gives its kind."""
    if isinstance(row.lr, float):
        return row.lr
    if lrs is None:
        raise SystemExit(f"row {row.name} needs the LR sweep first: run --groups sweep")
    return lrs[row.lr]

