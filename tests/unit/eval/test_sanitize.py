"""The code sanitizer (``eval.sanitize``): exact outputs on hand-written programs, and its effect on grading."""

from __future__ import annotations

import pytest

from openrlhf_populora.eval.benchmarks import load_benchmark
from openrlhf_populora.eval.evaluator import EvalSettings, grade
from openrlhf_populora.eval.sanitize import free_names, longest_parsable_span, sanitize

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


def test_every_binding_of_a_reached_name_is_kept_in_order():
    # a draft and then a fix (Python keeps the last), and a def rebound through a decorator call. Catches: only
    # the first or only the last binding kept (the lru_cache line alone raises NameError: f is not defined).
    program = "def f():\n    return 1\n\ndef f():\n    return 2\n"
    assert sanitize(program, {"f"}) == "def f():\n    return 1\ndef f():\n    return 2\n"
    wrapped = ("import functools\ndef f(n):\n    return n if n < 2 else f(n - 1) + f(n - 2)\n"
               "f = functools.lru_cache(None)(f)\nprint(f(30))\n")
    assert sanitize(wrapped, {"f"}) == wrapped.replace("print(f(30))\n", "")


def test_guarded_blocks_count_only_when_they_only_define():
    # Catches: a try whose body runs code taken for a definition block (only its handlers checked); nested
    # blocks not looked into; a name bound only in an except branch missed; an unreached definition that
    # imports inside its body kept as if it were an import.
    program = ("try:\n    print('side effect')\nexcept Exception:\n    W = 0\n"
               "if True:\n    if True:\n        Z = 4\n"
               "try:\n    LIMIT = int('x')\nexcept ValueError:\n    FALLBACK = 1\n"
               "def unused():\n    import os\n    return os.sep\n"
               "def f():\n    return (Z, FALLBACK)\n")
    assert sanitize(program, {"f", "W"}) == ("if True:\n    if True:\n        Z = 4\n"
                                             "try:\n    LIMIT = int('x')\nexcept ValueError:\n    FALLBACK = 1\n"
                                             "def f():\n    return (Z, FALLBACK)\n")


def test_tuple_chained_and_guarded_bindings_are_definitions():
    # Catches: only single-name assignments read as definitions (A, B and X dropped: NameError); a top-level
    # try that imports dropped (np undefined); one that only defines dropped although reached.
    program = ("try:\n    import numpy as np\nexcept ImportError:\n    np = None\n"
               "A, B = 1, 2\nX = Y = 3\nif True:\n    Z = 4\nfor i in range(2):\n    pass\n"
               "def f():\n    return (np, A + B + X + Z)\n")
    assert sanitize(program, {"f"}) == ("try:\n    import numpy as np\nexcept ImportError:\n    np = None\n"
                                        "A, B = 1, 2\nX = Y = 3\nif True:\n    Z = 4\n"
                                        "def f():\n    return (np, A + B + X + Z)\n")


def test_statements_are_copied_exactly_whatever_the_characters_before_them():
    # ast's column offsets count UTF-8 bytes: a statement after a non-ASCII one on the same line must still be cut
    # at the right place; a form feed must not shift lines; a decorator written "@ name" or "@(expr)" keeps its
    # '@'. Catches: slicing by characters, str.splitlines, a '@' assumed one column before the expression.
    assert sanitize('s = "é"; T = 2\ndef f():\n    return T\n', {"f"}) == "T = 2\ndef f():\n    return T\n"
    assert sanitize("def g():\n    return 1\n# a\x0cb\ndef f():\n    return g()\n", {"f"}) == (
        "def g():\n    return 1\ndef f():\n    return g()\n")
    assert sanitize("import functools\n@ (functools.lru_cache(None))\n@staticmethod\ndef f(x):\n    return x\nf(1)\n",
                    {"f"}) == "import functools\n@functools.lru_cache(None)\n@staticmethod\ndef f(x):\n    return x\n"


def test_the_roots_are_the_free_names_of_the_tests():
    # HumanEval's checks bind names of their own (loop variables, results): a demo line of the model's that
    # assigns one of them must not be kept (and run). Catches: every name of the test taken as a root.
    test = "def check(candidate):\n    for x in [1, 2]:\n        solution = candidate(x)\n        assert solution == encode(x)\n"
    assert free_names(test) == {"encode"}
    # nor its imports, its own definitions or builtins
    assert free_names("import math\nimport os.path\nfrom collections import Counter as C\ndef helper():\n"
                      "    return 1\nassert candidate(math.pi, os.sep, C(), helper()) == len([1])") == {"candidate"}
    program = "def encode(x):\n    return x\ndef f(x):\n    return x\nsolution = f(1 / 0)\n"
    assert sanitize(program, {"f", *free_names(test)}) == "def encode(x):\n    return x\ndef f(x):\n    return x\n"


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
    # nothing parses, or the entry point is never defined (imports or not): it fails as written, with its own
    # error. Catches: the imports alone returned.
    assert sanitize("def f(:\n", {"f"}) == "def f(:\n"
    assert sanitize("print(1)\n", {"f"}) == "print(1)\n"
    assert sanitize("import math\nprint(math.pi)\n", {"f"}) == "import math\nprint(math.pi)\n"


def test_the_span_search_stops_at_its_budget():
    # hundreds of unparsable lines (a repetition loop) cost a bounded number of parses. Catches: no budget.
    calls = []
    import openrlhf_populora.eval.sanitize as module

    real = module._parses
    try:
        module._parses = lambda source: calls.append(1) or real(source)
        assert longest_parsable_span("x = (\n" * 300, budget=50) == ""
    finally:
        module._parses = real
    assert len(calls) == 51  # the whole program once, then the budget


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
