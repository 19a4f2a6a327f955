"""The shipped ds_configs/: every JSON parses and validates, and every DeepSpeed JSON trains with its HDET JSON.

The end-to-end run launches each pair as the README's command does (``--deepspeed_config`` and
``--hdet_config``) on 4 CPU gloo ranks posing as 2 nodes of 2 ranks, so ``ranks_per_replica: "auto"`` gives
2 replicas of 2 ZeRO shards (and ``hdet_zero0.json`` 4 replicas of 1). Only what a 4-step CPU run must change
is overridden: the scheduler's length, the sync interval, the controller's start at the given LR and the metrics
path; ``train_batch_size`` is added to check how HDET splits it.

This file holds the tests that start no process; the tests on gloo ranks are in
tests/distributed/test_ds_configs_distributed.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deepspeed.runtime import lr_schedules
from deepspeed.runtime.config import DeepSpeedConfig
from settings import assert_resolves_like_the_defaults
from torch import nn

from hdet_scale import HDETConfig, load_config
from hdet_scale.controller import controller_updates
from hdet_scale.engines.deepspeed_settings import check_supported
from hdet_scale.topology import check_world_size

CONFIGS = Path(__file__).resolve().parents[2] / "ds_configs"
MATCHING_HDET = {
    "zero0_fp32.json": "hdet_zero0.json",
    "zero1_bf16.json": "hdet_zero.json",
    "zero2_bf16.json": "hdet_zero.json",
    "zero3_bf16.json": "hdet_zero.json",
}
"""Each DeepSpeed JSON and the HDET JSON the README pairs it with."""
ZERO_STAGE = {"zero0_fp32.json": 0, "zero1_bf16.json": 1, "zero2_bf16.json": 2, "zero3_bf16.json": 3}


def all_json() -> list[str]:
    return sorted(path.name for path in CONFIGS.glob("*.json"))


def read(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def test_every_json_is_paired_and_documented():
    names = all_json()
    ds_names = [name for name in names if not name.startswith(("hdet_", "trainer_"))]  # Trainer's: test_hf_trainer
    assert sorted(ds_names) == sorted(MATCHING_HDET), "a DeepSpeed JSON without a matching HDET JSON (or gone)"
    assert set(MATCHING_HDET.values()) <= set(names)
    readme = (CONFIGS / "README.md").read_text()
    undocumented = [name for name in names if f"`{name}`" not in readme]
    assert not undocumented, f"ds_configs/README.md does not describe {undocumented}"


@pytest.mark.parametrize("name", sorted(set(MATCHING_HDET.values())))
def test_hdet_json_loads_and_lays_out_the_readme_cluster(name, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = HDETConfig.from_json(CONFIGS / name)
    assert load_config(str(CONFIGS / name)) == config
    assert config.warm_init.enabled is False  # the paper's default: start from the checkpoint as it is
    assert config.metrics_path is None  # --out decides where a run writes: two runs never share one file
    # The README's launch: 4 nodes x 8 GPUs, the deepspeed launcher telling each rank LOCAL_SIZE=8.
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "8")
    expected_replicas = {"hdet_zero.json": 4, "hdet_zero0.json": 32}[name]
    assert check_world_size(config, 32, auto="node") == expected_replicas


@pytest.mark.parametrize("name", sorted(set(MATCHING_HDET.values())))
def test_hdet_json_writes_out_the_librarys_controller_defaults(name):
    """The spread and the controller of the shipped HDET JSONs are what an empty config runs with, also after a
    user changes the controller's mode or range test in them."""
    shipped, library = HDETConfig.from_json(CONFIGS / name), HDETConfig()
    assert (shipped.alpha, shipped.spread) == (library.alpha, library.spread)
    assert_resolves_like_the_defaults(read(name))


@pytest.mark.parametrize("name", sorted(MATCHING_HDET))
def test_deepspeed_json_passes_deepspeeds_parser_and_hdets_checks(name):
    values = read(name)
    parsed = DeepSpeedConfig(str(CONFIGS / name))  # no process group: world size 1
    assert parsed.zero_optimization_stage == ZERO_STAGE[name]
    assert parsed.bfloat16_config.enabled == name.endswith("_bf16.json")
    assert not parsed.float16_config.enabled
    assert parsed.gradient_clipping == 1.0
    micro, accumulation = parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps
    assert parsed.train_batch_size == micro * accumulation  # one rank: DeepSpeed derived it, nothing conflicts
    # The optimizer section must build torch's AdamW: DeepSpeed's own Adam JIT-compiles FusedAdam.
    assert parsed.optimizer_name == "adamw" and parsed.optimizer_params["torch_adam"] is True
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=values["optimizer"]["params"]["lr"])
    scheduler = getattr(lr_schedules, parsed.scheduler_name)(optimizer, **parsed.scheduler_params)
    hdet = HDETConfig.from_json(CONFIGS / MATCHING_HDET[name]).for_run(scheduler.total_num_steps)
    assert controller_updates(hdet) >= 10, "the schedule gives HDET's controller too few syncs to move the LR"
    check_supported(values, model)
