"""The overhead benchmark's Markdown results, written from its JSON record (see ``overhead.py``).

The tables, and the legends that say what they show, are generated here. What the numbers mean is written by
hand into note blocks of the results' Markdown, which a rewrite keeps (``common.save_markdown``): ``noise``
(how far this machine's timings can be trusted), ``layout`` (what the same-layout baseline shows, where a run
measures it) and, per engine part, ``bytes`` (what crosses replicas in local mode), ``signals`` (what each
controller signal costs) and ``memory`` (why HDET's memory differs from the baseline's), named after the part
where a run measures several (``ZeRO-2 memory``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import REFRESH, MiB, note, save_markdown, table_header, table_row
from overhead_memory import MEMORY_STEPS, MEMORY_SYNC_INTERVAL

TARGETS = {100: 0.01, 1000: 0.002}  # the project's step-time overhead targets per T (reported, not asserted)
MS, US = 1e3, 1e6
AMORTIZED_INTERVALS = (100, 1000)  # the sync intervals at which a sync's cost per step is reported


def result_parts(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, measurements) of each engine part: DeepSpeed's ZeRO stages, else the one unlabelled part."""
    return list(data["stages"].items()) if "stages" in data else [("", data)]


def write_markdown(path: Path, data: dict[str, Any]) -> None:
    """The results page of the record ``data``, keeping the hand-written notes of the page at ``path``."""
    m, cfg, engine = data["machine"], data["settings"], data["engine"]
    parts = result_parts(data)
    per_rank = "" if cfg["ranks_per_replica"] == 1 else ", local shards per rank"
    lines = [
        f"# HDET overhead on {engine['title']}",
        "",
        f"Command: `{cfg['command']}`",
        "",
        f"Machine: {m['nproc']} CPUs ({m['cpu']}), GPU: {m['gpu'] or 'none'}; torch {m['torch']}, "
        + (f"deepspeed {m['deepspeed']}, " if "deepspeed" in m else "")
        + f"backend {m['backend']}, {m['ranks']} ranks ({m['ranks'] // cfg['ranks_per_replica']} replicas x "
        f"{cfg['ranks_per_replica']} rank(s)), {m['torch_threads_per_rank']} torch thread(s) per rank; "
        f"{m['date_utc']}; load average {data['load_average']['start']} at start, "
        f"{data['load_average']['end']} at end; run took {data['runtime_s']:.0f} s.",
        "",
        f"Model: residual MLP, {data['model_params']:,} parameters ({parts[0][1]['bytes']['param_bytes'] / MiB:.2f} "
        f"MiB fp32{per_rank}), batch {cfg['batch']} per rank, AdamW. Baseline (\"plain\"): {engine['baseline']}. "
        "HDET: global gradient mode, alpha 1/9, auto-LR updating at every sync, no metrics file.",
        "",
        *note("noise"),
        "",
        *([f"Context of this run: {cfg['note']}", ""] if cfg["note"] else []),
    ]
    heading = "##"
    if "stages" in data:
        lines += stage_summary_markdown(cfg, parts)
        heading = "###"
    for label, part in parts:
        if label:
            lines += [f"## {label}", ""]
        lines += part_markdown(cfg, engine, label, part, heading)
    save_markdown(path, lines)


