"""HDET's warnings: one line each, under their own category, without a line of source code after them.

``warnings.warn`` prints the source line of the frame it blames, which for a library is a line of its own
internals or of the caller's set-up code, and says nothing the message does not. These warnings are attributed to
``hdet_scale`` itself, so they print as ``hdet_scale:0: HDETWarning: ...`` and can be filtered by category
(``warnings.filterwarnings("ignore", category=HDETWarning)``).
"""

from __future__ import annotations

import warnings


class HDETWarning(UserWarning):
    """A setting or situation HDET works around, and what to do about it."""


def warn(message: str) -> None:
    """Warns ``message`` as an ``HDETWarning`` attributed to hdet_scale, with no source line."""
    warnings.warn_explicit(message, HDETWarning, filename="hdet_scale", lineno=0, module="hdet_scale")


def no_replica_optimizer_warning(checkpoint: str, replica: int, restored_by: str) -> str:
    """The warning for a replica that owns its optimizer state resumed from ``checkpoint`` without it: the
    checkpoint was taken where the replicas' states were alike, or with fewer replicas."""
    return (f"{checkpoint} holds no optimizer state of replica {replica} (taken where the replicas' optimizer states "
            "were alike, as in global gradient mode or with average_optimizer_state, or with fewer replicas): the "
            f"replica goes on from replica 0's, as {restored_by} restored it")
