"""The DeepSpeed adapter on 4 real gloo ranks with real DeepSpeed ZeRO 0-3 (no mocks).

ZeRO-0 runs the paper's setting (every rank a replica: 4 replicas); ZeRO-1/2/3 run 2 replicas x 2 ranks,
each replica sharding the model over its own ranks. A DeepSpeed launch costs seconds here, so each launch
builds several engines and checks many properties.

This file holds the tests on gloo ranks; the tests that start no process are in tests/unit/test_deepspeed.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_deepspeed import MICRO_BATCHES, ds_config, tiny_model
from torch import nn

from distributed import gather_rows, run_ranks
from hdet_scale import multipliers
from hdet_scale.comm import PeerFailed
from hdet_scale.engines import deepspeed as hdet_deepspeed
from hdet_scale.probe import batch_probe

WORLD = 4


def build(config: dict, *, seed: int, plain: bool = False, lr: float = 0.01):
    model = tiny_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    if plain:
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    else:
        engine, *_ = hdet_deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def micro_batch(rank: int, step: int, micro: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10_000 * rank + 10 * step + micro)
    return torch.randn(2, 8, generator=generator).to(dtype)


def train_step(engine, rank: int, step: int, synced: list[bool] | None = None) -> float:
    """One optimizer step of MICRO_BATCHES micro-batches; returns the mean micro-batch loss (and appends
    ``engine.hdet.synced`` after every micro-batch to ``synced``)."""
    dtype = next(engine.module.parameters()).dtype
    losses = []
    for micro in range(MICRO_BATCHES):
        loss = engine(micro_batch(rank, step, micro, dtype)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if synced is not None:
            synced.append(engine.hdet.synced)
    return sum(losses) / len(losses)


def full_fp32(engine) -> torch.Tensor:
    """The replica's full fp32 master parameters, gathered through DeepSpeed's public API where it has one."""
    from deepspeed.utils import safe_get_full_fp32_param

    params = list(engine.module.parameters())
    masters = [safe_get_full_fp32_param(param) for param in params]
    if all(master is not None for master in masters):  # ZeRO-1/2/3 (collective on ZeRO-3)
        return torch.cat([master.detach().reshape(-1) for master in masters])
    if isinstance(engine.optimizer, torch.optim.Optimizer):  # ZeRO-0 fp32: the parameters are the masters
        return torch.cat([param.detach().reshape(-1) for param in params])
    # ZeRO-0 bf16 with a torch optimizer: DeepSpeed's FP16_UnfusedOptimizer keeps one fp32 copy per parameter.
    return torch.cat([master.detach().reshape(-1) for group in engine.optimizer.fp32_groups for master in group])


def module_values(engine) -> torch.Tensor:
    """The low-precision parameters the forward pass uses (ZeRO-3: gathered)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):
        return torch.cat([param.detach().float().reshape(-1) for param in params])


def record_used_lrs(engine) -> list[float]:
    """A list that receives param group 0's LR inside every base-optimizer step, i.e. the LR really used
    (this hook runs after HDET's, which scales the LR for the step's duration)."""
    used: list[float] = []
    engine.basic_optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: used.append(optimizer.param_groups[0]["lr"]))
    return used


def record_before_sync(engine) -> dict[int, torch.Tensor]:
    """Step -> every rank's full fp32 parameters at the start of that sync, before averaging."""
    captured: dict[int, torch.Tensor] = {}
    engine.hdet.ensemble.add_pre_sync_hook(lambda step: captured.update({step: gather_rows(full_fp32(engine))}))
    return captured


