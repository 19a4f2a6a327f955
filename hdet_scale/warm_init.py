"""Warm noisy initialization (paper eq. 10): theta_r = theta_0 + eps_r, eps_r ~ N(0, nu^2 ||theta_0||^2 / d).

The norm and the parameter count d are taken over the whole model. Each replica draws its own noise and
all ranks of a replica draw the same, from generators seeded by (config seed, replica, tensor index), so
the noise of a tensor does not depend on anything but those.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hdet_scale.spread import stream_seed


def noise_std(tensors: Sequence[torch.Tensor], nu: float) -> float:
    """nu * ||theta|| / sqrt(d) over all ``tensors`` (full, unsharded tensors)."""
    count = sum(t.numel() for t in tensors)
    if count == 0:
        return 0.0
    norm = torch.nn.utils.get_total_norm([t.detach().float() for t in tensors]).item()
    return nu * norm / math.sqrt(count)


@torch.no_grad()
def add_warm_noise(tensors: Sequence[torch.Tensor], *, nu: float, seed: int, replica_index: int) -> float:
    """Adds this replica's eq. 10 noise to full (unsharded) tensors in place; returns the std used."""
    std = noise_std(tensors, nu)
    for index, tensor in enumerate(tensors):
        generator = torch.Generator(device="cpu")
        generator.manual_seed(stream_seed(seed, f"warm_init/{replica_index}/{index}"))
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * std
        tensor.add_(noise.to(device=tensor.device, dtype=tensor.dtype))
    return std
