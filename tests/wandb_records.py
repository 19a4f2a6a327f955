"""Reads a Weights & Biases run file (``run-<id>.wandb``, what offline mode writes) back, for tests.

wandb >= 0.30 writes it from its Go core and ships no Python reader. The file is a LevelDB-style log: the
header ``:W&B`` with 3 more bytes, then 32 KiB blocks of chunks (4-byte checksum, 2-byte little-endian length,
1-byte type: 1 whole, 2 first, 3 middle, 4 last part of a record), each record a ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

BLOCK, HEADER, CHUNK_HEADER = 32768, 7, 7


def records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    position, pending = HEADER, b""
    while position + CHUNK_HEADER <= len(data):
        left_in_block = BLOCK - position % BLOCK
        length, kind = int.from_bytes(data[position + 4:position + 6], "little"), data[position + 6]
        if left_in_block < CHUNK_HEADER or kind == 0:  # the block's zero padding
            position += left_in_block
            continue
        pending += data[position + CHUNK_HEADER:position + CHUNK_HEADER + length]
        position += CHUNK_HEADER + length
        if kind in (1, 4):
            yield pending
            pending = b""


def history(path: Path) -> list[dict]:
    """The rows ``run.log`` wrote, in order, each with its ``_step``."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for data in records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
