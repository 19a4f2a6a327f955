"""Where DeepSpeed keeps the state HDET averages and saves, on real gloo ranks.

ZeRO-0 (every rank a replica) keeps its optimizer state in DeepSpeed's model file: each replica's Adam moments
are averaged when asked, and saved and reloaded as its own, in fp32 and bf16; the exported model is the fp32
masters, not the bf16 copies the forward uses. ZeRO-3 pads each parameter's
last partition with uninitialized memory: a sync must neither average nor check it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from settings import LR_HELD_AT_GIVEN
from torch import nn

from distributed import gather_rows, run_ranks
from hdet_scale.engines.deepspeed import REPLICA_FOLDER, HDETDeepSpeed

SYNC_INTERVAL = 2


def build(bf16: bool, *, average_optimizer_state: bool = False, seed: int = 0):
    from test_deepspeed import ds_config, tiny_model

    from hdet_scale.engines.deepspeed import initialize

    hdet = {"alpha": 0.5, "spread": "linear", "sync_interval": SYNC_INTERVAL, "gradient_mode": "local",
            "average_optimizer_state": average_optimizer_state,
            "auto_lr": {"mode": "scale", "start": 0, "range_test": 0}}
    model = tiny_model(seed)
    engine, *_ = initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
                            config=ds_config(0, bf16=bf16, hdet=hdet))
    return engine


def moments(engine) -> torch.Tensor:
    """This replica's Adam moments, read from the optimizer by its own parameters (not through HDET)."""
    optimizer = engine.basic_optimizer
    params = [param for group in optimizer.param_groups for param in group["params"]]
    return torch.cat([optimizer.state[param][key].reshape(-1) for param in params for key in ("exp_avg", "exp_avg_sq")])


def zero0_states(rank: int, world: int, directory: str) -> None:
    from test_deepspeed_distributed import full_fp32, train_step

    for bf16 in (False, True):
        averaged = build(bf16, average_optimizer_state=True)
        train_step(averaged, rank, 1)
        before = gather_rows(moments(averaged))
        assert not torch.equal(before[0], before[1])  # local mode: each replica's moments follow its own data
        train_step(averaged, rank, 2)  # the sync
        after = gather_rows(moments(averaged))
        assert torch.equal(after[0], after[1]), f"bf16={bf16}: moments not averaged at the sync"

        own = build(bf16)
        for step in range(1, SYNC_INTERVAL + 1):
            train_step(own, rank, step)
        saved = gather_rows(moments(own))
        assert not torch.equal(saved[0], saved[1])
        exported = torch.cat([tensor.reshape(-1) for tensor in own.hdet.full_state_dict().values()])
        assert torch.equal(exported, full_fp32(own)), f"bf16={bf16}: the export is not the fp32 masters"
        save_dir = Path(directory) / f"bf16_{bf16}"
        stale = save_dir / "tag" / REPLICA_FOLDER / "replica2_model_states.pt"  # a 3-replica save's, in the tag
        if rank == 0:
            stale.parent.mkdir(parents=True)
            stale.write_bytes(b"")
        dist.barrier()
        own.hdet.save_checkpoint(save_dir, "tag")
        assert not stale.exists() and HDETDeepSpeed._saved_replicas(save_dir / "tag") == 2
        loaded = build(bf16, seed=7)
        loaded.hdet.load_checkpoint(save_dir, "tag")
        assert torch.equal(gather_rows(moments(loaded)), saved), f"bf16={bf16}: a replica reloaded other moments"
        dist.barrier()


def test_zero0_optimizer_state_is_averaged_saved_and_reloaded_per_replica(tmp_path):
    run_ranks(zero0_states, 2, str(tmp_path))


