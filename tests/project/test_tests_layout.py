"""The tests mirror the layers (CONTRIBUTING.md, Tests): every test file sits in one of the four folders, and
no test module imports another one (what tests share lives in ``tests/support/``)."""

from __future__ import annotations

import ast

from paths import ROOT

TESTS = ROOT / "tests"
FOLDERS = {"unit", "integration", "cluster", "project"}


def test_every_test_file_sits_in_a_layer_folder():
    """Catches: a new test file dropped flat into ``tests/`` or into a folder of its own."""
    misplaced = [str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
                 if p.relative_to(TESTS).parts[0] not in FOLDERS]
    assert misplaced == []


def test_no_test_module_imports_another():
    """Catches: ``import test_selfplay_loop as loop_tests`` (a test file's helpers borrowed by another: moving
    or renaming the first breaks the second); shared helpers go to ``tests/support/``."""
    borrowed = []
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            borrowed += [f"{path.relative_to(TESTS)}: {n}" for n in names if n.split(".")[-1].startswith("test_")]
    assert borrowed == []
