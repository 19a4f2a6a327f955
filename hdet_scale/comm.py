"""Communication: bucketed averaging of local tensors over the cross-replica group, and small gathers.

Averaging packs many local tensors (any floating dtype, any size, empty shards included) into flat
buckets of bounded size in fp32 (fp64 tensors keep fp64), all-reduces each bucket while the next one is
being packed, and writes the mean back in place. Every bucket ends in one extra element, its contributor
count: a member that does not contribute (its replica is non-finite) sends zeros and a count of 0, so the
divisor is known on the device after the all-reduce, with no host synchronization and no second
collective. Everyone, contributor or not, receives the contributors' mean.

The same count rides with gradients (``healthy_mean_``, ``healthy_mean_hook``): a member whose gradient
has a non-finite element contributes nothing to that step's mean, decided on the device, so one diverging
replica never poisons the others in ``global`` gradient mode.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

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


# ------------------------------------------------------------------------------ parameters, at syncs
@dataclass
class _Segment:
    target: torch.Tensor  # flat view of the destination tensor
    target_offset: int
    bucket_offset: int
    numel: int


class _Bucket:
    """``capacity`` payload elements and the contributor count after them."""

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self.data = torch.empty(capacity + 1, dtype=dtype, device=device)
        self.fill = 0
        self.segments: list[_Segment] = []
        self.work: dist.Work | None = None


@torch.no_grad()  # adapters may hand over parameters (or views of them) that require grad
def average_tensors(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, *, bucket_bytes: int,
                    contribute: bool = True, skip_non_finite: bool = False) -> int:
    """Replaces every tensor in place by its mean over the members of ``group`` that contribute; returns the
    bytes all-reduced (payload and counts).

    ``contribute=False`` (this rank's replica is left out) sends zeros. ``skip_non_finite``: a member whose
    part of a bucket holds a non-finite element contributes nothing to that bucket either, decided on the
    device. A bucket nobody contributes to becomes zeros. With ``group`` None (one replica) nothing happens.
    Every member must pass tensors of the same shapes in the same order.
    """
    if group is None:
        return 0
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for tensor in tensors:
        if not tensor.is_contiguous():
            raise ValueError(f"cannot average a non-contiguous tensor of shape {tuple(tensor.shape)} in place")
        by_kind[(_bucket_device(tensor.device, group), reduction_dtype(tensor.dtype))].append(tensor)
    sent = 0
    for (device, dtype), members in by_kind.items():
        sent += _average_kind(members, group, device=device, dtype=dtype, contribute=contribute,
                              skip_non_finite=skip_non_finite, bucket_bytes=bucket_bytes)
    return sent


def _bucket_device(device: torch.device, group: dist.ProcessGroup) -> torch.device:
    """Where a bucket of tensors on ``device`` is all-reduced: their device, but a CUDA device for CPU tensors
    (e.g. offloaded shards) under NCCL, which all-reduces device memory only."""
    if device.type == "cpu" and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _average_kind(tensors: list[torch.Tensor], group: dist.ProcessGroup, *, device: torch.device,
                  dtype: torch.dtype, contribute: bool, skip_non_finite: bool, bucket_bytes: int) -> int:
    total = sum(t.numel() for t in tensors)
    capacity = min(max(1, bucket_bytes // dtype.itemsize - 1), max(total, 1))
    # Up to two buckets: one is packed while the other's all-reduce is in flight.
    buckets = [_Bucket(capacity, dtype, device)]
    current, in_flight, packed, sent = 0, None, 0, 0

    def launch(bucket: _Bucket) -> None:
        nonlocal sent
        payload = bucket.data[: bucket.fill]
        count = bucket.data[bucket.fill: bucket.fill + 1]
        if not contribute:
            payload.zero_()
            count.zero_()
        elif skip_non_finite:
            healthy = all_finite_flag(payload)
            payload.masked_fill_(~healthy, 0.0)
            count.copy_(healthy)
        else:
            count.fill_(1.0)
        message = bucket.data[: bucket.fill + 1]
        bucket.work = dist.all_reduce(message, op=dist.ReduceOp.SUM, group=group, async_op=True)
        sent += message.numel() * dtype.itemsize

    def finish(bucket: _Bucket) -> None:
        bucket.work.wait()
        divisor = bucket.data[bucket.fill].clamp(min=1)
        for seg in bucket.segments:  # divide while unpacking: one pass, the cast to the tensor's dtype included
            torch.div(bucket.data[seg.bucket_offset: seg.bucket_offset + seg.numel], divisor,
                      out=seg.target[seg.target_offset: seg.target_offset + seg.numel])
        bucket.fill, bucket.segments, bucket.work = 0, [], None

    for tensor in tensors:
        flat, offset = tensor.view(-1), 0
        while offset < flat.numel():
            bucket = buckets[current]
            count = min(flat.numel() - offset, capacity - bucket.fill)
            if contribute:
                bucket.data[bucket.fill: bucket.fill + count].copy_(flat[offset: offset + count])
            bucket.segments.append(_Segment(flat, offset, bucket.fill, count))
            bucket.fill += count
            offset += count
            packed += count
            if bucket.fill == capacity:
                launch(bucket)
                if in_flight is not None:
                    finish(in_flight)
                in_flight = bucket
                if packed < total:
                    if len(buckets) == 1:
                        buckets.append(_Bucket(capacity, dtype, device))
                    current = 1 - current
    last = buckets[current]
    if last.fill and last.work is None:  # a partly filled bucket (a full one is already in flight)
        launch(last)
    if in_flight is not None and in_flight is not last:
        finish(in_flight)
    if last.work is not None:
        finish(last)
    return sent


@torch.no_grad()
def broadcast_from_rank0(module: torch.nn.Module) -> None:
    """Overwrites every parameter and buffer of ``module`` with global rank 0's, so all replicas start alike."""
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=0)


def gather_rows(row: Sequence[float], *, world_size: int) -> torch.Tensor:
    """All ranks' ``row`` values as a (world_size, len(row)) float64 CPU tensor (one small all-reduce)."""
    if world_size == 1 or not dist.is_initialized():
        return torch.tensor([list(row)], dtype=torch.float64)
    device = collective_device()
    table = torch.zeros(world_size, len(row), dtype=torch.float64, device=device)
    table[dist.get_rank()] = torch.tensor(list(row), dtype=torch.float64, device=device)
    dist.all_reduce(table, op=dist.ReduceOp.SUM)
    return table.cpu()
