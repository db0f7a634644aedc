"""LoRA adapters on disk in PEFT's saved format: what ``PeftModel.from_pretrained`` and vLLM both load.

A PEFT adapter directory holds two files:

- ``adapter_config.json``: the ``LoraConfig`` (``peft_type: "LORA"``, ``r``, ``lora_alpha``, ``target_modules``
  ...); vLLM reads ``r``, ``lora_alpha``, ``target_modules``, ``bias``, ``use_rslora``, ``use_dora`` and
  ``modules_to_save`` from it;
- ``adapter_model.safetensors``: one tensor per LoRA factor, keyed as PEFT saves them, without the adapter
  name: ``base_model.model.<module path>.lora_A.weight`` (shape ``(r, in)``) and ``...lora_B.weight``
  (``(out, r)``). ``LocalEngine.get_adapter`` and ``get_peft_model_state_dict`` return exactly these keys.

Only torch, safetensors and the standard library are used here (no peft, no vLLM), so the vLLM rollout actor,
the trainer and the run directory all write adapters the same way.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from openrlhf_populora.durable import replace_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."

# <prefix><module path>.lora_A.weight | lora_B.weight ; an adapter name (``lora_A.default.weight``) is not allowed
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<factor>lora_A|lora_B)\.weight$")


def lora_config_dict(
    r: int,
    alpha: float,
    target_modules: str | Iterable[str],
    dropout: float = 0.0,
    base_model_name_or_path: str | None = None,
) -> dict[str, Any]:
    """The ``adapter_config.json`` content that peft's ``LoraConfig(task_type="CAUSAL_LM", r, lora_alpha,
    target_modules, lora_dropout, bias="none")`` saves (the fields readers use; peft fills the rest with its
    defaults on load). ``target_modules`` is a module-name list, a regex string, or ``"all-linear"``
    (OpenRLHF's ``--ds.lora.target_modules`` gives ``["all-linear"]``): ``write_peft_adapter`` replaces
    ``"all-linear"`` by the module names the tensors hold, as peft does once it has wrapped a model."""
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"LoRA rank r must be a positive int, got {r!r}")
    if not alpha > 0:
        raise ValueError(f"lora_alpha must be > 0, got {alpha!r}")
    if not 0 <= dropout < 1:
        raise ValueError(f"lora_dropout must be in [0, 1), got {dropout!r}")
    if isinstance(target_modules, str):
        targets: str | list[str] = target_modules
    else:
        targets = sorted(set(target_modules))
        if targets == ["all-linear"]:
            targets = "all-linear"
    if not targets:
        raise ValueError("target_modules is empty")
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "inference_mode": True,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": float(dropout),
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def adapter_modules(tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """``{module path: {"lora_A": A, "lora_B": B}}`` of PEFT saved-state ``tensors``, validated: every key a
    LoRA factor in PEFT's format, every module with both factors, 2-D, ``A: (r, in)`` and ``B: (out, r)`` with
    one rank ``r`` shared by all modules. Raises ``ValueError`` naming the first offending key."""
    if not tensors:
        raise ValueError("no adapter tensors given")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{key!r} is not a LoRA key in PEFT's saved format "
                             f"('{KEY_PREFIX}<module>.lora_A.weight' or '.lora_B.weight', no adapter name)")
        if not isinstance(value, torch.Tensor) or value.dim() != 2:
            raise ValueError(f"{key!r} must be a 2-D tensor, got {getattr(value, 'shape', type(value))}")
        if not value.is_floating_point():
            raise ValueError(f"{key!r} must be a floating-point tensor, got {value.dtype}")
        modules.setdefault(match["module"], {})[match["factor"]] = value
    ranks = set()
    for module, factors in modules.items():
        if set(factors) != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - set(factors)).pop()
            raise ValueError(f"module {module!r} has no {missing} tensor")
        a, b = factors["lora_A"], factors["lora_B"]
        if a.shape[0] != b.shape[1]:
            raise ValueError(f"module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                             f"disagree on the rank")
        ranks.add(a.shape[0])
    if len(ranks) != 1:
        raise ValueError(f"modules have different LoRA ranks {sorted(ranks)}; one rank per adapter is supported")
    return modules


def adapter_rank(tensors: Mapping[str, torch.Tensor]) -> int:
    """The LoRA rank ``r`` of validated adapter ``tensors``."""
    first = next(iter(adapter_modules(tensors).values()))
    return int(first["lora_A"].shape[0])


def write_peft_adapter(
    directory: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    lora_config: Mapping[str, Any],
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``directory`` (created if needed)
    and return its path. ``tensors`` are PEFT saved-state tensors (any device; cast to ``dtype`` when given,
    else kept). ``lora_config`` is a ``lora_config_dict`` (or a saved ``adapter_config.json``): its ``r`` must
    equal the tensors' rank, and ``"all-linear"`` targets become the module names present. A peft
    ``LoraConfig.to_dict()`` works too. Each file is
    written to a temporary name and renamed, so a reader never sees half a file."""
    from safetensors.torch import save_file

    modules = adapter_modules(tensors)
    rank = adapter_rank(tensors)
    config = dict(lora_config)
    for field in ("r", "lora_alpha", "target_modules"):
        if field not in config:
            raise ValueError(f"lora_config has no {field!r}")
    if int(config["r"]) != rank:
        raise ValueError(f"lora_config has r={config['r']} but the tensors have rank {rank}")
    targets = config["target_modules"]
    if targets == "all-linear" or (not isinstance(targets, str) and list(targets) == ["all-linear"]):
        config["target_modules"] = sorted({module.rsplit(".", 1)[-1] for module in modules})
    elif not isinstance(targets, str):
        config["target_modules"] = sorted(set(targets))
    config.setdefault("peft_type", "LORA")
    config.setdefault("bias", "none")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    payload = {}
    for key, value in tensors.items():
        value = value.detach().to("cpu")
        payload[key] = (value.to(dtype) if dtype is not None else value).contiguous()
    replace_file(out / WEIGHTS_FILE, lambda path: save_file(payload, path, metadata={"format": "pt"}))
    text = json.dumps(config, indent=2, sort_keys=True, default=_jsonable)
    replace_file(out / CONFIG_FILE, lambda path: Path(path).write_text(text))
    return out


def read_peft_adapter(directory: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, lora_config)`` of an adapter directory written by ``write_peft_adapter`` or peft."""
    from safetensors.torch import load_file

    path = Path(directory)
    config = json.loads((path / CONFIG_FILE).read_text())
    return load_file(str(path / WEIGHTS_FILE)), config


def _jsonable(value: Any) -> Any:
    """JSON for what a peft ``LoraConfig.to_dict()`` may hold besides plain values: sets and enums."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if hasattr(value, "value"):  # peft's PeftType / TaskType enums
        return value.value
    raise TypeError(f"cannot write {type(value).__name__} to adapter_config.json")
