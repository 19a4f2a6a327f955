"""DeepSpeed ZeRO 0-3 internals HDET relies on: the replica model-parallel unit and the state adapter.

DeepSpeed has no hybrid sharding, so HDET gives ``deepspeed.initialize`` a model-parallel unit (``mpu``)
whose data-parallel group is the replica: ZeRO then shards and reduces inside a replica only, and HDET
averages the fp32 master partitions across replicas at syncs. Where each ZeRO flavour keeps its fp32
master, its reduced gradients and its low-precision copies differs; ``ZeroAdapter`` answers those questions
for each optimizer DeepSpeed builds. These are DeepSpeed internals: ``check_internals`` fails fast, naming
the installed version, when one is missing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hdet_scale.adapter import AveragedBuffers, EngineAdapter, ParameterShard, floating_state, optimizer_parameters
from hdet_scale.engines.deepspeed_settings import TESTED_DEEPSPEED
from hdet_scale.topology import ReplicaTopology, built_once


class ReplicaMPU:
    """The model-parallel unit that makes a DeepSpeed data-parallel group out of one replica.

    ZeRO all-reduces gradient norms and overflow flags over the model-parallel group, so that group must be
    this rank alone; the data-parallel group is the replica's ranks.
    """

    def __init__(self, topology: ReplicaTopology) -> None:
        if topology.intra_replica_group is None:
            raise ValueError("ReplicaMPU needs a topology built over an initialized process group")
        self._topology = topology
        self._model_parallel_group = built_once(
            "rank alone", lambda: dist.new_subgroups_by_enumeration([[r] for r in range(topology.world_size)])[0])

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self._topology.intra_replica_group

    def get_data_parallel_world_size(self) -> int:
        return self._topology.ranks_per_replica

    def get_data_parallel_rank(self) -> int:
        return self._topology.position

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self._topology.replica_ranks(self._topology.replica_index)

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self._model_parallel_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_src_rank(self) -> int:
        return self._topology.rank

    # Universal checkpoints and newer DeepSpeed code ask for the tensor-parallel names.
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_src_rank = get_model_parallel_src_rank


class ZeroAdapter(EngineAdapter):
    """Where a DeepSpeed engine keeps the state HDET averages, whatever the ZeRO stage and precision.

    Args:
        engine: the ``DeepSpeedEngine`` built with a ``ReplicaMPU``.
    """

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._wrapper = engine.optimizer
        self._kind = _optimizer_kind(engine)
        check_internals(engine, self._kind)
        self._value_ranges: list[list[tuple[int, int]]] | None = None
        self.averaged_buffers = AveragedBuffers(engine.module)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._engine.basic_optimizer

    @property
    def module(self) -> nn.Module:
        return self._engine.module

    def averaged_tensors(self) -> list[torch.Tensor]:
        return self._real_elements(self.master_tensors()) + self.averaged_buffers()

    def master_tensors(self) -> list[torch.Tensor]:
        """This rank's fp32 master copy of its shard (the full parameters when nothing is partitioned), as the
        optimizer holds it: ZeRO-3's flat partitions include the padding of each parameter's last partition."""
        wrapper = self._wrapper
        if self._kind == "torch":
            return [param.data for param in optimizer_parameters(wrapper)]
        if self._kind == "fp16_optimizer":
            return list(wrapper.fp32_groups_flat)
        if self._kind == "fp16_unfused_optimizer":
            return [master for group in wrapper.fp32_groups for master in group]
        if self._kind == "bf16_optimizer":
            return list(wrapper.fp32_groups_flat_partition)
        if self._kind == "zero12":
            return list(wrapper.single_partition_of_fp32_groups)
        return list(wrapper.fp32_partitioned_groups_flat)

    @property
    def shards_parameters(self) -> bool:
        return self._kind in ("bf16_optimizer", "zero12", "zero3")

    def peak_lrs(self) -> list[float]:
        """Each param group's peak LR as the engine's scheduler gives it: DeepSpeed's ``WarmupLR``,
        ``WarmupDecayLR`` and ``OneCycle`` keep it as ``max_lrs``, ``WarmupCosineLR`` as ``org_lrs``; torch's
        schedulers and none as ``EngineAdapter.peak_lrs`` reads them."""
        scheduler = self._engine.lr_scheduler
        for name in ("max_lrs", "org_lrs"):
            peaks = getattr(scheduler, name, None)
            if isinstance(peaks, (list, tuple)) and len(peaks) == len(self.optimizer.param_groups):
                return [float(peak) for peak in peaks]
        return super().peak_lrs()

    def warm_init_shards(self) -> list[ParameterShard]:
        """The module's trained parameters in module order (the same for every ZeRO stage and replica size),
        each as this rank's fp32 master values of it."""
        wrapper = self._wrapper
        trained = {id(param) for group in self._trained_groups() for param in group}
        params = [param for param in self.module.parameters() if id(param) in trained]
        if self._kind in ("bf16_optimizer", "zero12"):
            return [_fragment_shard(param) for param in params]
        if self._kind == "zero3":
            return [_partition_shard(param, wrapper.dp_process_group) for param in params]
        masters = self.whole_masters()
        return [ParameterShard(param.shape, masters[id(param)]) for param in params]

    def whole_masters(self) -> dict[int, torch.Tensor]:
        """Where nothing is partitioned (ZeRO-0): each trained parameter's fp32 master, shaped like it, by the
        ``id`` of the module parameter (DeepSpeed's public ``safe_get_full_fp32_param`` finds none there). Empty
        on the stages that partition."""
        wrapper = self._wrapper
        if self._kind == "fp16_unfused_optimizer":
            return {id(low): master.data for lows, fp32s in zip(wrapper.fp16_groups, wrapper.fp32_groups, strict=True)
                    for low, master in zip(lows, fp32s, strict=True)}
        if self._kind == "fp16_optimizer":
            # One flat fp32 master per group, laid out like the group's parameters: views of it per parameter.
            return {id(low): master for lows, flat in zip(wrapper.fp16_groups, wrapper.fp32_groups_flat, strict=True)
                    for low, master in zip(lows, _views_like(flat, lows), strict=True)}
        if self._kind == "torch":  # the parameters are the masters
            return {id(param): param.data for param in optimizer_parameters(wrapper)}
        return {}

    def _trained_groups(self) -> list[list[nn.Parameter]]:
        """The module parameters the optimizer trains, per param group (ZeRO-3: per sub-group)."""
        wrapper = self._wrapper
        if self._kind == "torch":
            return [group["params"] for group in wrapper.param_groups]
        if self._kind == "bf16_optimizer":
            return wrapper.bf16_groups
        if self._kind == "zero12":
            return wrapper.bit16_groups
        return wrapper.fp16_groups  # DeepSpeed's fp16 wrappers and ZeRO-3

    def gradient_tensors(self) -> list[torch.Tensor]:
        """This rank's gradients after ZeRO reduced them inside the replica, before clipping and the step."""
        wrapper = self._wrapper
        if self._kind in ("torch", "fp16_optimizer", "fp16_unfused_optimizer"):
            return [param.grad for param in self.module.parameters() if param.grad is not None]
        if self._kind == "bf16_optimizer":
            # DeepSpeed all-reduces this optimizer's whole fp32 gradient buffer inside the replica and takes the
            # norm over all of it, so all of it (not just this rank's partition) is averaged across replicas.
            return list(wrapper.fp32_groups_gradients_flat)
        if self._kind == "zero12":
            tensors = []
            # By group index: DeepSpeed fills this dict in the order the backward first reached each group.
            for grads in (wrapper.averaged_gradients.get(index) for index in range(len(wrapper.bit16_groups))):
                # With low-precision gradients accumulated in fp32, DeepSpeed lays each group's partition out in
                # one flat buffer of fixed layout (padding zeroed): averaged whole, in place from a bucket's size
                # on, with no copy. Elsewhere the views' storage follows the order the backward reached them, which
                # may differ between replicas, so they are averaged one by one.
                flat = getattr(grads, "flat_partition", None)
                tensors += [flat] if flat is not None else list(grads or [])
            return tensors
        return [wrapper.grad_partitions_flat_buffer]

    def _state_moments(self) -> list[tuple[int, list[torch.Tensor]]]:
        state = self.optimizer.state
        # The optimizer's state is keyed by its parameters: a torch optimizer's are the module's own, whose
        # ``.data`` (what master_tensors gives) is another tensor object.
        keys = optimizer_parameters(self._wrapper) if self._kind == "torch" else self.master_tensors()
        return [(index, self._real_elements(floating_state(state.get(master, {})), sub_group=index))
                for index, master in enumerate(keys)]

    def _real_elements(self, flats: list[torch.Tensor], sub_group: int | None = None) -> list[torch.Tensor]:
        """ZeRO-3: views of the elements of ``flats`` that hold parameter values, leaving out the padding of each
        parameter's last partition, which DeepSpeed allocates uninitialized (garbage, maybe NaN, that must be
        neither averaged nor checked). ``flats`` are every sub-group's flat partition, or tensors laid out like
        sub-group ``sub_group``'s. Other stages: ``flats`` as they are."""
        if self._kind != "zero3":
            return flats
        if self._value_ranges is None:
            self._value_ranges = self._zero3_value_ranges()
        groups = range(len(flats)) if sub_group is None else [sub_group] * len(flats)
        return [flat.narrow(0, start, count) for flat, group in zip(flats, groups, strict=True)
                for start, count in self._value_ranges[group]]

    def _zero3_value_ranges(self) -> list[list[tuple[int, int]]]:
        """Per ZeRO-3 sub-group: the (start, count) ranges of this rank's flat partition that hold parameter
        values, adjacent ranges merged (one range where no parameter of the sub-group is padded here)."""
        ranges = []
        for params in self._wrapper.fp16_groups:
            merged: list[tuple[int, int]] = []
            offset = 0
            for param in params:
                size = param.partition_numel()
                held = min(max(param.ds_numel - dist.get_rank(group=param.ds_process_group) * size, 0), size)
                if held and merged and sum(merged[-1]) == offset:
                    merged[-1] = (merged[-1][0], merged[-1][1] + held)
                elif held:
                    merged.append((offset, held))
                offset += size
            ranges.append(merged)
        return ranges

    @torch.no_grad()
    def after_average(self) -> None:
        wrapper = self._wrapper
        if self._kind == "fp16_optimizer":
            for low, master in zip(wrapper.fp16_groups_flat, wrapper.fp32_groups_flat, strict=True):
                low.copy_(master)
        elif self._kind == "fp16_unfused_optimizer":
            for lows, masters in zip(wrapper.fp16_groups, wrapper.fp32_groups, strict=True):
                for low, master in zip(lows, masters, strict=True):
                    low.data.copy_(master.data)
        elif self._kind in ("bf16_optimizer", "zero12"):
            wrapper.update_lp_params()
        elif self._kind == "zero3":
            # As ZeRO-3's own step does: release every gathered parameter (persistent ones too, which stay
            # gathered between steps and would keep their old values), write the averaged partitions into the
            # low-precision shards, gather the persistent parameters again and drop the secondary (hpZ) copies.
            wrapper._partition_all_parameters()
            for sub_group in range(len(wrapper.fp16_groups)):
                wrapper._reassign_or_swap_out_partitioned_parameters(sub_group)
            if wrapper.persistent_parameters:
                wrapper.persistent_parameters[0].all_gather(wrapper.persistent_parameters)
            wrapper.invalidate_secondary_tensor()


