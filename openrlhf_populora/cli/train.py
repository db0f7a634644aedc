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
import os
import sys

import yaml

from openrlhf_populora.build import build_engine
from openrlhf_populora.config import load_yaml, parse_config

log = logging.getLogger("openrlhf_populora.train")


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
