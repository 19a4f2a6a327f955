"""The overhead benchmark's same-layout baseline (ZeRO inside each replica, gradients averaged across replicas by
hand) trains exactly as plain DeepSpeed over all ranks does: the same mean gradient (its norm, as DeepSpeed takes it),
so the same weights."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.multiprocessing as mp
from benchmark_modules import load_benchmark

overhead = load_benchmark("overhead")
engines = load_benchmark("overhead_engines")

STEPS = 3


def trained_weights(trainer: engines.Trainer, x: torch.Tensor,
                    y: torch.Tensor) -> tuple[list[torch.Tensor], list[float]]:
    """The full fp32 weights after ``STEPS`` steps on this rank's batch, and the global gradient norm DeepSpeed
    took at each step (collective within the engine's group)."""
    from deepspeed.utils import safe_get_full_fp32_param

    from hdet_scale.engines.deepspeed import replica_groups

    norms = []
    for _ in range(STEPS):
        trainer.train_step(x, y)
        norms.append(float(trainer.model.get_global_grad_norm()))
    with replica_groups(trainer.mpu) if trainer.name == "same_layout" else contextlib.nullcontext():
        return [safe_get_full_fp32_param(param).clone() for param in trainer.model.module.parameters()], norms


def rank_main(rank: int, settings: engines.Settings, store: str, stage: int) -> None:
    overhead.start_rank(rank, settings, store)
    engine = engines.DeepSpeedEngine(settings, torch.device("cpu"), stage)
    plain = engine.plain_trainer()  # before the replica-layout engine, as the benchmark builds them
    same_layout = engine.same_layout_trainer()
    assert (plain.model.dp_world_size, same_layout.model.dp_world_size) == (4, 2)
    generator = torch.Generator().manual_seed(100 + rank)  # every rank its own batch
    x = torch.randn(settings.batch, settings.width, generator=generator)
    y = torch.randint(0, 16, (settings.batch,), generator=generator)
    expected, expected_norms = trained_weights(plain, x, y)
    got, got_norms = trained_weights(same_layout, x, y)
    moved = max((after - before).abs().max().item()
                for after, before in zip(got, engines.build_model(settings, torch.device("cpu")).parameters(),
                                         strict=True))
    assert moved > 1e-4, "the weights did not train"
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    # AdamW's step does not see the gradient's scale; DeepSpeed's norm of the averaged gradient does
    assert got_norms == pytest.approx(expected_norms, rel=1e-5)


@pytest.mark.parametrize("stage", [1, 3])
def test_the_same_layout_baseline_trains_like_plain_deepspeed_over_all_ranks(tmp_path, stage):
    settings = dataclasses.replace(overhead.parse_args(["--engine", "deepspeed", "--quick", "--backend", "gloo"]),
                                   width=32, depth=2, batch=4)
    mp.spawn(rank_main, args=(settings, str(tmp_path / "store"), stage), nprocs=settings.ranks, join=True)