def zero3_padding(rank: int, world: int) -> list[int]:
    from deepspeed.utils import safe_get_full_fp32_param

    from hdet_scale.engines.deepspeed import initialize

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # 2 replicas of 2 ranks
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))  # the last bias: 3 values, 2 + 1 padded
    hdet = {"alpha": 0.5, "spread": "linear", "sync_interval": SYNC_INTERVAL, "ranks_per_replica": 2,
            "gradient_mode": "local", "average_optimizer_state": True,
            "auto_lr": {"mode": "scale", "start": 0, "range_test": 0}}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "hdet": hdet}
    engine, *_ = initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01), config=config)

    def train_step(step: int) -> None:
        generator = torch.Generator().manual_seed(100 * rank + step)
        loss = engine(torch.randn(2, 5, generator=generator)).pow(2).mean()
        engine.backward(loss)
        engine.step()

    def full() -> torch.Tensor:
        return torch.cat([safe_get_full_fp32_param(p).reshape(-1) for p in engine.module.parameters()])

    train_step(1)
    wrapper, bias = engine.optimizer, list(engine.module.parameters())[-1]
    sub_group, offset, size = wrapper.grad_position[wrapper.get_param_id(bias)]
    held = bias.ds_numel - dist.get_rank(group=bias.ds_process_group) * size
    if rank == 3:  # replica 1, second partition: one value of the bias, then padding
        assert held == 1 and size == 2
        master = wrapper.fp32_partitioned_groups_flat[sub_group]
        with torch.no_grad():
            master[offset + held] = float("nan")
            wrapper.optimizer.state[master]["exp_avg"][offset + held] = float("inf")
    before_sync = {}
    engine.hdet.ensemble.add_pre_sync_hook(lambda step: before_sync.update(rows=gather_rows(full())))
    train_step(2)  # the sync
    before = before_sync["rows"]
    report = engine.hdet.last_report
    assert report is not None and report.step == SYNC_INTERVAL
    after = gather_rows(full())
    torch.testing.assert_close(after.double(), before[[0, 2]].double().mean(0).expand_as(after))
    real = sum(p.ds_numel for p in engine.module.parameters())  # 57 values over each replica's 2 ranks
    local = gather_rows(torch.tensor([float(report.bytes_averaged)]))[:, 0]
    assert float(local.sum()) == 4 * (2 * 3 * real + 4)  # 2 replicas: masters and 2 moments; 4 ranks: a count each
    return report.excluded_replicas


def test_zero3_padding_is_neither_averaged_nor_checked():
    assert run_ranks(zero3_padding, 4) == [[]] * 4


def zero1_plain_checkpoint(rank: int, world: int, directory: str) -> list[tuple[float, float]]:
    import deepspeed

    from hdet_scale.engines import deepspeed as hdet_deepspeed

    def model_and_optimizer():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        groups = [{"params": model[0].parameters(), "lr": 0.01}, {"params": model[2].parameters(), "lr": 0.002}]
        return model, torch.optim.AdamW(groups)

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 1}}
    # A plain ZeRO-1 run (no HDET) with the layout HDET's replicas of one rank will have: one rank per
    # data-parallel group, so each rank saves (and later loads) its own checkpoint.
    from hdet_scale import HDETConfig, ReplicaTopology
    from hdet_scale.engines.zero import ReplicaMPU

    mpu = ReplicaMPU(ReplicaTopology.build(HDETConfig(ranks_per_replica=1)))
    model, optimizer = model_and_optimizer()
    with hdet_deepspeed.replica_groups(mpu):
        plain, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
        plain.backward(plain(torch.randn(2, 8)).pow(2).mean())
        plain.step()
        plain.save_checkpoint(f"{directory}/rank{rank}", "plain")

    model, optimizer = model_and_optimizer()
    # seed 1: the two groups' first permutations differ, so each replica has two different multipliers
    hdet = {"alpha": 0.5, "spread": "linear", "sync_interval": 10, "ranks_per_replica": 1, "seed": 1,
            "auto_lr": LR_HELD_AT_GIVEN}
    engine, *_ = hdet_deepspeed.initialize(model=model, optimizer=optimizer, config={**config, "hdet": hdet})
    with hdet_deepspeed.replica_groups(engine.mpu):
        engine.load_checkpoint(f"{directory}/rank{rank}", "plain")  # a warm start, saved without HDET
    flats = engine.optimizer.single_partition_of_fp32_groups
    numel_to_group = {flat.numel(): index for index, flat in enumerate(flats)}
    used: dict[int, float] = {}
    engine.basic_optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.update(
        {numel_to_group[group["params"][0].numel()]: group["lr"] for group in opt.param_groups}))
    expected = [lr * engine.hdet.lr_multiplier(index) for index, lr in enumerate(engine.get_lr())]
    assert engine.hdet.lr_multiplier(0) != engine.hdet.lr_multiplier(1)
    engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
    engine.step()
    return [(used[index], expected[index]) for index in range(2)]


def test_each_group_keeps_its_multiplier_after_loading_a_plain_zero1_checkpoint(tmp_path):
    for rank_pairs in run_ranks(zero1_plain_checkpoint, 2, str(tmp_path)):
        for used, expected in rank_pairs:
            assert used == pytest.approx(expected)


