"""Program parsing details (``tasks/programs.py``): exact sources after stripping and renaming, the chosen
entry, and the classes a program defines."""

import pytest

from openrlhf_populora.tasks.programs import parse_program


@pytest.mark.parametrize("src, expected", [
    # Catches: the line after a dropped statement also dropped (a comment lost), and a dropped statement
    # before a kept one taken as sharing its line (an AST rebuild that loses the kept function's comments).
    ("print(1)\ndef f(x):\n    # c\n    return x\n", "def f(x):\n    # c\n    return x\n"),
    ("def f(x):\n    return x\nprint(1)\n# tail\n", "def f(x):\n    return x\n# tail\n"),
    # Catches: a broken AST rebuild when a dropped call shares its line with a kept statement.
    ("def f(x):\n    return x\ny = 2; print(y)\n", "def f(x):\n    return x\ny = 2\n"),
])
def test_strip_top_level_exact_source(src, expected):
    p = parse_program(src)
    assert p.source == expected and p.renamed_from is None


REC = "    return main(x - 1) if x > 0 else x\n"


@pytest.mark.parametrize("src, expected, entry", [
    # A parameter or a nested def named ``f`` makes renaming unsafe: the renamed recursive call would reach
    # that local ``f``. Catches: the ``f`` parameter / ``f`` def checks of ``_rename`` dropped.
    ("def main(x, f=0):\n" + REC, "def main(x, f=0):\n" + REC + "\n\nf = main\n", "main"),
    ("def main(x):\n    def f(y):\n        return y\n" + REC,
     "def main(x):\n    def f(y):\n        return y\n" + REC + "\n\nf = main\n", "main"),
    # Catches: any keyword argument (not only one named like the entry) taken as making a rename unsafe.
    ("def main(xs):\n    return sorted(xs, reverse=True)\n", "def f(xs):\n    return sorted(xs, reverse=True)\n",
     "main"),
    # Catches: replacing the spots left to right on one line (later offsets shift after the first rename).
    ("def fact(n): return 1 if n < 2 else n * fact(n - 1)\n", "def f(n): return 1 if n < 2 else n * f(n - 1)\n",
     "fact"),
    # The only function no other one calls is the entry, even when it is not the last one; with two such
    # roots, the last function is. Catches: the single-root rule ignored or miscounted.
    ("def solve(x):\n    return helper(x)\n\ndef helper(x):\n    return x\n",
     "def f(x):\n    return helper(x)\n\ndef helper(x):\n    return x\n", "solve"),
    ("def a(x):\n    return x\n\ndef b(x):\n    return x\n", "def a(x):\n    return x\n\ndef f(x):\n    return x\n",
     "b"),
])
def test_entry_choice_and_rename_exact_source(src, expected, entry):
    p = parse_program(src)
    assert p.source == expected and p.renamed_from == entry


def test_unsafe_rename_keeps_recursion_working():
    # Catches: the renamed recursive call resolving to the local ``f`` (a parameter: TypeError; a nested
    # def: the identity) instead of the program's entry.
    for src in ("def main(x, f=0):\n" + REC, "def main(x):\n    def f(y):\n        return y + 100\n" + REC):
        scope: dict = {}
        exec(parse_program(src).source, scope)  # the test's own trusted programs
        assert scope["f"](3) == 0


@pytest.mark.parametrize("src, classes", [
    # Catches: namedtuple / NamedTuple assignments not read as classes (plain name or module attribute).
    ("from collections import namedtuple\nP = namedtuple('P', 'x y')\ndef f(p):\n    return p\n", {"P"}),
    ("import collections\nimport typing\nP = collections.namedtuple('P', 'x')\n"
     "Q = typing.NamedTuple('Q', [('x', int)])\nR = dict(a=1)\nclass S:\n    pass\ndef f(p):\n    return p\n",
     {"P", "Q", "S"}),
])
def test_defined_classes_include_named_tuples(src, classes):
    assert parse_program(src).classes == classes
