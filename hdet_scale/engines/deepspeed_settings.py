"""What ``hdet_scale.engines.deepspeed.initialize`` and the Trainer integration check before any process group or
engine exists: the DeepSpeed version HDET was tested with, the DeepSpeed JSON (settings HDET cannot run with, batch
sizes over all ranks), the HDET settings (from exactly one place) and the replica layout, each refused in one line
naming the setting."""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from packaging.version import Version
from torch import nn

from hdet_scale.config import HDETConfig, HDETConfigError
from hdet_scale.resolve import load_config, run_length_error
from hdet_scale.topology import check_world_size, with_replica_size

TESTED_DEEPSPEED = (Version("0.19.8"), Version("0.20"))
"""The DeepSpeed versions (lower bound included, upper excluded) whose internals HDET (``engines/zero.py``) was
tested against."""


def checked_settings(args: Any, model: nn.Module | None, config: str | Mapping[str, Any] | None,
                     hdet_config: HDETConfig | Mapping[str, Any] | str | None, total_steps: int | None, *,
                     mpu: Any = None, mesh_param: Any = None) -> tuple[dict[str, Any], Any, HDETConfig]:
    """The DeepSpeed config as a private dict, ``args`` without its path, and the HDET config with its replica
    size and (where the run's length is known) its controller's start and stop resolved; every check that needs
    no process group done."""
    if model is None:
        raise ValueError("initialize requires a model")
    if mpu is not None or mesh_param is not None:
        raise ValueError("HDET builds DeepSpeed's mpu itself (its data-parallel group is the replica); "
                         "tensor, pipeline and sequence parallelism are not supported, so pass neither mpu "
                         "nor mesh_param")
    ds_config, args = take_ds_config(args, config)
    hdet = hdet_settings(ds_config.pop("hdet", None), args, hdet_config)
    stage = int(zero_section(ds_config).get("stage", 0))
    hdet = with_replica_size(hdet, auto="rank" if stage == 0 else "node")
    if total_steps is None:  # the run's length, if DeepSpeed's scheduler knows it
        total_steps = ds_config.get("scheduler", {}).get("params", {}).get("total_num_steps")
    if isinstance(total_steps, int) and not isinstance(total_steps, bool):
        hdet = hdet.for_run(total_steps)
    launched_world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None  # the launcher's
    check_supported(ds_config, model, world_size=launched_world)  # batch sizes too, before any set-up
    if launched_world is not None:
        replicas = check_world_size(hdet, launched_world)
        per_replica_batch(ds_config, replicas)
        error = run_length_error(hdet, replicas, "pass total_steps= to initialize (or give DeepSpeed a scheduler "
                                 "with total_num_steps)")
        if error is not None:
            raise error
    return ds_config, args, hdet


ZERO_INIT_FIX = "build it normally and let initialize shard it inside each replica"


def check_supported(ds_config: Mapping[str, Any], model: nn.Module, *, world_size: int | None = None,
                    zero_init_fix: str = ZERO_INIT_FIX) -> None:
    """Raises, naming the setting, for DeepSpeed settings and models HDET cannot run with (with ``world_size``,
    also batch sizes that do not add up over all ranks); ``zero_init_fix`` says how to build the model without
    ``deepspeed.zero.Init``."""
    check_ds_config(ds_config, world_size)
    if any(hasattr(param, "ds_id") for param in model.parameters()):
        raise HDETConfigError("the model was built under deepspeed.zero.Init, which partitions it over every "
                              f"rank; {zero_init_fix}")
    from deepspeed.pipe import PipelineModule

    if isinstance(model, PipelineModule):
        raise HDETConfigError("pipeline parallelism (PipelineModule) is not supported with HDET")


