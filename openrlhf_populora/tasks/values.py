"""Value literals: the grammar an answer must follow to be a *value*, never a computation.

Accepted: constants (``-`` on numbers, ``a+bj`` complex literals), tuples, lists, sets, dicts,
``set()``/``frozenset(...)``/``bytearray(...)``, and calls to a given set of class names (the classes the
task's program defines, when its values are instances of them). Names, attributes, lambdas, comprehensions,
operators and any other call are rejected, and so is anything too large or too deep. Nothing is executed:
texts are only ``ast.parse``d.
"""

from __future__ import annotations

import ast

from openrlhf_populora.tasks.parsing import ParseError

MAX_VALUE_CHARS = 20_000
MAX_VALUE_NODES = 5_000
MAX_VALUE_DEPTH = 50
BUILTIN_CONSTRUCTORS = frozenset({"set", "frozenset", "bytearray"})
ARGS_SENTINEL = "__populora_args__"


def _safe_parse(source: str, mode: str) -> ast.AST:
    try:
        return ast.parse(source, mode=mode)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as e:
        raise ParseError("syntax", type(e).__name__) from None


def _is_number(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    return (isinstance(node, ast.Constant) and type(node.value) in (int, float, complex))


def _builtin_call_ok(call: ast.Call) -> bool:
    """``set()``, ``frozenset({...})``, ``bytearray(b'...')``: what their reprs look like, nothing else
    (``bytearray(10**9)``-style sizes would allocate when the value is built)."""
    if call.keywords or len(call.args) > 1:
        return False
    if not call.args:
        return True
    arg = call.args[0]
    if call.func.id == "bytearray":
        return isinstance(arg, ast.Constant) and isinstance(arg.value, bytes)
    return isinstance(arg, (ast.Set, ast.List, ast.Tuple, ast.Dict)) or (
        isinstance(arg, ast.Constant) and isinstance(arg.value, (str, bytes)))


def check_value(node: ast.AST, classes: frozenset[str] | set[str] = frozenset()) -> None:
    """Raise ParseError unless ``node`` is a value literal in the grammar above."""
    count = 0
    stack: list[tuple[ast.AST, int]] = [(node, 0)]
    while stack:
        n, depth = stack.pop()
        count += 1
        if count > MAX_VALUE_NODES or depth > MAX_VALUE_DEPTH:
            raise ParseError("value_too_large")
        if isinstance(n, ast.Constant):
            continue
        if isinstance(n, ast.UnaryOp):
            if not _is_number(n):
                raise ParseError("not_a_value", "operator")
            continue
        if isinstance(n, ast.BinOp):  # complex literal such as (1+2j) or (-1-2j)
            real = n.left.operand if isinstance(n.left, ast.UnaryOp) else n.left
            ok = (isinstance(n.op, (ast.Add, ast.Sub)) and _is_number(n.left)
                  and type(getattr(real, "value", None)) in (int, float)
                  and isinstance(n.right, ast.Constant) and type(n.right.value) is complex)
            if not ok:
                raise ParseError("not_a_value", "operator")
            continue
        if isinstance(n, (ast.Tuple, ast.List, ast.Set)):
            for elt in n.elts:
                if isinstance(elt, ast.Starred):
                    raise ParseError("not_a_value", "starred")
                stack.append((elt, depth + 1))
            continue
        if isinstance(n, ast.Dict):
            for k, v in zip(n.keys, n.values, strict=True):
                if k is None:
                    raise ParseError("not_a_value", "dict unpacking")
                stack.append((k, depth + 1))
                stack.append((v, depth + 1))
            continue
        if isinstance(n, ast.Call):
            name = n.func.id if isinstance(n.func, ast.Name) else None
            if name is None or (name not in BUILTIN_CONSTRUCTORS and name not in classes):
                raise ParseError("not_a_value", f"call to {ast.unparse(n.func)[:40]}")
            if name in BUILTIN_CONSTRUCTORS and name not in classes and not _builtin_call_ok(n):
                raise ParseError("not_a_value", f"{name}(...) must wrap a literal")
            for a in n.args:
                if isinstance(a, ast.Starred):
                    raise ParseError("not_a_value", "starred")
                stack.append((a, depth + 1))
            for kw in n.keywords:
                if kw.arg is None:
                    raise ParseError("not_a_value", "keyword unpacking")
                stack.append((kw.value, depth + 1))
            continue
        raise ParseError("not_a_value", type(n).__name__)


def parse_value(text: str, classes: frozenset[str] | set[str] = frozenset()) -> str:
    """Check ``text`` is one value literal; return its canonical source (``ast.unparse``)."""
    if not isinstance(text, str):
        raise ParseError("empty")
    text = text.strip()
    if not text:
        raise ParseError("empty")
    if len(text) > MAX_VALUE_CHARS:
        raise ParseError("value_too_large")
    tree = _safe_parse(text, "eval")
    check_value(tree.body, classes)
    return ast.unparse(tree.body)


def parse_arguments(text: str, classes: frozenset[str] | set[str] = frozenset()) -> str:
    """Check ``text`` is an argument list of value literals (keywords allowed); return it canonically.

    The text is parsed as the inside of a call; the result must be exactly one call of a sentinel name,
    so text that closes the parenthesis early or adds statements is rejected, never executed.
    """
    if not isinstance(text, str):
        raise ParseError("empty")
    text = text.strip()
    if not text:
        raise ParseError("empty")
    if len(text) > MAX_VALUE_CHARS:
        raise ParseError("value_too_large")
    tree = _safe_parse(f"{ARGS_SENTINEL}(\n{text}\n)", "eval")
    call = tree.body
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == ARGS_SENTINEL):
        raise ParseError("not_an_argument_list")
    parts = []
    for a in call.args:
        if isinstance(a, ast.Starred):
            raise ParseError("not_a_value", "starred")
        check_value(a, classes)
        parts.append(ast.unparse(a))
    for kw in call.keywords:
        if kw.arg is None:
            raise ParseError("not_a_value", "keyword unpacking")
        check_value(kw.value, classes)
        parts.append(f"{kw.arg}={ast.unparse(kw.value)}")
    if not parts:
        raise ParseError("empty")
    return ", ".join(parts)


