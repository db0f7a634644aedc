"""The local engine's resume point on disk: one ``engine_state.pt`` written atomically and durably (fsynced before
it replaces the old one), plus the engine's config as JSON beside it (for people; the run's ``config.yaml`` is what
resumes)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from openrlhf_populora.durable import replace_file

STATE_FILE = "engine_state.pt"


def write_state(path: str | Path, state: Mapping[str, Any], config: Mapping[str, Any]) -> None:
    """Write ``<path>/engine_state.pt`` atomically (a crash or power loss mid-write leaves the old file intact):
    the new file is fsynced before it replaces the old one, and the directory after."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    replace_file(out / STATE_FILE, lambda tmp: torch.save(dict(state), tmp))
    (out / "engine_config.json").write_text(json.dumps(dict(config), indent=1, default=str))


def read_state(path: str | Path) -> dict[str, Any]:
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(f"no engine state at {file}")
    return torch.load(file, map_location="cpu", weights_only=True)
