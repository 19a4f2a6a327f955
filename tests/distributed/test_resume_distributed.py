"""A bad resume is refused before training, in one line, touching nothing; a checkpoint loads into more and fewer
replicas (FSDP2 and DeepSpeed, real gloo ranks); settings that would do nothing are refused up front.

This file holds the tests on gloo ranks; the tests that start no process are in tests/unit/test_resume.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from settings import LR_HELD_AT_GIVEN, lr_held_at_given

from distributed import run_ranks


# ------------------------------------------------------------------------------ more and fewer replicas, FSDP2
def fsdp_save(rank: int, world: int, directory: str) -> None:
    from test_fsdp import loss_of, tiny_llama

    from hdet_scale import HDETConfig
    from hdet_scale.engines.fsdp import wrap
    from hdet_scale.engines.fsdp_checkpoint import save_checkpoint

    config = HDETConfig(spread="linear", alpha=0.5, sync_interval=2, ranks_per_replica=2, gradient_mode="local",
                        auto_lr=lr_held_at_given())
    model, hdet = wrap(tiny_llama(seed=0), config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hdet.attach(optimizer)
    for step in range(1, 3):
        optimizer.zero_grad()
        loss = loss_of(model, rank, step)
        loss.backward()
        optimizer.step()
        hdet.step(loss)
    save_checkpoint(directory, model, optimizer, hdet)
    torch.save(_fsdp_snapshot(model, optimizer), Path(directory) / f"rank{rank}.pt")


def _fsdp_snapshot(model, optimizer) -> dict[str, torch.Tensor]:
    """The full model and this replica's full Adam moments (collective over the replica)."""
    from test_fsdp import full

    moments = full(optimizer.state[p]["exp_avg"] for p in model.parameters())
    return {"model": full(model.parameters()), "moments": moments}


def fsdp_load(rank: int, world: int, directory: str, per_replica: int) -> None:
    from test_fsdp import loss_of, tiny_llama

    from hdet_scale import HDETConfig
    from hdet_scale.engines.fsdp import wrap
    from hdet_scale.engines.fsdp_checkpoint import load_checkpoint

    config = HDETConfig(spread="linear", alpha=0.5, sync_interval=2, ranks_per_replica=per_replica,
                        gradient_mode="local", auto_lr=lr_held_at_given())
    model, hdet = wrap(tiny_llama(seed=7), config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hdet.attach(optimizer)
    load_checkpoint(directory, model, optimizer, hdet)
    loaded = _fsdp_snapshot(model, optimizer)
    replica = rank // per_replica
    saved = torch.load(Path(directory) / f"rank{(replica % 2) * 2}.pt")  # saved replica r mod 2, its first rank
    assert torch.equal(loaded["model"], saved["model"])  # the model at the resume point is the saved one
    assert torch.equal(loaded["moments"], saved["moments"])
    assert hdet.ensemble.global_step == 2 and hdet.topology.num_replicas == world // per_replica
    loss = loss_of(model, rank, 3)  # and it trains on
    loss.backward()
    optimizer.step()
    hdet.step(loss)
    trained = _fsdp_snapshot(model, optimizer)["model"]
    assert torch.isfinite(trained).all() and not torch.equal(trained, loaded["model"])


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("fsdp_layouts") / "ckpt")
    run_ranks(fsdp_save, 4, directory)  # 2 replicas x 2 shards, local gradients: their moments differ
    saved = [torch.load(Path(directory) / f"rank{rank}.pt")["moments"] for rank in (0, 2)]
    assert not torch.equal(*saved)  # so a load that gave a replica the other's state would show
    return directory


@pytest.mark.parametrize(("world", "per_replica"), [(2, 2), (4, 1)])  # 1 replica; 4 replicas of 1 rank
def test_fsdp2_checkpoint_loads_into_fewer_and_more_replicas(fsdp_checkpoint, world, per_replica):
    run_ranks(fsdp_load, world, fsdp_checkpoint, per_replica)


# -------------------------------------------------------------------------- more and fewer replicas, DeepSpeed
def zero_engine(seed: int):
    from test_deepspeed import ds_config
    from test_deepspeed_distributed import build

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    hdet = {"alpha": 0.5, "spread": "linear", "sync_interval": 2, "ranks_per_replica": 1, "gradient_mode": "local",
            "auto_lr": LR_HELD_AT_GIVEN}
    return build(ds_config(1, hdet=hdet), seed=seed)


def zero_moments(engine) -> torch.Tensor:
    return torch.cat([tensor.reshape(-1) for tensor in engine.hdet.adapter.optimizer_state_tensors()])


