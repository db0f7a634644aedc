"""The local engine's resume point on disk: one ``engine_state.pt`` written atomically and durably (fsynced before
it replaces the old one), plus the engine's config as JSON beside it (for people; the run's ``config.yaml`` is what
resumes)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "engine_state.pt"


def write_state(path: str | Path, state: Mapping[str, Any], config: Mapping[str, Any]) -> None:
    """Write ``<path>/engine_state.pt`` atomically (a crash or power loss mid-write leaves the old file intact):
    the new file is fsynced before it replaces the old one, and the directory after."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".engine_state.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(dict(state), handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, out / STATE_FILE)
        dir_fd = os.open(out, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    (out / "engine_config.json").write_text(json.dumps(dict(config), indent=1, default=str))


def read_state(path: str | Path) -> dict[str, Any]:
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(f"no engine state at {file}")
    return torch.load(file, map_location="cpu", weights_only=True)
