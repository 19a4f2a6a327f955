"""train.py end to end: real torchrun and deepspeed launches of the tiny model on CPU ranks.

Launches cost tens of seconds here, so a few runs are shared by the tests through fixtures: FSDP2 in global mode
runs uninterrupted (the README's main job, shortened: conftest's ``main_job``, which test_readme_e2e.py checks too),
then again with a SIGTERM and a --resume (the two must end on the same parameters); DeepSpeed ZeRO-2 runs in
global mode, and ZeRO-3 in local mode is preempted and resumed. Bad inputs are checked in-process and through one
real launch.

This file holds the tests that start no process; the tests that start a launcher or script as a subprocess are in
tests/e2e/test_train_e2e.py.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hdet_scale.lm import train
from hdet_scale.lm.train import SINGLE_PROCESS, parse_args, plan


# -------------------------------------------------------------------------------------- bad input
@pytest.fixture
def single_process(monkeypatch, tmp_path):
    """What train.py's main sets when started without a launcher, in an empty folder (the default --out)."""
    for name, value in SINGLE_PROCESS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)


def check(argv: list[str], message: str) -> None:
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        plan(parse_args(argv))
    assert not dist.is_initialized()


@pytest.mark.usefixtures("single_process")
def test_bad_inputs_fail_before_any_process_group(tmp_path):
    check(["--data", str(tmp_path / "missing")], "--data .*missing: no such file or directory")
    check(["--preset", "huge"], "--preset 'huge' does not exist; choose one of tiny, small")
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    check(["--data", str(empty), "--vocab_size", "100"], "empty.bin: the file is empty")
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    check(["--data", str(odd), "--vocab_size", "100"], "not a whole number of uint16 tokens")
    wrong_vocab = tmp_path / "tokens.bin"
    wrong_vocab.write_bytes(torch.arange(1000, dtype=torch.int16).numpy().tobytes())
    check(["--data", str(wrong_vocab), "--vocab_size", "500"], "token id 999 is outside the vocabulary of 500")
    check(["--data", str(wrong_vocab)], "give its tokenizer's vocabulary with --vocab_size")
    large = tmp_path / "large.bin"  # more tokens than the check reads: its runs reach the last one
    ids = torch.zeros(3 << 21, dtype=torch.int16)
    ids[-1] = 999
    large.write_bytes(ids.numpy().tobytes())
    check(["--data", str(large), "--vocab_size", "500"], "token id 999 is outside the vocabulary of 500")
    check(["--data", str(wrong_vocab), "--vocab_size", "1000", "--seq_len", "512"],
          "too few for one batch of 8 x 513 tokens; give a longer token file, or lower --seq_len")
    texts = tmp_path / "texts"
    texts.mkdir()
    check(["--data", str(texts)], "no text files")
    bad_hdet = tmp_path / "hdet.json"
    bad_hdet.write_text(json.dumps({"alpha": 0.5, "sync_intervall": 10}))
    check(["--hdet_config", str(bad_hdet)], "sync_intervall")
    bad_hdet.write_text(json.dumps({"alpha": -0.5}))
    check(["--hdet_config", str(bad_hdet)], "alpha")
    check(["--eval_interval", "7"], r"--eval_interval=7 must be a multiple of sync_interval=5 \(picked for "
          r"--steps 300: the HDET settings leave it out\)")
    check(["--steps", "1500", "--eval_interval", "30"], "--eval_interval=30 must be a multiple of sync_interval=25")
    bad_hdet.write_text(json.dumps({"sync_interval": 4}))  # given: said as it is
    check(["--hdet_config", str(bad_hdet), "--eval_interval", "6"],
          "--eval_interval=6 must be a multiple of sync_interval=4: the replicas")
    check(["--steps", "0"], "--steps must be at least 1")
    check(["--seed", str(2**63)], r"--seed must be in \[0, 2\*\*63\), got 9223372036854775808")
    # a JSON written for transformers' Trainer: DeepSpeed would get its "auto" values as they are
    trainer_json = str(Path(__file__).resolve().parents[2] / "ds_configs" / "trainer_zero2.json")
    check(["--deepspeed_config", trainer_json],
          r"trainer_zero2\.json: train_batch_size, train_micro_batch_size_per_gpu, .*, bf16\.enabled are "
          r"\"auto\", which transformers' Trainer fills in")
    # train.py's warm-up (default 30 steps) longer than the run: the LR never reached its peak, and never decayed
    check(["--steps", "20"], r"--warmup_steps 30 is not below --steps 20: the LR would still be warming up when the "
                             r"run ends, and never decay; pass a --warmup_steps below 20")
    check(["--steps", "20", "--warmup_steps", "20"], "--warmup_steps 20 is not below --steps 20")
    # docs/train.md's DeepSpeed JSON without its --steps: a 300-step run of a 300,000-step schedule learned nothing
    zero2 = str(Path(__file__).resolve().parents[2] / "ds_configs" / "zero2_bf16.json")
    check(["--deepspeed_config", zero2], "--steps is 300 and the DeepSpeed JSON's "
          "scheduler.params.total_num_steps is 300000: the LR schedule must end when the run does; pass --steps "
          "300000")


