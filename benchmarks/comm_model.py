"""Communication model: HDET's cross-replica traffic and time at scale, in both gradient modes.

The setting is the one ``hdet_scale`` is built for on large models: nodes of 8 GPUs, one replica per node
(``ranks_per_replica = 8``), ZeRO or FSDP2 sharding inside a node, N nodes = N replicas. Every T steps a sync
averages each rank's fp32 master shard (4 bytes x params / 8) over the N ranks that hold the same shard on the
other nodes: one ring all-reduce per bucket (``bucket_mb``) over the cross-replica group at the wire's speed,
plus the sync's local work on the GPU (packing, the finiteness check, the division while unpacking) as
``benchmarks/gpu_check.py`` measured it on a GPU (``benchmarks/results/gpu_check.json``), plus the small loss
gather. Without a GPU measurement the bandwidth term is slowed by the bucketing efficiency measured on the CPU
by ``benchmarks/overhead.py`` (HDET's bucketed average over one flat all-reduce of the same bytes, from
``overhead_*_cpu.json``) and the finiteness check is read at HBM speed. Global gradient mode also all-reduces
every step's reduced gradient shard across the replicas (what native HSDP does); local mode does not. Compute
per step is 6 x params x tokens per step / (GPUs x achieved FLOP/s). Every assumption is a field of
``Assumptions`` and is listed at the top of the Markdown output.

    .venv/bin/python benchmarks/comm_model.py    # writes benchmarks/results/comm_model.md and .json

No measurement runs here: it reads the measured ratios and evaluates formulas (instantaneous, any machine).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from common import RESULTS, read_json, save_markdown, write_json

BUCKETED_OP = "average_tensors bucket_mb=25"  # HDET's bucketed average in the overhead benchmark's sync table
FLAT_OP = "flat all_reduce"

MODEL_PARAMS = {"1B": 1e9, "7B": 7e9, "13B": 13e9, "70B": 70e9}
NODE_COUNTS = (4, 8, 16, 32, 64)
LINK_GBPS = (200, 400)
SYNC_INTERVALS = (10, 100, 1000)
GRADIENT_MODES = ("global", "local")
H100_MEMORY_GB = 80


@dataclass(frozen=True)
class Assumptions:
    """The model's inputs besides model size, node count, bandwidth and T (all stated in the output)."""

    gpus_per_node: int = 8
    """GPUs per node = ranks per replica (one replica per node, sharded inside it)."""
    tokens_per_step: int = 4 * 2**20
    """Global batch in tokens per optimizer step, the same at every node count (Llama-2's 4M tokens)."""
    achieved_flops_per_gpu: float = 400e12
    """Achieved bf16 FLOP/s per H100 (about 40% of the SXM part's 989 TFLOP/s dense peak)."""
    link_bytes_per_s_per_gbps: float = 1e9 / 8
    """Bytes per second of one Gb/s. The bandwidth is per GPU: each GPU has its own NIC (rail-optimized,
    as in DGX H100 systems), so the 8 cross-replica rings of a node run side by side, one per NIC, at the
    NIC's line rate."""
    op_latency_s: float = 8.4e-6
    """Fixed latency of one all-reduce (NCCL's tuning model, ring / Simple protocol)."""
    hop_latency_s: float = 9.6e-6
    """Latency of one ring step between nodes (NCCL's tuning model, ring / Simple over the network); a ring
    all-reduce over N members takes 2 (N-1) steps."""
    bucket_bytes: int = 25 * 2**20
    """HDET's default ``bucket_mb = 25``: the sync is one all-reduce per bucket, one after the other."""
    master_bytes_per_param: int = 4
    """A sync averages the fp32 master shard (FSDP2's sharded fp32 parameters, ZeRO's fp32 partition)."""
    grad_bytes_per_param: int = 2
    """Global mode all-reduces bf16 gradients (FSDP2 ``reduce_dtype`` = bf16, DeepSpeed bf16 communication)."""
    hbm_bytes_per_s: float = 2.0e12
    """Achieved HBM read rate of the finiteness check over the master shard (H100 SXM: 3.35 TB/s peak)."""
    optimizer_state_bytes_per_param: int = 16
    """Model states per parameter for the memory check: fp32 master 4, fp32 gradient 4, Adam moments 8."""