class SaveEpilogue:
    """The collective ZeRO-3's save ends with, after its last write (``checkpoint_event_epilogue``: an all-gather
    of the persistent parameters inside the replica), watched during ``engine.save_checkpoint``. A rank whose write
    failed skips it, and its replica's peers would wait there until the process group's timeout:
    ``meet_after_failure`` has that rank join it, where it has not run yet, before the save's closing barrier."""

    def __init__(self, engine: Any) -> None:
        self._optimizer = engine.optimizer
        self._epilogue = getattr(self._optimizer, "checkpoint_event_epilogue", None)  # ZeRO-3's optimizer only
        self._ran = False

    def __enter__(self) -> SaveEpilogue:
        if self._epilogue is not None:
            self._optimizer.checkpoint_event_epilogue = self._run
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._epilogue is not None:
            del self._optimizer.checkpoint_event_epilogue  # the class's own again

    def _run(self) -> None:
        self._ran = True
        self._epilogue()

    def meet_after_failure(self) -> None:
        """Joins the epilogue's collective where the save failed before it (a no-op for ZeRO-0/1/2)."""
        if self._epilogue is not None and not self._ran:
            self._run()


def _fragment_shard(param: nn.Parameter) -> ParameterShard:
    """ZeRO-1/2 and BF16_Optimizer: the fp32 fragment of ``param`` in this rank's partition, a contiguous
    range of the flattened parameter (what ``deepspeed.utils.safe_set_full_fp32_param`` writes)."""
    mapping = param._hp_mapping
    if mapping is None:  # none of this parameter is in this rank's partition
        return ParameterShard(param.shape, torch.empty(0, device=param.device))
    return ParameterShard(param.shape, mapping.get_hp_fragment(), mapping.lp_fragment_address.start)