@pytest.mark.usefixtures("single_process")
def test_too_little_data_names_the_flag_that_cut_it(tmp_path):
    """Each said 'give more data or lower --seq_len', also where --max_data_mb or --heldout_fraction left too few
    tokens, and counted text files that were never read."""
    for bad in ("0", "-1", "nan"):
        check(["--max_data_mb", bad], rf"--max_data_mb must be a positive number of MiB, got {bad}")
    # the first few stdlib files hold none of the held-out ones (every 20th)
    check(["--max_data_mb", "0.01"], r"the standard library's source \(embedded\): 0 held-out tokens are too few for "
                                     r"one window of 129; raise --max_data_mb \(it stopped the reading at 0.01 MiB\), "
                                     r"or lower --seq_len$")
    texts = tmp_path / "texts"
    texts.mkdir()
    for index in range(30):
        (texts / f"{index:02}.txt").write_text("x" * 1024)
    check(["--data", str(texts), "--max_data_mb", str(5.5 / 1024)],
          rf"the first 6 of 30 text files in {texts}: 0 held-out tokens are too few for one window of 129; raise "
          r"--max_data_mb \(it stopped the reading at 0.00537 MiB\), or lower --seq_len$")
    check(["--data", str(texts), "--max_data_mb", str(1 / 1024), "--micro_batch_size", "16"],
          rf"the first 1 of 30 text files in {texts}: 1024 training tokens are too few for one batch of 16 x 129 "
          r"tokens; raise --max_data_mb")
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(torch.arange(1000, dtype=torch.int16).numpy().tobytes())
    check(["--data", str(tokens), "--vocab_size", "1000", "--seq_len", "32"],
          r"1,000 uint16 tokens in .*tokens.bin: 10 held-out tokens are too few for one window of 33; raise "
          r"--heldout_fraction \(now 0.01\), or lower --seq_len$")


@pytest.mark.usefixtures("single_process")
def test_a_run_in_its_out_is_refused_unless_resumed_or_overwritten(tmp_path):
    """A fresh run into the --out of a finished run used to replace its checkpoint, metrics and model with no
    word. Each of them alone is a run that --resume or --overwrite must name."""
    out = tmp_path / "run"
    for left in ("tensorboard/events", "checkpoints/latest/run.json", "final/model.safetensors", "hdet_metrics.jsonl"):
        shutil.rmtree(out, ignore_errors=True)
        (out / left).parent.mkdir(parents=True, exist_ok=True)
        (out / left).write_text("{}")
        check(["--out", str(out)], rf"--out {out} holds a run already \({out / left.split('/')[0]}\): pass --resume "
                                   "to continue it, --overwrite to start afresh over it, or choose another --out")
        assert plan(parse_args(["--out", str(out), "--overwrite"])).resume is None
        assert (out / left).exists()  # nothing is removed before the process group starts
    check(["--out", str(out), "--resume", "--overwrite"], "--resume continues the run in --out and --overwrite "
                                                          "replaces it: pass one of them$")
    (out / "hdet_metrics.jsonl").write_text("")  # an empty metrics file is no run
    plan(parse_args(["--out", str(out)]))


@pytest.mark.usefixtures("single_process")
def test_overwrite_under_a_slurm_template_says_how_to_drop_its_resume(tmp_path, monkeypatch):
    """`sbatch launch/fsdp.sbatch --overwrite ...`: the template adds --resume itself (RESUME=1), so the user was
    told to pass one of two flags of which they had passed one."""
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    check(["--out", str(tmp_path / "run"), "--resume", "--overwrite"],
          r"pass one of them \(the Slurm templates in launch/ pass --resume themselves: submit with RESUME=0 to "
          r"overwrite\)")


@pytest.mark.usefixtures("single_process")
def test_resume_over_a_finished_run_without_its_checkpoint_is_refused(tmp_path):
    """--resume without a checkpoint starts afresh (a job requeued before its first one): over a finished run's
    model, with its checkpoints deleted, it silently trained again and wrote over that model."""
    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    (out / "final" / "model.safetensors").write_text("x")
    check(["--out", str(out), "--resume"], rf"--resume: {out} holds a finished run's model \({out / 'final'}\) and "
                                          "no checkpoint to continue from: pass --overwrite instead of --resume")
    assert plan(parse_args(["--out", str(out), "--overwrite"])).resume is None
    (out / "final" / "model.safetensors").unlink()  # an empty folder is no model
    assert plan(parse_args(["--out", str(out), "--resume"])).resume is None
    # the final model's export killed between its two renames: the finished model waits aside
    (out / "final.old").mkdir()
    (out / "final.old" / "model.safetensors").write_text("x")
    check(["--out", str(out), "--resume"], rf"--resume: {out} holds a finished run's model \({out / 'final.old'}\)")