def record_averaged_gradients(engine) -> tuple[list[torch.Tensor], ...]:
    """At each step (the last step's kept): ZeRO-1/2's gradient views, their groups' flat partitions where
    DeepSpeed keeps one, and the tensors HDET averages across replicas."""
    views: list[torch.Tensor] = []
    flats: list[torch.Tensor] = []
    averaged: list[torch.Tensor] = []
    gradients = engine.hdet.adapter.gradient_tensors

    def recording() -> list[torch.Tensor]:
        groups = [grads for grads in getattr(engine.optimizer, "averaged_gradients", {}).values() if grads]
        views[:] = [grad for grads in groups for grad in grads]
        flats[:] = [grads.flat_partition for grads in groups if getattr(grads, "flat_partition", None) is not None]
        averaged[:] = gradients()
        return averaged

    engine.hdet.adapter.gradient_tensors = recording
    return views, flats, averaged


def probe_on_plain_model(flat_weights: torch.Tensor, batch: torch.Tensor) -> float:
    """The probe loss of a replica's weights, on a plain model in the batch's precision."""
    model = tiny_model(0).to(batch.dtype)
    torch.nn.utils.vector_to_parameters(flat_weights.to(batch.dtype), model.parameters())
    with torch.no_grad():
        return float(model(batch).float().pow(2).mean())


def inverse_step(step: int) -> float:
    return 1.0 / (1 + step)