def _partition_shard(param: nn.Parameter, data_parallel_group: dist.ProcessGroup) -> ParameterShard:
    """ZeRO-3: this rank's fp32 partition of ``param`` without the padding of the last partition.

    ``safe_set_full_fp32_param`` cannot write it: it slices the full value by the padded partition size, out
    of range on the last rank whenever the size does not divide the parameter.
    """
    from deepspeed.utils import safe_get_local_fp32_param

    # A view of the fp32 partition (the ``.to(device)`` inside is a no-op without offload, which HDET refuses).
    partition = safe_get_local_fp32_param(param)
    start = dist.get_rank(group=getattr(param, "ds_process_group", data_parallel_group)) * partition.numel()
    held = min(max(param.ds_numel - start, 0), partition.numel())
    return ParameterShard(param.ds_shape, partition.narrow(0, 0, held), min(start, param.ds_numel))


def _views_like(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of consecutive ranges of ``flat`` shaped like ``tensors`` (how a flattened group is laid out)."""
    views, offset = [], 0
    for tensor in tensors:
        views.append(flat.narrow(0, offset, tensor.numel()).view_as(tensor))
        offset += tensor.numel()
    return views


def _optimizer_kind(engine: Any) -> str:
    """Which of DeepSpeed's optimizer wrappers the engine built (they keep their masters in different places)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    wrapper = engine.optimizer
    if isinstance(wrapper, DeepSpeedZeroOptimizer_Stage3):
        return "zero3"
    if isinstance(wrapper, DeepSpeedZeroOptimizer):
        return "zero12"
    if isinstance(wrapper, BF16_Optimizer):
        return "bf16_optimizer"
    if isinstance(wrapper, FP16_Optimizer):
        return "fp16_optimizer"
    if isinstance(wrapper, FP16_UnfusedOptimizer):  # ZeRO-0 bf16 with a torch optimizer
        return "fp16_unfused_optimizer"
    if isinstance(wrapper, torch.optim.Optimizer):
        return "torch"
    raise ValueError(f"HDET does not support DeepSpeed's {type(wrapper).__name__} optimizer wrapper; use ZeRO "
                     "stage 0-3 in fp32 or bf16 without offload")


_INTERNALS: dict[str, tuple[str, ...]] = {
    "torch": (),
    "fp16_optimizer": ("fp16_groups", "fp16_groups_flat", "fp32_groups_flat"),
    "fp16_unfused_optimizer": ("fp16_groups", "fp32_groups"),
    "bf16_optimizer": ("bf16_groups", "fp32_groups_flat_partition", "fp32_groups_gradients_flat", "update_lp_params"),
    "zero12": ("bit16_groups", "single_partition_of_fp32_groups", "averaged_gradients", "update_lp_params"),
    "zero3": ("fp32_partitioned_groups_flat", "grad_partitions_flat_buffer", "fp16_groups", "_partition_all_parameters",
              "_reassign_or_swap_out_partitioned_parameters", "persistent_parameters", "invalidate_secondary_tensor",
              "dp_process_group"),
}
_ENGINE_INTERNALS = ("basic_optimizer", "mpu", "_take_model_step", "save_non_zero_checkpoint",
                     "_get_rank_zero_ckpt_name", "_get_ckpt_name", "zero_optimization")


def check_internals(engine: Any, kind: str) -> None:
    """Raises, naming the DeepSpeed version, if an internal attribute HDET uses is missing."""
    import deepspeed

    missing = [f"engine.{name}" for name in _ENGINE_INTERNALS if not hasattr(engine, name)]
    missing += [f"{type(engine.optimizer).__name__}.{name}" for name in _INTERNALS[kind]
                if not hasattr(engine.optimizer, name)]
    if missing:
        low, high = TESTED_DEEPSPEED
        raise RuntimeError(
            f"DeepSpeed {deepspeed.__version__} lacks internals HDET uses ({', '.join(missing)}); install a "
            f"tested version: pip install 'deepspeed>={low},<{high}'"
        )
