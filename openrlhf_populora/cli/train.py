"""``python -m openrlhf_populora.cli.train``: run PopuLoRA self-play (or the single-agent baseline).

Flags follow OpenRLHF 0.11.2's dotted names (``--actor.adam.lr``, ``--ds.lora.rank``, ``--rollout.temperature``,
``--ckpt.output_dir`` ...) plus the ``--populora.*`` group; ``--config configs/<preset>.yaml`` loads a preset.
Everything a run produces lands in ``--ckpt.output_dir`` (the run directory):

    config.yaml         the resolved configuration
    run_meta.json       the run's label and mode, and each start or resume's commit, packages and CPU
    metrics.jsonl       one JSON object per step (the tracker's schema, metrics/keys.py)
    problems.jsonl      every proposal and answer with its verdict, per step
    population.json     members, lineage and ratings
    buffers.jsonl       the task buffers
    adapters/<member>/  each living member's adapter in PEFT format (PeftModel.from_pretrained, vLLM --lora-modules)
    checkpoints/        atomic, fsynced checkpoints of whole steps (resume with --ckpt.load_enable)
    error.log           the traceback of a failed run (the run stays at its last checkpoint)
    figures/            the run's plots (cli/report.py)
"""

from __future__ import annotations

import logging
import math
import os
import sys

import yaml

from openrlhf_populora.config import Config, load_yaml, parse_config

log = logging.getLogger("openrlhf_populora.train")


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


def _selects_ray(argv: list[str]) -> bool:
    """``--populora.engine ray`` on the command line, or (without the flag) ``populora.engine: ray`` in the
    ``--config`` preset."""
    import argparse

    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    probe.add_argument("--populora.engine", dest="engine", default=None)
    probe.add_argument("--config", default=None)
    known, _ = probe.parse_known_args(argv)
    if known.engine is not None:
        return known.engine == "ray"
    if known.config:
        try:
            return load_yaml(known.config).get("populora.engine") == "ray"
        except (ValueError, yaml.YAMLError):
            return False  # the local parser reports it
    return False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if _selects_ray(argv):  # upstream's train_ppo_ray flags + --populora.*: a different parser, same entry point
        from openrlhf_populora.cli.ray_launch import main as launch_ray

        return launch_ray(argv)
    config = parse_config(argv)  # exits with status 2 on a bad flag or value, before any model loads
    logging.basicConfig(level=os.environ.get("POPULORA_LOG", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from openrlhf_populora.models.embedded import resolve_model
    from openrlhf_populora.models.shipped import ShippedModelError
    from openrlhf_populora.selfplay.runner import RunDirError, RunFailed, check_run_dir, claim_run_dir, run

    # every check before the run directory is touched, so a mistake loses nothing: the directory, the model
    # (a shipped one converts here, once), then the engine itself (LoRA target modules, dtype, device)
    try:
        check_run_dir(config)
    except RunDirError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        resolve_model(config.actor.model_name_or_path)
    except (ValueError, ShippedModelError) as err:
        print(f"error: --actor.model_name_or_path: {err}", file=sys.stderr)
        return 2
    try:
        engine = build_engine(config)
    except ValueError as err:
        print(f"error: the engine refused this configuration: {err}", file=sys.stderr)
        return 2

    lock = claim_run_dir(config)  # noqa: F841 - held until the process exits
    try:
        return run(config, lambda _config: engine)
    except RunFailed:  # run() logged the one-line report (and wrote the traceback to error.log)
        return 1


if __name__ == "__main__":
    sys.exit(main())
