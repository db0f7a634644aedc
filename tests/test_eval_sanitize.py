"""The code sanitizer (``eval.sanitize``): exact outputs on hand-written programs, and its effect on grading."""

from __future__ import annotations

import pytest

from openrlhf_populora.eval.benchmarks import load_benchmark
from openrlhf_populora.eval.evaluator import EvalSettings, grade
from openrlhf_populora.eval.sanitize import longest_parsable_span, sanitize

CHATTY = '''import math
from typing import List

SCALE = 2
UNUSED = 99

def helper(x):
    return math.floor(x) * SCALE

@staticmethod
def decorated(x):
    return helper(x)

def f(xs: List[float]) -> List[int]:
    return [decorated(x) for x in xs]

def not_used():
    return 0

# a test the model wrote itself, wrong
assert f([1.5]) == [3]
print(f([2.0]))
result = f([3.0])
for x in range(3):
    print(x)
if __name__ == "__main__":
    f([1.0])
'''


def test_keeps_imports_and_what_the_roots_reach_and_drops_the_rest():
    # Catches: top-level asserts, prints, loops, the main block or an unreached assignment kept; a helper the
    # entry reaches only through another definition dropped (reachability not followed); a decorator lost;
    # imports dropped; the order changed.
    assert sanitize(CHATTY, {"f"}) == (
        "import math\nfrom typing import List\nSCALE = 2\n"
        "def helper(x):\n    return math.floor(x) * SCALE\n"
        "@staticmethod\ndef decorated(x):\n    return helper(x)\n"
        "def f(xs: List[float]) -> List[int]:\n    return [decorated(x) for x in xs]\n"
    )


def test_every_root_is_kept_and_unknown_roots_are_ignored():
    # a test that calls a second function of the prompt (HumanEval/50's encode_shift). Catches: only the first
    # (or the entry) root followed.
    program = "def enc(s):\n    return s + 'x'\ndef dec(s):\n    return s[:-1]\nprint(dec(enc('a')))\n"
    assert sanitize(program, {"dec", "enc", "candidate", "assert_equal"}) == (
        "def enc(s):\n    return s + 'x'\ndef dec(s):\n    return s[:-1]\n")
    assert sanitize(program, {"dec"}) == "def dec(s):\n    return s[:-1]\n"


def test_the_last_definition_of_a_name_is_the_one_kept():
    # a draft and then a fix, as Python runs them. Catches: the first kept (evalplus.sanitize 0.3.1 does that).
    program = "def f():\n    return 1\n\ndef f():\n    return 2\n"
    assert sanitize(program, {"f"}) == "def f():\n    return 2\n"


def test_a_function_without_return_is_kept():
    # Catches: EvalPlus's "has a return statement" filter, which turns a function that loops forever (or one
    # that mutates its argument) into a missing one.
    program = "def f(xs):\n    while True:\n        pass\nf([1])\n"
    assert sanitize(program, {"f"}) == "def f(xs):\n    while True:\n        pass\n"


def test_a_completion_cut_off_mid_statement_keeps_its_longest_parsable_lines():
    # the token budget ran out inside the model's own demo. Catches: no span search (the SyntaxError stays),
    # a span that is not the longest (the function's body lost), a span taken from the wrong end.
    program = "Here is the function:\ndef f(x):\n    return x + 1\n\nprint(f(1), f(\n"
    assert longest_parsable_span(program) == "def f(x):\n    return x + 1\n"
    assert sanitize(program, {"f"}) == "def f(x):\n    return x + 1\n"
    assert longest_parsable_span("def f(x):\n    return 1\n") == "def f(x):\n    return 1\n"  # whole: as is


def test_a_program_with_nothing_to_keep_is_returned_unchanged():
    # nothing parses, or the entry point is never defined: it fails as written (its own error message)
    assert sanitize("def f(:\n", {"f"}) == "def f(:\n"
    assert sanitize("print(1)\n", {"f"}) == "print(1)\n"


@pytest.fixture(scope="module")
def sandbox(eval_sandbox):
    return eval_sandbox


def test_a_correct_function_with_a_wrong_self_test_passes_only_when_sanitized(sandbox):
    # HumanEval/0 answered correctly, followed by an assert the model made up (wrong) and a demo call.
    # Catches: the sanitizer not applied in grading, or the setting not passed down to it.
    problem = load_benchmark("humaneval")[0]
    answer = ("```python\ndef has_close_elements(numbers, threshold):\n"
              "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n\n"
              "assert has_close_elements([1.0, 2.0], 0.5) is True\nprint(has_close_elements([1.0], 0.1))\n```")
    graded = {s: grade([problem], [answer], sandbox, EvalSettings(code_template="chat", code_sanitizer=s))[0]
              for s in ("definitions", "none")}
    assert graded["definitions"]["passed"] is True
    assert graded["none"]["passed"] is False and graded["none"]["detail"].startswith("AssertionError")


def test_span_search_edge_cases():
    # Catches (mutants mutmut left alive): a non-empty default when nothing parses; a minimum size above 0 (a
    # one-line span never found); a search stepping over every other end line; a later span replacing an
    # earlier one of the same size.
    assert longest_parsable_span("def f(:\n") == ""
    assert longest_parsable_span("x = (\ny = 1") == "y = 1"
    assert longest_parsable_span("def f(x):\n    return x\nprint(f(") == "def f(x):\n    return x"
    assert longest_parsable_span("a = 1\n)\nb = 2") == "a = 1"


def test_an_annotated_constant_is_a_definition_and_only_its_statement_is_kept():
    # Catches: annotated assignments not read as definitions (LIMIT dropped: a NameError at run time); a
    # statement's text taken from the start of its line rather than its column (the print before the ';' kept).
    program = "print(1); LIMIT: int = 2\ndef f():\n    return LIMIT\n"
    assert sanitize(program, {"f"}) == "LIMIT: int = 2\ndef f():\n    return LIMIT\n"
