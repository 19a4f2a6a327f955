"""The fan-out: eq. 1's symmetric multipliers and the per-hyperparameter permutations of eq. 9.

Permutations come from one dedicated ``torch.Generator`` per explored value, seeded from the config seed
and the value's name. Every rank therefore derives the same assignment without communication, adding a
new explored value never changes the permutations of the others, and the global RNG is never touched.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from hdet_scale.config_rules import SPREADS


def multipliers(num_replicas: int, alpha: float, spread: str = "linear") -> list[float]:
    """The replicas' multipliers for spread ratio ``alpha``.

    ``linear`` is eq. 1: rho_r = 1 + alpha * (r - (N-1)/2) / delta with delta = max((N-1)/2, 0.5); they sum to
    N and span [1 - alpha, 1 + alpha]. ``log`` spreads them evenly in log space over [1/(1 + alpha), 1 + alpha]:
    rho_r = (1 + alpha) ** ((r - (N-1)/2) / delta), whose product is 1, so a step up and a step down are alike
    (eq. 1 at alpha = 0.5 spans 0.5x-1.5x: three times as far down as up in log terms). One replica gets
    exactly 1 when N is odd.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if spread not in SPREADS:
        raise ValueError(f"spread must be one of {SPREADS}, got {spread!r}")
    center = (num_replicas - 1) / 2
    delta = max(center, 0.5)
    if spread == "log":
        return [(1.0 + alpha) ** ((r - center) / delta) for r in range(num_replicas)]
    return [1.0 + alpha * (r - center) / delta for r in range(num_replicas)]


def stream_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for the explored value ``name`` (same on every rank and every Python run)."""
    return (seed * 0x9E3779B97F4A7C15 + zlib.crc32(name.encode())) % (2**63)


class PermutationStream:
    """Successive random permutations of replica slots for one explored value (eq. 9)."""

    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(stream_seed(seed, name))

    def draw(self, num_replicas: int) -> list[int]:
        """The next permutation: entry r is the multiplier index assigned to replica r."""
        return torch.randperm(num_replicas, generator=self._generator).tolist()

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self._generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._generator.set_state(state["generator"])
