"""What made a checkpoint of ``hdet_scale.lm.train``, checked before a run resumes from it.

Every checkpoint carries ``run.json``: the engine (and ZeRO stage), the model's shape, the replica layout, the
explored hyperparameters, the peak LR and weight decay, the hdet_scale version, the step, and the size of every
file of the checkpoint, written last, once the checkpoint is complete. ``--resume`` reads it before any process
group exists and refuses, in one line, what cannot be continued (another engine, another model, missing or
truncated files, other explored values, optimizer settings the saved state would ignore) without touching the
output directory. A different number of replicas is fine: the
model is one at a sync point, and each new replica takes a saved replica's optimizer state (replica ``r``
takes saved replica ``r mod R_saved``'s, or the one they shared where theirs were alike).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from hdet_scale.durable import clear_folder, fsync_path, replacement_folders, write_text_durably

MANIFEST = "run.json"
CHECKPOINTS = "checkpoints"
FINAL_MODEL = "final"
"""Where a complete run writes its model (for transformers' ``from_pretrained``), under ``--out``."""


class ResumeError(ValueError):
    """A checkpoint that this run cannot continue from; the message says which and why, in one line."""


TAKEN_FROM_THE_CHECKPOINT = ("hdet.seed", "hdet.auto_lr.initial_scale", "hdet.warm_init.")
"""Settings (and prefixes of them) that a resumed run cannot change: its checkpoint restores the permutation
streams hdet.seed started and the controller's scale auto_lr.initial_scale started, and warm_init acts only when
a run starts. (A changed auto_lr.range_test applies: no test runs again, but whether the controller moves the LR
and the LR's default spread follow it.)"""


@dataclass(frozen=True)
class ResumePoint:
    """A checkpoint a run can continue from."""

    path: Path
    step: int
    saved_replicas: int
    replicas: int
    changed: tuple[str, ...] = ()
    """The settings this run gives otherwise than the checkpoint's run did, as ``name old -> new``."""
    trained_to: dict[str, int] = field(default_factory=dict)
    """How far the checkpoint's run (and those it resumed) trained on each data file (``corpus.trained_so_far``);
    empty in one of an earlier version."""

    def changed_line(self) -> str:
        """One line: the changed settings that apply from the resumed step on, and those the checkpoint keeps."""
        kept = [change for change in self.changed if change.split(" ", 1)[0].startswith(TAKEN_FROM_THE_CHECKPOINT)]
        applied = [change for change in self.changed if change not in kept]
        said = []
        if applied:
            said.append(f"resuming with other settings than the checkpoint's ({', '.join(applied)}): they apply from "
                        f"step {self.step} on")
        if kept:
            said.append(f"{'and' if applied else 'resuming with'} settings the checkpoint keeps as they were "
                        f"({', '.join(kept)}): it restores the permutation streams and the controller's scale, and "
                        "warm_init acts only when a run starts")
        return "; ".join(said)

    @property
    def layout_changed(self) -> bool:
        return self.saved_replicas != self.replicas

    def layout_line(self) -> str:
        return (f"replica layout changed: the checkpoint has {self.saved_replicas} replica(s), this run "
                f"{self.replicas}; replica r continues with saved replica r mod {self.saved_replicas}'s optimizer "
                "state where the replicas saved their own, else with the one they shared (the model is one at a sync "
                "point)")


def identity(*, engine: str, zero_stage: int | None, model: dict[str, Any], replicas: int, ranks_per_replica: int,
             explored: list[str], optimizer: dict[str, float], settings: dict[str, Any]) -> dict[str, Any]:
    """What a resumed run must share with the checkpoint (and what it may change: ``replicas``). ``optimizer``:
    the values a resume would ignore, since the optimizer's and the LR schedule's saved state replace them (the
    peak LR, the weight decay). ``settings``: the others a resumed run may change, said in one line when it does
    (JSON values: what ``run.json`` gives back)."""
    return {"engine": engine, "zero_stage": zero_stage, "model": model, "replicas": replicas,
            "ranks_per_replica": ranks_per_replica, "explored": sorted(explored), "optimizer": optimizer,
            "settings": json.loads(json.dumps(settings))}


def version() -> str:
    try:
        return metadata.version("hdet_scale")
    except metadata.PackageNotFoundError:
        return "unknown"


def write_manifest(directory: Path, run: dict[str, Any], step: int) -> None:
    """Writes ``directory/run.json`` for the complete checkpoint in ``directory`` (one rank, after every rank
    wrote its files and flushed them to the disk): the run's identity, the step, the Slurm job that wrote it, and
    every file with its size; on the disk when it returns."""
    files = {str(path.relative_to(directory)): path.stat().st_size
             for path in sorted(directory.rglob("*")) if path.is_file() and path.name != MANIFEST}
    written = {**run, "step": step, "hdet_scale": version(), "slurm_job": os.environ.get("SLURM_JOB_ID"),
               "files": files}
    write_text_durably(directory / MANIFEST, json.dumps(written, indent=1) + "\n")


STAGING = tuple(folder.name for folder in replacement_folders(Path("latest")))
"""FSDP2's save writes ``latest.tmp``, moves ``latest`` to ``latest.old``, then ``latest.tmp`` to ``latest``
(``replace_folder_durably``)."""
DEEPSPEED_TAG_PREFIX = "step"
"""DeepSpeed's save writes ``step<N>/`` and its manifest, then points the ``latest`` file at it (through
``latest.tmp``), then removes the folder ``latest`` named before."""


def deepspeed_tag(step: int) -> str:
    """The folder of DeepSpeed's checkpoint at ``step``."""
    return f"{DEEPSPEED_TAG_PREFIX}{step}"


def deepspeed_folders(root: Path) -> list[Path]:
    """The DeepSpeed checkpoint folders under ``root`` (``step<N>``, nothing else a user keeps there)."""
    return sorted(path for path in root.glob(f"{DEEPSPEED_TAG_PREFIX}*")
                  if path.is_dir() and re.fullmatch(rf"{DEEPSPEED_TAG_PREFIX}\d+", path.name))


def latest_tag(root: Path) -> str | None:
    """The tag DeepSpeed's ``latest`` file under ``root`` names, None where there is none."""
    latest = root / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def point_latest(root: Path, tag: str) -> None:
    """Points DeepSpeed's ``latest`` file under ``root`` at ``tag``, on the disk when it returns."""
    write_text_durably(root / "latest", tag)


def checkpoint_dir(out: Path) -> Path | None:
    """The newest checkpoint under ``out/checkpoints``, of either engine: FSDP2's ``latest`` folder, or the
    folder DeepSpeed's ``latest`` file names, or a newer complete one a kill left before ``latest`` named it;
    where a kill between FSDP2's two renames left no ``latest``, the newest complete of ``latest.tmp`` and
    ``latest.old``, and where one before them left a complete ``latest.tmp`` newer than ``latest``, that one;
    None when there is none."""
    root = out / CHECKPOINTS
    latest = root / "latest"
    if latest.is_dir():
        # latest's files are stat'ed only where a complete latest.tmp is there to compare with (not before every save)
        staged = root / STAGING[0]
        staged_step = complete_step(staged)
        latest_step = complete_step(latest) if staged_step is not None else None
        return staged if latest_step is not None and staged_step > latest_step else latest
    tag = latest_tag(root)
    named = root / tag if tag is not None else None
    named_step = complete_step(named) if named is not None else None
    candidates = [*(root / name for name in STAGING), *deepspeed_folders(root)]
    newer = [(step, path) for path in candidates if path != named and (step := complete_step(path)) is not None
             and (named_step is None or step > named_step)]
    if named is not None and (named_step is None or not newer):
        return named  # a damaged checkpoint 'latest' names is refused by check_resume, not skipped for an older one
    return max(newer)[1] if newer else None


def complete_step(path: Path) -> int | None:
    """The step of the checkpoint in ``path`` when it is complete (its manifest readable and every file it lists
    there at its size), else None."""
    try:
        saved = json.loads((path / MANIFEST).read_text())
        sizes_right = all((path / name).is_file() and (path / name).stat().st_size == size
                          for name, size in saved["files"].items())
        return int(saved["step"]) if sizes_right else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_resume(out: Path, run: dict[str, Any]) -> ResumePoint | None:
    """The checkpoint under ``out`` this run (``identity``) continues from, None when there is none; raises
    ``ResumeError`` naming the checkpoint and the cause when it cannot be continued. Reads files only."""
    path = checkpoint_dir(out)
    if path is None:
        return None
    where = f"--resume: the checkpoint {path}"
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise ResumeError(f"{where} has no {MANIFEST} (it is incomplete, or was not written by this train.py); "
                          f"remove {out / CHECKPOINTS} to start afresh, or use another --out")
    try:
        saved = json.loads(manifest.read_text())
    except json.JSONDecodeError as error:
        raise ResumeError(f"{where}: {MANIFEST} is not valid JSON ({error})") from error
    _check_same(where, saved, run)
    for name, size in saved["files"].items():
        file = path / name
        if not file.is_file():
            raise ResumeError(f"{where} is incomplete: {name} is missing; resume from a complete checkpoint or remove "
                              f"{out / CHECKPOINTS} to start afresh")
        if file.stat().st_size != size:
            raise ResumeError(f"{where} is damaged: {name} has {file.stat().st_size} bytes, {size} were written; "
                              f"resume from a complete checkpoint or remove {out / CHECKPOINTS} to start afresh")
    return ResumePoint(path=path, step=int(saved["step"]), saved_replicas=int(saved["replicas"]),
                       replicas=int(run["replicas"]), changed=changed_settings(saved.get("settings", {}),
                                                                               run["settings"]),
                       trained_to=saved.get("trained_to", {}))


def written_before_this_requeue(out: Path) -> bool:
    """Whether this process is a requeued Slurm job and the newest checkpoint in ``out`` is one this same job
    wrote before the requeue: progress of this run, not of the run an ``--overwrite`` was given to replace."""
    job, path = os.environ.get("SLURM_JOB_ID"), checkpoint_dir(out)
    if not job or int(os.environ.get("SLURM_RESTART_COUNT", 0)) == 0 or path is None:
        return False
    try:
        return json.loads((path / MANIFEST).read_text()).get("slurm_job") == job
    except (OSError, ValueError, AttributeError):
        return False


UNSET = "unset"
"""How ``differences`` says a name one side does not have."""


def differences(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``name old -> new`` for each name whose value differs between ``before`` and ``now``, sorted; a name one
    side lacks is ``unset`` there."""
    def value(values: dict[str, Any], name: str) -> Any:
        return values[name] if name in values else UNSET

    return [f"{name} {value(before, name)} -> {value(now, name)}" for name in sorted(before.keys() | now.keys())
            if value(before, name) != value(now, name)]


def changed_settings(before: dict[str, Any], now: dict[str, Any]) -> tuple[str, ...]:
    """The settings (``identity``'s) a resumed run gives otherwise than its checkpoint's: those both runs recorded,
    and the DeepSpeed JSON's keys (``deepspeed.<key>``) that one of them has and the other lacks, where the
    checkpoint recorded its JSON. Any other name one side lacks is left out: earlier versions recorded fewer
    settings (or none), and a flag the JSON overrides is recorded as the JSON's key instead."""
    recorded_json = any(name.startswith("deepspeed.") for name in before)
    compared = {name for name in before.keys() | now.keys()
                if name in before and name in now or recorded_json and name.startswith("deepspeed.")}
    return tuple(differences({name: before[name] for name in compared & before.keys()},
                             {name: now[name] for name in compared & now.keys()}))


def _check_same(where: str, saved: dict[str, Any], run: dict[str, Any]) -> None:
    def engine(identity: dict[str, Any]) -> str:
        return identity["engine"] + ("" if identity["zero_stage"] is None else f" ZeRO-{identity['zero_stage']}")

    if (saved["engine"], saved["zero_stage"]) != (run["engine"], run["zero_stage"]):
        raise ResumeError(f"{where} was written by {engine(saved)}, this run uses {engine(run)}: resume with the "
                          "engine that wrote it, or use another --out")
    if saved["model"] != run["model"]:
        changed = ", ".join(differences(saved["model"], run["model"]))
        raise ResumeError(f"{where} holds another model ({changed}): resume with the model it was trained with, or "
                          "use another --out")
    if saved["explored"] != run["explored"]:
        raise ResumeError(f"{where} explores {saved['explored']}, this run {run['explored']}: resume with the same "
                          "explore settings and param groups, or use another --out")
    if saved.get("optimizer", run["optimizer"]) != run["optimizer"]:  # checkpoints of earlier versions lack it
        changed = ", ".join(differences(saved["optimizer"], run["optimizer"]))
        raise ResumeError(f"{where} was trained with other optimizer settings ({changed}): a resumed run takes the "
                          "saved optimizer and LR schedule state, which would ignore them; resume with the values it "
                          "was trained with, or start a new run in another --out")
    saved_settings = saved.get("settings", {})
    if "dropout" in run["explored"] and saved_settings.get("dropout", run["settings"]["dropout"]) \
            != run["settings"]["dropout"]:
        raise ResumeError(f"{where} explores the dropout as a factor on --dropout {saved_settings['dropout']}, which "
                          f"its HDET state keeps, and this run gives --dropout {run['settings']['dropout']}: resume "
                          f"with --dropout {saved_settings['dropout']}, or start a new run in another --out")
    if "replay_schedule" in saved_settings and ((saved_settings["replay_schedule"] is None)
                                                != (run["settings"].get("replay_schedule") is None)):
        kind = "on a replayed schedule" if saved_settings["replay_schedule"] else "on train.py's own schedule"
        raise ResumeError(f"{where} was trained {kind}, and this run's --replay_schedule says otherwise: the LR "
                          "scheduler's state it holds is of that kind; resume with --replay_schedule as the run was "
                          "started, or use another --out")
    if run["engine"] == "deepspeed" and run["zero_stage"] and saved["ranks_per_replica"] != run["ranks_per_replica"]:
        raise ResumeError(f"{where} was sharded over {saved['ranks_per_replica']} rank(s) per replica, this run "
                          f"{run['ranks_per_replica']}: ZeRO partitions do not reshape; keep ranks_per_replica (more "
                          "or fewer replicas are fine)")


TENSORBOARD = "tensorboard"
"""Where a run's TensorBoard events go, under ``--out`` (a fresh run's would mix with an earlier run's there)."""
WANDB_ID_FILE = "wandb_run_id"
"""The W&B run a resumed run logs into, under ``--out``: goes with the run it belongs to."""
STOPPED_EARLY = "stopped_early"
"""Under ``--out``, what a run that a signal stopped before its ``--steps`` leaves ("step N of M, from step K": K the
step that start began at), and a run there removes when it starts: the Slurm templates requeue a job whose ranks
stopped so without their asking, where the start trained a step."""


def previous_run(out: Path, metrics_path: str | None) -> list[Path]:
    """What an earlier run left in ``out``: its checkpoints, its final model (and the folders an export interrupted
    while it was put in place leaves), its metrics (non-empty) and those of attempts before it, its TensorBoard
    events."""
    found = [path for path in (out / CHECKPOINTS, out / FINAL_MODEL, *replacement_folders(out / FINAL_MODEL),
                               out / TENSORBOARD)
             if path.is_dir() and any(path.iterdir())]
    metrics = Path(metrics_path) if metrics_path else None
    if metrics is not None and metrics.is_file() and metrics.stat().st_size:
        found.append(metrics)
    if metrics is not None:
        found += sorted(metrics.parent.glob(f"{metrics.stem}.{EARLIER_ATTEMPT}_*{metrics.suffix}"))
    return found


def out_state(out: Path, metrics_path: str | None) -> tuple[tuple[str, ...], int | None]:
    """What ``out`` holds of a run, as far as starting one there depends on it: what ``previous_run`` finds, and
    the step of the newest complete checkpoint."""
    newest = checkpoint_dir(out)
    return (tuple(map(str, previous_run(out, metrics_path))),
            complete_step(newest) if newest is not None else None)


def remove_previous_run(out: Path, metrics_path: str | None) -> list[Path]:
    """Removes what ``previous_run`` finds, and its W&B run's id (a later run resuming with --wandb would log into
    it); returns what went."""
    removed = previous_run(out, metrics_path)
    if (out / WANDB_ID_FILE).is_file():
        removed.append(out / WANDB_ID_FILE)
    for path in removed:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return removed


EARLIER_ATTEMPT = "earlier_attempt"
"""In the name a fresh start under ``--resume`` gives the metrics of the attempt before it, which left no checkpoint:
``hdet_metrics.earlier_attempt_1.jsonl``, ``_2`` for the next, ..."""


def start_without_checkpoint(out: Path, metrics_path: str | None) -> list[str]:
    """Readies ``out`` for a run that starts at step 0 and removes nothing: what an earlier attempt there left without
    a checkpoint (a requeued job that failed before its first) is said in one line, and its metrics are moved aside
    to a name that says so rather than written over. An ``out`` with nothing of a run in it (an empty metrics file
    at most) says nothing. Returns the line, if any."""
    left = previous_run(out, metrics_path)
    metrics = Path(metrics_path) if metrics_path else None
    if metrics is not None and metrics.is_file() and not metrics.stat().st_size:
        metrics.unlink()  # empty: nothing to keep, and the run's own lines go there
    if not left:
        return []
    line = f"no checkpoint in {out / CHECKPOINTS} to resume from: this run starts at step 0"
    if metrics in left:
        number = 1
        while (aside := metrics.with_name(f"{metrics.stem}.{EARLIER_ATTEMPT}_{number}{metrics.suffix}")).exists():
            number += 1
        metrics.rename(aside)
        line += f"; the earlier attempt's metrics are kept in {aside}"
    return [line]


def settle_interrupted_save(out: Path) -> list[str]:
    """Tidies what an interrupted save left, losing nothing: where FSDP2 was killed after ``latest.tmp`` was
    complete but before or between its two renames, the newest complete checkpoint becomes ``latest``; where DeepSpeed
    was killed after a checkpoint was complete but before ``latest`` named it, ``latest`` is pointed at it. Then
    what is left of the staging and every other DeepSpeed ``step<N>`` folder is removed, being incomplete or older
    than ``latest`` (DeepSpeed's ``latest.tmp`` is a pointer file written before it replaces ``latest``). Returns
    one line per change."""
    root = out / CHECKPOINTS
    done = []
    newest = checkpoint_dir(out)
    if newest is not None and newest.name in STAGING:
        if (root / "latest").exists():  # killed before the first rename: the save's own order, each step atomic
            clear_folder(root / STAGING[1])  # older than latest
            (root / "latest").rename(root / STAGING[1])
        newest.rename(root / "latest")
        fsync_path(root)  # the renames on the disk before the folder they retired goes below
        done.append(f"promoted {newest} (complete, step {complete_step(root / 'latest')}) to {root / 'latest'}, "
                    "left by a checkpoint interrupted while it was put in place")
        newest = root / "latest"
    elif newest is not None and newest.name != "latest" and newest.name != latest_tag(root):
        point_latest(root, newest.name)
        done.append(f"pointed {root / 'latest'} at {newest} (complete, step {complete_step(newest)}), left by a "
                    "checkpoint interrupted before it was named")
    for leftover in [*(root / name for name in STAGING), *(path for path in deepspeed_folders(root) if path != newest)]:
        if not (leftover.exists() or leftover.is_symlink()):
            continue
        why = ("older than the checkpoint resumed" if leftover.name not in STAGING and complete_step(leftover)
               is not None else "left by an interrupted checkpoint")
        done.append(remove_unused(leftover) or f"removed {leftover}, {why}")
    return done


def remove_unused(path: Path) -> str | None:
    """Removes a checkpoint folder (or file) the run no longer uses. Where the file system refuses (a file another
    NFS client holds open, say), the run goes on: the one line returned says what to remove by hand."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            os.remove(path)
    except OSError as error:
        return f"could not remove {path} ({error.strerror or error}); the run does not use it: remove it by hand"
    return None


def flush_metrics(metrics_path: str | None) -> None:
    """Puts the metrics file on the disk before a checkpoint is taken (on the rank that writes it): the checkpoint
    vouches for its step, and a node crash must not leave a resumed run with lines missing before it."""
    if metrics_path and Path(metrics_path).is_file():
        fsync_path(Path(metrics_path))


def check_free_space(out: Path) -> None:
    """Raises OSError when the file system of ``out/checkpoints`` has less room than the last checkpoint took
    (the new one is written beside it before the old one goes): before any rank writes a byte, so a full disk
    stops the run in one line instead of in the middle of a save."""
    path = checkpoint_dir(out)
    manifest = path / MANIFEST if path is not None else None
    if manifest is None or not manifest.is_file():
        return
    needed = sum(json.loads(manifest.read_text())["files"].values())
    free = shutil.disk_usage(out / CHECKPOINTS).free
    if free < needed:
        raise OSError(f"no room for a checkpoint in {out / CHECKPOINTS}: the last one took {needed / 2**30:.2f} GiB, "
                      f"{free / 2**30:.2f} GiB are free; free some space (the last checkpoint is kept)")