# ------------------------------------------------------------------------------------- fan-out / converge
def fanout(rank: int, world: int, stage: int) -> list[int]:
    """Both gradient modes on one stage (in fp32 or bf16): divergence between syncs, averaging at
    syncs against an independent mean, multipliers and the LR the optimizer really used."""
    per_replica = 1 if stage == 0 else 2
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # as on 2 nodes of 2 ranks: ranks_per_replica "auto" is a node on ZeRO-1/2/3
    replicas = world // per_replica
    replica_of = torch.arange(world) // per_replica
    # (gradient mode, bf16, fp32 gradient accumulation): in bf16 with fp32 accumulation ZeRO-1 is DeepSpeed's
    # BF16_Optimizer, a wrapper of its own, and ZeRO-2 keeps one flat gradient partition of fixed layout per group
    # (fp32 ZeRO-2 in global mode: the alpha = 0 test)
    variants = {0: [("global", False, False), ("local", True, False)],
                1: [("global", True, True), ("local", False, False)],
                2: [("global", True, True), ("local", True, False)],
                3: [("global", True, False), ("local", False, False)]}[stage]
    syncs_per_variant = []
    for mode, bf16, fp32_accumulation in variants:
        hdet = {"alpha": 0.5, "spread": "linear", "sync_interval": 3, "gradient_mode": mode,
                "auto_lr": {"enabled": False, "range_test": 0}}
        extra = {"data_types": {"grad_accum_dtype": "fp32"}} if fp32_accumulation else {}
        engine = build(ds_config(stage, bf16=bf16, hdet=hdet, **extra), seed=rank)
        assert engine.hdet.topology.num_replicas == replicas  # "auto": a rank on ZeRO-0, a node on 1-3
        start = gather_rows(full_fp32(engine))
        assert torch.equal(start, start[:1].expand(world, -1))  # replicas start identical despite the seeds
        used_lrs = record_used_lrs(engine)
        before_sync = record_before_sync(engine)
        averaged_gradients = record_averaged_gradients(engine)
        probe_batch = micro_batch(0, -1, 0, torch.bfloat16 if bf16 else torch.float32)
        engine.hdet.ensemble.set_probe(batch_probe(engine, micro_batch(rank, -1, 0, probe_batch.dtype),
                                                   lambda model, batch: model(batch).float().pow(2).mean()))
        syncs = 0
        for step in range(1, 8):
            held = gather_rows(torch.tensor([engine.hdet.lr_multiplier()], dtype=torch.float64)).reshape(-1)
            assert sorted(held[::per_replica].tolist()) == pytest.approx(multipliers(replicas, 0.5))  # eq. 1
            assert torch.equal(held, held[::per_replica].repeat_interleave(per_replica))
            expected_lr = engine.get_lr()[0] * engine.hdet.lr_multiplier()
            assert engine.hdet.current_lrs()[0] == pytest.approx(expected_lr)
            used_lrs.clear()
            synced: list[bool] = []
            train_step(engine, rank, step, synced)
            # True once per sync, after the micro-batch whose step synced: where docs/engines.md's loop checkpoints.
            assert synced == [False] * (MICRO_BATCHES - 1) + [step % 3 == 0]
            # The base optimizer stepped (once per ZeRO-3 sub-group) at this replica's LR; outside the step
            # the param groups hold the base schedule again.
            assert used_lrs and all(lr == pytest.approx(expected_lr) for lr in used_lrs)
            assert engine.get_lr()[0] == pytest.approx(0.01)
            gradient_bytes = engine.hdet.gradient_bytes_across_replicas
            assert gradient_bytes > 0 if mode == "global" else gradient_bytes == 0
            if mode == "global" and stage == 2:  # each group's flat partition, averaged whole
                views, flats, averaged = averaged_gradients
                # one view per parameter of this rank's partition (DeepSpeed's own count), averaged as the flats
                in_partition = sum(len(params) for params in engine.optimizer.params_in_partition)
                assert flats and len(views) == in_partition and in_partition >= len(flats)
                assert [(t.data_ptr(), t.shape) for t in averaged] == [(t.data_ptr(), t.shape) for t in flats]
            if mode == "global" and engine.get_global_grad_norm() is not None:
                # One gradient for all: every rank computes the same norm, so clipping agrees everywhere.
                norms = gather_rows(torch.tensor([float(engine.get_global_grad_norm())], dtype=torch.float64))
                assert torch.allclose(norms, norms[:1].expand_as(norms), rtol=1e-6), norms.reshape(-1).tolist()
            after = gather_rows(full_fp32(engine))
            if step % 3:
                assert step not in before_sync
                for replica in range(1, replicas):  # replicas differ between syncs, agree inside a replica
                    assert not torch.allclose(after[0], after[replica_of == replica][0])
                assert torch.equal(after, after[::per_replica].repeat_interleave(per_replica, dim=0))
                continue
            syncs += 1
            assert engine.hdet.last_report.step == step
            pre = before_sync[step]
            # The probe scored each replica's own weights on rank 0's batch (ZeRO-3: gathered for the forward).
            replica_weights = [pre[replica_of == r][0] for r in range(replicas)]
            expected_probe = [probe_on_plain_model(weights, probe_batch) for weights in replica_weights]
            assert engine.hdet.last_report.probe_losses == pytest.approx(expected_probe, rel=2e-2 if bf16 else 1e-5)
            mean = torch.stack([pre[replica_of == r][0] for r in range(replicas)]).double().mean(0)
            assert torch.allclose(after.double(), mean.expand(world, -1), rtol=1e-6, atol=1e-7)
            assert torch.equal(after, after[:1].expand(world, -1))
            # The low-precision copies the forward pass uses were refreshed from the averaged masters.
            dtype = torch.bfloat16 if bf16 else torch.float32
            assert torch.equal(module_values(engine), after[rank].to(dtype).float())
        syncs_per_variant.append(syncs)
    return syncs_per_variant


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_replicas_fan_out_and_converge(stage):
    assert run_ranks(fanout, WORLD, stage) == [[2, 2]] * WORLD


# ------------------------------------------------------------------------- alpha = 0 is plain DeepSpeed
ALPHA_ZERO_STAGES = (0, 1, 2, 3)


