"""Parsing of model text without execution: answer regions, blocks, value literals, programs, rule list."""

import ast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openrlhf_populora.tasks.parsing import (
    ParseError,
    extract_answer,
    fenced_blocks,
    find_message,
    find_program_block,
    find_value_block,
)
from openrlhf_populora.tasks.programs import parse_program
from openrlhf_populora.tasks.rules import AZR_BANNED_WORDS, TaskRules, rule_violations
from openrlhf_populora.tasks.values import called_names, literal_value, parse_arguments, parse_value

# ------------------------------------------------------------------------------------------- regions


def test_answer_region_takes_last_answer_and_reports_tags():
    text = "<think>a <answer>no</answer></think> <answer>yes</answer>"
    assert extract_answer(text) == ("yes", True)
    assert extract_answer("<answer>open to the end") == ("open to the end", False)
    assert extract_answer("no tags at all") == ("no tags at all", False)
    assert extract_answer("reason</think> after") == (" after", False)
    assert extract_answer(None) == ("", False)  # type: ignore[arg-type]


def test_early_closed_answer_then_reopened_uses_last_region():
    text = "<answer>```output\n1\n```</answer> then <answer>"
    region, tags = extract_answer(text)
    assert region == "" and not tags
    assert find_value_block(region, "output") is None


def test_fenced_blocks_tags_and_unclosed_last_block():
    text = "```python\ndef f(x):\n    return x\n```\n```input\n1\n```\n```output\n2"
    assert fenced_blocks(text) == [("python", "def f(x):\n    return x\n"), ("input", "1\n"), ("output", "2")]


def test_program_block_fallbacks():
    assert find_program_block("```\ndef f(x): return x\n```") == "def f(x): return x\n"
    assert find_program_block("```py\nA\n```\n```python\nB\n```") == "A\n"
    assert find_program_block("```py\nA\n```\n```python\nB\n```", last=True) == "B\n"
    assert find_program_block("```text\ndef g(): pass\n```") == "def g(): pass\n"
    assert find_program_block("no code") is None


def test_value_block_fallbacks():
    assert find_value_block("```output\n1\n```\n```output\n2\n```", "output") == "2\n"
    assert find_value_block("<output>3</output>", "output") == "3"
    assert find_value_block("```\n4\n```", "output") == "4\n"
    assert find_value_block("  5  ", "output") == "5"
    assert find_value_block("two\nlines", "output") is None


@pytest.mark.parametrize("text", [
    "```" * 100_000, "```output\n" * 30_000, "<answer>" * 50_000, "<output>" * 50_000 + "x", "# Message: " * 30_000,
    "```\n" * 80_000, "```" + " " * 300_000, "#" + "\n" * 300_000 + "# Message:",
])
def test_fence_heavy_text_is_parsed_in_linear_time(text):
    # a regex version of the block scanner backtracked quadratically on such text (minutes per call)
    region, _ = extract_answer(text)
    find_value_block(region, "output"), find_program_block(region), find_message(region)


def test_message_sources():
    assert find_message("```message\nhi\n```") == "hi"
    assert find_message("<message> yo </message>") == "yo"
    assert find_message("# Message: sort it") == "sort it"
    assert find_message("nothing") is None


# ------------------------------------------------------------------------------------------- values


@pytest.mark.parametrize("text", [
    "1", "-2.5", "(1+2j)", "(-1-2j)", "'abc'", "b'x'", "None", "True", "[1, (2, 3), {'a': {4}}]",
    "set()", "frozenset({1, 2})", "bytearray(b'ab')", "{1: 'a', (1, 2): [3]}", "'héllo ✓'", "...",
])
def test_values_accepted(text):
    parse_value(text)


@pytest.mark.parametrize("text", [
    "f(1)", "x", "[1] * 3", "2 ** 100", "lambda: 1", "(lambda: 1)()", "a.b", "[i for i in range(3)]",
    "type('A', (), {'__eq__': lambda s, o: True})()", "__import__('os')", "{**d}", "[*x]", "1 if 1 else 2",
    "float('nan')", "not 1", "", "   ", "1; 2", "(1+2j)+3", "bytearray(1000000000)", "set(1, 2)",
    "frozenset(x=1)", "set(range(3))",
])
def test_computations_rejected(text):
    with pytest.raises(ParseError):
        parse_value(text)


