"""``SelfPlay.frozen``: a frozen member plays and is scored, but its samples never train its adapter.

The engine is the real ``LocalEngine`` on the tiny model with scripted completions (every proposal valid, answers
right or wrong by a fixed rule, so every group's rewards vary and every member has something to learn from); the
sandbox is real. The same step runs twice from the same start, once with nothing frozen (every adapter moves: the
test is sharp) and once with a teacher and a student frozen.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from task_answers import scripted_output_answer

from openrlhf_populora.config import Config
from openrlhf_populora.engines.local import LocalEngineConfig
from openrlhf_populora.engines.scripted import scripted_engine
from openrlhf_populora.models.embedded import resolve_model
from openrlhf_populora.selfplay.loop import SelfPlay
from openrlhf_populora.selfplay.summary import step_metrics

PROGRAMS = [("def f(x):\n    return x + 3", "4"), ("def f(x):\n    return x * 2", "5"),
            ("def f(x):\n    return x - 1", "9")]


_PROPOSALS = itertools.count()


def policy(adapter: str, prompt: str, sample: int, rng) -> str:
    """Teachers: the three valid programs in turn. Students: always right on ``x + 3``, never on ``x * 2``, on
    even samples otherwise; so teachers' rewards (1 - solve rate: 0, 1, 0.5) and students' rewards both vary."""
    if "## Task: write a new Python program" in prompt:
        program, arguments = PROGRAMS[next(_PROPOSALS) % len(PROGRAMS)]
        return f"<think>p</think><answer>\n```python\n{program}\n```\n```input\n{arguments}\n```\n</answer>"
    return scripted_output_answer(prompt, sample)


def make_loop(tmp_path, sandbox) -> SelfPlay:
    from openrlhf_populora.build import build_engine

    config = Config()
    config.actor.model_name_or_path = "tiny"
    config.actor.adam.lr = 1e-2
    config.ds.lora.rank = 2
    config.rollout.max_new_tokens = 16
    p = config.populora
    p.task_types = ["code_o"]
    p.num_teachers, p.num_students = 2, 2
    p.proposals_per_teacher, p.solver_tasks, p.solver_samples = 3, 2, 2
    p.seed_file = "configs/seeds/basic.jsonl"
    p.evolution.enabled = False
    config.validate()
    real = build_engine(config)
    real.close()
    engine = scripted_engine(policy)(LocalEngineConfig(**{**real.config.__dict__,
                                                          "model_name_or_path": resolve_model("tiny")}))
    loop = SelfPlay(config, engine, sandbox, tmp_path)
    loop.create_adapters()
    loop.seed_buffers()
    return loop


def _moved(before: dict, after: dict) -> bool:
    return any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("frozen", [set(), {"t1", "s0"}])
def test_frozen_members_play_but_never_train(tmp_path, task_sandbox, frozen):
    loop = make_loop(tmp_path, task_sandbox)
    loop.frozen = set(frozen)
    names = ["t0", "t1", "s0", "s1"]
    before = {name: loop.engine.get_adapter(name) for name in names}
    trained: list = []
    train_step = loop.engine.train_step
    loop.engine.train_step = lambda trajectories: trained.extend(trajectories) or train_step(trajectories)
    out = loop.run_step()

    for name in names:
        moved = _moved(before[name], loop.engine.get_adapter(name))
        assert moved == (name not in frozen), name  # frozen: bit-identical; the others all trained
        assert (loop.engine._optimizers[name].state == {}) == (name in frozen)  # no Adam step either
    assert {t.adapter for t in trained} == set(names) - frozen
    assert set(out.trained) == set(names) - frozen
    # a frozen member still played: its proposals and answers were made, verified and logged
    assert {pr.teacher for pr in out.proposals} == {"t0", "t1"}
    assert {a.student for a in out.attempts} == {"s0", "s1"}
    metrics = step_metrics(loop, out)
    assert metrics["member/t1/teacher/all/validity"] == 1.0
    assert 0 < metrics["member/s0/student/all/solve_rate"] < 1
