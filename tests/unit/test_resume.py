"""A bad resume is refused before training, in one line, touching nothing; a checkpoint loads into more and fewer
replicas (FSDP2 and DeepSpeed, real gloo ranks); settings that would do nothing are refused up front.

This file holds the tests that start no process; the tests on gloo ranks are in
tests/distributed/test_resume_distributed.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch.distributed as dist

from hdet_scale.lm.checkpoints import (
    MANIFEST,
    ResumeError,
    check_resume,
    identity,
    settle_interrupted_save,
    write_manifest,
)
from hdet_scale.lm.train import SINGLE_PROCESS, parse_args, plan

MODEL = {"preset": "tiny", "hidden_size": 64, "vocab_size": 256}


OPTIMIZER = {"peak_lr": 3e-3, "weight_decay": 0.1}


def run(engine: str = "fsdp", zero_stage: int | None = None, replicas: int = 2, per_replica: int = 2,
        explored: list[str] | None = None, model: dict | None = None, optimizer: dict | None = None,
        settings: dict | None = None) -> dict:
    return identity(engine=engine, zero_stage=zero_stage, model=model or MODEL, replicas=replicas,
                    ranks_per_replica=per_replica, explored=explored or [], optimizer=optimizer or OPTIMIZER,
                    settings=settings or {"steps": 300})


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
    (run(optimizer={**OPTIMIZER, "peak_lr": 1e-3}), r"other optimizer settings \(peak_lr 0.003 -> 0.001\): a "
                                                    r"resumed run takes the saved optimizer and LR schedule state"),
    (run(optimizer={**OPTIMIZER, "weight_decay": 0.0}), r"\(weight_decay 0.1 -> 0.0\)"),
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


def deepspeed_tag(out: Path, step: int, *, complete: bool = True) -> Path:
    """A DeepSpeed checkpoint folder ``step<step>`` as its save leaves it, with its manifest or (killed during the
    save) without."""
    path = out / "checkpoints" / f"step{step}"
    path.mkdir(parents=True)
    (path / "mp_rank_00_model_states.pt").write_bytes(b"m" * 50)
    if complete:
        write_manifest(path, run(engine="deepspeed", zero_stage=1), step=step)
    return path


def test_deepspeed_folders_a_kill_left_are_removed_and_a_complete_unnamed_one_is_resumed(tmp_path):
    root = tmp_path / "checkpoints"
    saved = run(engine="deepspeed", zero_stage=1)
    for step in (10, 20):  # 10: killed after 'latest' named 20, before 10 was removed
        deepspeed_tag(tmp_path, step)
    (root / "latest").write_text("step20")
    deepspeed_tag(tmp_path, 30, complete=False)  # killed while writing
    (root / "step10_keep").mkdir()  # what a user keeps there is not a checkpoint's
    (root / "steps_notes.txt").write_text("mine")
    assert check_resume(tmp_path, saved).step == 20
    assert settle_interrupted_save(tmp_path) == [
        f"removed {root / 'step10'}, older than the checkpoint resumed",
        f"removed {root / 'step30'}, left by an interrupted checkpoint"]
    assert sorted(path.name for path in root.iterdir()) == ["latest", "step10_keep", "step20", "steps_notes.txt"]
    (root / "step10_keep").rmdir(), (root / "steps_notes.txt").unlink()
    # killed after step40's manifest, before 'latest' named it: complete, so it is the run's newest checkpoint
    deepspeed_tag(tmp_path, 40)
    assert check_resume(tmp_path, saved).step == 40
    assert settle_interrupted_save(tmp_path) == [
        f"pointed {root / 'latest'} at {root / 'step40'} (complete, step 40), left by a checkpoint interrupted before "
        "it was named", f"removed {root / 'step20'}, older than the checkpoint resumed"]
    assert (root / "latest").read_text() == "step40" and check_resume(tmp_path, saved).step == 40
    assert sorted(path.name for path in root.iterdir()) == ["latest", "step40"]


def test_a_damaged_checkpoint_latest_names_is_refused_not_skipped_for_an_older_one(tmp_path):
    deepspeed_tag(tmp_path, 10)
    (deepspeed_tag(tmp_path, 20) / "mp_rank_00_model_states.pt").write_bytes(b"m" * 7)
    (tmp_path / "checkpoints" / "latest").write_text("step20")
    with pytest.raises(ResumeError, match="step20 is damaged"):
        check_resume(tmp_path, run(engine="deepspeed", zero_stage=1))


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
        "while it was put in place", f"removed {root / older}, left by an interrupted checkpoint"]
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


def test_a_checkpoint_that_cannot_continue_is_refused_before_the_text_is_read(tmp_path, single_process, monkeypatch):
    """A text corpus (a directory, the stdlib) is read whole into memory: it was read, all of it on every rank,
    before the checkpoint was found not to fit."""
    from hdet_scale.lm import plan as planning

    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("some text " * 200)
    fake_checkpoint(tmp_path / "out", run(engine="fsdp", replicas=1, per_replica=1))
    read = []
    monkeypatch.setattr(planning, "load_corpus", lambda *args, **kwargs: read.append(args) or pytest.fail("read"))
    args = parse_args(["--engine", "deepspeed", "--zero_stage", "1", "--out", str(tmp_path / "out"), "--resume",
                       "--data", str(texts)])
    with pytest.raises(ResumeError, match="written by fsdp, this run uses deepspeed ZeRO-1"):
        plan(args)
    assert read == []


def test_other_settings_a_resume_may_change_are_said_in_one_line(tmp_path, single_process):
    words = ["--out", str(tmp_path), "--max_data_mb", "1"]
    fake_checkpoint(tmp_path, plan(parse_args(words)).run)
    assert plan(parse_args([*words, "--resume"])).resume.changed == ()
    point = plan(parse_args([*words, "--resume", "--steps", "600", "--seed", "3"])).resume
    # a longer run moves the controller's window (shares of the run) with it, and train.py's sync interval
    assert point.changed == ("hdet.auto_lr.start 6 -> 12", "hdet.auto_lr.stop 75 -> 150", "hdet.sync_interval 5 -> 10",
                             "seed 0 -> 3", "steps 300 -> 600")
    assert point.changed_line().startswith("resuming with other settings than the checkpoint's (hdet.auto_lr.start "
                                           "6 -> 12, hdet.auto_lr.stop 75 -> 150, ")
    assert point.changed_line().endswith(", steps 300 -> 600): they apply from step 20 on")
    earlier = {**plan(parse_args([*words, "--resume"])).run}
    del earlier["settings"]  # a checkpoint of an earlier version: nothing to compare
    (tmp_path / "checkpoints").rename(tmp_path / "old")
    fake_checkpoint(tmp_path, earlier)
    assert plan(parse_args([*words, "--resume", "--steps", "600"])).resume.changed == ()


def test_a_resume_with_fewer_steps_than_its_checkpoint_is_refused_before_any_process_group(tmp_path, single_process):
    """--steps 10 over a checkpoint at step 20 skipped the loop, exported the model as finished at step 20 and
    exited 0."""
    words = ["--out", str(tmp_path), "--max_data_mb", "1", "--warmup_steps", "1"]
    path = fake_checkpoint(tmp_path, plan(parse_args(words)).run)  # at step 20
    with pytest.raises(ValueError, match=rf"--steps 10 is below the step of the checkpoint to resume, 20 \({path}\): "
                                         r"pass --steps 20 or more"):
        plan(parse_args([*words, "--resume", "--steps", "10"]))
    assert not dist.is_initialized()
    assert plan(parse_args([*words, "--resume", "--steps", "20"])).resume.step == 20  # the run's end: written again


def test_hdet_settings_the_checkpoint_keeps_are_said_kept_not_applied(tmp_path, single_process):
    """The line said every changed setting applies from the resumed step on, but the checkpoint's own state sets
    hdet.seed (the permutation streams) and auto_lr.initial_scale (the controller's scale), and warm_init acts
    only when a run starts. The range test's setting applies: whether the controller moves the LR follows it."""
    hdet = tmp_path / "hdet.json"
    hdet.write_text(json.dumps({"sync_interval": 5}))
    words = ["--out", str(tmp_path / "out"), "--max_data_mb", "1", "--hdet_config", str(hdet)]
    fake_checkpoint(tmp_path / "out", plan(parse_args(words)).run)
    hdet.write_text(json.dumps({"sync_interval": 5, "seed": 3, "auto_lr": {"initial_scale": 0.5, "range_test": 0},
                                "warm_init": {"enabled": True}}))
    point = plan(parse_args([*words, "--resume", "--steps", "600"])).resume
    assert point.changed_line() == (
        "resuming with other settings than the checkpoint's (hdet.auto_lr.range_test 100 -> 0, hdet.auto_lr.start "
        "6 -> 12, hdet.auto_lr.stop 75 -> 150, steps 300 -> 600): they apply from step 20 on; and settings the "
        "checkpoint keeps as they were (hdet.auto_lr.initial_scale 1.0 -> 0.5, hdet.seed 0 -> 3, "
        "hdet.warm_init.enabled False -> True): it restores the permutation streams and the controller's scale, and "
        "warm_init acts only when a run starts")
    hdet.write_text(json.dumps({"sync_interval": 5, "seed": 3}))
    assert plan(parse_args([*words, "--resume"])).resume.changed_line() == (
        "resuming with settings the checkpoint keeps as they were (hdet.seed 0 -> 3): it restores the permutation "
        "streams and the controller's scale, and warm_init acts only when a run starts")


def test_under_a_deepspeed_json_its_values_are_compared_not_the_flags_it_overrides(tmp_path, single_process):
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}))
    words = ["--engine", "deepspeed", "--deepspeed_config", str(ds_json), "--out", str(tmp_path / "out"),
             "--max_data_mb", "1"]
    saved = plan(parse_args(words)).run
    del saved["settings"]["seed"]  # a setting the checkpoint's version did not record: not compared
    fake_checkpoint(tmp_path / "out", saved)
    assert plan(parse_args([*words, "--resume", "--seed", "3"])).resume.changed == ()
    ds_json.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}))
    assert plan(parse_args([*words, "--resume"])).resume.changed == (
        "deepspeed.train_micro_batch_size_per_gpu 4 -> 2",)


