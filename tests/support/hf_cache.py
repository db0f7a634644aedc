"""A model in a Hugging Face cache, laid out as huggingface_hub writes it, for tests that resolve a hub id offline
(nothing here downloads): ``<HF_HOME>/hub/models--<org>--<name>/`` with ``blobs/<sha256>``,
``snapshots/<commit>/<file>`` links to the blobs, and ``refs/main`` naming the commit."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_model(hf_home: Path, repo_id: str, source: Path, commit: str = COMMIT) -> Path:
    """Put the files of the model directory ``source`` into ``hf_home``'s hub cache as ``repo_id`` at ``commit``
    (the ``main`` branch); returns the snapshot directory."""
    repo = Path(hf_home) / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in Path(source).rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
