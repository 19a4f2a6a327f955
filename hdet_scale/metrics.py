"""What a sync reports (``SyncReport``), written as one JSON line per sync by global rank 0."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hdet_scale.notices import warn


def writable_directory(path: str | os.PathLike[str], argument: str) -> Path:
    """``path``, checked to be a directory this process can create or write to, creating nothing; a ValueError
    naming ``argument`` otherwise (a path under a regular file, no permission), so a bad output path stops a run
    in one line before any work."""
    directory = Path(path)
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{argument} {directory}: cannot create it ({existing} is not a directory); choose "
                         "another directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{argument} {directory}: {existing} is not writable; choose another directory")
    return directory


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float as its text ("nan", "inf"): JSON has no NaN or infinity, and strict
    readers (jq, JavaScript) refuse the bare ``NaN`` Python's ``json`` would write."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them readable instead of invalid
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


class MetricsWriter:
    """Appends records to a JSON-lines file; a no-op when ``path`` is None or this is not rank 0.

    A write that fails (a full disk or quota, a network file system's error) leaves the file as it was and keeps
    the lines for the next write, with one warning: it runs on rank 0 alone, in the middle of a sync, where raising
    would leave the other ranks waiting in the next collective until their timeout, with no checkpoint taken."""

    def __init__(self, path: str | None, *, is_writer: bool) -> None:
        self.path = Path(path) if path and is_writer else None
        self._line_ended = False  # whether what the file held before this writer's first line ends in a newline
        self._pending: list[str] = []  # lines a failed write kept
        self._warned = False
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        self._pending.append(json.dumps(json_safe(record)) + "\n")
        try:
            self._append("".join(self._pending).encode())
        except OSError as error:
            self._line_ended = False  # a part it left, if cutting it back failed too, gets a line of its own
            if not self._warned:
                warn(f"could not write {self.path} ({error}): its lines wait in memory for the next write; the run "
                     "goes on")
                self._warned = True
            return
        self._line_ended = True
        self._pending = []

    def _append(self, data: bytes) -> None:
        """Appends ``data`` whole or not at all (a write that fails part way is cut back), unbuffered, so that what
        failed is known here."""
        descriptor = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            size = os.fstat(descriptor).st_size
            try:
                # a run killed while writing its last line left part of it
                if not self._line_ended and size and os.pread(descriptor, 1, size - 1) != b"\n":
                    data = b"\n" + data
                view = memoryview(data)
                while view:
                    view = view[os.write(descriptor, view):]
            except OSError:
                with contextlib.suppress(OSError):  # a part left all the same: the next write starts a new line
                    os.ftruncate(descriptor, size)
                raise
        finally:
            os.close(descriptor)


@dataclass
class SyncReport:
    """What one sync did; also the metrics line (``as_record``)."""

    step: int
    replica_losses: list[float | None]
    probe_losses: list[float] | None
    excluded_replicas: list[int]
    weights: list[float] | None
    controller_updated: bool
    values: dict[str, dict[str, Any]]
    sync_seconds: float
    bytes_averaged: int
    bytes_gathered: int

    def as_record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def scalars(self) -> dict[str, float]:
        """This sync as named scalars for loggers (TensorBoard, W&B, Lightning's), all under ``hdet/`` (beside a
        training loop's own ``train/loss``): the replicas' mean interval loss and each replica's, and per explored
        value (``lr/0``, ``weight_decay/0``, ...) its base, the controller's scale after the sync, and each replica's
        value at the interval's last step."""
        losses = [loss for loss in self.replica_losses if loss is not None and math.isfinite(loss)]
        scalars = {"hdet/loss": sum(losses) / len(losses) if losses else math.nan}
        for replica, loss in enumerate(self.replica_losses):
            if loss is not None and math.isfinite(loss):  # an excluded replica has no loss to show
                scalars[f"hdet/replica_{replica}_loss"] = loss
        for name, value in self.values.items():
            scalars[f"hdet/{name}/base"] = value["base"]
            scalars[f"hdet/{name}/scale"] = value["scale"]
            for replica, replica_value in enumerate(value["replica_values"]):
                scalars[f"hdet/{name}/replica_{replica}"] = replica_value
        return scalars
