"""Program complexity: hand-checked values and robustness to any text."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_populora.metrics.complexity import program_complexity
from openrlhf_populora.metrics.keys import COMPLEXITY_AXES


def test_single_assignment():
    # Assign -> Name / Constant: depth 2, 3 nodes (Module and Load/Store contexts not counted)
    assert program_complexity("x = 1") == {
        "ast_depth": 2.0, "ast_nodes": 3.0, "cyclomatic": 1.0, "loc": 1.0, "halstead_volume": 0.0}


def test_identity_function():
    # FunctionDef -> arguments -> arg is the deepest path (3); nodes: FunctionDef, arguments, arg, Return, Name
    c = program_complexity("def f(x):\n    return x\n")
    assert (c["ast_depth"], c["ast_nodes"], c["cyclomatic"], c["loc"]) == (3.0, 5.0, 1.0, 2.0)


def test_branches_loops_and_comments():
    code = (
        "def f(x):\n"
        "    # a comment line does not count\n"
        "\n"
        "    if x > 0 and x < 5:\n"
        "        return 1\n"
        "    for i in range(x):\n"
        "        x += i\n"
        "    return x\n"
    )
    c = program_complexity(code)
    assert c["cyclomatic"] == 4.0  # 1 + if + and + for
    assert c["loc"] == 6.0  # 8 lines minus the comment and the blank line
    assert c["ast_depth"] == 5.0  # FunctionDef -> If -> BoolOp -> Compare -> Name
    assert c["ast_nodes"] == 27.0


def test_halstead_volume_of_an_addition():
    # operators {+}: N1 = 1; operands {a, b}: N2 = 2 -> N = 3, n = 3, V = 3 log2 3
    c = program_complexity("def f(a, b):\n    return a + b\n")
    assert c["halstead_volume"] == pytest.approx(3 * math.log2(3))


def test_cyclomatic_is_the_most_complex_block():
    code = ("def easy(x):\n    return x\n\n"
            "class A:\n    def hard(self, x):\n        if x:\n            return 1\n"
            "        elif x > 2:\n            return 2\n        return 3\n")
    assert program_complexity(code)["cyclomatic"] == 3.0


@pytest.mark.parametrize("code", ["def f(:", "x = 1\0", "(" * 300 + ")" * 300, "return return", "\x00\xff"])
def test_unparsable_text_gives_missing_values(code):
    assert program_complexity(code) == dict.fromkeys(COMPLEXITY_AXES)


def test_empty_program():
    c = program_complexity("")
    assert c["ast_nodes"] == 0.0 and c["loc"] == 0.0


def test_deep_nesting_does_not_raise():
    code = "x = " + "[" * 90 + "]" * 90
    c = program_complexity(code)
    assert set(c) == set(COMPLEXITY_AXES)
    assert c["ast_depth"] is None or c["ast_depth"] >= 90


def test_non_string_is_a_type_error():
    with pytest.raises(TypeError, match="str"):
        program_complexity(b"x = 1")


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=200))
def test_any_text_never_raises(text):
    c = program_complexity(text)
    assert set(c) == set(COMPLEXITY_AXES)
    for value in c.values():
        assert value is None or (isinstance(value, float) and value >= 0)
