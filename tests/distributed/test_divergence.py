"""One diverging replica never ends a run in global gradient mode, on every engine.

NaN is put into replica 1's master weights after step 2; the sync at step 4 must leave replica 1 out, give
every rank replica 0's weights (the mean of the healthy replicas, here one), and training goes on to the next
sync with every value finite. Before the gradient mean left non-finite replicas out, replica 1's NaN gradient
reached every replica at step 3 and the sync raised FloatingPointError.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import gather_rows, run_ranks
from hdet_scale import AutoLRConfig, HDETConfig

SYNC_INTERVAL, STEPS, POISONED_AFTER = 4, 8, 2


def config(per_replica: int) -> HDETConfig:
    return HDETConfig(spread="linear", alpha=0.5, sync_interval=SYNC_INTERVAL, ranks_per_replica=per_replica,
                      gradient_mode="global", auto_lr=AutoLRConfig(mode="scale", start=0, range_test=0))


def run_and_check(rank: int, train_step: Callable[[int], None], full_weights: Callable[[], torch.Tensor],
                  poison: Callable[[], None], ensemble, replica_of: torch.Tensor) -> list[list[int]]:
    """Trains STEPS steps, poisoning replica 1 after step POISONED_AFTER; checks that the healthy replica keeps
    training (no step skipped for the other's NaN gradient) and every sync against the healthy replicas' weights
    gathered before it; returns each sync's excluded replicas."""
    before_sync: dict[int, torch.Tensor] = {}
    ensemble.add_pre_sync_hook(lambda step: before_sync.update({step: gather_rows(full_weights())}))
    excluded = []
    healthy_before = gather_rows(full_weights())[replica_of == 0][0]
    for step in range(1, STEPS + 1):
        report = train_step(step)
        if step == POISONED_AFTER:
            poison()
        healthy_now = gather_rows(full_weights())[replica_of == 0][0]
        assert torch.isfinite(healthy_now).all(), f"replica 0 caught the NaN at step {step}"
        if report is None:
            assert not torch.equal(healthy_now, healthy_before), f"replica 0 skipped step {step}"
        healthy_before = healthy_now
        if report is None:
            continue
        excluded.append(report.excluded_replicas)
        weights = gather_rows(full_weights())
        assert torch.isfinite(weights).all(), f"non-finite weights after the sync at step {step}"
        pre = before_sync[step]
        healthy = [r for r in range(int(replica_of.max()) + 1) if r not in report.excluded_replicas]
        mean = torch.stack([pre[replica_of == r][0] for r in healthy]).double().mean(0)
        assert torch.allclose(weights.double(), mean.expand_as(weights), rtol=1e-6, atol=1e-7)
    return excluded


# ------------------------------------------------------------------------------------------------ DDP
def ddp_replicas(hdet_config: HDETConfig | None = None):
    """DDP, a replica a rank (``config(1)`` unless given): the topology, the wrapped net, its AdamW and HDET."""
    from hdet_scale.engines.ddp import attach, wrap_model
    from hdet_scale.topology import ReplicaTopology

    hdet_config = hdet_config or config(1)
    topology = ReplicaTopology.build(hdet_config)
    model = wrap_model(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)), hdet_config, topology)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return topology, model, optimizer, attach(model, optimizer, hdet_config, topology=topology)


def ddp_optimizer_step(model, optimizer, rank: int, step: int, factor: float = 1.0) -> torch.Tensor:
    """One optimizer step on this rank's batch of ``step``, its loss times ``factor``; returns the loss (for
    ``hdet.step``)."""
    optimizer.zero_grad()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + step))
    loss = model(x).pow(2).mean() * factor
    loss.backward()
    optimizer.step()
    return loss


def ddp_run(rank: int, world: int) -> list[list[int]]:
    topology, model, optimizer, hdet = ddp_replicas()

    def train_step(step: int):
        return hdet.step(ddp_optimizer_step(model, optimizer, rank, step))

    def poison() -> None:
        if topology.replica_index == 1:
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("nan")

    weights = lambda: torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # noqa: E731
    return run_and_check(rank, train_step, weights, poison, hdet, torch.arange(world))


def test_ddp_global_mode_survives_a_diverged_replica():
    assert run_ranks(ddp_run, 2) == [[[1], []]] * 2


