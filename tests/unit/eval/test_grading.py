"""Grading: EvalPlus differential tests and LiveCodeBench tests in the real Sandbox; math by equivalence
(math-verify); answer extraction and prompt templates."""

from __future__ import annotations

import json

import pytest
from paths import EVAL_DATA

from openrlhf_populora.eval.benchmarks import load_benchmark
from openrlhf_populora.eval.code_grading import grade_code
from openrlhf_populora.eval.evaluator import EvalSettings, grade
from openrlhf_populora.eval.extract import answer_region, extract_code, extract_math_answer, last_boxed
from openrlhf_populora.eval.math_grading import answers_match
from openrlhf_populora.eval.prompts import R1_SYSTEM, render_prompt


@pytest.fixture(scope="module")
def sandbox(eval_sandbox):
    return eval_sandbox


def canonical(name: str) -> list[str]:
    return [json.loads(line)["canonical_solution"] for line in (EVAL_DATA / name).read_text().splitlines()]


def passed(problems, codes, sandbox, **kw) -> list[bool]:
    return [g.passed for g in grade_code(problems, codes, sandbox, **kw)]


# ------------------------------------------------------------------------------------ EvalPlus


def test_evalplus_canonical_solutions_pass(sandbox):
    he = load_benchmark("humaneval_plus", EVAL_DATA)
    mbpp = load_benchmark("mbpp_plus", EVAL_DATA)
    assert passed(he, canonical("HumanEvalPlus.jsonl"), sandbox) == [True, True, True]
    assert passed(mbpp, canonical("MbppPlus.jsonl"), sandbox) == [True, True]


def test_evalplus_wrong_solutions_fail_on_the_plus_inputs(sandbox):
    he = load_benchmark("humaneval_plus", EVAL_DATA)
    # below_zero that forgets the running balance passes the first base inputs but not [5, -5, -1, 10]
    only_single = "    return any(op < 0 for op in operations) and operations[0] < 0\n"
    grades = grade_code(he[:1], [only_single], sandbox)
    assert not grades[0].passed and "expected True, got False" in grades[0].detail


def test_evalplus_float_tolerance_and_find_zero(sandbox):
    he = load_benchmark("humaneval_plus", EVAL_DATA)
    close = "    return number - int(number) + 1e-9\n"  # within atol 1e-6
    far = "    return number - int(number) + 1e-3\n"
    # a different root than the reference's bisection finds (it finds 1 or 2 for (x-1)(x-2)(x-3)):
    # find_zero is checked by |poly(xs, x)| <= atol, not by equality with the reference
    other_root = (
        "    if xs == [-6, 11, -6, 1]:\n        return 3.0\n"
        "    lo, hi = -100.0, 100.0\n"
        "    for _ in range(200):\n"
        "        mid = (lo + hi) / 2\n"
        "        if poly(xs, lo) * poly(xs, mid) <= 0:\n            hi = mid\n        else:\n            lo = mid\n"
        "    return lo\n"
    )
    not_a_root = "    return 0.0\n"
    assert passed(he[1:2] * 2, [close, far], sandbox) == [True, False]
    assert passed(he[2:3] * 2, [other_root, not_a_root], sandbox) == [True, False]


def test_mbpp_set_valued_task_compares_as_sets(sandbox):
    mbpp = load_benchmark("mbpp_plus", EVAL_DATA)
    reordered = "def similar_elements(a, b):\n    return sorted(set(b) & set(a), reverse=True)\n"
    missing = "def similar_elements(a, b):\n    return list(set(a) & set(b))[:1]\n"
    assert passed(mbpp[:1] * 2, [reordered, missing], sandbox) == [True, False]


def test_candidate_cannot_see_or_break_the_reference(sandbox):
    mbpp = load_benchmark("mbpp_plus", EVAL_DATA)
    # the candidate redefines the name the reference uses in its own namespace only
    shadow = "import math\nmath.sqrt = lambda x: 0\ndef is_not_prime(n):\n    return n != 2 and n != 37 and n != 7919\n"
    assert passed(mbpp[1:2], [shadow], sandbox, sanitizer="none") == [False]  # the sanitizer would drop the patch


# ------------------------------------------------------------------------------------ LiveCodeBench

STDIN_OK = "n = int(input())\na = list(map(int, input().split()))\nprint(sum(a))\nprint(max(a))\n"
STDIN_FAST_IO = (
    "import sys\n"
    "def main():\n"
    "    data = sys.stdin.buffer.read().split()\n"
    "    a = [int(x) for x in data[1:]]\n"
    "    sys.stdout.write(str(sum(a)) + '\\n' + str(max(a)) + '\\n')\n"
    "if __name__ == '__main__':\n"
    "    main()\n"
)
TWO_SUM = (
    "class Solution:\n"
    "    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
    "        seen = {}\n"
    "        for i, x in enumerate(nums):\n"
    "            if target - x in seen:\n"
    "                return (seen[target - x], i)\n"
    "            seen[x] = i\n"
)


STDIN_OPEN0 = "n, *a = map(int, open(0).read().split())\nprint(sum(a))\nprint(max(a))\n"


def test_livecodebench_correct_programs_pass(sandbox):
    stdin, functional = load_benchmark("livecodebench", EVAL_DATA)
    programs = [STDIN_OK, STDIN_FAST_IO, STDIN_OPEN0, TWO_SUM]
    assert passed([stdin, stdin, stdin, functional], programs, sandbox) == [True, True, True, True]