# ------------------------------------------------------------------------------------------- formulas
def ring_latency_seconds(members: int, a: Assumptions) -> float:
    """The latency of one ring all-reduce over ``members`` ranks, one per node: a fixed part and 2 (members-1)
    steps between nodes."""
    return a.op_latency_s + 2 * (members - 1) * a.hop_latency_s if members > 1 else 0.0


def ring_bandwidth_seconds(payload_bytes: float, members: int, bytes_per_s: float) -> float:
    """The bandwidth term of a ring all-reduce: every byte crosses each link 2 (members-1)/members times."""
    return 2 * (members - 1) / members * payload_bytes / bytes_per_s if members > 1 else 0.0


def bucketed_allreduce_seconds(payload_bytes: float, members: int, link_gbps: float, a: Assumptions, *,
                               bandwidth_factor: float = 1.0) -> dict[str, float]:
    """``payload_bytes`` per rank all-reduced in buckets of ``a.bucket_bytes``, one after the other: each
    bucket pays the ring's latency; ``bandwidth_factor`` scales the bandwidth term (the bucketing ratio)."""
    if members <= 1 or payload_bytes <= 0:
        return {"buckets": 0, "latency_s": 0.0, "bandwidth_s": 0.0, "total_s": 0.0}
    buckets = math.ceil(payload_bytes / a.bucket_bytes)
    latency = buckets * ring_latency_seconds(members, a)
    link = link_gbps * a.link_bytes_per_s_per_gbps
    bandwidth = bandwidth_factor * ring_bandwidth_seconds(payload_bytes, members, link)
    return {"buckets": buckets, "latency_s": latency, "bandwidth_s": bandwidth, "total_s": latency + bandwidth}


def master_shard_bytes(params: float, a: Assumptions) -> float:
    """Bytes of fp32 master parameters one rank averages at a sync (its shard of the replica's model)."""
    return a.master_bytes_per_param * params / a.gpus_per_node


def gradient_shard_bytes(params: float, a: Assumptions) -> float:
    """Bytes of reduced gradient one rank all-reduces across replicas per step in global mode."""
    return a.grad_bytes_per_param * params / a.gpus_per_node


def compute_seconds(params: float, nodes: int, a: Assumptions) -> float:
    """One optimizer step's compute: 6 x params x tokens per step over all GPUs' achieved FLOP/s."""
    return 6 * params * a.tokens_per_step / (nodes * a.gpus_per_node * a.achieved_flops_per_gpu)


def sync_seconds(params: float, nodes: int, link_gbps: float, bucketing_ratio: float, a: Assumptions, *,
                 local_seconds_per_byte: float | None = None) -> dict[str, float]:
    """One sync, by component: the bucketed ring all-reduce of the master shard, its bandwidth term times
    ``bucketing_ratio``; the local work (``local_seconds_per_byte`` times the shard's bytes where a GPU measured
    it, else the finiteness check at HBM speed, packing and dividing being in the ratio); the loss gather (a few
    floats per rank over all ranks, a tree all-reduce: its fixed latency and 2 log2(ranks) steps). The sync
    blocks: no overlap with compute."""
    shard = master_shard_bytes(params, a)
    average = bucketed_allreduce_seconds(shard, nodes, link_gbps, a, bandwidth_factor=bucketing_ratio)
    local = shard * local_seconds_per_byte if local_seconds_per_byte is not None else shard / a.hbm_bytes_per_s
    gather = a.op_latency_s + 2 * math.ceil(math.log2(nodes * a.gpus_per_node)) * a.hop_latency_s
    return {"buckets": average["buckets"], "latency_s": average["latency_s"] + gather,
            "bandwidth_s": average["bandwidth_s"], "local_work_s": local, "loss_gather_s": gather,
            "total_s": average["total_s"] + local + gather}


def gradient_allreduce_seconds(params: float, nodes: int, link_gbps: float, a: Assumptions) -> float:
    """Global mode's per-step all-reduce of the reduced gradient shard across replicas, bucketed like the
    sync at the engine's own efficiency (taken as 1); counted as if not overlapped with the backward."""
    return bucketed_allreduce_seconds(gradient_shard_bytes(params, a), nodes, link_gbps, a)["total_s"]


