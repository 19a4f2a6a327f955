"""Warm noisy initialization (eq. 10) on real gloo ranks with DDP, FSDP2 and DeepSpeed ZeRO 0-3 (no mocks).

Every engine starts from the same model and seed, so a replica's noised fp32 parameters must be the same
whatever the engine and however many ranks shard it: the runs return replica 0's and replica 1's weights
and the test compares them across engines and replica sizes. Inside each run: the noise has eq. 10's std
(norm and count over the whole model, computed here on the full model), replicas differ, the ranks of a
replica agree, and a training step afterwards keeps the noise (alpha = 0 in global mode: every replica
applies the same update, so the differences between replicas are exactly the noise's).

This file holds the tests on gloo ranks; the tests that start no process are in tests/unit/test_warm_init.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_warm_init import NU, SEED
from torch import nn
from torch.nn.utils import parameters_to_vector

from distributed import gather_rows, run_ranks
from hdet_scale import AutoLRConfig, HDETConfig, ReplicaTopology, WarmInitConfig, warm_init
from hdet_scale.engines import ddp, fsdp

WORLD = 4
FP32, BF16 = "fp32", "bf16"


def make_model(seed: int) -> nn.Module:
    """2311 parameters; under 2 shards the (3, 64) and (3,) tensors split unevenly and the (1, 3) and (1,)
    tensors leave rank 1 of a replica empty (FSDP2) or holding only padding (ZeRO-3)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 3), nn.Tanh(), nn.Linear(3, 1))


