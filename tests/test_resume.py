"""A bad resume is refused before training, in one line, touching nothing; a checkpoint loads into more and fewer
replicas (FSDP2 and DeepSpeed, real gloo ranks); settings that would do nothing are refused up front."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from settings import LR_HELD_AT_GIVEN, lr_held_at_given

from distributed import gather_rows, run_ranks
from hdet_scale.lm.checkpoints import (
    MANIFEST,
    ResumeError,
    check_resume,
    identity,
    settle_interrupted_save,
    write_manifest,
)
from hdet_scale.train import SINGLE_PROCESS, parse_args, plan

MODEL = {"preset": "tiny", "hidden_size": 64, "vocab_size": 256}


def run(engine: str = "fsdp", zero_stage: int | None = None, replicas: int = 2, per_replica: int = 2,
        explored: list[str] | None = None, model: dict | None = None) -> dict:
    return identity(engine=engine, zero_stage=zero_stage, model=model or MODEL, replicas=replicas,
                    ranks_per_replica=per_replica, explored=explored or [])


def fake_checkpoint(out: Path, saved: dict, *, deepspeed_tag: str | None = None) -> Path:
    """A checkpoint folder as train.py leaves it: FSDP2's ``latest/``, or DeepSpeed's tag named by ``latest``."""
    root = out / "checkpoints"
    path = root / (deepspeed_tag or "latest")
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"m" * 10)
    (path / "__0_0.distcp").write_bytes(b"s" * 100)
    if deepspeed_tag:
        (root / "latest").write_text(deepspeed_tag)
    write_manifest(path, saved, step=20)
    return path


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*")}


@pytest.mark.parametrize(("change", "message"), [
    (lambda out, path: None, None),
    (lambda out, path: (path / "__0_0.distcp").write_bytes(b"s" * 40), r"is damaged: __0_0.distcp has 40 bytes, 100"),
    (lambda out, path: (path / ".metadata").unlink(), r"is incomplete: .metadata is missing"),
    (lambda out, path: (path / MANIFEST).unlink(), r"has no run.json \(it is incomplete, or was not written"),
])
def test_files_are_checked_before_anything_is_touched(tmp_path, change, message):
    path = fake_checkpoint(tmp_path, run())
    change(tmp_path, path)
    before = snapshot(tmp_path)
    if message is None:
        point = check_resume(tmp_path, run(replicas=4, per_replica=1))
        assert point.step == 20 and point.layout_changed and "saved replica r mod 2" in point.layout_line()
    else:
        with pytest.raises(ResumeError, match=message):
            check_resume(tmp_path, run())
    assert snapshot(tmp_path) == before  # a refused (or accepted) check writes nothing


@pytest.mark.parametrize(("current", "message"), [
    (run(engine="deepspeed", zero_stage=2), r"was written by fsdp, this run uses deepspeed ZeRO-2"),
    (run(model={**MODEL, "hidden_size": 256}), r"holds another model \(hidden_size 64 -> 256\)"),
    (run(explored=["label_smoothing"]), r"explores \[\], this run \['label_smoothing'\]"),
])
def test_what_cannot_continue_is_refused_in_one_line(tmp_path, current, message):
    fake_checkpoint(tmp_path, run())
    with pytest.raises(ResumeError, match=message) as caught:
        check_resume(tmp_path, current)
    assert "\n" not in str(caught.value) and str(tmp_path / "checkpoints" / "latest") in str(caught.value)


def test_deepspeed_checkpoints_keep_their_shard_size(tmp_path):
    saved = run(engine="deepspeed", zero_stage=1, per_replica=2)
    fake_checkpoint(tmp_path, saved, deepspeed_tag="step20")
    assert check_resume(tmp_path, run(engine="deepspeed", zero_stage=1, replicas=4, per_replica=2)).replicas == 4
    with pytest.raises(ResumeError, match="sharded over 2 rank\\(s\\) per replica, this run 1"):
        check_resume(tmp_path, run(engine="deepspeed", zero_stage=1, per_replica=1))
    assert check_resume(tmp_path / "elsewhere", saved) is None  # no checkpoint: a fresh start


def test_leftovers_of_an_interrupted_save_are_removed(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "latest.tmp").mkdir(parents=True)
    (root / "latest.tmp" / "shard").write_text("x")
    assert settle_interrupted_save(tmp_path) == [f"removed {root / 'latest.tmp'}, left by an interrupted checkpoint"]
    assert not (root / "latest.tmp").exists() and settle_interrupted_save(tmp_path) == []


def staged(out: Path, name: str, step: int) -> Path:
    """A complete FSDP2 checkpoint at ``step`` under the staging name ``name``."""
    path = fake_checkpoint(out / name, run())
    target = out / "checkpoints" / name
    target.parent.mkdir(exist_ok=True)
    path.rename(target)
    write_manifest(target, run(), step=step)
    return target


@pytest.mark.parametrize("newest", ["latest.tmp", "latest.old"])
def test_a_kill_between_the_two_renames_loses_no_checkpoint(tmp_path, newest):
    """FSDP2's save moves latest to latest.old, then latest.tmp to latest. Killed in between, --resume found no
    latest, started afresh, and the start removed both complete checkpoints. Now the newest complete one is
    resumed from, promoted to latest, and only then is the older one removed."""
    older = "latest.old" if newest == "latest.tmp" else "latest.tmp"
    staged(tmp_path, older, step=10)
    staged(tmp_path, newest, step=30)
    root = tmp_path / "checkpoints"
    point = check_resume(tmp_path, run())
    assert (point.path, point.step) == (root / newest, 30)
    assert settle_interrupted_save(tmp_path) == [
        f"promoted {root / newest} (complete, step 30) to {root / 'latest'}, left by a checkpoint interrupted "
        "between its renames", f"removed {root / older}, left by an interrupted checkpoint"]
    assert sorted(path.name for path in root.iterdir()) == ["latest"]
    assert check_resume(tmp_path, run()).step == 30


def test_an_incomplete_staging_is_never_preferred_to_a_complete_one(tmp_path):
    staged(tmp_path, "latest.old", step=10)
    damaged = staged(tmp_path, "latest.tmp", step=30)
    (damaged / "__0_0.distcp").write_bytes(b"s" * 40)
    assert check_resume(tmp_path, run()).step == 10
    settle_interrupted_save(tmp_path)
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == ["latest"]
    assert check_resume(tmp_path, run()).step == 10


# ---------------------------------------------------------------------------------------- train.py, no launch
@pytest.fixture
def single_process(monkeypatch):
    for name, value in SINGLE_PROCESS.items():
        monkeypatch.setenv(name, value)


def test_another_engines_checkpoint_is_refused_before_any_process_group(tmp_path, single_process):
    fake_checkpoint(tmp_path, run(engine="fsdp", replicas=1, per_replica=1))
    args = parse_args(["--engine", "deepspeed", "--zero_stage", "1", "--out", str(tmp_path), "--resume",
                       "--max_data_mb", "1"])
    with pytest.raises(ResumeError, match="written by fsdp, this run uses deepspeed ZeRO-1"):
        plan(args)
    assert not dist.is_initialized()


@pytest.mark.parametrize(("words", "message"), [
    (["--hdet_config", "{hdet}"], r"explore.dropout explores the model's dropout, and it has none: pass --dropout"),
    (["--engine", "deepspeed", "--deepspeed_config", "{fp16}"], r"fp16.enabled: HDET supports fp32 and bf16"),
    (["--engine", "deepspeed", "--deepspeed_config", "{offload}"], r"offload_optimizer.device='cpu'"),
    (["--engine", "deepspeed", "--deepspeed_config", "{batch}"],
     r"train_batch_size=24 does not match train_micro_batch_size_per_gpu=4 x gradient_accumulation_steps=1 x "
     r"1 ranks = 4"),
])
def test_settings_that_would_do_nothing_or_fail_late_are_refused_first(tmp_path, single_process, words, message):
    files = {"hdet": {"explore": {"dropout": {"alpha": 0.3}}},
             "fp16": {"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True}},
             "offload": {"train_micro_batch_size_per_gpu": 4,
                         "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
             "batch": {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}}
    paths = {}
    for name, content in files.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(content))
    args = parse_args([word.format(**paths) for word in words] + ["--out", str(tmp_path), "--max_data_mb", "1"])
    with pytest.raises(ValueError, match=message):
        plan(args)
    assert not dist.is_initialized()


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
    assert torch.isfinite(gather_rows(loaded["model"])).all()


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("fsdp_layouts") / "ckpt")
    run_ranks(fsdp_save, 4, directory)  # 2 replicas x 2 shards
    return directory


@pytest.mark.parametrize(("world", "per_replica"), [(2, 2), (4, 1)])  # 1 replica; 4 replicas of 1 rank
def test_fsdp2_checkpoint_loads_into_fewer_and_more_replicas(fsdp_checkpoint, world, per_replica):
    run_ranks(fsdp_load, world, fsdp_checkpoint, per_replica)


# -------------------------------------------------------------------------- more and fewer replicas, DeepSpeed
def zero_engine(seed: int):
    from test_deepspeed import build, ds_config

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    hdet = {"alpha": 0.5, "spread": "linear", "sync_interval": 2, "ranks_per_replica": 1, "gradient_mode": "local",
            "auto_lr": LR_HELD_AT_GIVEN}
    return build(ds_config(1, hdet=hdet), seed=seed)


def zero_moments(engine) -> torch.Tensor:
    return torch.cat([tensor.reshape(-1) for tensor in engine.hdet.adapter.optimizer_state_tensors()])


def zero_save(rank: int, world: int, directory: str) -> None:
    from test_deepspeed import full_fp32, train_step

    engine = zero_engine(seed=0)
    for step in range(1, 3):
        train_step(engine, rank, step)
    engine.hdet.save_checkpoint(directory, "tag")
    torch.save({"model": full_fp32(engine), "moments": zero_moments(engine)}, Path(directory) / f"rank{rank}.pt")


def zero_load(rank: int, world: int, directory: str) -> None:
    from test_deepspeed import full_fp32, train_step

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


def test_a_full_disk_is_found_before_a_save_starts(tmp_path):
    from hdet_scale.lm.checkpoints import check_free_space

    check_free_space(tmp_path)  # no checkpoint yet: nothing to compare with
    path = fake_checkpoint(tmp_path, run())
    check_free_space(tmp_path)  # 110 bytes: room enough
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"]["__0_0.distcp"] = 2**62  # as if the last checkpoint had been 4 EiB
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(OSError, match=r"no room for a checkpoint in .*: the last one took .* GiB, .* GiB are free"):
        check_free_space(tmp_path)


# ------------------------------------------------------------------------------ train.py's label smoothing
def smoothing_step(rank: int, world: int) -> tuple[float, float]:
    """One train.py step on FSDP2 with explore.label_smoothing: the loss it trains on is the replica's smoothed
    cross-entropy, computed here independently before the step."""
    import argparse

    from hdet_scale import HDETConfig
    from hdet_scale.lm.backends import FSDPBackend
    from hdet_scale.lm.model import build_model

    config = HDETConfig.from_dict({"alpha": 0.5, "spread": "linear", "ranks_per_replica": 1, "sync_interval": 1,
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


def test_a_collective_checkpoint_failure_is_told_by_its_first_rank_in_one_line():
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from hdet_scale.comm import one_line

    failures = {rank: _wrap_exception(NotADirectoryError(f"Not a directory: 'latest.tmp' (rank {rank})\nmore"))
                for rank in (3, 1)}
    assert one_line(CheckpointException("CheckpointException ranks", failures)) == (
        "NotADirectoryError: Not a directory: 'latest.tmp' (rank 1)")
    assert one_line(ValueError("")) == "ValueError: "


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
