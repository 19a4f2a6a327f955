"""The shipped ds_configs/: every JSON parses and validates, and every DeepSpeed JSON trains with its HDET JSON.

The end-to-end run launches each pair as the README's command does (``--deepspeed_config`` and
``--hdet_config``) on 4 CPU gloo ranks posing as 2 nodes of 2 ranks, so ``ranks_per_replica: "auto"`` gives
2 replicas of 2 ZeRO shards (and ``hdet_zero0.json`` 4 replicas of 1). Only what a 4-step CPU run must change
is overridden: the scheduler's length, the sync interval, the controller's start at the given LR (no LR range
test) and the metrics path; ``train_batch_size`` is added to check how HDET splits it.

This file holds the tests on gloo ranks; the tests that start no process are in tests/unit/test_ds_configs.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import pytest
import torch
from deepspeed.runtime import lr_schedules
from test_ds_configs import MATCHING_HDET, ZERO_STAGE, read
from torch import nn
from torch.nn import functional
from torch.utils.data import TensorDataset

from distributed import gather_rows, run_ranks
from hdet_scale import multipliers
from hdet_scale.engines.deepspeed import add_config_arguments, initialize

# ------------------------------------------------------------------------------------ end to end
RANKS_PER_NODE, WORLD, STEPS, SYNC_INTERVAL = 2, 4, 4, 2


def optimizer_wrapper(ds_name: str) -> type:
    """The optimizer wrapper DeepSpeed builds for each shipped config (ZeRO-1 with fp32 gradient accumulation:
    BF16_Optimizer)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return {"zero0_fp32.json": torch.optim.AdamW, "zero1_bf16.json": BF16_Optimizer,
            "zero2_bf16.json": DeepSpeedZeroOptimizer, "zero3_bf16.json": DeepSpeedZeroOptimizer_Stage3}[ds_name]