def test_flags_a_deepspeed_json_run_does_not_read_are_not_said_to_apply(tmp_path, single_process):
    """A JSON without gradient_clipping, gradient_accumulation_steps or bf16 recorded --grad_clip, --grad_accum and
    --dtype as the run's settings: a resume that changed them said they applied from its step on, and DeepSpeed
    never read them (they are refused beside a JSON since)."""
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4}))
    words = ["--engine", "deepspeed", "--deepspeed_config", str(ds_json), "--out", str(tmp_path / "out"),
             "--max_data_mb", "1"]
    saved = plan(parse_args(words)).run
    assert not {"micro_batch_size", "grad_accum", "grad_clip", "dtype"} & saved["settings"].keys()
    fake_checkpoint(tmp_path / "out", saved)
    changed = ["--grad_clip", "0.5", "--grad_accum", "2", "--dtype", "fp32", "--micro_batch_size", "2"]
    with pytest.raises(ValueError, match="DeepSpeed takes --micro_batch_size .*, --grad_accum .*, --grad_clip .*, "
                                         "--dtype .* from the JSON"):
        plan(parse_args([*words, "--resume", *changed]))
    assert plan(parse_args([*words, "--resume", "--warmup_steps", "7"])).resume.changed == ("warmup_steps 30 -> 7",)