def losses_and_parameters(rank: int, world: int, plain: bool) -> dict[int, tuple[list[float], list[float]]]:
    """Five optimizer steps (gradient accumulation and clipping on) per stage, with plain DeepSpeed over all
    ranks or with HDET in global mode at alpha = 0 (ZeRO-0: 4 replicas; ZeRO-1/2/3: 2 replicas x 2 ranks).
    Plain and HDET run in separate launches: DeepSpeed keeps one process-wide mpu, which the HDET engine sets."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    results = {}
    for stage in ALPHA_ZERO_STAGES:
        hdet = {"alpha": 0.0, "spread": "linear", "sync_interval": 2, "gradient_mode": "global",
                "auto_lr": {"enabled": False, "range_test": 0}}
        engine = build(ds_config(stage, hdet=None if plain else hdet), seed=rank, plain=plain, lr=0.05)
        losses = [train_step(engine, rank, step) for step in range(1, 6)]
        results[stage] = (losses, full_fp32(engine).tolist())  # plain lists: tensors do not outlive the rank
    return results


def test_global_mode_with_zero_spread_is_plain_deepspeed():
    plain = run_ranks(losses_and_parameters, WORLD, True)
    ours = run_ranks(losses_and_parameters, WORLD, False)
    for rank in range(WORLD):
        for stage in ALPHA_ZERO_STAGES:
            (plain_losses, plain_params), (our_losses, our_params) = plain[rank][stage], ours[rank][stage]
            assert our_losses == pytest.approx(plain_losses, rel=1e-6, abs=1e-7), (rank, stage)
            assert torch.allclose(torch.tensor(our_params), torch.tensor(plain_params), rtol=1e-5, atol=1e-7)


# -------------------------------------------------------------------------- schedulers and data loading
DS_SCHEDULERS = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 4},
    "WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 2, "total_num_steps": 8},
    "WarmupCosineLR": {"warmup_min_ratio": 0.1, "warmup_num_steps": 2, "total_num_steps": 8},
    "OneCycle": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.02, "cycle_first_step_size": 3},
}


def reference_schedule(name: str, steps: int) -> list[float]:
    """The LRs DeepSpeed's scheduler writes, computed on a bare torch optimizer with no engine or HDET."""
    from deepspeed.runtime import lr_schedules

    optimizer = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=0.01)
    if name == "LambdaLR":
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_step)
    else:
        scheduler = getattr(lr_schedules, name)(optimizer, **DS_SCHEDULERS[name])
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    return lrs