def zero_section(ds_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The DeepSpeed JSON's ``zero_optimization`` object ({} where there is none)."""
    zero = ds_config.get("zero_optimization")
    if zero is None or zero is False:  # DeepSpeed reads false as stage 0
        return {}
    if not isinstance(zero, Mapping):
        raise HDETConfigError(f"zero_optimization must be an object such as {{\"stage\": 2}}, got {zero!r} "
                              "(DeepSpeed's older true form is not supported with HDET)")
    return zero


FP16_NAMES = ("torch.float16", "fp16", "float16", "half")
"""How the DeepSpeed JSON may name float16 (DeepSpeed's own spellings)."""


def check_ds_config(ds_config: Mapping[str, Any], world_size: int | None = None) -> None:
    """Raises, naming the setting, for a DeepSpeed JSON HDET cannot run with (offload, hpZ, qgZ, tensor or expert
    parallelism, fp16, node-local or background checkpoint writers) and, with ``world_size``, for batch sizes that
    do not add up over all ranks: before any process group exists."""
    _check_key_spelling(ds_config)
    zero = zero_section(ds_config)
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        raise HDETConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    for section in ("offload_optimizer", "offload_param"):
        device = (zero.get(section) or {}).get("device", "none")
        if str(device).lower() != "none":
            raise HDETConfigError(
                f"zero_optimization.{section}.device={device!r}: HDET averages the ZeRO partitions in place on "
                "the accelerator and does not support offload; remove the offload section or set it to 'none'"
            )
    for legacy, section in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if zero.get(legacy):  # DeepSpeed still reads these older spellings as {section: {"device": "cpu"}}
            raise HDETConfigError(
                f"zero_optimization.{legacy}={zero[legacy]!r} (DeepSpeed's older spelling of {section}.device='cpu'): "
                "HDET averages the ZeRO partitions in place on the accelerator and does not support offload; remove "
                "the setting"
            )
    if int(zero.get("zero_hpz_partition_size", 1)) > 1:
        raise HDETConfigError("zero_optimization.zero_hpz_partition_size > 1 (ZeRO++ hpZ) is not supported with "
                              "HDET: a replica already shards inside its own group; remove the setting")
    if zero.get("zero_quantized_gradients"):
        raise HDETConfigError("zero_optimization.zero_quantized_gradients (ZeRO++ qgZ) is not supported with HDET: "
                              "its all-to-all reduces the gradients over every rank, not inside the replica; remove "
                              "the setting")
    if int((ds_config.get("tensor_parallel") or {}).get("autotp_size", 0) or 0) > 1:
        raise HDETConfigError("tensor_parallel.autotp_size > 1 is not supported with HDET: DeepSpeed's tensor "
                              "parallelism replaces HDET's replica groups, so ZeRO would shard and reduce across "
                              "replicas; remove it")
    if (ds_config.get("expert_parallel") or {}).get("enabled", False):
        raise HDETConfigError("expert_parallel.enabled is not supported with HDET: DeepSpeed's expert parallelism "
                              "builds its own groups across the replicas; remove it")
    checkpoint = ds_config.get("checkpoint") or {}
    if checkpoint.get("use_node_local_storage", False):
        raise HDETConfigError("checkpoint.use_node_local_storage is not supported with HDET: the replicas write one "
                              "checkpoint together (replica 0 the model, the others their own optimizer state beside "
                              "it), which every node must see to resume; remove it and save to a shared file system")
    decoupled = (checkpoint.get("writer") or {}).get("decoupled", False)
    if decoupled or ("datastates_ckpt" in ds_config and ds_config["datastates_ckpt"] is not False):  # DeepSpeed's rule
        where = "checkpoint.writer.decoupled" if decoupled else "datastates_ckpt"
        raise HDETConfigError(f"{where}: HDET puts a checkpoint in place and names it 'latest' once its files are on "
                              "the disk, and this writer writes them later, in the background; remove it")
    autocast = ds_config.get("torch_autocast") or {}
    # torch_autocast without a dtype is torch.autocast's default on a GPU: float16
    if (ds_config.get("fp16") or {}).get("enabled", False) or (
            autocast.get("enabled", False) and str(autocast.get("dtype", "fp16")).lower() in FP16_NAMES):
        where = "fp16.enabled" if (ds_config.get("fp16") or {}).get("enabled", False) else "torch_autocast.dtype"
        raise HDETConfigError(f"{where}: HDET supports fp32 and bf16 (per-replica loss scaling is untested); "
                              "use \"bf16\": {\"enabled\": true}")
    if str(ds_config.get("gradient_allreduce_op", "mean")).lower() == "sum":
        raise HDETConfigError("gradient_allreduce_op=\"sum\": HDET averages the gradients across replicas, so a "
                              "sum inside each replica would leave them a replica count times smaller than plain "
                              "DeepSpeed's sum over every rank; remove it (DeepSpeed's default is the mean)")
    if world_size is not None:
        _check_batch_sizes(ds_config, world_size)


KEYS_HDET_READS = ("zero_optimization", "bf16", "fp16", "optimizer", "scheduler", "train_batch_size",
                   "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping", "checkpoint",
                   "torch_autocast")
"""The DeepSpeed settings whose misspelling ``check_ds_config`` names (DeepSpeed ignores a key it does not know)."""
DEEPSPEED_KEYS_LIKE_THEM = ("bfloat16",)
"""DeepSpeed settings that are close to one of ``KEYS_HDET_READS`` and spelt right (its older name of bf16)."""


def _check_key_spelling(ds_config: Mapping[str, Any]) -> None:
    """Raises where the JSON lacks one of ``KEYS_HDET_READS`` and holds a key spelt almost like it: DeepSpeed would
    ignore that key, and run without the setting (a misspelt zero_optimization: every rank a whole replica)."""
    present = [key for key in ds_config if key not in KEYS_HDET_READS and key not in DEEPSPEED_KEYS_LIKE_THEM]
    for key in KEYS_HDET_READS:
        if key not in ds_config:
            close = difflib.get_close_matches(key, present, n=1, cutoff=0.8)
            if close:
                raise HDETConfigError(f"the DeepSpeed JSON's \"{close[0]}\" is no DeepSpeed setting (DeepSpeed would "
                                      f"ignore it): did you mean \"{key}\"?")


def _check_batch_sizes(ds_config: Mapping[str, Any], world_size: int) -> None:
    """DeepSpeed's rule over all ranks, train_batch_size = micro-batch x accumulation x ranks, in the JSON's own
    numbers (DeepSpeed would check it per replica, in numbers the user never wrote)."""
    sizes = {key: ds_config.get(key) for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                 "gradient_accumulation_steps")}
    auto = [key for key, value in sizes.items() if value == "auto"]
    if auto:  # the Trainer fills them in before deepspeed.initialize, and train.py refuses them in its plan
        raise HDETConfigError(f"{', '.join(auto)} {'is' if len(auto) == 1 else 'are'} \"auto\", which transformers' "
                              "Trainer fills in; deepspeed.initialize takes the JSON as it is: write numbers there")
    if any(value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1)
           for value in sizes.values()):
        return  # bad types are DeepSpeed's to report
    total, micro, accumulation = sizes.values()
    if None not in (total, micro, accumulation) and total != micro * accumulation * world_size:
        raise HDETConfigError(
            f"train_batch_size={total} does not match train_micro_batch_size_per_gpu={micro} x "
            f"gradient_accumulation_steps={accumulation} x {world_size} ranks = {micro * accumulation * world_size}; "
            "set it to that, or leave one of the three out for DeepSpeed to derive")
    known = [value for value in (micro, accumulation) if value is not None]
    if total is not None and not known and total % world_size:
        raise HDETConfigError(f"train_batch_size={total} is not a multiple of the {world_size} ranks: each rank "
                              "takes an equal share of it; give a multiple, or train_micro_batch_size_per_gpu")
    if total is not None and len(known) == 1 and total % (known[0] * world_size):
        raise HDETConfigError(
            f"train_batch_size={total} is not a multiple of {known[0]} x {world_size} ranks "
            f"({'train_micro_batch_size_per_gpu' if micro is not None else 'gradient_accumulation_steps'} x "
            "ranks): DeepSpeed could not derive the other one")