def original(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Global rank 0's starting weights (every engine broadcasts them), in the engine's parameter dtype."""
    return parameters_to_vector(make_model(seed=0).parameters()).detach().to(dtype).float()


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(4, 32, generator=generator), torch.randn(4, 1, generator=generator)


def config(per_replica: int) -> HDETConfig:
    return HDETConfig(spread="linear", alpha=0.0, sync_interval=1000, ranks_per_replica=per_replica,
                      gradient_mode="global", seed=SEED, auto_lr=AutoLRConfig(mode="scale", enabled=False),
                      warm_init=WarmInitConfig(enabled=True, nu=NU))


def small_noise_chunks() -> None:
    """Noise chunks of 7 elements in this rank process: shards and chunks then cut each other at many places."""
    warm_init.NOISE_CHUNK = 7


def check_warm_start(rows: torch.Tensor, start: torch.Tensor, per_replica: int) -> list[list[float]]:
    """Checks every rank's full noised fp32 parameters against eq. 10; returns replica 0's and 1's."""
    expected_std = NU * start.double().norm().item() / math.sqrt(start.numel())  # eq. 10 on the full model
    noise = rows.double() - start.double()
    replicas = rows.shape[0] // per_replica
    for replica in range(replicas):
        members = rows[replica * per_replica: (replica + 1) * per_replica]
        assert torch.equal(members, members[:1].expand_as(members)), f"the ranks of replica {replica} disagree"
        assert noise[replica * per_replica].std().item() == pytest.approx(expected_std, rel=0.06)
    for replica in range(1, replicas):
        correlation = torch.corrcoef(noise[[0, replica * per_replica]])[0, 1].item()
        assert abs(correlation) < 0.15, f"replicas 0 and {replica} drew related noise ({correlation})"
    return [rows[0].tolist(), rows[per_replica].tolist()]


def check_noise_kept(before: torch.Tensor, after: torch.Tensor) -> None:
    """After a step at alpha = 0 with one global gradient, the parameters moved but the differences between
    replicas are still the warm-init noise: nothing re-synchronized the weights."""
    assert torch.isfinite(after).all() and not torch.equal(after, before)
    assert torch.allclose(after - after[:1], before - before[:1], atol=1e-6)


# ------------------------------------------------------------------------------------- DDP and FSDP2
def full_parameters(model: nn.Module) -> torch.Tensor:
    """An FSDP2 model's parameters gathered whole (collective over the replica), flattened into one vector."""
    return torch.cat([param.full_tensor().detach().reshape(-1) for param in model.parameters()])


def ddp_and_fsdp(rank: int, world: int) -> dict[str, list[list[float]]]:
    small_noise_chunks()
    results = {}
    # DDP, 2 replicas x 2 ranks, every rank a different model: the wrap broadcasts rank 0's before the noise.
    topology = ReplicaTopology.build(config(2))
    model = ddp.wrap_model(make_model(seed=rank), config(2), topology)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hdet = ddp.attach(model, optimizer, config(2), topology=topology)
    noised = gather_rows(parameters_to_vector(model.parameters()).detach())
    results["ddp 2x2"] = check_warm_start(noised, original(), per_replica=2)
    x, y = batch(rank)
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    optimizer.step()
    hdet.step(loss)
    check_noise_kept(noised, gather_rows(parameters_to_vector(model.parameters()).detach()))
    with pytest.raises(ValueError, match="already has HDET attached"):
        ddp.attach(model, optimizer, config(2), topology=topology)
    state = hdet.state_dict()
    hdet.close()
    # A run continuing from a checkpoint, its weights loaded already, passes the HDET state: no noise again.
    loaded = parameters_to_vector(model.parameters()).detach().clone()
    ddp.attach(model, optimizer, config(2), topology=topology, state=state).close()
    assert torch.equal(parameters_to_vector(model.parameters()).detach(), loaded)

    # FSDP2 with 2 shards per replica (2 replicas), then 1 (4 replicas): the same noise for replicas 0 and 1.
    for per_replica in (2, 1):
        model, hdet = fsdp.wrap(make_model(seed=rank), config(per_replica), block_classes=(nn.Linear,))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if per_replica == 2:  # the shards this run is about: uneven, and empty on the second rank
            local_sizes = [param.to_local().numel() for param in model.parameters()]
            assert local_sizes == ([1024, 32, 128, 2, 3, 1] if rank % 2 == 0 else [1024, 32, 64, 1, 0, 0])
        hdet.attach(optimizer)
        noised = gather_rows(full_parameters(model))
        results[f"fsdp2 {world // per_replica}x{per_replica}"] = check_warm_start(noised, original(), per_replica)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        optimizer.step()
        hdet.step(loss)
        check_noise_kept(noised, gather_rows(full_parameters(model)))
        hdet.ensemble.close()
    return results


# ------------------------------------------------------------------------------------------ DeepSpeed
DS_VARIANTS = [  # (ZeRO stage, precision, ranks per replica): each optimizer wrapper HDET knows but FP16_Optimizer
    # (ZeRO-0 bf16 with DeepSpeed's own fused optimizer, which needs an accelerator)
    (0, FP32, 1),  # the torch optimizer itself, 4 replicas
    (0, BF16, 2),  # FP16_UnfusedOptimizer, every rank of a replica holding whole parameters
    (1, FP32, 2),  # DeepSpeedZeroOptimizer: fp32 fragments of a flat partition
    (1, BF16, 2),  # BF16_Optimizer (bf16 with fp32 gradient accumulation)
    (2, BF16, 2),  # DeepSpeedZeroOptimizer with bf16 copies
    (3, FP32, 2),  # ZeRO-3 partitions with padding
    (3, FP32, 1),  # ZeRO-3, one rank per replica
]


def deepspeed_runs(rank: int, world: int) -> dict[str, list[list[float]]]:
    small_noise_chunks()
    from test_deepspeed_distributed import full_fp32, module_values

    from hdet_scale.engines import deepspeed as hdet_deepspeed

    results = {}
    for stage, precision, per_replica in DS_VARIANTS:
        bf16 = precision == BF16
        hdet = {"alpha": 0.0, "sync_interval": 1000, "gradient_mode": "global", "ranks_per_replica": per_replica,
                "seed": SEED, "auto_lr": {"enabled": False}, "warm_init": {"enabled": True, "nu": NU}}
        ds_config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                     "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}, "steps_per_print": 10**6,
                     "hdet": hdet}
        if stage == 1 and bf16:
            ds_config["data_types"] = {"grad_accum_dtype": "fp32"}
        model = make_model(seed=rank)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
        engine, *_ = hdet_deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        name = f"zero{stage} {precision} {world // per_replica}x{per_replica}"
        noised = gather_rows(full_fp32(engine))
        results[name] = check_warm_start(noised, original(torch.bfloat16 if bf16 else torch.float32), per_replica)
        # The low-precision copies the forward pass uses carry the noise too.
        assert torch.equal(module_values(engine), noised[rank].to(torch.bfloat16 if bf16 else torch.float32).float())
        x, y = batch(rank)
        loss = (engine(x.to(torch.bfloat16 if bf16 else torch.float32)).float() - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        check_noise_kept(noised, gather_rows(full_fp32(engine)))
    return results


# -------------------------------------------------------------------------------------------- tests
def agreed(results: list[dict[str, list[list[float]]]]) -> dict[str, list[list[float]]]:
    assert all(result == results[0] for result in results)  # every rank saw the same replica weights
    return results[0]


@pytest.fixture(scope="module")
def ddp_fsdp_weights() -> dict[str, list[list[float]]]:
    """Replica 0's and 1's noised weights per DDP / FSDP2 layout; the per-run checks ran on the ranks."""
    return agreed(run_ranks(ddp_and_fsdp, WORLD))


@pytest.fixture(scope="module")
def deepspeed_weights() -> dict[str, list[list[float]]]:
    """Replica 0's and 1's noised fp32 masters per DeepSpeed variant; the per-run checks ran on the ranks."""
    return agreed(run_ranks(deepspeed_runs, WORLD))


def assert_same_replicas(runs: dict[str, list[list[float]]]) -> None:
    """Replicas 0 and 1 hold exactly the same weights in every run."""
    assert len(runs) >= 2
    reference_name, reference = next(iter(runs.items()))
    for name, weights in runs.items():
        for replica in (0, 1):
            assert torch.equal(torch.tensor(weights[replica]), torch.tensor(reference[replica])), (
                f"replica {replica}: {name} differs from {reference_name}")


def test_ddp_and_fsdp2_noise_is_eq_10_and_the_same_for_1_and_2_shards(ddp_fsdp_weights):
    assert set(ddp_fsdp_weights) == {"ddp 2x2", "fsdp2 2x2", "fsdp2 4x1"}
    assert_same_replicas(ddp_fsdp_weights)


@pytest.mark.parametrize("precision", [FP32, BF16])
def test_deepspeed_noise_is_eq_10_and_the_same_for_every_stage_and_replica_size(deepspeed_weights, precision):
    runs = {name: weights for name, weights in deepspeed_weights.items() if precision in name}
    assert len(runs) == sum(variant[1] == precision for variant in DS_VARIANTS)
    assert_same_replicas(runs)


def test_every_engine_draws_the_same_noise(ddp_fsdp_weights, deepspeed_weights):
    """The same seed and starting weights give replica r the same fp32 weights under DDP, FSDP2 and ZeRO."""
    assert_same_replicas({**ddp_fsdp_weights, **{name: weights for name, weights in deepspeed_weights.items()
                                                 if FP32 in name}})
