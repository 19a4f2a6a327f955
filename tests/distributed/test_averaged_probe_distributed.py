"""The probe on averaged weights (``auto_lr.average_window``) on 2 replicas of every engine, against independent
computations: the running mean by hand in one process, then each sync's probe scores against each replica's full
weights recorded at the window's steps, averaged here, loaded into a plain copy of the model and scored on the same
probe batch.

This file holds the tests on gloo ranks; the tests that start no process are in tests/unit/test_averaged_probe.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_averaged_probe import STEPS, SYNC_INTERVAL, WINDOW
from torch import nn

from distributed import gather_rows, run_ranks
from hdet_scale.probe import batch_probe


def hdet_settings(per_replica: int) -> dict:
    return {"alpha": 0.5, "spread": "log", "sync_interval": SYNC_INTERVAL, "ranks_per_replica": per_replica,
            "auto_lr": {"mode": "log", "start": 0, "stop": STEPS, "initial_scale": 1.0,
                        "average_window": WINDOW, "range_test": 0}}


def check_scores(records: dict[int, torch.Tensor], reports: list, probe_loss, replica_of: torch.Tensor) -> None:
    """``records[step]``: every rank's full weights after that step (before its sync); each report's probe losses
    must be the probe loss of each replica's weights averaged over the window's steps (the last 2 steps of each
    interval)."""
    assert len(reports) == STEPS // SYNC_INTERVAL
    for report in reports:
        window = list(range(report.step - 1, report.step + 1))
        for replica, score in enumerate(report.probe_losses):
            rank = int((replica_of == replica).nonzero()[0])
            mean = torch.stack([records[step][rank] for step in window]).double().mean(0).float()
            assert score == pytest.approx(probe_loss(mean), rel=1e-5), (report.step, replica)
        assert report.excluded_replicas == []


# ------------------------------------------------------------------------------------------------ DDP
def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


PROBE_X = torch.randn(5, 6, generator=torch.Generator().manual_seed(9))


def mlp_probe_loss(flat: torch.Tensor) -> float:
    model = mlp()
    torch.nn.utils.vector_to_parameters(flat, model.parameters())
    with torch.no_grad():
        return float(model(PROBE_X).pow(2).mean())


def ddp_run(rank: int, world: int) -> None:
    from hdet_scale import HDETConfig, ReplicaTopology
    from hdet_scale.engines.ddp import attach, wrap_model

    config = HDETConfig.from_dict(hdet_settings(1))
    topology = ReplicaTopology.build(config)
    model = wrap_model(mlp(), config, topology)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    hdet = attach(model, optimizer, config, topology=topology)
    hdet.set_probe(batch_probe(model, PROBE_X, lambda m, x: m(x).pow(2).mean()))
    records, reports = {}, []
    for step in range(1, STEPS + 1):
        optimizer.zero_grad()
        loss = model(torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * rank + step))).pow(2).mean()
        loss.backward()
        optimizer.step()
        records[step] = gather_rows(torch.nn.utils.parameters_to_vector(model.parameters()).detach())
        report = hdet.step(loss)
        if report is not None:
            reports.append(report)
            after = gather_rows(torch.nn.utils.parameters_to_vector(model.parameters()).detach())
            # the sync averaged each replica's last iterate, not its window average
            assert torch.allclose(after[0], records[step].double().mean(0).float(), atol=1e-6)
    assert len(reports) == 3
    check_scores(records, reports, mlp_probe_loss, torch.arange(world))


def test_ddp_scores_each_replicas_averaged_weights():
    run_ranks(ddp_run, 2)


# ---------------------------------------------------------------------------------------------- FSDP2
def fsdp_run(rank: int, world: int) -> None:
    from test_fsdp import full, tiny_llama

    from hdet_scale import HDETConfig
    from hdet_scale.engines.fsdp import wrap
    from hdet_scale.lm.model import next_token_loss

    config = HDETConfig.from_dict(hdet_settings(2))
    model, handle = wrap(tiny_llama(seed=0), config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    hdet = handle.attach(optimizer)
    tokens = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(5))
    probe_batch = (tokens[:, :-1], tokens[:, 1:])
    hdet.set_probe(batch_probe(model, probe_batch, lambda m, b: next_token_loss(m, *b)))
    records, reports = {}, []
    for step in range(1, STEPS + 1):
        optimizer.zero_grad()
        batch = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(100 * rank + step))
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        records[step] = gather_rows(full(model.parameters()))
        report = hdet.step(loss)
        if report is not None:
            reports.append(report)

    def probe_loss(flat: torch.Tensor) -> float:
        plain = tiny_llama(seed=0)
        torch.nn.utils.vector_to_parameters(flat, plain.parameters())
        with torch.no_grad():
            return float(next_token_loss(plain.eval(), *probe_batch))

    check_scores(records, reports, probe_loss, torch.arange(world) // 2)


def test_fsdp2_scores_each_replicas_averaged_shards():
    run_ranks(fsdp_run, 4)


# ------------------------------------------------------------------------------------------ DeepSpeed
def zero_run(rank: int, world: int, stage: int) -> None:
    from test_deepspeed import ds_config, tiny_model
    from test_deepspeed_distributed import build, full_fp32, micro_batch
    from test_deepspeed_distributed import train_step as deepspeed_step

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    engine = build(ds_config(stage, hdet=hdet_settings(2)), seed=rank)
    probe_batch = micro_batch(0, -1, 0, torch.float32)
    engine.hdet.ensemble.set_probe(batch_probe(engine, probe_batch, lambda m, b: m(b).float().pow(2).mean()))
    records, reports = {}, []
    engine.hdet.ensemble.add_pre_sync_hook(lambda step: records.update({step: gather_rows(full_fp32(engine))}))
    for step in range(1, STEPS + 1):
        deepspeed_step(engine, rank, step)
        if step % SYNC_INTERVAL:
            records[step] = gather_rows(full_fp32(engine))
        else:
            reports.append(engine.hdet.last_report)

    def probe_loss(flat: torch.Tensor) -> float:
        plain = tiny_model(0)
        torch.nn.utils.vector_to_parameters(flat, plain.parameters())
        with torch.no_grad():
            return float(plain(probe_batch).pow(2).mean())

    check_scores(records, reports, probe_loss, torch.arange(world) // 2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_scores_each_replicas_averaged_partitions(stage):
    run_ranks(zero_run, 4, stage)
