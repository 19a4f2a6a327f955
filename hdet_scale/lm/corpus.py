"""Training corpora: the embedded standard-library source, a text file or a directory of them, or a token file.

Text is read as bytes (a 256-token vocabulary, no tokenizer to download). A pre-tokenized file is a flat
array of uint16 or uint32 token ids (nanoGPT's ``.bin`` layout), read through a memory map so a corpus larger
than memory costs nothing to open. Every source is checked when loaded, before any process group starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hdet_scale.lm.data import byte_tokens, stdlib_files, stdlib_root

BYTE_VOCAB = 256
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".csv", ".html", ".xml", ".tex"}
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
TOKEN_FILE_DEFAULTS = {"token_dtype": "uint16", "vocab_size": None, "heldout_fraction": 0.01}
"""The settings of a token file alone (``load_corpus``'s arguments, train.py's flags) and their defaults."""
HELDOUT_EVERY = 20  # text sources: every 20th file is held out whole
VOCAB_CHECK_TOKENS = 1 << 22  # token ids checked against the vocabulary when a token file is opened
VOCAB_CHECK_RUNS = 256  # in runs of contiguous tokens, spread evenly over the file
UINT32_CHECK_PAIRS = 64
"""The pairs of uint16 ids at the start of a token file that must all look like uint32 halves to refuse it."""
TEXT_CHECK_BYTES = 4096
"""The first bytes of a token file read to tell it from text."""
PRINTABLE_BYTES = frozenset(b"\t\n\r" + bytes(range(32, 127)))


@dataclass(frozen=True)
class Corpus:
    """Token ids for training and for the held-out loss, and the vocabulary they come from."""

    train: Any  # a 1-D torch tensor or numpy memmap of token ids
    heldout: Any
    vocab_size: int
    description: str
    more_train: str = "give more data"
    """How to get more training tokens out of this source, for an error that finds too few."""
    more_heldout: str = "give more data"
    """How to get more held-out tokens out of this source."""
    held_from: dict[str, int] = field(default_factory=dict)
    """For every file (``file_key``) held out, the byte it is held out from (0: the whole file), for a resumed run to
    check that it holds out nothing it trained on (``held_out_but_trained``)."""
    trained_to: dict[str, int] = field(default_factory=dict)
    """For every file trained on, the byte training reads it up to."""

    def check_fits(self, *, seq_len: int, micro_batch_size: int) -> None:
        """Raises when the corpus cannot fill one batch of ``micro_batch_size`` windows of ``seq_len + 1`` (and
        ``batch`` draws a window's start from before the last ``seq_len + 1`` tokens: one more)."""
        batch_tokens = micro_batch_size * (seq_len + 1)
        needed = max(batch_tokens, seq_len + 2)
        if len(self.train) < needed:
            at_least = "" if needed == batch_tokens else f" (at least {needed}: a window starts at random)"
            raise ValueError(f"{self.description}: {len(self.train)} training tokens are too few for one batch of "
                             f"{micro_batch_size} x {seq_len + 1} tokens{at_least}; {self.more_train}, or lower "
                             "--seq_len / --micro_batch_size")
        if len(self.heldout) < seq_len + 2:
            raise ValueError(f"{self.description}: {len(self.heldout)} held-out tokens are too few for one window of "
                             f"{seq_len + 1}; {self.more_heldout}, or lower --seq_len")


def reads_bytes(source: str) -> bool:
    """Whether ``source`` is text, read as bytes (``"stdlib"``, a directory or a text file): its vocabulary is
    ``BYTE_VOCAB``."""
    return source == "stdlib" or Path(source).is_dir() or _is_text_file(Path(source))


def _is_text_file(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in TEXT_SUFFIXES


def load_corpus(source: str, *, token_dtype: str = TOKEN_FILE_DEFAULTS["token_dtype"], vocab_size: int | None = None,
                heldout_fraction: float = TOKEN_FILE_DEFAULTS["heldout_fraction"],
                max_bytes: int | None = None) -> Corpus:
    """The corpus named by ``source``: ``"stdlib"``, a text file or a directory of them, or a token file.

    Args:
        source: ``"stdlib"`` (the embedded default), a text file (``TEXT_SUFFIXES``) or a directory (its text files),
            read as bytes, or a file of ``token_dtype`` token ids.
        token_dtype: ``"uint16"`` or ``"uint32"``, for token files.
        vocab_size: the tokenizer's vocabulary, required for token files (ids must be below it).
        heldout_fraction: token files: the share at the end held out for the held-out loss.
        max_bytes: read at most this many bytes (None: all); of a token file, its first ``max_bytes``, whose last
            ``heldout_fraction`` is held out.
    """
    if source == "stdlib":
        corpus = _text_files(stdlib_files(), stdlib_root(), max_bytes, keys="stdlib")
        more = _more_text(max_bytes, read=len(corpus.train) + len(corpus.heldout),
                          otherwise="give a directory of text files")
        return dataclasses.replace(corpus, description="the standard library's source (embedded)", more_train=more,
                                   more_heldout=more)
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"--data {source}: no such file or directory (use 'stdlib', a text file or a "
                                "directory of them, or a uint16/uint32 token file)")
    if path.is_dir():
        return _text_directory(path, max_bytes)
    if _is_text_file(path):
        return _text_files([path], path, max_bytes)
    return _token_file(path, token_dtype, vocab_size, heldout_fraction, max_bytes)


def _more_text(max_bytes: int | None, *, read: int, otherwise: str) -> str:
    """How to get more tokens from a text source that gave ``read`` bytes: a larger --max_data_mb where it stopped
    the reading, else ``otherwise``."""
    if max_bytes is not None and read >= max_bytes:
        return f"raise --max_data_mb (it stopped the reading at {max_bytes / 2**20:.3g} MiB)"
    return otherwise


def _text_directory(root: Path, max_bytes: int | None) -> Corpus:
    files = sorted(p for p in root.rglob("*") if _is_text_file(p))
    if not files:
        raise ValueError(f"--data {root}: no text files ({', '.join(sorted(TEXT_SUFFIXES))}) in the directory; "
                         "give a token file itself, not its directory")
    return _text_files(files, root, max_bytes)


def _text_files(files: list[Path], root: Path, max_bytes: int | None, *, keys: str | None = None) -> Corpus:
    """``files`` read as bytes: every ``HELDOUT_EVERY``-th held out whole, or one file's last tenth. ``keys``: the
    name the files' keys start with (``file_key``), ``root``'s own by default."""
    if len(files) == 1:  # nothing can be held out whole: the file's last tenth is held out instead
        data = files[0].read_bytes()[:max_bytes]
        cut = len(data) - len(data) // 10
        train, heldout, read = [data[:cut]], [data[cut:]], 1
        key = file_key(files[0], root, keys)
        held_from, trained_to = {key: cut}, {key: cut}
    else:
        held = set(range(HELDOUT_EVERY - 1, len(files), HELDOUT_EVERY)) or {len(files) - 1}
        train, heldout, total = [], [], 0
        held_from, trained_to = {}, {}
        for index, file in enumerate(files):
            if max_bytes is not None and total >= max_bytes:
                break
            data = file.read_bytes()[: None if max_bytes is None else max_bytes - total]
            (heldout if index in held else train).append(data)
            if index in held:
                held_from[file_key(file, root, keys)] = 0
            else:
                trained_to[file_key(file, root, keys)] = len(data)
            total += len(data)
        read = len(train) + len(heldout)
    if root.is_file():
        description = f"the text file {root}"
    elif read == len(files):
        description = f"{len(files)} text files in {root}"
    else:  # --max_data_mb stopped the reading
        description = f"the first {read} of {len(files)} text files in {root}"
    more = _more_text(max_bytes, read=sum(map(len, train)) + sum(map(len, heldout)), otherwise="give more text files")
    return Corpus(byte_tokens(b"".join(train)), byte_tokens(b"".join(heldout)), BYTE_VOCAB, description, more, more,
                  held_from=held_from, trained_to=trained_to)


def file_key(file: Path, root: Path, keys: str | None = None) -> str:
    """How the held-out split names ``file`` of the source ``root``: a file given itself by its name, a folder's (or
    the embedded corpus's) by its path in it after the folder's name (or ``keys``), so that a copy of the data
    elsewhere (a job's local disk) is still compared, where it keeps its name."""
    if file == root:
        return root.resolve().name
    return f"{keys or root.resolve().name}/{file.relative_to(root).as_posix()}"


def held_out_but_trained(held_from: dict[str, int], trained_before: dict[str, int]) -> str | None:
    """What of a corpus's held-out part (``Corpus.held_from``) runs before trained on (``trained_before``, the
    ``Corpus.trained_to`` of each, merged by ``trained_so_far``), in words; None where nothing."""
    trained = [(key, start, trained_before[key]) for key, start in sorted(held_from.items())
               if start < trained_before.get(key, 0)]
    if not trained:
        return None
    (key, start, end), more = trained[0], len(trained) - 1
    return (f"{key} is held out from byte {start:,} now, and the run trained on it up to byte {end:,}"
            + (f" ({more} more file(s) alike)" if more else ""))


def trained_so_far(trained_before: dict[str, int], trained_to: dict[str, int]) -> dict[str, int]:
    """How far every file was trained on by the runs before (``trained_before``) and this one (``trained_to``)."""
    return {**trained_before, **{key: max(end, trained_before.get(key, 0)) for key, end in trained_to.items()}}


def _token_file(path: Path, token_dtype: str, vocab_size: int | None, heldout_fraction: float,
                max_bytes: int | None) -> Corpus:
    if token_dtype not in TOKEN_DTYPES:
        raise ValueError(f"--token_dtype {token_dtype!r}: choose one of {', '.join(TOKEN_DTYPES)}")
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"--data {path}: the file is empty")
    with path.open("rb") as file:
        start = file.read(TEXT_CHECK_BYTES)
    if all(byte in PRINTABLE_BYTES for byte in start):  # token ids would hold bytes outside printable text
        raise ValueError(f"--data {path} reads as text, not as token ids: name it with a text suffix "
                         f"({', '.join(sorted(TEXT_SUFFIXES))}) to train on it as bytes, or give the token file")
    if vocab_size is None:
        raise ValueError(f"--data {path} is a token file: give its tokenizer's vocabulary with --vocab_size")
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"--heldout_fraction must be in (0, 1), got {heldout_fraction}")
    dtype = np.dtype(TOKEN_DTYPES[token_dtype])
    if dtype.itemsize == 2 and vocab_size > 2**16:
        raise ValueError(f"--vocab_size {vocab_size} has ids that {token_dtype} cannot hold (up to 65535): a token "
                         "file of that vocabulary is uint32 (--token_dtype uint32)")
    if size % dtype.itemsize:
        raise ValueError(f"--data {path}: {size} bytes is not a whole number of {token_dtype} tokens: the file is "
                         f"truncated or corrupt, or its token type is not {token_dtype} (--token_dtype)")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    described = f"{len(tokens):,} {token_dtype} tokens in {path}"
    more_train = "give a longer token file"
    if max_bytes is not None and max_bytes < size:
        tokens = tokens[: max_bytes // dtype.itemsize]
        described = f"the first {len(tokens):,} of {described}"  # --max_data_mb stopped the reading
        more_train = _more_text(max_bytes, read=max_bytes, otherwise=more_train)
        if not len(tokens):
            raise ValueError(f"--max_data_mb {max_bytes / 2**20:.3g} is less than one {token_dtype} token of "
                             f"--data {path}: raise it, or leave it out to read the whole file")
    # Checking every id of a multi-billion-token file would take minutes: evenly spread runs of tokens (the first
    # and the last among them) catch a wrong dtype, a wrong vocabulary or a file of another format, reading a few
    # MiB (single tokens at a stride would read a page of the file each).
    run = VOCAB_CHECK_TOKENS // VOCAB_CHECK_RUNS
    starts = np.linspace(0, max(0, len(tokens) - run), VOCAB_CHECK_RUNS).astype(np.int64)
    sample = np.concatenate([tokens[begin: begin + run] for begin in np.unique(starts)])
    highest = int(sample.max())
    if highest >= vocab_size:
        raise ValueError(f"--data {path}: token id {highest} is outside the vocabulary of {vocab_size} "
                         "(--vocab_size): the file is corrupt, or --token_dtype / --vocab_size are wrong")
    if dtype.itemsize == 2:
        _refuse_uint32_read_as_uint16(path, tokens[: VOCAB_CHECK_TOKENS // VOCAB_CHECK_RUNS])
    cut = len(tokens) - max(1, int(len(tokens) * heldout_fraction))
    split = {file_key(path, path): cut * dtype.itemsize}  # held out from the byte training reads it up to
    return Corpus(tokens[:cut], tokens[cut:], vocab_size, described, more_train=more_train,
                  more_heldout=f"raise --heldout_fraction (now {heldout_fraction:g})",
                  held_from=split, trained_to=dict(split))


def _refuse_uint32_read_as_uint16(path: Path, first: Any) -> None:
    """A ValueError where the file's first tokens, read as uint16, hold 0 at every odd place and something else
    at an even one: the low and high halves of uint32 ids below 65536 (little-endian), which as uint16 would train
    on every second token 0."""
    pairs = np.asarray(first[: len(first) - len(first) % 2]).reshape(-1, 2)
    if len(pairs) >= UINT32_CHECK_PAIRS and not pairs[:, 1].any() and pairs[:, 0].any():
        raise ValueError(f"--data {path} reads as uint32 token ids (as uint16 every second id is 0): pass "
                         "--token_dtype uint32")


def batch(tokens: Any, *, micro_batch_size: int, seq_len: int,
          generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, next-token targets) of ``micro_batch_size`` windows at random offsets drawn from ``generator``."""
    starts = torch.randint(0, len(tokens) - seq_len - 1, (micro_batch_size,), generator=generator).tolist()
    windows = torch.from_numpy(np.stack([np.asarray(tokens[s: s + seq_len + 1], dtype=np.int64) for s in starts]))
    return windows[:, :-1], windows[:, 1:]