class TinyRegression(nn.Module):
    """The middle layer (65,536 weights) is above the ZeRO-3 config's stage3_param_persistence_threshold, so
    ZeRO-3 partitions it; the outer layers stay persistent: both paths of the ZeRO-3 average run."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        prediction = self.net(inputs.to(self.net[0].weight.dtype))
        return functional.mse_loss(prediction.float(), targets)


def train_launched(ds_name: str, ds_path: str, hdet_path: str) -> list[float]:
    """One launch as the README's command makes it, checked at every optimizer step; returns the losses."""
    args = add_config_arguments(argparse.ArgumentParser()).parse_args(
        ["--deepspeed_config", ds_path, "--hdet_config", hdet_path])
    ds_config = json.loads(Path(ds_path).read_text())
    micro, accumulation = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    samples = torch.Generator().manual_seed(0)
    inputs = torch.randn(micro * accumulation * WORLD * STEPS, 16, generator=samples)
    dataset = TensorDataset(inputs, inputs[:, :1].sin() + 0.1 * torch.randn(len(inputs), 1, generator=samples))
    model = TinyRegression()
    engine, _, loader, scheduler = initialize(args=args, model=model, model_parameters=model.parameters(),
                                              training_data=dataset)
    hdet, stage = engine.hdet, ZERO_STAGE[ds_name]
    assert type(engine.basic_optimizer) is torch.optim.AdamW  # the JSON's optimizer, nothing JIT-compiled
    assert type(engine.optimizer) is optimizer_wrapper(ds_name)
    assert isinstance(scheduler, lr_schedules.WarmupCosineLR)
    precision = torch.bfloat16 if ds_name.endswith("_bf16.json") else torch.float32
    assert all(param.dtype == precision for param in engine.module.parameters())
    per_replica = 1 if stage == 0 else RANKS_PER_NODE
    assert hdet.topology.ranks_per_replica == per_replica
    assert engine.train_batch_size() == ds_config["train_batch_size"] // hdet.topology.num_replicas
    full_numel = sum(getattr(param, "ds_numel", param.numel()) for param in engine.module.parameters())
    shard_numel = sum(master.numel() for master in hdet.adapter.master_tensors())
    assert full_numel / per_replica <= shard_numel < 1.2 * full_numel / per_replica  # sharded inside the replica

    def masters() -> torch.Tensor:
        """What a sync averages: the masters' values (ZeRO-3: without its uninitialized padding) and the
        buffers, zero-filled to the same length on every rank."""
        values = torch.cat([tensor.detach().float().reshape(-1) for tensor in hdet.adapter.averaged_tensors()])
        buffers = sum(buffer.numel() for buffer in engine.module.buffers() if buffer.is_floating_point())
        return torch.cat([values, values.new_zeros(shard_numel + buffers - values.numel())])

    pre_sync_rows: list[torch.Tensor] = []
    ensemble_step = hdet.ensemble.step

    def recording_step(*step_args, **step_kwargs):
        pre_sync_rows.append(gather_rows(masters()))  # after the optimizer step, before any average
        return ensemble_step(*step_args, **step_kwargs)

    hdet.ensemble.step = recording_step
    replicas = [hdet.topology.replica_ranks(index) for index in range(hdet.topology.num_replicas)]
    losses, syncs, diverged_steps = [], 0, 0
    for inputs_batch, targets in loader:
        boundary = engine.is_gradient_accumulation_boundary()
        if boundary:
            held = gather_rows(torch.tensor([hdet.lr_multiplier()], dtype=torch.float64))[:, 0]
            assert sorted(held[[ranks[0] for ranks in replicas]].tolist()) == pytest.approx(
                multipliers(len(replicas), hdet.config.spread_alpha(lr=True), hdet.config.spread))  # one per replica
            lr_used = hdet.current_lrs()[0]
            # Four steps give the controller no update (its stop is at step 1 of 4): the LR stays at its start.
            start = hdet.ensemble.config.auto_lr.initial_scale
            assert lr_used == pytest.approx(engine.get_lr()[0] * start * hdet.lr_multiplier())
        loss = engine(inputs_batch, targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if not boundary:
            continue
        if stage > 0:  # ZeRO-0 in fp32 keeps no norm
            norms = gather_rows(torch.tensor([float(engine.get_global_grad_norm())], dtype=torch.float64))
            # Global mode: one gradient for all replicas, so one norm and one clipping coefficient on every rank.
            assert torch.allclose(norms, norms[:1].expand_as(norms), rtol=1e-6, atol=0)
        pre, post = pre_sync_rows[-1], gather_rows(masters())
        if lr_used > 0:  # DeepSpeed's warm-up schedules train their first step(s) at LR 0
            diverged_steps += 1
            for ranks in replicas[1:]:  # the LR spread makes the replicas diverge between syncs
                assert not torch.allclose(pre[ranks], pre[replicas[0]])
        if hdet.global_step % SYNC_INTERVAL:
            assert torch.equal(pre, post)
            continue
        syncs += 1
        mean = torch.stack([pre[ranks].double() for ranks in replicas]).mean(0)  # the same shard positions
        for ranks in replicas:
            assert torch.allclose(post[ranks].double(), mean, rtol=1e-6, atol=1e-7)
        assert hdet.last_report is not None and hdet.last_report.step == hdet.global_step
    assert engine.global_steps == hdet.global_step == STEPS and syncs == STEPS // SYNC_INTERVAL
    assert diverged_steps >= 2, "too few steps at a non-zero LR to see the spread"
    assert hdet.gradient_bytes_across_replicas > 0  # global gradient mode crossed replicas every step
    return losses


def launch_all(rank: int, world: int, launches: list[tuple[str, str, str]]) -> dict[str, list[float]]:
    # Two "nodes" of two ranks, as the deepspeed launcher would describe them.
    os.environ.update(LOCAL_WORLD_SIZE=str(RANKS_PER_NODE), LOCAL_RANK=str(rank % RANKS_PER_NODE))
    return {ds_name: train_launched(ds_name, ds_path, hdet_path) for ds_name, ds_path, hdet_path in launches}


def test_every_config_pair_trains_with_hdet_on_cpu(tmp_path):
    """Every DeepSpeed JSON with its HDET JSON, in one 4-rank launch (the imports dominate its time)."""
    launches = []
    for ds_name, hdet_name in MATCHING_HDET.items():
        ds_config = read(ds_name)
        # DeepSpeed's meaning, kept by HDET: the batch of one optimizer step over all ranks.
        ds_config["train_batch_size"] = (ds_config["train_micro_batch_size_per_gpu"]
                                         * ds_config["gradient_accumulation_steps"] * WORLD)
        # A schedule as long as this run, so the LR is not still near zero in its warm-up.
        ds_config["scheduler"]["params"].update(total_num_steps=STEPS, warmup_num_steps=2)
        # 4 steps hold no sync inside the controller's window (steps 0-1): it would never leave its low start,
        # which HDET refuses; starting at the given LR keeps every other setting as shipped. Nor do they hold the
        # shipped 100-step LR range test (its steps come before the run's): none, as a 4-step CPU run must.
        shipped = read(hdet_name)
        hdet_config = {**shipped, "sync_interval": SYNC_INTERVAL,
                       "auto_lr": {**shipped["auto_lr"], "initial_scale": 1.0, "range_test": 0},
                       "metrics_path": str(tmp_path / f"{Path(ds_name).stem}_metrics.jsonl")}
        ds_path, hdet_path = tmp_path / ds_name, tmp_path / f"{Path(ds_name).stem}_{hdet_name}"
        ds_path.write_text(json.dumps(ds_config))
        hdet_path.write_text(json.dumps(hdet_config))
        launches.append((ds_name, str(ds_path), str(hdet_path)))

    losses = run_ranks(launch_all, WORLD, launches)

    for ds_name in MATCHING_HDET:
        micro_steps = STEPS * read(ds_name)["gradient_accumulation_steps"]
        assert all(len(rank[ds_name]) == micro_steps and all(map(math.isfinite, rank[ds_name])) for rank in losses)
        metrics = tmp_path / f"{Path(ds_name).stem}_metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert [record["step"] for record in records] == [2, 4]
        replicas = WORLD // (1 if ZERO_STAGE[ds_name] == 0 else RANKS_PER_NODE)
        assert all(len(record["replica_losses"]) == replicas for record in records)
