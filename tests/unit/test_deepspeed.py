"""The DeepSpeed adapter on 4 real gloo ranks with real DeepSpeed ZeRO 0-3 (no mocks).

ZeRO-0 runs the paper's setting (every rank a replica: 4 replicas); ZeRO-1/2/3 run 2 replicas x 2 ranks,
each replica sharding the model over its own ranks. A DeepSpeed launch costs seconds here, so each launch
builds several engines and checks many properties.

This file holds the tests that start no process; the tests on gloo ranks are in
tests/distributed/test_deepspeed_distributed.py.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hdet_scale import HDETConfigError
from hdet_scale.engines import deepspeed as hdet_deepspeed
from hdet_scale.engines.deepspeed_settings import check_version

MICRO_BATCHES = 2


def tiny_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # a different seed per rank: initialize must still make replicas identical
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def ds_config(stage: int, *, bf16: bool = False, hdet: dict | None = None, **extra) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": MICRO_BATCHES,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16},
              "steps_per_print": 10**6, **extra}
    if hdet is not None:
        config["hdet"] = hdet
    return config


# ------------------------------------------------------------------------------------------ bad inputs
@pytest.fixture
def launcher_env(monkeypatch):
    """What the deepspeed launcher sets on a 4-rank node; no process group exists."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_SIZE", "4")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    yield
    assert not dist.is_initialized()  # every error came before any process group was created


@pytest.mark.parametrize(("config", "kwargs", "message"), [
    (ds_config(2, hdet={"ranks_per_replica": 3}), {}, "ranks_per_replica=3 does not divide the world size 4"),
    (ds_config(2, hdet={"sync_intreval": 3}), {},
     r"unknown HDET setting 'sync_intreval' \(did you mean 'sync_interval'"),
    (ds_config(2, hdet={"alpha": 1.5, "spread": "linear"}), {}, r"alpha must be a number in \[0.0, 1.0\)"),
    (ds_config(2, hdet=[1]), {}, "the 'hdet' section of the DeepSpeed config must be a JSON object"),
    (ds_config(2, hdet={}), {"hdet_config": {"alpha": 0.2, "spread": "linear"}}, "HDET settings given more than once"),
    (ds_config(2, zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}}), {},
     "zero_optimization.offload_optimizer.device='cpu'.*does not support offload"),
    (ds_config(3, zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}}), {},
     "zero_optimization.offload_param.device='nvme'"),
    (ds_config(3, zero_optimization={"stage": 3, "zero_hpz_partition_size": 2}), {}, "ZeRO\\+\\+ hpZ"),
    # DeepSpeed's older spellings of the two offload sections (ZeRO-2 with cpu_offload left gradients unaveraged)
    (ds_config(2, zero_optimization={"stage": 2, "cpu_offload": True}), {},
     "zero_optimization.cpu_offload=True.*offload_optimizer.device=.cpu.*does not support offload"),
    (ds_config(3, zero_optimization={"stage": 3, "cpu_offload_param": True}), {},
     "zero_optimization.cpu_offload_param=True.*offload_param"),
    (ds_config(3, zero_optimization={"stage": 3, "zero_quantized_gradients": True}), {}, "ZeRO\\+\\+ qgZ"),
    (ds_config(2, zero_optimization=True), {},
     r"zero_optimization must be an object such as \{\"stage\": 2\}, got True"),
    (ds_config(2, fp16={"enabled": True}), {}, "fp16.enabled: HDET supports fp32 and bf16"),
    (ds_config(0, torch_autocast={"enabled": True, "dtype": "half"}), {}, "torch_autocast.dtype: HDET supports fp32"),
    (ds_config(2, checkpoint={"use_node_local_storage": True}), {},
     "checkpoint.use_node_local_storage is not supported with HDET"),
    (ds_config(2, checkpoint={"writer": {"decoupled": True}}), {}, "checkpoint.writer.decoupled: HDET puts"),
    (ds_config(2, datastates_ckpt={}), {}, "datastates_ckpt: HDET puts a checkpoint in place"),
    # null turns it on, as DeepSpeed reads it
    (ds_config(2, datastates_ckpt=None), {}, "datastates_ckpt: HDET puts a checkpoint in place"),
    (ds_config(0, torch_autocast={"enabled": True}), {}, "torch_autocast.dtype: HDET supports fp32"),  # fp16 by default
    (ds_config(1, tensor_parallel={"autotp_size": 2}), {}, "tensor_parallel.autotp_size > 1 is not supported"),
    (ds_config(2, expert_parallel={"enabled": True}), {}, "expert_parallel.enabled is not supported"),
    (ds_config(2, train_batch_size=6), {"hdet_config": {"ranks_per_replica": 1}},
     "train_batch_size=6 does not match train_micro_batch_size_per_gpu=2 x gradient_accumulation_steps=2 x 4 ranks "
     "= 16"),
    ({key: value for key, value in ds_config(2, train_batch_size=6).items()
      if key not in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")},
     {"hdet_config": {"ranks_per_replica": 1}},
     "train_batch_size=6 is not a multiple of the 4 ranks: each rank takes an equal share of it"),
    # summed inside the replica, averaged across: a replica count times smaller than plain DeepSpeed's sum
    (ds_config(2, gradient_allreduce_op="SUM"), {}, 'gradient_allreduce_op="sum": HDET averages the gradients'),
    # "auto" read as a batch size: 'must be a multiple of the number of replicas', or DeepSpeed's TypeError
    (ds_config(2, train_batch_size="auto"), {}, 'train_batch_size is "auto", which transformers\' Trainer fills in'),
    ({**ds_config(2), "train_micro_batch_size_per_gpu": "auto"}, {},
     'train_micro_batch_size_per_gpu is "auto", which'),
])
def test_bad_inputs_fail_before_any_process_group(launcher_env, config, kwargs, message):
    with pytest.raises((HDETConfigError, ValueError), match=message):
        hdet_deepspeed.initialize(model=tiny_model(0), optimizer=torch.optim.AdamW, config=config, **kwargs)


