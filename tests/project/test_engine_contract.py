"""The engine contract as a structure: engines import nothing of the loop, and the local engine's knobs have one
source of values (the run's Config), so the two config trees cannot disagree."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from paths import ROOT

from openrlhf_populora.build import local_engine_config
from openrlhf_populora.config import Config
from openrlhf_populora.engines.local import LocalEngineConfig

ENGINES = ROOT / "openrlhf_populora" / "engines"
LOOP_SIDE = ("selfplay", "population", "tasks", "rewards", "config", "metrics", "build", "cli", "eval")


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_engine_module_imports_the_loop_side():
    """Engines know nothing of AZR, the population or the loop (they were reaching selfplay, Config and
    population through the Ray launcher and trainer)."""
    offenders = {}
    for path in sorted(ENGINES.rglob("*.py")):
        bad = sorted(m for m in _imports(path)
                     if any(m == f"openrlhf_populora.{side}" or m.startswith(f"openrlhf_populora.{side}.")
                            for side in LOOP_SIDE))
        if bad:
            offenders[str(path.relative_to(ENGINES))] = bad
    assert offenders == {}


def test_the_local_engine_has_no_defaults_of_its_own_for_what_config_holds():
    """Every knob Config also holds is required in LocalEngineConfig; only the engine's own implementation
    knobs keep defaults (they used to disagree: lr 1e-5 vs 1e-6, all-linear vs q/k/v/o, micro-batch 4 vs 8)."""
    own = {"generation_batch_size", "share_prefill", "share_prompts", "policy_loss", "old_logprobs"}
    with_defaults = {f.name for f in dataclasses.fields(LocalEngineConfig)
                     if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
    assert with_defaults == own


def test_the_composition_maps_config_onto_every_engine_knob():
    config = Config()
    config.actor.adam.lr, config.ds.lora.rank, config.train.max_epochs = 3e-5, 4, 2
    config.actor.micro_batch_size, config.populora.total_steps, config.actor.lr_warmup_ratio = 3, 10, 0.25
    engine = local_engine_config(config)
    assert (engine.lr, engine.lora_rank, engine.max_epochs, engine.micro_batch_size) == (3e-5, 4, 2, 3)
    assert (engine.lr_total_steps, engine.lr_warmup_steps) == (20, 5)  # updates: steps x epochs
    assert engine.lora_target_modules == config.ds.lora.target_modules
    assert engine.trains and not LocalEngineConfig.for_inference(None, 8, 16, "all-linear", "fp32", "cpu", 1).trains
