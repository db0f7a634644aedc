"""The local engine's composition: the engine of a run from its ``Config`` (the Ray engine's is ``build/ray.py``).

Engines take their own config (``engines/local/config.py``) and never read ``Config``: ``local_engine_config`` maps
the one set of values onto the engine's fields, so the two trees cannot disagree on a default.
"""

from __future__ import annotations

import math

from openrlhf_populora.config import Config


def local_engine_config(config: Config, **overrides):
    """The local engine's knobs from ``Config``, the one place their values come from (``overrides``: field by
    field, for tests and benchmarks). The model is named, not resolved: the engine resolves it when it loads."""
    from dataclasses import replace

    from openrlhf_populora.engines.local import LocalEngineConfig

    threads = config.populora.num_threads or (1 if config.populora.device == "cpu" else 0)
    clip_low, clip_high = config.actor.eps_clip_low_high or (config.actor.eps_clip, config.actor.eps_clip)
    updates = config.populora.total_steps * config.train.max_epochs  # optimizer updates the LR schedule spans
    engine_config = LocalEngineConfig(
        model_name_or_path=config.actor.model_name_or_path,
        lora_rank=config.ds.lora.rank,
        lora_alpha=config.ds.lora.alpha,
        lora_target_modules=list(config.ds.lora.target_modules),
        lora_dropout=config.ds.lora.dropout,
        dtype=config.ds.param_dtype,
        device=config.populora.device,
        attn_implementation=config.ds.attn_implementation,
        num_threads=threads,
        seed=config.train.seed,
        micro_batch_size=config.actor.micro_batch_size,
        logprob_temperature=config.rollout.temperature or 1.0,
        lr=config.actor.adam.lr,
        lr_scheduler=config.actor.lr_scheduler,
        lr_warmup_steps=math.ceil(config.actor.lr_warmup_ratio * updates),
        lr_total_steps=updates,
        min_lr_ratio=config.actor.min_lr_ratio,
        weight_decay=config.actor.adam.weight_decay,
        adam_betas=tuple(config.actor.adam.betas),
        adam_eps=config.actor.adam.eps,
        max_norm=config.actor.max_norm,
        eps_clip_low=clip_low,
        eps_clip_high=clip_high,
        entropy_coef=config.actor.entropy_coef,
        max_epochs=config.train.max_epochs,
    )
    return replace(engine_config, **overrides)


def build_engine(config: Config):
    """The local engine, configured from the OpenRLHF-style flags (``local_engine_config``)."""
    from openrlhf_populora.engines.local import LocalEngine

    return LocalEngine(local_engine_config(config))
