"""A save that fails on one rank, at each of its writes, on FSDP2 and DeepSpeed ZeRO-2/3 (real gloo ranks, train.py's
backends): every rank stops within seconds with the same one-line error, never waiting for a process-group
timeout, and the newest complete checkpoint is kept and loads the model it saved. A rank killed (SIGKILL) in a
save leaves a checkpoint that resumes with the model it saved.

Every write of a save is counted on each rank (DCP's shard files, ``torch.save``, the manifest, the renames and
DeepSpeed's ``latest``) by wrapping the functions that write, then each is made to fail once, on rank 0 and on
rank 1 (a rank that writes only its shard).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_fsdp import full

from distributed import run_ranks
from hdet_scale.comm import on_rank0
from hdet_scale.lm.checkpoints import check_resume, checkpoint_dir, identity, settle_interrupted_save

SYNC_INTERVAL = 2
VICTIMS = (0, 1)
LAYOUTS = {"fsdp": ("fsdp", None), "zero2": ("deepspeed", 2), "zero3": ("deepspeed", 3)}
"""What each test case runs on: the engine and its ZeRO stage."""
ROUND_TRIP_SECONDS = 30.0  # far below the process group's timeout (90 s here, 10 min in train.py)


class Injector:
    """Counts this rank's writes under ``root`` and makes the ``fail_at``-th of them raise an OSError, or kills
    this rank (SIGKILL) at the write named ``kill_at``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.writes: list[str] = []
        self.fail_at: int | None = None
        self.kill_at: str | None = None

    def install(self) -> None:
        import torch.distributed.checkpoint.filesystem as filesystem

        self._wrap(torch, "save", lambda args: args[1])
        # a stream opened to write (DCP's reader opens them too, for the check of a complete checkpoint)
        self._wrap(filesystem.FileSystem, "create_stream", lambda args: args[1] if "w" in args[2] else None)
        for method in ("write_text", "replace", "rename"):
            self._wrap(pathlib.Path, method, lambda args: args[0])
        self._wrap(os, "fsync", lambda args: os.readlink(f"/proc/self/fd/{args[0]}"))

    def _wrap(self, owner: Any, name: str, path_of: Callable[[tuple], Any]) -> None:
        original = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            target = path_of(args)  # DCP also torch.saves into open streams: those are counted as its files
            path = Path(target) if isinstance(target, (str, os.PathLike)) else None
            if path is not None and path.is_relative_to(self.root):
                self.writes.append(f"{name} {path.relative_to(self.root)}")
                if len(self.writes) - 1 == self.fail_at:
                    raise OSError(f"injected: {name} failed")
                if self.writes[-1] == self.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        setattr(owner, name, counted)


def build(layout: str, directory: Path) -> Any:
    from hdet_scale import HDETConfig
    from hdet_scale.lm.backends import DeepSpeedBackend, FSDPBackend
    from hdet_scale.lm.model import build_model
    from hdet_scale.lm.plan import _deepspeed_config
    from hdet_scale.lm.train import parse_args

    engine, stage = LAYOUTS[layout]
    zero = [] if engine == "fsdp" else ["--zero_stage", str(stage)]
    args = parse_args(["--steps", "200", "--micro_batch_size", "2", "--seq_len", "16", "--engine", engine, *zero,
                       "--out", str(directory), "--dtype", "fp32"])
    config = HDETConfig(alpha=0.5, sync_interval=SYNC_INTERVAL, ranks_per_replica=2,
                        auto_lr={"enabled": False, "range_test": 0})
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=64, seq_len=16)
    if engine == "fsdp":
        return FSDPBackend(model, config, args, torch.device("cpu"))
    return DeepSpeedBackend(model, config, args, _deepspeed_config(args), torch.device("cpu"))


