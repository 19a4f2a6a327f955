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


@pytest.mark.parametrize(("left", "kept"), [
    ({"ckpt.old": "older", "ckpt.tmp": "newer"}, "newer"),  # killed between the renames: the newer, complete
    ({"ckpt.old": "older"}, "older"),                       # (the staging folder lost by hand)
    ({"ckpt": "newer", "ckpt.old": "older"}, "newer"),      # killed before the older one was removed
    ({"ckpt": "older", "ckpt.tmp": "partial"}, "older"),    # killed while writing: the staging folder is let be
    ({"ckpt.tmp": "partial"}, None),                        # a first save killed while writing: no checkpoint
])
def test_a_kill_between_the_renames_leaves_the_newer_folder_in_place(tmp_path, left, kept):
    for name, content in left.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "which").write_text(content)
    assert durable.recover_replaced_folder(tmp_path / "ckpt") == (kept is not None)
    if kept is not None:
        assert (tmp_path / "ckpt" / "which").read_text() == kept
    assert not (tmp_path / "ckpt.old").exists()
    assert (tmp_path / "ckpt.tmp").exists() == (left.get("ckpt.tmp") == "partial")
