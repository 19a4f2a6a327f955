"""Files on the disk before a checkpoint says it is complete: a node that crashes (power, kernel) loses what the
page cache held, so a manifest or a rename that reached the disk before the data it vouches for would name files
that came back truncated, after the previous checkpoint was deleted."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
import uuid
from pathlib import Path

from hdet_scale.notices import warn


def fsync_path(path: Path) -> None:
    """Flushes the file ``path``, or the entries of the folder ``path`` (a rename in it), to the disk. A file
    system that cannot flush a folder (CIFS, some FUSE mounts: EINVAL) keeps its renames as it does."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    except OSError as error:
        if not (error.errno == errno.EINVAL and path.is_dir()):
            raise
    finally:
        os.close(descriptor)


def fsync_tree(path: Path) -> None:
    """Flushes every file under the folder ``path``, and the folders' entries."""
    for folder, _, files in os.walk(path):
        for name in files:
            fsync_path(Path(folder) / name)
        fsync_path(Path(folder))


def replace_durably(source: Path, target: Path) -> None:
    """``source.replace(target)`` once the file ``source`` is on the disk, then the rename too."""
    fsync_path(source)
    source.replace(target)
    fsync_path(target.parent)


def write_text_durably(target: Path, text: str) -> None:
    """Replaces the file ``target`` with one holding ``text`` (written beside it as ``<name>.tmp``), on the disk when
    it returns: a crash leaves the old file or the new one, never a part."""
    staging = target.with_name(target.name + ".tmp")
    staging.write_text(text)
    replace_durably(staging, target)


def replacement_folders(target: Path) -> tuple[Path, Path]:
    """Where the next version of the folder ``target`` is written (``target.tmp``), and where the one it replaces
    waits while ``replace_folder_durably`` puts it in place (``target.old``)."""
    return target.with_name(target.name + ".tmp"), target.with_name(target.name + ".old")


def clear_folder(folder: Path) -> None:
    """Removes ``folder`` so that its name is free. Where the file system refuses to delete something in it (a
    file another NFS client holds open, say), the folder moves aside to ``<name>.undeleted-<time>`` and a warning
    says to remove it by hand: left at its name, it would stop every later save that needs the name."""
    shutil.rmtree(folder, ignore_errors=True)
    if not (folder.exists() or folder.is_symlink()):
        return
    aside = folder.with_name(f"{folder.name}.undeleted-{time.time_ns()}")
    folder.rename(aside)
    warn(f"could not remove {folder}; moved it to {aside}, which no run uses: remove it by hand")


def replace_folder_durably(staging: Path, target: Path) -> None:
    """Puts the complete folder ``staging`` (its files on the disk already) at ``target``, replacing the folder
    there: ``target`` moves to ``target.old``, ``staging`` to ``target``, then the old one goes. A kill at any
    moment leaves a complete folder: ``target``, or ``target.old`` with ``staging`` beside it."""
    retired = replacement_folders(target)[1]
    fsync_path(staging)  # its own entries too (a file added last, say), before it vouches for them as ``target``
    clear_folder(retired)  # older than ``target``, which is complete
    if target.exists():
        target.rename(retired)
    staging.rename(target)
    fsync_path(target.parent)
    try:
        clear_folder(retired)
    except OSError as error:  # the new folder is in place: the replacement did not fail
        warn(f"{target} is in place, but the folder it replaced could not be removed or moved aside ({error}): "
             f"remove {retired} by hand before the next save there")


def recover_replaced_folder(target: Path) -> bool:
    """Undoes what a kill between ``replace_folder_durably``'s two renames left: no ``target``, and ``target.old``
    beside the complete ``target.tmp`` (the renames start only once it is complete) is put in its place, else
    ``target.old``; a ``target.old`` left beside a ``target`` goes. A ``target.tmp`` alone is a write that did not
    finish and is let be. Returns whether ``target`` is there. Call it before writing ``target.tmp`` anew."""
    staging, retired = replacement_folders(target)
    if retired.exists():
        if not target.exists():
            (staging if staging.exists() else retired).rename(target)
            fsync_path(target.parent)
        clear_folder(retired)
    return target.exists()


def start_replacement(target: Path) -> None:
    """Readies ``target.tmp`` for the next version of the folder ``target``: a complete version a kill between
    the two renames left is put in place first (``recover_replaced_folder``), then what an unfinished write left
    at ``target.tmp`` goes."""
    recover_replaced_folder(target)
    clear_folder(replacement_folders(target)[0])


FOLDER_TOKEN = ".made_for_this_save"
"""The file ``start_fresh_folder`` marks a staging folder with: a token, new for every save."""


def start_fresh_folder(folder: Path) -> str:
    """Makes the folder ``folder`` (its name free) and marks it with a new token, on the disk; returns the token, for
    every node to check with ``see_fresh_folder`` before it writes there."""
    folder.mkdir(parents=True)
    token = uuid.uuid4().hex
    write_text_durably(folder / FOLDER_TOKEN, token)
    fsync_path(folder.parent)
    return token


def see_fresh_folder(folder: Path, token: str, *, patience_s: float = 90.0) -> None:
    """Waits until this node's view of ``folder`` is the one ``start_fresh_folder`` made (``token``): for a while
    after a rename (its attribute cache's time, up to a minute by default) a network file system may show another
    node the folder the name had before (the previous save's staging, renamed into the checkpoint), and the files
    written through it would go into the live checkpoint. An OSError once ``patience_s`` passed."""
    waited, pause = 0.0, 0.5
    while True:
        try:
            if (folder / FOLDER_TOKEN).read_text() == token:
                return
        except OSError:
            pass
        if waited >= patience_s:
            raise OSError(f"{folder} is not, on this node, the folder just made there for this save, after "
                          f"{waited:.0f} s (a network file system's stale view of a folder renamed since): mount it "
                          "with lookupcache=none, or checkpoint to a file system every node sees at once (Lustre, "
                          "GPFS)")
        time.sleep(pause)
        waited += pause
        pause = min(2 * pause, 8.0)
        with contextlib.suppress(OSError):
            os.listdir(folder.parent)  # look the names up again
