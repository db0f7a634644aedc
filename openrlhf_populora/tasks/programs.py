"""Program parsing: read a proposed or predicted program and make its entry point ``f``.

Nothing is executed: the text is ``ast.parse``d, top-level calls are stripped and the entry is renamed.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass

from openrlhf_populora.tasks.parsing import ParseError
from openrlhf_populora.tasks.values import _safe_parse

MAX_PROGRAM_CHARS = 20_000


@dataclass(frozen=True)
class Program:
    """A parsed program: ``source`` defines ``f``; ``renamed_from`` is the original entry name, if any."""

    source: str
    renamed_from: str | None
    classes: frozenset[str]
    tree: ast.Module


def _is_main_guard(stmt: ast.stmt) -> bool:
    return (isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Compare)
            and "__name__" in ast.unparse(stmt.test))


def _strip_top_level(source: str, tree: ast.Module) -> str:
    """Drop top-level expression statements (calls such as ``print(f(3))``), asserts and ``__main__``
    guards: a program is definitions only. Comments elsewhere are kept."""
    drop = [s for s in tree.body if isinstance(s, (ast.Expr, ast.Assert)) or _is_main_guard(s)]
    if not drop:
        return source
    keep = [s for s in tree.body if s not in drop]
    drop_lines = {ln for s in drop for ln in range(s.lineno, s.end_lineno + 1)}
    keep_lines = {ln for s in keep for ln in range(s.lineno, s.end_lineno + 1)}
    if drop_lines & keep_lines:  # statements sharing a line (``a = 1; print(a)``): rebuild from the AST
        return ast.unparse(ast.Module(body=keep, type_ignores=[])) + "\n"
    lines = source.splitlines(keepends=True)
    return "".join(line for i, line in enumerate(lines, start=1) if i not in drop_lines)


def _defined_classes(tree: ast.Module) -> frozenset[str]:
    names = {s.name for s in tree.body if isinstance(s, ast.ClassDef)}
    for s in tree.body:  # P = namedtuple('P', ...) / NamedTuple(...)
        if isinstance(s, ast.Assign) and isinstance(s.value, ast.Call):
            func = s.value.func
            fname = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if fname in ("namedtuple", "NamedTuple"):
                names.update(t.id for t in s.targets if isinstance(t, ast.Name))
    return frozenset(names)


def _choose_entry(tree: ast.Module) -> str:
    funcs = [s for s in tree.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if not funcs:
        raise ParseError("no_function")
    referenced: set[str] = set()
    for fn in funcs:
        for n in ast.walk(fn):
            if isinstance(n, ast.Name) and n.id != fn.name:
                referenced.add(n.id)
    roots = [fn.name for fn in funcs if fn.name not in referenced]
    return roots[0] if len(roots) == 1 else funcs[-1].name


def _rename(source: str, tree: ast.Module, old: str) -> str | None:
    """Rename function ``old`` to ``f`` at its def and every plain-name use; None when not safe."""
    spots: list[tuple[int, int, int]] = []  # (line, col start, col end)
    lines = source.splitlines(keepends=True)
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and n.id == "f":
            return None
        if isinstance(n, ast.arg) and n.arg in ("f", old):
            return None
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == "f":
            return None
        if isinstance(n, ast.Name) and n.id == old:
            if n.lineno != n.end_lineno:
                return None
            spots.append((n.lineno, n.col_offset, n.end_col_offset))
        if isinstance(n, ast.keyword) and n.arg == old:
            return None
    defs = [s for s in ast.walk(tree) if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and s.name == old]
    if len(defs) != 1:
        return None
    d = defs[0]
    raw = lines[d.lineno - 1].encode()
    m = re.compile(rb"def\s+(" + re.escape(old.encode()) + rb")\b").search(raw, d.col_offset)
    if m is None:
        return None
    spots.append((d.lineno, m.start(1), m.end(1)))
    for lineno, start, end in sorted(spots, reverse=True):  # AST offsets are UTF-8 byte offsets
        raw = lines[lineno - 1].encode()
        lines[lineno - 1] = (raw[:start] + b"f" + raw[end:]).decode()
    return "".join(lines)


def parse_program(text: str, *, strip_top_level: bool = True) -> Program:
    """Read a program whose entry point becomes ``f``.

    Helper functions, classes and nested defs are allowed (AZR rejected any second ``def``). The entry is a
    top-level ``f`` if there is one; otherwise the only top-level function no other one calls, else the
    last top-level function; it is renamed to ``f`` (or aliased with ``f = name`` when renaming is unsafe).
    """
    if not isinstance(text, str) or not text.strip():
        raise ParseError("empty")
    source = textwrap.dedent(text).strip("\n") + "\n"
    if len(source) > MAX_PROGRAM_CHARS:
        raise ParseError("program_too_long")
    tree = _safe_parse(source, "exec")
    if strip_top_level:
        source = _strip_top_level(source, tree)
        tree = _safe_parse(source, "exec")
    top_names = {s.name for s in tree.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assigned_f = any(isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "f" for t in s.targets)
                     for s in tree.body)
    renamed_from = None
    if "f" not in top_names and not assigned_f:
        renamed_from = _choose_entry(tree)
        new_source = _rename(source, tree, renamed_from)
        if new_source is None:
            new_source = source.rstrip("\n") + f"\n\n\nf = {renamed_from}\n"
        source = new_source
        tree = _safe_parse(source, "exec")
    return Program(source=source, renamed_from=renamed_from, classes=_defined_classes(tree), tree=tree)
