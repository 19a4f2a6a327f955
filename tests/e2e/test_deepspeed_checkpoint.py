"""DeepSpeed checkpoints of an HDET run on real gloo ranks.

One 4-rank launch trains 2 replicas x 2 ZeRO shards and saves (ZeRO-2 twice, ZeRO-3 once); DeepSpeed's converter
turns one ZeRO-2 checkpoint into a universal checkpoint; a second 4-rank launch resumes both ZeRO-2 checkpoints
in the same layout and loads the universal one into 1 replica x 4 shards; a 2-rank launch loads a ZeRO-2
checkpoint into 1 replica x 2 shards. The tests read what those launches found. The converter runs as a subprocess
(``python -m deepspeed.checkpoint.ds_to_universal``), which puts the file in the e2e tier.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distributed import gather_rows, run_ranks
from hdet_scale import AutoLRConfig, HDETConfig
from hdet_scale.comm import PeerFailed
from hdet_scale.config import ExploreConfig, KnobConfig

WORLD, PER_REPLICA = 4, 2
SYNC_INTERVAL = 2
SAVED_AT = 4  # a sync point
RESUMED = range(SAVED_AT + 1, SAVED_AT + 5)  # two more intervals: the controller and the permutations move again
TAG = "hdet"
# The saved runs: local gradients, so replicas' Adam moments differ between syncs; in the second they are
# averaged at every sync, so at the save point every replica holds replica 0's moments.
OWN_MOMENTS, AVERAGED_MOMENTS = "own_moments", "averaged_moments"
ZERO3, UNIVERSAL, RECORDS = "zero3", "universal", "records"


def tiny_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))  # 57 parameters: ZeRO pads its partitions


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)  # every rank, so every replica, sees its own data
    return torch.randn(2, 5, generator=generator), torch.randn(2, 3, generator=generator)


def build(stage: int, per_replica: int, *, seed: int = 0, universal: bool = False,
          average_optimizer_state: bool = False, explore_weight_decay: bool = False) -> Any:
    from hdet_scale.engines.deepspeed import initialize

    zero = {"stage": stage} | ({"stage3_param_persistence_threshold": 0} if stage == 3 else {})
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        # A scheduler with state: a resumed run must continue the warm-up where the saved one stopped.
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 0.005, "warmup_max_lr": 0.05, "warmup_num_steps": 10}},
        "checkpoint": {"load_universal": universal},
    }
    # start=0: the controller moves from the first sync, so its saved state is not the initial one.
    hdet = HDETConfig(spread="linear", alpha=0.5, sync_interval=SYNC_INTERVAL, ranks_per_replica=per_replica,
                      gradient_mode="local", average_optimizer_state=average_optimizer_state,
                      auto_lr=AutoLRConfig(mode="scale", start=0, sigma=0.01, range_test=0),
                      explore=ExploreConfig(weight_decay=KnobConfig(alpha=0.5) if explore_weight_decay else None))
    model = tiny_mlp(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    engine, *_ = initialize(model=model, optimizer=optimizer, config=config, hdet_config=hdet)
    return engine


def train(engine: Any, rank: int, steps: range) -> list[tuple[float, list[float], list[float]]]:
    """Runs ``steps``; per step: the loss, then DeepSpeed's scheduled LRs and this replica's LRs for the next."""
    trace = []
    for step in steps:
        inputs, targets = batch(rank, step)
        loss = F.mse_loss(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
        trace.append((loss.item(), engine.get_lr(), engine.hdet.current_lrs()))
    return trace


def full_params(engine: Any) -> dict[str, torch.Tensor]:
    """The fp32 master parameters gathered from this replica's ZeRO partitions (collective in the replica)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {name: safe_get_full_fp32_param(param).clone() for name, param in engine.module.named_parameters()}


def full_moments(engine: Any) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_optimizer_state

    return {name: safe_get_full_optimizer_state(param, "exp_avg").clone()
            for name, param in engine.module.named_parameters()}


def local_moments(engine: Any) -> torch.Tensor:
    """This rank's own ZeRO partition of the Adam moments (exp_avg, then exp_avg_sq)."""
    return torch.cat([tensor.reshape(-1) for tensor in engine.hdet.adapter.optimizer_state_tensors()])


def flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensor.reshape(-1) for tensor in params.values()])


