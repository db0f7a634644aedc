"""Atomic, durable file writes: a crash or a power loss leaves the old file or the new one, never a torn one.

A file is written under a temporary name beside its target, fsynced, renamed over the target (``os.replace`` is
atomic on one filesystem), and the directory is fsynced, so the rename cannot reach the disk before the bytes it
names. Without the first fsync, a filesystem with delayed allocation (ext4, xfs) may commit the rename first and
leave an empty file after a power loss; without the second, the rename itself may be lost.

Used for everything a run resumes from or a reader trusts: checkpoints (``selfplay.checkpoint``), the local
engine's state, adapter files, ``run_meta.json``, ``config.yaml``, and the evaluation store's files.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def fsync_file(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Make the directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: str | Path) -> None:
    """fsync every file under ``directory``, then every directory in it, deepest first."""
    for dirpath, _dirnames, filenames in os.walk(directory, topdown=False):
        for name in filenames:
            path = Path(dirpath) / name
            if not path.is_symlink():
                fsync_file(path)
        fsync_dir(dirpath)


def replace_file(target: str | Path, write: Callable[[Path], None]) -> None:
    """Call ``write(path)`` to fill a temporary file beside ``target`` (``.<name>.tmp``: one name per target, so
    what a killed process leaves is overwritten by the next write, and created by ``write`` with the usual
    permissions), then fsync it, rename it over ``target`` and fsync the directory. If ``write`` raises, the
    temporary file is removed and ``target`` is untouched. One writer per target at a time (the callers hold
    the run's or the store's lock)."""
    target = Path(target)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        write(tmp)
        fsync_file(tmp)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(target.parent)


def replace_text(target: str | Path, text: str) -> None:
    """``replace_file`` for a text file (UTF-8)."""
    replace_file(target, lambda path: path.write_text(text, encoding="utf-8"))