def test_keys_a_deepspeed_json_gains_or_loses_are_said_too(tmp_path, single_process):
    """Only keys both runs recorded were compared: a JSON that gained a scheduler or lost its gradient_clipping
    resumed without a word."""
    ds_json = tmp_path / "ds.json"
    base = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
    ds_json.write_text(json.dumps({**base, "gradient_clipping": 0.5}))
    words = ["--engine", "deepspeed", "--deepspeed_config", str(ds_json), "--out", str(tmp_path / "out"),
             "--max_data_mb", "1"]
    saved = plan(parse_args(words)).run
    fake_checkpoint(tmp_path / "out", saved)
    ds_json.write_text(json.dumps({**base, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}))
    # --grad_clip, --warmup_steps and --min_lr_ratio, which the new JSON's keys override, are not said unset
    assert plan(parse_args([*words, "--resume"])).resume.changed == (
        "deepspeed.gradient_clipping 0.5 -> unset", "deepspeed.scheduler.params.warmup_num_steps unset -> 10",
        "deepspeed.scheduler.type unset -> WarmupLR")
    # a checkpoint of a version that recorded no DeepSpeed JSON: its keys are not compared
    (tmp_path / "out" / "checkpoints").rename(tmp_path / "old")
    fake_checkpoint(tmp_path / "out", {**saved, "settings": {name: value for name, value in saved["settings"].items()
                                                             if not name.startswith("deepspeed.")}})
    assert plan(parse_args([*words, "--resume"])).resume.changed == ()


