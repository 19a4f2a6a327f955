"""DCP checkpoints of an FSDP2 HDET run on 4 gloo ranks = 2 replicas x 2 shards."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from test_fsdp import PER_REPLICA, WORLD, full, loss_of, tiny_llama

from distributed import gather_rows, run_ranks, train_steps
from hdet_scale import AutoLRConfig, HDETConfig
from hdet_scale.comm import PeerFailed
from hdet_scale.engines.fsdp import wrap
from hdet_scale.engines.fsdp_checkpoint import (
    EXTRA_STATE_FILE,
    HDET_STATE_FILE,
    full_state_dict,
    has_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_pretrained,
)

CONFIG = HDETConfig(spread="linear", alpha=0.5, sync_interval=3, ranks_per_replica=PER_REPLICA, gradient_mode="local",
                    auto_lr=AutoLRConfig(mode="scale", start=0, sigma=0.01, range_test=0))


def build(seed: int):
    model, hdet = wrap(tiny_llama(seed), CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    hdet.attach(optimizer)
    return model, optimizer, hdet


def train(model, optimizer, hdet, rank: int, steps: range) -> list[float]:
    return train_steps(model, optimizer, hdet, loss_of, rank, steps)


def moments(optimizer) -> torch.Tensor:
    return full(state["exp_avg"] for state in optimizer.state.values())


def resume(rank: int, world: int, directory: str) -> None:
    path = Path(directory) / "ckpt"
    straight = build(seed=0)
    straight_losses = train(*straight, rank, range(1, 10))

    first = build(seed=0)
    losses = train(*first, rank, range(1, 5))
    with pytest.raises(ValueError, match="a checkpoint is taken at sync points"):
        save_checkpoint(path, *first)
    assert not path.exists()
    losses += train(*first, rank, range(5, 7))
    saved_moments = moments(first[1])
    replica_moments = gather_rows(saved_moments)
    assert not torch.equal(replica_moments[0], replica_moments[2])  # local mode: replicas' Adam states differ
    save_checkpoint(path, *first)
    save_checkpoint(path, *first)  # overwriting an existing checkpoint keeps exactly one, complete
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt"]
    # A kill between the save's two renames leaves no ckpt: the older checkpoint as ckpt.old and the newer, complete,
    # as ckpt.tmp. Asked whether there is a checkpoint, the library said no (the run started afresh, and its first
    # save deleted ckpt.tmp); the newer one is put in place.
    torch.distributed.barrier()  # every rank has looked at the folder above
    if rank == 0:
        shutil.copytree(path, path.with_name("ckpt.old"))
        path.rename(path.with_name("ckpt.tmp"))
        (path.with_name("ckpt.tmp") / "newer").touch()
    torch.distributed.barrier()
    assert has_checkpoint(path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt"]
    assert (path / "newer").is_file()

    second = build(seed=123)
    load_checkpoint(path, *second)
    assert torch.equal(moments(second[1]), saved_moments)  # each replica got its own optimizer state back
    losses += train(*second, rank, range(7, 10))
    assert losses == straight_losses
    assert torch.equal(full(straight[0].parameters()), full(second[0].parameters()))

    # The synced model consolidates into one unsharded transformers model.
    state = full_state_dict(second[0])
    save_pretrained(second[0], Path(directory) / "export")
    synced = full(second[0].parameters())
    if rank == 0:
        plain = tiny_llama(seed=7)
        plain.load_state_dict(state)
        assert torch.equal(torch.cat([p.detach().reshape(-1) for p in plain.parameters()]), synced)
        from transformers import LlamaForCausalLM

        exported = LlamaForCausalLM.from_pretrained(Path(directory) / "export")
        tokens = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
        assert torch.allclose(exported(input_ids=tokens).logits, plain(input_ids=tokens).logits)

    # A checkpoint from elsewhere cannot run code at load: a pickled callable in its HDET or extra state is refused
    # (both are read on rank 0, which the other ranks then follow).
    for name in (HDET_STATE_FILE, EXTRA_STATE_FILE):
        save_checkpoint(path, *second)
        if rank == 0:
            torch.save({"hook": print}, path / name)
        torch.distributed.barrier()
        refused = PeerFailed if rank > 0 else pickle.UnpicklingError
        with pytest.raises(refused, match="Weights only load failed"):
            load_checkpoint(path, *second)


def test_resume_from_a_checkpoint_continues_exactly(tmp_path):
    run_ranks(resume, WORLD, str(tmp_path))


def applied_after_resume(rank: int, world: int, directory: str) -> dict:
    """Save at the sync at step 3, load into a fresh run, train to the next sync: the bases that interval applied
    (what report --export-schedule writes)."""
    path = Path(directory) / "ckpt"
    probe = {"mode": "log", "start": 0, "stop": 12, "average_window": 0.25, "range_test": 0}
    config = HDETConfig.from_dict({"spread": "linear", "alpha": 0.5, "sync_interval": 3,
                                   "ranks_per_replica": PER_REPLICA, "auto_lr": probe})

    def build_probed(seed: int):
        model, hdet = wrap(tiny_llama(seed), config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        hdet.attach(optimizer).set_probe(lambda: loss_of(model, 0, 0))
        return model, optimizer, hdet

    model, optimizer, hdet = build_probed(seed=0)
    train(model, optimizer, hdet, rank, range(1, 4))
    save_checkpoint(path, model, optimizer, hdet)
    model, optimizer, hdet = build_probed(seed=1)
    load_checkpoint(path, model, optimizer, hdet)
    reports = []
    for step in range(4, 7):
        optimizer.zero_grad()
        loss = loss_of(model, rank, step)
        loss.backward()
        optimizer.step()
        reports.append(hdet.step(loss))
    return {"applied": reports[-1].values["lr/0"]["applied_bases"]}


def test_a_resumed_interval_records_only_its_own_steps(tmp_path):
    """Loading the optimizer runs a step at LR 0 that the LR hook recorded: the first sync after every resume
    had T + 1 applied bases, the first of them 0. (This test also checked that the probe's averaged-weight window
    was sized for the step the run resumed at, not step 0: a window that grew over the run, the removed
    ``auto_lr.average_window_late``, was once sized at step 0 before the checkpoint loaded. The window no longer
    depends on the step, so there is nothing left to size.)"""
    for result in run_ranks(applied_after_resume, WORLD, str(tmp_path)):
        assert len(result["applied"]) == 3 and all(base > 0 for base in result["applied"])


def small_run(config: HDETConfig, *, seed: int = 0, weight_decay: float = 0.01, total_steps: int | None = None):
    """A two-layer model wrapped whole (no blocks), AdamW at 1e-2 and HDET attached: (model, optimizer, handle)."""
    torch.manual_seed(seed)
    model, handle = wrap(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)), config, block_classes=[])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=weight_decay)
    handle.attach(optimizer, total_steps=total_steps)
    return model, optimizer, handle


def save_while_ramping(rank: int, world: int, directory: str) -> list[str]:
    config = HDETConfig(spread="linear", alpha=0.5, sync_interval=4, ranks_per_replica=1,
                        auto_lr=AutoLRConfig(mode="scale", start=0, range_test=13))
    model, optimizer, handle = small_run(config)
    for _ in range(2):
        optimizer.zero_grad()
        loss = model(torch.randn(3, 4)).pow(2).mean()
        loss.backward()
        optimizer.step()
        handle.step(loss)
    assert handle.ramping
    with pytest.raises(RuntimeError, match="during the LR range test"):
        save_checkpoint(Path(directory) / "ckpt", model, optimizer, handle)
    return sorted(p.name for p in Path(directory).iterdir())


def test_a_checkpoint_during_the_range_test_is_refused_before_anything_is_written(tmp_path):
    """HDET's state was asked for on rank 0 only after every rank had written its shards: the refusal came after a
    full save, on the other ranks as a PeerFailed, and left ckpt.tmp behind."""
    assert run_ranks(save_while_ramping, 2, str(tmp_path)) == [[], []]


def load_into_another_exploration(rank: int, world: int, directory: str) -> bool:
    path = Path(directory) / "ckpt"

    def build_small(explore: dict, seed: int):
        config = HDETConfig.from_dict({"spread": "linear", "alpha": 0.5, "sync_interval": 2, "ranks_per_replica": 1,
                                       "auto_lr": {"range_test": 0}, "explore": explore})
        return small_run(config, seed=seed, weight_decay=0.1, total_steps=100)

    saved = build_small({}, seed=0)
    save_checkpoint(path, *saved)
    other = build_small({"weight_decay": {"alpha": 0.5}}, seed=1)
    before = full(other[0].parameters())
    with pytest.raises(ValueError, match="explore settings must match the checkpoint's"):
        load_checkpoint(path, *other)
    return torch.equal(full(other[0].parameters()), before)


def test_a_checkpoint_of_another_exploration_is_refused_before_the_model_is_read(tmp_path):
    """The HDET state was checked after the model and optimizer were loaded: a refused load had overwritten them
    (and read every shard first)."""
    assert run_ranks(load_into_another_exploration, 2, str(tmp_path)) == [True, True]


def load_where_ranks_see_different_files(rank: int, world: int, directory: str) -> tuple[bool, dict]:
    """Rank 0 sees the checkpoint whole; rank 1 sees its shards but not the files rank 0 writes beside them, as a
    rank of a network file system with a stale cache may."""
    config = HDETConfig(spread="linear", alpha=0.5, sync_interval=1, ranks_per_replica=1,
                       auto_lr=AutoLRConfig(mode="scale", start=0, range_test=0))
    model, optimizer, handle = small_run(config)
    views = [Path(directory) / "rank0_view", Path(directory) / "rank1_view"]
    save_checkpoint(views[0] / "ckpt", model, optimizer, handle, extra_state={"epoch": 3})
    if rank == 0:
        shutil.copytree(views[0] / "ckpt", views[1] / "ckpt")
        for name in (HDET_STATE_FILE, EXTRA_STATE_FILE):
            (views[1] / "ckpt" / name).unlink()
    torch.distributed.barrier()
    os.chdir(views[rank])
    found = has_checkpoint("ckpt")
    return found, load_checkpoint("ckpt", model, optimizer, handle) if found else {}


def test_every_rank_follows_rank_0s_reading_of_the_checkpoint(tmp_path):
    """Each rank looked for the checkpoint and read its HDET and extra state for itself: where ranks see the file
    system differently, one started afresh (or failed) while the others loaded, and the run hung in DCP's load."""
    assert run_ranks(load_where_ranks_see_different_files, 2, str(tmp_path)) == [(True, {"epoch": 3})] * 2


