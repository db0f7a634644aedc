"""One scripted self-play step checked against rewards and matchups computed by hand.

The engine is the real ``LocalEngine`` on the tiny model with scripted completions
(``engines/scripted.py``), the sandbox is real. Teacher t0 proposes ``x + 3`` (input 4), ``x * 2`` (input 5),
the identity (input 'abc') and one invalid answer. Students answer by a fixed rule:

- s0 is always right; s1 is right only on samples >= 2; s2 only on sample 0 and samples >= 2;
- everyone is right on the identity.

A student's matched attempts on one task are its samples 0 and 1; a buffer top-up that repeats a task of this
step comes after them in the same request (samples 2 and 3), where everyone is right. So a teacher reward
that counted top-ups, or the wrong students, comes out different from the hand-computed one.
"""

from __future__ import annotations

import re

import pytest
from scripted_loops import scripted_loop, tiny_config

from openrlhf_populora.engines.scripted import scripted_engine
from openrlhf_populora.selfplay.loop import SelfPlay
from openrlhf_populora.selfplay.summary import step_metrics

PROPOSALS = [
    ("def f(x):\n    return x + 3", "4"),
    ("def f(x):\n    return x * 2", "5"),
    ("def f(x):\n    return x", "'abc'"),
    None,  # invalid: no program
]


def policy(adapter: str, prompt: str, sample: int, rng) -> str:
    if "## Task: write a new Python program" in prompt:
        return _teacher_answer()  # by the order of the requests, not by chance
    program = re.search(r"```python\n(.*?)\n```", prompt, re.S).group(1)
    arguments = re.search(r"```input\n(.*?)\n```", prompt, re.S).group(1)
    right = (adapter == "s0" or sample >= 2 or program.endswith("return x")
             or (adapter == "s2" and sample == 0))
    scope: dict = {}
    exec(program, scope)  # the test's own programs and the shipped seed tasks: trusted
    value = repr(eval(f"f({arguments})", scope)) if right else "-12345"
    return f"<think>t</think><answer>```output\n{value}\n```</answer>"


_CALLS = {"teacher": 0}


def _teacher_answer() -> str:
    proposal = PROPOSALS[_CALLS["teacher"] % len(PROPOSALS)]
    _CALLS["teacher"] += 1
    if proposal is None:
        return "<think>hmm</think><answer>I do not know</answer>"
    program, arguments = proposal
    return f"<think>p</think><answer>\n```python\n{program}\n```\n```input\n{arguments}\n```\n</answer>"


def make_loop(tmp_path, task_sandbox, **populora) -> SelfPlay:
    # recency_window 0: top-ups come from this step's own tasks, the ones the rewards must not count
    config = tiny_config(**{"num_teachers": 1, "num_students": 3, "proposals_per_teacher": 4, "solver_tasks": 4,
                            "solver_samples": 2, "recency_window": 0, **populora})
    return scripted_loop(config, scripted_engine(policy), tmp_path, task_sandbox)


@pytest.mark.parametrize("remap_zero, identity_reward", [(False, 0.0), (True, -0.5)])
def test_teacher_rewards_count_only_matched_students_on_their_own_attempts(
        tmp_path, task_sandbox, monkeypatch, remap_zero, identity_reward):
    monkeypatch.setitem(_CALLS, "teacher", 0)
    loop = make_loop(tmp_path, task_sandbox)
    loop.p.reward.remap_zero = remap_zero
    out = loop.run_step()
    rates = [pr.solve_rates for pr in out.proposals]
    assert rates == [{"s0": 1.0, "s1": 0.0, "s2": 0.5}, {"s0": 1.0, "s1": 0.0, "s2": 0.5},
                     {"s0": 1.0, "s1": 1.0, "s2": 1.0}, {}]
    assert [pr.reward for pr in out.proposals] == [0.5, 0.5, identity_reward, -1.0]
    # the test is only as sharp as its top-ups: some repeat a non-identity task of this step, and were right
    repeats = [a for a in out.attempts if a.proposal is None and not a.task.program.strip().endswith("return x")]
    assert repeats and all(a.verdict.correct for a in repeats)
    assert {a.student for a in out.attempts if a.proposal is not None} == {"s0", "s1", "s2"}


def test_round_robin_matchups_rotate_with_the_step(tmp_path, task_sandbox, monkeypatch):
    monkeypatch.setitem(_CALLS, "teacher", 0)
    loop = make_loop(tmp_path, task_sandbox, num_teachers=2, num_students=2, matchmaking="round_robin",
                     proposals_per_teacher=1, solver_tasks=1)
    seen = []
    for t in (1, 2, 3):
        out = loop.run_step()
        # matchup j: teacher j mod T meets student (j + step + task index) mod S
        assert [(m.teacher, m.student) for m in out.matchups] == [("t0", f"s{(0 + t) % 2}"), ("t1", f"s{(1 + t) % 2}")]
        seen.append(out.matchups)
    assert seen[0] != seen[1] and seen[0] == seen[2]


