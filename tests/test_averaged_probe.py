"""The controller's weight-based signals on 2 replicas of every engine, against independent computations.

Averaged weights (``auto_lr.average_window``): the running mean by hand in one process, then each sync's probe
scores against each replica's full weights recorded at the window's steps, averaged here, loaded into a plain
copy of the model and scored on the same probe batch. Displacement (``auto_lr.displacement``): the cosine of
consecutive sync-to-sync moves, against the full averaged weights gathered after each sync. Progress
(``auto_lr.hypergradient='progress'``): the probe loss each interval started from, against the full averaged
weights of the sync before scored in a plain copy, and the Delta the controller took from it.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from distributed import gather_rows, run_ranks
from hdet_scale.probe import batch_probe
from hdet_scale.weight_average import WindowAverage

SYNC_INTERVAL, STEPS = 4, 12  # three syncs: the displacement signal speaks at the third
WINDOW = 0.5  # the last 2 steps of every interval
DISPLACEMENT = 0.1


def test_window_average_by_hand():
    window = WindowAverage(WINDOW, SYNC_INTERVAL)
    tensor = torch.zeros(3)
    refreshed = []
    for since_sync, value in enumerate([1.0, 2.0, 4.0, 8.0], start=1):
        tensor.fill_(value)
        window.observe(since_sync, lambda: [tensor])
    assert window.count == 2  # steps 3 and 4 of the interval
    with window.swapped_in([tensor], lambda: refreshed.append(tensor.clone())) as swapped:
        assert swapped and torch.equal(tensor, torch.full((3,), 6.0))  # (4 + 8) / 2
    assert torch.equal(tensor, torch.full((3,), 8.0)) and len(refreshed) == 2  # its own values back, refreshed
    with window.swapped_in([tensor], lambda: None):
        assert torch.equal(tensor, torch.full((3,), 6.0))  # the mean survives being swapped in and out
    assert torch.equal(tensor, torch.full((3,), 8.0))
    window.reset()
    with window.swapped_in([tensor], lambda: refreshed.append(None)) as swapped:
        assert not swapped  # nothing averaged since the reset (e.g. an early sync)
    assert len(refreshed) == 2
    assert not WindowAverage(0.0, SYNC_INTERVAL).enabled


def hdet_settings(per_replica: int) -> dict:
    return {"alpha": 0.5, "spread": "log", "sync_interval": SYNC_INTERVAL, "ranks_per_replica": per_replica,
            "auto_lr": {"mode": "log", "hypergradient": "progress", "warmup_steps": 0, "stop_steps": STEPS,
                        "initial_scale": 1.0, "average_window": WINDOW, "displacement": DISPLACEMENT}}


def test_displacement_cosine_by_hand():
    from hdet_scale.displacement import DisplacementSignal

    signal = DisplacementSignal()
    weights = [torch.zeros(2), torch.zeros(1)]
    path = [([0.0, 0.0], [0.0]), ([1.0, 0.0], [0.0]), ([2.0, 1.0], [0.0]), ([1.0, 1.0], [1.0])]
    seen = []
    for first, second in path:
        weights[0].copy_(torch.tensor(first))
        weights[1].copy_(torch.tensor(second))
        seen.append(signal.update(weights, None))
    # moves: (1, 0, 0), (1, 1, 0), (-1, 0, 1): cos 1/sqrt(2), then -1 / (sqrt(2) sqrt(2)) = -1/2
    assert seen[:2] == [None, None]
    assert seen[2] == pytest.approx(1 / 2**0.5) and seen[3] == pytest.approx(-0.5)
    signal.reset()
    assert signal.update(weights, None) is None


def check_displacement(after_sync: list[torch.Tensor], reports: list) -> None:
    """The last report's displacement against the full averaged weights after each sync."""
    assert [report.displacement for report in reports[:2]] == [None, None]
    first, second = after_sync[1] - after_sync[0], after_sync[2] - after_sync[1]
    expected = float(torch.dot(first.double(), second.double()) / (first.double().norm() * second.double().norm()))
    assert reports[2].displacement == pytest.approx(expected, rel=1e-4, abs=1e-6)