def plain(value: Any) -> Any:
    """``value`` with tensors (generator states) as lists, so whole HDET states compare with ``==``."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


def snapshot(engine: Any) -> dict[str, Any]:
    """Everything a resume must restore, as comparable values."""
    return {"params": full_params(engine), "moments": local_moments(engine), "lr": engine.get_lr(),
            "replica_lrs": engine.hdet.current_lrs(), "hdet": plain(engine.hdet.state_dict()),
            "global_steps": engine.global_steps}


def record(directory: str | Path, rank: int) -> dict[str, Any]:
    """What rank ``rank`` of the saving launch recorded."""
    return torch.load(Path(directory) / RECORDS / f"rank{rank}.pt")


def failed(checks: dict[str, bool]) -> list[str]:
    return [name for name, ok in checks.items() if not ok]


# ------------------------------------------------------------------------------------ the saving launch
def save_and_continue(rank: int, directory: Path, variant: str) -> dict[str, Any]:
    """ZeRO-2, 2 replicas x 2 shards: trains to a sync point, saves there and trains on."""
    save_dir = directory / variant
    engine = build(2, PER_REPLICA, average_optimizer_state=variant == AVERAGED_MOMENTS)
    train(engine, rank, range(1, SAVED_AT))
    with pytest.raises(RuntimeError, match="sync points"):
        engine.hdet.save_checkpoint(save_dir, TAG)
    dist.barrier()
    assert not save_dir.exists()  # refused before DeepSpeed created anything
    train(engine, rank, range(SAVED_AT, SAVED_AT + 1))
    assert engine.hdet.last_report is not None and engine.hdet.global_step == SAVED_AT

    params_by_rank = gather_rows(flat(full_params(engine)))
    assert torch.equal(params_by_rank[0], params_by_rank[PER_REPLICA])  # a sync point: replicas are identical
    moments = local_moments(engine)
    moments_by_rank = gather_rows(moments)
    same_moments = torch.equal(moments_by_rank[rank % PER_REPLICA], moments_by_rank[rank % PER_REPLICA + PER_REPLICA])
    assert same_moments == (variant == AVERAGED_MOMENTS)

    saved = snapshot(engine)
    saved["full_moments"] = full_moments(engine)
    engine.hdet.save_checkpoint(save_dir, TAG, client_state={"epoch": 3})
    # Files are named by the rank inside the replica: the one at this position holds replica 0's moments, so
    # replica 1 wrote none over them.
    position = rank % PER_REPLICA
    written = torch.load(save_dir / TAG / f"zero_pp_rank_{position}_mp_rank_00_optim_states.pt", weights_only=False)
    state = written["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
    assert torch.equal(torch.cat([state["exp_avg"], state["exp_avg_sq"]]), moments_by_rank[position])
    continued = train(engine, rank, RESUMED)
    return {"saved": saved, "continued": continued, "final": snapshot(engine)}


def save_runs(rank: int, world: int, directory: str) -> None:
    records = {variant: save_and_continue(rank, Path(directory), variant)
               for variant in (OWN_MOMENTS, AVERAGED_MOMENTS)}

    zero3 = build(3, PER_REPLICA)
    train(zero3, rank, range(1, SYNC_INTERVAL + 1))
    records[ZERO3] = full_params(zero3)
    zero3.hdet.save_checkpoint(Path(directory) / ZERO3, TAG)
    # Through a file: tensors sent back through run_ranks' queue are shared memory that dies with the rank.
    (Path(directory) / RECORDS).mkdir(exist_ok=True)
    torch.save(records, Path(directory) / RECORDS / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The saving launch's directory, with the OWN_MOMENTS checkpoint also converted to a universal one."""
    directory = tmp_path_factory.mktemp("deepspeed_checkpoints")
    run_ranks(save_runs, WORLD, str(directory))
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                    "--input_folder", str(directory / OWN_MOMENTS / TAG),
                    "--output_folder", str(directory / UNIVERSAL / TAG),
                    "--num_extract_workers", "1", "--num_merge_workers", "1"], check=True, capture_output=True)
    return directory


# ----------------------------------------------------------------------------------- the loading launch
def resume_checks(rank: int, directory: str, variant: str) -> list[str]:
    """Loads a ZeRO-2 checkpoint into a fresh engine of the saved layout and repeats the saved run's steps."""
    saved_run = record(directory, rank)[variant]
    before = saved_run["saved"]
    engine = build(2, PER_REPLICA, seed=123, average_optimizer_state=variant == AVERAGED_MOMENTS)
    fresh = flat(full_params(engine))
    _, client_state = engine.hdet.load_checkpoint(Path(directory) / variant, TAG)
    loaded = snapshot(engine)
    checks = {
        "fresh engine differs": not torch.equal(fresh, flat(before["params"])),
        "client_state": client_state.get("epoch") == 3,
        "params": torch.equal(flat(loaded["params"]), flat(before["params"])),
        "this replica's Adam moments": torch.equal(loaded["moments"], before["moments"]),
        "scheduled lr": loaded["lr"] == before["lr"],
        "replica lrs": loaded["replica_lrs"] == before["replica_lrs"],
        "hdet state": loaded["hdet"] == before["hdet"],
        "global_steps": loaded["global_steps"] == before["global_steps"],
    }
    # Losses, scheduled LRs and this replica's LRs at every step, through two more syncs.
    checks["continued steps"] = train(engine, rank, RESUMED) == saved_run["continued"]
    final = snapshot(engine)
    checks["final params"] = torch.equal(flat(final["params"]), flat(saved_run["final"]["params"]))
    checks["final hdet state"] = final["hdet"] == saved_run["final"]["hdet"]
    return failed(checks)