def one_step(backend: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """One optimizer step of ``hdet_scale.lm.train`` on one micro-batch."""
    backend.optimizer_step([backend.forward_backward(batch, index=0, of=1)])


def parameters(backend: Any) -> torch.Tensor:
    return full(backend.module.parameters()).clone()


def faults(rank: int, world: int, directory: str, layout: str) -> list[tuple[int, str, str, float]]:
    from hdet_scale.lm.agreement import RunFailed, agreed

    out = Path(directory)
    root = out / "checkpoints"
    run = run_identity(layout)
    backend = build(layout, out)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(rank))

    def train() -> torch.Tensor:
        for _ in range(SYNC_INTERVAL):
            one_step(backend, (tokens[:, :-1], tokens[:, 1:]))
        return parameters(backend)

    def save() -> None:
        agreed("saving a checkpoint", lambda: backend.save(root, {"step": backend.ensemble.global_step}, run))

    injector = Injector(root)
    injector.install()
    train()
    save()
    train()
    injector.writes.clear()
    save()  # a save after an earlier one, as in each case below: every write such a save makes
    writes = [None] * world
    dist.all_gather_object(writes, list(injector.writes))
    outcomes = []
    for victim in VICTIMS:
        for index in range(len(writes[victim])):
            dist.barrier()  # no rank still reads the last case's checkpoint
            on_rank0(lambda: shutil.rmtree(root, ignore_errors=True), "clearing")
            saved = train()
            save()
            saved_step = backend.ensemble.global_step
            now = train()
            injector.writes.clear()
            injector.fail_at = index if rank == victim else None
            started = time.perf_counter()
            try:
                save()
                outcome = "saved"
            except RunFailed as failure:
                outcome = str(failure)
            elapsed = time.perf_counter() - started
            injector.fail_at = None
            point = check_resume(out, run)
            assert point is not None and point.step in (saved_step, backend.ensemble.global_step), (index, point)
            expected = now if point.step == backend.ensemble.global_step else saved
            dist.barrier()  # every rank has read the folder as the failed save left it
            on_rank0(lambda: settle_interrupted_save(out), "settling")
            backend.load(checkpoint_dir(out))
            assert torch.equal(parameters(backend), expected), (victim, writes[victim][index])
            outcomes.append((victim, writes[victim][index], outcome, elapsed))
    return outcomes


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_write_failing_on_one_rank_stops_every_rank_at_once_and_keeps_the_checkpoint(tmp_path, layout):
    results = run_ranks(faults, 4, str(tmp_path), layout, timeout=900)
    cases = results[0]
    assert {victim for victim, *_ in cases} == set(VICTIMS) and len(cases) >= 3
    for rank_cases in results:
        assert [(victim, write) for victim, write, *_ in rank_cases] == [(v, w) for v, w, *_ in cases]
    for case, *others in zip(*results, strict=True):
        victim, write, outcome, _ = case
        # the same one line on every rank, naming the rank the write failed on
        assert all(other[2] == outcome for other in others), (write, outcome, [other[2] for other in others])
        assert "\n" not in outcome
        # A failed write of the checkpoint's own files (any of rank 1's: they all come before rank 0 publishes it)
        # fails the save; a failure after the checkpoint was complete and in place is no failure.
        if victim == 1 or write.split()[0] in DATA_WRITES:
            assert outcome != "saved", (victim, write)
        if outcome != "saved":
            assert outcome.startswith("saving a checkpoint: ") and f"(rank {victim})" in outcome, outcome
            assert "injected" in outcome, outcome
        assert max(other[3] for other in (case, *others)) < ROUND_TRIP_SECONDS, (write, outcome)


# ----------------------------------------------------------------------------------------- on the disk
DATA_WRITES = ("save", "create_stream", "write_text")
PUBLISH = {"fsdp": "rename latest.tmp", "zero2": "replace latest.tmp", "zero2 engine.hdet": "replace latest.tmp"}
"""The write that makes a save the checkpoint a resume finds (the older one goes right after it). ``zero2
engine.hdet``: DeepSpeed's HDET handle's own ``save_checkpoint``, as a user's loop calls it, without train.py."""


def reads_of_latest_in_a_save(rank: int, world: int, directory: str) -> int:
    """How often this rank reads the DeepSpeed checkpoint folder's 'latest' in two saves of train.py's backend."""
    from hdet_scale.lm import backends

    backend = build("zero2", Path(directory))
    reads = []
    read = backends.latest_tag

    def counted(folder: Path) -> str | None:
        reads.append(folder)
        return read(folder)

    backends.latest_tag = counted
    batch = (torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
    for _ in range(2):
        for _ in range(SYNC_INTERVAL):
            one_step(backend, batch)
        backend.save(Path(directory) / "checkpoints", {}, {})
    return len(reads)


def test_a_deepspeed_save_reads_the_folders_latest_on_rank_0_alone(tmp_path):
    """Every rank read 'latest', before the save's collectives, for rank 0's removal of the older checkpoint: one
    rank failing that read (a stale file handle on one node) left the others waiting in the save's collective."""
    assert run_ranks(reads_of_latest_in_a_save, 4, str(tmp_path)) == [2, 0, 0, 0]


def writes_of_a_save(rank: int, world: int, directory: str, layout: str) -> list[str]:
    """Every write, flush and rename of this rank in a save over an existing checkpoint, in order."""
    out = Path(directory)
    root = out / "checkpoints"
    engine_layout, _, handle = layout.partition(" ")
    backend = build(engine_layout, out)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(rank))
    injector = Injector(root)
    injector.install()
    for save in range(2):
        for _ in range(SYNC_INTERVAL):
            one_step(backend, (tokens[:, :-1], tokens[:, 1:]))
        injector.writes.clear()
        if handle:
            backend.hdet.save_checkpoint(root, tag=f"save{save}")
        else:
            backend.save(root, {}, run_identity(layout))
    return injector.writes


