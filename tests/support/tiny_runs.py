"""Run directories made by hand on the tiny model, for tests that evaluate runs: a config, a population and
random LoRA adapters on a given base model (shared by several test modules)."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from openrlhf_populora.build import local_engine_config
from openrlhf_populora.config import Config
from openrlhf_populora.engines.local import LocalEngine
from openrlhf_populora.population.members import Population


def tiny_engine(model_dir: str) -> LocalEngine:
    config = local_engine_config(Config(), dtype="fp32", lora_target_modules=["q_proj", "v_proj"], seed=0,
                                 model_name_or_path=model_dir, lora_rank=4, lora_alpha=8, policy_loss="native")
    return LocalEngine(config)


def save_random_adapters(model_dir: str, ids: list[str], target: Path, seed: int) -> None:
    """One adapter per id with random A and B (so it changes the base's outputs), saved under ``target/<id>``."""
    engine = tiny_engine(model_dir)
    gen = torch.Generator().manual_seed(seed)
    for member_id in ids:
        engine.add_adapter(member_id)
        engine.set_adapter(member_id, {k: torch.randn(v.shape, generator=gen)
                                       for k, v in engine.get_adapter(member_id).items()})
        engine.save_adapter(member_id, str(target / member_id))
    engine.close()


def write_run(root: Path, model_dir: str, *, baseline: bool, seed: int) -> Path:
    """A finished run trained with the chat template: a 1T+1S population (t0, s0), or the baseline (b0)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(yaml.safe_dump({"actor": {"model_name_or_path": model_dir},
                                                      "populora": {"chat_template": True}}))
    population = Population.baseline() if baseline else Population.create(1, 1)
    population.save(root / "population.json")
    save_random_adapters(model_dir, ["b0"] if baseline else ["t0", "s0"], root / "adapters", seed=seed)
    return root