def zero_save(rank: int, world: int, directory: str) -> None:
    from test_deepspeed_distributed import full_fp32, train_step

    engine = zero_engine(seed=0)
    for step in range(1, 3):
        train_step(engine, rank, step)
    engine.hdet.save_checkpoint(directory, "tag")
    torch.save({"model": full_fp32(engine), "moments": zero_moments(engine)}, Path(directory) / f"rank{rank}.pt")


def zero_load(rank: int, world: int, directory: str) -> None:
    from test_deepspeed_distributed import full_fp32, train_step

    engine = zero_engine(seed=5)
    engine.hdet.load_checkpoint(directory, "tag")
    saved = torch.load(Path(directory) / f"rank{rank % 2}.pt")  # saved replica r mod 2
    assert torch.equal(full_fp32(engine), saved["model"])
    assert torch.equal(zero_moments(engine), saved["moments"])
    assert engine.hdet.global_step == 2 and engine.hdet.topology.num_replicas == world
    train_step(engine, rank, 3)
    assert torch.isfinite(full_fp32(engine)).all()


@pytest.fixture(scope="module")
def zero_checkpoint(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("zero_layouts") / "ckpt")
    run_ranks(zero_save, 2, directory)  # 2 replicas of 1 rank, ZeRO-1, local gradients: their moments differ
    saved = [torch.load(Path(directory) / f"rank{r}.pt")["moments"] for r in range(2)]
    assert not torch.equal(*saved)
    return directory


@pytest.mark.parametrize("world", [1, 4])
def test_deepspeed_checkpoint_loads_into_fewer_and_more_replicas(zero_checkpoint, world):
    run_ranks(zero_load, world, zero_checkpoint)


# ------------------------------------------------------------------------------ train.py's label smoothing
def smoothing_step(rank: int, world: int) -> tuple[float, float]:
    """One train.py step on FSDP2 with explore.label_smoothing: the loss it trains on is the replica's smoothed
    cross-entropy, computed here independently before the step."""
    import argparse

    from hdet_scale import HDETConfig
    from hdet_scale.lm.backends import FSDPBackend
    from hdet_scale.lm.model import build_model

    config = HDETConfig.from_dict({"alpha": 0.5, "spread": "linear", "ranks_per_replica": 1, "sync_interval": 1,
                                   "gradient_mode": "local",
                                   "explore": {"label_smoothing": {"base": 0.2, "alpha": 0.5}}})
    args = argparse.Namespace(dtype="fp32", grad_accum=1, micro_batch_size=2, lr=1e-3, weight_decay=0.0, steps=10,
                              warmup_steps=1, min_lr_ratio=0.1, grad_clip=0.0, replay_schedule=None)
    torch.manual_seed(0)
    backend = FSDPBackend(build_model("tiny", vocab_size=64, seq_len=16), config, args, torch.device("cpu"))
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(rank))
    batch = (tokens[:, :-1], tokens[:, 1:])
    smoothing = backend.ensemble.value("label_smoothing")
    with torch.no_grad():  # smoothed cross-entropy by hand: (1 - eps) * NLL + eps * mean over the vocabulary
        log_probs = backend.model(input_ids=batch[0]).logits.float().log_softmax(-1)
        nll = -log_probs.gather(-1, batch[1].unsqueeze(-1)).mean()
        expected = (1 - smoothing) * nll + smoothing * -log_probs.mean()
    loss = backend.forward_backward(batch, index=0, of=1)
    backend.optimizer_step([loss])
    return smoothing, float(loss) - float(expected)


def test_explored_label_smoothing_reaches_train_pys_loss():
    results = run_ranks(smoothing_step, 2)
    assert sorted(smoothing for smoothing, _ in results) == pytest.approx([0.1, 0.3])  # 0.2 x (1 -+ 0.5)
    assert all(abs(difference) < 1e-6 for _, difference in results)


def checkpoint_failure_on_rank_1(rank: int, world: int) -> str:
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from hdet_scale.lm.agreement import RunFailed, agreed

    def save() -> None:  # DCP raises its collective exception on every rank, carrying rank 1's error
        raise CheckpointException("CheckpointException ranks", {1: _wrap_exception(OSError("No space left"))})

    with pytest.raises(RunFailed) as failed:
        agreed("saving a checkpoint", save)
    return str(failed.value)


def test_a_collective_failure_names_the_rank_it_came_from():
    """Every rank holds DCP's exception, rank 0 first: the line used to say rank 0 for rank 1's failure."""
    assert run_ranks(checkpoint_failure_on_rank_1, 2) == ["saving a checkpoint: OSError: No space left (rank 1)"] * 2
