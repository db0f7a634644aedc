"""Patches for OpenRLHF 0.11.2: module-attribute swaps, applied and reverted as a unit.

Everything the plugin changes in OpenRLHF is either a subclass (``openrlhf_populora.engines.ray``) or one of
the attribute swaps registered here. A :class:`Patch` names an upstream attribute (``module:attr`` or
``module:Class.attr``) and the object that replaces it; :func:`apply` swaps them all, remembering the
originals, and :func:`revert` puts the originals back. Applying twice is a no-op.

:func:`apply` refuses to run against any OpenRLHF version other than :data:`UPSTREAM_VERSION`. The source
hashes in ``upstream.lock.json`` (see :func:`source_hash` and ``lock.py``) are checked by
``tests/unit/patches/test_openrlhf.py``; ``python -m openrlhf_populora.patches.openrlhf_0_11_2.lock --check|--write``
compares or regenerates them.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

UPSTREAM_VERSION = "0.11.2"
LOCK_FILE = Path(__file__).with_name("upstream.lock.json")


class UpstreamVersionError(RuntimeError):
    """The installed OpenRLHF is not the version these patches were written and hash-checked against."""


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("openrlhf")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_version() -> None:
    found = installed_version()
    if found != UPSTREAM_VERSION:
        raise UpstreamVersionError(
            f"openrlhf_populora's patches are pinned to openrlhf=={UPSTREAM_VERSION}, but "
            f"{'no openrlhf' if found is None else f'openrlhf=={found}'} is installed. "
            f"Install it with: pip install --no-deps openrlhf=={UPSTREAM_VERSION}"
        )


def resolve(target: str) -> tuple[Any, str]:
    """``"pkg.mod:Class.attr"`` -> (owner object, attribute name)."""
    module_name, _, path = target.partition(":")
    if not path:
        raise ValueError(f"patch target {target!r} must look like 'module:attr' or 'module:Class.attr'")
    owner: Any = importlib.import_module(module_name)
    *parents, attr = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    return owner, attr


def lookup(target: str) -> Any:
    owner, attr = resolve(target)
    return getattr(owner, attr)


def source_hash(obj: Any) -> str:
    """sha256 of ``inspect.getsource(obj)`` (Ray actor classes hash their wrapped class)."""
    obj = getattr(obj, "__ray_actor_class__", obj)
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()


def load_lock() -> dict[str, Any]:
    return json.loads(LOCK_FILE.read_text()) if LOCK_FILE.exists() else {}


@dataclass(frozen=True)
class Patch:
    """Replace upstream ``target`` with ``replacement``. ``why`` is shown in logs and docs."""

    target: str
    replacement: Any
    why: str


_applied: dict[str, tuple[Any, str, Any]] = {}  # target -> (owner, attr, original)


def apply(patches: list[Patch]) -> None:
    """Swap every target for its replacement (idempotent per target)."""
    check_version()
    for patch in patches:
        owner, attr = resolve(patch.target)
        if patch.target not in _applied:
            _applied[patch.target] = (owner, attr, getattr(owner, attr))
        setattr(owner, attr, patch.replacement)


def revert() -> None:
    """Restore every original, newest swap first."""
    for target in reversed(list(_applied)):
        owner, attr, original = _applied.pop(target)
        setattr(owner, attr, original)


def applied() -> list[str]:
    return list(_applied)


def original(target: str) -> Any:
    """The upstream object at ``target``: the recorded original while a patch replaces it, else the current one."""
    return _applied[target][2] if target in _applied else lookup(target)
