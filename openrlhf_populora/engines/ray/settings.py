"""OpenRLHF's parsed arguments -> the plugin's :class:`~openrlhf_populora.config.Config`.

The Ray engine is launched with upstream's parser (every ``train_ppo_ray`` flag) plus the ``--populora.*`` group.
The self-play loop reads a ``Config``; this module fills one from the hierarchized namespace, copying every
leaf the two share (``rollout.temperature``, ``train.seed``, ``ckpt.output_dir``, ``logger.*``, ``populora.*``
...). Leaves that only the embedded engine has (``ds.param_dtype`` choices, ``actor.micro_batch_size``) keep
their defaults: on this path DeepSpeed and vLLM own them.
"""

from __future__ import annotations

from typing import Any

from openrlhf_populora.config import Config, iter_fields, set_dotted

# Leaves the loop reads. Engine-side leaves (optimiser, LoRA shape, dtype) are consumed by upstream's actors.
SHARED_PREFIXES = ("populora.", "rollout.", "train.seed", "ckpt.", "logger.")

_MISSING = object()


def _lookup(namespace: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        namespace = getattr(namespace, part, _MISSING)
        if namespace is _MISSING:
            return _MISSING
    return namespace


def config_from_args(args: Any) -> Config:
    """A validated ``Config`` for the self-play loop from upstream's hierarchized ``args``."""
    config = Config()
    for name, _field, _tp in iter_fields(Config):
        if not name.startswith(SHARED_PREFIXES):
            continue
        value = _lookup(args, name)
        if value is _MISSING or value is None:
            continue
        if name == "ckpt.save_steps" and value == float("inf"):  # upstream turns -1 into inf
            value = -1
        if name.startswith("logger.wandb.") and not _lookup(args, "logger.wandb.key"):
            continue  # upstream's rule: W&B is on only with --logger.wandb.key (its project has a default)
        if name == "ckpt.max_num":
            value = int(value)
        set_dotted(config, name, value)
    config.validate()
    return config
