"""Flushing checkpoint files to the disk (hdet_scale/durable.py): a file system that cannot flush a folder keeps
a save working; a file that cannot be flushed stops it. The order of the flushes in a real save is checked in
tests/distributed/test_save_faults.py."""

from __future__ import annotations

import errno
import os

import pytest

from hdet_scale import durable


def test_a_folder_the_file_system_cannot_flush_is_let_be_and_a_file_is_not(tmp_path, monkeypatch):
    (tmp_path / "shard").write_text("x")

    def cannot(descriptor: int) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")  # what CIFS and some FUSE mounts answer

    monkeypatch.setattr(os, "fsync", cannot)
    durable.fsync_path(tmp_path)
    with pytest.raises(OSError):
        durable.fsync_path(tmp_path / "shard")
    monkeypatch.setattr(os, "fsync", lambda descriptor: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(OSError, match="I/O error"):
        durable.fsync_path(tmp_path)