def test_a_start_without_checkpoint_is_quiet_in_an_empty_out_and_keeps_every_earlier_attempts_metrics(tmp_path,
                                                                                                     monkeypatch):
    """The Slurm templates' first start (--resume, nothing in --out) says nothing, a --resume outside Slurm says it
    found no checkpoint; each attempt that left metrics but no checkpoint has them kept under a name of its own
    (train.py's e2e test runs one)."""
    from hdet_scale.lm.checkpoints import previous_run
    from hdet_scale.lm.train import tidy_out

    out, metrics = tmp_path / "run", tmp_path / "run" / "hdet_metrics.jsonl"
    assert tidy_out(out, str(metrics), overwrite=False, resume=None) == []
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert tidy_out(out, str(metrics), overwrite=False, resume=None, resume_asked=True) == []
    monkeypatch.delenv("SLURM_JOB_ID")
    # a --resume typed by hand (a mistyped --out, another working directory) says it found nothing to continue
    assert tidy_out(out, str(metrics), overwrite=False, resume=None, resume_asked=True) == [
        f"--resume: no checkpoint in {out / 'checkpoints'}: this run starts at step 0"]
    out.mkdir()
    metrics.write_text("")  # an empty metrics file is no attempt: removed, so that the run's lines start it
    assert tidy_out(out, str(metrics), overwrite=False, resume=None) == []
    assert not metrics.exists()
    for attempt in (1, 2):
        metrics.write_text(f'{{"step": 5, "attempt": {attempt}}}\n')
        aside = out / f"hdet_metrics.earlier_attempt_{attempt}.jsonl"
        assert tidy_out(out, str(metrics), overwrite=False, resume=None) == [
            f"no checkpoint in {out / 'checkpoints'} to resume from: this run starts at step 0; the earlier "
            f"attempt's metrics are kept in {aside}"]
        assert json.loads(aside.read_text())["attempt"] == attempt and not metrics.exists()
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events").write_text("x")  # TensorBoard drops an earlier attempt's curves itself
    assert tidy_out(out, str(metrics), overwrite=False, resume=None) == [
        f"no checkpoint in {out / 'checkpoints'} to resume from: this run starts at step 0"]
    assert (out / "tensorboard" / "events").exists()
    # an export killed between its renames leaves the model in final.tmp and the one before in final.old
    for folder in ("final.tmp", "final.old"):
        (out / folder).mkdir()
        (out / folder / "model.safetensors").write_text("x")
    left = [out / name for name in ("final.tmp", "final.old", "tensorboard", "hdet_metrics.earlier_attempt_1.jsonl",
                                    "hdet_metrics.earlier_attempt_2.jsonl")]
    assert sorted(previous_run(out, str(metrics))) == sorted(left)  # so a run without flags is refused there
    assert sorted(tidy_out(out, str(metrics), overwrite=True, resume=None)) == sorted(
        f"--overwrite: removed {path}" for path in left)
    assert not any(out.iterdir())


@pytest.mark.usefixtures("single_process")
def test_an_out_another_run_wrote_to_while_this_one_started_is_not_taken(tmp_path):
    """The plan reads --out before the process group starts, the lock is taken after: a run that held --out
    until then may have saved there meanwhile, which this run would overwrite or not have checked."""
    from hdet_scale.lm.out_lock import LOCK, OutInUse, release
    from hdet_scale.lm.train import take_as_planned

    out = tmp_path / "run"
    checked = plan(parse_args(["--out", str(out), "--resume"]))
    take_as_planned(out, checked)
    assert (out / LOCK).is_file()
    release(out)
    (out / "final").mkdir(parents=True)  # the run that held --out ended meanwhile
    (out / "final" / "model.safetensors").write_text("x")
    with pytest.raises(OutInUse, match=rf"--out {out} changed while this run was starting"):
        take_as_planned(out, checked)
    assert not (out / LOCK).exists()  # released: the next try sees what --out holds now


@pytest.mark.usefixtures("single_process")
def test_an_out_written_to_while_the_plan_read_the_corpus_is_not_taken(tmp_path, monkeypatch):
    """The plan read what --out held at its very end, after deciding on it and reading the corpus: a checkpoint
    the run holding --out wrote meanwhile was in both readings, and this run started at step 0 over it."""
    from hdet_scale.lm import plan as plan_module
    from hdet_scale.lm.checkpoints import write_manifest
    from hdet_scale.lm.out_lock import OutInUse
    from hdet_scale.lm.train import take_as_planned

    out = tmp_path / "run"
    load_corpus = plan_module.load_corpus

    def saved_meanwhile(*args, **kwargs):
        checkpoint = out / "checkpoints" / "latest"  # the run that held --out was preempted while the text was read
        checkpoint.mkdir(parents=True)
        (checkpoint / ".metadata").write_bytes(b"m")
        write_manifest(checkpoint, {}, step=20)
        return load_corpus(*args, **kwargs)

    monkeypatch.setattr(plan_module, "load_corpus", saved_meanwhile)
    checked = plan(parse_args(["--out", str(out), "--resume"]))
    assert checked.resume is None  # decided before the checkpoint came
    with pytest.raises(OutInUse, match=rf"--out {out} changed while this run was starting"):
        take_as_planned(out, checked)


