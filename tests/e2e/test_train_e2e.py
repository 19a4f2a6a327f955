"""train.py end to end: real torchrun and deepspeed launches of the tiny model on CPU ranks.

Launches cost tens of seconds here, so a few runs are shared by the tests through fixtures: FSDP2 in global mode
runs uninterrupted (the README's main job, shortened: conftest's ``main_job``, which test_readme_e2e.py checks too),
then again with a SIGTERM and a --resume (the two must end on the same parameters); DeepSpeed ZeRO-2 runs in
global mode, and ZeRO-3 in local mode is preempted and resumed. Bad inputs are checked in-process and through one
real launch.

This file holds the tests that start a launcher or script as a subprocess; the tests that start no process are in
tests/unit/test_train.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import wandb_records
from launcher import SHORT, SHORT_BESIDE_JSON, STEPS, SYNC_INTERVAL, deepspeed, launch, single_process, torchrun

from hdet_scale import multipliers
from hdet_scale.lm import out_lock
from hdet_scale.lm.checkpoints import STOPPED_EARLY
from hdet_scale.lm.train import parse_args


def hdet_config(tmp: Path, mode: str, ranks_per_replica: int) -> str:
    path = tmp / f"hdet_{mode}_{ranks_per_replica}.json"
    path.write_text(json.dumps({"alpha": 0.5, "sync_interval": SYNC_INTERVAL, "gradient_mode": mode,
                                "ranks_per_replica": ranks_per_replica, "auto_lr": {"start": 10, "range_test": 0}}))
    return str(path)


def one_rank(tmp: Path, steps: int = 2 * SYNC_INTERVAL, **hdet_settings) -> list[str]:
    """A single-process run (no launcher) of ``steps`` short steps, syncing every SYNC_INTERVAL, without the LR range
    test, with ``hdet_settings`` besides: a few seconds (append ``--out`` and the rest)."""
    config = tmp / "hdet_one_rank.json"
    config.write_text(json.dumps({"sync_interval": SYNC_INTERVAL, "auto_lr": {"range_test": 0}, **hdet_settings}))
    return [*single_process(), *SHORT, "--steps", str(steps), "--hdet_config", str(config)]


def metric_lines(out: Path, kind: str = "replica_losses") -> list[dict]:
    """The metrics lines of one kind: syncs (``replica_losses``) or evaluations (``heldout_loss``)."""
    lines = [json.loads(line) for line in (out / "hdet_metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if kind in line]


def exported(out: Path) -> dict[str, torch.Tensor]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(out / "final")
    return {name: tensor.float() for name, tensor in model.state_dict().items()}


# ------------------------------------------------------------------------------------------ FSDP2
@pytest.fixture(scope="module")
def fsdp_runs(main_job, tmp_path_factory):
    """FSDP2, 2 replicas x 2 ranks, global gradients: uninterrupted (the README's main job); the same launch with
    SIGTERM after the first sync with --on_signal next_sync; then --resume."""
    split = tmp_path_factory.mktemp("fsdp") / "split"
    split.mkdir()
    command = [*main_job.command, "--out", str(split), "--on_signal", "next_sync",
               "--checkpoint_interval", str(SYNC_INTERVAL)]  # the preemption lands on a checkpoint step
    preempted = launch(command, cwd=split, sigterm_after_step=SYNC_INTERVAL, metrics=split / "hdet_metrics.jsonl")
    preempted_metrics = metric_lines(split)
    stopped_early = (split / STOPPED_EARLY).read_text() if (split / STOPPED_EARLY).exists() else None
    resumed = launch([*command, "--resume"], cwd=split)
    return {"full": main_job.out, "split": split, "uninterrupted": main_job.result, "preempted": preempted,
            "preempted_metrics": preempted_metrics, "stopped_early": stopped_early, "resumed": resumed,
            "command": main_job.command}


def on_two_ranks(command: list[str]) -> list[str]:
    """``command`` (the main job's) launched on 2 ranks: one replica of 2, for launches whose checks need no
    second replica (each rank fewer saves seconds of imports)."""
    return [*torchrun(2), *command[command.index("hdet_scale.lm.train") + 1:]]


def assert_two_replica_run(result: subprocess.CompletedProcess, out: Path, engine: str, *,
                           spread: bool = True) -> list[dict]:
    """A run of 2 replicas x 2 ranks on ``engine`` ended well, synced every T with both replicas' losses, and
    its replicas trained at different LRs (``spread``) or at the same one; returns its sync lines."""
    assert result.returncode == 0, result.stdout[-5000:]
    assert f"HDET train: engine={engine} ranks=4 replicas=2 ranks_per_replica=2" in result.stdout
    lines = metric_lines(out)
    assert [line["step"] for line in lines] == list(range(SYNC_INTERVAL, STEPS + 1, SYNC_INTERVAL))
    assert all(len(line["replica_losses"]) == 2 for line in lines)
    replica_lrs = lines[0]["values"]["lr/0"]["replica_values"]
    assert (replica_lrs[0] != replica_lrs[1]) == spread
    return lines


@pytest.mark.e2e
def test_fsdp_run_end_to_end(fsdp_runs):
    result, out = fsdp_runs["uninterrupted"], fsdp_runs["full"]
    lines = assert_two_replica_run(result, out, "fsdp", spread=False)  # the defaults: the LR the test picked
    assert "gradient_mode=global" in result.stdout
    # the default: the LR range test first, then the LR held at 0.7 times the pick, unspread (no controller moves
    # it, so nothing reads a spread)
    assert re.search(r"LR range test: picked \S+ \(\S+ x --lr\) in \d+ steps", result.stdout)
    assert not any(line["controller_updated"] for line in lines)
    assert len({line["values"]["lr/0"]["scale"] for line in lines}) == 1
    assert result.stdout.count("held-out loss") >= STEPS // 10  # every --eval_interval, and at the end
    evaluations = metric_lines(out, "heldout_loss")
    assert [line["step"] for line in evaluations] == [10, 20, 30, 40]  # the last one is the final evaluation
    assert f"held-out loss {evaluations[-1]['heldout_loss']:.4f}" in result.stdout
    assert "final train loss" in result.stdout and f"metrics: {out / 'hdet_metrics.jsonl'}" in result.stdout
    assert f"checkpoint: {out / 'checkpoints' / 'latest'}" in result.stdout
    assert f"model: {out / 'final'}" in result.stdout
    assert not (out / out_lock.LOCK).exists()  # the run gave its --out back
    # the last line: the LR the run found, in --lr's units (SHORT's --lr), the factor of the last sync
    found = re.search(r"found LR (\S+) \((\S+) x --lr\)\n*$", result.stdout)
    assert found, result.stdout[-2000:]
    factor = lines[-1]["values"]["lr/0"]["scale"]
    assert float(found[2]) == pytest.approx(factor, rel=6e-3)  # printed to 3 significant digits
    assert float(found[1]) == pytest.approx(factor * parse_args([]).lr, rel=1e-2)
    sync_line = re.search(r"^sync step \d+  loss \S+  replica losses \[.*\]  lr (\S+) \((\S+) x schedule\)  ",
                          result.stdout, re.M)
    assert sync_line, result.stdout[-2000:]  # the same factor, under the same words, at every sync
    quiet(result, "Setting accelerator")  # DeepSpeed's, which this path does not use


def quiet(result: subprocess.CompletedProcess, *more: str) -> None:
    """Nothing in the log that is not the user's business: DeepSpeed's FutureWarnings, transformers'
    shard-writing bar, and what ``more`` names."""
    for noise in ("FutureWarning", "Writing model shards", *more):
        assert noise not in result.stdout, noise


@pytest.mark.e2e
def test_fsdp_export_is_the_checkpointed_model(fsdp_runs):
    """The transformers export equals the model in the final DCP checkpoint (converted offline)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = fsdp_runs["full"]
    dcp_to_torch_save(out / "checkpoints" / "latest", out / "consolidated.pt")
    saved = torch.load(out / "consolidated.pt", weights_only=False)["model"]
    model = exported(out)
    assert set(model) == set(saved)
    for name, tensor in model.items():
        assert torch.equal(tensor, saved[name].float()), name


@pytest.mark.e2e
def test_sigterm_then_resume_matches_an_uninterrupted_run(fsdp_runs):
    preempted, resumed = fsdp_runs["preempted"], fsdp_runs["resumed"]
    assert "preempted at step" in preempted.stdout, preempted.stdout[-5000:]
    stopped = int(preempted.stdout.split("preempted at step ")[1].split(";")[0])
    assert SYNC_INTERVAL < stopped < STEPS and stopped % SYNC_INTERVAL == 0  # next_sync: a regular sync point
    saved = [line for line in preempted.stdout.splitlines() if line.startswith("checkpoint: ")]
    assert len(saved) == stopped // SYNC_INTERVAL  # one per checkpoint step: the preemption's step saved once
    assert max(line["step"] for line in fsdp_runs["preempted_metrics"]) == stopped
    # what the Slurm templates read to requeue a job whose ranks a signal they did not send stopped; gone once the
    # run resumed and finished (a job that ends then is not requeued)
    assert fsdp_runs["stopped_early"] == f"step {stopped} of {STEPS}, from step 0\n"
    assert not (fsdp_runs["split"] / STOPPED_EARLY).exists() and not (fsdp_runs["full"] / STOPPED_EARLY).exists()
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    assert f"resumed from {fsdp_runs['split'] / 'checkpoints' / 'latest'} at step {stopped}" in resumed.stdout
    # The metrics file reads as one run: each sync once, in order.
    assert [line["step"] for line in metric_lines(fsdp_runs["split"])] == [
        line["step"] for line in metric_lines(fsdp_runs["full"])]
    assert metric_lines(fsdp_runs["split"], "heldout_loss") == metric_lines(fsdp_runs["full"], "heldout_loss")
    full, split = exported(fsdp_runs["full"]), exported(fsdp_runs["split"])
    for name, tensor in full.items():
        assert torch.equal(tensor, split[name]), name
    final = [line for line in resumed.stdout.splitlines() if line.startswith("final train loss")]
    assert final and final[0].split("(")[0] in fsdp_runs["uninterrupted"].stdout


def applied_bases(out: Path) -> list[float]:
    """The base LR of param group 0 at every step, from a run's sync lines."""
    return [base for line in metric_lines(out) for base in line["values"]["lr/0"]["applied_bases"]]


@pytest.mark.e2e
def test_a_plain_run_replays_the_schedule_the_run_found(fsdp_runs, tmp_path):
    full, command = fsdp_runs["full"], on_two_ranks(fsdp_runs["command"])
    scales = [line["values"]["lr/0"]["scale"] for line in metric_lines(full)]
    assert scales[0] != pytest.approx(1.0, abs=1e-3)  # the range test set the LR: the schedule is not --lr's cosine
    schedule = tmp_path / "schedule.json"
    export = subprocess.run([sys.executable, "-m", "hdet_scale.tools.report", str(full / "hdet_metrics.jsonl"),
                             "--export-schedule", str(schedule)], capture_output=True, text=True, cwd=tmp_path)
    assert export.returncode == 0, export.stderr
    replay = tmp_path / "replay"
    replay.mkdir()
    # without HDET, and without the flags of the schedule the file replaces (refused beside it: test_train.py)
    dropped = {"--hdet_config", "--warmup_steps"}
    plain = [word for index, word in enumerate(command) if not {word, command[index - 1]} & dropped]
    result = launch([*plain, "--replay_schedule", str(schedule), "--out", str(replay)], cwd=replay)
    assert result.returncode == 0, result.stdout[-5000:]
    assert applied_bases(replay) == applied_bases(full)
    assert len(applied_bases(full)) == STEPS
    assert "replicas=1 ranks_per_replica=2" in result.stdout  # one replica, no spread: a plain run
    assert "sync step" not in result.stdout  # whose syncs only record what it applied


def without_range_test(command: list[str], tmp: Path) -> list[str]:
    """``command`` with a copy of its HDET config that starts no LR range test: for launches that test what happens
    at a sync or a save, which the test's 100 steps would only delay."""
    at = command.index("--hdet_config") + 1
    config = json.loads(Path(command[at]).read_text())
    config["auto_lr"] = {**config.get("auto_lr", {}), "range_test": 0}
    path = tmp / "hdet_no_range_test.json"
    path.write_text(json.dumps(config))
    return [*command[:at], str(path), *command[at + 1:]]


def files_of(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(directory.rglob("*")) if p.is_file()}


def one_error(result: subprocess.CompletedProcess) -> str:
    """The run failed with exactly one ``train.py: error:`` line and no traceback from any rank; returns that line.

    torchrun itself reports a failed rank with its own ``ChildFailedError`` traceback (its design, whatever the
    rank printed); that one is allowed, any other is not."""
    errors = [line for line in result.stdout.splitlines() if line.startswith("train.py: error:")]
    assert result.returncode != 0 and len(errors) == 1, result.stdout[-5000:]
    for traceback in result.stdout.split("Traceback (most recent call last):")[1:]:
        assert "ChildFailedError" in traceback and "hdet_scale/" not in traceback, result.stdout[-5000:]
    return errors[0]


@pytest.mark.e2e
def test_a_checkpoint_of_the_other_engine_is_refused_before_training(fsdp_runs, tmp_path):
    """An FSDP2 checkpoint under the deepspeed launcher: one line, nothing in the output directory touched."""
    out = fsdp_runs["split"]
    before = files_of(out)
    result = launch([*deepspeed(2), *SHORT, "--out", str(out), "--resume"], cwd=tmp_path, timeout=240)
    error = one_error(result)
    assert f"{out / 'checkpoints' / 'latest'} was written by fsdp, this run uses deepspeed ZeRO-2" in error
    assert "HDET train:" not in result.stdout
    assert files_of(out) == before


@pytest.mark.e2e
def test_a_damaged_checkpoint_stops_every_rank_in_one_line(fsdp_runs, tmp_path):
    shutil.copytree(fsdp_runs["split"], tmp_path / "out")
    shard = max((tmp_path / "out" / "checkpoints" / "latest").glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # as a full disk or a killed copy leaves it
    result = launch([*fsdp_runs["command"], "--out", str(tmp_path / "out"), "--resume"], cwd=tmp_path, timeout=240)
    assert f"is damaged: {shard.name} has" in one_error(result)


@pytest.mark.e2e
def test_resume_into_fewer_replicas_says_so_and_trains_on(fsdp_runs, tmp_path):
    """A requeued job on half the nodes: the 2 x 2 checkpoint resumes as one replica of 2 ranks."""
    shutil.copytree(fsdp_runs["split"], tmp_path / "out")
    command = on_two_ranks(fsdp_runs["command"])
    result = launch([*command, "--out", str(tmp_path / "out"), "--resume", "--steps", str(STEPS + SYNC_INTERVAL)],
                    cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-5000:]
    assert "replica layout changed: the checkpoint has 2 replica(s), this run 1" in result.stdout
    assert f"at step {STEPS}" in result.stdout and "final train loss" in result.stdout
    assert max(line["step"] for line in metric_lines(tmp_path / "out")) == STEPS + SYNC_INTERVAL


@pytest.mark.e2e
def test_a_second_run_on_an_out_in_use_is_refused_and_touches_nothing(fsdp_runs, tmp_path):
    """Two jobs with the same OUT_DIR, both passing --resume (the Slurm templates' default): the second, finding no
    checkpoint yet, would start afresh and delete the first one's metrics."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "hdet_metrics.jsonl").write_text('{"step": 0, "range_test": {}}\n')  # the live run's first line
    with subprocess.Popen(["sleep", "300"]) as live:  # the run holding --out, on this host
        (out / out_lock.LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": live.pid,
                                                     "since": "2026-11-27 10:00:00"}))
        before = files_of(out)
        result = launch([*on_two_ranks(fsdp_runs["command"]), "--out", str(out), "--resume"], cwd=tmp_path,
                        timeout=240)
        live.kill()
    assert f"--out {out} is in use by another run (rank 0 on {socket.gethostname()}, pid {live.pid}" in \
        one_error(result)
    assert files_of(out) == before


@pytest.mark.e2e
def test_a_resume_without_a_checkpoint_says_it_starts_at_step_0_and_keeps_the_earlier_metrics(tmp_path):
    """The Slurm templates always pass --resume; a requeued job whose first attempt failed before any checkpoint
    (a lost node, with the default --checkpoint_interval 0) started again at step 0 without a word and deleted that
    attempt's metrics."""
    out = tmp_path / "out"
    out.mkdir()
    earlier = '{"step": 5, "replica_losses": [5.0]}\n{"step": 10, "replica_losses": [4.0]}\n'
    (out / "hdet_metrics.jsonl").write_text(earlier)
    result = launch([*one_rank(tmp_path), "--out", str(out), "--resume"], cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout[-5000:]
    aside = out / "hdet_metrics.earlier_attempt_1.jsonl"
    assert (f"no checkpoint in {out / 'checkpoints'} to resume from: this run starts at step 0; the earlier "
            f"attempt's metrics are kept in {aside}") in result.stdout
    assert aside.read_text() == earlier
    assert [line["step"] for line in metric_lines(out)] == [5, 10]  # this run's own, from step 0
    assert "final train loss" in result.stdout


def tensorboard_steps(out: Path, name: str) -> list[int]:
    """The steps of every ``name`` event TensorBoard holds for ``out``, a step logged twice twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(out / "tensorboard"))
    accumulator.Reload()
    return [event.step for event in accumulator.Scalars(name)]


@pytest.mark.e2e
@pytest.mark.parametrize("metrics_file", [True, False], ids=["metrics_file", "no_metrics_file"])
def test_resuming_a_finished_run_writes_its_model_again_in_one_piece_and_no_line_twice(tmp_path, metrics_file):
    """A job requeued after its last checkpoint (killed while it wrote the model, say) resumes at the run's end:
    it appended the held-out loss a second time, and wrote final/ in place, where a kill in the middle damages a
    complete model. The model is now written beside it and renamed into place. Without a metrics file (whose lines
    told which held-out losses were recorded) TensorBoard got the last one twice."""
    out = tmp_path / "out"
    command = [*one_rank(tmp_path, **({} if metrics_file else {"metrics_path": None})), "--out", str(out)]
    finished = launch(command, cwd=tmp_path, timeout=240)
    assert finished.returncode == 0, finished.stdout[-5000:]
    metrics = (out / "hdet_metrics.jsonl").read_text() if metrics_file else None
    model, folder = exported(out), (out / "final").stat().st_ino
    again = launch([*command, "--resume"], cwd=tmp_path, timeout=240)
    assert again.returncode == 0, again.stdout[-5000:]
    steps = 2 * SYNC_INTERVAL
    assert (f"the checkpoint at step {steps} ends this run (--steps {steps}): nothing to train; its model is written "
            "again") in again.stdout
    assert tensorboard_steps(out, "eval/heldout_loss") == [steps]  # the held-out loss at the end once
    if metrics_file:
        assert (out / "hdet_metrics.jsonl").read_text() == metrics
    else:
        assert not (out / "hdet_metrics.jsonl").exists()
    assert (out / "final").stat().st_ino != folder  # a new folder, renamed into place
    assert sorted(path.name for path in out.iterdir() if path.name.startswith("final")) == ["final"]
    for name, tensor in exported(out).items():
        assert torch.equal(tensor, model[name]), name


@pytest.mark.e2e
def test_runs_without_a_launcher_on_one_machine_do_not_collide_on_a_port(tmp_path):
    """Without a launcher the run set up its world of one on MASTER_PORT 29512 unless told otherwise: a second such
    run on the machine (here a socket listening there) failed with EADDRINUSE's traceback. It picks a free port now,
    and a MASTER_PORT the user gave that is taken is said in one line."""
    with socket.socket() as other_run, socket.socket() as given:
        with contextlib.suppress(OSError):  # taken by another process already: the collision to avoid all the same
            other_run.bind(("127.0.0.1", 29512))
            other_run.listen()
        result = launch([*one_rank(tmp_path), "--out", str(tmp_path / "out")], cwd=tmp_path, timeout=240)
        assert result.returncode == 0, result.stdout[-5000:]
        given.bind(("127.0.0.1", 0))
        given.listen()
        port = given.getsockname()[1]
        refused = launch(["env", f"MASTER_PORT={port}", *one_rank(tmp_path), "--out", str(tmp_path / "again")],
                         cwd=tmp_path, timeout=240)
    assert one_error(refused) == (f"train.py: error: MASTER_PORT={port} is in use on this machine (another run?): "
                                  "set MASTER_PORT to a free port, or leave it unset and the run picks one")
    assert refused.returncode == 2


@pytest.mark.e2e
@pytest.mark.parametrize("engine", ["fsdp", "deepspeed"])
def test_a_resumed_run_with_dropout_draws_what_an_uninterrupted_one_would(tmp_path, engine):
    """Only torch.manual_seed(seed) was set and no random state saved: the resumed run's dropout masks started over
    from the seed, and the model differed from an uninterrupted run's. An LR constant in --steps (no warm-up, no
    decay) lets a 10-step run be continued to 20 steps."""
    steps = 4 * SYNC_INTERVAL
    command = [*one_rank(tmp_path, steps), "--engine", engine, "--dropout", "0.3", "--warmup_steps", "0",
               "--min_lr_ratio", "1"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    for result in (launch([*command, "--out", str(whole)], cwd=tmp_path, timeout=240),
                   launch([*command, "--steps", str(steps // 2), "--out", str(split)], cwd=tmp_path, timeout=240),
                   launch([*command, "--out", str(split), "--resume"], cwd=tmp_path, timeout=240)):
        assert result.returncode == 0, result.stdout[-5000:]
    assert re.search(rf"resumed from {split / 'checkpoints'}/\S+ at step {steps // 2}", result.stdout)
    model = exported(whole)
    for name, tensor in exported(split).items():
        assert torch.equal(tensor, model[name]), name


@pytest.mark.e2e
def test_a_checkpoint_that_cannot_be_written_stops_every_rank_in_one_line(fsdp_runs, tmp_path):
    """Saving fails on every rank (here: where checkpoints/ should be, a file stands): one line, exit 1."""
    (tmp_path / "checkpoints").write_text("not a directory")
    command = without_range_test(on_two_ranks(fsdp_runs["command"]), tmp_path)
    result = launch([*command, "--out", str(tmp_path), "--steps", str(SYNC_INTERVAL), "--warmup_steps", "1"],
                    cwd=tmp_path, timeout=240)
    assert f"saving a checkpoint in {tmp_path / 'checkpoints'}:" in one_error(result)


@pytest.mark.e2e
def test_ctrl_c_checkpoints_like_sigterm(fsdp_runs, tmp_path):
    """Ctrl-C in the terminal (SIGINT to every process of the launch): the ranks stop together at the next safe
    point and checkpoint, with no traceback from any rank."""
    command = without_range_test(fsdp_runs["command"], tmp_path)
    result = launch([*command, "--out", str(tmp_path)], cwd=tmp_path, sigterm_after_step=SYNC_INTERVAL,
                    metrics=tmp_path / "hdet_metrics.jsonl", signal_number=signal.SIGINT)
    assert "preempted at step" in result.stdout, result.stdout[-5000:]
    assert (tmp_path / "checkpoints" / "latest" / "run.json").is_file()
    assert "KeyboardInterrupt" not in result.stdout
    assert result.stdout.count("Traceback") <= 1  # torchrun's own report of the signal it received, at most


@pytest.mark.e2e
def test_a_run_stopped_during_its_lr_range_test_says_so_in_its_out(tmp_path):
    """Stopped during the range test, a run saves nothing and exits 0: without OUT/stopped_early a Slurm template
    took it for a run that had finished, and the job ended COMPLETED at step 0."""
    out = tmp_path / "out"
    command = [*one_rank(tmp_path, auto_lr={"range_test": 5000}), "--out", str(out)]
    result = launch(command, cwd=tmp_path, sigterm_on_output="LR range test: up to 5000 steps")
    assert result.returncode == 0 and "stopped during the LR range test" in result.stdout, result.stdout[-5000:]
    assert (out / STOPPED_EARLY).read_text() == f"step 0 of {2 * SYNC_INTERVAL}, from step 0\n"


@pytest.mark.e2e
def test_a_run_can_start_with_an_lr_range_test_under_deepspeed(tmp_path):
    """ZeRO-0, 2 replicas of 1 rank, DeepSpeed's WarmupDecayLR from the JSON: the test's steps come before --steps
    (the engine holds the JSON's scheduler), the pick is said over the JSON's peak, and the run syncs every T of its
    own steps. (The FSDP2 path runs the default range test in the main job.)"""
    config, ds_config = tmp_path / "hdet.json", tmp_path / "ds.json"
    config.write_text(json.dumps({"alpha": 0.5, "sync_interval": SYNC_INTERVAL, "auto_lr": {"range_test": 20}}))
    ds_config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3,
                                                          "warmup_num_steps": 5, "total_num_steps": STEPS}}}))
    out = tmp_path / "out"
    result = launch([*deepspeed(2), *SHORT_BESIDE_JSON, "--deepspeed_config", str(ds_config), "--hdet_config",
                     str(config), "--out", str(out)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-5000:]
    picked = re.search(r"LR range test: picked (\S+) \((\S+) x the DeepSpeed JSON's warmup_max_lr\) in 20 steps",
                       result.stdout)
    assert picked, result.stdout[-5000:]
    assert float(picked[2]) == pytest.approx(float(picked[1]) / 2e-3, rel=1e-2)
    lines = [json.loads(line) for line in (out / "hdet_metrics.jsonl").read_text().splitlines()]
    test = lines[0]["range_test"]
    assert lines[0]["step"] == 0 and test["picked_lr"] == pytest.approx(float(picked[1]), rel=1e-2)
    # the replicas' mean LR at 0.7 times the pick, over the JSON's peak (not lr)
    mean = sum(multipliers(2, 0.5, "log")) / 2
    assert test["scale"] == pytest.approx(0.7 * test["picked_lr"] / (2e-3 * mean), rel=1e-6)
    syncs = metric_lines(out)
    assert [line["step"] for line in syncs] == list(range(SYNC_INTERVAL, STEPS + 1, SYNC_INTERVAL))
    # the schedule started after the test: the first sync's bases are WarmupDecayLR's first steps (0, 0, then its
    # log warm-up) times the scale
    first_bases = syncs[0]["values"]["lr/0"]["applied_bases"]
    assert first_bases[:3] == pytest.approx([0.0, 0.0, 2e-3 * test["scale"] * math.log(2) / math.log(5)], rel=1e-4)


# -------------------------------------------------------------------------------------- DeepSpeed
@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    """ZeRO-2, 2 replicas x 2 ranks, global gradients; ZeRO-3, 2 replicas of 1 rank, local gradients, stopped
    after the first sync with the default --on_signal sync_now as the Slurm template's time guard stops it (the
    launchers started ignoring SIGUSR1 and SIGTERM, SIGUSR1 to every process), then --resume."""
    root = tmp_path_factory.mktemp("deepspeed")
    global_out, local_out = root / "global", root / "local"
    global_out.mkdir(), local_out.mkdir()
    zero2 = launch([*deepspeed(4), *SHORT, "--zero_stage", "2", "--hdet_config", hdet_config(root, "global", 2),
                    "--probe_batch", "4", "--out", str(global_out)], cwd=global_out)
    local_args = [*SHORT, "--zero_stage", "3", "--hdet_config", hdet_config(root, "local", 1), "--out", str(local_out),
                  "--wandb", "hdet-test"]
    as_the_slurm_template = ["bash", "-c", 'trap "" TERM USR1; exec "$@"', "bash"]
    preempted = launch([*as_the_slurm_template, *deepspeed(2), *local_args], cwd=local_out,
                       sigterm_after_step=SYNC_INTERVAL, signal_number=signal.SIGUSR1,
                       metrics=local_out / "hdet_metrics.jsonl")
    checkpoints_after_preemption = sorted(p.name for p in (local_out / "checkpoints").iterdir() if p.is_dir())
    resumed = launch([*deepspeed(2), *local_args, "--resume"], cwd=local_out)
    return {"global": global_out, "local": local_out, "zero2": zero2, "preempted": preempted,
            "checkpoints_after_preemption": checkpoints_after_preemption, "resumed": resumed}


@pytest.mark.e2e
def test_deepspeed_global_run_end_to_end(deepspeed_runs):
    result, out = deepspeed_runs["zero2"], deepspeed_runs["global"]
    lines = assert_two_replica_run(result, out, "deepspeed")
    quiet(result)
    probes = [line["probe_losses"] for line in lines]  # --probe_batch: each replica scored on the same windows
    assert all(len(losses) == 2 and all(0 < loss < 10 for loss in losses) for losses in probes)
    assert probes[0][0] != probes[0][1]
    assert (out / "checkpoints" / "latest").read_text() == f"step{STEPS}"
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == [f"step{STEPS}"]  # older gone


@pytest.mark.e2e
def test_deepspeed_export_is_the_checkpointed_model(deepspeed_runs):
    """The transformers export equals DeepSpeed's own fp32 consolidation of the final checkpoint."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out = deepspeed_runs["global"]
    saved = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"), tag=f"step{STEPS}")
    model = exported(out)
    for name, tensor in saved.items():
        assert torch.equal(model[name], tensor.float()), name


@pytest.mark.e2e
def test_deepspeed_time_guard_stop_syncs_now_and_resumes(deepspeed_runs):
    preempted, resumed = deepspeed_runs["preempted"], deepspeed_runs["resumed"]
    # The launchers ignore SIGUSR1 and wait for the ranks, which stop cleanly: the launch ends well (DeepSpeed's
    # launcher would kill them 30 s after a SIGTERM, checkpoint written or not).
    assert preempted.returncode == 0, preempted.stdout[-5000:]
    assert "preempted at step" in preempted.stdout and "received SIGUSR1" in preempted.stdout
    assert "HDET train: engine=deepspeed ranks=2 replicas=2 ranks_per_replica=1" in preempted.stdout
    assert "preset=tiny (0.1M parameters)" in preempted.stdout  # counted before ZeRO-3 partitions the model
    quiet(resumed)
    assert "gradient_mode=local" in preempted.stdout
    stopped = int(preempted.stdout.split("preempted at step ")[1].split(";")[0])
    assert SYNC_INTERVAL < stopped < STEPS
    assert deepspeed_runs["checkpoints_after_preemption"] == [f"step{stopped}"]
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    assert f"at step {stopped}" in resumed.stdout and "final train loss" in resumed.stdout
    steps = [line["step"] for line in metric_lines(deepspeed_runs["local"])]
    # Regular syncs, the early one at the preemption, then regular ones again up to the end.
    regular = list(range(SYNC_INTERVAL, STEPS + 1, SYNC_INTERVAL))
    assert steps == sorted(set(regular) | {stopped})
    # --wandb: the resumed run logs into the preempted run's W&B run, a row per sync like the metrics file. The
    # signal to every process stopped the preempted run's W&B service too: that run said so once and checkpointed.
    assert preempted.stdout.count("W&B stopped logging") <= 1
    out = deepspeed_runs["local"]
    run_id = (out / "wandb_run_id").read_text().strip()
    rows = [row for path in out.glob(f"wandb/offline-run-*/run-{run_id}.wandb") for row in wandb_records.history(path)]
    losses = {row["step"]: row["hdet/loss"] for row in rows if "hdet/loss" in row}
    for line in metric_lines(out):
        if line["step"] > stopped:
            assert losses[line["step"]] == pytest.approx(sum(line["replica_losses"]) / 2)


@pytest.mark.e2e
def test_a_bad_input_stops_a_real_launch_at_once(tmp_path):
    """Under torchrun, every rank stops before any process group exists, and rank 0 says why in one line."""
    result = launch([*torchrun(2), "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path)], cwd=tmp_path,
                    timeout=180)
    assert result.returncode != 0
    assert "train.py: error: --data" in result.stdout and "no such file or directory" in result.stdout
    assert result.stdout.count("train.py: error:") == 1
    assert "HDET train:" not in result.stdout
