"""Reduce a model's program to the code its tests need, as EvalPlus's sanitizer does (``evalplus.sanitize``).

A chat model answering "write a function" often adds its own tests after the function: asserts it made up,
prints, a demo call, a ``check_solution()``. Run whole, a wrong made-up assert fails a correct function (the
0.5B base model's ``multiples_of_num(4, 3) == [3, 6, 9, 12]`` on MBPP), and a slow demo can time it out. The
published HumanEval(+) and MBPP(+) numbers are graded after EvalPlus's sanitizer removes that code; so are
ours (``code_grading.candidate_program``), with its rules:

- the longest run of whole lines that parses is the program (text after a completion cut off mid-statement by
  the token budget, or prose around the code, is left out);
- kept: every top-level import, and the top-level definitions (functions, classes, assignments to a name) that
  the roots reach, following every name a kept definition uses;
- dropped: every other top-level statement (asserts, calls, prints, loops, ``if __name__ == "__main__":``).

Two deliberate differences from ``evalplus.sanitize`` 0.3.1, each of which fails a benchmark's own reference
solution there: the roots are the entry point **and every name the problem's tests use** (HumanEval/50's test
calls ``encode_shift`` from the prompt; MBPP/367's setup code builds ``Node`` objects the solution never names),
and a function is kept whether or not it contains ``return`` (EvalPlus drops one that does not, turning a
function that loops forever into a missing one). A name defined twice keeps its last definition, as Python
would run it (EvalPlus keeps the first). This module only parses; nothing of the program runs here.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def longest_parsable_span(program: str) -> str:
    """``program`` when it parses, else its longest run of consecutive lines that does (counted in non-blank
    lines, the earliest such run on a tie), or "" when no line parses."""
    if _parses(program):
        return program
    lines = program.split("\n")
    best, best_len = "", 0
    for i in range(len(lines)):
        for j in range(len(lines), i, -1):  # longest first: the first that parses is this start's best
            size = sum(1 for line in lines[i:j] if line.strip())
            if size <= best_len:
                break
            chunk = "\n".join(lines[i:j])
            if _parses(chunk):
                best, best_len = chunk, size
                break
    return best


def _parses(source: str) -> bool:
    try:
        ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


def _defined_name(node: ast.stmt) -> str | None:
    if isinstance(node, _DEFINITIONS):
        return node.name
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
        return node.target.id
    return None


def _source(lines: list[str], node: ast.stmt) -> str:
    """The exact text of a top-level statement, decorators included."""
    first = node.decorator_list[0] if isinstance(node, _DEFINITIONS) and node.decorator_list else node
    start = first.lineno - 1
    col = first.col_offset - (1 if first is not node else 0)  # a decorator's '@' precedes its expression
    end, end_col = node.end_lineno - 1, node.end_col_offset
    if start == end:
        return lines[start][col:end_col]
    return "".join([lines[start][col:], *lines[start + 1:end], lines[end][:end_col]])


def names_used(source: str) -> set[str]:
    """Every name ``source`` loads or binds (the tests' names, for ``sanitize``'s roots); empty if it does not
    parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return set()
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


def sanitize(program: str, roots: Iterable[str]) -> str:
    """``program`` reduced to its imports and the definitions ``roots`` reach (see the module docstring). A
    program none of whose lines parse is returned unchanged: it fails as written."""
    code = longest_parsable_span(program)
    if not code.strip():
        return program
    tree = ast.parse(code)
    lines = code.splitlines(keepends=True)
    definitions: dict[str, ast.stmt] = {}
    for node in tree.body:
        name = _defined_name(node)
        if name is not None:
            definitions[name] = node  # the last definition of a name is the one Python keeps
    uses = {name: {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} - {name}
            for name, node in definitions.items()}
    reached, todo = set(), [r for r in roots if r in definitions]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(u for u in uses[name] if u in definitions)
    kept_nodes = {id(definitions[name]) for name in reached}
    kept = [_source(lines, node) for node in tree.body
            if isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in kept_nodes]
    return "\n".join(kept) + "\n" if kept else program