def take_ds_config(args: Any, config: str | Mapping[str, Any] | None) -> tuple[dict[str, Any], Any]:
    """The DeepSpeed config as a private dict, and ``args`` without ``deepspeed_config`` (it is passed on
    as the dict, so DeepSpeed must not read the file a second time)."""
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is not None and config is not None:
        raise ValueError("DeepSpeed config given twice: as args.deepspeed_config and as config; pass one")
    source = config if config is not None else from_args
    if source is None:
        raise ValueError("DeepSpeed needs a config: pass --deepspeed_config PATH or config=dict_or_path")
    if isinstance(source, Mapping):
        values = copy.deepcopy(dict(source))
    else:
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"DeepSpeed config '{path}' does not exist")
        values = json.loads(path.read_text())
    if from_args is not None:
        args = argparse.Namespace(**{**vars(args), "deepspeed_config": None})
    return values, args


def hdet_settings(section: Any, args: Any, explicit: HDETConfig | Mapping[str, Any] | str | None) -> HDETConfig:
    sources = {name: value for name, value in (("the 'hdet' section of the DeepSpeed config", section),
                                                ("args.hdet_config", getattr(args, "hdet_config", None)),
                                                ("hdet_config=", explicit)) if value is not None}
    if len(sources) > 1:
        raise HDETConfigError(f"HDET settings given more than once ({', '.join(sources)}); keep exactly one")
    if not sources:
        return HDETConfig()
    (name, value), = sources.items()
    if name.startswith("the 'hdet'") and not isinstance(value, Mapping):
        raise HDETConfigError(f"the 'hdet' section of the DeepSpeed config must be a JSON object, got {value!r}")
    return load_config(value, world_size=None)


def per_replica_batch(ds_config: dict[str, Any], num_replicas: int) -> dict[str, Any]:
    """A copy of ``ds_config`` whose ``train_batch_size`` (one optimizer step over all ranks) is the batch
    of one replica, DeepSpeed's data-parallel group under HDET."""
    if "train_batch_size" not in ds_config:
        return ds_config
    total = ds_config["train_batch_size"]
    if isinstance(total, bool) or not isinstance(total, int) or total % num_replicas:
        raise HDETConfigError(
            f"train_batch_size={total!r} must be a multiple of the number of replicas ({num_replicas}): it is the "
            "batch of one optimizer step over all ranks, and each replica takes an equal share"
        )
    return {**ds_config, "train_batch_size": total // num_replicas}


def check_version(version: str) -> None:
    """Raises if ``version`` (DeepSpeed's ``__version__``) is outside the range HDET was tested with."""
    low, high = TESTED_DEEPSPEED
    if not low <= Version(version) < high:
        raise RuntimeError(
            f"hdet_scale's DeepSpeed adapter uses ZeRO internals tested with DeepSpeed >={low},<{high}; "
            f"DeepSpeed {version} is installed. Install a tested version: pip install 'deepspeed>={low},<{high}'"
        )
