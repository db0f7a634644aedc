"""Evolution inside the loop: when an event runs (never at the run's last step) and whom it makes.

The engine is the real ``LocalEngine`` on the tiny model with scripted completions that are all invalid (the
loop still steps, rates and evolves; nothing needs to be valid for that), the sandbox is real.
"""

from __future__ import annotations

import pytest

from openrlhf_populora.build import local_engine_config
from openrlhf_populora.config import Config
from openrlhf_populora.engines.scripted import scripted_engine
from openrlhf_populora.selfplay.loop import SelfPlay

pytestmark = pytest.mark.slow

Silent = scripted_engine(lambda adapter, prompt, sample, rng: "no idea")


def _loop(tmp_path, task_sandbox, total_steps: int) -> SelfPlay:
    config = Config()
    config.actor.model_name_or_path = "tiny"
    config.ds.lora.rank = 2
    config.rollout.max_new_tokens = 8
    p = config.populora
    p.num_teachers, p.num_students, p.total_steps = 2, 2, total_steps
    p.task_types = ["code_o"]
    p.seed_file = "configs/seeds/basic.jsonl"
    p.proposals_per_teacher, p.solver_tasks, p.solver_samples = 1, 1, 1
    p.evolution.enabled, p.evolution.evolve_every, p.evolution.min_age = True, 1, 0
    p.evolution.replace_fraction, p.evolution.operators = 0.5, {"gaussian": 1.0}
    config.validate()
    loop = SelfPlay(config, Silent(local_engine_config(config)), task_sandbox, tmp_path)
    loop.create_adapters()
    loop.seed_buffers()
    return loop


def test_evolution_never_fires_at_the_last_step(tmp_path, task_sandbox):
    # Events are due at every step (evolve_every 1, min_age 0). The first step of a 2-step run evolves: one child
    # per role. The second is the last: a child made there would be exported without a single update.
    # Catches: no last-step guard (2 children at step 2), a guard that compares t <= total_steps (the same),
    # and one off by one the other way, t < total_steps - 1 (no child at step 1).
    loop = _loop(tmp_path, task_sandbox, total_steps=2)
    first = loop.run_step()
    assert first.step == 1 and sorted(e["role"] for e in first.evolution) == ["student", "teacher"]
    last = loop.run_step()
    assert last.step == 2 and last.evolution == []
    assert sorted(m.birth_step for m in loop.population.members) == [0, 0, 0, 0, 1, 1]


def test_the_slot_holds_the_operators_child_of_its_parents(tmp_path, task_sandbox):
    # 3 teachers + 3 students with distinct random adapters; at step 1 one member per role is replaced by
    # linear_0_5 of two survivors: every tensor of the child is exactly (p1 + p2) / 2 of the parents' tensors as the
    # loop read them (the parents keep them: nothing trains after evolution in a step). Halving is exact in
    # binary floating point, so the equality is exact.
    # Catches: the loop installing a copy of a parent (set_adapter(action.slot, parents[...])) or the untouched
    # victim instead of the operator's child.
    import torch

    config = Config()
    config.actor.model_name_or_path = "tiny"
    config.ds.lora.rank = 2
    config.rollout.max_new_tokens = 8
    p = config.populora
    p.num_teachers, p.num_students, p.total_steps = 3, 3, 2
    p.task_types = ["code_o"]
    p.seed_file = "configs/seeds/basic.jsonl"
    p.proposals_per_teacher, p.solver_tasks, p.solver_samples = 1, 1, 1
    p.evolution.enabled, p.evolution.evolve_every, p.evolution.min_age = True, 1, 0
    p.evolution.replace_fraction, p.evolution.elites = 0.34, 0
    p.evolution.operators = {"linear_0_5": 1.0}
    config.validate()
    loop = SelfPlay(config, Silent(local_engine_config(config)), task_sandbox, tmp_path)
    loop.create_adapters()
    loop.seed_buffers()
    gen = torch.Generator().manual_seed(0)
    before = {}
    for member in loop.population.alive():
        weights = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in
                   loop.engine.get_adapter(member.adapter).items()}
        loop.engine.set_adapter(member.adapter, weights)
        before[member.adapter] = weights
    events = loop.run_step().evolution
    assert sorted((e["role"], e["operator"]) for e in events) == [("student", "linear_0_5"), ("teacher", "linear_0_5")]
    for event in events:
        first, second = (loop.engine.get_adapter(slot) for slot in event["parent_adapters"])
        child = loop.engine.get_adapter(event["slot"])
        assert event["slot"] not in event["parent_adapters"] and set(child) == set(first)
        for key in child:
            assert torch.equal(child[key], (first[key] + second[key]) / 2), key
            assert not torch.equal(child[key], before[event["slot"]][key]), key