def check_progress(after_sync: list[torch.Tensor], reports: list, probe_loss) -> None:
    """Each interval's start probe loss against the full averaged weights of the sync before, and the Delta the
    controller moved by: the progress hypergradient of the replicas' probe losses, plus the displacement's push.
    The first interval has no start: the controller does not move."""
    from hdet_scale.controller import progress_hypergradient

    assert reports[0].start_probe_loss is None and not reports[0].controller_updated
    for before, report in zip(after_sync, reports[1:], strict=False):
        assert report.start_probe_loss == pytest.approx(probe_loss(before), rel=1e-5), report.step
        lr = report.values["lr/0"]
        expected = progress_hypergradient(report.probe_losses, report.start_probe_loss, lr["replica_multipliers"])
        assert report.controller_updated
        assert lr["delta"] == pytest.approx(expected + DISPLACEMENT * (report.displacement or 0.0), abs=1e-12)


def check_scores(records: dict[int, torch.Tensor], reports: list, probe_loss, replica_of: torch.Tensor,
                 windows: tuple[int, ...] = (2, 2, 2)) -> None:
    """``records[step]``: every rank's full weights after that step (before its sync); each report's probe losses
    must be the probe loss of each replica's weights averaged over the window's steps (the last ``windows[i]``
    steps of interval i)."""
    for report, size in zip(reports, windows, strict=True):
        window = list(range(report.step - size + 1, report.step + 1))
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


# A window growing from a quarter of the interval at the controller's start (step 0) to three quarters at its
# stop (step 12): the interval after the sync at step t averages ceil(4 x (0.25 + 0.5 t / 12)) steps: 1, 2, 3.
GROWING = {"average_window": 0.25, "average_window_late": 0.75, "stop_steps": STEPS}


def ddp_run(rank: int, world: int, growing: bool) -> None:
    from hdet_scale import HDETConfig, ReplicaTopology
    from hdet_scale.engines.ddp import attach, wrap_model

    settings = hdet_settings(1)
    if growing:
        settings["auto_lr"].update(GROWING)
    config = HDETConfig.from_dict(settings)
    topology = ReplicaTopology.build(config)
    model = wrap_model(mlp(), config, topology)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    hdet = attach(model, optimizer, config, topology=topology)
    hdet.set_probe(batch_probe(model, PROBE_X, lambda m, x: m(x).pow(2).mean()))
    records, reports, after_sync = {}, [], []
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
            after_sync.append(after[0])
            if step == 2 * SYNC_INTERVAL:  # a checkpoint keeps the next interval's start loss
                assert hdet.state_dict()["start_probe_loss"] == pytest.approx(mlp_probe_loss(after[0]), rel=1e-5)
    assert len(reports) == 3
    check_scores(records, reports, mlp_probe_loss, torch.arange(world), (1, 2, 3) if growing else (2, 2, 2))
    check_displacement(after_sync, reports)
    check_progress(after_sync, reports, mlp_probe_loss)


@pytest.mark.parametrize("growing", [False, True])
def test_ddp_scores_each_replicas_averaged_weights(growing):
    run_ranks(ddp_run, 2, growing)


