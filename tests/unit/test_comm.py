"""Bucketed averaging over cross-replica groups on 4 real gloo ranks (2 replicas x 2 positions).

This file holds the tests that start no process; the tests on gloo ranks are in
tests/distributed/test_comm_distributed.py and the tests that start a launcher or script as a subprocess are in
tests/e2e/test_comm_e2e.py.
"""

from __future__ import annotations

import math

import torch

from hdet_scale import comm
from hdet_scale.averaging import average_tensors
from hdet_scale.comm import all_finite_on, bits_fingerprint, pack_healthy, unpack_healthy_mean


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
    # nobody contributed: NaN, as DDP's own mean would be, so that a GradScaler skips the step and lowers its scale
    # (zeros hid every rank's overflow from it: it stepped on zeros at the same scale, step after step)
    assert unpack_healthy_mean(torch.zeros(3), torch.empty(2), 4).isnan().all()
    assert unpack_healthy_mean(torch.zeros(3, dtype=torch.bfloat16), out, 4).isnan().all()


def test_all_finite_reads_every_tensor_of_every_precision():
    cpu = torch.device("cpu")

    def finite(*tensors: torch.Tensor) -> bool:
        flag = all_finite_on(list(tensors), cpu)
        assert flag.dtype == torch.bool and flag.dim() == 0
        return bool(flag)

    # fp64 sums in fp64, fp16 and bf16 in fp32: none of these overflows where it is summed
    healthy = [torch.ones(3), torch.full((2, 2), -1e30), torch.zeros(0), torch.tensor([1e300], dtype=torch.float64),
               torch.tensor([6e4, 6e4], dtype=torch.float16), torch.ones(4, dtype=torch.bfloat16)]
    assert finite(*healthy) and finite()
    for broken in (torch.tensor([1.0, math.inf]), torch.tensor([-math.inf, 2.0]), torch.tensor([math.nan]),
                   torch.tensor([math.inf, -math.inf]), torch.tensor([1e300, math.nan], dtype=torch.float64),
                   torch.tensor([math.inf], dtype=torch.bfloat16), torch.tensor([math.nan], dtype=torch.float16)):
        assert not finite(*healthy, broken), broken  # found in the last tensor, whatever its precision
        assert not finite(broken, *healthy), broken


def test_the_fingerprint_weighs_each_elements_bits_by_its_odd_place():
    one, two, minus_one = 0x3F800000, 0x40000000, -0x40800000  # float32 1.0, 2.0, -1.0 as signed int32 bits
    assert bits_fingerprint([torch.tensor([1.0])]) == one
    assert bits_fingerprint([torch.tensor([1.0]), torch.tensor([2.0, -1.0])]) == (one + 3 * two + 5 * minus_one) % 2**64
    assert bits_fingerprint([torch.tensor([-1.0])]) == 2**64 + minus_one  # unsigned
    assert bits_fingerprint([torch.tensor([1.0], dtype=torch.bfloat16)]) == 0x3F80
    assert bits_fingerprint([torch.tensor([1.0], dtype=torch.float64)]) == 0x3FF0000000000000
    assert bits_fingerprint([]) == bits_fingerprint([torch.empty(0)]) == 0


def test_the_fingerprint_sees_any_one_change_and_not_the_chunking(monkeypatch):
    state = [torch.randn(5, 3, generator=torch.Generator().manual_seed(0)), torch.randn(4)]
    whole = bits_fingerprint(state)
    monkeypatch.setattr(comm, "_FINGERPRINT_CHUNK", 4)
    assert bits_fingerprint(state) == whole
    assert bits_fingerprint([state[0].reshape(-1)[:7], state[0].reshape(-1)[7:], state[1]]) == whole
    for index in range(state[0].numel()):
        changed = state[0].clone()
        changed.view(-1)[index] = torch.nextafter(changed.view(-1)[index], torch.tensor(math.inf))
        assert bits_fingerprint([changed, state[1]]) != whole
    assert bits_fingerprint([state[1], state[0]]) != whole  # the order counts
    assert bits_fingerprint([torch.tensor([1 + 2j], dtype=torch.complex64)]) == 0x3F800000 + 3 * 0x40000000  # re, im


def test_the_fingerprint_wraps_around_exactly_past_64_bits(monkeypatch):
    infinity, minus_infinity = 0x7FF0000000000000, 0xFFF0000000000000 - 2**64  # float64 bits as signed int64
    state = [torch.tensor([math.inf, math.inf, -math.inf], dtype=torch.float64)]
    expected = (infinity + 3 * infinity + 5 * minus_infinity) % 2**64  # past int64's range on the way
    assert bits_fingerprint(state) == expected
    monkeypatch.setattr(comm, "_FINGERPRINT_CHUNK", 1)  # the running sum wraps too
    assert bits_fingerprint(state) == expected
    assert state[0].tolist() == [math.inf, math.inf, -math.inf]  # read, never written (int64 bits are a view)
