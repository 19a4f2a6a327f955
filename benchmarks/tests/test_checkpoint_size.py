"""The checkpoint size benchmark's reading of a checkpoint's parts and its ratio, against files sized by hand."""

from __future__ import annotations

from benchmark_modules import load_benchmark

checkpoint_size = load_benchmark("checkpoint_size")


def test_deepspeed_parts_are_read_from_the_file_names(tmp_path):
    sizes = {"mp_rank_00_model_states.pt": 100, "zero_pp_rank_0_mp_rank_00_optim_states.pt": 30,
             "zero_pp_rank_1_mp_rank_00_optim_states.pt": 30, "hdet_replicas/replica1_zero_pp_rank_0_mp_rank_00"
             "_optim_states.pt": 30, "hdet_replicas/replica1_zero_pp_rank_1_mp_rank_00_optim_states.pt": 30,
             "run.json": 7}
    for name, size in sizes.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * size)
    assert checkpoint_size.parts_of_deepspeed(tmp_path) == {"model": 100, "optimizer": 120, "optimizer_states": 2}


def test_the_baseline_is_the_checkpoint_with_one_optimizer_state():
    row = {"code": "abc", "engine": "deepspeed", "mode": "local", "total": 227, "model": 100, "optimizer": 120,
           "optimizer_states": 2}
    lines = checkpoint_size.report({"machine": {}, "rows": [row]})
    assert lines[6].endswith("| 2 | 1.36x |")  # 227 / (227 - 120 + 60)