def stage_summary_markdown(cfg: dict[str, Any], parts: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """One table of the step-time ratios of every stage."""
    lines = [
        f"## Step-time ratio HDET / plain per stage ({cfg['steps']} timed steps per variant, blocks of "
        f"{cfg['block']}, all stages' variants round-robin in one run; details per stage below)",
        "",
        *table_header("stage", "T", "hot-path ratio, median over rounds (IQR)", "total-time ratio",
                      "estimate from components", *same_layout_columns(parts[0][1])),
    ]
    for label, part in parts:
        for interval in cfg["sync_intervals"]:
            name = f"hdet_T{interval}"
            entry = part["step_time"][name]
            lines.append(table_row(label, interval, _ratio(entry["block_median_ratio"]),
                                   f"{entry['total_time_ratio']:.3f}", f"{1 + part['estimated_overhead'][name]:.4f}",
                                   *same_layout_cells(part, name)))
    if same_layout_columns(parts[0][1]):
        lines += ["", SAME_LAYOUT_LEGEND, "", *note("layout")]
    return [*lines, ""]


SAME_LAYOUT_LEGEND = (
    "Same layout: plain DeepSpeed sharding inside each replica with the gradients averaged across replicas by one "
    "flat all-reduce before each step, HDET's layout without HDET. HDET over it is HDET's own work; it over plain "
    "(the `same_layout` row) is what the layout costs or saves.")


def same_layout_columns(part: dict[str, Any]) -> tuple[str, ...]:
    """The columns of the ratios against the same-layout baseline, where the run measured it."""
    if "same_layout" not in part["step_time"]:
        return ()
    return ("hot-path ratio vs same layout (IQR)", "total-time ratio vs same layout")


def same_layout_cells(part: dict[str, Any], name: str) -> tuple[str, ...]:
    """Variant ``name``'s ratios against the same-layout baseline, where the run measured it."""
    if not same_layout_columns(part):
        return ()
    ratios = part["step_time"][name]["vs_same_layout"]
    return _ratio(ratios["block_median_ratio"]), f"{ratios['total_time_ratio']:.3f}"


def part_markdown(cfg: dict[str, Any], engine: dict[str, Any], label: str, part: dict[str, Any],
                  heading: str) -> list[str]:
    """Sections 1-4 of the engine part ``label``, each section's notes after it."""
    per_rank = "" if cfg["ranks_per_replica"] == 1 else ", local shards per rank"
    gradient_average = engine["gradient_average_in_hot_path"]
    named = f"{label} " if label else ""
    return [
        *step_markdown(cfg, part, heading, gradient_average), "",
        *signals_markdown(cfg, part, heading, gradient_average), "", *note(f"{named}signals"), "",
        *sync_markdown(cfg, part["sync_time"], part["step_time"]["plain"]["step_s"]["median"], heading, per_rank,
                       gradient_average), "",
        *bytes_markdown(cfg, part["bytes"], heading, per_rank), "", *note(f"{named}bytes"), "",
        *memory_markdown(part["memory"], heading, per_rank), "", *note(f"{named}memory"), "",
    ]


def _ms(stats: dict[str, float]) -> str:
    """Median (IQR) of seconds, in ms."""
    return f"{stats['median'] * MS:.2f} ({stats['q1'] * MS:.2f}-{stats['q3'] * MS:.2f})"


def _ratio(stats: dict[str, float]) -> str:
    """Median (IQR) of a ratio."""
    return f"{stats['median']:.3f} ({stats['q1']:.3f}-{stats['q3']:.3f})"


def step_markdown(cfg: dict[str, Any], part: dict[str, Any], heading: str, gradient_average: bool) -> list[str]:
    """Section 1: step time of every variant, the ratios to the plain one and the hot path's components."""
    steps, sync, hooks = part["step_time"], part["sync_time"], part["hook_overhead"]
    hdet_step = "`ensemble.step()` inside `engine.step()`" if gradient_average else "`hdet.step(loss)`"
    lines = [
        f"{heading} 1. Step time ({cfg['steps']} timed steps per variant, blocks of {cfg['block']}, round-robin)",
        "",
        *table_header("variant", "syncs timed", "median step ms (IQR)",
                      "hot-path ratio vs plain, median over rounds (IQR)", "total-time ratio",
                      "estimate from components", "target", *same_layout_columns(part)),
    ]
    lines.append(table_row("plain", steps["plain"]["syncs_timed"], _ms(steps["plain"]["step_s"]), 1, 1, 1, "",
                           *["" for _ in same_layout_columns(part)]))
    if same_layout_columns(part):
        entry = steps["same_layout"]
        lines.append(table_row("same_layout", entry["syncs_timed"], _ms(entry["step_s"]),
                               _ratio(entry["block_median_ratio"]), f"{entry['total_time_ratio']:.3f}", "", "", 1, 1))
    for interval in cfg["sync_intervals"]:
        name = f"hdet_T{interval}"
        entry = steps[name]
        target = f"<= {1 + TARGETS[interval]:.3f}" if interval in TARGETS else ""
        lines.append(table_row(name, entry["syncs_timed"], _ms(entry["step_s"]), _ratio(entry["block_median_ratio"]),
                               f"{entry['total_time_ratio']:.3f}", f"{1 + part['estimated_overhead'][name]:.4f}",
                               target, *same_layout_cells(part, name)))
    gradient_row = []
    if gradient_average:
        gradient_row = [table_row("gradient all-reduce across replicas (`average_tensors` bucket_mb=25, section 2)",
                                  f"{sync['ops']['average_tensors bucket_mb=25']['seconds']['median'] * US:.1f}")]
    return [
        *lines,
        "",
        "Hot-path ratio: per round, the HDET block's median step over the plain block's median step (a median "
        "hardly sees the sync steps). Total-time ratio: all timed steps, syncs included; "
        + ("one sync per 1000 steps is within its noise. " if steps["hdet_T1000"]["syncs_timed"] else
           "T=1000 does not sync within the timed steps, so its sync cost enters only the estimate. ")
        + f"Estimate from components: 1 + (median time of {hdet_step} on non-sync steps + LR-hook cost + "
        + ("gradient all-reduce across replicas + " if gradient_average else "")
        + "median `hdet.sync()` at bucket_mb 25 from section 2 / T) / plain median step."
        + (" It leaves out that ZeRO shards over the 2 ranks of a replica instead of all ranks (a larger "
           "optimizer shard per rank, collectives over fewer ranks), which the direct ratios include."
           if gradient_average else "")
        + (" The same-layout baseline: see the summary above." if same_layout_columns(part) else ""),
        "",
        *table_header("hot-path component", "median µs"),
        *[table_row(f"{hdet_step}, non-sync step, {name}", f"{steps[name]['hdet_step_call_s']['median'] * US:.1f}")
          for name in (f"hdet_T{interval}" for interval in cfg["sync_intervals"])],
        table_row(f"LR hooks around `optimizer.step()` (hooked {hooks['hooked_step_s'] * US:.1f} - plain "
                  f"{hooks['plain_step_s'] * US:.1f}, no gradients)", f"{hooks['hook_s'] * US:.1f}"),
        *gradient_row,
        "",
        "Sync steps in training (step time of the steps that synced, median): " + ", ".join(
            f"{name} {steps[name]['sync_step_s']['median'] * MS:.1f} ms over {steps[name]['sync_step_s']['n']}"
            for name in (f"hdet_T{interval}" for interval in cfg["sync_intervals"]) if "sync_step_s" in steps[name])
        +
        f"; plain median step {steps['plain']['step_s']['median'] * MS:.1f} ms. These include the rank skew "
        "that a plain step absorbs in the next gradient all-reduce.",
    ]


def signals_markdown(cfg: dict[str, Any], part: dict[str, Any], heading: str, gradient_average: bool) -> list[str]:
    """Section 1, continued: the step-time cost of each controller signal against HDET without one."""
    interval = cfg["sync_intervals"][0]
    steps, costs = part["step_time"], part["signal_costs"]
    base, plain_step_s = costs[f"hdet_T{interval}"], steps["plain"]["step_s"]["median"]
    spread_over = AMORTIZED_INTERVALS[0]
    lines = [
        f"{heading} 1b. Controller signals (T = {interval}, in the same round-robin)",
        "",
        *table_header("variant", "hot-path ratio vs plain (IQR)", "total-time ratio", "hot path µs",
                      "own sync ms (median)", f"own sync per step at T = {spread_over}, share of a plain step",
                      "estimate from components", "estimate minus no signal's"),
    ]
    for name, cost in costs.items():
        entry = steps[name]
        lines.append(table_row(name, _ratio(entry["block_median_ratio"]), f"{entry['total_time_ratio']:.3f}",
                               f"{cost['hot_path_s'] * US:.1f}", f"{cost['sync_s'] * MS:.2f}",
                               f"{amortized_share(cost['sync_s'], spread_over, plain_step_s):.2%}",
                               f"{1 + cost['estimate']:.4f}", f"{cost['estimate'] - base['estimate']:+.4f}"))
    legends = [legend for signal, legend in SIGNAL_LEGENDS.items() if f"hdet_T{interval}_{signal}" in costs]
    return [
        *lines,
        "",
        "Each signal variant scores the replicas on a probe batch at every sync (one forward); "
        + ", ".join(legends) + ". Own sync: the median `SyncReport.sync_seconds` of the variant's syncs in "
        "training (rank 0). Estimate: as above, with the variant's own sync time"
        + (" and the gradient all-reduce across replicas" if gradient_average else "") + ".",
    ]


SIGNAL_LEGENDS = {
    "averaged": "`averaged` also adds each step's weights in the second half of the interval to a running mean and "
                "swaps that mean in for the probe",
    "displacement": "`displacement` (a signal since removed from the library) keeps two more copies and compares "
                    "the sync-to-sync moves",
    "progress": "`progress` (the progress hypergradient, since removed from the library) scores the model the sync "
                "averaged once more (the next interval's start)",
    "default": "`default` is the library's default controller (`log`, on weights averaged over the last quarter of "
               "the interval)",
}
"""What each signal variant adds, for the legend of the variants a results file holds (those measured before the
``displacement`` and ``progress`` signals left the library still do)."""


def amortized_share(sync_s: float, interval: int, plain_step_s: float) -> float:
    """A sync of ``sync_s`` seconds spread over the ``interval`` steps between syncs, as a share of a plain step."""
    return sync_s / interval / plain_step_s


def sync_markdown(cfg: dict[str, Any], sync: dict[str, Any], plain_step_s: float, heading: str, per_rank: str,
                  gradient_average: bool) -> list[str]:
    """Section 2: each sync operation against one flat all-reduce of the same bytes, and what it costs a step once
    spread over the steps between syncs."""
    return [
        f"{heading} 2. Sync time ({sync['payload_bytes'] / MiB:.2f} MiB of parameters{per_rank}, "
        f"{cfg['sync_reps']} repetitions, slowest rank; the flat all_reduce runs over the cross-replica group)",
        "",
        *table_header("operation", "buckets", "median ms (IQR)", "ratio vs flat all_reduce, paired median (IQR)",
                      *(f"per step at T = {interval}, share of a plain step" for interval in AMORTIZED_INTERVALS)),
        *[table_row(name, "-" if entry["buckets"] is None else entry["buckets"], _ms(entry["seconds"]),
                    _ratio(entry["ratio_vs_flat"]),
                    *(f"{amortized_share(entry['seconds']['median'], interval, plain_step_s):.2%}"
                      for interval in AMORTIZED_INTERVALS))
          for name, entry in sync["ops"].items()],
        "",
        f"Per step: the median time over T, over the plain median step ({plain_step_s * MS:.1f} ms, section 1): "
        "what a sync adds to each step on average, the number to hold against a step's budget.",
        "",
        "`hdet.sync` minus `average_tensors` is the score gather (riding in the average's first bucket when "
        "every rank is a replica, a small all-rank collective alongside otherwise), the finiteness check of every "
        "parameter and the controller"
        + (", and ZeRO refreshing its parameters from the averaged master" if gradient_average else "")
        + "; `average_tensors` minus the flat all-reduce is packing the buckets, the division and unpacking."
        + (f" `{REFRESH}` is ZeRO rewriting its parameter copies from the averaged master, timed alone (ZeRO-1/2: "
           "the low-precision parameters and their all-gather inside the replica, the one ZeRO runs after every "
           "step; ZeRO-3: the re-partition)." if REFRESH in sync["ops"] else ""),
    ]


def bytes_markdown(cfg: dict[str, Any], nbytes: dict[str, Any], heading: str, per_rank: str) -> list[str]:
    """Section 3: the bytes averaged per sync and crossing replicas per step, in both gradient modes."""
    intervals = cfg["sync_intervals"]
    return [
        f"{heading} 3. Bytes (payload per rank; a ring all-reduce moves about 2(n-1)/n times this per rank)",
        "",
        f"Parameter bytes{per_rank} {nbytes['param_bytes']:,}; cross-replica gradient all-reduce per step in "
        f"global mode: {nbytes['grad_bytes_per_step_measured']:,} measured (estimate = parameter bytes "
        f"{nbytes['grad_bytes_per_step_estimate']:,}). Loss gather per sync: {nbytes['bytes_gathered_per_sync']} "
        "bytes.",
        "",
        *table_header("gradient mode", "bytes averaged per sync",
                      *[f"{'cross-replica bytes per step, ' if i == 0 else ''}T={t}" for i, t in enumerate(intervals)]),
        *[table_row(mode, f"{nbytes['bytes_averaged_per_sync'][mode]:,}",
                    *[f"{nbytes['cross_replica_bytes_per_step'][f'T{t}'][mode]:,.0f}" for t in intervals])
          for mode in ("global", "local")],
    ]


def memory_markdown(memory: dict[str, dict[str, int]], heading: str, per_rank: str) -> list[str]:
    """Section 4: each variant's peak and retained memory against the plain engine's."""
    plain = memory["plain"]
    lines = [
        f"{heading} 4. Peak memory (build the model and engine, then {MEMORY_STEPS} steps at T = "
        f"{MEMORY_SYNC_INTERVAL}, in a launch of its own; memory in use in that window above its start"
        f"{per_rank}, maximum over ranks)",
        "",
        *table_header("variant", "peak MiB", "peak vs plain", "retained at the end MiB", "retained vs plain"),
    ]
    for name, entry in memory.items():
        peak = "" if name == "plain" else (f"{(entry['peak_bytes'] - plain['peak_bytes']) / MiB:+.2f} MiB "
                                           f"({entry['peak_bytes'] / plain['peak_bytes']:.3f}x)")
        kept = "" if name == "plain" else f"{(entry['retained_bytes'] - plain['retained_bytes']) / MiB:+.2f} MiB"
        lines.append(table_row(name, f"{entry['peak_bytes'] / MiB:.2f}", peak, f"{entry['retained_bytes'] / MiB:.2f}",
                               kept))
    return [*lines, "", "Peak: the most memory in use at once in the window (parameters, gradients, optimizer "
            "states, activations, the engine's buffers, HDET's state and a sync's buckets); retained: what is "
            "still in use after the last step, with the trainer alive. Each variant ran once unmetered first, so "
            "one-time set-up (thread pools, a new process group's first collectives) is left out. CPU: the "
            "kernel's peak resident set size, reset at the window's start, with glibc mapping every block of "
            "64 KiB or more by itself (page granular; small allocations add some noise); CUDA: "
            "`torch.cuda.max_memory_allocated`."]
