"""Value literals and the task rule list, to the exact reason tag, limit boundary and built value.

The reason tags of ParseError land in problems.jsonl, so every table here pins the tag, not just "raises".
"""

import ast

import pytest

from openrlhf_populora.tasks.parsing import ParseError
from openrlhf_populora.tasks.rules import TaskRules, rule_violations
from openrlhf_populora.tasks.values import (
    MAX_VALUE_DEPTH,
    MAX_VALUE_NODES,
    Instance,
    literal_value,
    parse_arguments,
    parse_value,
)


def _reason(parse, text, classes=frozenset()):
    with pytest.raises(ParseError) as info:
        parse(text, classes)
    return info.value.reason


def _nested_lists(depth, inner="0"):
    return "[" * depth + inner + "]" * depth


# ------------------------------------------------------------------------------------------- values


@pytest.mark.parametrize(("text", "reason"), [
    (None, "empty"),  # Catches: the non-str tag changed
    ("", "empty"),
    ("  \n ", "empty"),  # Catches: the blank-text tag changed (ParseError(None))
    ("'" + "a" * 30_000 + "'", "value_too_large"),  # Catches: the MAX_VALUE_CHARS tag changed
    (_nested_lists(MAX_VALUE_DEPTH + 1), "value_too_large"),  # Catches: the depth/node tag changed
    ("[" + "0," * MAX_VALUE_NODES + "]", "value_too_large"),  # 5001 nodes. Catches: count -= 1 (no limit)
    ("not 1", "not_a_value"),  # Catches: the UnaryOp-operator tag changed
    ("-x", "not_a_value"),
    ("1 + 2", "not_a_value"),  # Catches: the BinOp-operator tag changed
    ("(1+2j)+3", "not_a_value"),
    ("[*x]", "not_a_value"),  # Catches: the starred-element tag changed (ParseError(None, ...))
    ("{**d}", "not_a_value"),  # Catches: the dict-unpacking tag changed
    ("P(**kw)", "not_a_value"),  # Catches: the keyword-unpacking tag in a class call changed
    ("P(*xs)", "not_a_value"),
    ("set([1], [2])", "not_a_value"),  # Catches: _builtin_call_ok allowing two args (len > 2)
    ("frozenset([1], [2])", "not_a_value"),
    ("[x, set()]", "not_a_value"),  # Catches: `break` after a call, leaving the rest of the stack unchecked
    ("P(x)", "not_a_value"),  # Catches: the same `break`, leaving the call's own arguments unchecked
    ("g(1)", "not_a_value"),
    ("x", "not_a_value"),
])
def test_parse_value_rejections_carry_exact_reason(text, reason):
    assert _reason(parse_value, text, {"P"}) == reason


@pytest.mark.parametrize(("text", "canonical"), [
    # 5000 nodes exactly (the list and 4999 constants): the node limit is inclusive.
    ("[" + "0," * (MAX_VALUE_NODES - 1) + "]", "[" + ", ".join(["0"] * (MAX_VALUE_NODES - 1)) + "]"),
    # The constant at depth 50 exactly. Catches: list/tuple/set elements pushed at depth + 2.
    (_nested_lists(MAX_VALUE_DEPTH), _nested_lists(MAX_VALUE_DEPTH)),
    (_nested_lists(MAX_VALUE_DEPTH, "(0,)")[1:-1], _nested_lists(MAX_VALUE_DEPTH - 1, "(0,)")),
    # A dict at depth 49, its key and value at depth 50. Catches: dict keys pushed at depth + 2.
    (_nested_lists(MAX_VALUE_DEPTH - 1, "{0: 1}"), _nested_lists(MAX_VALUE_DEPTH - 1, "{0: 1}")),
])
def test_value_limits_are_inclusive_at_the_boundary(text, canonical):
    assert parse_value(text) == canonical


def test_dict_one_level_past_the_depth_limit_is_rejected():
    assert _reason(parse_value, _nested_lists(MAX_VALUE_DEPTH, "{0: 1}")) == "value_too_large"