def zero3_frozen_export(rank: int, world: int) -> None:
    from hdet_scale.engines.deepspeed import initialize

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # 2 replicas of 2 ranks
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
    model[4].weight = model[2].weight  # tied, as a language model's output layer and its embedding
    model[0].requires_grad_(False)  # a frozen layer: ZeRO-3 partitions it, but no optimizer holds a master of it
    frozen = {f"0.{name}": tensor.clone() for name, tensor in model[0].state_dict().items()}
    hdet = {"alpha": 0.5, "spread": "linear", "sync_interval": 1, "ranks_per_replica": 2,
            "auto_lr": {"mode": "scale", "start": 0, "range_test": 0}}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "hdet": hdet}
    optimizer = torch.optim.AdamW([*model[2].parameters(), model[4].bias], lr=0.01)
    engine, *_ = initialize(model=model, optimizer=optimizer, config=config)
    loss = engine(torch.randn(2, 5, generator=torch.Generator().manual_seed(rank))).pow(2).mean()
    engine.backward(loss)
    engine.step()  # a sync
    exported = engine.hdet.full_state_dict()
    for name, tensor in frozen.items():
        assert torch.equal(exported[name], tensor), f"the frozen {name} is not exported as it is"
    assert gather_rows(torch.cat([tensor.reshape(-1) for tensor in exported.values()])).unique(dim=0).shape[0] == 1
    assert exported.keys() == engine.module.state_dict().keys()  # the tied weight under both its names
    assert torch.equal(exported["4.weight"], exported["2.weight"])


def test_zero3_export_holds_frozen_and_tied_parameters():
    run_ranks(zero3_frozen_export, 4)


def save_two_replicas(rank: int, world: int, directory: str) -> list[float]:
    from test_deepspeed_distributed import train_step

    engine = build(False)
    for step in range(1, SYNC_INTERVAL + 1):
        train_step(engine, rank, step)
    engine.hdet.save_checkpoint(Path(directory) / "rank0_view" / "ckpt", "tag")
    return moments(engine).tolist()


def load_where_ranks_see_different_files(rank: int, world: int, directory: str) -> list[float]:
    """Rank 0 sees the checkpoint as written; ranks 1 and 2 see no ``latest`` and a third replica's file that is no
    longer there, as ranks of a network file system with a stale cache may."""
    engine = build(False, seed=7)
    os.chdir(Path(directory) / ("rank0_view" if rank == 0 else "rank1_view"))
    engine.hdet.load_checkpoint("ckpt")
    return moments(engine).tolist()


def test_every_rank_follows_rank_0s_reading_of_the_checkpoint(tmp_path):
    """Each rank read ``latest`` and counted the saved replicas for itself: where ranks see the file system
    differently they loaded different tags, or other replicas' optimizer state, or failed alone."""
    import shutil

    saved = run_ranks(save_two_replicas, 2, str(tmp_path))
    stale = tmp_path / "rank1_view" / "ckpt"
    shutil.copytree(tmp_path / "rank0_view" / "ckpt", stale)
    (stale / "latest").unlink()
    (stale / "tag" / REPLICA_FOLDER / "replica2_mp_rank_00_model_states.pt").write_bytes(b"")
    assert saved[0] != saved[1]
    assert run_ranks(load_where_ranks_see_different_files, 3, str(tmp_path)) == [saved[0], saved[1], saved[0]]


