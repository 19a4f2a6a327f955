"""The overhead benchmark's CPU memory meter against allocations worked out by hand."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from benchmark_modules import BENCHMARKS, load_benchmark

memory = load_benchmark("overhead_memory")
MB = 1_000_000
PAGE = 4096

# Run as the benchmark's memory launch runs: in a fresh process with glibc mapping every large block.
SCRIPT = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
from overhead_memory import PeakMemory, map_every_large_block

map_every_large_block()

kept = torch.ones(1_000_000)  # 4 MB in use before the window: not counted
kept.clone()  # an op's first call sets things up that stay (about 0.5 MB): not this test's business
with PeakMemory(torch.device("cpu")) as meter:
    a = torch.ones(1_000_000)  # 4 MB
    b = torch.ones(500_000)  # 2 MB (6 in use)
    del a  # 2
    c = torch.ones(2_000_000)  # 8 MB (10)
    d = c.clone()  # 8 MB beside b and c: 18 MB, the peak
    del c, d, kept  # 2 MB left; freeing a tensor from before the window counts against the start
print(meter.peak_bytes, meter.retained_bytes)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_peak_memory_counts_the_most_in_use_at_once_and_what_is_left():
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(BENCHMARKS)], capture_output=True, text=True,
                          check=True)
    peak, retained = map(int, done.stdout.split())
    # The kernel's resident-set counters are per-CPU counters folded in batches of up to 64 pages, and a read
    # sums them approximately: each of the two reads (start, end) can be that far off on every CPU (seen: 65
    # pages low on 2 CPUs under load).
    slack = 64 * PAGE * (os.cpu_count() or 1)
    assert peak == pytest.approx(18 * MB, abs=slack)
    assert retained == pytest.approx(2 * MB - 4 * MB, abs=slack)


def test_resident_bytes_reads_both_sizes_and_the_peak_is_at_least_the_current():
    sizes = memory.resident_bytes()
    assert 0 < sizes["VmRSS"] <= sizes["VmHWM"]
