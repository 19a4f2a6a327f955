"""Warm noisy initialization (eq. 10) without processes: a replica's noise is one stream over the whole model,
so any cut of it into shards draws the same numbers. The engines' runs on gloo ranks are in
tests/distributed/test_warm_init_distributed.py."""

from __future__ import annotations

import pytest
import torch

from hdet_scale import warm_init

NU, SEED = 0.01, 3


def test_a_range_of_noise_is_the_same_however_it_is_cut(monkeypatch):
    monkeypatch.setattr(warm_init, "NOISE_CHUNK", 1000)
    numel = 2500  # two whole chunks and a half
    whole = warm_init.replica_noise(numel, 0, numel, seed=SEED, replica_index=1, index=4)
    assert whole.shape == (numel,) and whole.std().item() == pytest.approx(1.0, rel=0.1)
    for cuts in ([0, 1250, 2500], [0, 999, 1000, 1001, 2500], [0, 0, 7, 2499, 2500]):  # shards of any layout
        parts = [warm_init.replica_noise(numel, a, b, seed=SEED, replica_index=1, index=4)
                 for a, b in zip(cuts, cuts[1:], strict=False)]
        assert torch.equal(torch.cat(parts), whole)
    first_chunk = torch.randn(1000, generator=torch.Generator().manual_seed(
        warm_init.stream_seed(SEED, "warm_init/1/4/0")))  # independently: chunk 0's own generator
    assert torch.equal(whole[:1000], first_chunk)
    other_replica = warm_init.replica_noise(numel, 0, numel, seed=SEED, replica_index=0, index=4)
    assert abs(torch.corrcoef(torch.stack([whole, other_replica]))[0, 1].item()) < 0.1
    with pytest.raises(ValueError, match="not within a parameter of 2500"):
        warm_init.replica_noise(numel, 2000, 2501, seed=SEED, replica_index=1, index=4)


def test_a_channels_last_parameter_gets_the_noise_of_its_contiguous_twin():
    """DDP hands its parameters over as they are: a conv weight in channels_last memory format takes the same
    noise, element by element, as the same weight stored contiguously."""
    from torch import nn

    from hdet_scale import HDETConfig, HDETEnsemble, ReplicaTopology, WarmInitConfig
    from hdet_scale.config import AutoLRConfig
    from hdet_scale.engines.ddp import DDPAdapter

    config = HDETConfig(seed=SEED, warm_init=WarmInitConfig(enabled=True, nu=NU), auto_lr=AutoLRConfig(range_test=0))
    weights = []
    for memory_format in (torch.contiguous_format, torch.channels_last):
        torch.manual_seed(0)
        model = nn.Conv2d(3, 8, 3).to(memory_format=memory_format)
        start = model.weight.detach().clone()
        HDETEnsemble(config, DDPAdapter(torch.optim.SGD(model.parameters(), lr=0.1), model),
                     topology=ReplicaTopology.single_process()).close()
        assert model.weight.is_contiguous(memory_format=memory_format)
        assert not torch.equal(model.weight.detach(), start)
        weights.append(model.weight.detach().clone())
    assert torch.equal(weights[0], weights[1])


def test_a_sync_before_the_first_step_leaves_the_warm_noise_alone():
    """A Lightning validation before the first step (its sanity check, or one at the end of the range test's last
    epoch) synced there: the replicas, apart only by their warm-init noise, were averaged back into one start."""
    from torch import nn

    from hdet_scale import HDETConfig, HDETEnsemble, ReplicaTopology
    from hdet_scale.engines.ddp import DDPAdapter

    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = HDETConfig.from_dict({"sync_interval": 5, "warm_init": {"enabled": True},
                                   "auto_lr": {"enabled": False, "range_test": 0}})
    hdet = HDETEnsemble(config, DDPAdapter(optimizer, model), topology=ReplicaTopology.single_process())
    start = [parameter.detach().clone() for parameter in model.parameters()]
    assert not hdet.at_sync_point and hdet.sync() is None  # no step yet: nothing to average
    assert all(torch.equal(before, after) for before, after in zip(start, model.parameters(), strict=True))
    # a checkpoint or an export of one model says when it can be taken (not "sync first", which did nothing here)
    assert not hdet.at_sync_point and hdet.apart_error("a checkpoint") == (
        "a checkpoint is taken where the replicas are one model, and before the first step warm init keeps their "
        "starts apart: take it after the first sync (every 5 steps)")
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    hdet.step(1.0)
    assert hdet.sync() is not None and hdet.at_sync_point


def test_a_start_afresh_from_a_partial_load_noises_every_weight_once():
    """weights_loaded() after a load that left some parameters as they were (``strict=False``) added the same noise
    to them again: theta_0 + 2 eps. Each ends at its weights before the noise (loaded, or as they were) plus one
    eps, at the std of those weights (eq. 10), computed here independently from the noise streams."""
    from torch import nn

    from hdet_scale import HDETConfig, HDETEnsemble, ReplicaTopology
    from hdet_scale.engines.ddp import DDPAdapter

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    before = [parameter.detach().clone() for parameter in model.parameters()]
    config = HDETConfig.from_dict({"seed": SEED, "warm_init": {"enabled": True, "nu": NU},
                                   "auto_lr": {"enabled": False, "range_test": 0}})
    hdet = HDETEnsemble(config, DDPAdapter(torch.optim.SGD(model.parameters(), lr=0.1), model),
                        topology=ReplicaTopology.single_process())
    loaded = {"0.weight": torch.full((3, 4), 0.5), "0.bias": torch.full((3,), -0.25)}
    model.load_state_dict(loaded, strict=False)  # the second layer keeps its (noised) weights
    assert hdet.weights_loaded()
    start = [loaded["0.weight"], loaded["0.bias"], before[2], before[3]]
    flat = torch.cat([tensor.reshape(-1).double() for tensor in start])
    std = NU * flat.square().mean().sqrt().item()
    for index, (parameter, theta) in enumerate(zip(model.parameters(), start, strict=True)):
        noise = warm_init.replica_noise(theta.numel(), 0, theta.numel(), seed=SEED, replica_index=0, index=index)
        assert torch.allclose(parameter.detach(), theta + std * noise.view_as(theta), rtol=0, atol=1e-6)
    hdet.close()