def optimizer_states_in_global_mode(rank: int, world: int, directory: str, stage: int,
                                    coupled_decay: bool) -> tuple[bool, bool]:
    """Global mode, 2 replicas, saved at the sync at step 2: whether the checkpoint has files of replica 1, and
    whether the replicas' optimizer states differed; each replica must get its own back either way."""
    from test_deepspeed import ds_config, tiny_model
    from test_deepspeed_distributed import train_step

    from hdet_scale.engines.deepspeed import initialize

    hdet = {"alpha": 0.5, "spread": "linear", "sync_interval": SYNC_INTERVAL, "auto_lr": LR_HELD_AT_GIVEN}

    def build_global(seed: int):
        model = tiny_model(seed)
        # Adam adds the weight decay to the gradient, so replicas training at other LRs get other moments
        kind = torch.optim.Adam if coupled_decay else torch.optim.AdamW
        optimizer = kind(model.parameters(), lr=0.01, weight_decay=0.1)
        return initialize(model=model, optimizer=optimizer, config=ds_config(stage, hdet=hdet))[0]

    engine = build_global(0)
    for step in range(1, SYNC_INTERVAL + 1):
        train_step(engine, rank, step)
    saved = moments(engine)
    rows = gather_rows(saved)
    engine.hdet.save_checkpoint(directory, "tag")
    loaded = build_global(3)
    loaded.hdet.load_checkpoint(directory, "tag")
    assert torch.equal(moments(loaded), saved)
    replica_files = Path(directory) / "tag" / REPLICA_FOLDER
    return replica_files.is_dir() and any(replica_files.iterdir()), not torch.equal(rows[0], rows[1])


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("coupled_decay", [False, True])
def test_replicas_alike_save_one_optimizer_state_and_those_that_differ_each_their_own(tmp_path, stage, coupled_decay):
    """Every replica wrote its optimizer state (ZeRO-0: its whole model file), R copies where they were alike."""
    expected = (coupled_decay, coupled_decay)
    assert run_ranks(optimizer_states_in_global_mode, 2, str(tmp_path), stage, coupled_decay) == [expected] * 2


def export_between_syncs(rank: int, world: int) -> bool:
    from test_deepspeed_distributed import full_fp32, train_step

    engine = build(False)
    train_step(engine, rank, 1)  # syncs every SYNC_INTERVAL = 2 steps: between syncs, the replicas differ
    assert not torch.equal(*gather_rows(full_fp32(engine)))
    with pytest.raises(RuntimeError, match="step 1 is between syncs .* engine.hdet.sync()"):
        engine.hdet.full_state_dict()
    engine.hdet.sync()
    exported = torch.cat([tensor.reshape(-1) for tensor in engine.hdet.full_state_dict().values()])
    return torch.equal(exported, full_fp32(engine)) and torch.equal(*gather_rows(exported))


def test_the_model_is_exported_at_sync_points_only():
    """Between syncs the export was replica 0's model alone, silently (each rank exported its own replica's)."""
    assert run_ranks(export_between_syncs, 2) == [True, True]


def scripts_own_checkpoint_calls(rank: int, world: int, directory: str) -> dict:
    """A training script's own ``engine.save_checkpoint`` / ``engine.load_checkpoint``, as DeepSpeed's examples
    write them."""
    from test_deepspeed_distributed import train_step

    engine = build(False)
    train_step(engine, rank, 1)
    with pytest.raises(RuntimeError, match="step 1 is between syncs"):
        engine.save_checkpoint(directory)
    train_step(engine, rank, 2)
    engine.save_checkpoint(directory, client_state={"epoch": 3})
    saved = gather_rows(moments(engine))
    loaded = build(False, seed=7)
    nothing = loaded.load_checkpoint(Path(directory) / "empty")  # no checkpoint yet: DeepSpeed's (None, None)
    path, client_state = loaded.load_checkpoint(directory)
    weights_only = build(False, seed=7)
    weights_only.load_checkpoint(directory, load_module_only=True)  # a fresh start from the weights: HDET's too
    return {"nothing": nothing, "epoch": client_state.get("epoch"), "hdet_step": loaded.hdet.ensemble.global_step,
            "moments_reloaded": torch.equal(gather_rows(moments(loaded)), saved),
            "replicas_differed": not torch.equal(*saved),
            "weights_only_hdet_step": weights_only.hdet.ensemble.global_step}


def test_a_scripts_own_engine_checkpoint_calls_save_and_load_hdet_and_each_replica(tmp_path):
    """``engine.save_checkpoint`` and ``engine.load_checkpoint`` were DeepSpeed's alone: the checkpoint lost HDET's
    state (the resumed run's controller started over, silently) and the other replicas' optimizer state."""
    for seen in run_ranks(scripts_own_checkpoint_calls, 2, str(tmp_path)):
        assert seen == {"nothing": (None, None), "epoch": 3, "hdet_step": SYNC_INTERVAL, "moments_reloaded": True,
                        "replicas_differed": True, "weights_only_hdet_step": 0}