def test_overwrite_removes_the_previous_runs_checkpoints_model_metrics_and_events_only(tmp_path):
    from hdet_scale.lm.checkpoints import remove_previous_run

    for left in ("checkpoints/latest/run.json", "final/config.json", "hdet_metrics.jsonl", "tensorboard/events",
                 "wandb_run_id", "notes.txt"):
        (tmp_path / left).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / left).write_text("x")
    metrics = str(tmp_path / "hdet_metrics.jsonl")
    removed = remove_previous_run(tmp_path, metrics)
    # the W&B run's id too: the next run, resumed with --wandb, logged into the replaced run's W&B run
    assert removed == [tmp_path / "checkpoints", tmp_path / "final", tmp_path / "tensorboard",
                       tmp_path / "hdet_metrics.jsonl", tmp_path / "wandb_run_id"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.usefixtures("single_process")
def test_an_out_that_cannot_be_written_is_refused_in_one_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    check(["--out", str(blocker / "run")], f"--out {blocker / 'run'}: cannot create it \\({blocker} is not a "
                                           "directory\\); choose another directory")
    hdet = tmp_path / "hdet.json"
    hdet.write_text(json.dumps({"metrics_path": str(blocker / "m.jsonl")}))
    # two Slurm jobs given one HDET JSON, each with its own OUT_DIR, wrote into one metrics file (--out's lock is
    # each job's own), and the second moved the first one's live file aside as an earlier attempt's
    check(["--hdet_config", str(hdet), "--out", str(tmp_path / "run")],
          rf"metrics_path {blocker / 'm.jsonl'} is outside --out {tmp_path / 'run'}: one run at a time holds --out")
    inside = tmp_path / "run" / "a_file"
    inside.parent.mkdir()
    inside.write_text("x")
    hdet.write_text(json.dumps({"metrics_path": str(inside / "m.jsonl")}))
    check(["--hdet_config", str(hdet), "--out", str(tmp_path / "run")], "metrics_path's folder .*a_file: cannot "
                                                                         "create it")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_command_line_error_is_said_once(rank, monkeypatch, capsys):
    """argparse's own errors (here a negative number after --lr, read as an option) came from every rank."""
    for name, value in {**SINGLE_PROCESS, "RANK": str(rank), "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    waits = []
    monkeypatch.setattr(train.time, "sleep", waits.append)
    with pytest.raises(SystemExit) as stop:
        train.main(["--lr", "-1e-3"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and not dist.is_initialized()
    assert err.count("usage:") == (1 if rank == 0 else 0)
    assert "train.py: error" in err and "--lr: expected one argument" in err
    assert waits == ([] if rank == 0 else [train.BAD_INPUT_GRACE_S])


def test_a_cut_short_metrics_line_is_dropped_and_the_rest_kept(tmp_path, capsys):
    from hdet_scale.lm.progress import Progress

    metrics = tmp_path / "hdet_metrics.jsonl"
    metrics.write_text('{"step": 5, "loss": 1}\n{"step": 10, "loss": 2}\n{"step": 15, "loss": 3}\n{"step": 20, "lo')
    Progress(tmp_path, enabled=True, bar=False, total=20, metrics_path=str(metrics)).truncate_metrics(str(metrics), 10)
    assert metrics.read_text() == '{"step": 5, "loss": 1}\n{"step": 10, "loss": 2}\n'
    assert "dropped 1 unreadable line(s), left by an interrupted write" in capsys.readouterr().out
    assert not (tmp_path / "hdet_metrics.jsonl.tmp").exists()


def test_the_metrics_lines_a_checkpoint_vouches_for_are_on_the_disk(tmp_path, monkeypatch):
    """The metrics file stayed in the page cache when a checkpoint was taken, and the file a resume rewrote replaced
    it before it was flushed: a node crash could leave the resumed run with lines missing before its step."""
    import os

    from hdet_scale.lm.checkpoints import flush_metrics
    from hdet_scale.lm.progress import Progress

    events: list[str] = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync " + os.path.basename(
        os.readlink(f"/proc/self/fd/{fd}"))), fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda source, target: (events.append(
        f"replace {os.path.basename(source)}"), replace(source, target))[1])
    metrics = tmp_path / "hdet_metrics.jsonl"
    metrics.write_text('{"step": 5, "loss": 1}\n')
    flush_metrics(str(metrics))
    assert events == ["fsync hdet_metrics.jsonl"]
    events.clear()
    metrics.write_text('{"step": 5, "loss": 1}\n{"step": 10, "loss": 2}\n')
    Progress(tmp_path, enabled=True, bar=False, total=20, metrics_path=str(metrics)).truncate_metrics(str(metrics), 5)
    assert events == ["fsync hdet_metrics.jsonl.tmp", "replace hdet_metrics.jsonl.tmp", f"fsync {tmp_path.name}"]


@pytest.mark.usefixtures("single_process")
def test_a_schedule_train_py_cannot_replay_is_refused_before_any_process_group(tmp_path):
    from hdet_scale.replay import SCHEDULE_FORMAT

    schedule = tmp_path / "schedule.json"
    schedule.write_text(json.dumps({"format": SCHEDULE_FORMAT, "source": "x", "steps": 10,
                                    "values": {"lr/0": [1e-3] * 10}}))
    check(["--replay_schedule", str(schedule), "--steps", "20"], "covers 10 steps and --steps is 20: pass --steps 10")
    check(["--replay_schedule", str(schedule), "--steps", "5"], "covers 10 steps and --steps is 5: pass --steps 10")
    check(["--replay_schedule", str(tmp_path / "none.json")], "--replay_schedule .*none.json: no such schedule file")
    check(["--replay_schedule", str(schedule), "--steps", "10", "--hdet_config", str(schedule)],
          "--replay_schedule trains without HDET: drop --hdet_config")
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "scheduler": {"type": "WarmupLR"}}))
    check(["--replay_schedule", str(schedule), "--steps", "10", "--deepspeed_config", str(ds_config)],
          "--replay_schedule and the DeepSpeed JSON's \"scheduler\" both set the LR")
    schedule.write_text(json.dumps({"format": SCHEDULE_FORMAT, "source": "x", "steps": 10,
                                    "values": {"lr/0": [1e-3] * 10, "label_smoothing": [0.1] * 10}}))
    check(["--replay_schedule", str(schedule), "--steps", "10"], r"also explored \['label_smoothing'\]")
    # a replayed schedule replaces the warm-up: --warmup_steps (default 30) above its 10 steps is no matter
    schedule.write_text(json.dumps({"format": SCHEDULE_FORMAT, "source": "x", "steps": 10,
                                    "values": {"lr/0": [1e-3] * 10}}))
    # and every step's LR: flags for them were accepted and ignored
    check(["--replay_schedule", str(schedule), "--steps", "10", "--warmup_steps", "5", "--lr", "0.1"],
          r"sets every step's LR itself: drop --lr, --warmup_steps, which the replay would ignore")
    schedule.write_text(json.dumps({"format": SCHEDULE_FORMAT, "source": "x", "steps": 10,
                                    "values": {"lr/0": [1e-3] * 10, "weight_decay/0": [0.1] * 10}}))
    check(["--replay_schedule", str(schedule), "--steps", "10", "--weight_decay", "0.3"],
          r"sets every step's LR and weight decay itself: drop --weight_decay")
    schedule.write_text(json.dumps({"format": SCHEDULE_FORMAT, "source": "x", "steps": 10,
                                    "values": {"lr/0": [1e-3] * 10}}))
    assert plan(parse_args(["--replay_schedule", str(schedule), "--steps", "10", "--weight_decay", "0.3"]))
    # its metrics lines (the training loss) as often as an HDET run's, and at every checkpoint and evaluation
    assert plan(parse_args(["--replay_schedule", str(schedule), "--steps", "10"])).config.sync_interval == 1
    schedule.write_text(json.dumps({"format": SCHEDULE_FORMAT, "source": "x", "steps": 1500,
                                    "values": {"lr/0": [1e-3] * 1500}}))
    replay = ["--replay_schedule", str(schedule), "--steps", "1500"]
    assert plan(parse_args(replay)).config.sync_interval == 25
    assert plan(parse_args([*replay, "--checkpoint_interval", "100", "--eval_interval", "10"])).config.sync_interval \
        == 5