@pytest.mark.parametrize(("text", "reason"), [
    (None, "empty"),  # Catches: the non-str tag changed
    ("", "empty"),
    (" \t\n", "empty"),  # Catches: the blank-text tag changed (ParseError(None))
    ("# only a comment", "empty"),
    ("'" + "a" * 30_000 + "'", "value_too_large"),  # Catches: the MAX_VALUE_CHARS tag changed
    ("1)(2", "not_an_argument_list"),  # Catches: the sentinel-check tag changed
    ("1), exec('x'", "not_an_argument_list"),
    ("*xs", "not_a_value"),
    ("**kw", "not_a_value"),  # Catches: ParseError("keyword unpacking") (the detail as the tag)
    ("1, x", "not_a_value"),
    ("k=not 1", "not_a_value"),
])
def test_parse_arguments_rejections_carry_exact_reason(text, reason):
    assert _reason(parse_arguments, text) == reason


@pytest.mark.parametrize(("text", "value"), [
    ("+5", 5),  # Catches: unary plus built as -v
    ("+2.5", 2.5),
    ("-5", -5),
    ("set()", frozenset()),  # Catches: "set" not recognised, built as Instance(('set', (), ()))
    ("set([1, 2, 2])", frozenset({1, 2})),
    ("frozenset('ab')", frozenset({"a", "b"})),
    ("bytearray(b'ab')", bytearray(b"ab")),  # Catches: bytearray(x) built as an Instance, or bytearray(None)
    ("bytearray()", bytearray()),
])
def test_literal_value_builds_exact_values(text, value):
    built = literal_value(text)
    assert built == value and type(built) is type(value)


@pytest.mark.parametrize("text", ["{[1]}", "{[1]: 2}", "{{}: 1}", "frozenset([[1]])"])
def test_literal_value_unhashable_is_not_a_value(text):
    # Catches: the builder's exception turned into ParseError(type(e).__name__), i.e. tag "TypeError".
    assert _reason(literal_value, text) == "not_a_value"


def test_literal_value_freezes_dicts_inside_instances():
    # Catches: _freeze building frozenset(None) for dicts (TypeError -> ParseError).
    built = literal_value("P({'a': 1, 'c': 3}, k={'b': [2]})", {"P"})
    assert built == Instance(("P", (("__dict__", frozenset({("a", 1), ("c", 3)})),),
                              (("k", ("__dict__", frozenset({("b", ("__list__", (2,)))}))),)))
    assert built == literal_value("P({'c': 3, 'a': 1}, k={'b': [2]})", {"P"})
    assert built != literal_value("P({'a': 1, 'c': 4}, k={'b': [2]})", {"P"})


# ------------------------------------------------------------------------------------------- rules


@pytest.mark.parametrize("kwargs", [
    {"max_output_chars": 0},  # Catches: `and` in place of `or` between the two char limits
    {"max_input_chars": 0},
    {"induction_inputs": 1, "induction_min_inputs": 1},
    {"induction_min_inputs": 1},
    {"induction_min_inputs": 11},
    {"determinism_runs": 0},
])
def test_task_rules_rejects_bad_knobs(kwargs):
    with pytest.raises(ValueError):
        TaskRules(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"induction_inputs": 2, "induction_min_inputs": 2},  # Catches: induction_inputs <= 2 rejected
    {"determinism_runs": 1},  # Catches: determinism_runs <= 1 rejected
    {"max_output_chars": 1, "max_input_chars": 1},
])
def test_task_rules_accepts_the_smallest_valid_knobs(kwargs):
    rules = TaskRules(**kwargs)
    assert all(getattr(rules, k) == v for k, v in kwargs.items())


@pytest.mark.parametrize(("src", "violations"), [
    ("from . import x", ["relative_import"]),  # Catches: the relative-import tag changed
    ("from .. import os", ["relative_import"]),
    ("from os import path", ["banned_module:os"]),  # Catches: None appended for a banned from-import
    ("from numpy import random", ["banned_module:numpy.random"]),
    ("import os.path as p", ["banned_module:os"]),
    ("def f(x):\n    return x.__class__.__builtins__", ["banned_name:__builtins__"]),  # Catches: None for attrs
    ("x = __import__('subprocess')", ["banned_call:__import__", "banned_name:__import__"]),
    ("import os\nimport os", ["banned_module:os"]),
])
def test_rule_violations_exact_tags(src, violations):
    assert rule_violations(ast.parse(src), TaskRules()) == violations