def optimizer_states_in_global_mode(rank: int, world: int, directory: str, coupled_decay: bool) -> tuple[bool, bool]:
    """Global mode, 2 replicas x 2 shards, saved at the sync at step 2: whether the checkpoint holds replica 1's
    optimizer state, and whether the replicas' states differed; each replica must get its own back either way."""
    import torch.distributed.checkpoint as dcp
    from settings import lr_held_at_given

    path = Path(directory) / "ckpt"
    config = HDETConfig(spread="linear", alpha=0.5, sync_interval=2, ranks_per_replica=PER_REPLICA,
                        auto_lr=lr_held_at_given())

    def build_global(seed: int):
        model, hdet = wrap(tiny_llama(seed), config)
        # Adam adds the weight decay to the gradient, so replicas training at other LRs get other moments
        kind = torch.optim.Adam if coupled_decay else torch.optim.AdamW
        optimizer = kind(model.parameters(), lr=1e-2, weight_decay=0.1)
        hdet.attach(optimizer)
        return model, optimizer, hdet

    first = build_global(seed=0)
    train(*first, rank, range(1, 3))
    saved_moments = moments(first[1])
    rows = gather_rows(saved_moments)
    save_checkpoint(path, *first)
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    second = build_global(seed=9)
    load_checkpoint(path, *second)
    assert torch.equal(moments(second[1]), saved_moments)
    return any(key.startswith("optimizer_replica1.") for key in keys), not torch.equal(rows[0], rows[2])


