"""The quality benchmark's results: per-row summaries, the findings derived from them, the Markdown page and
the figures (see ``quality.py``).

Findings are computed from the numbers, so they stay true on a re-run. What cannot be computed (the history
of the sweep's threshold, caveats about the setting and the machine) is written by hand into note blocks of
the results' Markdown, ``sweep`` and ``caveats``, which a rewrite keeps (``common.save_markdown``).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import REPO, bullets, note, repo_relative, save_markdown, table_header, table_row
from quality_rows import NPROC, Row
from quality_runs import DIRECTION_BAND, SPIKE_NATS, onecycle_schedule


# ------------------------------------------------------------------------------------------ summaries
def row_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-row spread of the final losses and wall time, divergence counts, and the controller's end."""
    entry: dict[str, Any] = {"seeds": [r["seed"] for r in records], "lr": records[0]["lr"],
                             "label": records[0]["label"], "meta": records[0]["meta"]}
    for key in ("final_train_loss", "final_heldout_loss", "wall_seconds"):
        entry[key] = {**spread([r[key] for r in records]), "per_seed": [r[key] for r in records]}
    entry["diverged"] = sum(r["diverged"] for r in records)
    entry["unstable"] = sum(r["unstable"] for r in records)
    entry["max_spike"] = max(r["spike"] for r in records)
    if all("controller" in r for r in records):
        entry["controller"] = {key: [r["controller"][key] for r in records]
                               for key in ("ratio_end", "ratio_gmean", "up_fraction", "direction")}
    return entry


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Mean, sample standard deviation (0 for one value), min, max and count of the finite ``values``; the
    non-finite ones are counted apart (a diverged seed has no loss to average)."""
    finite = [value for value in values if math.isfinite(value)]
    if not finite:
        return {"mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan, "n": 0,
                "nonfinite": len(values)}
    return {"mean": statistics.fmean(finite), "std": statistics.stdev(finite) if len(finite) > 1 else 0.0,
            "min": min(finite), "max": max(finite), "n": len(finite), "nonfinite": len(values) - len(finite)}


def missing_runs(rows: Sequence[Row], records: list[dict[str, Any]]) -> list[str]:
    """Each row whose seeds have not all run (the sweep: seed 0, the others: seeds 0-2), and how to run them."""
    missing = []
    for row in rows:
        absent = sorted(set([0] if row.group == "sweep" else range(3))
                        - {r["seed"] for r in records if r["row"] == row.name})
        if absent:
            missing.append(f"{row.group}/{row.name}: seeds {absent}")
    if missing:
        missing.append("run the rest with: `.venv/bin/python benchmarks/quality.py --groups main hdet_sweep "
                       "direction --seeds 0 1 2` (runs already recorded are skipped)")
    return missing


def findings(summary: dict[str, dict[str, Any]], lrs: dict[str, float] | None,
             records: list[dict[str, Any]]) -> list[str]:
    """Plain statements derived from the numbers (so they stay true on a re-run)."""
    lines = []
    get = summary.get
    low, high, full = get("baseline_low"), get("baseline_high"), get("hdet_full")
    if low and high:
        lines.append(f"Baseline-High (max LR {high['lr']:g}) was unstable in {high['unstable']} of "
                     f"{len(high['seeds'])} seeds (largest climb above its best loss {high['max_spike']:.2f} nats); "
                     f"Baseline-Low ({low['lr']:g}) in {low['unstable']} of {len(low['seeds'])}.")
    if full and low:
        diff = full["final_train_loss"]["mean"] - low["final_train_loss"]["mean"]
        lines.append(f"Target 'HDET full at the high LR trains stably and ends at or below Baseline-Low': HDET full "
                     f"unstable in {full['unstable']} of {len(full['seeds'])} seeds; train loss minus Baseline-Low "
                     f"{diff:+.3f} -> {'met' if full['unstable'] == 0 and diff <= 0 else 'MISSED'}.")
    at_high = [entry for name, entry in summary.items()
               if name.startswith("hdet_") and lrs and entry["lr"] == lrs["high"]]
    if at_high and low:
        stable = [entry for entry in at_high if entry["unstable"] == 0]
        best = min(at_high, key=lambda entry: entry["final_train_loss"]["mean"])
        lines.append(f"HDET variants at the high LR stable in every seed: "
                     f"{', '.join(entry['label'] for entry in stable) or 'none'}; the lowest train loss of any HDET "
                     f"variant there: {best['label']}, {best['final_train_loss']['mean']:.3f} (Baseline-Low "
                     f"{low['final_train_loss']['mean']:.3f}).")
    auto = [get(name) for name in ("schedulefree", "prodigy") if get(name)]
    if full and auto:
        best_auto = min(a["final_heldout_loss"]["mean"] for a in auto)
        diff = full["final_heldout_loss"]["mean"] - best_auto
        lines.append(f"Target 'HDET full held-out at or below the best of schedule-free and Prodigy': "
                     f"{full['final_heldout_loss']['mean']:.3f} vs {best_auto:.3f} ({diff:+.3f}) -> "
                     f"{'met' if diff <= 0 else 'MISSED'}.")
    direction = [(name, entry) for name, entry in summary.items() if name.startswith("dir_")]
    for start in ("low", "high"):
        mine = [(name, entry) for name, entry in direction if name.startswith(f"dir_{start}_")]
        if not mine:
            continue
        moves = [d for _, entry in mine for d in entry["controller"]["direction"]]
        counts = {d: moves.count(d) for d in ("up", "down", "flat", "none") if moves.count(d)}
        want = "up" if start == "low" else "down"
        lines.append(f"Started too {start} ({mine[0][1]['lr']:g}): the controller moved the LR "
                     f"{', '.join(f'{d} in {n}' for d, n in counts.items())} of {len(moves)} runs (wanted: {want}).")
        scales = [value for _, entry in mine if entry["meta"]["mode"] == "scale"
                  for value in entry["controller"]["ratio_end"]]
        if lrs and scales:
            needed = lrs["best"] / lrs[f"too_{start}"]
            lines.append(f"  `scale` mode ended at scale {min(scales):.2f}-{max(scales):.2f}; reaching the sweep's "
                         f"best LR would take {needed:.2f}.")
            for step in sorted({entry["meta"].get("lambda", 0.5) for _, entry in mine} - {0.5}):
                by_interval: dict[int, list[float]] = {}
                for _, entry in mine:
                    if entry["meta"].get("lambda", 0.5) == step:
                        by_interval.setdefault(entry["meta"]["T"], []).extend(entry["controller"]["ratio_end"])
                lines.append(f"  With lambda {step:g} and the probe: scale at the end " + "; ".join(
                    f"T = {t}: {', '.join(f'{v:.2f}' for v in values)}" for t, values in sorted(by_interval.items()))
                    + ".")
        right = [name for name, entry in mine if all(d == want for d in entry["controller"]["direction"])]
        if right:
            lines.append(f"  Settings that moved it {want} in every seed: {', '.join(right)}.")
    if lrs:
        dp = {r["lr"]: r for r in records if r["group"] == "sweep" and r["seed"] == 0}
        for start in ("too_low", "too_high"):
            lr = lrs[start]
            mine = [entry for name, entry in direction if entry["lr"] == lr]
            if lr in dp and mine:
                best_dir = min(entry["final_train_loss"]["mean"] for entry in mine)
                lines.append(f"From {start.replace('_', ' ')} ({lr:g}): plain DP there ended at "
                             f"{dp[lr]['final_train_loss']:.3f}, plain DP at the best LR {lrs['best']:g} at "
                             f"{dp[lrs['best']]['final_train_loss']:.3f}; the best direction-study variant at "
                             f"{best_dir:.3f}.")
    return lines


# ------------------------------------------------------------------------------------------ Markdown
def _f(value: float, digits: int = 3) -> str:
    return "nan" if not math.isfinite(value) else f"{value:.{digits}f}"


def _cell(stats: dict[str, Any], digits: int = 3) -> str:
    """``mean ± std [per seed]`` with the non-finite seeds named."""
    text = _f(stats["mean"], digits)
    if stats["n"] > 1:
        text += f" ± {_f(stats['std'], digits)} [{', '.join(_f(v, digits) for v in stats['per_seed'])}]"
    if stats["nonfinite"]:
        text += f" ({stats['nonfinite']} non-finite)"
    return text


def write_markdown(path: Path, data: dict[str, Any], missing: list[str]) -> None:
    """The results page of ``data`` (the JSON record): the setting, the tables, the findings, the figures and
    what is ``missing``, keeping the hand-written notes of the page at ``path``."""
    summary = data["summary"]
    lines = [*header_markdown(data), *sweep_markdown(data)]
    for group, title in (("main", "Main rows (the paper's Table 1 in miniature)"),
                         ("hdet_sweep", "HDET full: alpha, T and controller mode")):
        lines += rows_markdown(title, [entry for entry in summary.values() if entry["group"] == group])
    lines += direction_markdown([entry for entry in summary.values() if entry["group"] == "direction"])
    lines += ["## Findings", "", *bullets(data["findings"]), "", "## Caveats", "", *note("caveats"), ""]
    if data.get("figures"):
        lines += ["## Figures", "", *bullets(f"[{Path(f).name}]({(REPO / f).relative_to(path.parent)}): {what}"
                                             for f, what in data["figures"]), ""]
    lines += ["## Missing", "", *bullets(missing or ["nothing: every row and seed asked for has run."]), "",
              f"Per-run data (curves, per-sync base LR and scale, commands): `{path.with_suffix('.json').name}`."]
    save_markdown(path, lines)


def header_markdown(data: dict[str, Any]) -> list[str]:
    """The title, the setting every run shares and the commands that ran."""
    s, info = data["settings"], data["machine"]
    return [
        "# Quality benchmark (CPU): HDET against plain DP, schedule-free AdamW and Prodigy",
        "",
        f"`benchmarks/quality.py`; last update {info['date']} on {info['platform']} ({info['nproc']} CPU cores), "
        f"torch {info['torch']}, transformers {info['transformers']}, `hdet_scale` at commit "
        f"{info['git_commit'][:12]}. Model: preset `{s['preset']}` (byte-level Llama, 256-token vocabulary) on "
        f"the embedded stdlib corpus (4 MiB, every 20th file held out); {NPROC} ranks on gloo = {NPROC} replicas, "
        f"AdamW (weight decay 0.01) with OneCycleLR, {s['steps']} steps x {NPROC} ranks x {s['batch_size']} x "
        f"{s['seq_len']} bytes = {s['steps'] * NPROC * s['batch_size'] * s['seq_len']:,} tokens for every run. "
        f"HDET: global gradients unless noted, controller from step {round(s['controller_start'] * s['steps'])}, "
        f"sigma 0.1, beta 0.9, lambda 0.5, warm init nu 0.01. Train loss: the final (averaged) model on "
        f"{16} fixed training batches; held-out: on {16} fixed held-out batches (the same in every run). "
        "Mean ± sample std over seeds [per seed]. Lower is better. Wall time: training loop only, on a shared "
        "2-core machine (compare within one table only).",
        "",
        "Commands run (in order):",
        "",
        *bullets(f"`{inv['command']}` ({inv['date']})" for inv in data["invocations"]),
        "",
    ]


def sweep_markdown(data: dict[str, Any]) -> list[str]:
    """The plain-DP sweep, how it picks the rows' LRs, and the ``sweep`` note."""
    sweep = sorted((r for r in data["runs"] if r["group"] == "sweep"), key=lambda r: (r["lr"], r["seed"]))
    if not sweep:
        return []
    lrs = data.get("lrs")
    return [
        "## LR sweep (plain data parallel, seed 0): how the grid was chosen",
        "",
        *table_header("max LR", "train loss", "held-out", "start loss", "largest climb", "unstable"),
        *[table_row(f"{r['lr']:g}", _f(r["final_train_loss"]), _f(r["final_heldout_loss"]),
                    _f(r["start_train_loss"]), f"{r['spike']:.2f}", "yes" if r["unstable"] else "no") for r in sweep],
        "",
        f"Unstable: non-finite, ending at or above the starting loss, or climbing {SPIKE_NATS} nats above the best "
        "loss reached (10-step means). The grid is in factors of 3 so that 9x is two points up. Baseline-High = "
        "the smallest unstable LR whose LR / 9 is stable; Baseline-Low = that / 9.",
        f"Chosen: {', '.join(f'{k} = {v:g}' for k, v in lrs.items())}." if lrs else
        f"Chosen: none ({data.get('lrs_error')})",
        "",
        *note("sweep"),
        "",
    ]