def test_livecodebench_wrong_programs_fail(sandbox):
    stdin, functional = load_benchmark("livecodebench", EVAL_DATA)
    only_sum = "n = int(input())\nprint(sum(map(int, input().split())))\n"
    swapped = TWO_SUM.replace("(seen[target - x], i)", "(i, seen[target - x])")
    grades = grade_code([stdin, functional], [only_sum, swapped], sandbox)
    assert [g.passed for g in grades] == [False, False]
    assert "test #0" in grades[0].detail


def test_livecodebench_whitespace_and_number_formats(sandbox):
    stdin, _ = load_benchmark("livecodebench", EVAL_DATA)
    # trailing spaces and "6.0" for "6" are accepted (token-wise Decimal equality), as LiveCodeBench does
    loose = "n = int(input())\na = list(map(int, input().split()))\nprint(float(sum(a)), '  ')\nprint(max(a))\n"
    assert passed([stdin], [loose], sandbox) == [True]


def test_per_test_timeout(sandbox):
    stdin, _ = load_benchmark("livecodebench", EVAL_DATA)
    grades = grade_code([stdin], ["while True:\n    pass\n"], sandbox, per_test_timeout_s=0.5)
    assert not grades[0].passed and "exceeded 0.5s" in grades[0].detail


# ------------------------------------------------------------------------------------ math


@pytest.mark.parametrize(
    ("gold", "response"),
    [
        ("\\frac{1}{2}", "0.5"),
        ("0.5", "\\boxed{\\frac{1}{2}}"),
        ("\\frac{1}{2}", "so it is \\boxed{\\dfrac12}"),
        ("\\frac{1}{2}", "<think>half</think> <answer>The answer is $\\boxed{1/2}$</answer>"),
        ("\\sqrt{2}", "\\boxed{2^{1/2}}"),
        ("x^2 + 1", "\\boxed{1 + x^2}"),
        ("2400", "\\boxed{2,400}"),
        ("27", "\\boxed{27.0}"),
    ],
)
def test_equivalent_math_answers_match(gold, response):
    assert answers_match(gold, response)


@pytest.mark.parametrize(
    ("gold", "response"),
    [("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}"), ("27", "\\boxed{28}"), ("3", ""), ("x^2+1", "\\boxed{x^2-1}")],
)
def test_different_math_answers_do_not_match(gold, response):
    assert not answers_match(gold, response)


def test_math_grading_on_fixtures_uses_the_last_answer_block():
    problems = load_benchmark("math500", EVAL_DATA) + load_benchmark("gsm8k", EVAL_DATA)
    completions = [
        "<think>1/4+1/4</think><answer>\\boxed{0.5}</answer>",
        "<think>maybe \\boxed{-3}</think><answer>\\boxed{3}</answer>",
        "<think>12 - 2</think><answer>\\boxed{10}</answer>",
        "<think>1200*2</think><answer>\\boxed{2400.5}</answer>",
    ]
    grades = grade(problems, completions, None, EvalSettings())
    assert [g["passed"] for g in grades] == [True, True, True, False]


# ------------------------------------------------------------------------------------ extraction, prompts


def test_answer_region_and_code_extraction():
    text = "<think>try ```python\nbad()\n```</think><answer>\n```python\ndef f():\n    return 1\n```\n</answer>"
    assert answer_region(text) == ("\n```python\ndef f():\n    return 1\n```\n", True)
    assert extract_code(text) == "def f():\n    return 1"
    assert extract_code("```\nx = 1\n```\ntext\n```py\ny = 2\n```") == "y = 2"  # last fence, any tag
    assert extract_code("<answer>```python\ndef g(): pass") == "def g(): pass"  # cut-off generation
    assert extract_code("<answer>def h(): pass</answer>") == "def h(): pass"  # no fence inside the answer
    assert extract_code("    return x\n") == "    return x"  # plain completion mode


def test_completion_mode_cuts_at_the_next_top_level_statement():
    body = "    total = 0\n    # add them\n    for x in xs:\n        total += x\n    return total\n"
    for tail in ("\ndef other():\n    pass\n", "\nprint(f([1]))\n", "\n# test\n", "\n```\nMore text",
                 "\nif __name__ == '__main__':\n    main()\n", "\nclass A:\n    pass\n"):
        assert extract_code(body + tail, completion_mode=True) == body.rstrip()
    assert extract_code(body, completion_mode=True) == body.rstrip()


def test_math_extraction_helpers():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{2}{3}} c") == "\\frac{2}{3}"
    assert last_boxed("\\boxed{unclosed") is None and last_boxed("none") is None
    assert extract_math_answer("<think>x</think><answer> 42 </answer>") == "42"


def test_prompt_templates():
    he = load_benchmark("humaneval", limit=1)[0]
    math = load_benchmark("gsm8k", EVAL_DATA)[0]
    azr = render_prompt(he, "azr")
    assert azr.startswith(R1_SYSTEM) and azr.endswith("Assistant: <think>")
    assert he.starter_code.rstrip() in azr and "<answer>" in azr
    boxed = render_prompt(math, "azr_boxed")
    assert "\\boxed{}" in boxed and math.question in boxed and boxed.endswith("Assistant: <think>")
    assert "\\boxed{}" not in render_prompt(math, "azr")
    assert render_prompt(he, "completion") == he.starter_code
    assert render_prompt(math, "chat", lambda text: f"<user>{text}</user>").startswith("<user>")
    with pytest.raises(ValueError, match="needs the model's chat template"):
        render_prompt(math, "chat")
    with pytest.raises(ValueError, match="unknown prompt template"):
        render_prompt(math, "fancy")
    stdin, functional = load_benchmark("livecodebench", EVAL_DATA)
    assert "standard input" in render_prompt(stdin, "azr")
    assert functional.starter_code.rstrip() in render_prompt(functional, "azr")
