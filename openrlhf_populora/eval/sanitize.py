"""Reduce a model's program to the code its tests need, as EvalPlus's sanitizer does (``evalplus.sanitize``).

A chat model answering "write a function" often adds its own tests after the function: asserts it made up,
prints, a demo call, a ``check_solution()``. Run whole, a wrong made-up assert fails a correct function (the
0.5B base model's ``multiples_of_num(4, 3) == [3, 6, 9, 12]`` on MBPP), and a slow demo can time it out. The
published HumanEval(+) and MBPP(+) numbers are graded after EvalPlus's sanitizer removes that code; so are
ours (``code_grading.candidate_program``), with its rules:

- the longest run of whole lines that parses is the program (text after a completion cut off mid-statement by
  the token budget, or prose around the code, is left out);
- kept: every top-level import, and the top-level bindings (functions, classes, assignments) of the names the
  roots reach, following every name a kept binding uses;
- dropped: every other top-level statement (asserts, calls, prints, loops, ``if __name__ == "__main__":``).

Where ``evalplus.sanitize`` 0.3.1 fails correct code, we do not follow it:

- the roots are the entry point **and the free names of the problem's tests** (``free_names``: HumanEval/50's
  test calls ``encode_shift`` from the prompt; MBPP/367's setup code builds ``Node`` objects the solution never
  names); EvalPlus follows the entry point alone and fails both reference solutions;
- a function is kept whether or not it contains ``return`` (EvalPlus drops one that does not);
- every top-level binding of a reached name is kept, in source order, so Python's own last-one-wins holds and a
  rebinding such as ``f = functools.lru_cache(None)(f)`` keeps the ``def f`` it wraps; a tuple or chained
  assignment (``A, B = 1, 2``) binds each of its names, and a top-level ``try``/``if`` made only of imports,
  definitions and assignments (``try: import numpy as np`` / ``except ImportError: np = None``) is kept like an
  import when it imports, else bound like a definition;
- a program in which no root is defined is returned unchanged, so it fails with its own error.

Kept statements are copied as written (``ast.get_source_segment``, decorators included), so line numbers in a
traceback differ but nothing else. This module only parses; nothing of the program runs here.
"""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterable

_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_IMPORTS = (ast.Import, ast.ImportFrom)
_BINDINGS = (*_DEFINITIONS, ast.Assign, ast.AnnAssign, ast.AugAssign)
# the span search parses at most this many candidate spans, then keeps the best found (a completion of hundreds
# of unparsable lines, a 0.5B model's repetition loop, would otherwise cost seconds in the grading process)
SPAN_SEARCH_BUDGET = 2000


def _parses(source: str) -> bool:
    try:
        ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


def longest_parsable_span(program: str, budget: int = SPAN_SEARCH_BUDGET) -> str:
    """``program`` when it parses, else its longest run of consecutive lines that does (counted in non-blank
    lines, the earliest such run on a tie; after ``budget`` parses, the best found so far), or "" when none."""
    if _parses(program):
        return program
    lines = program.split("\n")
    best, best_len, tries = "", 0, 0
    for i in range(len(lines)):
        for j in range(len(lines), i, -1):  # longest first: the first that parses is this start's best
            size = sum(1 for line in lines[i:j] if line.strip())
            if size <= best_len:
                break
            chunk = "\n".join(lines[i:j])
            tries += 1
            if _parses(chunk):
                best, best_len = chunk, size
                break
            if tries >= budget:
                return best
    return best


def free_names(source: str) -> set[str]:
    """The names ``source`` (a test) reads but neither binds, imports, takes as a parameter nor gets from
    builtins: what it expects the program under test to define. Empty when it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return set()
    loaded, bound = set(), set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, _IMPORTS):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (*_DEFINITIONS,)):
            bound.add(node.name)
    return loaded - bound


def _only_definitions(node: ast.stmt) -> bool:
    """A top-level ``try``/``if`` whose every statement imports, defines, assigns or passes."""
    body = [*node.body, *node.orelse]
    if isinstance(node, ast.Try):
        body += [*node.finalbody, *(s for handler in node.handlers for s in handler.body)]
    return all(isinstance(s, (*_IMPORTS, *_BINDINGS, ast.Pass)) or (isinstance(s, (ast.Try, ast.If))
                                                                      and _only_definitions(s)) for s in body)


def _bound_names(node: ast.stmt) -> set[str]:
    """The top-level names a statement binds: a definition's name, an assignment's target names, the bindings
    of a guarded block without imports (one with imports is always kept)."""
    if isinstance(node, _DEFINITIONS):
        return {node.name}
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        if isinstance(node, ast.AnnAssign) and node.value is None:
            return set()  # a bare annotation binds nothing
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    if isinstance(node, (ast.Try, ast.If)):
        return set().union(*(_bound_names(s) for s in ast.iter_child_nodes(node) if isinstance(s, ast.stmt)),
                           *(_bound_names(s) for h in getattr(node, "handlers", []) for s in h.body))
    return set()


def _source(code: str, node: ast.stmt) -> str:
    """The text of a top-level statement as written, decorators included."""
    decorators = node.decorator_list if isinstance(node, _DEFINITIONS) else []
    return "".join(f"@{ast.get_source_segment(code, d)}\n" for d in decorators) + ast.get_source_segment(code, node)


def sanitize(program: str, roots: Iterable[str]) -> str:
    """``program`` reduced to its imports and the bindings of the names ``roots`` reach (see the module
    docstring); unchanged when no root is defined in it (or nothing of it parses)."""
    code = longest_parsable_span(program)
    if not code.strip():
        return program
    tree = ast.parse(code)
    bindings: dict[str, list[ast.stmt]] = {}
    always: list[ast.stmt] = []  # imports, and guarded blocks that import
    for node in tree.body:
        guarded = isinstance(node, (ast.Try, ast.If)) and _only_definitions(node)
        if isinstance(node, _IMPORTS) or (guarded and any(isinstance(n, _IMPORTS) for n in ast.walk(node))):
            always.append(node)
        elif isinstance(node, _BINDINGS) or guarded:
            for name in _bound_names(node):
                bindings.setdefault(name, []).append(node)
    reached, todo = set(), [r for r in roots if r in bindings]
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        for node in bindings[name]:
            todo.extend(n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in bindings)
    if not reached:
        return program
    kept = {id(node) for name in reached for node in bindings[name]} | {id(node) for node in always}
    return "\n".join(_source(code, node) for node in tree.body if id(node) in kept) + "\n"