def rows_markdown(title: str, entries: list[dict[str, Any]]) -> list[str]:
    """A table of row summaries: losses over seeds, how many were unstable, wall time, the controller's end."""
    if not entries:
        return []
    lines = [f"## {title}", "", *table_header("row", "max LR", "train loss", "held-out loss", "unstable / seeds",
                                              "wall s", "controller scale at end")]
    for entry in entries:
        control = entry.get("controller")
        scale = "" if not control else "off" if all(d == "none" for d in control["direction"]) else \
            ", ".join(_f(v, 2) for v in control["ratio_end"])
        lines.append(table_row(entry["label"], f"{entry['lr']:g}", _cell(entry["final_train_loss"]),
                               _cell(entry["final_heldout_loss"]), f"{entry['unstable']} / {len(entry['seeds'])}",
                               _f(entry["wall_seconds"]["mean"], 0), scale))
    return [*lines, ""]


def direction_markdown(entries: list[dict[str, Any]]) -> list[str]:
    """The direction study: where the controller took the LR from the too-low and the too-high start."""
    if not entries:
        return []
    lines = [
        "## The controller's direction",
        "",
        "HDET alpha 0.5, no warm init, from the sweep's too-low and too-high LR. `ratio` is the base LR over where "
        "it would be without the controller's votes: `scale` mode, its scale (base over the plain OneCycle "
        "schedule); `paper` mode, its owned base over the pure geometric decay to OneCycle's floor that mode "
        "follows by itself. `gmean`: its geometric mean over the controller's updates; `up`: the share of updates "
        "whose Delta (eqs. 5-6) pointed up; `moved`: from the ratio at the end (`paper`: from gmean; flat within "
        f"±{DIRECTION_BAND}).",
        "",
        *table_header("start", "T", "mode", "probe", "lambda", "seeds", "ratio at end", "gmean ratio", "up share",
                      "moved", "train loss", "held-out"),
    ]
    for entry in entries:
        meta, c = entry["meta"], entry["controller"]
        lines.append(table_row(
            f"{meta['start'].replace('too_', '')} {entry['lr']:g}", meta["T"], meta["mode"],
            "yes" if meta["probe"] else "no", f"{meta.get('lambda', 0.5):g}", len(entry["seeds"]),
            *[", ".join(_f(v, 2) for v in c[key]) for key in ("ratio_end", "ratio_gmean", "up_fraction")],
            ", ".join(c["direction"]), _cell(entry["final_train_loss"]), _cell(entry["final_heldout_loss"])))
    return [*lines, ""]


