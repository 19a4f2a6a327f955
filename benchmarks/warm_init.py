"""Warm init's time and peak memory per rank for one large parameter: each rank drawing the whole parameter's
noise and keeping its part (how hdet_scale drew it before) against drawing only the chunks its part overlaps
(``hdet_scale.warm_init.replica_noise``).

One process plays the rank in the middle of a replica of ``S`` ranks that shards a parameter of ``--numel``
fp32 values evenly (no process group is needed: a rank's noise depends only on its range). For each ``S`` and
method it reports the median wall time over ``--repeats`` and the peak memory the draw adds (CPU: the
kernel's peak resident set size, every freed block returned to it; see ``overhead_memory.PeakMemory``).

    python benchmarks/warm_init.py                      # 2e8 values (a 0.8 GB parameter), S = 1, 8, 64
    python benchmarks/warm_init.py --numel 5e7 --shards 1 8 --out /tmp/warm_init
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import RESULTS, MiB, cpu_model, machine_info, note, save_markdown, table_header, table_row, write_json
from overhead_memory import PeakMemory, map_every_large_block

from hdet_scale.spread import stream_seed
from hdet_scale.warm_init import NOISE_CHUNK, noise_pieces

SEED, REPLICA, INDEX = 0, 1, 0


def whole_then_slice(local: torch.Tensor, numel: int, start: int) -> None:
    """The previous method: the parameter's whole noise from one generator, then this rank's part of it."""
    generator = torch.Generator().manual_seed(stream_seed(SEED, f"warm_init/{REPLICA}/{INDEX}"))
    local.add_(torch.randn(numel, generator=generator)[start: start + local.numel()], alpha=0.01)


def chunked(local: torch.Tensor, numel: int, start: int) -> None:
    """What ``add_warm_noise`` does now: the chunks of the rank's part, each added where it belongs."""
    for at, piece in noise_pieces(numel, start, start + local.numel(), seed=SEED, replica_index=REPLICA,
                                  index=INDEX):
        local[at: at + piece.numel()].add_(piece, alpha=0.01)


METHODS: dict[str, Callable[[torch.Tensor, int, int], None]] = {"whole, then sliced": whole_then_slice,
                                                                "chunks of the rank's part": chunked}


def measure(method: Callable[[torch.Tensor, int, int], None], numel: int, shards: int, repeats: int) -> dict:
    """Adds the noise of the middle rank's part to a tensor of that part, ``repeats`` times."""
    size = -(-numel // shards)
    start = min(shards // 2 * size, numel)
    stop = min(start + size, numel)
    local = torch.zeros(stop - start)
    seconds, peaks = [], []
    for _ in range(repeats):
        with PeakMemory(torch.device("cpu")) as memory:
            began = time.perf_counter()
            method(local, numel, start)
            seconds.append(time.perf_counter() - began)
        peaks.append(memory.peak_bytes)
    return {"shards": shards, "local_values": stop - start, "seconds_median": statistics.median(seconds),
            "seconds": seconds, "peak_bytes_max": max(peaks)}


def markdown(record: dict) -> list[str]:
    m = record["machine"]
    lines = [
        "# Warm init per rank: whole-parameter noise vs the rank's own chunks",
        "",
        f"Measured {m['date']} on {m['cpu']} ({m['nproc']} cores), torch {m['torch']}, one thread, by "
        f"`python benchmarks/warm_init.py --numel {record['numel']:.0f}` (a parameter of {record['numel']:,} fp32 "
        f"values, {record['numel'] * 4 / MiB:,.0f} MiB; noise chunks of {record['noise_chunk']:,} values). The "
        "rank is the middle one of a replica of S ranks; peak memory is what the draw adds on top of the rank's "
        "own shard.",
        "",
        *table_header("ranks per replica S", "values on the rank", "method", "time (median)", "peak memory added"),
    ]
    for row in record["rows"]:
        lines.append(table_row(row["shards"], f"{row['local_values']:,}", row["method"],
                               f"{row['seconds_median']:.3f} s", f"{row['peak_bytes_max'] / MiB:,.0f} MiB"))
    return [*lines, "", *note("findings")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=float, default=2e8, help="values in the parameter")
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 8, 64], help="ranks per replica to try")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "warm_init_cpu", help="results stem (.json, .md)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    map_every_large_block()
    numel = int(args.numel)
    rows = []
    for shards in args.shards:
        for name, method in METHODS.items():
            rows.append({"method": name, **measure(method, numel, shards, args.repeats)})
            print(f"S={shards:>3} {name:<26} {rows[-1]['seconds_median']:.3f} s "
                  f"{rows[-1]['peak_bytes_max'] / MiB:,.0f} MiB", flush=True)
    record = {"machine": machine_info(backend="none", ranks=1, cpu=cpu_model()), "numel": numel,
              "noise_chunk": NOISE_CHUNK, "repeats": args.repeats, "rows": rows}
    write_json(args.out.with_suffix(".json"), record)
    save_markdown(args.out.with_suffix(".md"), markdown(record))


if __name__ == "__main__":
    main()