def test_training_metrics_stay_with_the_member_that_trained_when_evolution_replaces_it(
        tmp_path, task_sandbox, monkeypatch):
    monkeypatch.setitem(_CALLS, "teacher", 0)
    loop = make_loop(tmp_path, task_sandbox, num_teachers=2, num_students=2)
    loop.p.evolution.enabled = True
    loop.p.evolution.evolve_every = 1
    loop.p.evolution.replace_fraction = 0.5
    loop.p.evolution.min_age = 0
    out = loop.run_step()
    assert out.evolution  # someone was replaced right after training
    metrics = step_metrics(loop, out)
    for event in out.evolution:
        old, child = event["replaced"], event["child"]
        if out.trained.get(event["slot"]) == old:
            assert any(k.startswith(f"member/{old}/") and k.endswith("/grad_norm") for k in metrics)
        assert not any(k.startswith(f"member/{child}/") and k.endswith("/grad_norm") for k in metrics)
    assert set(out.trained) == set(out.train_stats)
    trained_grad_norms = [k for k in metrics if k.endswith("/grad_norm") and k.startswith("member/")]
    assert len(trained_grad_norms) == len(out.train_stats)


def _valid_policy(adapter: str, prompt: str, sample: int, rng) -> str:
    """Every proposal valid (the three programs in turn); answers right on x + 3 at even samples, never on
    x * 2, always on the identity and on the seed tasks' even samples, so every group's rewards vary."""
    if "## Task: write a new Python program" in prompt:
        program, arguments = PROPOSALS[_CALLS["teacher"] % 3]
        _CALLS["teacher"] += 1
        return f"<think>p</think><answer>\n```python\n{program}\n```\n```input\n{arguments}\n```\n</answer>"
    program = re.search(r"```python\n(.*?)\n```", prompt, re.S).group(1)
    arguments = re.search(r"```input\n(.*?)\n```", prompt, re.S).group(1)
    scope: dict = {}
    exec(program, scope)  # the test's own programs and the shipped seed tasks: trusted
    right = program.endswith("return x") or (not program.endswith("x * 2") and sample % 2 == 0)
    value = repr(eval(f"f({arguments})", scope)) if right else "-12345"
    return f"<think>t</think><answer>```output\n{value}\n```</answer>"


def _work_per_adapter(tmp_path, task_sandbox, **populora) -> tuple[dict, dict, dict]:
    """One step; per adapter: proposals generated, answers generated, and Adam steps taken."""
    config = tiny_config(**{"proposals_per_teacher": 2, "solver_tasks": 3, "solver_samples": 2,
                            "matchmaking": "round_robin", **populora})
    proposals: dict[str, int] = {}
    answers: dict[str, int] = {}

    class Counting(scripted_engine(_valid_policy)):
        def generate(self, requests, params):
            for r in requests:
                table = proposals if "## Task: write a new Python program" in r.prompt else answers
                table[r.adapter] = table.get(r.adapter, 0) + r.n
            return super().generate(requests, params)

    loop = scripted_loop(config, Counting, tmp_path, task_sandbox)
    loop.run_step()
    engine = loop.engine
    adam_steps = {name: {int(s["step"]) for s in opt.state.values()} for name, opt in engine._optimizers.items()}
    return proposals, answers, adam_steps


def test_the_baseline_does_one_teachers_and_one_students_work_per_step(tmp_path, task_sandbox, monkeypatch):
    """Per-adapter compute matching, measured through the loop: with the same settings, the baseline's one
    adapter generates exactly one teacher's proposals and one student's answers, and every adapter of either
    run takes exactly one optimizer update."""
    monkeypatch.setitem(_CALLS, "teacher", 0)
    pop = _work_per_adapter(tmp_path / "pop", task_sandbox, num_teachers=2, num_students=2)
    base = _work_per_adapter(tmp_path / "base", task_sandbox, mode="baseline")
    proposals, answers, adam_steps = pop
    assert proposals == {"t0": 2, "t1": 2}  # 2 proposals
    assert answers == {"s0": 6, "s1": 6}  # 3 tasks (2 of its teacher's, 1 from the buffers) x 2 samples
    assert base[0] == {"b0": proposals["t0"]} and base[1] == {"b0": answers["s0"]}
    assert adam_steps == {"t0": {1}, "t1": {1}, "s0": {1}, "s1": {1}} and base[2] == {"b0": {1}}
