"""The model cache: where converted models live, and how a model gets there without ever being half-written.

A model directory is filled in a temporary sibling (``.<name>.<random>``), marked done, then renamed into
place, all under an exclusive file lock (``.<name>.lock``), so two processes converting at once do the work
once and neither ever sees a partial directory. A temporary sibling left by a killed process is removed by
the next conversion (under the same lock, so never while another process is writing it).

Cache directory: ``$POPULORA_CACHE_DIR`` (default ``~/.cache/openrlhf_populora``).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "POPULORA_CACHE_DIR"
DONE_MARKER = ".populora-converted"


def cache_dir() -> Path:
    """Where converted models live: ``$POPULORA_CACHE_DIR`` or ``~/.cache/openrlhf_populora``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "openrlhf_populora")


def is_published(target: Path) -> bool:
    return (target / DONE_MARKER).is_file()


def publish(target: Path, write: Callable[[Path], None], marker_text: str) -> Path:
    """``target`` filled by ``write(tmp_dir)``, atomically; returns at once if it is already there.

    ``write`` may raise (a failed check, Ctrl-C): the temporary directory is then removed and nothing
    appears at ``target``.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds the model published
        if is_published(target):
            return target
        for stale in target.parent.glob(f".{target.name}.*"):
            if stale.is_dir():  # left by a killed conversion: nobody else can be writing it (we hold the lock)
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
        try:
            write(tmp)
            (tmp / DONE_MARKER).write_text(marker_text)
            if target.exists():  # an unfinished directory from an older layout
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target
