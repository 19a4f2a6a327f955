"""What ``add_hdet`` checks before a Trainer trains with HDET: the Trainer settings HDET does not support, the
DeepSpeed config it runs with, the replica layout and where checkpoints fall, each refused in one line with the
fix."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hdet_scale.config import HDETConfig, HDETConfigError
from hdet_scale.extras import require
from hdet_scale.topology import check_world_size

require("transformers", "trainer", "hdet_scale.integrations.hf_trainer")
from transformers import Trainer, TrainingArguments  # noqa: E402


def check_trainer(trainer: Trainer, config: HDETConfig) -> str:
    """Which HDET engine ``trainer`` runs on (``"ddp"`` or ``"deepspeed"``); raises HDETConfigError naming the
    Trainer setting HDET does not support, and the fix."""
    args = trainer.args
    if getattr(trainer, "is_fsdp_enabled", False) or args.fsdp or args.fsdp_config and args.fsdp_config.get("xla"):
        raise HDETConfigError(
            f"TrainingArguments(fsdp={args.fsdp!r}): Trainer's FSDP setting is not supported with HDET. Use DDP "
            "or DeepSpeed ZeRO 0-3 with the Trainer, or train with hdet_scale.engines.fsdp (FSDP2 sharded inside "
            "each replica) in your own loop"
        )
    parallelism = getattr(args, "parallelism_config", None)
    if parallelism is not None:
        sizes = {name: getattr(parallelism, name, None) or 1
                 for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")}
        if any(size > 1 for size in sizes.values()):
            used = ", ".join(f"{name}={size}" for name, size in sizes.items() if size > 1)
            raise HDETConfigError(
                f"TrainingArguments(parallelism_config=ParallelismConfig({used})) is not supported with HDET: its "
                "replicas are the data-parallel ranks (DDP) or groups of ZeRO ranks (ranks_per_replica); remove "
                "parallelism_config"
            )
    tensor_parallel = getattr(trainer.model, "tp_size", None) or 1
    if tensor_parallel > 1 or getattr(trainer, "is_distributed_loading_by_transformers", False):
        how = f"tp_size={tensor_parallel}" if tensor_parallel > 1 else "sharded at from_pretrained"
        raise HDETConfigError(
            f"a model loaded sharded by transformers ({how}) is not supported with HDET: the Trainer then wraps it in "
            "no DDP, and HDET's replicas are data-parallel ranks (DDP) or groups of ZeRO ranks; load it whole")
    if getattr(args, "auto_find_batch_size", False):
        raise HDETConfigError("TrainingArguments(auto_find_batch_size=True) is not supported with HDET: each retry "
                              "after an out-of-memory error starts training again on the weights the last one "
                              "left (noised, or moved by the LR range test); set the batch size yourself")
    if args.n_gpu > 1:
        raise HDETConfigError(f"{args.n_gpu} GPUs in one process (nn.DataParallel) is not supported with HDET: "
                              "launch one process per GPU (torchrun, accelerate launch or deepspeed)")
    if getattr(trainer, "is_model_parallel", False):
        raise HDETConfigError("a model spread over several devices (device_map) is not supported with HDET: load "
                              "it on one device per process")
    if (config.explore.label_smoothing is not None and type(trainer).compute_loss is Trainer.compute_loss
            and getattr(trainer, "compute_loss_func", None) is None):
        raise HDETConfigError("explore.label_smoothing is a value your loss reads (hdet.value('label_smoothing')), and "
                              "this Trainer computes its loss itself, which would train every replica at one value: "
                              "override compute_loss (or pass compute_loss_func) to read it, or remove "
                              "explore.label_smoothing")
    engine = "deepspeed" if getattr(trainer, "is_deepspeed_enabled", False) else "ddp"
    if engine == "ddp" and _compiles(trainer) and args.world_size > 1:
        raise HDETConfigError("torch.compile (TrainingArguments(torch_compile=True), or accelerate's "
                              "ACCELERATE_DYNAMO_BACKEND or config) under DDP is not supported with HDET (accelerate "
                              "wraps the DDP model, whose gradient average HDET sets, in a compiled module): set "
                              "torch_compile=False and no dynamo backend in accelerate")
    world = args.world_size
    if engine == "deepspeed":
        _check_deepspeed(trainer, config)
    check_world_size(config, world, auto=_auto_replica_size(trainer, engine))
    check_saving(args, config)
    return engine


def _compiles(trainer: Trainer) -> bool:
    """Whether accelerate compiles the model: ``torch_compile``, or a dynamo backend of accelerate's own setting."""
    if getattr(trainer.args, "torch_compile", False):
        return True
    plugin = getattr(trainer.accelerator.state, "dynamo_plugin", None)
    backend = getattr(plugin, "backend", None)
    return backend is not None and str(getattr(backend, "value", backend)).lower() != "no"


def _auto_replica_size(trainer: Trainer, engine: str) -> str:
    """What ``ranks_per_replica: "auto"`` means: one rank unless ZeRO-1/2/3 shard the model (a node)."""
    if engine != "deepspeed":
        return "rank"
    return "rank" if _zero_stage(_deepspeed_config(trainer)) == 0 else "node"


def _deepspeed_config(trainer: Trainer) -> dict[str, Any]:
    return trainer.accelerator.state.deepspeed_plugin.deepspeed_config


def _zero_stage(ds_config: Mapping[str, Any]) -> int:
    return int((ds_config.get("zero_optimization") or {}).get("stage", 0))


def _check_deepspeed(trainer: Trainer, config: HDETConfig) -> None:
    import deepspeed

    from hdet_scale.engines.deepspeed_settings import check_supported, check_version

    check_version(deepspeed.__version__)
    ds_config = _deepspeed_config(trainer)
    if "hdet" in ds_config:
        raise HDETConfigError("the DeepSpeed config has an 'hdet' section: with the Trainer, pass the HDET settings "
                              "to add_hdet only")
    check_supported(ds_config, trainer.model, zero_init_fix=(
        "transformers builds a model so (from_pretrained, from_config) once a TrainingArguments with a ZeRO-3 config "
        "exists: load the model before creating the TrainingArguments, and HDET shards it inside each replica"))
    zero = ds_config.get("zero_optimization") or {}
    if int(zero.get("stage", 0)) == 3 and not zero.get("stage3_gather_16bit_weights_on_model_save"):
        raise HDETConfigError(
            "ZeRO-3 without zero_optimization.stage3_gather_16bit_weights_on_model_save: trainer.save_model() then "
            "falls back to DeepSpeed's own checkpoint, which every replica writes into the same files; set it to "
            "true, and the model is gathered and written once")


def check_saving(args: TrainingArguments, config: HDETConfig) -> None:
    """Checkpoints must fall on sync points, where every replica holds the same model; raises HDETConfigError
    naming the saving setting and the fix."""
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    if strategy == "no":
        return
    steps = args.save_steps
    if strategy != "steps" or not float(steps).is_integer() or steps < 1 or int(steps) % config.sync_interval:
        raise HDETConfigError(
            f"save_strategy={strategy!r} with save_steps={steps!r}: HDET checkpoints are taken at sync points, "
            f"where the replicas are identical; use save_strategy='steps' with save_steps a multiple of "
            f"sync_interval={config.sync_interval}, or set save_strategy='no'"
        )

