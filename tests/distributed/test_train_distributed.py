"""train.py's steps that need a process group, on gloo ranks without a launch: taking --out.

The launches themselves are in tests/e2e/test_train_e2e.py."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from distributed import run_ranks


def take_after_plans_that_differ(rank: int, world: int, directory: str) -> tuple[str, bool]:
    from hdet_scale.lm.agreement import RunFailed
    from hdet_scale.lm.checkpoints import out_state
    from hdet_scale.lm.out_lock import LOCK
    from hdet_scale.lm.train import take_out

    out = Path(directory) / "run"
    out.mkdir(exist_ok=True)
    # The ranks plan one after another: rank 1 finds an empty --out; then another run that held it ends, leaving
    # its checkpoint; then rank 0 plans, and resumes that checkpoint.
    planned = out_state(out, None) if rank == 1 else None
    dist.barrier()
    if rank == 0:
        (out / "checkpoints" / "latest").mkdir(parents=True)
        planned = out_state(out, None)
    dist.barrier()
    checked = SimpleNamespace(out_state=planned, config=SimpleNamespace(metrics_path=None))
    try:
        take_out(out, checked)
        said = "taken"
    except RunFailed as failure:
        said = str(failure)
    dist.barrier()
    return said, (out / LOCK).exists()


def test_ranks_whose_plans_found_different_runs_in_out_do_not_take_it(tmp_path):
    """Rank 0 checked only its own plan against --out: rank 0 resumed the checkpoint while rank 1 started afresh
    (skipping the load's collectives: a hang, or a rank training other weights)."""
    for said, locked in run_ranks(take_after_plans_that_differ, 2, str(tmp_path), timeout=60):
        assert said.startswith(f"taking {tmp_path / 'run'}: OutInUse: --out {tmp_path / 'run'} changed while this "
                               "run was starting (its ranks found different runs there")
        assert not locked


def exit_status_and_errors(args: Any) -> tuple[int, str]:
    """train.py's run with ``args`` on this rank: its exit status (0 where it ends without SystemExit) and what it
    wrote to stderr."""
    import torch

    from hdet_scale.lm.train import plan, train_on_every_rank

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            train_on_every_rank(args, plan(args), torch.device("cpu"))
        code = 0
    except SystemExit as stop:
        code = stop.code
    return code, said.getvalue()


def export_failing_on_rank_0(rank: int, world: int, directory: str) -> dict:
    """train.py's run to its end, where rank 0's write of the final model fails (a full disk)."""
    from hdet_scale.lm.backends import FSDPBackend
    from hdet_scale.lm.train import parse_args

    export = FSDPBackend.export

    def export_on_a_full_disk(self, path):
        export(self, path)
        if rank == 0:
            raise OSError(28, "No space left on device")

    FSDPBackend.export = export_on_a_full_disk
    out = Path(directory) / "run"
    args = parse_args(["--preset", "tiny", "--steps", "10", "--seq_len", "16", "--micro_batch_size", "2",
                       "--max_data_mb", "1", "--warmup_steps", "2", "--no_progress", "--eval_batches", "1",
                       "--out", str(out)])
    code, said = exit_status_and_errors(args)
    return {"code": code, "checkpoint": (out / "checkpoints" / "latest").is_dir(), "said": said}


def test_a_final_model_that_fails_to_write_stops_every_rank_in_one_line(tmp_path):
    """The final export was outside train.py's agreement: a write failing on rank 0 ended it in a traceback, while
    the other ranks went on into the next collective and waited there for the timeout."""
    first, second = run_ranks(export_failing_on_rank_0, 2, str(tmp_path), timeout=180)
    assert (first["code"], first["checkpoint"], second["code"], second["said"]) == (1, True, 1, "")
    assert first["said"] == (f"train.py: error: writing the model to {tmp_path / 'run' / 'final'}: OSError: [Errno 28] "
                             "No space left on device (rank 0)\n")


def logs_failing_on_rank_0(rank: int, world: int, directory: str) -> tuple[int, str]:
    """train.py's run, where rank 0's W&B start fails (not logged in, say)."""
    from hdet_scale.lm import progress
    from hdet_scale.lm.train import parse_args

    class FailingSinks:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("wandb.errors.UsageError: api_key not configured (no-tty)")

    if rank == 0:
        progress.ScalarSinks = FailingSinks
    args = parse_args(["--preset", "tiny", "--steps", "10", "--seq_len", "16", "--micro_batch_size", "2",
                       "--max_data_mb", "1", "--warmup_steps", "2", "--no_progress", "--eval_batches", "1",
                       "--out", str(Path(directory) / "run")])
    return exit_status_and_errors(args)


def test_logs_that_fail_to_start_on_rank_0_stop_every_rank_in_one_line(tmp_path):
    """W&B's start failing on rank 0 printed a traceback there while the other ranks waited in the next collective
    until the launcher's timeout."""
    (first_code, first_said), (second_code, second_said) = run_ranks(logs_failing_on_rank_0, 2, str(tmp_path),
                                                                     timeout=120)
    assert (first_code, second_code, second_said) == (1, 1, "")
    assert first_said == ("train.py: error: starting the run's logs (--wandb, TensorBoard): RuntimeError: "
                          "wandb.errors.UsageError: api_key not configured (no-tty) (rank 0)\n")


def attention_scales_evaluated_at(rank: int, world: int, directory: str) -> list[float]:
    """The softmax scale (over its own) of the first attention module in each of train.py's evaluations, on a run
    that explores it."""
    import json

    from hdet_scale.lm.backends import FSDPBackend
    from hdet_scale.lm.train import parse_args

    loss, seen = FSDPBackend.loss, []

    def recording_loss(self, batch):
        attention = next(module for module in self.model.modules() if hasattr(module, "scaling"))
        seen.append(attention.scaling * attention.head_dim ** 0.5)
        return loss(self, batch)

    FSDPBackend.loss = recording_loss
    settings = Path(directory) / "hdet.json"
    if rank == 0:
        settings.write_text(json.dumps({"gradient_mode": "local", "sync_interval": 5, "auto_lr": {"enabled": False},
                                        "explore": {"attention_scale": {"alpha": 0.5}}}))
    dist.barrier()
    args = parse_args(["--preset", "tiny", "--steps", "10", "--seq_len", "16", "--micro_batch_size", "2",
                       "--max_data_mb", "1", "--warmup_steps", "2", "--no_progress", "--eval_batches", "1",
                       "--eval_interval", "5", "--hdet_config", str(settings), "--out", str(Path(directory) / "run")])
    code, said = exit_status_and_errors(args)
    assert code == 0, said
    return seen


def test_the_held_out_loss_is_the_exported_models(tmp_path):
    """Each rank scored the held-out loss at its replica's attention scale (its multiplier times the base): the mean
    of models none of which is the exported one, whose weights carry the base."""
    for seen in run_ranks(attention_scales_evaluated_at, 2, str(tmp_path), timeout=300):
        assert len(seen) >= 3 and seen == pytest.approx([1.0] * len(seen)), seen


def signalled_while_building(rank: int, world: int, directory: str, where: str) -> dict:
    """train.py's run, where rank 1 gets a SIGTERM (the cluster preempting the job) while the model is wrapped, or
    the time guard's SIGUSR1 while the run takes ``--out`` (``where``)."""
    import os
    import signal

    import torch

    from hdet_scale.lm import train
    from hdet_scale.lm.backends import FSDPBackend
    from hdet_scale.lm.train import parse_args, plan, train_on_every_rank

    def signalled_in(work, number):
        def work_and_get_signalled(*args, **kwargs):
            if rank == 1:
                os.kill(os.getpid(), number)
            return work(*args, **kwargs)

        return work_and_get_signalled

    if where == "wrap":
        FSDPBackend.__init__ = signalled_in(FSDPBackend.__init__, signal.SIGTERM)
    else:
        train.take_out = signalled_in(train.take_out, signal.SIGUSR1)
    out = Path(directory) / "run"
    hdet_config = Path(directory) / f"hdet{rank}.json"  # no LR range test: a stop during it saves nothing
    hdet_config.write_text('{"alpha": 0.5, "sync_interval": 2, "auto_lr": {"range_test": 0}}')
    args = parse_args(["--preset", "tiny", "--steps", "40", "--seq_len", "16", "--micro_batch_size", "2",
                       "--max_data_mb", "1", "--warmup_steps", "2", "--no_progress", "--eval_batches", "1",
                       "--out", str(out), "--hdet_config", str(hdet_config)])
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        train_on_every_rank(args, plan(args), torch.device("cpu"))
    return {"said": said.getvalue(), "final": (out / "final").exists()}


@pytest.mark.parametrize("where", ["wrap", "take_out"])
def test_a_signal_while_the_model_is_built_stops_the_run_at_its_first_steps_with_a_checkpoint(tmp_path, where):
    """The ranks caught the signals only once the model was built and wrapped (minutes for a large one): a SIGTERM
    before then killed the rank (or, ignored as the Slurm templates start them, was lost, and the run trained on
    until Slurm's SIGKILL). A SIGUSR1 while the run took --out (its lock, the checks of a shared file system) killed
    the rank too: caught from the moment the process group is up, as the docs say."""
    first, _ = run_ranks(signalled_while_building, 2, str(tmp_path), where, timeout=180)
    stopped = re.search(r"^preempted at step (\d+); checkpoint: (\S+); rerun with --resume$", first["said"],
                        re.MULTILINE)
    assert stopped and int(stopped.group(1)) <= 2, first["said"]
    assert Path(stopped.group(2)).is_dir() and not first["final"]


def replica_sizes_that_differ(rank: int, world: int, directory: str) -> tuple[int, str]:
    """train.py's run, where the ranks were given different replica sizes (nodes of different sizes under "node")."""
    from hdet_scale.lm.train import parse_args

    hdet_config = Path(directory) / f"hdet{rank}.json"
    hdet_config.write_text(f'{{"ranks_per_replica": {rank + 1}}}')
    return exit_status_and_errors(parse_args([
        "--preset", "tiny", "--steps", "10", "--warmup_steps", "2", "--max_data_mb", "1", "--no_progress",
        "--out", str(Path(directory) / "run"), "--hdet_config", str(hdet_config)]))


def test_ranks_that_disagree_on_the_replica_size_stop_with_one_line(tmp_path):
    """The check ran inside the FSDP2 wrap, whose HDETConfigError ended every rank in a traceback."""
    (first_code, first_said), (second_code, second_said) = run_ranks(replica_sizes_that_differ, 2, str(tmp_path),
                                                                     timeout=120)
    assert (first_code, second_code, second_said) == (2, 2, "")
    assert first_said.startswith("train.py: error: the ranks disagree on ranks_per_replica: 1 on rank 0 but 2 on "
                                 "rank 1") and first_said.count("\n") == 1
    assert not (tmp_path / "run").exists()


def take_on_each_nodes_own_disk(rank: int, world: int, directory: str) -> tuple[str, list[str]]:
    """Each rank's --out on a disk of its own (a relative --out, each rank in its own folder), as node-local storage
    gives a run of several nodes."""
    import os

    from hdet_scale.lm.agreement import RunFailed
    from hdet_scale.lm.checkpoints import out_state
    from hdet_scale.lm.train import take_out

    os.chdir(Path(directory) / f"node{rank}")
    out = Path("run")
    checked = SimpleNamespace(out_state=out_state(out, None), config=SimpleNamespace(metrics_path=None))
    try:
        take_out(out, checked)
        said = "taken"
    except RunFailed as failure:
        said = str(failure)
    return said, sorted(path.name for path in out.iterdir()) if out.is_dir() else []


def test_an_out_that_is_not_one_folder_for_every_rank_is_refused(tmp_path):
    """Rank 0 alone names and renames a checkpoint that every rank writes: an --out on each node's own disk made every
    checkpoint unusable, and nothing said so until a resume failed with a misleading line."""
    for node in range(2):
        (tmp_path / f"node{node}").mkdir()
    for said, files in run_ranks(take_on_each_nodes_own_disk, 2, str(tmp_path), timeout=60):
        assert said == ("taking run: OutInUse: --out run is not one folder for every rank: rank 1 does not see the "
                        "lock rank 0 took there (a disk of each node's own?); give an --out on a file system every "
                        "node shares (rank 0)")
        assert "run.lock" not in files  # released
