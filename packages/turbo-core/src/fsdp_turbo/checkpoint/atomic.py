"""Publishing a folder atomically: flush it to disk, then rename it into place, never
deleting what it replaces before the new one is there. Used by ``save_pretrained``, the
command's training checkpoints and its data cache."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a folder's list of entries, to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(folder: Path, *, files: bool = True) -> None:
    """Flush ``folder``'s files (all of them, whoever wrote them) and the folder's own entry list."""
    if files:
        for path in folder.rglob("*"):
            if path.is_file():
                fsync_path(path)
    fsync_path(folder)


def move_into_place(partial: Path, target: Path) -> None:
    """Rename ``partial`` to ``target``. An existing ``target`` is moved aside first and
    deleted only once the new one is in place; the parent's entries are flushed."""
    aside = target.with_name(f"{target.name}.old")
    if target.exists():
        shutil.rmtree(aside, ignore_errors=True)
        target.rename(aside)
    os.replace(partial, target)
    fsync_path(target.parent)
    shutil.rmtree(aside, ignore_errors=True)
