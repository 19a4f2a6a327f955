"""Files on the disk before a checkpoint says it is complete: a node that crashes (power, kernel) loses what the
page cache held, so a manifest or a rename that reached the disk before the data it vouches for would name files
that came back truncated, after the previous checkpoint was deleted."""

from __future__ import annotations

import errno
import os
import shutil
import time
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
