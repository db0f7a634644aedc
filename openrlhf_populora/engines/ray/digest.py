"""One content hash of an adapter's tensors, computed alike by the policy actor and the vLLM actor.

The sync proof (``trainer.RayEngine.check_sync``) compares the hash of the file each vLLM engine loaded for an
adapter with the hash of the weights the trainer holds at that moment, both in the engine's dtype: a stale
upload (an older version, or none) or a corrupted one (any changed byte) differs, whatever the dtype.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch


def dtype_named(name: str | torch.dtype) -> torch.dtype:
    """``torch.bfloat16`` from ``"torch.bfloat16"``, ``"bfloat16"`` or the dtype itself."""
    if isinstance(name, torch.dtype):
        return name
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return value


def adapter_digest(tensors: Mapping[str, torch.Tensor], dtype: str | torch.dtype | None = None) -> str:
    """sha256 over the tensors in key order: each key, shape, dtype and raw bytes (cast to ``dtype`` first,
    as the vLLM actor casts what it writes; None: as they are)."""
    digest = hashlib.sha256()
    cast = None if dtype is None else dtype_named(dtype)
    for key in sorted(tensors):
        value = tensors[key].detach().to("cpu")
        if cast is not None:
            value = value.to(cast)
        value = value.contiguous()
        digest.update(f"{key}|{tuple(value.shape)}|{value.dtype}|".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
