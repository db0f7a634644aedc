"""Atomic checkpoints: a crash while saving never corrupts the last good checkpoint.

A checkpoint is a directory ``step_000012/`` under the checkpoint root. It is written in full under a
temporary name, marked complete, then renamed into place (``os.replace`` is atomic on one filesystem);
the ``latest`` pointer is replaced the same way. Readers only ever see complete checkpoints.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

_MARK = "COMPLETE"


def _name(step: int) -> str:
    return f"step_{step:06d}"


def save_checkpoint(root: str | Path, step: int, write: Callable[[Path], None], max_num: int = 3) -> Path:
    """Call ``write(directory)`` to fill a new checkpoint for ``step``; publish it atomically."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{_name(step)}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write(tmp)
    (tmp / _MARK).write_text(str(step))
    final = root / _name(step)
    if final.exists():  # re-saving a step (e.g. after a resume): move the old one aside first
        stale = root / f".{_name(step)}.stale"
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(final, stale)
        os.replace(tmp, final)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.replace(tmp, final)
    pointer = root / ".latest.partial"
    pointer.write_text(final.name)
    os.replace(pointer, root / "latest")
    _prune(root, keep=max(1, max_num))
    return final


def _complete(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step_*") if (p / _MARK).is_file())


def _prune(root: Path, keep: int) -> None:
    for old in _complete(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    pointer = root / "latest"
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / _MARK).is_file():
            return candidate
    complete = _complete(root)
    return complete[-1] if complete else None


def checkpoint_step(path: str | Path) -> int:
    return int((Path(path) / _MARK).read_text())
