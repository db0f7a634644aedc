"""Durable, atomic checkpoints: a crash or a power loss while saving never loses the last good checkpoint.

A checkpoint is a directory ``step_000012/`` under the checkpoint root. It is written in full under a
temporary name, marked complete, and every file and directory in it is fsynced; only then is it renamed into
place (``os.replace`` is atomic on one filesystem) and the root fsynced, so the rename cannot reach the disk
before the data it names. The ``latest`` pointer is replaced the same way. Older checkpoints are pruned only
after all of that, so the previous one is kept until the new one is durable. Readers only ever see complete
checkpoints.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from openrlhf_populora.durable import fsync_dir, fsync_tree, replace_text

_MARK = "COMPLETE"


def _name(step: int) -> str:
    return f"step_{step:06d}"


def save_checkpoint(root: str | Path, step: int, write: Callable[[Path], None], max_num: int = 3,
                    keep_every: int = 0) -> Path:
    """Call ``write(directory)`` to fill a new checkpoint for ``step``; publish it atomically and durably, then
    prune all but the ``max_num`` newest (and, with ``keep_every`` > 0, every checkpoint of a step that is a
    multiple of it)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{_name(step)}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write(tmp)
    (tmp / _MARK).write_text(str(step))
    fsync_tree(tmp)  # every byte of the new checkpoint is on disk before anything names it
    final = root / _name(step)
    stale = root / f".{_name(step)}.stale"
    if final.exists():  # re-saving a step: move the old one aside first (latest_checkpoint still finds it there)
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(final, stale)
    os.replace(tmp, final)
    fsync_dir(root)
    replace_text(root / "latest", final.name)
    # the new checkpoint is durable: only now may older ones go
    shutil.rmtree(stale, ignore_errors=True)
    _prune(root, keep=max(1, max_num), keep_every=keep_every)
    return final


def _is_complete(path: Path) -> bool:
    return (path / _MARK).is_file()


def _complete(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step_*") if _is_complete(p))


def _prune(root: Path, keep: int, keep_every: int = 0) -> None:
    for old in _complete(root)[:-keep]:
        if keep_every > 0 and checkpoint_step(old) % keep_every == 0:
            continue
        shutil.rmtree(old, ignore_errors=True)
    for leftover in [*root.glob(".step_*.partial"), *root.glob(".step_*.stale")]:  # from a crash in a save
        shutil.rmtree(leftover, ignore_errors=True)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    pointer = root / "latest"
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if _is_complete(candidate):
            return candidate
    # no pointer, or it names a checkpoint a crash left unpublished: the newest complete one, counting one a
    # re-save of its step had moved aside
    complete = _complete(root) + [p for p in root.glob(".step_*.stale") if _is_complete(p)]
    return max(complete, key=checkpoint_step) if complete else None


def checkpoint_step(path: str | Path) -> int:
    return int((Path(path) / _MARK).read_text())
