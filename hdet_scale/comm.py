"""Communication: replica-safe gradient means, small gathers and finiteness checks.

In ``global`` gradient mode a contributor count rides with every cross-replica gradient all-reduce
(``healthy_mean_``, ``healthy_mean_hook``): a member whose gradient has a non-finite element contributes
nothing to that step's mean, decided on the device with no host synchronization and no extra collective, so
one diverging replica never poisons the others. The sync's bucketed averaging is ``hdet_scale.averaging``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from hdet_scale.topology import collective_device


def reduction_dtype(dtype: torch.dtype) -> torch.dtype:
    """The bucket dtype for a tensor dtype: fp32, or fp64 for fp64 tensors (never lose precision)."""
    if not dtype.is_floating_point:
        raise TypeError(f"HDET averages floating-point tensors only, got {dtype}")
    return torch.float64 if dtype == torch.float64 else torch.float32


def all_finite_flag(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on ``tensor``'s device: every element is finite (no host synchronization).

    A tensor's min and max are finite exactly when all of it is: aminmax reads it once with no full-size
    temporary (``isfinite`` makes one), and a sum or norm would overflow on large but finite values."""
    if not tensor.numel():
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    return torch.isfinite(torch.stack(torch.aminmax(tensor.reshape(-1)))).all()


# ------------------------------------------------------------------------------ gradients, every step
def _count_dtype(dtype: torch.dtype, group_size: int) -> torch.dtype:
    """``dtype`` if it counts up to ``group_size`` exactly (bf16: 256 members, fp16: 2048), else fp32."""
    exact = round(2 / torch.finfo(dtype).eps)  # 2 ** (mantissa bits + 1)
    return dtype if group_size <= exact else torch.float32


def pack_healthy(tensor: torch.Tensor, group_size: int) -> torch.Tensor:
    """A flat buffer of ``tensor / group_size`` (zeros where any element of ``tensor`` is non-finite) and one
    last element, the contributor count: 1, or 0 for a non-finite ``tensor``. Pre-dividing like DDP's own
    hook keeps low-precision sums in range and makes a mean over healthy members bit-exact with it."""
    flat = tensor.reshape(-1)
    packed = torch.empty(flat.numel() + 1, dtype=_count_dtype(tensor.dtype, group_size), device=tensor.device)
    healthy = all_finite_flag(flat)
    payload = packed[:-1]
    torch.div(flat, group_size, out=payload)
    payload.masked_fill_(~healthy, 0.0)
    packed[-1].copy_(healthy)
    return packed


def unpack_healthy_mean(packed: torch.Tensor, out: torch.Tensor, group_size: int) -> torch.Tensor:
    """Writes the contributors' mean of an all-reduced ``pack_healthy`` buffer into ``out`` (zeros when
    nobody contributed); returns ``out``."""
    count = packed[-1:].clamp(min=1)
    rescale = torch.full_like(count, float(group_size)).div_(count)  # exactly 1 when every member contributed
    torch.mul(packed[:-1], rescale, out=out.view(-1))
    return out


def healthy_mean_(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> int:
    """Replaces ``tensor`` in place by the mean over the members of ``group`` whose ``tensor`` is all finite
    (collective; one all-reduce, no host synchronization); returns the bytes all-reduced."""
    if group is None:
        return 0
    size = dist.get_world_size(group)
    packed = pack_healthy(tensor, size)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    unpack_healthy_mean(packed, tensor, size)
    return packed.numel() * packed.element_size()


def healthy_mean_hook(group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future:
    """A DDP communication hook (``ddp.register_comm_hook(group, healthy_mean_hook)``): each gradient bucket
    becomes the mean over the ranks of ``group`` (None: all) whose bucket is all finite."""
    buffer = bucket.buffer()
    size = dist.get_world_size(group)
    packed = pack_healthy(buffer, size)
    future = dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group, async_op=True).get_future()
    return future.then(lambda _: unpack_healthy_mean(packed, buffer, size))


# DDP checks a hook's annotations against the real classes, and this module's are strings (future annotations).
healthy_mean_hook.__annotations__.update(bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]})


@torch.no_grad()
def broadcast_from_rank0(module: torch.nn.Module) -> None:
    """Overwrites every parameter and buffer of ``module`` with global rank 0's, so all replicas start alike."""
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=0)


def start_gather_rows(row: Sequence[float], *, world_size: int) -> tuple[torch.Tensor, dist.Work | None]:
    """Starts gathering every rank's ``row`` into a (world_size, len(row)) float64 table (one small all-reduce:
    each rank fills its own row of zeros); the table holds it once the returned work (None: nothing to wait
    for) has finished."""
    if world_size == 1 or not dist.is_initialized():
        return torch.tensor([list(row)], dtype=torch.float64), None
    device = collective_device()
    table = torch.zeros(world_size, len(row), dtype=torch.float64, device=device)
    table[dist.get_rank()] = torch.tensor(list(row), dtype=torch.float64, device=device)
    return table, dist.all_reduce(table, op=dist.ReduceOp.SUM, async_op=True)


def gather_rows(row: Sequence[float], *, world_size: int) -> torch.Tensor:
    """All ranks' ``row`` values as a (world_size, len(row)) float64 CPU tensor (one small all-reduce)."""
    table, work = start_gather_rows(row, world_size=world_size)
    if work is not None:
        work.wait()
    return table.cpu()


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """True when every element of every tensor is finite (one host synchronization per device)."""
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        flags.setdefault(tensor.device, []).append(all_finite_flag(tensor))
    return all(bool(torch.stack(values).all()) for values in flags.values())
