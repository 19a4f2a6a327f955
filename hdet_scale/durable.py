"""Files on the disk before a checkpoint says it is complete: a node that crashes (power, kernel) loses what the
page cache held, so a manifest or a rename that reached the disk before the data it vouches for would name files
that came back truncated, after the previous checkpoint was deleted."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path


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


def replacement_folders(target: Path) -> tuple[Path, Path]:
    """Where the next version of the folder ``target`` is written (``target.tmp``), and where the one it replaces
    waits while ``replace_folder_durably`` puts it in place (``target.old``)."""
    return target.with_name(target.name + ".tmp"), target.with_name(target.name + ".old")


def replace_folder_durably(staging: Path, target: Path) -> None:
    """Puts the complete folder ``staging`` (its files on the disk already) at ``target``, replacing the folder
    there: ``target`` moves to ``target.old``, ``staging`` to ``target``, then the old one goes. A kill at any
    moment leaves a complete folder: ``target``, or ``target.old`` with ``staging`` beside it."""
    retired = replacement_folders(target)[1]
    shutil.rmtree(retired, ignore_errors=True)  # older than ``target``, which is complete
    if target.exists():
        target.rename(retired)
    staging.rename(target)
    fsync_path(target.parent)
    shutil.rmtree(retired, ignore_errors=True)


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
        shutil.rmtree(retired, ignore_errors=True)
    return target.exists()


def start_replacement(target: Path) -> None:
    """Readies ``target.tmp`` for the next version of the folder ``target``: a complete version a kill between
    the two renames left is put in place first (``recover_replaced_folder``), then what an unfinished write left
    at ``target.tmp`` goes."""
    recover_replaced_folder(target)
    shutil.rmtree(replacement_folders(target)[0], ignore_errors=True)
