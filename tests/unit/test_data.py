import pytest
import torch

from hdet_scale.lm.corpus import load_corpus
from hdet_scale.lm.data import random_windows, stdlib_files


def test_corpus_is_the_stdlib_without_its_tests():
    files = stdlib_files()
    assert len(files) > 100 and all(path.suffix == ".py" for path in files)
    assert not any(part in {"test", "tests", "idle_test"} for path in files for part in path.parts[-3:-1])


def test_held_out_files_are_spread_and_disjoint():
    budget = 8_000_000
    corpus = load_corpus("stdlib", max_bytes=budget)
    assert len(corpus.train) + len(corpus.heldout) == budget and corpus.train.dtype == torch.uint8
    # built again from the files: every 20th file whole in the held-out part, the others in training, in order,
    # up to the budget (the last file read cut at it)
    parts: tuple[list[bytes], list[bytes]] = ([], [])
    left = budget
    for index, path in enumerate(stdlib_files()):
        if not left:
            break
        data = path.read_bytes()[:left]
        parts[index % 20 == 19].append(data)
        left -= len(data)
    assert len(parts[1]) >= 10  # spread: many files across the library, not one corner
    assert bytes(corpus.train.numpy()) == b"".join(parts[0]) and bytes(corpus.heldout.numpy()) == b"".join(parts[1])
    assert len(corpus.held_from) == len(parts[1]) and len(corpus.trained_to) == len(parts[0])


def test_windows_are_next_byte_targets():
    tokens = torch.arange(100, dtype=torch.uint8)
    inputs, targets = random_windows(tokens, batch_size=3, seq_len=10, generator=torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (3, 10)
    assert torch.equal(inputs[:, 1:], targets[:, :-1]) and torch.equal(targets - inputs, torch.ones(3, 10).long())
    with pytest.raises(ValueError, match="too short"):
        random_windows(tokens[:5], batch_size=1, seq_len=10, generator=torch.Generator())