@pytest.mark.usefixtures("single_process")
def test_the_controller_starts_at_its_share_of_the_run(tmp_path):
    hdet = tmp_path / "hdet.json"
    hdet.write_text(json.dumps({"sync_interval": 5, "auto_lr": {"start": 0.1}}))
    checked = plan(parse_args(["--hdet_config", str(hdet), "--steps", "40"]))
    assert checked.config.auto_lr.start == 4  # round(0.1 x 40)


@pytest.mark.usefixtures("single_process")
def test_token_file_trains_the_vocabulary_it_names(tmp_path):
    tokens = (torch.arange(20_000) % 300).to(torch.int32)
    path = tmp_path / "tokens.u32"
    path.write_bytes(tokens.numpy().astype("uint32").tobytes())
    checked = plan(parse_args(["--data", str(path), "--token_dtype", "uint32", "--vocab_size", "300"]))
    assert checked.corpus.vocab_size == 300
    assert len(checked.corpus.train) + len(checked.corpus.heldout) == 20_000
    assert int(checked.corpus.train[299]) == 299  # read as uint32, in order
    # read as uint16 (the default): every second id 0, trained on silently
    check(["--data", str(path), "--vocab_size", "300"], r"tokens.u32 reads as uint32 token ids \(as uint16 every "
          r"second id is 0\): pass --token_dtype uint32")
    # a vocabulary uint16 cannot hold: no id of any file could fail the vocabulary check
    check(["--data", str(path), "--vocab_size", "128256"], r"--vocab_size 128256 has ids that uint16 cannot hold")


