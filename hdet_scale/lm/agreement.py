"""Work every rank does where any rank may fail (a checkpoint's save or load, a file rank 0 writes): every rank
learns whether any failed, so they stop together in one line instead of waiting for a timeout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from hdet_scale.comm import failed_rank, one_line


class RunFailed(RuntimeError):
    """A failure every rank agreed on (a checkpoint that did not load or save); rank 0 prints it in one line."""


def agreed(action: str, work: Callable[[], Any]) -> Any:
    """``work()`` on every rank, then every rank learns whether any failed (collective); raises ``RunFailed``
    with the first failing rank's cause on all of them, so they stop together, none left waiting."""
    try:
        result, failure = work(), None
    except (Exception, CheckpointException) as error:  # any cause: one line, not a traceback per rank
        result, failure = None, (failed_rank(error, dist.get_rank()), one_line(error))
    failures: list[tuple[int, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    first = next((found for found in failures if found is not None), None)
    if first is not None:
        raise RunFailed(f"{action}: {first[1]} (rank {first[0]})")
    return result
