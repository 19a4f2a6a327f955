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