@pytest.mark.parametrize("layout", list(PUBLISH))
def test_every_file_of_a_checkpoint_is_on_the_disk_before_it_replaces_the_older_one(tmp_path, layout):
    """A node crash loses the page cache: each file a rank wrote is flushed (fsync of that file by its rank, or
    by the node's first rank, which under DeepSpeed flushes the whole checkpoint) before rank 0 publishes the
    checkpoint, and the rename itself is flushed (fsync of its folder, ".") before the older checkpoint goes."""
    writes = run_ranks(writes_of_a_save, 4, str(tmp_path), layout, timeout=300)
    publish = writes[0].index(PUBLISH[layout])
    flushed_before_publish = {write.split(" ", 1)[1] for write in writes[0][:publish] if write.startswith("fsync ")}
    for rank, done in enumerate(writes):
        for index, write in enumerate(done):
            kind, path = write.split(" ", 1)
            if kind in DATA_WRITES:
                own = rank > 0 and f"fsync {path}" in done[index + 1:]  # inside the save, before rank 0 publishes
                assert own or path in flushed_before_publish, (rank, write, done)
    assert "fsync ." in writes[0][publish + 1:], writes[0]


# ----------------------------------------------------------------------------------------------- kills
KILLS = {"fsdp": [(0, "save latest.tmp/hdet_state.pt"), (0, "rename latest.tmp"),
                  (1, "create_stream latest.tmp/__1_0.distcp")],
         "zero2": [(0, "replace latest.tmp"), (1, "save step4/zero_pp_rank_1_mp_rank_00_optim_states.pt")]}
"""(victim rank, write): on FSDP2 rank 0's first own write, between its two renames, and rank 1's shard; on
DeepSpeed the pointer's replace and rank 1's optimizer partition."""


def killed_in_a_save(rank: int, world: int, directory: str, layout: str, victim: int, write: str) -> None:
    """Saves at step 2, trains to step 4 and saves again, the victim rank killed at ``write`` of that save;
    writes each rank's parameters at both steps first."""
    out = Path(directory)
    root = out / "checkpoints"
    backend = build(layout, out)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        for _ in range(SYNC_INTERVAL):
            one_step(backend, (tokens[:, :-1], tokens[:, 1:]))
        torch.save(parameters(backend), out / f"expected_{rank}_step{backend.ensemble.global_step}.pt")
        injector = Injector(root)
        if backend.ensemble.global_step == 2 * SYNC_INTERVAL and rank == victim:
            injector.kill_at = write
            injector.install()
        backend.save(root, {}, run_identity(layout))
    raise AssertionError(f"rank {victim} was not killed at {write}")


def run_identity(layout: str) -> dict:
    engine, stage = LAYOUTS[layout]
    return identity(engine=engine, zero_stage=stage, model={"preset": "tiny"},
                    replicas=2, ranks_per_replica=2, explored=[], optimizer={"peak_lr": 1e-3, "weight_decay": 0.0},
                    settings={})


def resumed_after_a_kill(rank: int, world: int, directory: str, layout: str) -> int:
    """What --resume does: the newest complete checkpoint, settled, loaded; it must hold the saved model."""
    out = Path(directory)
    point = check_resume(out, run_identity(layout))
    dist.barrier()
    on_rank0(lambda: settle_interrupted_save(out), "settling")
    backend = build(layout, out / "fresh")
    backend.load(checkpoint_dir(out))
    expected = torch.load(out / f"expected_{rank}_step{point.step}.pt")
    assert torch.equal(parameters(backend), expected)
    return point.step


@pytest.mark.parametrize(("layout", "victim", "write"), [(layout, *kill) for layout, kills in KILLS.items()
                                                          for kill in kills])
def test_a_rank_killed_in_a_save_leaves_a_checkpoint_that_resumes(tmp_path, layout, victim, write):
    """SIGKILL of one rank at a write of the second save (the others die with the job): the newest complete
    checkpoint is found, nothing complete was deleted, and it loads the model it saved. Killed between FSDP2's
    two renames, or before DeepSpeed's 'latest' named the new checkpoint, that one is complete and is resumed."""
    with pytest.raises(AssertionError, match="distributed run failed") as killed:  # gloo tells the others at once
        run_ranks(killed_in_a_save, 4, str(tmp_path), layout, victim, write, timeout=300)
    assert "was not killed" not in str(killed.value)
    steps = run_ranks(resumed_after_a_kill, 4, str(tmp_path), layout, timeout=300)
    newer = (layout, write) in (("fsdp", "rename latest.tmp"), ("zero2", "replace latest.tmp"))
    assert steps == [2 * SYNC_INTERVAL if newer else SYNC_INTERVAL] * 4