def universal_checks(rank: int, world: int, directory: str) -> list[str]:
    """Loads the universal checkpoint into one replica sharded over all ranks, then trains through a sync."""
    before = record(directory, 0)[OWN_MOMENTS]["saved"]  # replica 0's state, the one its files hold
    engine = build(2, per_replica=world, seed=123, universal=True)
    _, client_state = engine.hdet.load_checkpoint(Path(directory) / UNIVERSAL, TAG)
    loaded = snapshot(engine)
    checks = {
        "client_state": client_state.get("epoch") == 3,
        "params": torch.equal(flat(loaded["params"]), flat(before["params"])),
        "Adam moments": torch.equal(flat(full_moments(engine)), flat(before["full_moments"])),
        "scheduled lr": loaded["lr"] == before["lr"],
        "controller state": all(entry["controller"] == before["hdet"]["explored"][name]["controller"]
                                for name, entry in loaded["hdet"]["explored"].items()),
        "permutations redrawn for one replica": all(entry["permutation"] == [0]
                                                    for entry in loaded["hdet"]["explored"].values()),
    }
    trace = train(engine, rank, range(SAVED_AT + 1, SAVED_AT + 1 + SYNC_INTERVAL))
    checks["trains through a sync"] = (engine.hdet.last_report is not None
                                       and all(math.isfinite(loss) for loss, _, _ in trace)
                                       and not torch.equal(flat(full_params(engine)), flat(before["params"])))
    return failed(checks)


def load_runs(rank: int, world: int, directory: str) -> dict[str, list[str]]:
    failures = {variant: resume_checks(rank, directory, variant) for variant in (OWN_MOMENTS, AVERAGED_MOMENTS)}
    failures[UNIVERSAL] = universal_checks(rank, world, directory)
    return failures


@pytest.fixture(scope="module")
def loaded(saved) -> list[dict[str, list[str]]]:
    """Per rank: the names of the checks that failed, per loaded checkpoint."""
    return run_ranks(load_runs, WORLD, str(saved))


# ----------------------------------------------------------------------------------------------- tests
def test_resume_from_a_sync_point_continues_exactly(loaded):
    # Moments averaged at syncs: replica 0's files hold every replica's state, and everything resumes bit for bit.
    assert {rank: failures[AVERAGED_MOMENTS] for rank, failures in enumerate(loaded)} == dict.fromkeys(range(WORLD), [])


def test_resume_restores_every_replicas_own_adam_moments(loaded):
    assert {rank: failures[OWN_MOMENTS] for rank, failures in enumerate(loaded)} == dict.fromkeys(range(WORLD), [])


def test_zero3_checkpoint_loads_into_an_unsharded_model(saved):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(saved / ZERO3), tag=TAG)
    model = tiny_mlp(seed=7)
    model.load_state_dict(state)
    expected = record(saved, 0)[ZERO3]
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), expected[name]), name
    assert not torch.equal(flat(expected), flat(dict(tiny_mlp(seed=0).named_parameters())))  # it trained


def one_replica(rank: int, world: int, directory: str) -> None:
    before = record(directory, rank)[OWN_MOMENTS]["saved"]  # ranks 0 and 1 were replica 0, whose files hold it
    # A run exploring another set of values is refused before DeepSpeed loads anything: rank 0 names the mismatch,
    # the other ranks rank 0.
    other = build(2, per_replica=world, seed=123, explore_weight_decay=True)
    fresh = flat(full_params(other))
    with pytest.raises(ValueError if rank == 0 else PeerFailed, match="explores"):
        other.hdet.load_checkpoint(Path(directory) / OWN_MOMENTS, TAG)
    assert torch.equal(flat(full_params(other)), fresh)
    engine = build(2, per_replica=world, seed=123)
    engine.hdet.load_checkpoint(Path(directory) / OWN_MOMENTS, TAG)
    loaded = snapshot(engine)
    assert torch.equal(flat(loaded["params"]), flat(before["params"]))
    assert torch.equal(loaded["moments"], before["moments"])
    assert loaded["lr"] == before["lr"]
    assert loaded["hdet"]["step"] == before["hdet"]["step"]
    assert loaded["hdet"]["num_replicas"] == 1
    for name, entry in loaded["hdet"]["explored"].items():
        assert entry["controller"] == before["hdet"]["explored"][name]["controller"]
        assert entry["permutation"] == [0]  # redrawn for one replica
    trace = train(engine, rank, range(SAVED_AT + 1, SAVED_AT + 1 + SYNC_INTERVAL))
    assert engine.hdet.last_report is not None
    assert all(math.isfinite(loss) for loss, _, _ in trace)
    assert not torch.equal(flat(full_params(engine)), flat(before["params"]))


def test_checkpoint_loads_into_fewer_replicas_of_the_same_size(saved):
    run_ranks(one_replica, PER_REPLICA, str(saved))


def test_universal_checkpoint_loads_into_another_partitioning(loaded):
    # Saved as 2 replicas x 2 ZeRO shards, converted by ds_to_universal, loaded as 1 replica x 4 shards.
    assert {rank: failures[UNIVERSAL] for rank, failures in enumerate(loaded)} == dict.fromkeys(range(WORLD), [])
