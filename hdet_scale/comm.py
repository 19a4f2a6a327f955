"""Communication: bucketed averaging of local tensors over the cross-replica group, and small gathers.

Averaging packs many local tensors (any floating dtype, any size, empty shards included) into flat
buckets of bounded size in fp32 (fp64 tensors keep fp64), all-reduces each bucket while the next one is
being packed, and writes the mean back in place. A replica whose values are non-finite contributes
zeros and is left out of the divisor, then receives the mean like everyone else.
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


@dataclass
class _Segment:
    target: torch.Tensor  # flat view of the destination tensor
    target_offset: int
    bucket_offset: int
    numel: int


class _Bucket:
    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self.data = torch.empty(capacity, dtype=dtype, device=device)
        self.fill = 0
        self.segments: list[_Segment] = []
        self.work: dist.Work | None = None


@torch.no_grad()  # adapters may hand over parameters (or views of them) that require grad
def average_tensors(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, *,
                    contribute: bool, num_contributors: int, bucket_bytes: int) -> int:
    """Replaces every tensor in place by its mean over ``group``; returns the payload bytes all-reduced.

    ``contribute=False`` (this rank's replica is non-finite) sends zeros; ``num_contributors`` is how many
    members of ``group`` contribute. With ``group`` None (one replica) nothing happens. Every member must
    pass tensors of the same shapes in the same order.
    """
    if group is None:
        return 0
    if num_contributors < 1:
        raise ValueError("no replica has finite values to average")
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for tensor in tensors:
        if not tensor.is_contiguous():
            raise ValueError(f"cannot average a non-contiguous tensor of shape {tuple(tensor.shape)} in place")
        by_kind[(tensor.device, reduction_dtype(tensor.dtype))].append(tensor)
    sent = 0
    for (device, dtype), members in by_kind.items():
        sent += _average_kind(members, group, device=device, dtype=dtype, contribute=contribute,
                              num_contributors=num_contributors, bucket_bytes=bucket_bytes)
    return sent


def _average_kind(tensors: list[torch.Tensor], group: dist.ProcessGroup, *, device: torch.device,
                  dtype: torch.dtype, contribute: bool, num_contributors: int, bucket_bytes: int) -> int:
    total = sum(t.numel() for t in tensors)
    capacity = min(max(1, bucket_bytes // dtype.itemsize), max(total, 1))
    # Up to two buckets: one is packed while the other's all-reduce is in flight.
    buckets = [_Bucket(capacity, dtype, device)]
    current, in_flight, packed, sent = 0, None, 0, 0

    def launch(bucket: _Bucket) -> None:
        nonlocal sent
        payload = bucket.data[: bucket.fill]
        if not contribute:
            payload.zero_()
        bucket.work = dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=group, async_op=True)
        sent += bucket.fill * dtype.itemsize

    def finish(bucket: _Bucket) -> None:
        bucket.work.wait()
        for seg in bucket.segments:  # divide while unpacking: one pass, the cast to the tensor's dtype included
            torch.div(bucket.data[seg.bucket_offset: seg.bucket_offset + seg.numel], num_contributors,
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
