"""benchmarks/gpu_check.py's dry run on the CPU: the same code paths a lent GPU runs, so the check cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch
from benchmark_modules import BENCHMARKS

from hdet_scale.lm.model import build_model


@pytest.mark.e2e
def test_the_cpu_dry_run_measures_every_engine_and_writes_consistent_results(tmp_path):
    out = tmp_path / "gpu_check"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--device", "cpu", "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.with_suffix(".json").read_text())
    model = build_model("tiny", vocab_size=256, seq_len=32)
    parameter_bytes = 4 * sum(p.numel() for p in model.parameters())
    buffer_bytes = 4 * sum(b.numel() for b in model.buffers() if b.is_floating_point())
    assert record["local_work"]["tiny"]["bytes"] == parameter_bytes
    assert set(record["runs"]) == {"ddp/tiny", "fsdp/tiny"} and record["incomplete"] == []
    for name, run in record["runs"].items():
        assert not [section for section, found in run.items()
                    if isinstance(found, dict) and {"error", "skipped"} & found.keys()], (name, run)
        timing = run["step_time"]
        # a sync averages every parameter and floating buffer (rotary frequencies) of the replica, and one more
        # element: the contributor count
        assert timing["sync_bytes"] == parameter_bytes + buffer_bytes + 4
        assert timing["syncs_timed"] >= 1 and timing["plain_step_ms"] > 0 and timing["flat_all_reduce_ms"] > 0
        plain, own, sync = timing["plain_step_ms"], sum(timing["own_work_per_step_ms"].values()), timing["sync_ms"]
        for interval in (10, 100, 1000):
            assert timing["ratio"][str(interval)] == pytest.approx((plain + own + sync / interval) / plain)
        own_sync = max(0.0, sync - timing["flat_all_reduce_ms"])
        assert timing["ratio_own_work_only"]["1000"] == pytest.approx((plain + own + own_sync / 1000) / plain)
        compute = timing["compute_step_ms"]  # the same step without its gradient transfer
        assert 0 < compute and timing["ratio_over_compute"]["100"] == pytest.approx((compute + own + own_sync / 100)
                                                                                   / compute)
        # CUDA-only checks say so on the CPU instead of reporting numbers
        assert run["synchronizations"]["checked"] is False and run["memory"]["checked"] is False
    # DDP's gradient average timed four ways on the same batches; FSDP2 has no DDP hook to compare
    hooks = record["runs"]["ddp/tiny"]["gradient_hooks"]
    ways = ("built_in", "built_in_guarded", "python_allreduce_hook", "hdet_healthy_mean")
    assert all(hooks[f"{name}_ms"] > 0 for name in ways)
    assert {f"{name}_over_built_in_ms" for name in ways[1:]} | {"hdet_healthy_mean_over_python_allreduce_hook_ms"} \
        <= set(hooks)
    assert "gradient_hooks" not in record["runs"]["fsdp/tiny"]
    # where each hook's time goes: rank 0's profile of each, every one all-reducing through c10d
    profiles = record["runs"]["ddp/tiny"]["hook_profile"]["hooks"]
    assert list(profiles) == list(ways)
    assert all(ops["c10d::allreduce_"]["calls"] >= 1 for ops in profiles.values())
    # the finiteness check is HDET's hook's and the guarded step's own
    assert "aten::isfinite" in profiles["hdet_healthy_mean"] and "aten::isfinite" in profiles["built_in_guarded"]
    assert "aten::isfinite" not in profiles["built_in"]
    page = out.with_suffix(".md").read_text()
    assert "guard before the step over built-in |" in page
    assert "differs most, hdet_healthy_mean against python_allreduce_hook" in page
    assert "| ddp/tiny |" in page and "| fsdp/tiny |" in page and "| tiny |" in page


@pytest.mark.e2e
def test_a_run_out_of_time_still_writes_its_results_and_says_what_it_skipped(tmp_path):
    """Everything after the budget is skipped and named, and the files are written: a GPU loan that runs out
    keeps what was measured."""
    out = tmp_path / "gpu_check"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--device", "cpu", "--quick",
                           "--engines", "ddp", "--no_profile", "--budget_s", "0", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["incomplete"] == ["local_work: the time budget (--budget_s) ran out before it started",
                                    "ddp/tiny: the time budget (--budget_s) ran out before it started"]
    assert "- ddp/tiny: the time budget (--budget_s) ran out before it started" in out.with_suffix(".md").read_text()
    assert not list(tmp_path.glob("gpu_check_*"))  # no partial files left


@pytest.mark.filterwarnings("ignore:called a synchronizing")  # the part not checked in place shows its own
def test_the_sync_watch_notes_every_synchronization_and_lets_the_part_run_on():
    from benchmark_modules import load_benchmark

    gpu_check = load_benchmark("gpu_check")
    watch, ran = gpu_check.SyncWatch(torch.device("cpu")), []
    said = "called a synchronizing CUDA operation"  # what CUDA's sync debug mode says
    for _ in range(2):
        with watch.region("optimizer"):
            warnings.warn(said, UserWarning, stacklevel=1)
            ran.append(True)
    with watch.region("forward_backward"):  # not checked in place
        warnings.warn(said, UserWarning, stacklevel=1)
    assert ran == [True, True] and list(watch.found) == ["optimizer"] and len(watch.found["optimizer"]) == 2
    assert watch.found["optimizer"][0].startswith("test_gpu_check.py:")


def test_the_page_names_each_section_that_failed_and_shows_the_others():
    """A section that failed on a GPU loan is named with its error, and the sections measured beside it show."""
    from benchmark_modules import load_benchmark

    gpu_check = load_benchmark("gpu_check")
    memory = {"checked": True, "plain_mib": 100.0, "hdet_mib": 120.0, "hdet_no_window_mib": 110.0,
              "hdet_over_plain": 1.2, "window_share_of_extra": 0.5}
    record = {"machine": {"gpu": "a GPU", "torch": "2.13", "date": "today"}, "command": "python3 gpu_check.py",
              "settings": {"batch": 8, "seq_len": 256}, "incomplete": ["fsdp/125m: the time budget ran out"],
              "local_work": {"small": {"error": "rank 0: RuntimeError: NCCL"}},
              "runs": {"ddp/small": {"step_time": {"error": "rank 1: RuntimeError: out of memory"}, "memory": memory,
                                     "hook_profile": {"skipped": "the time budget ran out"}}}}
    page = "\n".join(gpu_check.markdown(record))
    assert "- `ddp/small` step_time: rank 1: RuntimeError: out of memory" in page
    assert "- `ddp/small` hook_profile: the time budget ran out" in page
    assert "- fsdp/125m: the time budget ran out" in page
    assert "- the sync's local work on `small`: rank 0: RuntimeError: NCCL" in page
    assert "| ddp/small | 100.0 | 120.0 | 110.0 | 1.200 | 50% |" in page