# ------------------------------------------------------------------------------------------- figures
def make_plots(records: list[dict[str, Any]], out: Path, steps: int) -> list[tuple[str, str]]:
    """Figure 2 (main rows' loss curves, seed 0) and Figure 3 (HDET full's schedules) via hdet_scale.tools.report,
    plus the direction study's scale curves."""
    from hdet_scale.tools.report import report

    figures = []
    main = [r for r in records if r["group"] == "main" and r["seed"] == min(x["seed"] for x in records)]
    if main:
        paths = [REPO / r["run_dir"] / "loss.jsonl" for r in main]
        labels = [r["label"] for r in main]
        full = next((r for r in main if r["row"] == "hdet_full"), None)
        if full is not None:
            paths.append(REPO / full["run_dir"] / "hdet_metrics.jsonl")
            labels.append("HDET full (replica band)")
        summary = report(paths, out / "main", labels)
        # The committed summary names files by their place in the repository, not on this machine.
        for run in summary["runs"]:
            run["path"] = repo_relative(run["path"])
        summary["files"] = [repo_relative(file) for file in summary["files"]]
        (out / "main" / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        figures += [(file, "Figure 2: training (and held-out) loss vs steps, main rows, first seed" if
                     file.endswith("loss.png") else "Figure 3: HDET full's per-replica LRs, base and scale")
                    for file in summary["files"]]
    direction = [r for r in records if r["group"] == "direction" and "base_lr_per_sync" in r]
    if direction:
        figures.append((repo_relative(plot_direction(direction, out / "direction_scale.png", steps)),
                        "direction study: `scale` mode's base LR / OneCycle schedule over the run, every run"))
    return figures


def plot_direction(records: list[dict[str, Any]], path: Path, steps: int) -> Path:
    """`scale` mode's base LR relative to the plain schedule over steps: one colour per setting (T, probe,
    lambda), one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale_runs = [r for r in records if r["meta"]["mode"] == "scale"]
    settings = sorted({(r["meta"]["T"], r["meta"]["probe"], r["meta"].get("lambda", 0.5)) for r in scale_runs})
    colours = {setting: plt.get_cmap("tab10")(index % 10) for index, setting in enumerate(settings)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, start in zip(axes, ("too_low", "too_high"), strict=True):
        labelled = set()
        for r in scale_runs:
            if r["meta"]["start"] != start:
                continue
            setting = (r["meta"]["T"], r["meta"]["probe"], r["meta"].get("lambda", 0.5))
            schedule = onecycle_schedule(r["lr"], steps)
            points = [(step, base / schedule[step]) for step, base, _ in r["base_lr_per_sync"] if schedule[step] > 0]
            label = None if setting in labelled else (
                f"T {setting[0]}, lambda {setting[2]:g}{', probe' if setting[1] else ''}")
            labelled.add(setting)
            ax.plot([p[0] for p in points], [p[1] for p in points], color=colours[setting], alpha=0.8, label=label)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_yscale("log")
        ax.set_title(f"start {start.replace('_', ' ')}")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("scale: base LR / OneCycle schedule")
    fig.suptitle("auto-LR controller, scale mode: one line per seed", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

