"""Bucketed averaging of a rank's local tensors over its cross-replica group, in as few collectives as can be.

A sync averages many tensors of any floating dtype and size (empty shards included). Small ones are packed
into flat buckets of bounded size in fp32 (fp64 tensors keep fp64), each all-reduced while the next is packed,
and the mean is written back in place while unpacking. Large fp32/fp64 tensors (ZeRO-1/2's flat partitions)
are all-reduced in place, with no copy at all. Packing, the finiteness check and unpacking each touch all of a
bucket's tensors in one fused (``torch._foreach_*``) call: a model has hundreds of tensors, and one kernel
launch per tensor and pass made the sync's local work on a GPU cost as much as its transfer.

Whether a rank contributes is a flag on the device (its replica may be non-finite): a rank that does not
contributes zeros, and the number of contributors rides as one extra element of the first bucket, so the
divisor is known on the device after the all-reduce: no host synchronization and no extra collective. A
``rider`` (e.g. every rank's row of the sync's score table, zeros elsewhere) rides in the same first bucket:
sums with one non-zero term per element are exact, so this gathers it. After the first bucket and before any
tensor is written, ``check`` sees the summed rider and may stop the average (nobody healthy), leaving every
tensor as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hdet_scale.adapter import EngineAdapter
from hdet_scale.comm import all_finite_on, first_accelerator, reduction_dtype, start_gather_rows, zero_unless
from hdet_scale.scores import ReplicaScores
from hdet_scale.topology import ReplicaTopology, collective_device

logger = logging.getLogger(__name__)

Check = Callable[[torch.Tensor | None], None]


@torch.no_grad()  # adapters may hand over parameters (or views of them) that require grad
def average_tensors(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, *, bucket_bytes: int,
                    contribute: bool | torch.Tensor = True, skip_non_finite: bool = False,
                    nan_if_none: bool | None = None, rider: torch.Tensor | None = None, check: Check | None = None,
                    memory: list[torch.Tensor] | None = None) -> int:
    """Replaces every tensor in place by its mean over the members of ``group`` that contribute; returns the
    bytes all-reduced (the tensors' and the contributor count, not the rider's).

    ``contribute``: whether this member contributes (a bool, or a 0-dim bool tensor decided on the device);
    one that does not sends zeros and receives the others' mean. ``skip_non_finite``: a member whose tensors
    hold a non-finite element does not contribute either. If nobody contributes every tensor becomes zeros, or NaN
    with ``nan_if_none`` (default: ``skip_non_finite``; no member finite: what a plain mean would give, so the failure
    shows; a ``check`` can refuse either first). ``rider``: a float64 tensor summed over ``group`` with the first
    bucket, in place. ``check(rider)``: called after the first bucket, before any tensor is written; raising
    there stops the average with every tensor unchanged. With ``group`` None (one replica) nothing is sent and
    ``check`` sees the rider as it is. ``memory``: a list the caller keeps between calls, holding the buckets
    for the next call (a fresh multi-MB bucket per call costs page faults on the CPU). Every member must pass
    tensors of the same shapes in the same order.
    """
    if group is None:
        if check is not None:
            check(rider)
        return 0
    tensors = [_flat_view(tensor) for tensor in tensors]
    for tensor in tensors:
        reduction_dtype(tensor.dtype)  # floating point only
    device = _bucket_device([t.device for t in tensors], group)
    flag = torch.as_tensor(contribute, dtype=torch.bool).to(device)
    if skip_non_finite:
        flag = flag & all_finite_on(tensors, device)
    known = contribute if isinstance(contribute, bool) and not skip_non_finite else None
    nan_if_none = skip_non_finite if nan_if_none is None else nan_if_none
    return _Averager(group, device, bucket_bytes, flag, known, memory, nan_if_none=nan_if_none).run(
        tensors, rider, check)


def average_replica_gradients(tensors: Sequence[torch.Tensor], topology: ReplicaTopology, *, bucket_bytes: int,
                              memory: list[torch.Tensor] | None = None) -> int:
    """``global`` gradient mode on sharded replicas: replaces this rank's gradient shards by their mean over the
    replicas whose every rank's shards are all finite; returns the bytes all-reduced (collective: every rank
    calls it). A replica judged rank by rank would give its finite shards to the mean while its non-finite ones
    were left out: a step on a mix of a diverging replica's gradients and the others'. Where no replica is finite
    the mean is NaN, so the engine's overflow check skips the step. No host synchronization."""
    if topology.cross_replica_group is None:
        return 0
    if topology.ranks_per_replica == 1:  # the rank is the replica
        return average_tensors(tensors, topology.cross_replica_group, skip_non_finite=True,
                               bucket_bytes=bucket_bytes, memory=memory)
    device = _bucket_device([t.device for t in tensors], topology.cross_replica_group)
    finite = all_finite_on(tensors, device).to(torch.int32)
    dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=topology.intra_replica_group)
    return average_tensors(tensors, topology.cross_replica_group, contribute=finite.bool(), nan_if_none=True,
                           bucket_bytes=bucket_bytes, memory=memory)


