import pytest
import torch

from hdet_scale.lm.data import random_windows, stdlib_corpus, stdlib_files


def test_corpus_is_the_stdlib_without_its_tests():
    files = stdlib_files()
    assert len(files) > 100 and all(path.suffix == ".py" for path in files)
    assert not any(part in {"test", "tests", "idle_test"} for path in files for part in path.parts[-3:-1])


def test_held_out_files_are_spread_and_disjoint():
    train, heldout = stdlib_corpus(1_000_000, holdout_every=4)
    assert len(train) + len(heldout) == 1_000_000 and train.dtype == torch.uint8
    # built again from the files: every fourth file whole in the held-out part, the others in training, in order,
    # up to the budget (the last file read cut at it)
    parts: tuple[list[bytes], list[bytes]] = ([], [])
    left = 1_000_000
    for index, path in enumerate(stdlib_files()):
        if not left:
            break
        data = path.read_bytes()[:left]
        parts[index % 4 == 3].append(data)
        left -= len(data)
    assert len(parts[1]) >= 10  # spread: many files across the library, not one corner
    assert bytes(train.numpy()) == b"".join(parts[0]) and bytes(heldout.numpy()) == b"".join(parts[1])
    with pytest.raises(ValueError, match="holdout_every must be >= 2"):
        stdlib_corpus(1000, holdout_every=1)


def test_windows_are_next_byte_targets():
    tokens = torch.arange(100, dtype=torch.uint8)
    inputs, targets = random_windows(tokens, batch_size=3, seq_len=10, generator=torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (3, 10)
    assert torch.equal(inputs[:, 1:], targets[:, :-1]) and torch.equal(targets - inputs, torch.ones(3, 10).long())
    with pytest.raises(ValueError, match="too short"):
        random_windows(tokens[:5], batch_size=1, seq_len=10, generator=torch.Generator())


def test_train_py_reads_the_embedded_corpus_as_stdlib_corpus_splits_it():
    """train.py reads it through the text-folder path (which names its files for the resume's held-out check):
    the same bytes, trained and held out, as ``stdlib_corpus`` (the demo's and the docs' split)."""
    from hdet_scale.lm.corpus import load_corpus

    for max_bytes in (1 << 20, 3 << 20):
        corpus, (train, heldout) = load_corpus("stdlib", max_bytes=max_bytes), stdlib_corpus(max_bytes)
        assert torch.equal(corpus.train, train) and torch.equal(corpus.heldout, heldout)
        assert len(corpus.held_from) == len(stdlib_files()[: len(corpus.trained_to) + len(corpus.held_from)]) // 20
