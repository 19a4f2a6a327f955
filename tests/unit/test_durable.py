"""Flushing checkpoint files to the disk (hdet_scale/durable.py): a file system that cannot flush a folder keeps
a save working; a file that cannot be flushed stops it. The order of the flushes in a real save is checked in
tests/distributed/test_save_faults.py."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest

from hdet_scale import durable
from hdet_scale.durable import FOLDER_TOKEN, see_fresh_folder, start_fresh_folder


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


def refuse_to_delete(monkeypatch, name: str) -> None:
    """The file system refuses to delete the folder ``name`` (a file in it another NFS client holds open)."""
    rmtree = durable.shutil.rmtree

    def refusing(path, ignore_errors=False, **kwargs):
        if os.path.basename(path) == name:
            if ignore_errors:
                return
            raise OSError(errno.EBUSY, "Device or resource busy", str(path))
        rmtree(path, ignore_errors=ignore_errors, **kwargs)

    monkeypatch.setattr(durable.shutil, "rmtree", refusing)


def test_a_retired_folder_that_cannot_be_deleted_moves_aside_and_the_save_goes_on(tmp_path, monkeypatch):
    """A ckpt.old the file system would not delete stayed at its name: the next save's rename of ckpt onto it failed
    (directory not empty), and so did every later save, and the resume's own tidying."""
    for name, content in {"ckpt": "current", "ckpt.old": "stuck", "ckpt.tmp": "newer"}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "which").write_text(content)
    refuse_to_delete(monkeypatch, "ckpt.old")
    with pytest.warns(UserWarning, match=r"could not remove .*ckpt\.old; moved it to .*ckpt\.old\.undeleted-\d+"):
        durable.replace_folder_durably(tmp_path / "ckpt.tmp", tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "which").read_text() == "newer"
    aside = sorted(path.name for path in tmp_path.iterdir() if ".undeleted-" in path.name)
    assert len(aside) == 2  # the stuck one, and then the checkpoint it replaced (the same refusal)
    assert sorted({(tmp_path / name / "which").read_text() for name in aside}) == ["current", "stuck"]
    assert not (tmp_path / "ckpt.old").exists() and not (tmp_path / "ckpt.tmp").exists()


def test_a_staging_folder_that_cannot_be_deleted_moves_aside_before_a_save_writes_there(tmp_path, monkeypatch):
    (tmp_path / "ckpt.tmp").mkdir()
    (tmp_path / "ckpt.tmp" / "partial").write_text("x")
    refuse_to_delete(monkeypatch, "ckpt.tmp")
    with pytest.warns(UserWarning, match="could not remove"):
        durable.start_replacement(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt.tmp").exists()  # a save writes its files into an empty staging folder


def test_a_folder_is_flushed_before_it_replaces_the_one_it_retires(tmp_path, monkeypatch):
    """The staging folder's own entries (a file added to it last) were never flushed: a power loss could bring back
    the new checkpoint without some of its files after the old one was deleted."""
    events = []
    flush = durable.fsync_path
    monkeypatch.setattr(durable, "fsync_path", lambda path: events.append(("flush", path)) or flush(path))
    rename = type(tmp_path).rename
    monkeypatch.setattr(type(tmp_path), "rename", lambda self, to: events.append(("rename", self)) or rename(self, to))
    target, staging = tmp_path / "ckpt", tmp_path / "ckpt.tmp"
    target.mkdir()
    staging.mkdir()
    (staging / "state.pt").write_bytes(b"new")
    durable.replace_folder_durably(staging, target)
    assert events.index(("flush", staging)) < events.index(("rename", target)) < events.index(("rename", staging))
    assert (target / "state.pt").read_bytes() == b"new"


def test_a_retired_folder_that_can_be_neither_deleted_nor_moved_leaves_the_replacement_done(tmp_path, monkeypatch):
    """Once the new folder was in place, the retired one's removal failing (nor could it move aside) raised: a train.py
    save reported as failed, and the run ended, with its new checkpoint complete and in place."""
    for name, content in {"ckpt": "current", "ckpt.tmp": "newer"}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "which").write_text(content)
    refuse_to_delete(monkeypatch, "ckpt.old")
    rename = type(tmp_path).rename

    def refusing_to_move_aside(self, to):
        if ".undeleted-" in str(to):
            raise OSError(errno.EACCES, "Permission denied", str(self))
        return rename(self, to)

    monkeypatch.setattr(type(tmp_path), "rename", refusing_to_move_aside)
    with pytest.warns(UserWarning, match=r"ckpt is in place, but the folder it replaced could not be removed .*: "
                                         r"remove .*ckpt\.old by hand before the next save there"):
        durable.replace_folder_durably(tmp_path / "ckpt.tmp", tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "which").read_text() == "newer"


def test_a_node_writes_into_the_staging_folder_only_once_it_sees_this_saves(tmp_path):
    """Every save stages under one name: a network file system may show a node, for a while after a rename, the
    folder the name had before (the last save's staging, now the checkpoint), and its files would go there."""
    staging = tmp_path / "latest.tmp"
    token = start_fresh_folder(staging)
    see_fresh_folder(staging, token)  # this node sees it
    checkpoint = tmp_path / "latest"
    staging.rename(checkpoint)
    stale = start_fresh_folder(tmp_path / "stale")  # what a stale view shows: a folder of another save's token
    (tmp_path / "stale").rename(staging)
    with pytest.raises(OSError, match=r"latest.tmp is not, on this node, the folder just made there for this save, "
                                      r"after \d+ s \(a network file system's stale view"):
        see_fresh_folder(staging, token, patience_s=1.0)
    assert stale != token

    def view_turns_fresh() -> None:
        time.sleep(0.7)
        (staging / FOLDER_TOKEN).write_text(token)  # the node's cache runs out: it sees the new folder

    thread = threading.Thread(target=view_turns_fresh)
    thread.start()
    see_fresh_folder(staging, token, patience_s=10.0)
    thread.join()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_missing_a_shard_dcp_wrote_is_not_put_in_place(tmp_path):
    """A rank's shard written elsewhere (a stale view of the staging folder): the manifest listed what rank 0 saw,
    and the checkpoint, complete to every check, could not be loaded."""
    import torch
    import torch.distributed.checkpoint as dcp

    from hdet_scale.engines.fsdp_checkpoint import _check_shards

    dcp.save({"weight": torch.arange(6.0)}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    _check_shards(tmp_path / "ckpt")
    shard = next((tmp_path / "ckpt").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(OSError, match=rf"lacks {shard.name} \(or holds less of it than was written\)"):
        _check_shards(tmp_path / "ckpt")
    shard.unlink()
    with pytest.raises(OSError, match=rf"the checkpoint .*ckpt lacks {shard.name}"):
        _check_shards(tmp_path / "ckpt")