@pytest.mark.parametrize("coupled_decay", [False, True])
def test_replicas_alike_save_one_optimizer_state_and_those_that_differ_each_their_own(tmp_path, coupled_decay):
    """Every replica saved its optimizer state, R copies of it where they were alike (global mode, AdamW)."""
    expected = (coupled_decay, coupled_decay)
    assert run_ranks(optimizer_states_in_global_mode, WORLD, str(tmp_path), coupled_decay) == [expected] * WORLD


def export_between_syncs(rank: int, world: int) -> bool:
    config = HDETConfig(spread="linear", alpha=0.5, sync_interval=2, ranks_per_replica=1,
                        auto_lr=AutoLRConfig(mode="scale", start=0, range_test=0))
    model, optimizer, handle = small_run(config)
    optimizer.zero_grad()
    loss = model(torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))).pow(2).mean()
    loss.backward()
    optimizer.step()
    handle.step(loss)  # step 1 of 2: the replicas differ
    assert not torch.equal(*gather_rows(full(model.parameters())))
    with pytest.raises(RuntimeError, match=r"step 1 is between syncs .*\(hdet\.sync\(\)"):
        full_state_dict(model)
    handle.sync()
    exported, synced = full_state_dict(model), full(model.parameters())  # the export: complete on rank 0
    return rank > 0 or torch.equal(torch.cat([value.reshape(-1) for value in exported.values()]), synced)


def test_the_model_is_exported_at_sync_points_only():
    """Between syncs the export was rank 0's replica alone, silently."""
    assert run_ranks(export_between_syncs, 2) == [True, True]