def payload_bytes_per_step(params: float, sync_interval: int, mode: str, a: Assumptions) -> float:
    """Cross-replica payload per GPU per step, the sync amortized over T (a ring moves 2 (N-1)/N times it)."""
    sync = master_shard_bytes(params, a) / sync_interval
    return sync + (gradient_shard_bytes(params, a) if mode == "global" else 0.0)


def closed_form_sync_fraction(nodes: int, link_gbps: float, sync_interval: int, bucketing_ratio: float,
                              a: Assumptions) -> float:
    """The sync's bandwidth term over the compute per step, latencies left out:
    ratio x 2 (N-1)/N x 4 P/g / B / T  over  6 P tokens / (g N F)  =  ratio x 4 (N-1) F / (3 tokens B T)
    for fp32 masters: independent of the model size and of the GPUs per node."""
    bandwidth = link_gbps * a.link_bytes_per_s_per_gbps
    return (bucketing_ratio * 2 * (nodes - 1) * a.master_bytes_per_param * a.achieved_flops_per_gpu
            / (6 * a.tokens_per_step * bandwidth * sync_interval))


def evaluate(model: str, nodes: int, link_gbps: float, sync_interval: int, mode: str, bucketing_ratio: float,
             a: Assumptions, *, local_seconds_per_byte: float | None = None) -> dict[str, Any]:
    """One configuration: bytes, times and the overhead fractions (of the compute per step)."""
    params = MODEL_PARAMS[model]
    compute = compute_seconds(params, nodes, a)
    sync = sync_seconds(params, nodes, link_gbps, bucketing_ratio, a, local_seconds_per_byte=local_seconds_per_byte)
    gradient = gradient_allreduce_seconds(params, nodes, link_gbps, a) if mode == "global" else 0.0
    payload = payload_bytes_per_step(params, sync_interval, mode, a)
    per_step = gradient + sync["total_s"] / sync_interval
    return {
        "model": model, "params": params, "nodes": nodes, "gpus": nodes * a.gpus_per_node,
        "link_gbps": link_gbps, "sync_interval": sync_interval, "gradient_mode": mode,
        "compute_s": compute, "sync": sync, "gradient_allreduce_s": gradient,
        "sync_payload_bytes": master_shard_bytes(params, a),
        "payload_bytes_per_step": payload, "wire_bytes_per_step": payload * 2 * (nodes - 1) / nodes,
        "cross_replica_s_per_step": per_step,
        "hdet_sync_overhead": sync["total_s"] / sync_interval / compute,
        "cross_replica_fraction": per_step / compute,
        "model_states_gb_per_gpu": a.optimizer_state_bytes_per_param * params / a.gpus_per_node / 1e9,
    }


# ------------------------------------------------------------------------------------------- measured input
def measured_bucketing_ratios(results: Path = RESULTS) -> list[dict[str, Any]]:
    """HDET's bucketed average over one flat all-reduce of the same bytes (paired median), per engine and
    ZeRO stage, from the overhead benchmark's CPU results."""
    found = []
    for path in sorted(results.glob("overhead_*_cpu.json")):
        data = read_json(path)
        parts = data["stages"].items() if "stages" in data else [(data["engine"]["title"], data)]
        for name, part in parts:
            ops = part.get("sync_time", {}).get("ops", {})
            if BUCKETED_OP not in ops or FLAT_OP not in ops:
                continue
            machine = data.get("machine", {})
            found.append({
                "source": path.name, "engine": name, "payload_bytes": part["sync_time"]["payload_bytes"],
                "flat_ms": 1e3 * ops[FLAT_OP]["seconds"]["median"],
                "bucketed_ms": 1e3 * ops[BUCKETED_OP]["seconds"]["median"],
                "ratio": ops[BUCKETED_OP]["ratio_vs_flat"]["median"],
                "machine": f"{machine.get('cpu', '?')}, {machine.get('backend', '?')}, "
                           f"{machine.get('ranks', '?')} ranks, torch {machine.get('torch', '?')}",
            })
    if not found:
        raise FileNotFoundError(f"no overhead_*_cpu.json with a '{BUCKETED_OP}' sync time in {results}; run "
                                "benchmarks/overhead.py first")
    return found


