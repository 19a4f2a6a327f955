"""Bucketed averaging over cross-replica groups on 4 real gloo ranks (2 replicas x 2 positions).

This file holds the tests that start no process; the tests on gloo ranks are in
tests/distributed/test_comm_distributed.py and the tests that start a launcher or script as a subprocess are in
tests/e2e/test_comm_e2e.py.
"""

from __future__ import annotations

import math

import torch

from hdet_scale.averaging import average_tensors, coalesced_views
from hdet_scale.comm import all_finite_on, pack_healthy, unpack_healthy_mean


def test_one_replica_averages_nothing():
    tensor = torch.ones(3)
    checked = []
    assert average_tensors([tensor], None, bucket_bytes=64, check=checked.append) == 0
    assert torch.equal(tensor, torch.ones(3)) and checked == [None]


def test_packing_counts_exactly_in_low_precision():
    packed = pack_healthy(torch.tensor([2.0, 4.0], dtype=torch.bfloat16), 4)
    assert packed.dtype == torch.bfloat16 and packed.tolist() == [0.5, 1.0, 1.0]
    assert pack_healthy(torch.ones(2, dtype=torch.bfloat16), 257).dtype == torch.float32  # 257 is not a bf16
    assert pack_healthy(torch.tensor([1.0, -math.inf]), 2).tolist() == [0.0, 0.0, 0.0]
    out = torch.empty(2, dtype=torch.bfloat16)
    summed = torch.tensor([1.5, 3.0, 3.0])  # three of four members contributed
    assert unpack_healthy_mean(summed, out, 4).tolist() == [2.0, 4.0]


def test_views_that_tile_a_storage_become_one_flat_view():
    flat = torch.arange(10.0)
    # Out of order, as ZeRO-2 lists its gradient partition (the last layer's first), plus an unrelated tensor.
    pieces = [flat[6:10].view(2, 2), flat[0:2], flat[2:6]]
    other = torch.ones(3)
    merged = coalesced_views([pieces[0], other, pieces[1], pieces[2]])
    assert len(merged) == 2 and merged[1] is other
    assert merged[0].data_ptr() == flat.data_ptr() and merged[0].tolist() == list(range(10))
    merged[0].mul_(2)  # a view: writing it writes every piece
    assert pieces[0].tolist() == [[12.0, 14.0], [16.0, 18.0]]


def test_views_with_gaps_overlaps_or_other_dtypes_stay_apart():
    flat = torch.arange(12.0)
    gap = coalesced_views([flat[0:3], flat[3:5], flat[6:8]])  # 5 is in neither
    assert [(t.storage_offset(), t.numel()) for t in gap] == [(0, 5), (6, 2)]
    overlap = coalesced_views([flat[0:4], flat[2:6]])
    assert [(t.storage_offset(), t.numel()) for t in overlap] == [(0, 4), (2, 4)]
    strided = flat[::2]
    assert coalesced_views([strided])[0] is strided
    halves = torch.zeros(4, dtype=torch.float16)
    assert len(coalesced_views([flat[0:2], halves[0:2], halves[2:4]])) == 2


def test_all_finite_reads_every_tensor_of_every_precision():
    cpu = torch.device("cpu")

    def finite(*tensors: torch.Tensor) -> bool:
        flag = all_finite_on(list(tensors), cpu)
        assert flag.dtype == torch.bool and flag.dim() == 0
        return bool(flag)

    healthy = [torch.ones(3), torch.full((2, 2), -1e30), torch.zeros(0), torch.ones(2, dtype=torch.float64),
               torch.ones(4, dtype=torch.bfloat16)]
    assert finite(*healthy) and finite()
    for broken in (torch.tensor([1.0, math.inf]), torch.tensor([-math.inf, 2.0]), torch.tensor([math.nan]),
                   torch.tensor([math.inf, -math.inf]), torch.tensor([1e300, math.nan], dtype=torch.float64),
                   torch.tensor([math.inf], dtype=torch.bfloat16)):
        assert not finite(*healthy, broken), broken  # found in the last tensor, whatever its precision
        assert not finite(broken, *healthy), broken