@pytest.mark.usefixtures("single_process")
def test_max_data_mb_reads_the_start_of_a_token_file(tmp_path):
    """--max_data_mb was ignored for a token file: the whole file was read, silently."""
    path = tmp_path / "tokens.u16"
    path.write_bytes(np.arange(2**20, dtype=np.uint16).tobytes())  # 2 MiB, ids 0 .. 65535 in turn
    words = ["--data", str(path), "--vocab_size", "65536", "--heldout_fraction", "0.25"]
    corpus = plan(parse_args([*words, "--max_data_mb", "0.5"])).corpus
    assert (len(corpus.train), len(corpus.heldout)) == (3 * 2**16, 2**16)  # 0.5 MiB = 2**18 tokens, a quarter out
    assert int(corpus.heldout[-1]) == 2**16 - 1  # the end of the first 2**18 tokens
    assert corpus.description == f"the first 262,144 of 1,048,576 uint16 tokens in {path}"
    check([*words, "--max_data_mb", str(256 / 2**10 / 2**10)],  # 128 tokens: 96 to train on
          rf"the first 128 of 1,048,576 uint16 tokens in {path}: 96 training tokens are too few for one batch of 8 x "
          r"129 tokens; raise --max_data_mb \(it stopped the reading at 0.000244 MiB\), or lower --seq_len")
    check([*words, "--max_data_mb", str(1 / 2**20)], r"--max_data_mb 9.54e-07 is less than one uint16 token of --data ")