def schedulers_and_data(rank: int, world: int) -> list[str]:
    """Per-replica multipliers on top of DeepSpeed's four schedulers and a torch scheduler (each writes
    absolute LRs every step): the base schedule is untouched and each replica trains at schedule * rho.
    Also: training_data is split over the global rank, so every replica reads different samples."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # 2 replicas of 2 ranks
    checked = []
    hdet = {"alpha": 0.5, "spread": "linear", "sync_interval": 2, "auto_lr": {"enabled": False, "range_test": 0}}
    for name in [*DS_SCHEDULERS, "LambdaLR"]:
        extra = {} if name == "LambdaLR" else {"scheduler": {"type": name, "params": DS_SCHEDULERS[name]}}
        config = ds_config(1, hdet=hdet, **extra)
        model = tiny_model(rank)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        torch_scheduler = ((lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, inverse_step))
                           if name == "LambdaLR" else None)
        engine, _, _, scheduler = hdet_deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                                            lr_scheduler=torch_scheduler)
        assert scheduler is not None
        used = record_used_lrs(engine)
        expected = reference_schedule(name, 6)
        for step in range(6):
            assert engine.get_lr()[0] == pytest.approx(expected[step], abs=1e-12), (name, step)
            rho = engine.hdet.lr_multiplier()
            assert rho in (0.5, 1.5)  # eq. 1 for 2 replicas
            used.clear()
            train_step(engine, rank, step)
            assert used == [pytest.approx(expected[step] * rho, abs=1e-12)], (name, step)
        checked.append(name)

    # Plain DeepSpeed engines built after HDET's keep their all-rank groups (DeepSpeed's mpu is process-wide;
    # HDET's engine only sets its own while it runs), and HDET's engine keeps its replica groups.
    for stage in (0, 2):
        plain = build(ds_config(stage), seed=rank, plain=True)
        assert plain.dp_world_size == world
        train_step(plain, rank, 1)
        trained = gather_rows(full_fp32(plain))
        assert torch.equal(trained, trained[:1].expand_as(trained))  # gradients averaged over all 4 ranks
    used.clear()
    expected_lr = engine.get_lr()[0] * engine.hdet.lr_multiplier()
    train_step(engine, rank, 6)
    assert used == [pytest.approx(expected_lr, abs=1e-12)]
    assert engine.hdet.topology.num_replicas == 2 and engine.dp_world_size == 2
    checked.append("plain engines alongside")

    dataset = torch.utils.data.TensorDataset(torch.arange(64))
    model = tiny_model(rank)
    engine, _, loader, _ = hdet_deepspeed.initialize(model=model, config=ds_config(1, hdet=hdet),
                                                     optimizer=torch.optim.AdamW, training_data=dataset,
                                                     model_parameters=model.parameters())
    indices = gather_rows(torch.cat([batch for (batch,) in loader]))
    assert indices.shape == (world, 64 // world)
    assert len(set(indices.reshape(-1).tolist())) == 64  # disjoint over all ranks, so over replicas too
    checked.append("data")

    # Closed at a sync, HDET leaves the engine: its steps sync no more (they did: close() left the engine's step
    # wrapped), and each replica trains on inside its own groups, on its own data.
    engine = build(ds_config(2, hdet=hdet), seed=rank)
    for step in (1, 2):
        train_step(engine, rank, step)
    engine.hdet.close()
    counted, report = engine.hdet.global_step, engine.hdet.last_report
    assert gather_rows(full_fp32(engine)).unique(dim=0).shape[0] == 1  # one model at the sync
    for step in range(3, 7):  # two sync intervals
        train_step(engine, rank, step)
    assert (engine.hdet.global_step, engine.hdet.last_report) == (counted, report)
    replicas = gather_rows(full_fp32(engine))
    assert torch.equal(replicas[0], replicas[1]) and torch.equal(replicas[2], replicas[3])  # ranks of a replica
    assert not torch.equal(replicas[0], replicas[2])
    checked.append("closed")
    return checked


def test_multipliers_survive_schedulers_and_data_is_split_over_all_ranks():
    assert run_ranks(schedulers_and_data, WORLD) == [[*DS_SCHEDULERS, "LambdaLR", "plain engines alongside",
                                                       "data", "closed"]] * WORLD


# ------------------------------------------------------------------------------------------- LR range test
RANGE_TEST_STEPS = 15


def range_test_on_zero(rank: int, world: int) -> dict:
    """ZeRO-2, 2 replicas x 2 ranks, DeepSpeed's WarmupDecayLR: the LR range test the run starts with, then the
    run's first steps."""
    from hdet_scale.range_test import ramp_lr

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    hdet = {"alpha": 0.5, "sync_interval": 2, "auto_lr": {"enabled": False, "range_test": RANGE_TEST_STEPS}}
    schedule = {"type": "WarmupDecayLR", "params": DS_SCHEDULERS["WarmupDecayLR"]}
    engine = build(ds_config(2, hdet=hdet, scheduler=schedule), seed=rank)
    first = full_fp32(engine)
    used = record_used_lrs(engine)
    test_steps, schedule_step = 0, engine.lr_scheduler.last_batch_iteration
    while engine.hdet.ramping:
        used.clear()
        train_step(engine, rank, 100 + test_steps)
        assert used == [pytest.approx(ramp_lr(test_steps, steps=RANGE_TEST_STEPS), rel=1e-9)]  # every replica
        assert engine.lr_scheduler.last_batch_iteration == schedule_step  # held: its first step comes after the test
        test_steps += 1
    restored = torch.equal(full_fp32(engine), first)
    expected = reference_schedule("WarmupDecayLR", 4)
    run = []
    for step in range(4):
        used.clear()
        multiplier = engine.hdet.lr_multiplier()
        train_step(engine, rank, step)
        run.append((used[0], expected[step], multiplier))
    return {"test_steps": test_steps, "restored": restored, "run": run, "pick": engine.hdet.ensemble.range_test_pick,
            "found": engine.hdet.found_lr_factor(), "steps": engine.hdet.global_step}


