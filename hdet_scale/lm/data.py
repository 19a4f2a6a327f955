"""The embedded default corpus: the CPython standard library's source, read as bytes (no download)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

_SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    """Where the standard library's source is."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The standard library's .py files, test suites and installed packages excluded, in a stable order."""
    root = stdlib_root()
    files = [path for path in root.rglob("*.py")
             if not _SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1])]
    if not files:
        raise FileNotFoundError(f"no Python sources under {root}: the embedded corpus needs the stdlib source")
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def byte_tokens(data: bytes) -> torch.Tensor:
    """``data`` as a uint8 tensor of byte tokens (a copy: the tensor owns writable memory)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def random_windows(tokens: torch.Tensor, *, batch_size: int, seq_len: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of (input, next-token target) windows at random offsets drawn from ``generator``."""
    if len(tokens) < seq_len + 2:
        raise ValueError(f"corpus of {len(tokens)} tokens is too short for windows of {seq_len} + 1 tokens")
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=generator)
    windows = torch.stack([tokens[s: s + seq_len + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]