def test_class_constructors_only_when_allowed():
    with pytest.raises(ParseError):
        parse_value("Point(x=1, y=2)")
    assert parse_value("Point(x=1, y=2)", {"Point"}) == "Point(x=1, y=2)"
    with pytest.raises(ParseError):
        parse_value("Point(**kw)", {"Point"})


def test_value_size_and_depth_limits():
    with pytest.raises(ParseError):
        parse_value("[" * 60 + "]" * 60)
    with pytest.raises(ParseError):
        parse_value("[" * 1000 + "]" * 1000)  # the parser's own nesting limit, caught
    with pytest.raises(ParseError):
        parse_value("'" + "a" * 30_000 + "'")
    with pytest.raises(ParseError):
        parse_value("1" * 5000)  # int literal over Python's digit limit


def test_arguments_are_value_lists_and_injection_is_rejected():
    assert parse_arguments("'a',  [1,2], k = {3}") == "'a', [1, 2], k={3}"
    assert parse_arguments("1 # comment") == "1"
    for bad in ["1)\nimport os\nf(1", "1), exec('x'", "1)(2", "*xs", "**kw", "", "f(1)", "1; 2", "x=1)+(2"]:
        with pytest.raises(ParseError):
            parse_arguments(bad)


def test_literal_value_equality_semantics():
    assert literal_value("1") == literal_value("1.0") == literal_value("True")
    assert literal_value("{1, 2}") == literal_value("{2, 1}") == literal_value("frozenset({1, 2})")
    assert literal_value("(1, 2)") != literal_value("[1, 2]")
    assert literal_value("{'a': 1, 'b': 2}") == literal_value("{'b': 2, 'a': 1}")
    assert literal_value("P(1, y=[2])", {"P"}) == literal_value("P(1, y=[2])", {"P"})
    assert literal_value("P(1, y=[2])", {"P"}) != literal_value("P(1, y=[3])", {"P"})
    with pytest.raises(ParseError):
        literal_value("{[1]}")  # unhashable set element
    assert called_names("P(Q(1), 2)") == {"P", "Q"}


# ------------------------------------------------------------------------------------------- programs


def test_entry_renamed_to_f_including_recursion():
    p = parse_program("def fact(n):\n    return 1 if n < 2 else n * fact(n - 1)\n")
    assert p.renamed_from == "fact"
    assert "def f(n)" in p.source and "n * f(n - 1)" in p.source


def test_helpers_classes_and_nested_defs_are_allowed():
    # AZR rejected any program with more than one ``def`` (pitfall 8), contradicting its own prompt.
    src = """
import heapq

class Node:
    def __init__(self, v):
        self.v = v

def helper(x):
    def inner(y):
        return y + 1
    return inner(x)

def solve(xs):
    return [helper(Node(x).v) for x in xs]
"""
    p = parse_program(src)
    assert p.renamed_from == "solve" and "def f(xs)" in p.source and "def helper(x)" in p.source
    assert p.classes == {"Node"}


def test_entry_f_kept_and_unsafe_rename_uses_alias():
    assert parse_program("def g(x): return x\ndef f(x): return g(x)\n").renamed_from is None
    p = parse_program("def main(x):\n    f = 2\n    return x * f\n")
    assert p.renamed_from == "main" and p.source.rstrip().endswith("f = main")


def test_top_level_calls_prints_asserts_and_main_guard_are_stripped():
    src = ("def f(x):\n    # keep this comment\n    return x\nprint(f(1))\nassert f(2) == 2\n"
           "if __name__ == '__main__':\n    f(3)\nf(4)\n")
    p = parse_program(src)
    assert p.source == "def f(x):\n    # keep this comment\n    return x\n"


def test_program_errors():
    for bad, reason in [("", "empty"), ("x = 1\n", "no_function"), ("def f(:\n", "syntax"),
                        ("def f(x):\n" + "    x += 1\n" * 3000, "program_too_long")]:
        with pytest.raises(ParseError) as e:
            parse_program(bad)
        assert e.value.reason == reason


def test_indented_program_is_dedented():
    assert parse_program("    def f(x):\n        return x\n").source == "def f(x):\n    return x\n"


# ------------------------------------------------------------------------------------------- rules


def _violations(src):
    return rule_violations(ast.parse(src), TaskRules())


