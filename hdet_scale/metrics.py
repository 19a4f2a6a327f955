"""One JSON line per sync, written by global rank 0."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them readable instead of invalid
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


class MetricsWriter:
    """Appends records to a JSON-lines file; a no-op when ``path`` is None or this is not rank 0."""

    def __init__(self, path: str | None, *, is_writer: bool) -> None:
        self.path = Path(path) if path and is_writer else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        with self.path.open("a") as handle:
            handle.write(json.dumps(_json_safe(record)) + "\n")
