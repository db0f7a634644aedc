"""One self-play loop on the real local engine with scripted completions, for tests that check a step by hand.

``tiny_config`` is the tiny model, code_o only, the shipped seed tasks and no evolution; ``scripted_loop`` builds
the loop on a scripted subclass of the local engine (``engines/scripted.py``), with adapters made and buffers
seeded. The sandbox is the real one (the ``task_sandbox`` fixture).
"""

from __future__ import annotations

from openrlhf_populora.build import local_engine_config
from openrlhf_populora.config import Config
from openrlhf_populora.selfplay.loop import SelfPlay


def tiny_config(**populora) -> Config:
    """The tiny model, one task type (code_o), shipped seed tasks, no evolution, no learning probe;
    ``populora`` overrides."""
    config = Config()
    config.actor.model_name_or_path = "tiny"
    config.ds.lora.rank = 2
    config.rollout.max_new_tokens = 16
    p = config.populora
    p.task_types = ["code_o"]
    p.seed_file = "configs/seeds/basic.jsonl"
    p.evolution.enabled = False
    p.probe_size = 0  # the learning probe's base samples would take the scripted policies' first answers
    for key, value in populora.items():
        setattr(p, key, value)
    config.validate()
    return config


def scripted_loop(config: Config, engine_class: type, tmp_path, task_sandbox) -> SelfPlay:
    """A loop on the real local engine (``engine_class``: a scripted subclass), adapters made, buffers seeded."""
    loop = SelfPlay(config, engine_class(local_engine_config(config)), task_sandbox, tmp_path)
    loop.create_adapters()
    loop.seed_buffers()
    return loop