def test_the_lr_range_test_runs_on_zero_with_deepspeeds_schedule_held():
    ranks = run_ranks(range_test_on_zero, WORLD)
    mean = sum(multipliers(2, 0.5, "log")) / 2
    for result in ranks:
        assert result["pick"] == ranks[0]["pick"] is not None and result["restored"]
        assert 13 <= result["test_steps"] <= RANGE_TEST_STEPS and result["steps"] == 4
        # the replicas' mean LR at 0.7 times the pick, over the schedule's peak (not lr=0.01)
        scale = 0.7 * result["pick"] / (DS_SCHEDULERS["WarmupDecayLR"]["warmup_max_lr"] * mean)
        assert result["found"] == pytest.approx(scale)
        for used, scheduled, multiplier in result["run"]:
            assert used == pytest.approx(scheduled * scale * multiplier, rel=1e-6)


def direct_backward(rank: int, world: int, stage: int) -> str:
    engine = build(ds_config(stage, hdet={"sync_interval": 2}), seed=0)
    loss = engine(micro_batch(rank, 0, 0, torch.float32)).pow(2).mean()
    with pytest.raises(RuntimeError) as refused:
        engine.scale(loss).backward()
    return str(refused.value)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_direct_backward_is_refused_in_one_line(stage):
    """ZeRO-1/2/3 take loss.backward() called directly: HDET saw no loss, so its range test stopped the run and its
    controller never moved."""
    for message in run_ranks(direct_backward, 2, stage, timeout=120):
        assert "HDET under DeepSpeed reads each micro-batch's loss in engine.backward(loss)" in message


def latest_seen_by_one_rank(rank: int, world: int, directory: str) -> list:
    import shutil

    engine = build(ds_config(0, hdet={"sync_interval": 1, "auto_lr": {"enabled": False, "range_test": 0}}), seed=0)
    train_step(engine, rank, 1)
    engine.save_checkpoint(f"{directory}/shared")
    dist.barrier()
    own = Path(directory) / f"rank{rank}"
    if rank == 1:  # rank 1's view of the file system (a stale cache, say) has the checkpoint; rank 0's has none
        shutil.copytree(f"{directory}/shared", own / "checkpoints")
    else:
        (own / "checkpoints").mkdir(parents=True)
    dist.barrier()
    os.chdir(own)
    return list(engine.load_checkpoint("checkpoints"))


def test_a_load_follows_rank_0s_finding_that_there_is_no_checkpoint(tmp_path):
    """Where rank 0 found no 'latest', DeepSpeed read 'latest' again on each rank: a rank that saw one loaded while
    rank 0 returned (None, None), and the two went on into different collectives."""
    assert run_ranks(latest_seen_by_one_rank, 2, str(tmp_path), timeout=120) == [[None, None]] * 2


def load_outcome(load) -> str:
    """How ``load()`` ended on this rank: "loaded", "PeerFailed: <its message>" (another rank failed), or "own: <the
    type of the error it raised here>"."""
    try:
        load()
    except PeerFailed as error:
        return f"PeerFailed: {error}"
    except Exception as error:
        return f"own: {type(error).__name__}"
    return "loaded"