@pytest.mark.parametrize("rank", [0, 1])
def test_only_rank_0_speaks_at_once_about_a_bad_input(rank, tmp_path, monkeypatch, capsys):
    """Rank 0 says why and exits at once. Another rank first waits for its launcher to stop it, so that it
    cannot end the launch before rank 0 has spoken; still running after the grace, it says why itself."""
    for name, value in {**SINGLE_PROCESS, "RANK": str(rank), "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    waits = []
    monkeypatch.setattr(train.time, "sleep", waits.append)
    with pytest.raises(SystemExit) as stop:
        train.main(["--data", str(tmp_path / "nowhere"), "--out", str(tmp_path)])
    assert stop.value.code == 2 and not dist.is_initialized()
    assert waits == ([] if rank == 0 else [train.BAD_INPUT_GRACE_S])
    where = "" if rank == 0 else " (rank 1)"
    assert capsys.readouterr().err.startswith(f"train.py: error{where}: --data ")


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    for option, default in (("--steps", 300), ("--lr", 0.003), ("--out", "runs/train"), ("--probe_batch", 16),
                            ("--on_signal", "sync_now"), ("--preset", "tiny")):
        assert re.search(rf"{option} .*?\(default: {re.escape(str(default))}\)", shown), option


def test_any_seed_train_py_takes_seeds_its_data_streams():
    """--seed $(date +%s) was taken, then failed at the first batch, after the process group and the model: the
    stream's seed overflowed a generator's."""
    for seed in (1_764_300_000, 2**63 - 1):
        torch.Generator().manual_seed(train._mix(seed, 5, 3))
    assert train._mix(3, 5, 1) == (3 * 1_000_003 + 5) * 100_003 + 1 + 2**40  # the streams of every earlier run


def test_the_peak_lr_the_found_lr_is_said_against():
    """--lr, unless the DeepSpeed JSON sets the peak: its scheduler's warmup_max_lr, else its optimizer's lr
    (WarmupCosineLR peaks there)."""
    from hdet_scale.lm.plan import given_peak_lr

    args = parse_args(["--lr", "0.002"])
    assert given_peak_lr(args, None) == (0.002, "--lr")
    assert given_peak_lr(args, {"scheduler": {"type": "WarmupCosineLR", "params": {}}}) == (0.002, "--lr")
    assert given_peak_lr(args, {"optimizer": {"params": {"lr": 3e-4}}}) == (3e-4, "the DeepSpeed JSON's lr")
    assert given_peak_lr(args, {"optimizer": {"params": {"lr": 3e-4}},
                                "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}}}) == (
        1e-3, "the DeepSpeed JSON's warmup_max_lr")
    # WarmupLR without its peak warms up to the optimizer's LR; WarmupDecayLR to DeepSpeed's default of 0.001, and
    # OneCycle to its cycle_max_lr, whatever --lr says
    assert given_peak_lr(args, {"scheduler": {"type": "WarmupLR", "params": {}}}) == (0.002, "--lr")
    assert given_peak_lr(args, {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 9}}}) == (
        0.001, "DeepSpeed's default warmup_max_lr of WarmupDecayLR")
    assert given_peak_lr(args, {"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 0.03}}}) == (
        0.03, "the DeepSpeed JSON's cycle_max_lr")
    assert given_peak_lr(args, {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": [0.02, 0.01]}}}
                         ) == (0.02, "the DeepSpeed JSON's warmup_max_lr[0]")  # per param group: the first's


@pytest.mark.usefixtures("single_process")
def test_text_is_read_as_bytes_and_token_file_flags_only_with_a_token_file(tmp_path):
    """A text file given as --data was read as uint16 token ids (once --vocab_size was given, as the error asked,
    silently), and --vocab_size, --token_dtype and --heldout_fraction with text did nothing."""
    prose = tmp_path / "prose.txt"
    prose.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    corpus = plan(parse_args(["--data", str(prose)])).corpus
    data = prose.read_bytes()
    cut = len(data) - len(data) // 10  # as a one-file directory: its last tenth held out
    assert (corpus.vocab_size, corpus.description) == (256, f"the text file {prose}")
    assert corpus.train.tolist() == list(data[:cut]) and corpus.heldout.tolist() == list(data[cut:])
    check(["--data", str(prose), "--vocab_size", "32000"],
          "--vocab_size set the reading of a token file, and --data .*prose.txt is text, read as bytes")
    check(["--token_dtype", "uint32", "--heldout_fraction", "0.1"],
          "--token_dtype, --heldout_fraction set the reading of a token file, and --data stdlib is text")
    renamed = tmp_path / "prose.bin"
    renamed.write_bytes(data)
    check(["--data", str(renamed), "--vocab_size", "32000"], "prose.bin reads as text, not as token ids")
    # without --vocab_size too: it was asked for, and then the text refused
    check(["--data", str(renamed)], "prose.bin reads as text, not as token ids: name it with a text suffix .* to "
                                    "train on it as bytes, or give the token file$")


@pytest.mark.usefixtures("single_process")
def test_a_training_split_of_one_window_is_refused_before_any_process_group(tmp_path):
    """seq_len + 1 training tokens passed the check and failed drawing a window's start, after the process group."""
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(np.arange(19, dtype=np.uint16).tobytes())  # 10 held out, 9 to train on
    check(["--data", str(tokens), "--vocab_size", "64", "--heldout_fraction", "0.55", "--seq_len", "8",
           "--micro_batch_size", "1"],
          r"9 training tokens are too few for one batch of 1 x 9 tokens \(at least 10: a window starts at random\)")


@pytest.mark.usefixtures("single_process")
def test_deepspeed_flags_on_fsdp2_and_numbers_out_of_range_are_refused(tmp_path):
    """--zero_stage and --deepspeed did nothing on FSDP2 (the engine under torchrun or without a launcher), and a
    negative or NaN --weight_decay or --grad_clip failed in AdamW after the process group (or made every weight NaN)."""
    check(["--zero_stage", "3"], r"--zero_stage is DeepSpeed's and the engine is FSDP2 \(--engine auto\)")
    check(["--engine", "fsdp", "--deepspeed"], r"--deepspeed is DeepSpeed's and the engine is FSDP2 \(--engine fsdp\)")
    for name in ("weight_decay", "grad_clip"):
        for bad in ("-1", "nan"):
            check([f"--{name}", bad], rf"--{name} must be a number >= 0, got {bad}")
    assert plan(parse_args(["--deepspeed"])).engine == "deepspeed"


@pytest.mark.usefixtures("single_process")
def test_hdet_settings_without_a_sync_interval_take_one_for_the_runs_length(tmp_path):
    """An --hdet_config without sync_interval got the library's T = 1000 whatever --steps was: a 300-step run never
    synced before its end."""
    hdet = tmp_path / "hdet.json"
    hdet.write_text(json.dumps({"alpha": 0.5}))
    assert plan(parse_args(["--hdet_config", str(hdet)])).config.sync_interval == 5  # 300 steps, as without a JSON
    hdet.write_text(json.dumps({"alpha": 0.5, "sync_interval": 20}))
    assert plan(parse_args(["--hdet_config", str(hdet)])).config.sync_interval == 20


def test_more_ranks_on_a_node_than_gpus_is_refused_before_any_process_group(monkeypatch):
    """torch.cuda.set_device failed on the ranks past the last GPU with an invalid device ordinal in a traceback."""
    from hdet_scale.lm.train import rank_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(ValueError, match=r"^4 ranks on this node and 2 GPU\(s\): one rank a GPU, so start at most 2 "
                                         r"\(--nproc_per_node 2\), or train on the CPU \(CUDA_VISIBLE_DEVICES= "):
        rank_device()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_device() == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rank_device() == torch.device("cpu")


@pytest.mark.usefixtures("single_process")
def test_settings_that_would_fail_or_do_nothing_after_the_process_group_are_refused_before_it(tmp_path, monkeypatch):
    """Each passed the plan and failed on every rank after the model was built, or was silently ignored."""
    configs = Path(__file__).resolve().parents[2] / "ds_configs"
    zero3 = str(configs / "zero3_bf16.json")
    hdet = tmp_path / "hdet.json"
    hdet.write_text(json.dumps({"auto_lr": {"mode": "paper"}}))
    check(["--hdet_config", str(hdet)], "auto_lr.mode 'paper' decays the LR to OneCycleLR's floor .* use mode 'log'")
    hdet.write_text(json.dumps({"explore": {"weight_decay": {}}}))
    check(["--hdet_config", str(hdet), "--weight_decay", "0"],
          "explore.weight_decay explores the weight decay, and --weight_decay is 0")
    decays = tmp_path / "decays.json"  # a JSON optimizer without a weight decay takes its class's: AdamW's 0.01
    for params, refused in (({"lr": 1e-3, "torch_adam": True}, False), ({"lr": 1e-3, "weight_decay": 0}, True),
                            ({"lr": 1e-3}, True)):  # DeepSpeed's fused Adam: 0
        decays.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 0},
                                      "optimizer": {"type": "AdamW", "params": params}}))
        words = ["--hdet_config", str(hdet), "--deepspeed_config", str(decays)]
        if refused:
            check(words, "and the DeepSpeed JSON's optimizer.params.weight_decay is 0")
        else:
            assert plan(parse_args(words)).config.explore.weight_decay is not None
    hdet.write_text(json.dumps({"gradient_mode": "local", "explore": {"label_smoothing": {"base": 0.1}}}))
    monkeypatch.setenv("WORLD_SIZE", "2")  # two replicas of one rank: the controller moves it
    check(["--hdet_config", str(hdet), "--probe_batch", "0"],
          "explore.label_smoothing is compared on the probe batch alone, and --probe_batch is 0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    # the JSON's flags: DeepSpeed took the JSON's warm-up and LR, and the README's own example passed a dead flag
    check(["--deepspeed_config", zero3, "--steps", "300000", "--lr", "1e-4", "--warmup_steps", "10"],
          r"zero3_bf16.json DeepSpeed takes --lr \(its optimizer.params.lr\), --warmup_steps \(its scheduler\) from "
          r"the JSON \(or from its own defaults where the JSON leaves the key out\), not from the command line: set it "
          "there and drop the flag")
    for name, value in (("micro_batch_size", "4"), ("dtype", "fp32"), ("grad_clip", "0.5")):
        check(["--deepspeed_config", zero3, "--steps", "300000", f"--{name}", value], f"--{name} ")
    # a scheduler that sets the LR itself, with train.py's optimizer: WarmupDecayLR warms up to its own default
    scheduled = tmp_path / "scheduled.json"
    scheduled.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 0},
                                     "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 300}}}))
    check(["--deepspeed_config", str(scheduled), "--lr", "1e-4"], r"--lr \(its scheduler.params.warmup_max_lr\)")
    assert plan(parse_args(["--deepspeed_config", zero3, "--steps", "300000"])).engine == "deepspeed"
    written = tmp_path / "ds.json"
    for bad, message in (([1], "must hold a JSON object"),
                         ({"zero_optimization": {"stage": "two"}}, "zero_optimization.stage must be 0, 1, 2 or 3, "
                                                                   "got 'two'"),
                         ({"zero_optimisation": {"stage": 3}}, "\"zero_optimisation\" is no DeepSpeed setting .* did "
                                                               "you mean \"zero_optimization\"")):
        written.write_text(json.dumps(bad))
        check(["--deepspeed_config", str(written)], message)
    # two replicas of two ranks: 3 sequences a replica cannot be split over its two ranks
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    written.write_text(json.dumps({"train_batch_size": 6, "zero_optimization": {"stage": 2}}))
    check(["--deepspeed_config", str(written)], "train_batch_size=6 is not a multiple of the 4 ranks")