def progress_timing_run(rank: int, world: int, with_probe: bool) -> None:
    """T = 4, the controller from step 10 to 12, a manual sync at step 10 (off the grid of 4). The start of the
    interval a sync ends is scored only where that sync updates: none at step 4 (the next sync, 8, is in the
    warm-up), one at step 8 and at the manual sync (their next sync, 12, updates), none at 12 (past the stop)."""
    from hdet_scale import HDETConfig, ReplicaTopology
    from hdet_scale.engines.ddp import attach, wrap_model

    config = HDETConfig.from_dict({"alpha": 0.5, "sync_interval": SYNC_INTERVAL, "ranks_per_replica": 1, "auto_lr": {
        "hypergradient": "progress", "warmup_steps": 10, "stop_steps": 12, "initial_scale": 1.0}})
    topology = ReplicaTopology.build(config)
    model = wrap_model(mlp(), config, topology)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    hdet = attach(model, optimizer, config, topology=topology)
    if with_probe:
        hdet.set_probe(batch_probe(model, PROBE_X, lambda m, x: m(x).pow(2).mean()))
    reports = {}
    for step in range(1, 13):
        optimizer.zero_grad()
        loss = model(torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * rank + step))).pow(2).mean()
        loss.backward()
        optimizer.step()
        if not with_probe:
            with pytest.raises(ValueError, match=r"hypergradient='progress' scores the replicas' progress on a probe "
                                                 r"batch: set one with hdet.set_probe before the first step"):
                hdet.step(loss)
            return
        report = hdet.step(loss)
        if step == 10:
            report = hdet.sync()
            after_manual = gather_rows(torch.nn.utils.parameters_to_vector(model.parameters()).detach())[0]
        if report is not None:
            reports[report.step] = report
    assert sorted(reports) == [4, 8, 10, 12]
    assert [reports[step].start_probe_loss is not None for step in (4, 8, 10, 12)] == [False, False, True, True]
    assert [reports[step].controller_updated for step in (4, 8, 10, 12)] == [False, False, True, True]
    assert reports[12].start_probe_loss == pytest.approx(mlp_probe_loss(after_manual), rel=1e-5)
    assert hdet.state_dict()["start_probe_loss"] is None


@pytest.mark.parametrize("with_probe", [True, False])
def test_the_progress_start_is_scored_where_the_next_sync_updates(with_probe):
    run_ranks(progress_timing_run, 2, with_probe)


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
    records, reports, after_sync = {}, [], []
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
            after_sync.append(full(model.parameters()))

    def probe_loss(flat: torch.Tensor) -> float:
        plain = tiny_llama(seed=0)
        torch.nn.utils.vector_to_parameters(flat, plain.parameters())
        with torch.no_grad():
            return float(next_token_loss(plain.eval(), *probe_batch))

    check_scores(records, reports, probe_loss, torch.arange(world) // 2)
    check_displacement(after_sync, reports)
    check_progress(after_sync, reports, probe_loss)


def test_fsdp2_scores_each_replicas_averaged_shards():
    run_ranks(fsdp_run, 4)


# ------------------------------------------------------------------------------------------ DeepSpeed
def zero_run(rank: int, world: int, stage: int) -> None:
    from test_deepspeed import build, ds_config, full_fp32, micro_batch, tiny_model
    from test_deepspeed import train_step as deepspeed_step

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    engine = build(ds_config(stage, hdet=hdet_settings(2)), seed=rank)
    probe_batch = micro_batch(0, -1, 0, torch.float32)
    engine.hdet.ensemble.set_probe(batch_probe(engine, probe_batch, lambda m, b: m(b).float().pow(2).mean()))
    records, reports, after_sync = {}, [], []
    engine.hdet.ensemble.add_pre_sync_hook(lambda step: records.update({step: gather_rows(full_fp32(engine))}))
    for step in range(1, STEPS + 1):
        deepspeed_step(engine, rank, step)
        if step % SYNC_INTERVAL:
            records[step] = gather_rows(full_fp32(engine))
        else:
            reports.append(engine.hdet.last_report)
            after_sync.append(full_fp32(engine))

    def probe_loss(flat: torch.Tensor) -> float:
        plain = tiny_model(0)
        torch.nn.utils.vector_to_parameters(flat, plain.parameters())
        with torch.no_grad():
            return float(plain(probe_batch).pow(2).mean())

    check_scores(records, reports, probe_loss, torch.arange(world) // 2)
    check_displacement(after_sync, reports)
    check_progress(after_sync, reports, probe_loss)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_scores_each_replicas_averaged_partitions(stage):
    run_ranks(zero_run, 4, stage)