def measured_gpu_local_work(results: Path = RESULTS) -> dict[str, Any] | None:
    """The sync's local work per byte that ``gpu_check.py`` measured on a GPU, on its largest preset (None
    without a GPU measurement)."""
    data = read_json(results / "gpu_check.json")
    measured = {preset: work for preset, work in (data or {}).get("local_work", {}).items() if "bytes" in work}
    if not measured:
        return None
    preset, work = max(measured.items(), key=lambda item: item[1]["bytes"])
    return {"source": "gpu_check.json", "gpu": data["machine"].get("gpu", "?"), "preset": preset,
            "bytes": work["bytes"], "local_work_ms": work["local_work_ms"], "copy_ms": work["copy_ms"],
            "over_copy": work["local_work_over_copy"], "seconds_per_byte": work["local_work_ms"] / 1e3 / work["bytes"]}


# ------------------------------------------------------------------------------------------- output
BUCKET_MBS = (25, 100, 256, 1024)
BUCKET_CASES = (("7B", 8), ("7B", 64), ("70B", 8), ("70B", 64))


def build(a: Assumptions, ratios: list[dict[str, Any]], gpu: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every configuration, and the effect of ``bucket_mb`` on a few of them at the higher bandwidth: with the
    local work ``gpu`` measured (the wire at its speed), else with the largest CPU ratio (the most pessimistic)."""
    used = max(ratios, key=lambda entry: entry["ratio"])
    ratio, local = (1.0, gpu["seconds_per_byte"]) if gpu else (used["ratio"], None)
    rows = [evaluate(model, nodes, gbps, interval, mode, ratio, a, local_seconds_per_byte=local)
            for model in MODEL_PARAMS for nodes in NODE_COUNTS for gbps in LINK_GBPS
            for interval in SYNC_INTERVALS for mode in GRADIENT_MODES]
    buckets = [{"bucket_mb": mb, **evaluate(model, nodes, max(LINK_GBPS), 100, "local", ratio,
                                             replace(a, bucket_bytes=mb * 2**20), local_seconds_per_byte=local)}
               for model, nodes in BUCKET_CASES for mb in BUCKET_MBS]
    return {"benchmark": "comm_model", "command": "python benchmarks/comm_model.py", "assumptions": asdict(a),
            "measured_bucketing_ratios": ratios, "gpu_local_work": gpu,
            "bucketing_ratio_used": {"ratio": ratio, "source": used["source"] if not gpu else "gpu_check.json",
                                     "engine": used["engine"] if not gpu else "the wire's speed"},
            "rows": rows, "bucket_mb_rows": buckets, "takeaway": takeaway(rows, gpu)}


def _row(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    return next(row for row in rows if all(row[key] == value for key, value in match.items()))


def _worst(rows: list[dict[str, Any]], key: str, **match: Any) -> float:
    return max(row[key] for row in rows if all(row[name] == value for name, value in match.items()))


def takeaway(rows: list[dict[str, Any]], gpu: dict[str, Any] | None = None) -> str:
    """The sentence for the README, from the worst cases in the table."""
    sync = {(gbps, interval): 100 * _worst(rows, "hdet_sync_overhead", link_gbps=gbps, sync_interval=interval)
            for gbps in LINK_GBPS for interval in (100, 1000)}
    grad = 100 * max(row["gradient_allreduce_s"] / row["compute_s"] for row in rows
                     if row["gradient_mode"] == "global" and row["link_gbps"] == 400)
    basis = f"the sync's local work measured on an {gpu['gpu']}" if gpu else "the bucketing efficiency measured on CPU"
    return (f"In a communication model of 1B-70B models on 4-64 nodes of 8 H100s (one replica per node, a "
            f"4M-token batch, {basis}), HDET's parameter sync adds at most "
            f"{sync[400, 100]:.1f}% to the step time at T = 100 and {sync[400, 1000]:.2f}% at T = 1000 with "
            f"400 Gb/s per GPU ({sync[200, 100]:.1f}% and {sync[200, 1000]:.2f}% at 200 Gb/s), growing with "
            f"the node count, not the model size; local gradient mode also drops the per-step gradient "
            f"all-reduce across nodes that global mode and plain HSDP pay (up to {grad:.0f}% of the step time "
            f"at 64 nodes when not overlapped).")


def _pct(value: float) -> str:
    return f"{100 * value:.3f}" if value < 0.01 else f"{100 * value:.2f}"


def _cost_lines(a: Assumptions, used: dict[str, Any], gpu: dict[str, Any] | None) -> list[str]:
    """How the sync's own work beside the wire is counted: measured on a GPU, or the CPU's ratio."""
    if gpu:
        return [
            f"- The wire at its speed, plus the sync's **local work measured on an {gpu['gpu']}** by "
            f"`benchmarks/gpu_check.py`: packing, the finiteness check and the division while unpacking took "
            f"{gpu['local_work_ms']:.2f} ms for the {gpu['bytes'] / 2**20:.0f} MiB of preset `{gpu['preset']}` "
            f"({gpu['over_copy']:.1f} times one device-to-device copy of the bytes), "
            f"{gpu['seconds_per_byte'] * 1e12:.2f} ms per GB of shard. It does not overlap the wire here (an "
            "upper bound: the next bucket is packed while one is in flight).",
            "- Plus the loss gather (a few floats per rank over all ranks: a tree all-reduce, the fixed latency + 2 "
            "log2(ranks) steps). The controller's arithmetic takes microseconds. Optimizer state is not averaged "
            "(`average_optimizer_state` off, the default; on, Adam's two moments triple the sync bytes).",
        ]
    return [
        f"- The bandwidth term is multiplied by the **measured bucketing ratio {used['ratio']:.3f}**: HDET's "
        "`average_tensors` over one flat all-reduce of the same bytes (paired median) from "
        f"`{used['source']}` ({used['engine']}), the largest of the ratios measured below. It was measured on "
        "**CPU with gloo**, where packing, dividing and unpacking are CPU memory copies on 2 shared cores; on "
        "GPUs they run at HBM speed (tens of times the NIC's) while the previous bucket is on the wire, so the "
        "GPU ratio should be close to 1 and the bandwidth terms here are pessimistic by up to that factor.",
        f"- Plus the finiteness check of the shard (read once at {a.hbm_bytes_per_s / 1e12:.1f} TB/s of HBM) and "
        "the loss gather (a few floats per rank over all ranks: a tree all-reduce, the fixed latency + 2 "
        "log2(ranks) steps). The controller's arithmetic takes microseconds. Optimizer state is not averaged "
        "(`average_optimizer_state` off, the default; on, Adam's two moments triple the sync bytes).",
    ]


def _assumption_lines(a: Assumptions, used: dict[str, Any], gpu: dict[str, Any] | None) -> list[str]:
    return [
        f"- Nodes of {a.gpus_per_node} H100 GPUs; one replica per node (`ranks_per_replica = {a.gpus_per_node}`), "
        f"ZeRO/FSDP2 sharding inside a node, so N nodes = N replicas. Models of {', '.join(MODEL_PARAMS)} "
        "parameters (nominal: 1e9 ... 70e9).",
        f"- Bandwidth is **per GPU NIC** ({' and '.join(map(str, LINK_GBPS))} Gb/s, at line rate): each GPU has "
        "its own NIC (rail-optimized, as in DGX H100), and the 8 cross-replica rings of a node (one per local "
        "rank) run side by side. If your bandwidth is per node (one NIC shared by 8 GPUs), every bandwidth "
        "term below is 8x larger.",
        f"- A sync averages each rank's fp32 master shard, {a.master_bytes_per_param} B x params / "
        f"{a.gpus_per_node}, with one ring all-reduce per {a.bucket_bytes / 2**20:.0f} MiB bucket (`bucket_mb` "
        "default), one after the other, over the N ranks that hold that shard. Per bucket: a latency of "
        f"{a.op_latency_s * 1e6:.1f} us + 2 (N-1) x {a.hop_latency_s * 1e6:.1f} us (the constants of NCCL's "
        "tuning model for ring / Simple over the network, `src/graph/tuning.cc`; they vary by NCCL version) plus "
        "2 (N-1)/N x bytes / bandwidth.",
        *_cost_lines(a, used, gpu),
        f"- Global gradient mode all-reduces the reduced **bf16** gradient shard ({a.grad_bytes_per_param} B x "
        f"params / {a.gpus_per_node}) across the replicas every step, as native HSDP does (fp32 gradients double "
        "it), bucketed alike with the engine's own efficiency taken as 1. It is counted as if not overlapped "
        "with the backward (an upper bound: engines overlap it); the sync cannot overlap (it runs between steps).",
        f"- Compute per step: 6 x params x {a.tokens_per_step:,} tokens (one global batch at every node count) / "
        f"(GPUs x {a.achieved_flops_per_gpu / 1e12:.0f} TFLOP/s achieved bf16 per H100, about 40% of the 989 "
        "TFLOP/s dense peak). Percentages are of this time; with a global batch of B tokens multiply them by "
        f"{a.tokens_per_step / 2**20:.0f}M / B.",
        "- Closed form of the sync's bandwidth term (latencies left out; ratio 1 at the wire's speed): ratio x 4 "
        "(N-1) x FLOP/s / (3 x tokens "
        "per step x bandwidth x T). It does not depend on the model size (the sync's bytes and the compute both "
        "grow with the parameters); the size enters through the per-bucket latencies and the finiteness check.",
    ]


def _bytes_table(rows: list[dict[str, Any]], a: Assumptions) -> list[str]:
    lines = ["| model | model states per GPU | sync payload | gradient payload per step (global) | per step, "
             "global: T=10 | T=100 | T=1000 | per step, local: T=10 | T=100 | T=1000 | local / global at T=100 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for model in MODEL_PARAMS:
        per = {(mode, interval): _row(rows, model=model, nodes=NODE_COUNTS[0], link_gbps=LINK_GBPS[0],
                                      sync_interval=interval, gradient_mode=mode)
               for mode in GRADIENT_MODES for interval in SYNC_INTERVALS}
        first = per["global", SYNC_INTERVALS[0]]
        states = first["model_states_gb_per_gpu"]
        cells = " | ".join(f"{per[mode, interval]['payload_bytes_per_step'] / 1e9:.3f} GB" for mode in GRADIENT_MODES
                           for interval in SYNC_INTERVALS)
        ratio = per["local", 100]["payload_bytes_per_step"] / per["global", 100]["payload_bytes_per_step"]
        lines.append(f"| {model} | {states:.0f} GB{' (over 80 GB)' if states > H100_MEMORY_GB else ''} | "
                     f"{first['sync_payload_bytes'] / 1e9:.3f} GB | "
                     f"{gradient_shard_bytes(first['params'], a) / 1e9:.3f} GB | {cells} | {ratio:.4f} |")
    return lines


def _time_table(rows: list[dict[str, Any]], gbps: int) -> list[str]:
    lines = ["| model | nodes (GPUs) | compute per step s | one sync ms | of which latency ms | HDET sync % of "
             "step: T=10 | T=100 | T=1000 | global mode: gradient all-reduce % | global mode: all cross-replica "
             "time at T=100 % |", "|---|---|---|---|---|---|---|---|---|---|"]
    for model in MODEL_PARAMS:
        for nodes in NODE_COUNTS:
            per = {interval: _row(rows, model=model, nodes=nodes, link_gbps=gbps, sync_interval=interval,
                                  gradient_mode="global") for interval in SYNC_INTERVALS}
            row = per[SYNC_INTERVALS[0]]
            cells = " | ".join(_pct(per[interval]["hdet_sync_overhead"]) for interval in SYNC_INTERVALS)
            lines.append(f"| {model} | {nodes} ({row['gpus']}) | {row['compute_s']:.3f} | "
                         f"{1e3 * row['sync']['total_s']:.1f} | {1e3 * row['sync']['latency_s']:.1f} | {cells} | "
                         f"{_pct(row['gradient_allreduce_s'] / row['compute_s'])} | "
                         f"{_pct(per[100]['cross_replica_fraction'])} |")
    return lines


def _bucket_table(bucket_rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| model | nodes | bucket_mb | buckets | one sync ms | of which latency ms | HDET sync % at T=100 |",
             "|---|---|---|---|---|---|---|"]
    for row in bucket_rows:
        sync = row["sync"]
        lines.append(f"| {row['model']} | {row['nodes']} | {row['bucket_mb']} | {sync['buckets']} | "
                     f"{1e3 * sync['total_s']:.1f} | {1e3 * sync['latency_s']:.1f} | "
                     f"{_pct(row['hdet_sync_overhead'])} |")
    return lines


def render_markdown(result: dict[str, Any]) -> list[str]:
    """The results page: takeaway, assumptions, measured ratios, bytes, one time table per bandwidth, and
    the effect of ``bucket_mb``."""
    a = Assumptions(**result["assumptions"])
    rows, used, gpu = result["rows"], result["bucketing_ratio_used"], result.get("gpu_local_work")
    lines = ["# HDET communication model: sync overhead at scale", "",
             f"Command: `{result['command']}` (formulas only; it reads the sync's local work measured on a GPU "
             "from `gpu_check.json`, else the bucketing ratio measured on CPU from `overhead_*_cpu.json`). Code: "
             "`benchmarks/comm_model.py`.", "", "## Takeaway", "",
             result["takeaway"], "", "## Assumptions", "", *_assumption_lines(a, used, gpu), "",
             f"## Measured bucketing ratio (CPU, gloo{'; not used: the GPU measurement replaces it' if gpu else ''})",
             "",
             "| source | engine | payload bytes per rank | flat all_reduce ms | HDET bucketed average ms | ratio |",
             "|---|---|---|---|---|---|"]
    for entry in result["measured_bucketing_ratios"]:
        lines.append(f"| {entry['source']} | {entry['engine']} | {entry['payload_bytes']:,} | {entry['flat_ms']:.2f} "
                     f"| {entry['bucketed_ms']:.2f} | {entry['ratio']:.3f} |")
    lines += ["", f"Measured on: {result['measured_bucketing_ratios'][0]['machine']}.", "",
              "## Cross-replica bytes per GPU (payload; a ring moves 2 (N-1)/N times it over the NIC)", "",
              *_bytes_table(rows, a), "",
              "Local mode sends 2/(T+2) of global mode's cross-replica bytes per step, not 1/T: the sync averages "
              "fp32 masters (4 B per parameter) while global mode's gradients are bf16 (2 B); with fp32 gradients "
              "it is 1/(T+1).", "",
              f"70B: {MODEL_PARAMS['70B'] * a.optimizer_state_bytes_per_param / a.gpus_per_node / 1e9:.0f} GB of "
              f"model states per GPU with one replica per node does not fit an {H100_MEMORY_GB} GB H100; it needs "
              "CPU offload or 2+ nodes per replica (`ranks_per_replica = 16`: each rank's sync shard halves and "
              "there are half as many replicas, so the sync's bandwidth term roughly halves). Its rows are the "
              "arithmetic of the stated layout."]
    for gbps in LINK_GBPS:
        lines += ["", f"## Time at {gbps} Gb/s per GPU", "",
                  "HDET sync % = one sync / T over the compute per step: HDET's added time in either gradient mode, "
                  "and all of local mode's cross-replica time. Gradient all-reduce: what global mode (and plain "
                  "HSDP) sends across nodes every step and local mode does not.", "", *_time_table(rows, gbps)]
    lines += ["", f"## bucket_mb at {max(LINK_GBPS)} Gb/s per GPU", "",
              "With 25 MiB buckets the per-bucket latency is a large part of a sync on many nodes; larger buckets "
              "(`bucket_mb`, one fp32 buffer of that size per rank during the sync, two while one is in flight) "
              "remove most of it.", "", *_bucket_table(result["bucket_mb_rows"]),
              "", "Every configuration, both modes (bytes, seconds, fractions), is in `comm_model.json`."]
    return lines


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Reads the measured ratios, evaluates every configuration, writes the Markdown and JSON results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(RESULTS),
                        help="directory with overhead_*_cpu.json (and gpu_check.json, when a GPU measured it)")
    parser.add_argument("--out", default=str(RESULTS), help="directory for comm_model.md and comm_model.json")
    args = parser.parse_args(argv)
    result = build(Assumptions(), measured_bucketing_ratios(Path(args.results)),
                   measured_gpu_local_work(Path(args.results)))
    out = Path(args.out)
    write_json(out / "comm_model.json", result)
    save_markdown(out / "comm_model.md", render_markdown(result))
    print(result["takeaway"])
    print(f"wrote {out / 'comm_model.md'} and {out / 'comm_model.json'}")
    return result


if __name__ == "__main__":
    main()