def _bucket_device(devices: list[torch.device], group: dist.ProcessGroup) -> torch.device:
    """Where the buckets live: the tensors' accelerator if any, else the device ``group``'s collectives need (the
    GPU for CPU tensors, e.g. offloaded shards, under NCCL, which all-reduces device memory only)."""
    return first_accelerator(devices) or collective_device(group)


@dataclass
class _Segment:
    target: torch.Tensor  # flat view of the destination tensor
    target_offset: int
    bucket_offset: int
    numel: int


@dataclass
class _Bucket:
    data: torch.Tensor
    fill: int = 0
    segments: list[_Segment] = field(default_factory=list)
    work: dist.Work | None = None
    has_count: bool = False

    def views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each segment's part of the bucket and of its tensor."""
        return ([self.data[seg.bucket_offset: seg.bucket_offset + seg.numel] for seg in self.segments],
                [seg.target[seg.target_offset: seg.target_offset + seg.numel] for seg in self.segments])


class _Averager:
    """One ``average_tensors`` call: the first bucket (rider, payload, count), then everything else, with at
    most two buckets alive (one in flight while the next is packed) and their memory reused."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, bucket_bytes: int, flag: torch.Tensor,
                 known: bool | None, memory: list[torch.Tensor] | None, *, nan_if_none: bool) -> None:
        self.group = group
        self.device = device
        self.bucket_bytes = bucket_bytes
        self.flag = flag
        self.known = known  # the flag, where the host knows it: then contributors need no masking pass
        self.count: torch.Tensor | None = None  # contributors, from the first bucket (clamped to >= 1 unless NaN)
        self.nan_if_none = nan_if_none  # nobody contributed: zeros divided by a count of 0
        self.sent = 0
        self.in_flight: list[_Bucket] = []
        self.in_place_works: list[tuple[torch.Tensor, dist.Work]] = []
        self.free = memory if memory is not None else []  # buckets to reuse; left holding the last two

    def run(self, tensors: Sequence[torch.Tensor], rider: torch.Tensor | None, check: Check | None) -> int:
        in_place = [t for t in tensors if t.device == self.device and t.dtype in (torch.float32, torch.float64)
                    and t.numel() * t.element_size() >= self.bucket_bytes]
        kinds: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in tensors:
            if not any(tensor is other for other in in_place):
                kinds.setdefault(reduction_dtype(tensor.dtype), []).append(tensor)
        if check is None:  # nothing to wait for: the large tensors go at once
            self._send_in_place(in_place)
        for bucket in self._buckets(kinds, rider):
            self._launch(bucket)
            self.in_flight.append(bucket)
            if len(self.in_flight) == 2:
                self._finish_oldest(rider, check, in_place)
        while self.in_flight:
            self._finish_oldest(rider, check, in_place)
        for tensor, work in self.in_place_works:
            work.wait()
            tensor.div_(self.count)
        return self.sent

    def _finish_oldest(self, rider: torch.Tensor | None, check: Check | None, in_place: list[torch.Tensor]) -> None:
        bucket = self.in_flight[0]
        bucket.work.wait()
        if bucket.has_count:  # the first bucket: read it before anything is written
            count = bucket.data[bucket.fill - 1]  # a copy below: the bucket it sits in is divided by it
            self.count = count.clone() if self.nan_if_none else count.clamp(min=1)
            if rider is not None:
                size = _encoded_size(rider, bucket.data.dtype)
                rider.copy_(_decode(bucket.data[:size], bucket.data.dtype, rider))
            if check is not None:
                try:
                    check(rider)
                except BaseException:
                    for other in self.in_flight[1:]:  # leave no collective behind
                        other.work.wait()
                    raise
                self._send_in_place(in_place)
        self.in_flight.pop(0)
        if bucket.segments:  # the payload is contiguous: divide it at once, then copy out (casting) at once
            first, last = bucket.segments[0], bucket.segments[-1]
            bucket.data[first.bucket_offset: last.bucket_offset + last.numel].div_(self.count)
            parts, targets = bucket.views()
            torch._foreach_copy_(targets, parts)
        self.free.append(bucket.data)

    # ---------------------------------------------------------------------------------------- packing
    def _buckets(self, kinds: dict[torch.dtype, list[torch.Tensor]], rider: torch.Tensor | None) -> Iterator[_Bucket]:
        """Full buckets as they are packed: the first starts with the rider and ends with the count."""
        first = True
        for dtype, tensors in (kinds.items() if kinds else [(torch.float32, [])]):
            needed = sum(t.numel() for t in tensors) + (_encoded_size(rider, dtype) + 1 if first else 0)
            capacity = max(1, min(self.bucket_bytes // dtype.itemsize, needed))
            bucket = self._new_bucket(capacity, dtype, _encoded_size(rider, dtype) if first else 0, first)
            if first and rider is not None:
                bucket.data[: bucket.fill].copy_(_encode(rider, dtype))
            for tensor in tensors:
                flat, offset = tensor, 0
                while offset < flat.numel():
                    room = bucket.data.numel() - bucket.fill - (1 if first else 0)
                    if room == 0:
                        yield self._closed(bucket, first)
                        first = False
                        bucket = self._new_bucket(capacity, dtype, 0, False)
                        continue
                    count = min(flat.numel() - offset, room)
                    bucket.segments.append(_Segment(flat, offset, bucket.fill, count))
                    bucket.fill += count
                    offset += count
            if first or bucket.segments:
                yield self._closed(bucket, first)
                first = False

    def _new_bucket(self, capacity: int, dtype: torch.dtype, header: int, first: bool) -> _Bucket:
        size = max(capacity, header + 2) if first else capacity  # the first also holds the count
        # by index: list.remove compares tensors with ==, element by element
        index = next((i for i, data in enumerate(self.free) if data.dtype == dtype and data.numel() == size), None)
        data = self.free.pop(index) if index is not None else torch.empty(size, dtype=dtype, device=self.device)
        return _Bucket(data, fill=header)

    def _closed(self, bucket: _Bucket, first: bool) -> _Bucket:
        if bucket.segments:
            parts, sources = bucket.views()
            torch._foreach_copy_(parts, sources)
        if first:
            bucket.data[bucket.fill].copy_(self.flag)
            bucket.fill += 1
            bucket.has_count = True
        return bucket

    # -------------------------------------------------------------------------------- communication
    def _launch(self, bucket: _Bucket) -> None:
        message = bucket.data[: bucket.fill]
        if bucket.segments:  # the payload: contiguous from the first segment to the end of the last
            first, last = bucket.segments[0], bucket.segments[-1]
            self._zero_unless_contributing(message[first.bucket_offset: last.bucket_offset + last.numel])
        bucket.work = dist.all_reduce(message, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        payload = sum(segment.numel for segment in bucket.segments) + (1 if bucket.has_count else 0)
        self.sent += payload * message.element_size()

    def _send_in_place(self, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            self._zero_unless_contributing(tensor)
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            self.in_place_works.append((tensor, work))
            self.sent += tensor.numel() * tensor.element_size()

    def _zero_unless_contributing(self, payload: torch.Tensor) -> None:
        """A member that does not contribute sends zeros (no pass at all where the host knows it contributes)."""
        if self.known is None:
            zero_unless(payload, self.flag)
        elif not self.known:
            payload.zero_()


# ------------------------------------------------------------------------------------------- the rider
def _encoded_size(rider: torch.Tensor | None, dtype: torch.dtype) -> int:
    """Elements a float64 rider takes in a bucket of ``dtype``: itself in fp64, a (high, low) fp32 pair each
    in fp32 (about 48 bits of the value)."""
    if rider is None:
        return 0
    return rider.numel() * (1 if dtype == torch.float64 else 2)


def _encode(rider: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    flat = rider.reshape(-1).to(torch.float64)
    if dtype == torch.float64:
        return flat
    high = flat.to(torch.float32)
    low = (flat - high.to(torch.float64)).to(torch.float32)
    low = torch.where(torch.isfinite(high), low, torch.zeros_like(low))  # inf - inf would be NaN
    return torch.cat([high, low])


def _decode(encoded: torch.Tensor, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    if dtype == torch.float64:
        return encoded.view(like.shape)
    high, low = encoded.to(torch.float64).chunk(2)
    return (high + low).view(like.shape)


def average_healthy(tensors: list[torch.Tensor], row: list[float], topology: ReplicaTopology,
                    adapter: EngineAdapter, *, step: int, with_probe: bool, bucket_bytes: int,
                    memory: list[torch.Tensor], with_optimizer_state: bool) -> tuple[ReplicaScores, int]:
    """Gathers every rank's score ``row`` (``ReplicaScorer.row``) and replaces ``tensors`` by their mean over the
    healthy replicas (every rank of a replica healthy); the ranks of a replica left out receive the mean and start
    their optimizer state afresh, unless ``with_optimizer_state`` (the optimizer state is among ``tensors``, so
    they received the healthy replicas' mean of it too). Returns the scores and the bytes averaged (collective).

    When every rank is a replica the score table rides in the average's first bucket: one collective in all.
    Otherwise (sharded replicas, or the optimizer state among ``tensors``) it is gathered over all ranks first, so
    that every rank of a replica knows whether the replica contributes, and all stop where the ranks that average
    together hold different numbers of elements (``check_same_elements``). Nothing is written when no replica is
    healthy: the sync raises instead."""
    topo = topology
    # the cross-replica group is every rank, and the tensors are alike there (the optimizer state need not be: it
    # is made at a parameter's first step, which a replica may not have taken yet)
    rides = topo.num_replicas > 1 and topo.ranks_per_replica == 1 and not with_optimizer_state
    if rides:
        table = torch.zeros(topo.world_size, len(row), dtype=torch.float64)
        table[topo.rank] = torch.tensor(row, dtype=torch.float64)
        healthy = bool(row[2])
    else:
        table, gathering = start_gather_rows(row, world_size=topo.world_size)
        if gathering is not None:
            gathering.wait()
        check_same_elements(table.cpu(), topo, step)
        healthy = bool(table[topo.replica_ranks(topo.replica_index), 2].all())
    found: list[ReplicaScores] = []

    def check(_: torch.Tensor | None) -> None:
        scores = ReplicaScores.from_table(table.cpu(), topo, with_probe=with_probe)
        if not any(scores.healthy):
            raise FloatingPointError(
                f"HDET sync at step {step}: every replica has non-finite parameters or optimizer state (replica "
                f"losses {scores.losses}); nothing was averaged. Lower the LR or alpha, or resume from the last "
                "checkpoint")
        found.append(scores)

    sent = average_tensors(tensors, topo.cross_replica_group, contribute=healthy, rider=table if rides else None,
                           check=check, bucket_bytes=bucket_bytes, memory=memory)
    adapter.after_average()
    if not healthy and not with_optimizer_state:
        adapter.restart_optimizer_state()
    if found[0].excluded:
        logger.warning("HDET step %d: replicas %s had non-finite values and were left out of the average",
                       step, found[0].excluded)
    return found[0], sent


ELEMENTS_COLUMN, STATE_LAYOUT_COLUMN = 4, 5
"""The score table's columns of how many elements each rank averages and of which parameters the optimizer state
among them is of (``ReplicaScorer.row``)."""


def check_same_elements(table: torch.Tensor, topology: ReplicaTopology, step: int) -> None:
    """A ValueError on every rank (each reads the whole ``table``) where ranks that average together hold different
    numbers of elements, or optimizer states of different parameters: their buckets would not line up, and the
    collective would hang or mix unrelated values."""
    for position in range(topology.ranks_per_replica):
        ranks = topology.cross_replica_ranks(position)
        rows = [tuple(row) for row in table[ranks][:, [ELEMENTS_COLUMN, STATE_LAYOUT_COLUMN]].tolist()]
        other = next((index for index, row in enumerate(rows) if row != rows[0]), None)
        if other is None:
            continue
        differ = (f"rank {ranks[0]}: {rows[0][0]:.0f} elements, rank {ranks[other]}: {rows[other][0]:.0f}"
                  if rows[other][0] != rows[0][0] else "as many elements, the optimizer state of other parameters")
        raise ValueError(
            f"HDET sync at step {step}: the replicas hold different tensors to average ({differ}); nothing was "
            "averaged. Every replica must train the same model; with average_optimizer_state, the optimizer makes "
            "a parameter's state at its first step, which a replica may not have taken yet (its fp16 steps skipped, "
            "or no gradient reached the parameter there): set average_optimizer_state to false, so that each "
            "replica keeps its own")


def _flat_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements in memory order as a 1-D view, written through in place: of a contiguous tensor, and
    of one laid out densely in another memory format (a channels_last convolution weight). Every replica's tensor
    has the same layout, so the elements meet their peers'."""
    if tensor.is_contiguous():
        return tensor.view(-1)
    if any(tensor.is_contiguous(memory_format=layout) for layout in (torch.channels_last, torch.channels_last_3d)):
        return tensor.as_strided((tensor.numel(),), (1,))
    raise ValueError(f"cannot average a non-contiguous tensor of shape {tuple(tensor.shape)} in place")
