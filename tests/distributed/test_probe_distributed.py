"""The probe batch: every replica scored on the same held-out batch at each sync, driving the controller.

This file holds the tests on gloo ranks; the tests that start no process are in tests/unit/test_probe.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import run_ranks
from hdet_scale import AutoLRConfig, HDETConfig
from hdet_scale.controller import softmax_weights
from hdet_scale.engines.ddp import attach, wrap_model
from hdet_scale.probe import batch_probe
from hdet_scale.topology import ReplicaTopology

WORLD = 4


def probe_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return nn.functional.mse_loss(model(inputs), targets)


def candidate_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7 + rank)  # every rank draws its own: rank 0's must win
    return torch.randn(16, 4, generator=generator), torch.randn(16, 1, generator=generator)


def probed_training(rank: int, world: int, probe_weight: float) -> int:
    config = HDETConfig(spread="linear", alpha=0.5, sync_interval=3,
                        auto_lr=AutoLRConfig(mode="scale", start=0, sigma=0.05, probe_weight=probe_weight,
                                             range_test=0))
    topology = ReplicaTopology.build(config)
    torch.manual_seed(0)
    model = wrap_model(nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1)), config, topology)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    hdet = attach(model, optimizer, config, topology=topology)
    forwards = []
    model.register_forward_hook(lambda module, args, output: forwards.append(module.training))
    hdet.set_probe(batch_probe(model, candidate_batch(rank), probe_loss))
    rank0_batch = candidate_batch(0)
    expected: dict[int, list[float]] = {}

    def score_replicas_independently(step: int) -> None:
        # Each rank is a replica here: its loss on rank 0's batch, computed by hand on a copy in eval mode.
        copy = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
        copy.load_state_dict(model.module.state_dict())
        with torch.no_grad():
            own = probe_loss(copy.eval(), rank0_batch).reshape(1).double()
        rows = [torch.empty_like(own) for _ in range(world)]
        dist.all_gather(rows, own)
        expected[step] = torch.cat(rows).tolist()
        forwards.clear()

    hdet.add_pre_sync_hook(score_replicas_independently)
    syncs = 0
    for step in range(1, 10):
        generator = torch.Generator().manual_seed(100 * rank + step)
        inputs, targets = torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        report = hdet.step(loss)
        if report is None:
            continue
        syncs += 1
        assert forwards == [False]  # one forward pass per rank per sync, in eval mode
        assert model.training  # and back to training afterwards
        assert report.probe_losses == pytest.approx(expected[step], rel=1e-6)
        assert len(set(report.probe_losses)) == world  # replicas differ before averaging
        signal = [probe_weight * probe + (1 - probe_weight) * train
                  for probe, train in zip(report.probe_losses, report.replica_losses, strict=True)]
        assert report.weights == pytest.approx(softmax_weights(signal, sigma=0.05), rel=1e-9)
    return syncs


@pytest.mark.parametrize("probe_weight", [1.0, 0.5])
def test_probe_losses_drive_the_controller(probe_weight):
    assert run_ranks(probed_training, WORLD, probe_weight) == [3] * WORLD



def fsdp2_training_losses(rank: int, world: int, probed: bool) -> tuple[list[float], list[float] | None]:
    """train.py's FSDP2 backend, 2 replicas x 2 shards of a tiny Llama, 6 steps synced every 2, the controller
    held; with or without a probe. Returns the training losses and the last sync's probe losses."""
    import argparse

    from hdet_scale.lm.backends import FSDPBackend
    from hdet_scale.lm.model import build_model

    config = HDETConfig(ranks_per_replica=2, sync_interval=2, auto_lr=AutoLRConfig(mode="scale",
                                                                                   start=100_000, range_test=0))
    args = argparse.Namespace(dtype="fp32", grad_accum=1, micro_batch_size=2, lr=1e-2, weight_decay=0.0, steps=6,
                              warmup_steps=1, min_lr_ratio=0.1, grad_clip=0.0, replay_schedule=None)
    torch.manual_seed(0)
    backend = FSDPBackend(build_model("tiny", vocab_size=64, seq_len=16), config, args, torch.device("cpu"))
    if probed:
        held_out = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(99))
        backend.ensemble.set_probe(batch_probe(backend.module, (held_out[:, :-1], held_out[:, 1:]),
                                               lambda _, batch: backend.loss(batch)))
    data, losses = torch.Generator().manual_seed(rank), []
    for _ in range(6):
        tokens = torch.randint(0, 64, (2, 17), generator=data)
        loss = backend.forward_backward((tokens[:, :-1], tokens[:, 1:]), index=0, of=1)
        backend.optimizer_step([loss])
        losses.append(float(loss))
    return losses, backend.ensemble.last_report.probe_losses


def test_a_probe_changes_nothing_in_fsdp2_training():
    """A probe only reads: with the controller held, training is the same with and without one. FSDP2 keeps the
    root module's parameters unsharded after a forward that no backward follows (the probe's), and the average
    edits the shards: the next forward must gather them again, not train on the replica's pre-average values."""
    probed, plain = run_ranks(fsdp2_training_losses, 4, True), run_ranks(fsdp2_training_losses, 4, False)
    assert all(scores is not None and len(scores) == 2 for _, scores in probed)  # the probe scored both replicas
    assert all(scores is None for _, scores in plain)
    assert [losses for losses, _ in probed] == [losses for losses, _ in plain]
