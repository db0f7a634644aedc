"""Seeds both engines derive the same way, so that one (seed, name) gives one adapter and one request index
gives one sample stream whichever engine runs it."""

from __future__ import annotations

import hashlib


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any printable parts (not Python's salted ``hash``)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def adapter_init_seed(seed: int, name: str) -> int:
    """The torch seed under which adapter ``name`` is initialised (A random, B zero), on either engine."""
    return derive_seed(seed, "adapter-init", name)