def test_the_probe_is_scored_a_micro_batch_at_a_time_with_the_same_mean():
    """One forward over all --probe_batch windows (16 by default) could run out of memory where the steps take 4 a
    micro-batch; in chunks the mean over the windows is the same."""
    from hdet_scale.lm.train import mean_loss_in_chunks

    inputs = torch.arange(10.0).reshape(5, 2)
    seen: list[int] = []

    def loss(chunk):
        seen.append(len(chunk[0]))
        return (chunk[0] - chunk[1]).mean()

    mean = mean_loss_in_chunks(loss, (inputs, torch.zeros(5, 2)), 2)
    assert seen == [2, 2, 1] and float(mean) == pytest.approx(float(inputs.mean()))


def test_the_weight_decay_deepspeed_builds_a_json_optimizer_with():
    """DeepSpeed's engine builds torch's AdamW for Adam or AdamW with torch_adam (unless adam_w_mode is off), whose
    default weight decay is 0.01; its fused Adam, torch's Adam and the others default to 0."""
    from hdet_scale.lm.plan import built_weight_decay

    def built(kind: str, **params) -> float:
        return built_weight_decay({"optimizer": {"type": kind, "params": {"lr": 1e-3, **params}}})

    assert built("AdamW", weight_decay=0.05) == 0.05
    assert built("AdamW", torch_adam=True) == built("Adam", torch_adam=True) == built("MuAdamW") == 0.01
    assert built("Adam", torch_adam=True, adam_w_mode=False) == built("AdamW") == built("Lamb") == 0.0
