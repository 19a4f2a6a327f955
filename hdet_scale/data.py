"""The embedded default corpus: the CPython standard library's source, read as bytes (no download)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

_SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_files() -> list[Path]:
    """The standard library's .py files, test suites and installed packages excluded, in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [path for path in root.rglob("*.py")
             if not _SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1])]
    if not files:
        raise FileNotFoundError(f"no Python sources under {root}: the embedded corpus needs the stdlib source")
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def stdlib_corpus(max_bytes: int | None = None) -> torch.Tensor:
    """The corpus as a uint8 tensor of byte tokens (vocabulary 256)."""
    chunks, total = [], 0
    for path in stdlib_files():
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    corpus = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(corpus), dtype=torch.uint8)


def split_holdout(tokens: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out): the held-out part is the corpus' last ``fraction``."""
    cut = int(len(tokens) * (1.0 - fraction))
    return tokens[:cut], tokens[cut:]


def random_windows(tokens: torch.Tensor, *, batch_size: int, seq_len: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of (input, next-token target) windows at random offsets drawn from ``generator``."""
    if len(tokens) < seq_len + 2:
        raise ValueError(f"corpus of {len(tokens)} tokens is too short for windows of {seq_len} + 1 tokens")
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=generator)
    windows = torch.stack([tokens[s: s + seq_len + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]