# ---------------------------------------------------------------------------------------------- FSDP2
def fsdp_run(rank: int, world: int) -> list[list[int]]:
    from test_fsdp import full, loss_of, tiny_llama

    from hdet_scale.engines.fsdp import wrap

    model, handle = wrap(tiny_llama(seed=0), config(2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    hdet = handle.attach(optimizer)

    def train_step(step: int):
        optimizer.zero_grad()
        loss = loss_of(model, rank, step)
        loss.backward()
        optimizer.step()
        return hdet.step(loss)

    def poison() -> None:
        if rank == 2:  # replica 1, shard 0: half the embedding rows, so every batch meets the NaN
            with torch.no_grad():
                next(model.parameters()).to_local().fill_(float("nan"))

    return run_and_check(rank, train_step, lambda: full(model.parameters()), poison, hdet,
                         torch.arange(world) // 2)


def test_fsdp2_global_mode_survives_a_diverged_replica():
    assert run_ranks(fsdp_run, 4) == [[[1], []]] * 4


# ------------------------------------------------------------------------------------------ DeepSpeed
def zero_run(rank: int, world: int, stage: int) -> list[list[int]]:
    from test_deepspeed import ds_config
    from test_deepspeed_distributed import build, full_fp32
    from test_deepspeed_distributed import train_step as deepspeed_step

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    hdet = {"alpha": 0.5, "spread": "linear", "sync_interval": SYNC_INTERVAL, "ranks_per_replica": 2,
            "gradient_mode": "global", "auto_lr": {"mode": "scale", "start": 0, "range_test": 0}}
    engine = build(ds_config(stage, hdet=hdet), seed=rank)

    def train_step(step: int):
        deepspeed_step(engine, rank, step)
        report = engine.hdet.last_report
        return report if report is not None and report.step == step else None

    def poison() -> None:
        if rank == 2:  # replica 1, partition 0
            with torch.no_grad():
                engine.hdet.adapter.master_tensors()[0].view(-1)[0] = float("nan")
        engine.hdet.adapter.after_average()  # the forward's copies follow the masters (collective per replica)

    return run_and_check(rank, train_step, lambda: full_fp32(engine), poison, engine.hdet.ensemble,
                         torch.arange(world) // 2)


def zero_exclusion_checkpoint_run(rank: int, world: int, stage: int, directory: str) -> dict:
    """ZeRO, 2 replicas of 2 ranks: replica 1 is left out at the first sync, which restarts its optimizer state;
    a checkpoint saved right after loads into fresh engines with every rank's weights and optimizer state."""
    from test_deepspeed import ds_config
    from test_deepspeed_distributed import build, full_fp32
    from test_deepspeed_distributed import train_step as deepspeed_step

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    hdet = {"alpha": 0.5, "spread": "linear", "sync_interval": SYNC_INTERVAL, "ranks_per_replica": 2,
            "gradient_mode": "global", "auto_lr": {"mode": "scale", "start": 0, "range_test": 0}}
    engine = build(ds_config(stage, hdet=hdet), seed=rank)
    for step in range(1, SYNC_INTERVAL + 1):
        deepspeed_step(engine, rank, step)
        if step == POISONED_AFTER and rank == 2:  # replica 1, partition 0
            with torch.no_grad():
                engine.hdet.adapter.master_tensors()[0].view(-1)[0] = float("nan")
    engine.hdet.save_checkpoint(directory, tag="after_exclusion")
    fresh = build(ds_config(stage, hdet=hdet), seed=100 + rank)
    fresh.hdet.load_checkpoint(directory, tag="after_exclusion")
    states = engine.hdet.adapter.optimizer_state_tensors()
    loaded = fresh.hdet.adapter.optimizer_state_tensors()
    return {"excluded": engine.hdet.last_report.excluded_replicas,
            "state_zero": all(not value.any() for value in states), "state_entries": len(states),
            "weights_loaded": torch.equal(full_fp32(fresh), full_fp32(engine)),
            "state_loaded": len(loaded) == len(states)
            and all(torch.equal(a, b) for a, b in zip(states, loaded, strict=True))}


@pytest.mark.parametrize("stage", [1, 3])
def test_a_zero_checkpoint_after_a_replica_was_left_out_loads(tmp_path, stage):
    results = run_ranks(zero_exclusion_checkpoint_run, 4, stage, str(tmp_path))
    assert all(result["excluded"] == [1] for result in results)
    assert [result["state_zero"] for result in results] == [False, False, True, True]
    assert results[0]["state_entries"] > 0
    assert all(result["weights_loaded"] and result["state_loaded"] for result in results)


def test_zero1_global_mode_survives_a_diverged_replica():
    assert run_ranks(zero_run, 4, 1) == [[[1], []]] * 4


def test_zero3_global_mode_survives_a_diverged_replica():
    assert run_ranks(zero_run, 4, 3) == [[[1], []]] * 4


# ------------------------------------------------------------------------- what leaves a replica out
def nan_loss_run(rank: int, world: int) -> dict:
    """DDP, 2 replicas, global gradients: replica 1's loss is NaN at step 3 (so is its gradient, which the
    replica-safe mean leaves out). Its weights and Adam state stay finite."""
    _, model, optimizer, hdet = ddp_replicas()
    report = None
    for step in range(1, SYNC_INTERVAL + 1):
        report = hdet.step(ddp_optimizer_step(model, optimizer, rank, step,
                                              float("nan") if step == 3 and rank == 1 else 1.0))
    moments = gather_rows(torch.cat([state["exp_avg"].reshape(-1) for state in optimizer.state.values()]))
    # plain values only: a tensor sent back to the test process needs its rank alive until it is read
    return {"excluded": report.excluded_replicas, "losses": report.replica_losses, "weights": report.weights,
            "moments_equal": torch.equal(moments[0], moments[1]), "moments_sum": float(moments.abs().sum())}


def test_a_non_finite_loss_alone_is_the_worst_score_not_an_exclusion():
    """It used to leave the healthy replica out and wipe its Adam state, saying it 'had non-finite values'."""
    result = run_ranks(nan_loss_run, 2)[0]
    assert result["excluded"] == []
    assert result["losses"][1] is None or not torch.isfinite(torch.tensor(result["losses"][1]))
    assert result["weights"][1] == 0.0 and result["weights"][0] == 1.0  # the worst score: no weight
    assert result["moments_equal"] and result["moments_sum"] > 0


def left_out_run(rank: int, world: int) -> dict:
    """DDP, 2 replicas: replica 1's weights turn NaN in the sync step's optimizer step, after its loss (finite, and
    lower than replica 0's) was computed."""
    _, model, optimizer, hdet = ddp_replicas()
    report = None
    for step in range(1, SYNC_INTERVAL + 1):
        loss = ddp_optimizer_step(model, optimizer, rank, step, 0.01 if rank == 1 else 1.0)
        if step == SYNC_INTERVAL and rank == 1:
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("nan")
        report = hdet.step(loss)
    return {"excluded": report.excluded_replicas, "losses": report.replica_losses, "weights": report.weights}


def test_a_replica_left_out_scores_worst_whatever_its_loss():
    """Its finite, lower loss weighed it most: the controller moved toward the value whose weights just failed."""
    result = run_ranks(left_out_run, 2)[0]
    assert result["excluded"] == [1] and result["losses"][1] < result["losses"][0]
    assert result["weights"] == [1.0, 0.0]


def averaged_state_exclusion_run(rank: int, world: int) -> dict:
    """DDP, 2 replicas, local gradients, ``average_optimizer_state``: replica 1's weights turn NaN after step 2, so
    its gradient and Adam moments do at step 3; the sync at step 4 leaves it out."""
    import dataclasses

    _, model, optimizer, hdet = ddp_replicas(dataclasses.replace(config(1), gradient_mode="local",
                                                                 average_optimizer_state=True))
    moments = lambda: gather_rows(torch.cat([state[key].reshape(-1) for state in optimizer.state.values()  # noqa: E731
                                             for key in ("exp_avg", "exp_avg_sq")]))
    before: dict[int, torch.Tensor] = {}
    hdet.add_pre_sync_hook(lambda step: before.update({step: moments()}))
    report = None
    for step in range(1, SYNC_INTERVAL + 1):
        report = hdet.step(ddp_optimizer_step(model, optimizer, rank, step))
        if step == POISONED_AFTER and rank == 1:
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("nan")
    after, synced = moments(), before[SYNC_INTERVAL]
    return {"excluded": report.excluded_replicas, "replica_1_finite_before": bool(synced[1].isfinite().all()),
            "received_replica_0s": [torch.equal(row, synced[0]) for row in after]}


def test_a_replica_left_out_keeps_the_averaged_optimizer_state_it_received():
    """With the optimizer state averaged too, a replica left out receives the healthy replicas' moments; it used
    to zero them right after (a fresh Adam), so the replicas' states differed after the sync."""
    result = run_ranks(averaged_state_exclusion_run, 2)[0]
    assert result["excluded"] == [1] and not result["replica_1_finite_before"]
    assert result["received_replica_0s"] == [True, True]


def sharded_exclusion_run(rank: int, world: int, directory: str) -> dict:
    """FSDP2, 2 replicas x 2 shards, global gradients: one shard of replica 1 turns non-finite just before the
    sync at step 4 (its other shard is finite). The whole replica is left out, both its ranks restart their Adam
    state with every entry kept, and a checkpoint at that sync loads."""
    from pathlib import Path

    from test_fsdp import full, loss_of, tiny_llama

    from hdet_scale.engines.fsdp import wrap
    from hdet_scale.engines.fsdp_checkpoint import load_checkpoint, save_checkpoint

    def build():
        model, handle = wrap(tiny_llama(seed=0), config(2))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        return model, optimizer, handle, handle.attach(optimizer)

    model, optimizer, handle, hdet = build()
    before: dict[str, torch.Tensor] = {}

    def poison(step: int) -> None:
        before["weights"] = gather_rows(full(model.parameters()))
        if rank == 2:
            with torch.no_grad():
                next(model.parameters()).to_local()[0, 0] = float("inf")

    hdet.add_pre_sync_hook(poison)
    report = None
    for step in range(1, SYNC_INTERVAL + 1):
        optimizer.zero_grad()
        loss = loss_of(model, rank, step)
        loss.backward()
        optimizer.step()
        report = hdet.step(loss)
    healthy_weights = before["weights"][0]
    def local(state: dict) -> list[torch.Tensor]:  # the moments are DTensors, the step count is not
        return [value.to_local() if hasattr(value, "to_local") else value for value in state.values()]

    states = [value for state in optimizer.state.values() for value in local(state)]
    path = Path(directory) / "ckpt"
    save_checkpoint(path, model, optimizer, handle)
    fresh_model, fresh_optimizer, fresh_handle, _ = build()
    load_checkpoint(path, fresh_model, fresh_optimizer, fresh_handle)
    loaded = [value for state in fresh_optimizer.state.values() for value in local(state)]
    return {"excluded": report.excluded_replicas,
            "weights_are_replica_0s": torch.equal(full(model.parameters()), healthy_weights),
            "state_zero": all(not value.any() for value in states), "state_entries": len(states),
            "loaded_equal": all(torch.equal(a, b) for a, b in zip(states, loaded, strict=True))
            and len(loaded) == len(states)}


def test_a_replica_is_left_out_whole_and_its_checkpoint_loads(tmp_path):
    """Finiteness was decided per rank: the finite shard of a bad replica was averaged in. And the excluded ranks
    cleared their optimizer state, so a checkpoint at that sync missed its keys and could not be loaded."""
    results = run_ranks(sharded_exclusion_run, 4, str(tmp_path))
    assert all(result["excluded"] == [1] for result in results)
    assert all(result["weights_are_replica_0s"] for result in results)
    assert [result["state_zero"] for result in results] == [False, False, True, True]
    assert len({result["state_entries"] for result in results}) == 1 and results[0]["state_entries"] > 0
    assert all(result["loaded_equal"] for result in results)


# ------------------------------------------------------------------------------------- constant buffers
class MaskedNet(nn.Module):
    """A net with BatchNorm statistics (averaged), an additive mask buffer holding -inf by design (a constant) and an
    observer's running minimum, +inf until the first forward (as a quantization observer's)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(8, 4), nn.BatchNorm1d(4)
        self.register_buffer("mask", torch.tensor([0.0, 0.0, -math.inf, 0.0]))
        self.register_buffer("floor_mask", torch.tensor([0.0, torch.finfo(torch.float32).min, 0.0, 0.0]))
        self.register_buffer("seen_min", torch.tensor(math.inf))
        self.register_buffer("rank_0_min", torch.tensor(math.inf))  # an observer only rank 0's forward reaches
        self.register_buffer("rank_1_mask", torch.tensor(0.0))  # -inf on rank 1 alone when HDET attaches

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen_min.copy_(torch.minimum(self.seen_min, x.min()))
            if dist.get_rank() == 0:
                self.rank_0_min.copy_(torch.minimum(self.rank_0_min, x.min()))
        return (self.norm(self.linear(x)) + self.mask + self.floor_mask).softmax(-1)


def masked_run(rank: int, world: int) -> dict:
    from hdet_scale.engines.ddp import attach, wrap_model
    from hdet_scale.probe import batch_probe
    from hdet_scale.topology import ReplicaTopology

    hdet_config = HDETConfig(spread="linear", alpha=0.5, sync_interval=SYNC_INTERVAL,
                             auto_lr=AutoLRConfig(mode="scale", start=0, range_test=0, average_window=0.5))
    topology = ReplicaTopology.build(hdet_config)
    model = wrap_model(MaskedNet(), hdet_config, topology, broadcast_buffers=False)  # each rank its own
    if rank == 1:  # as in a model not broadcast before HDET attached (the wrap broadcasts rank 0's)
        model.module.rank_1_mask.fill_(-math.inf)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    hdet = attach(model, optimizer, hdet_config, topology=topology)
    hdet.set_probe(batch_probe(model, torch.ones(4, 8), lambda m, x: m(x)[:, 0].mean()))
    reports, after_first_sync = [], None
    for step in range(2 * SYNC_INTERVAL):  # the observer is averaged from the first sync, which finds it finite
        optimizer.zero_grad()
        loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + step)))[:, 0].mean()
        loss.backward()
        optimizer.step()
        reports.append(hdet.step(loss))
        if step == SYNC_INTERVAL - 1:
            after_first_sync = gather_rows(model.module.seen_min.reshape(1)).reshape(-1).tolist()
        if step == SYNC_INTERVAL:  # the mask rebuilt, -inf elsewhere: still a constant
            model.module.mask.copy_(torch.tensor([0.0, -math.inf, 0.0, 0.0]))
    inner = model.module
    return {"excluded": reports[-1].excluded_replicas, "probe": reports[-1].probe_losses,
            "seen_min_after_first_sync": after_first_sync,
            "mask": inner.mask.tolist(), "floor_mask": inner.floor_mask.tolist(),
            "running_mean": gather_rows(inner.norm.running_mean).tolist(),
            "seen_min": gather_rows(inner.seen_min.reshape(1)).reshape(-1).tolist(),
            "rank_0_min": gather_rows(inner.rank_0_min.reshape(1)).reshape(-1).tolist(),
            "rank_1_mask": gather_rows(inner.rank_1_mask.reshape(1)).reshape(-1).tolist()}


def test_a_buffer_non_finite_from_the_start_is_a_constant_until_it_changes():
    first, second = run_ranks(masked_run, 2)
    assert first["excluded"] == [] and all(math.isfinite(loss) for loss in first["probe"])
    assert first["mask"] == second["mask"] == [0.0, -math.inf, 0.0, 0.0]  # as rebuilt, never averaged
    # a mask of the dtype's lowest value: its replicas' sum overflowed to -inf, then every replica was excluded
    assert first["floor_mask"] == second["floor_mask"] == [0.0, torch.finfo(torch.float32).min, 0.0, 0.0]
    rows = first["running_mean"]
    assert rows[0] == rows[1]  # the statistics, finite, are averaged across the replicas
    # the observer changed since the start: averaged too, so the replicas are one model again, from the sync that
    # found it finite on (it was left as each replica had it until the next)
    low = first["seen_min"]
    assert math.isfinite(low[0]) and low[0] == low[1]
    low = first["seen_min_after_first_sync"]
    assert math.isfinite(low[0]) and low[0] == low[1]
    # finite on rank 0 alone: a constant still on both (rank 0 averaging it alone would misalign the buckets)
    low = first["rank_0_min"]
    assert math.isfinite(low[0]) and low[1] == math.inf
    # -inf on rank 1 alone at the start: a constant on both too, left as each rank has it
    assert first["rank_1_mask"] == [0.0, -math.inf]


class DroppingNet(nn.Module):
    """An observer buffer, +inf at the start, that rank 0's forward fills in and rank 1's removes (a module that
    rebuilds its buffers on its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.register_buffer("seen_min", torch.tensor(math.inf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 0:
            self.seen_min.copy_(torch.minimum(self.seen_min, x.min()))
        elif "seen_min" in self._buffers:
            del self._buffers["seen_min"]
        return self.linear(x)


def dropped_buffer_run(rank: int, world: int) -> list[float]:
    from hdet_scale.engines.ddp import attach, wrap_model
    from hdet_scale.topology import ReplicaTopology

    config = HDETConfig(spread="linear", alpha=0.5, sync_interval=SYNC_INTERVAL,
                        auto_lr=AutoLRConfig(mode="scale", start=0, range_test=0))
    topology = ReplicaTopology.build(config)
    model = wrap_model(DroppingNet(), config, topology, broadcast_buffers=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    hdet = attach(model, optimizer, config, topology=topology)
    for step in range(2 * SYNC_INTERVAL):
        optimizer.zero_grad()
        loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + step))).pow(2).mean()
        loss.backward()
        optimizer.step()
        hdet.step(loss)
    return [float(buffer) for buffer in model.module.buffers()]


def test_a_constant_gone_from_some_ranks_stays_one_on_all():
    """Gone on rank 1, filled in on rank 0: rank 1 took the missing buffer as finite, both ranks turned it into an
    averaged one, and rank 0 averaged it alone, waiting for rank 1 in an all-reduce it never joined."""
    first, second = run_ranks(dropped_buffer_run, 2, timeout=120)
    assert len(first) == 1 and math.isfinite(first[0]) and second == []  # each kept its own, nothing averaged
