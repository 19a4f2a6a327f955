"""The optional extras (pyproject's ``[project.optional-dependencies]``): a feature whose package is missing says so
in one line, with the pip command that installs it, before any expensive work."""

from __future__ import annotations

import importlib.util


class MissingExtra(ImportError):
    """A feature's optional package is not installed."""


def require(module: str, extra: str, feature: str) -> None:
    """Raises ``MissingExtra`` naming ``feature`` and ``pip install 'hdet_scale[extra]'`` when ``module`` cannot
    be imported."""
    if importlib.util.find_spec(module) is None:
        raise MissingExtra(f"{feature} needs {module}, which is not installed: pip install 'hdet_scale[{extra}]'")