def checkpoint_unseen_by_one_rank(rank: int, world: int, directory: str) -> str:
    import shutil

    engine = build(ds_config(0, hdet={"sync_interval": 1, "auto_lr": {"enabled": False, "range_test": 0}}), seed=0)
    train_step(engine, rank, 1)
    engine.save_checkpoint(f"{directory}/shared", tag="saved")
    dist.barrier()
    own = Path(directory) / f"rank{rank}" / "checkpoints"
    shutil.copytree(f"{directory}/shared", own)
    if rank == 1:  # rank 1's view of the file system lacks the checkpoint's files; rank 0's has them
        for path in (own / "saved").glob("*model_states*"):
            path.unlink()
    dist.barrier()
    os.chdir(own.parent)
    return load_outcome(lambda: engine.load_checkpoint("checkpoints", tag="saved"))


def test_a_checkpoint_one_rank_does_not_see_stops_every_rank(tmp_path):
    """DeepSpeed failed an assertion on a rank whose view of the file system lacked the checkpoint's files rank 0
    found: rank 0 loaded and went on, to wait in the first collective of the run."""
    first, second = run_ranks(checkpoint_unseen_by_one_rank, 2, str(tmp_path), timeout=120)
    assert second == "own: AssertionError"
    assert first.startswith("PeerFailed: loading the checkpoint saved failed on rank 1"), first


def tags_as_deepspeed_takes_them(rank: int, world: int, directory: str) -> list:
    hdet = {"sync_interval": 1, "auto_lr": {"enabled": False, "range_test": 0}}
    engine = build(ds_config(0, hdet=hdet), seed=0)
    train_step(engine, rank, 1)
    seen = [engine.save_checkpoint(directory, tag=7)]  # DeepSpeed's tutorial numbers its tags
    seen.append(Path(engine.load_checkpoint(directory, tag=7)[0]).parent.name)
    for attempt in (lambda: engine.load_checkpoint(directory, tag="never_saved"),
                    lambda: build(ds_config(0, hdet=hdet, checkpoint={"load_universal": True}),
                                  seed=0).load_checkpoint(directory)):
        try:
            attempt()
            seen.append("loaded")
        except (FileNotFoundError, ValueError, PeerFailed) as error:
            seen.append(str(error))
    return seen


def test_tags_are_taken_as_their_strings_and_a_missing_one_is_named(tmp_path):
    """A number as tag failed on a path join (and tag 0 became global_step<N>); a tag with no folder failed
    DeepSpeed's bare assertion; a universal load without 'latest_universal' returned (None, None), where DeepSpeed
    raises, so a loop ignoring it started from scratch."""
    for saved, loaded, missing, universal in run_ranks(tags_as_deepspeed_takes_them, 2, str(tmp_path), timeout=180):
        assert saved == "7" and loaded == "7" and (tmp_path / "latest").read_text() == "7"
        assert "no DeepSpeed checkpoint 'never_saved'" in missing
        assert "latest_universal does not exist" in universal


def legacy_format_round_trip(rank: int, world: int, directory: str) -> str:
    hdet = {"sync_interval": 1, "auto_lr": {"enabled": False, "range_test": 0}}
    engine = build(ds_config(1, hdet=hdet, checkpoint={"checkpoint_serialization": False}), seed=0)
    train_step(engine, rank, 1)
    engine.save_checkpoint(directory)
    return Path(engine.load_checkpoint(directory)[0]).parent.name


def test_a_checkpoint_in_torchs_older_file_format_loads(tmp_path):
    """DeepSpeed's checkpoint_serialization false writes files torch cannot memory-map: every load failed."""
    assert run_ranks(legacy_format_round_trip, 2, str(tmp_path), timeout=180) == ["global_step1"] * 2


def zero3_load_of_an_older_tag(rank: int, world: int, directory: str) -> list[str]:
    engine = build(ds_config(3, hdet={"sync_interval": 1, "auto_lr": {"enabled": False, "range_test": 0}}), seed=0)
    train_step(engine, rank, 1)
    engine.save_checkpoint(directory, tag="first")
    train_step(engine, rank, 2)
    engine.save_checkpoint(directory, tag="second")  # 'latest' names it
    messages = []
    for tag, module_only in (("first", False), ("first", True), ("second", False)):
        try:
            engine.load_checkpoint(directory, tag=tag, load_optimizer_states=False, load_module_only=module_only)
            messages.append("loaded")
        except (ValueError, PeerFailed) as error:
            messages.append(str(error))
    return messages