def test_a_resume_that_turns_the_replayed_schedule_on_or_off_is_refused_before_any_process_group(tmp_path,
                                                                                                  single_process):
    """A replay and an HDET run both explore nothing, so the resume was taken, and the saved scheduler state of one
    kind failed to load into the other (KeyError 'lr_lambdas') after the model was built and the checkpoint read."""
    from hdet_scale.replay import SCHEDULE_FORMAT

    schedule = tmp_path / "schedule.json"
    schedule.write_text(json.dumps({"format": SCHEDULE_FORMAT, "source": "x", "steps": 300,
                                    "values": {"lr/0": [1e-3] * 300}}))
    replayed = ["--out", str(tmp_path / "out"), "--max_data_mb", "1", "--replay_schedule", str(schedule)]
    fake_checkpoint(tmp_path / "out", plan(parse_args(replayed)).run)
    assert plan(parse_args([*replayed, "--resume"])).resume.step == 20
    with pytest.raises(ResumeError, match="was trained on a replayed schedule, and this run's --replay_schedule says "
                                          "otherwise"):
        plan(parse_args([*replayed[:4], "--resume"]))
    assert not dist.is_initialized()


def test_a_changed_lr_or_weight_decay_is_refused_on_resume_not_ignored(tmp_path, single_process):
    """The saved optimizer and LR schedule state would replace them: the run would silently train at the old ones."""
    words = ["--out", str(tmp_path), "--max_data_mb", "1"]
    fake_checkpoint(tmp_path, plan(parse_args(words)).run)
    assert plan(parse_args([*words, "--resume"])).resume.step == 20
    for change, message in ((["--lr", "1e-3"], r"peak_lr 0.003 -> 0.001"),
                            (["--weight_decay", "0"], r"weight_decay 0.1 -> 0.0")):
        with pytest.raises(ResumeError, match=message):
            plan(parse_args([*words, "--resume", *change]))
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
    files = {"hdet": {"gradient_mode": "local", "explore": {"dropout": {"alpha": 0.3}}},
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


def test_a_collective_checkpoint_failure_is_told_by_its_first_rank_in_one_line():
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from hdet_scale.comm import one_line

    failures = {rank: _wrap_exception(NotADirectoryError(f"Not a directory: 'latest.tmp' (rank {rank})\nmore"))
                for rank in (3, 1)}
    assert one_line(CheckpointException("CheckpointException ranks", failures)) == (
        "NotADirectoryError: Not a directory: 'latest.tmp' (rank 1)")
    assert one_line(ValueError("")) == "ValueError: "


def test_a_complete_staging_newer_than_latest_is_resumed_and_promoted(tmp_path):
    """FSDP2 killed after latest.tmp was complete but before its first rename: latest (older) and latest.tmp
    (newer) are both complete. The older one was resumed from and the newer one removed, losing an interval."""
    staged(tmp_path, "latest", step=10)
    staged(tmp_path, "latest.tmp", step=30)
    root = tmp_path / "checkpoints"
    assert check_resume(tmp_path, run()).step == 30
    assert settle_interrupted_save(tmp_path) == [
        f"promoted {root / 'latest.tmp'} (complete, step 30) to {root / 'latest'}, left by a checkpoint interrupted "
        "while it was put in place", f"removed {root / 'latest.old'}, left by an interrupted checkpoint"]
    assert sorted(path.name for path in root.iterdir()) == ["latest"]
    assert check_resume(tmp_path, run()).step == 30
    # an older or incomplete latest.tmp (killed while writing) is not preferred to a complete latest
    damaged = staged(tmp_path, "latest.tmp", step=40)
    (damaged / "__0_0.distcp").write_bytes(b"s" * 40)
    assert check_resume(tmp_path, run()).step == 30


def test_a_requeued_job_given_overwrite_continues_its_own_checkpoint_not_an_earlier_runs(tmp_path, single_process,
                                                                                         monkeypatch):
    """A requeued Slurm job runs its command line again: with --overwrite (RESUME=0 with the templates) every
    requeue erased the job's own progress and started from step 0, without end under the time guard."""
    from hdet_scale.lm.train import tidy_out

    words = ["--out", str(tmp_path), "--max_data_mb", "1", "--overwrite"]
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    fake_checkpoint(tmp_path, plan(parse_args(words)).run)  # written by job 7
    assert plan(parse_args(words)).resume is None  # job 7's first start: the checkpoint is an earlier run's
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    point = plan(parse_args(words)).resume
    assert point is not None and point.step == 20
    assert tidy_out(tmp_path, None, overwrite=True, resume=point) == [
        "--overwrite: this Slurm job was requeued after its checkpoint at step 20; it continues from it instead of "
        "erasing it"]
    assert check_resume(tmp_path, plan(parse_args(words)).run).step == 20  # still there
    monkeypatch.setenv("SLURM_JOB_ID", "8")  # another job given the same --out: --overwrite replaces the run
    assert plan(parse_args(words)).resume is None
    assert tidy_out(tmp_path, None, overwrite=True, resume=None) == [f"--overwrite: removed {tmp_path / 'checkpoints'}"]


def test_a_leftover_the_file_system_will_not_remove_is_said_and_the_run_goes_on(tmp_path):
    """A removal the file system refuses (a file another NFS client holds open) stopped the resume, and under
    DeepSpeed failed a save whose new checkpoint was complete. An immutable file (chattr +i) refuses even root."""
    import subprocess

    leftover = tmp_path / "checkpoints" / "latest.tmp"
    leftover.mkdir(parents=True)
    held = leftover / "shard"
    held.write_text("x")
    if subprocess.run(["chattr", "+i", str(held)], capture_output=True).returncode != 0:
        pytest.skip("this file system cannot make a file immutable")
    try:
        assert settle_interrupted_save(tmp_path) == [
            f"could not remove {leftover} (Operation not permitted); the run does not use it: remove it by hand"]
    finally:
        subprocess.run(["chattr", "-i", str(held)], check=True)
    assert settle_interrupted_save(tmp_path) == [f"removed {leftover}, left by an interrupted checkpoint"]


def test_a_promoted_checkpoint_is_on_the_disk_before_the_one_it_retired_goes(tmp_path, monkeypatch):
    """Killed before the first rename of an FSDP2 save: the complete latest.tmp is promoted and the older latest
    removed, and the renames were not flushed before that removal (a power loss could bring back neither)."""
    from hdet_scale.lm import checkpoints

    root = tmp_path / "checkpoints"
    fake_checkpoint(tmp_path, run())
    newer = root / "latest.tmp"
    (root / "latest").rename(newer)
    write_manifest(newer, run(), step=30)
    fake_checkpoint(tmp_path, run())  # the older one (step 20), still at latest
    events = []
    monkeypatch.setattr(checkpoints, "fsync_path", lambda path: events.append(("flush", path)))
    remove = checkpoints.remove_unused
    monkeypatch.setattr(checkpoints, "remove_unused", lambda path: events.append(("remove", path)) or remove(path))
    said = settle_interrupted_save(tmp_path)
    assert said[0].startswith(f"promoted {newer}") and said[1].startswith(f"removed {root / 'latest.old'}")
    assert events.index(("flush", root)) < events.index(("remove", root / "latest.old"))


def test_a_resume_that_would_hold_out_trained_tokens_is_refused_before_any_process_group(tmp_path, single_process):
    """A resume with a larger --heldout_fraction (or a smaller --max_data_mb) moved the token file's held-out part
    into the tokens the run had trained on, and its held-out loss was measured on training data. A copy of the file
    elsewhere (a job's local disk) is the same data."""
    import numpy as np

    data = tmp_path / "tokens.bin"
    (np.arange(40_000) % 1000).astype(np.uint16).tofile(data)  # 80,000 bytes, held out from byte 79,200 (1%)
    words = ["--out", str(tmp_path / "out"), "--vocab_size", "1000", "--seq_len", "32"]
    saved = plan(parse_args([*words, "--data", str(data)])).run
    assert saved["trained_to"] == {"tokens.bin": 79_200}
    fake_checkpoint(tmp_path / "out", saved)
    (tmp_path / "scratch").mkdir()
    copy = tmp_path / "scratch" / "tokens.bin"
    copy.write_bytes(data.read_bytes())
    for source, flags, start in ((data, ["--heldout_fraction", "0.05"], "76,000"), (copy, ["--heldout_fraction",
                                 "0.05"], "76,000"), (data, ["--max_data_mb", str(40_000 / 2**20)], "39,600")):
        with pytest.raises(ResumeError, match=rf"--resume: --data {re.escape(str(source))}: tokens.bin is held out "
                                              rf"from byte {start} now, and the run trained on it up to byte 79,200, "
                                              r"so the held-out loss would be measured on training"):
            plan(parse_args([*words, "--data", str(source), "--resume", *flags]))
    assert not dist.is_initialized()
    moved_on = plan(parse_args([*words, "--data", str(data), "--resume", "--heldout_fraction", "0.005"]))
    assert moved_on.run["trained_to"] == {"tokens.bin": 79_600}  # trains on more: fine


def text_folder(folder: Path, names: list[str], size: int = 1000) -> None:
    folder.mkdir(exist_ok=True)
    for name in names:
        (folder / name).write_text(name[0] * size)


def test_a_resume_after_files_were_added_to_the_data_folder_is_refused_where_they_shift_the_held_out_files(
        tmp_path, single_process):
    """Every 20th file in name order is held out: a file added before the others shifted the choice onto files the
    run had trained on. Files added after them keep it; every run's trained files are recorded, and the record goes
    on over a resume from other data."""
    folder = tmp_path / "text"
    text_folder(folder, [f"f{index:02d}.txt" for index in range(1, 41)])
    words = ["--out", str(tmp_path / "out"), "--seq_len", "32"]
    saved = plan(parse_args([*words, "--data", str(folder)])).run
    assert saved["trained_to"] == {f"text/f{index:02d}.txt": 1000 for index in range(1, 41) if index % 20}
    fake_checkpoint(tmp_path / "out", saved)
    text_folder(folder, ["f41.txt"])  # after the others: the same files held out
    resumed = plan(parse_args([*words, "--data", str(folder), "--resume"])).run
    assert resumed["trained_to"] == {**saved["trained_to"], "text/f41.txt": 1000}
    on_stdlib = plan(parse_args([*words, "--resume", "--max_data_mb", "1"])).run  # resumed on other data
    assert on_stdlib["trained_to"].items() > saved["trained_to"].items() and "stdlib/__future__.py" in on_stdlib[
        "trained_to"]
    (tmp_path / "out" / "checkpoints").rename(tmp_path / "first")
    fake_checkpoint(tmp_path / "out", on_stdlib)
    text_folder(folder, ["f00.txt"])  # before them: f19 and f39 held out, trained on before
    with pytest.raises(ResumeError, match=r"text/f19.txt is held out from byte 0 now, and the run trained on it up "
                                          r"to byte 1,000 \(1 more file\(s\) alike\)"):
        plan(parse_args([*words, "--data", str(folder), "--resume"]))


def test_a_folder_of_one_file_given_a_second_is_refused_where_the_trained_file_becomes_held_out(
        tmp_path, single_process):
    """One file: its last tenth is held out; a second file sorting after it is held out whole instead, and the first
    (trained up to byte 900) is trained on whole: fine. One sorting before it holds out the first whole."""
    folder = tmp_path / "one"
    text_folder(folder, ["m.txt"], size=20_000)
    words = ["--out", str(tmp_path / "out"), "--seq_len", "32", "--data", str(folder)]
    saved = plan(parse_args(words)).run
    assert saved["trained_to"] == {"one/m.txt": 18_000}
    fake_checkpoint(tmp_path / "out", saved)
    text_folder(folder, ["z.txt"], size=20_000)
    assert plan(parse_args([*words, "--resume"])).run["trained_to"] == {"one/m.txt": 20_000}
    (folder / "z.txt").unlink()
    text_folder(folder, ["a.txt"], size=20_000)
    with pytest.raises(ResumeError, match=r"one/m.txt is held out from byte 0 now, and the run trained on it up to "
                                          r"byte 18,000, so"):
        plan(parse_args([*words, "--resume"]))


def test_a_text_file_given_itself_is_checked_by_its_name(tmp_path, single_process):
    """A text file's last tenth is held out: a smaller --max_data_mb moves it into the bytes trained on."""
    text_folder(tmp_path / "data", ["book.txt"], size=40_000)
    words = ["--out", str(tmp_path / "out"), "--seq_len", "32", "--data", str(tmp_path / "data" / "book.txt")]
    saved = plan(parse_args(words)).run
    assert saved["trained_to"] == {"book.txt": 36_000}
    fake_checkpoint(tmp_path / "out", saved)
    with pytest.raises(ResumeError, match="book.txt is held out from byte 18,000 now, and the run trained on it up to "
                                          "byte 36,000"):
        plan(parse_args([*words, "--resume", "--max_data_mb", str(20_000 / 2**20)]))


def test_a_new_dropout_is_refused_where_the_checkpoint_explores_it(tmp_path, single_process):
    """With explore.dropout the checkpoint's HDET state keeps the dropout its factor multiplies: the resume line said
    --dropout 0.1 -> 0.2 applies from the resumed step on, and the run trained at the factor on 0.1."""
    hdet = tmp_path / "hdet.json"
    hdet.write_text(json.dumps({"gradient_mode": "local", "explore": {"dropout": {"alpha": 0.3}}}))
    words = ["--out", str(tmp_path / "out"), "--max_data_mb", "1", "--hdet_config", str(hdet), "--dropout", "0.1"]
    fake_checkpoint(tmp_path / "out", plan(parse_args(words)).run)
    with pytest.raises(ResumeError, match=r"explores the dropout as a factor on --dropout 0.1, which its HDET state "
                                          r"keeps, and this run gives --dropout 0.2: resume with --dropout 0.1"):
        plan(parse_args([*words, "--resume", "--dropout", "0.2"]))
    hdet.write_text(json.dumps({"gradient_mode": "local"}))  # not explored: the new dropout applies (said so)
    fake_checkpoint(tmp_path / "other", plan(parse_args([*words, "--out", str(tmp_path / "other")])).run)
    assert plan(parse_args([*words, "--out", str(tmp_path / "other"), "--resume", "--dropout", "0.2"])
                ).resume.changed == ("dropout 0.1 -> 0.2",)