def called_names(text: str) -> frozenset[str]:
    """Names called in a (valid) value or argument-list text, e.g. ``{'Point'}`` for ``Point(x=1)``."""
    try:
        tree = ast.parse(f"{ARGS_SENTINEL}(\n{text}\n)", mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return frozenset()
    names = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return frozenset(names - {ARGS_SENTINEL})


class Instance(tuple):
    """A constructor call ``Name(args, k=v)`` read structurally: equal iff same name and equal arguments."""

    __slots__ = ()


def literal_value(text: str, classes: frozenset[str] | set[str] = frozenset()) -> object:
    """Build the Python value of a checked literal WITHOUT evaluating anything.

    Builtin containers become themselves (sets as frozensets, so they nest), constructor calls of program
    classes become ``Instance`` records compared structurally. Python ``==`` on the result then matches
    value equality (``1 == 1.0``, ``{1, 2} == {2, 1}``, ``(1,) != [1]``). Raises ParseError.
    """
    tree = _safe_parse(parse_value(text, classes), "eval")

    def build(n: ast.AST) -> object:
        if isinstance(n, ast.Constant):
            return n.value
        if isinstance(n, ast.UnaryOp):
            v = build(n.operand)
            return -v if isinstance(n.op, ast.USub) else +v
        if isinstance(n, ast.BinOp):
            left, right = build(n.left), build(n.right)
            return left + right if isinstance(n.op, ast.Add) else left - right
        if isinstance(n, ast.Tuple):
            return tuple(build(e) for e in n.elts)
        if isinstance(n, ast.List):
            return [build(e) for e in n.elts]
        if isinstance(n, ast.Set):
            return frozenset(build(e) for e in n.elts)
        if isinstance(n, ast.Dict):
            return {build(k): build(v) for k, v in zip(n.keys, n.values, strict=True)}
        if isinstance(n, ast.Call):
            name = n.func.id
            args = tuple(build(a) for a in n.args)
            if name in ("set", "frozenset") and not n.keywords and len(args) <= 1:
                return frozenset(args[0]) if args else frozenset()
            if name == "bytearray" and not n.keywords and len(args) <= 1:
                return bytearray(args[0]) if args else bytearray()
            kwargs = tuple(sorted((k.arg, _freeze(build(k.value))) for k in n.keywords))
            return Instance((name, tuple(_freeze(a) for a in args), kwargs))
        raise ParseError("not_a_value", type(n).__name__)

    try:
        return build(tree.body)
    except ParseError:
        raise
    except Exception as e:  # unhashable set element or dict key, huge bytearray, ...
        raise ParseError("not_a_value", type(e).__name__) from None


def _freeze(v: object) -> object:
    if isinstance(v, list):
        return ("__list__", tuple(_freeze(x) for x in v))
    if isinstance(v, dict):
        return ("__dict__", frozenset((_freeze(k), _freeze(x)) for k, x in v.items()))
    return v
