"""The LR-finding benchmark's results: the Markdown tables and the figures (see ``lr_finding.py``).

The headline table gives, for the default variant at every start factor, the mean held-out loss over the seeds
minus the sweep-best LR's mean, and plain data parallel at the same LR. What the numbers mean is written by
hand into the Markdown's note blocks (``findings``, ``caveats``), which a rewrite keeps.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common import note, repo_relative, save_markdown, table_header, table_row

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TARGET_NATS, TARGET_AT_ONE = 0.03, 0.01
FULL_GRID_SEEDS = 3


def mean_sd(values: Iterable[float | None]) -> tuple[float, float, int]:
    """Mean and sample standard deviation of ``values`` (a diverged run, None, counts as +inf), and their count."""
    numbers = [math.inf if value is None else value for value in values]
    if not numbers:
        return math.nan, math.nan, 0
    mean = statistics.fmean(numbers)
    return mean, (statistics.stdev(numbers) if len(numbers) > 1 and math.isfinite(mean) else 0.0), len(numbers)


def sweep_table(record: dict[str, Any]) -> dict[float, tuple[float, float, int]]:
    by_lr: dict[float, list[float | None]] = {}
    for run in record["sweep"]:
        by_lr.setdefault(run["lr"], []).append(run["heldout"])
    return {lr: mean_sd(values) for lr, values in sorted(by_lr.items())}


def method_table(record: dict[str, Any]) -> dict[tuple[str, str, float | None], list[dict[str, Any]]]:
    """Runs by (method, variant, start factor rounded)."""
    groups: dict[tuple[str, str, float | None], list[dict[str, Any]]] = {}
    for run in record["runs"]:
        factor = None if run["start_factor"] is None else round(run["start_factor"], 4)
        groups.setdefault((run["method"], run["variant"], factor), []).append(run)
    return groups


def _fmt(value: float, digits: int = 3, signed: bool = False) -> str:
    if value is None or not math.isfinite(value):
        return "diverged" if value == math.inf else "-"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def headline(record: dict[str, Any], sweep: dict[float, tuple[float, float, int]]) -> list[str]:
    best_lr, variant = record["best_lr"], record["default_variant"]
    best_mean = sweep[best_lr][0]
    lines = [f"Default variant `{variant}`; sweep-best LR {best_lr:.3g}, held-out {best_mean:.3f} (mean of "
             f"{sweep[best_lr][2]} seeds). Target: at most +{TARGET_NATS} nats at every start, and within "
             f"{TARGET_AT_ONE} of plain data parallel at factor 1.", "",
             *table_header("start factor", "start LR", "HDET held-out (mean ± sd)", "HDET - sweep best",
                           "plain DP at the start LR - sweep best", "final LR / best (mean)", "met")]
    for (method, name, factor), runs in sorted(method_table(record).items(), key=lambda item: item[0][2] or 0):
        if method != "hdet" or name != variant:
            continue
        mean, sd, count = mean_sd(run["heldout"] for run in runs)
        plain = _plain_at(sweep, best_lr * factor)
        ratios = [run["final_lr_ratio"] for run in runs if run["final_lr_ratio"] is not None]
        met = mean - best_mean <= TARGET_NATS and (abs(factor - 1) > 1e-3 or mean - plain[0] <= TARGET_AT_ONE)
        lines.append(table_row(f"{factor:.3g}", f"{best_lr * factor:.3g}", f"{_fmt(mean)} ± {_fmt(sd)} ({count})",
                               _fmt(mean - best_mean, signed=True), _fmt(plain[0] - best_mean, signed=True),
                               _fmt(statistics.geometric_mean(ratios) if ratios else math.nan, 2),
                               "yes" if met else "no"))
    return lines


def _plain_at(sweep: dict[float, tuple[float, float, int]], lr: float) -> tuple[float, float, int]:
    closest = min(sweep, key=lambda grid_lr: abs(math.log(grid_lr / lr)))
    return sweep[closest] if abs(math.log(closest / lr)) < 0.05 else (math.nan, math.nan, 0)


def all_methods(record: dict[str, Any], best_mean: float) -> list[str]:
    lines = [*table_header("method", "variant", "start factor", "held-out (mean ± sd, n)", "- sweep best",
                           "final LR / best", "diverged")]
    for (method, name, factor), runs in sorted(method_table(record).items(),
                                               key=lambda item: (item[0][0], item[0][1], item[0][2] or 0)):
        mean, sd, count = mean_sd(run["heldout"] for run in runs)
        ratios = [run["final_lr_ratio"] for run in runs if run["final_lr_ratio"] is not None]
        lines.append(table_row(method, f"`{name}`", "-" if factor is None else f"{factor:.3g}",
                               f"{_fmt(mean)} ± {_fmt(sd)} ({count})", _fmt(mean - best_mean, signed=True),
                               _fmt(statistics.geometric_mean(ratios), 2) if ratios else "-",
                               sum(run["heldout"] is None for run in runs)))
    return lines


def write_report(stem: Path, record: dict[str, Any]) -> None:
    """``<stem>.md`` and ``<stem>_heldout.png`` / ``<stem>_scales.png``."""
    sweep = sweep_table(record)
    best_mean = sweep[record["best_lr"]][0]
    s, m = record["setting"], record["machine"]
    lines = [
        "# LR finding: one HDET run from a wrong LR against the best run of an LR sweep", "",
        f"Setting: preset `{s['preset']}`"
        f"{''.join(f', {key} {s[key]}' for key in ('hidden', 'layers') if s[key] is not None)}, "
        f"{s['steps']} steps, {s['nproc']} ranks = replicas, batch {s['batch_size']} x {s['seq_len']} bytes per rank, "
        f"schedule `{s['schedule']}`, T = {s['sync_interval']}, controller from {s['controller_start']:.0%} of "
        f"the steps (a variant's own `start` wins). Machine: {m['nproc']} CPUs, "
        f"{f'one {gpu} GPU that the ranks share over gloo, ' if (gpu := m.get('gpu')) else ''}"
        f"torch {m['torch']}, {m['date']}. Command: "
        "`python benchmarks/lr_finding.py` with the setting above; every launch is in the JSON.", "",
        "## Headline", "", *headline(record, sweep), "",
        "## The sweep (plain data parallel)", "",
        *table_header("LR", "held-out (mean ± sd, n)", "- best"),
        *[table_row(f"{lr:.3g}" + (" (best)" if lr == record["best_lr"] else ""),
                    f"{_fmt(mean)} ± {_fmt(sd)} ({n})", _fmt(mean - best_mean, signed=True))
          for lr, (mean, sd, n) in sweep.items()], "",
        "## Every method and variant", "", *all_methods(record, best_mean), "",
        "Variants: the HDET settings of each are `VARIANTS` in `benchmarks/lr_finding.py`, and each run's in the JSON "
        "(`hdet_config`; the variants since dropped are described in benchmarks/README.md); `final LR / best` is the "
        "start LR times the controller's last effective scale (base LR over the schedule's), as a geometric mean "
        "over seeds.", "",
        *figures(stem, record, sweep), "",
        "## Findings", "", *note("findings"), "", "## Caveats", "", *note("caveats"),
    ]
    save_markdown(stem.with_suffix(".md"), lines)


def full_grid_variants(record: dict[str, Any]) -> list[str]:
    """The HDET variants run with ``FULL_GRID_SEEDS`` or more seeds from every start factor the default variant
    was run from (a diverged run counts as run)."""
    seeds: dict[tuple[str, float], int] = {}
    for (method, name, factor), runs in method_table(record).items():
        if method == "hdet" and factor is not None:
            seeds[name, factor] = len({run["seed"] for run in runs})
    starts = {factor for name, factor in seeds if name == record["default_variant"]}
    names = {name for name, _ in seeds}
    return sorted(name for name in names if starts and all(seeds.get((name, f), 0) >= FULL_GRID_SEEDS
                                                           for f in starts))


LEGEND_ROWS = 20
"""Entries per legend column beside the variants' panel (more would run off the figure's height)."""


def line_styles(keys: list[tuple[str, str]], default_key: tuple[str, str],
                palette: Sequence[Any]) -> dict[tuple[str, str], tuple[Any, str]]:
    """A (colour, dash) pair per line that no other line has (for up to three times the palette's colours less
    two): the default solid in the palette's first colour, the others dashed, then dotted, then dash-dotted, in
    its colours from the third on (not the default's light twin)."""
    others = sorted(set(keys) - {default_key})
    colours = palette[2:]
    styles = {key: (colours[index % len(colours)], ("--", ":", "-.")[index // len(colours) % 3])
              for index, key in enumerate(others)}
    styles[default_key] = (palette[0], "-")
    return styles


def heldout_figure(record: dict[str, Any], sweep: dict[float, tuple[float, float, int]]) -> Figure:
    """Held-out loss against the start factor: the default variant against the other methods (left), every
    variant with the full grid (right)."""
    import matplotlib.pyplot as plt

    best_lr = record["best_lr"]
    fig, (methods_ax, variants_ax) = plt.subplots(1, 2, figsize=(13, 4.8), layout="constrained")
    lines: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for (method, name, factor), runs in method_table(record).items():
        mean = mean_sd(run["heldout"] for run in runs)[0]
        if factor is not None and math.isfinite(mean):
            lines.setdefault((method, name), []).append((factor, mean))
        elif method == "prodigy" and math.isfinite(mean):
            methods_ax.axhline(mean, color="gray", linestyle=":", label="Prodigy (LR 1.0)")
    default_key = ("hdet", record["default_variant"])
    # left: one line per method; right: every HDET variant with the full grid (the others are in the tables)
    methods = [key for key in lines if key[0] != "hdet" or key == default_key]
    variants = [("hdet", name) for name in full_grid_variants(record)]
    styles = line_styles(list(lines), default_key, plt.get_cmap("tab20").colors)  # the same in both panels
    for ax, keys in ((methods_ax, methods), (variants_ax, variants)):
        ax.errorbar([lr / best_lr for lr in sweep], [v[0] for v in sweep.values()],
                    yerr=[v[1] for v in sweep.values()], color="black", marker="o",
                    label="plain DP sweep (x = its LR / best)")
        for key in sorted(keys):
            colour, dash = styles[key]
            ax.plot(*zip(*sorted(lines[key]), strict=True), dash, marker=".", color=colour,
                    linewidth=2.5 if key == default_key else 1.2,
                    label=f"HDET `{key[1]}`" if key[0] == "hdet" else key[0])
        ax.set_xscale("log")
        ax.set_xlabel("start LR / sweep-best LR")
    methods_ax.set_ylabel("final held-out loss (mean over seeds)")
    methods_ax.set_ylim(top=min(methods_ax.get_ylim()[1], sweep[best_lr][0] + 1.0))
    methods_ax.set_title("the default against the other methods")
    methods_ax.legend(fontsize=7)
    worst = max((mean for key in variants for _, mean in lines[key]), default=sweep[best_lr][0])
    variants_ax.set_ylim(sweep[best_lr][0] - 0.05, min(worst, sweep[best_lr][0] + 0.5) + 0.02)
    variants_ax.set_title(f"HDET variants with {FULL_GRID_SEEDS}+ seeds at every start")
    variants_ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                       ncols=max(1, math.ceil((len(variants) + 1) / LEGEND_ROWS)))
    return fig


def figures(stem: Path, record: dict[str, Any], sweep: dict[float, tuple[float, float, int]]) -> list[str]:
    """Held-out loss against the start factor (the default variant against the other methods, and every variant
    with the full grid), and the default variant's LR over the run per start."""
    try:
        import matplotlib
    except ImportError:
        return ["(figures need matplotlib: pip install -e '.[bench]')"]
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best_lr = record["best_lr"]
    fig = heldout_figure(record, sweep)
    heldout = stem.parent / f"{stem.name}_heldout.png"
    fig.savefig(heldout, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    factors = sorted({round(run["start_factor"], 4) for run in record["runs"]
                      if run["method"] == "hdet" and run["variant"] == record["default_variant"]})
    for color, factor in zip(colors, factors, strict=False):
        for run in record["runs"]:
            if run["method"] == "hdet" and run["variant"] == record["default_variant"] and \
                    round(run["start_factor"], 4) == factor and run["scales"]:
                steps, scales = zip(*run["scales"], strict=True)
                ax.plot(steps, [run["lr"] * scale / best_lr for scale in scales], color=color, alpha=0.7,
                        label=f"start x{factor:.3g}" if run["seed"] == min(r["seed"] for r in record["runs"]) else None)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("base LR before the schedule's decay / sweep-best LR")
    ax.set_title(f"`{record['default_variant']}`: where the controller takes the LR (one line per seed)")
    ax.legend(fontsize=7)
    scales_png = stem.parent / f"{stem.name}_scales.png"
    fig.tight_layout()
    fig.savefig(scales_png, dpi=110)
    plt.close(fig)
    return ["## Figures", "", f"![held-out vs start factor]({Path(repo_relative(heldout)).name})", "",
            f"![the controller's LR over the run]({Path(repo_relative(scales_png)).name})"]
