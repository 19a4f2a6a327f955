"""Imports a script from benchmarks/ for its tests (it is a script folder, not a package)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1]


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as module ``name``, with benchmarks/ importable as its scripts expect (they
    import each other by plain name, so each module is loaded once and shared)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    module = importlib.import_module(name)
    if Path(module.__file__).resolve().parent != BENCHMARKS:
        raise ImportError(f"module {name!r} comes from {module.__file__}, not from {BENCHMARKS}")
    return module
