"""Program complexity along five axes, robust to any program text.

For a program ``code`` (Python source):

- ``ast_depth``       longest root-to-leaf path of the AST, counted in nodes below the ``Module`` node
                      (``x = 1`` -> Assign -> Name = 2). Expression-context nodes (Load/Store/Del) are ignored.
- ``ast_nodes``       number of AST nodes, again without the ``Module`` node and context nodes.
- ``cyclomatic``      McCabe cyclomatic complexity from ``radon``: the largest over the module body and
                      every function and method (not radon's per-class aggregate) (a straight-line function is 1; each ``if``/loop/boolean
                      operator/except/comprehension adds one).
- ``loc``             source lines of code (radon's ``sloc``: lines that are neither blank nor comments).
- ``halstead_volume`` Halstead volume N·log2(n) over the whole module (radon ``h_visit``), with N the
                      total and n the distinct count of operators and operands.

A program that does not parse gets ``None`` for every axis; an axis whose tool fails gets ``None`` alone.
No program text ever raises; a non-string argument raises ``TypeError``.
"""

from __future__ import annotations

import ast

from openrlhf_populora.metrics.keys import COMPLEXITY_AXES


def _empty() -> dict[str, float | None]:
    return dict.fromkeys(COMPLEXITY_AXES)


def ast_shape(tree: ast.AST) -> tuple[int, int]:
    """``(depth, nodes)`` of an AST, iteratively (deeply nested code cannot overflow the stack)."""
    depth, nodes = 0, 0
    stack = [(child, 1) for child in ast.iter_child_nodes(tree)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, ast.expr_context):
            continue
        nodes += 1
        depth = max(depth, level)
        stack.extend((child, level + 1) for child in ast.iter_child_nodes(node))
    return depth, nodes


def _cyclomatic(code: str) -> float:
    from radon.visitors import ComplexityVisitor

    visitor = ComplexityVisitor.from_code(code)
    values = [visitor.complexity]
    for block in visitor.blocks:
        methods = getattr(block, "methods", None)
        if methods is None:  # a function (radon lists methods as functions too)
            values.append(block.complexity)
        else:  # a class: radon's class score is an aggregate, use its methods instead
            values.extend(method.complexity for method in methods)
    return float(max(values))


def _loc(code: str) -> float:
    from radon.raw import analyze

    return float(analyze(code).sloc)


def _halstead_volume(code: str) -> float:
    from radon.metrics import h_visit

    return float(h_visit(code).total.volume)


def program_complexity(code: str) -> dict[str, float | None]:
    """Complexity of one program: ``{axis: value or None}`` for every axis in ``keys.COMPLEXITY_AXES``."""
    if not isinstance(code, str):
        raise TypeError(f"program_complexity expects the program text as str, got {type(code).__name__}")
    result = _empty()
    try:
        tree = ast.parse(code)
        depth, nodes = ast_shape(tree)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return result
    result["ast_depth"], result["ast_nodes"] = float(depth), float(nodes)
    for axis, tool in (("cyclomatic", _cyclomatic), ("loc", _loc), ("halstead_volume", _halstead_volume)):
        try:
            result[axis] = tool(code)
        except Exception:  # radon has parse quirks of its own: a missing value, never a crash
            result[axis] = None
    return result