def test_a_zero3_load_without_optimizer_states_of_a_tag_latest_does_not_name_is_refused(tmp_path):
    """DeepSpeed took the weights from the checkpoint 'latest' named and everything else from the tag asked for."""
    for first, first_module_only, second in run_ranks(zero3_load_of_an_older_tag, 2, str(tmp_path), timeout=180):
        for refused in (first, first_module_only):  # Megatron-DeepSpeed's fine-tuning load asks for the module only
            assert "reads its weights from the checkpoint" in refused and "(second), not from tag 'first'" in refused
        assert "or load it with load_optimizer_states=True" in first  # a module-only load would then read no weights
        assert first_module_only.endswith("not from tag 'first': load the checkpoint 'latest' names")
        assert second == "loaded"


def load_with_one_replicas_file_broken(rank: int, world: int, directory: str) -> str:
    hdet = {"sync_interval": 1, "gradient_mode": "local", "auto_lr": {"enabled": False, "range_test": 0}}
    engine = build(ds_config(2, hdet=hdet), seed=0)
    train_step(engine, rank, 1)
    engine.save_checkpoint(directory, tag="saved")
    dist.barrier()
    own_files = sorted((Path(directory) / "saved" / hdet_deepspeed.REPLICA_FOLDER).glob("*optim_states*"))
    if rank == 1:  # replica 1's own optimizer state, which rank 1 alone reads
        assert own_files
        for path in own_files:
            path.write_bytes(path.read_bytes()[:100])
    dist.barrier()
    return load_outcome(lambda: engine.load_checkpoint(directory, tag="saved"))


def test_a_load_failing_on_one_rank_stops_every_rank(tmp_path):
    """A file only one rank reads (its replica's own optimizer state) that fails to load raised there alone: the
    other ranks loaded and went on, to wait in the first collective of the run for a rank that never came."""
    own, peer = run_ranks(load_with_one_replicas_file_broken, 2, str(tmp_path), timeout=240)[::-1]
    assert own.startswith("own: ") and peer.startswith("PeerFailed: loading the checkpoint saved failed on rank 1")


def save_after_close(rank: int, world: int, directory: str) -> tuple[str, list[str]]:
    engine = build(ds_config(0, hdet={"sync_interval": 1, "auto_lr": {"enabled": False, "range_test": 0}}), seed=0)
    train_step(engine, rank, 1)
    engine.hdet.close()
    engine.hdet.close()  # again: nothing more to undo, on any replica
    train_step(engine, rank, 2)  # the replicas train apart
    with pytest.raises(ValueError) as refused:
        engine.save_checkpoint(f"{directory}/shared", "apart")
    own = Path(directory) / f"replica{engine.hdet.topology.replica_index}"
    engine.save_checkpoint(str(own), "apart", {}, True, False)  # positionally, as DeepSpeed takes them
    assert engine.load_checkpoint(str(own), "apart", True, True)[0] is not None
    return str(refused.value), sorted(str(path.relative_to(own)) for path in own.rglob("*") if path.is_file())


def test_replicas_that_train_apart_after_close_save_each_into_its_own_directory(tmp_path):
    """After close the replicas kept HDET's file names (every replica but the first writing no model, replica r's
    names computed as replica 0's) and saved into one directory over each other."""
    for message, files in run_ranks(save_after_close, 2, str(tmp_path), timeout=120):
        assert "the replicas train apart, and two of them would write DeepSpeed's files into one directory" in message
        assert files == ["apart/mp_rank_00_model_states.pt", "latest"]  # DeepSpeed's own names, for each replica
