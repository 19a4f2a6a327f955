"""train.py end to end: real torchrun and deepspeed launches of the tiny model on CPU ranks.

Launches cost tens of seconds here, so a few runs are shared by the tests through fixtures: FSDP2 in global mode
runs uninterrupted (the README's main job, shortened: conftest's ``main_job``, which test_readme.py checks too),
then again with a SIGTERM and a --resume (the two must end on the same parameters); DeepSpeed ZeRO-2 runs in
global mode, and ZeRO-3 in local mode is preempted and resumed. Bad inputs are checked in-process and through one
real launch.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import wandb_records
from launcher import SHORT, STEPS, SYNC_INTERVAL, deepspeed, launch, torchrun

from hdet_scale import train
from hdet_scale.train import SINGLE_PROCESS, parse_args, plan


def hdet_config(tmp: Path, mode: str, ranks_per_replica: int) -> str:
    path = tmp / f"hdet_{mode}_{ranks_per_replica}.json"
    path.write_text(json.dumps({"alpha": 0.5, "sync_interval": SYNC_INTERVAL, "gradient_mode": mode,
                                "ranks_per_replica": ranks_per_replica, "auto_lr": {"start": 10}}))
    return str(path)


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
    resumed = launch([*command, "--resume"], cwd=split)
    return {"full": main_job.out, "split": split, "uninterrupted": main_job.result, "preempted": preempted,
            "preempted_metrics": preempted_metrics, "resumed": resumed, "command": main_job.command}


def assert_two_replica_run(result: subprocess.CompletedProcess, out: Path, engine: str) -> list[dict]:
    """A run of 2 replicas x 2 ranks on ``engine`` ended well, synced every T with both replicas' losses, and
    its replicas trained at different LRs; returns its sync lines."""
    assert result.returncode == 0, result.stdout[-5000:]
    assert f"HDET train: engine={engine} ranks=4 replicas=2 ranks_per_replica=2" in result.stdout
    lines = metric_lines(out)
    assert [line["step"] for line in lines] == list(range(SYNC_INTERVAL, STEPS + 1, SYNC_INTERVAL))
    assert all(len(line["replica_losses"]) == 2 for line in lines)
    spread = lines[0]["values"]["lr/0"]["replica_values"]
    assert spread[0] != spread[1]
    return lines


@pytest.mark.e2e
def test_fsdp_run_end_to_end(fsdp_runs):
    result, out = fsdp_runs["uninterrupted"], fsdp_runs["full"]
    lines = assert_two_replica_run(result, out, "fsdp")
    assert "gradient_mode=global" in result.stdout
    assert any(line["controller_updated"] for line in lines)  # the controller starts after its warm-up
    assert result.stdout.count("held-out loss") >= STEPS // 10  # every --eval_interval, and at the end
    evaluations = metric_lines(out, "heldout_loss")
    assert [line["step"] for line in evaluations] == [10, 20, 30, 40]  # the last one is the final evaluation
    assert f"held-out loss {evaluations[-1]['heldout_loss']:.4f}" in result.stdout
    assert "final train loss" in result.stdout and f"metrics: {out / 'hdet_metrics.jsonl'}" in result.stdout
    assert f"checkpoint: {out / 'checkpoints' / 'latest'}" in result.stdout
    assert f"model: {out / 'final'}" in result.stdout
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
def test_a_plain_run_replays_the_schedule_the_controller_found(fsdp_runs, tmp_path):
    full, command = fsdp_runs["full"], fsdp_runs["command"]
    scales = [line["values"]["lr/0"]["scale"] for line in metric_lines(full)]
    assert len(set(scales)) > 2  # the controller moved: the schedule is not --lr's cosine
    schedule = tmp_path / "schedule.json"
    export = subprocess.run([sys.executable, "-m", "hdet_scale.report", str(full / "hdet_metrics.jsonl"),
                             "--export-schedule", str(schedule)], capture_output=True, text=True, cwd=tmp_path)
    assert export.returncode == 0, export.stderr
    at = command.index("--hdet_config")
    replay = tmp_path / "replay"
    replay.mkdir()
    # Another --lr: only the file can give the run the HDET run's bases.
    result = launch([*command[:at], *command[at + 2:], "--lr", "1e-5", "--replay_schedule", str(schedule),
                     "--out", str(replay)], cwd=replay)
    assert result.returncode == 0, result.stdout[-5000:]
    assert applied_bases(replay) == applied_bases(full)
    assert len(applied_bases(full)) == STEPS
    assert "replicas=1 ranks_per_replica=4" in result.stdout  # one replica, no spread: a plain run
    assert "sync step" not in result.stdout  # whose syncs only record what it applied


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
    command = [*torchrun(2), *fsdp_runs["command"][fsdp_runs["command"].index("hdet_scale.train") + 1:]]
    result = launch([*command, "--out", str(tmp_path / "out"), "--resume", "--steps", str(STEPS + SYNC_INTERVAL)],
                    cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-5000:]
    assert "replica layout changed: the checkpoint has 2 replica(s), this run 1" in result.stdout
    assert f"at step {STEPS}" in result.stdout and "final train loss" in result.stdout
    assert max(line["step"] for line in metric_lines(tmp_path / "out")) == STEPS + SYNC_INTERVAL


@pytest.mark.e2e
def test_a_checkpoint_that_cannot_be_written_stops_every_rank_in_one_line(fsdp_runs, tmp_path):
    """Saving fails on every rank (here: where checkpoints/ should be, a file stands): one line, exit 1."""
    (tmp_path / "checkpoints").write_text("not a directory")
    result = launch([*fsdp_runs["command"], "--out", str(tmp_path), "--steps", str(SYNC_INTERVAL)], cwd=tmp_path,
                    timeout=240)
    assert f"saving a checkpoint in {tmp_path / 'checkpoints'}:" in one_error(result)


@pytest.mark.e2e
def test_ctrl_c_checkpoints_like_sigterm(fsdp_runs, tmp_path):
    """Ctrl-C in the terminal (SIGINT to every process of the launch): the ranks stop together at the next safe
    point and checkpoint, with no traceback from any rank."""
    result = launch([*fsdp_runs["command"], "--out", str(tmp_path)], cwd=tmp_path, sigterm_after_step=SYNC_INTERVAL,
                    metrics=tmp_path / "hdet_metrics.jsonl", signal_number=signal.SIGINT)
    assert "preempted at step" in result.stdout, result.stdout[-5000:]
    assert (tmp_path / "checkpoints" / "latest" / "run.json").is_file()
    assert "KeyboardInterrupt" not in result.stdout
    assert result.stdout.count("Traceback") <= 1  # torchrun's own report of the signal it received, at most


@pytest.mark.e2e
def test_a_run_can_start_with_an_lr_range_test(tmp_path):
    """2 replicas of 1 rank: the test's steps come before --steps, and the run syncs every T of its own steps."""
    config = tmp_path / "hdet.json"
    config.write_text(json.dumps({"alpha": 0.5, "sync_interval": SYNC_INTERVAL, "auto_lr": {"range_test": 20}}))
    out = tmp_path / "out"
    result = launch([*torchrun(2), *SHORT, "--hdet_config", str(config), "--out", str(out)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-5000:]
    picked = re.search(r"LR range test: picked (\S+) \((\S+) x --lr\) in 20 steps", result.stdout)
    assert picked, result.stdout[-5000:]
    lines = [json.loads(line) for line in (out / "hdet_metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 0 and lines[0]["range_test"]["picked_lr"] == pytest.approx(float(picked[1]), rel=1e-2)
    assert [line["step"] for line in metric_lines(out)] == list(range(SYNC_INTERVAL, STEPS + 1, SYNC_INTERVAL))


# -------------------------------------------------------------------------------------- DeepSpeed
@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    """ZeRO-2, 2 replicas x 2 ranks, global gradients; ZeRO-3, 2 replicas of 1 rank, local gradients,
    SIGTERM after the first sync with the default --on_signal sync_now, then --resume."""
    root = tmp_path_factory.mktemp("deepspeed")
    global_out, local_out = root / "global", root / "local"
    global_out.mkdir(), local_out.mkdir()
    zero2 = launch([*deepspeed(4), *SHORT, "--zero_stage", "2", "--hdet_config", hdet_config(root, "global", 2),
                    "--probe_batch", "4", "--out", str(global_out)], cwd=global_out)
    local_args = [*SHORT, "--zero_stage", "3", "--hdet_config", hdet_config(root, "local", 1), "--out", str(local_out),
                  "--wandb", "hdet-test"]
    preempted = launch([*deepspeed(2), *local_args], cwd=local_out, sigterm_after_step=SYNC_INTERVAL,
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
def test_deepspeed_sigterm_syncs_now_and_resumes(deepspeed_runs):
    preempted, resumed = deepspeed_runs["preempted"], deepspeed_runs["resumed"]
    # The launcher itself dies of the SIGTERM sent to the whole session; the ranks stop cleanly.
    assert "preempted at step" in preempted.stdout, preempted.stdout[-5000:]
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
    # launcher stopped the preempted run's W&B service with its ranks: that run said so once and checkpointed.
    assert preempted.stdout.count("W&B stopped logging") <= 1
    out = deepspeed_runs["local"]
    run_id = (out / "wandb_run_id").read_text().strip()
    rows = [row for path in out.glob(f"wandb/offline-run-*/run-{run_id}.wandb") for row in wandb_records.history(path)]
    losses = {row["_step"]: row["train/loss"] for row in rows if "train/loss" in row}
    for line in metric_lines(out):
        if line["step"] > stopped:
            assert losses[line["step"]] == pytest.approx(sum(line["replica_losses"]) / 2)


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
    check(["--data", str(empty), "--vocab_size", "100"], "the token file is empty")
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    check(["--data", str(odd), "--vocab_size", "100"], "not a whole number of uint16 tokens")
    wrong_vocab = tmp_path / "tokens.bin"
    wrong_vocab.write_bytes(torch.arange(1000, dtype=torch.int16).numpy().tobytes())
    check(["--data", str(wrong_vocab), "--vocab_size", "500"], "token id 999 is outside the vocabulary of 500")
    check(["--data", str(wrong_vocab)], "give its tokenizer's vocabulary with --vocab_size")
    check(["--data", str(wrong_vocab), "--vocab_size", "1000", "--seq_len", "512"],
          "too few for one batch of 8 x 513 tokens")
    texts = tmp_path / "texts"
    texts.mkdir()
    check(["--data", str(texts)], "no text files")
    bad_hdet = tmp_path / "hdet.json"
    bad_hdet.write_text(json.dumps({"alpha": 0.5, "sync_intervall": 10}))
    check(["--hdet_config", str(bad_hdet)], "sync_intervall")
    bad_hdet.write_text(json.dumps({"alpha": -0.5}))
    check(["--hdet_config", str(bad_hdet)], "alpha")
    check(["--eval_interval", "7"], "--eval_interval=7 must be a multiple of sync_interval=5")  # 300 steps: T = 5
    check(["--steps", "1500", "--eval_interval", "30"], "--eval_interval=30 must be a multiple of sync_interval=25")
    check(["--steps", "0"], "--steps must be at least 1")
    # docs/train.md's DeepSpeed JSON without its --steps: a 300-step run of a 300,000-step schedule learned nothing
    zero2 = str(Path(__file__).resolve().parents[1] / "ds_configs" / "zero2_bf16.json")
    check(["--deepspeed_config", zero2], "--steps is 300 and the DeepSpeed JSON's "
          "scheduler.params.total_num_steps is 300000: the LR schedule must end when the run does; pass --steps "
          "300000")


@pytest.mark.usefixtures("single_process")
def test_a_run_in_its_out_is_refused_unless_resumed_or_overwritten(tmp_path):
    """A fresh run into the --out of a finished run used to replace its checkpoint, metrics and model with no
    word. Each of them alone is a run that --resume or --overwrite must name."""
    out = tmp_path / "run"
    for left in ("checkpoints/latest/run.json", "final/model.safetensors", "hdet_metrics.jsonl"):
        shutil.rmtree(out, ignore_errors=True)
        (out / left).parent.mkdir(parents=True, exist_ok=True)
        (out / left).write_text("{}")
        check(["--out", str(out)], rf"--out {out} holds a run already \({out / left.split('/')[0]}\): pass --resume "
                                   "to continue it, --overwrite to start afresh over it, or choose another --out")
        assert plan(parse_args(["--out", str(out), "--overwrite"])).resume is None
        assert (out / left).exists()  # nothing is removed before the process group starts
    check(["--out", str(out), "--resume", "--overwrite"], "--resume continues the run in --out and --overwrite "
                                                          "replaces it: pass one of them")
    (out / "hdet_metrics.jsonl").write_text("")  # an empty metrics file is no run
    plan(parse_args(["--out", str(out)]))


def test_overwrite_removes_the_previous_runs_checkpoints_model_and_metrics_only(tmp_path):
    from hdet_scale.lm.checkpoints import remove_previous_run

    for left in ("checkpoints/latest/run.json", "final/config.json", "hdet_metrics.jsonl", "tensorboard/events",
                 "notes.txt"):
        (tmp_path / left).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / left).write_text("x")
    metrics = str(tmp_path / "hdet_metrics.jsonl")
    removed = remove_previous_run(tmp_path, metrics)
    assert removed == [tmp_path / "checkpoints", tmp_path / "final", tmp_path / "hdet_metrics.jsonl"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["notes.txt", "tensorboard"]


@pytest.mark.usefixtures("single_process")
def test_an_out_that_cannot_be_written_is_refused_in_one_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    check(["--out", str(blocker / "run")], f"--out {blocker / 'run'}: cannot create it \\({blocker} is not a "
                                           "directory\\); choose another directory")
    hdet = tmp_path / "hdet.json"
    hdet.write_text(json.dumps({"metrics_path": str(blocker / "m.jsonl")}))
    check(["--hdet_config", str(hdet)], "metrics_path's folder .*a_file: cannot create it")


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    for option, default in (("--steps", 300), ("--lr", 0.003), ("--out", "runs/train"), ("--probe_batch", 16),
                            ("--on_signal", "sync_now"), ("--preset", "tiny")):
        assert re.search(rf"{option} .*?\(default: {re.escape(str(default))}\)", shown), option


def test_the_peak_lr_the_found_lr_is_said_against():
    """--lr, unless the DeepSpeed JSON sets the peak: its scheduler's warmup_max_lr, else its optimizer's lr
    (WarmupCosineLR peaks there)."""
    from hdet_scale.lm.plan import given_peak_lr

    args = parse_args(["--lr", "0.002"])
    assert given_peak_lr(args, None) == (0.002, "--lr")
    assert given_peak_lr(args, {"scheduler": {"type": "WarmupCosineLR", "params": {}}}) == (0.002, "--lr")
    assert given_peak_lr(args, {"optimizer": {"params": {"lr": 3e-4}}}) == (3e-4, "the DeepSpeed JSON's lr")
    assert given_peak_lr(args, {"optimizer": {"params": {"lr": 3e-4}},
                                "scheduler": {"params": {"warmup_max_lr": 1e-3}}}) == (
        1e-3, "the DeepSpeed JSON's warmup_max_lr")


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


@pytest.mark.usefixtures("single_process")
def test_a_range_test_under_deepspeed_is_refused_before_any_process_group(tmp_path):
    hdet = tmp_path / "hdet.json"
    hdet.write_text(json.dumps({"auto_lr": {"range_test": 20}}))
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8}))
    check(["--hdet_config", str(hdet), "--deepspeed_config", str(ds_config)],
          "range_test is not supported with DeepSpeed yet")


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


@pytest.mark.e2e
def test_a_bad_input_stops_a_real_launch_at_once(tmp_path):
    """Under torchrun, every rank stops before any process group exists, and rank 0 says why in one line."""
    result = launch([*torchrun(2), "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path)], cwd=tmp_path,
                    timeout=180)
    assert result.returncode != 0
    assert "train.py: error: --data" in result.stdout and "no such file or directory" in result.stdout
    assert result.stdout.count("train.py: error:") == 1
    assert "HDET train:" not in result.stdout
