import math

import pytest
import torch

from hdet_scale.spread import PermutationStream, multipliers


@pytest.mark.parametrize(
    ("num_replicas", "alpha", "expected"),
    [
        (1, 0.5, [1.0]),
        (2, 0.5, [0.5, 1.5]),  # delta = 0.5: r - 0.5 = -0.5, 0.5
        (4, 0.3, [0.7, 0.9, 1.1, 1.3]),  # delta = 1.5: (r - 1.5)/1.5 = -1, -1/3, 1/3, 1
        (8, 0.7, [0.3, 0.5, 0.7, 0.9, 1.1, 1.3, 1.5, 1.7]),  # delta = 3.5: steps of 2/7 * 0.7 = 0.2
        (8, 1 / 9, [1 - 1 / 9 + k * 2 / 63 for k in range(8)]),  # the paper's spread
    ],
)
def test_multipliers_by_hand(num_replicas, alpha, expected):
    values = multipliers(num_replicas, alpha)
    assert values == pytest.approx(expected, abs=1e-12)
    assert sum(values) == pytest.approx(num_replicas, abs=1e-12)
    assert min(values) == pytest.approx(1 - alpha if num_replicas > 1 else 1.0)


def test_alpha_zero_gives_exact_ones():
    assert multipliers(8, 0.0) == [1.0] * 8


def test_permutations_are_deterministic_independent_and_leave_global_rng_alone():
    before = torch.random.get_rng_state()
    a1, a2, b = PermutationStream("lr/0", 7), PermutationStream("lr/0", 7), PermutationStream("lr/1", 7)
    draws_a1 = [a1.draw(8) for _ in range(50)]
    assert draws_a1 == [a2.draw(8) for _ in range(50)]
    draws_b = [b.draw(8) for _ in range(50)]
    assert draws_a1 != draws_b
    assert all(sorted(p) == list(range(8)) for p in draws_a1)
    assert torch.equal(before, torch.random.get_rng_state())


def test_permutation_stream_resumes():
    stream = PermutationStream("lr/0", 3)
    stream.draw(4)
    saved = stream.state_dict()
    expected = [stream.draw(4) for _ in range(5)]
    resumed = PermutationStream("lr/0", 99)
    resumed.load_state_dict(saved)
    assert [resumed.draw(4) for _ in range(5)] == expected


def test_log_spread_by_hand():
    # N = 4, delta = 1.5: exponents (r - 1.5) / 1.5 = -1, -1/3, 1/3, 1 of 1 + alpha = 2
    values = multipliers(4, 1.0, "log")
    assert values == pytest.approx([0.5, 2 ** (-1 / 3), 2 ** (1 / 3), 2.0], abs=1e-12)
    assert math.prod(values) == pytest.approx(1.0, abs=1e-12)  # as far up as down
    assert multipliers(2, 0.5, "log") == pytest.approx([1 / 1.5, 1.5])
    assert multipliers(3, 0.5, "log")[1] == 1.0
    assert multipliers(5, 0.0, "log") == [1.0] * 5
    with pytest.raises(ValueError, match="spread must be one of"):
        multipliers(2, 0.5, "cubic")
