"""The communication model's formulas against numbers worked out by hand, and its outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark_modules import load_benchmark

REPO = Path(__file__).resolve().parents[2]


cm = load_benchmark("comm_model")
A = cm.Assumptions()  # 8 GPUs/node, 4 Mi tokens, 400 TFLOP/s, 8.4 + 9.6 us latencies, 25 MiB, fp32/bf16, 2 TB/s


def test_7b_on_8_nodes_at_400_gbps_global_mode_t100():
    ratio = 1.5
    row = cm.evaluate("7B", 8, 400, 100, "global", ratio, A)
    # Worked by hand: master shard 4 * 7e9 / 8 = 3.5e9 B in ceil(3.5e9 / 26,214,400) = 134 buckets; a ring of 8
    # costs 8.4 + 2 * 7 * 9.6 = 142.8 us per bucket; bandwidth term 2 * 7/8 * 3.5e9 / 50e9 = 0.1225 s, times
    # the ratio; finiteness check 3.5e9 / 2e12; loss gather over 64 ranks 8.4 + 2 * 6 * 9.6 = 123.6 us.
    sync_latency = 134 * 142.8e-6 + 123.6e-6
    sync = sync_latency + 1.5 * 0.1225 + 1.75e-3
    assert row["sync"]["buckets"] == 134
    assert row["sync"]["latency_s"] == pytest.approx(sync_latency)
    assert row["sync"]["bandwidth_s"] == pytest.approx(0.18375)
    assert row["sync"]["total_s"] == pytest.approx(sync)  # 0.2047588 s
    # Compute: 6 * 7e9 * 4,194,304 / (64 GPUs * 400e12) = 6.88128 s per step.
    assert row["compute_s"] == pytest.approx(6.88128)
    # Gradient shard 2 * 7e9 / 8 = 1.75e9 B: 67 buckets of 142.8 us + 2 * 7/8 * 1.75e9 / 50e9 = 0.06125 s.
    assert row["gradient_allreduce_s"] == pytest.approx(67 * 142.8e-6 + 0.06125)
    assert row["hdet_sync_overhead"] == pytest.approx(0.2047588 / 100 / 6.88128)
    assert row["cross_replica_fraction"] == pytest.approx((0.0708176 + 0.2047588 / 100) / 6.88128)
    assert row["payload_bytes_per_step"] == pytest.approx(1.75e9 + 3.5e9 / 100)
    assert row["wire_bytes_per_step"] == pytest.approx(1.785e9 * 2 * 7 / 8)
    assert row["model_states_gb_per_gpu"] == pytest.approx(14.0)


def test_1b_on_4_nodes_at_200_gbps_local_mode_t10():
    row = cm.evaluate("1B", 4, 200, 10, "local", 1.5, A)
    # Shard 5e8 B: ceil(5e8 / 26,214,400) = 20 buckets of 8.4 + 2 * 3 * 9.6 = 66 us; bandwidth
    # 1.5 * 2 * 3/4 * 5e8 / 25e9 = 0.045 s; check 5e8 / 2e12 = 2.5e-4 s; gather over 32 ranks 8.4 + 10 * 9.6 us.
    sync = 20 * 66e-6 + 0.045 + 2.5e-4 + 104.4e-6
    assert row["sync"]["total_s"] == pytest.approx(sync)
    assert row["compute_s"] == pytest.approx(1.96608)  # 6 * 1e9 * 4,194,304 / (32 * 400e12)
    assert row["gradient_allreduce_s"] == 0.0
    assert row["hdet_sync_overhead"] == pytest.approx(sync / 10 / 1.96608)
    assert row["cross_replica_fraction"] == pytest.approx(row["hdet_sync_overhead"])
    assert row["payload_bytes_per_step"] == pytest.approx(5e8 / 10)


def test_with_the_local_work_measured_on_a_gpu_the_wire_runs_at_its_speed():
    row = cm.evaluate("7B", 8, 400, 100, "global", 1.0, A, local_seconds_per_byte=1e-11)
    # As above with the ratio 1, and the local work 3.5e9 B * 1e-11 s/B = 0.035 s instead of the HBM check.
    assert row["sync"]["bandwidth_s"] == pytest.approx(0.1225)
    assert row["sync"]["local_work_s"] == pytest.approx(0.035)
    assert row["sync"]["total_s"] == pytest.approx(134 * 142.8e-6 + 123.6e-6 + 0.1225 + 0.035)


def fake_gpu_check(directory: Path) -> None:
    work = {"small": {"bytes": 100, "local_work_ms": 5.0, "copy_ms": 0.1, "local_work_over_copy": 50.0},
            "125m": {"bytes": 4000, "local_work_ms": 8.0, "copy_ms": 1.0, "local_work_over_copy": 8.0}}
    (directory / "gpu_check.json").write_text(json.dumps({"machine": {"gpu": "Test GPU"}, "local_work": work}))


def test_reads_the_gpu_local_work_of_the_largest_preset_and_drops_the_cpu_ratio(tmp_path):
    fake_results(tmp_path)
    assert cm.measured_gpu_local_work(tmp_path) is None
    fake_gpu_check(tmp_path)
    gpu = cm.measured_gpu_local_work(tmp_path)
    assert gpu["preset"] == "125m" and gpu["seconds_per_byte"] == pytest.approx(8e-3 / 4000)
    result = cm.build(A, cm.measured_bucketing_ratios(tmp_path), gpu)
    row = cm._row(result["rows"], model="7B", nodes=8, link_gbps=400, sync_interval=100, gradient_mode="global")
    assert row["sync"]["bandwidth_s"] == pytest.approx(0.1225)  # ratio 1, not the CPU's 1.4
    assert row["sync"]["local_work_s"] == pytest.approx(3.5e9 * 8e-3 / 4000)
    markdown = "\n".join(cm.render_markdown(result))
    assert "local work measured on an Test GPU" in markdown and "not used: the GPU measurement replaces it" in markdown


def test_local_mode_sends_2_over_t_plus_2_of_global_mode_with_bf16_gradients():
    for interval in (10, 100, 1000):
        local = cm.payload_bytes_per_step(13e9, interval, "local", A)
        glob = cm.payload_bytes_per_step(13e9, interval, "global", A)
        assert local / glob == pytest.approx(2 / (interval + 2))


def test_closed_form_matches_the_bandwidth_term():
    for model in ("1B", "70B"):
        for nodes in (4, 64):
            row = cm.evaluate(model, nodes, 400, 100, "local", 1.8, A)
            expected = cm.closed_form_sync_fraction(nodes, 400, 100, 1.8, A)
            assert row["sync"]["bandwidth_s"] / 100 / row["compute_s"] == pytest.approx(expected)
    # By hand at 64 nodes: 1.8 * 4 * 63 * 400e12 / (3 * 4,194,304 * 50e9 * 100).
    assert cm.closed_form_sync_fraction(64, 400, 100, 1.8, A) == pytest.approx(
        1.8 * 4 * 63 * 400e12 / (3 * 4_194_304 * 50e9 * 100))


def test_one_replica_sends_nothing():
    assert cm.bucketed_allreduce_seconds(1e9, 1, 400, A)["total_s"] == 0.0
    assert cm.ring_latency_seconds(1, A) == 0.0


def fake_results(directory: Path) -> None:
    def sync_time(payload: int, flat: float, bucketed: float) -> dict:
        return {"payload_bytes": payload, "ops": {
            "flat all_reduce": {"seconds": {"median": flat}, "ratio_vs_flat": {"median": 1.0}},
            "average_tensors bucket_mb=25": {"seconds": {"median": bucketed},
                                             "ratio_vs_flat": {"median": 1.25}},
            "hdet.sync bucket_mb=25": {"seconds": {"median": 9.0}, "ratio_vs_flat": {"median": 7.0}}}}

    machine = {"cpu": "test cpu", "backend": "gloo", "ranks": 4, "torch": "x"}
    (directory / "overhead_ddp_cpu.json").write_text(json.dumps(
        {"engine": {"title": "plain DDP"}, "machine": machine, "sync_time": sync_time(100, 0.01, 0.0125)}))
    stages = {"ZeRO-1": {"sync_time": sync_time(50, 0.02, 0.03)}, "ZeRO-2": {"bytes": {}}}
    stages["ZeRO-1"]["sync_time"]["ops"]["average_tensors bucket_mb=25"]["ratio_vs_flat"]["median"] = 1.4
    (directory / "overhead_deepspeed_cpu.json").write_text(json.dumps({"machine": machine, "stages": stages}))
    (directory / "overhead_fsdp_gpu.json").write_text("not read: only the CPU files")


def test_reads_the_measured_ratios_and_uses_the_largest(tmp_path):
    fake_results(tmp_path)
    ratios = cm.measured_bucketing_ratios(tmp_path)
    assert [(entry["engine"], entry["ratio"]) for entry in ratios] == [("plain DDP", 1.25), ("ZeRO-1", 1.4)]
    assert ratios[1]["flat_ms"] == pytest.approx(20.0) and ratios[1]["payload_bytes"] == 50
    result = cm.build(A, ratios)
    assert result["bucketing_ratio_used"]["ratio"] == 1.4
    row = cm._row(result["rows"], model="7B", nodes=8, link_gbps=400, sync_interval=100, gradient_mode="global")
    assert row["sync"]["bandwidth_s"] == pytest.approx(1.4 * 0.1225)
    with pytest.raises(FileNotFoundError, match="run benchmarks/overhead.py first"):
        cm.measured_bucketing_ratios(tmp_path / "missing")


def test_the_committed_cpu_results_give_a_ratio():
    ratios = cm.measured_bucketing_ratios()
    fsdp = json.loads((REPO / "benchmarks" / "results" / "overhead_fsdp_cpu.json").read_text())
    measured = fsdp["sync_time"]["ops"]["average_tensors bucket_mb=25"]["ratio_vs_flat"]["median"]
    assert ("FSDP2", measured) in [(entry["engine"], entry["ratio"]) for entry in ratios]
    assert all(entry["ratio"] >= 1.0 for entry in ratios)


def test_writes_markdown_and_json(tmp_path, capsys):
    fake_results(tmp_path)
    result = cm.main(["--results", str(tmp_path), "--out", str(tmp_path / "out")])
    data = json.loads((tmp_path / "out" / "comm_model.json").read_text())
    assert len(data["rows"]) == 4 * 5 * 2 * 3 * 2 == len(result["rows"])
    markdown = (tmp_path / "out" / "comm_model.md").read_text()
    lines = markdown.splitlines()
    assert lines[lines.index("## Takeaway") + 2] == data["takeaway"]
    assert "measured bucketing ratio 1.400" in markdown and "CPU with gloo" in markdown
    worst = max(row["hdet_sync_overhead"] for row in data["rows"]
                if row["link_gbps"] == 400 and row["sync_interval"] == 100)
    assert f"at most {100 * worst:.1f}% to the step time at T = 100" in data["takeaway"]
    for row in data["rows"]:
        if row["gradient_mode"] == "local":
            glob = cm._row(data["rows"], model=row["model"], nodes=row["nodes"], link_gbps=row["link_gbps"],
                           sync_interval=row["sync_interval"], gradient_mode="global")
            assert row["cross_replica_s_per_step"] < glob["cross_replica_s_per_step"]
    # The bucket_mb table: larger buckets, fewer buckets and less latency.
    latency = [row["sync"]["latency_s"] for row in data["bucket_mb_rows"] if row["model"] == "70B"
               and row["nodes"] == 64]
    assert latency == sorted(latency, reverse=True) and len(latency) == 4
    assert data["takeaway"] in capsys.readouterr().out