@pytest.mark.parametrize("src", [
    "import os", "import sys", "from os import sys", "import os.path as p", "from os import path",
    "import random", "from datetime import date", "import time", "import subprocess as sp",
    "x = __import__('subprocess')", "import importlib", "from importlib import import_module",
    "import numpy.random", "from numpy import random", "import socket", "from . import x",
    "def f(x):\n    return eval(x)", "def f(x):\n    return open(x).read()", "def f():\n    return input()",
    "def f():\n    return globals()", "def f(x):\n    return x.__class__.__builtins__",
])
def test_ban_list_bypasses_of_azr_are_caught(src):
    # AZR matched banned words against single name components, so these all passed (pitfall 3).
    assert _violations(src)


@pytest.mark.parametrize("src", [
    "import math\nimport numpy\nfrom collections import deque",
    "def parse_input(s):\n    return s\ndef f(x):\n    return parse_input(x)",  # AZR's regex flagged `input(`
    "def f(input):\n    return input(1)",  # a parameter named like a banned call is the program's own
    "import heapq, itertools, functools, string, re",
])
def test_allowed_programs(src):
    assert _violations(src) == []


def test_parity_knobs_default_to_azr():
    rules = TaskRules()
    assert rules.induction_inputs == 10 and rules.max_output_chars == 400 and rules.determinism_runs == 2
    assert rules.prompt_banned_words == AZR_BANNED_WORDS
    with pytest.raises(ValueError):
        TaskRules(induction_min_inputs=11)
    with pytest.raises(ValueError):
        TaskRules(determinism_runs=0)


# ------------------------------------------------------------------------------------------- fuzz

TOKENS = list("()[]{}:,.'\"\\#*=+-/ \n\tabcdefxyz0123456789_") + [
    "def ", "```", "```python\n", "```input\n", "<answer>", "</answer>", "lambda", "import ", "é", "\x00", "    "]
python_ish = st.lists(st.sampled_from(TOKENS), max_size=60).map("".join)


@settings(max_examples=150, deadline=None)
@given(text=st.one_of(python_ish, st.text(max_size=200)))
def test_parsers_only_ever_raise_parse_error(text):
    for parse in (parse_value, parse_arguments, parse_program, literal_value):
        try:
            parse(text)
        except ParseError:
            pass
    region, _ = extract_answer(text)
    find_program_block(region), find_value_block(region, "output"), find_message(region)


@settings(max_examples=100, deadline=None)
@given(value=st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
              st.text(max_size=8), st.binary(max_size=4), st.complex_numbers(allow_nan=False, allow_infinity=False)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.tuples(inner, inner),
                            st.frozensets(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), inner,
                                                                                      max_size=3)),
    max_leaves=12))
def test_repr_of_builtin_values_round_trips_through_literal_value(value):
    assert literal_value(repr(value)) == value


# ------------------------------------------------------------------------------------------- boundaries


@pytest.mark.parametrize("text, expected", [
    # Catches the region ending at the LAST </answer> (rfind) instead of the first one after <answer>.
    ("<answer>a</answer>b</answer>", ("a", False)),
    # Catches the </think> search not bounded by <answer>: a </think> after the answer does not count.
    ("<answer>a</answer></think>", ("a", False)),
    # Catches `>= 1` for the </think> position: a </think> at index 0 counts.
    ("</think><answer>a</answer>", ("a", True)),
    # Catches `think > 0`: without <answer>, a </think> at index 0 still starts the region.
    ("</think>abc", ("abc", False)),
])
def test_answer_region_boundaries(text, expected):
    assert extract_answer(text) == expected


def test_single_unclosed_block_keeps_its_body():
    """Catches the closing-fence search starting at the text's beginning instead of after the header (the
    opening fence is then taken as its own close: an empty body; with two fences the scan never ends)."""
    assert fenced_blocks("```py\nx = 1\n") == [("py", "x = 1\n")]


@pytest.mark.parametrize("region, expected", [
    # Catches the span's close found with find (the first </output>): the last complete span wins.
    ("<output>1</output> <output>2</output>", "2"),
    # Catches the span's open found with find (the first <output>): the span starts at the nearest open.
    ("<output>1<output>2</output>", "2"),
    # Catches the single-line fallback accepting a line with fences in it (no block was found in it).
    ("```x```", None),
])
def test_value_block_tag_spans_and_fence_line(region, expected):
    assert find_value_block(region, "output") == expected