def test_zero_optimization_false_is_stage_0_as_deepspeed_reads_it():
    from hdet_scale.engines.deepspeed_settings import zero_section

    assert zero_section({"zero_optimization": False}) == zero_section({}) == {}
    with pytest.raises(HDETConfigError, match="got True"):
        zero_section({"zero_optimization": True})


def test_user_mpu_and_missing_config_are_refused(launcher_env):
    with pytest.raises(ValueError, match="HDET builds DeepSpeed's mpu itself"):
        hdet_deepspeed.initialize(model=tiny_model(0), config=ds_config(1), mpu=object())
    with pytest.raises(ValueError, match="DeepSpeed needs a config"):
        hdet_deepspeed.initialize(model=tiny_model(0))


def test_settings_from_args_and_the_deepspeed_json(launcher_env, tmp_path):
    """--deepspeed_config and --hdet_config from the command line; the HDET file's own errors name it."""
    ds_path, hdet_path = tmp_path / "ds.json", tmp_path / "hdet.json"
    ds_path.write_text(json.dumps(ds_config(2)))
    hdet_path.write_text(json.dumps({"ranks_per_replica": 8}))
    parser = hdet_deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--local_rank=1", "--deepspeed_config", str(ds_path), "--hdet_config", str(hdet_path)])
    assert args.deepspeed_config == str(ds_path) and args.hdet_config == str(hdet_path) and args.local_rank == 1
    with pytest.raises(HDETConfigError, match="ranks_per_replica=8 does not divide the world size 4"):
        hdet_deepspeed.initialize(args=args, model=tiny_model(0), optimizer=torch.optim.AdamW)
    own = argparse.ArgumentParser()
    own.add_argument("--local_rank", type=int, default=0)
    assert hdet_deepspeed.add_config_arguments(own).parse_args([]).local_rank == 0  # the user's own declaration
    with pytest.raises(ValueError, match="DeepSpeed config given twice"):
        hdet_deepspeed.initialize(args=args, model=tiny_model(0), config=ds_config(2))


@pytest.mark.parametrize("version", ["0.18.4", "0.20.0", "1.0.0"])
def test_untested_deepspeed_versions_are_named_in_the_error(version):
    with pytest.raises(RuntimeError, match=rf"DeepSpeed {version} is installed.*pip install 'deepspeed>=0.19.8,<0.20'"):
        check_version(version)


def test_the_installed_deepspeed_is_in_the_tested_range():
    import deepspeed

    check_version(deepspeed.__version__)  # raises if pyproject's pin and the tested range disagree