def saves_into_one_tag(rank: int, world: int, directory: str) -> dict:
    """Every save into the tag "last", as a script that keeps one checkpoint writes them: one that fails on rank 1,
    then one that succeeds, then a kill between the two renames that put a save in place."""
    import shutil

    from test_deepspeed_distributed import train_step

    engine = build(False)
    step = 0

    def trained() -> torch.Tensor:
        nonlocal step
        for _ in range(SYNC_INTERVAL):
            step += 1
            train_step(engine, rank, step)
        return gather_rows(moments(engine))

    def loaded() -> torch.Tensor:
        fresh = build(False, seed=7)
        fresh.load_checkpoint(directory)  # the tag 'latest' names: "last"
        return gather_rows(moments(fresh))

    first = trained()
    engine.save_checkpoint(directory, "last")
    second = trained()
    save = torch.save

    def full_disk(obj, path, *args, **kwargs):  # replica 1's own optimizer file, as a full disk fails it
        if rank == 1 and REPLICA_FOLDER in str(path):
            raise OSError(28, "No space left on device")
        return save(obj, path, *args, **kwargs)

    torch.save = full_disk
    try:
        engine.save_checkpoint(directory, "last")
        failed = ""
    except Exception as error:
        failed = str(error)
    finally:
        torch.save = save
    after_failure = loaded()
    engine.save_checkpoint(directory, "last")
    after_success = loaded()
    last = Path(directory) / "last"
    if rank == 0:  # killed between the renames: the older checkpoint aside, the new one complete beside it
        shutil.copytree(last, last.with_name("last.tmp"))
        last.rename(last.with_name("last.old"))
    dist.barrier()
    after_kill = loaded()
    return {"failed": failed, "kept": torch.equal(after_failure, first), "replaced": torch.equal(after_success, second),
            "recovered": torch.equal(after_kill, second) and sorted(p.name for p in Path(directory).iterdir()),
            "states_differ": not torch.equal(*first)}


def test_a_save_into_an_existing_tag_that_fails_leaves_the_one_before_whole(tmp_path):
    """DeepSpeed wrote over the tag's files in place: a save that failed on one rank left the only checkpoint a mix
    of two (here rank 1's optimizer state of the failed save beside rank 0's of the one before)."""
    for seen in run_ranks(saves_into_one_tag, 2, str(tmp_path), timeout=300):
        assert "No space left on device" in seen["failed"]
        assert seen == {"failed": seen["failed"], "kept": True, "replaced": True,
                        "recovered": ["last", "latest"], "states_differ": True}


def range_test_after_loading_weights(rank: int, world: int, directory: str, module_only: bool) -> list[bool]:
    import deepspeed
    from torch.nn.utils import parameters_to_vector

    from hdet_scale import HDETConfig, ReplicaTopology
    from hdet_scale.engines import deepspeed as hdet_deepspeed
    from hdet_scale.engines.zero import ReplicaMPU

    def model_and_optimizer(seed: int):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 1}}
    mpu = ReplicaMPU(ReplicaTopology.build(HDETConfig(ranks_per_replica=1)))
    model, optimizer = model_and_optimizer(seed=1)  # the pretrained weights a fine-tune starts from
    with hdet_deepspeed.replica_groups(mpu):
        plain, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
        plain.save_checkpoint(f"{directory}/rank{rank}", "pretrained")
    pretrained = parameters_to_vector(plain.module.parameters()).detach().clone()

    model, optimizer = model_and_optimizer(seed=2)
    hdet = {"ranks_per_replica": 1, "sync_interval": 5, "auto_lr": {"range_test": 13}}
    engine, *_ = hdet_deepspeed.initialize(model=model, optimizer=optimizer, config={**config, "hdet": hdet})
    engine.load_checkpoint(f"{directory}/rank{rank}", "pretrained", load_module_only=module_only)
    loaded = torch.equal(parameters_to_vector(engine.module.parameters()), pretrained)
    generator = torch.Generator().manual_seed(rank)
    while engine.hdet.ramping:
        engine.backward(engine(torch.randn(2, 8, generator=generator)).pow(2).mean())
        engine.step()
    return [loaded, torch.equal(parameters_to_vector(engine.module.parameters()), pretrained)]


@pytest.mark.parametrize("module_only", [True, False], ids=["load_module_only", "checkpoint without HDET"])
def test_the_range_test_comes_back_to_weights_loaded_after_initialize(tmp_path, module_only):
    """The range test kept the weights HDET attached to: a fine-tune that loaded its pretrained weights after
    deepspeed.initialize was back at its random start after the test."""
    assert run_ranks(range_test_after_loading_weights, 2, str(tmp_path), module_only) == [[True, True]] * 2
