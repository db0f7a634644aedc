"""Grade code completions by running each benchmark's tests in the project's ``Sandbox``.

For each (problem, completion) one sandbox job runs a *harness* program that embeds the candidate source as a
string, ``exec``s it in its own namespace and runs the tests; the job's expression is ``'passed'``, so a
completion passes iff the job ends with status ``ok`` (any failed assert, exception, timeout, memory or
output overflow is a failure). Per-test time limits come from ``signal.setitimer`` inside the job; the
sandbox's own wall-clock limit bounds the whole job.

Test kinds (see ``problems``):
- ``check`` (HumanEval): the candidate program, then the benchmark's ``check`` function in the same namespace,
  then ``check(<entry_point>)``.
- ``io`` (EvalPlus, differential): expected = reference(*input), got = candidate(*input) on deep copies;
  equal iff ``got == expected``, or, for float outputs (a float or a flat list/tuple of floats),
  ``|got - exp| <= atol + 1e-7 |exp|`` elementwise with ``atol = max(record atol, 1e-6)``. EvalPlus's task
  quirks are kept: ``find_zero`` (HumanEval/32) passes iff ``|poly(xs, got)| <= atol``; a few MBPP+ tasks
  compare as sets or only require a non-None result (``_SET_EQUAL`` / ``_NOT_NONE``).
- ``stdin`` (LiveCodeBench): the program runs as ``__main__`` with the case input on stdin; outputs match iff
  their stripped lines are equal, or every whitespace-separated token is equal as text or as a Decimal.
- ``functional`` (LiveCodeBench/LeetCode): ``Solution().<func_name>(*args)`` with one JSON argument per
  input line; results match iff equal after turning tuples into lists.

The candidate runs with ``__name__ != "__main__"`` (except LiveCodeBench stdin programs, which are scripts),
so its own demo code under ``if __name__ == "__main__":`` does not run. Code from the model is untrusted and
only ever runs inside the sandbox.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from openrlhf_populora.eval.problems import Problem
from openrlhf_populora.eval.sanitize import free_names, sanitize

PASS_EXPR = "'passed'"
PASS_VALUE = repr("passed")
_SET_EQUAL = ("similar_elements", "find_char_long", "common_in_nested_lists", "extract_singly", "larg_nnum",
              "intersection_array", "find_dissimilar", "Diff")
_NOT_NONE = ("check_str", "text_match_three", "text_starta_endb")
# names LeetCode-style solutions use without importing them (LiveCodeBench runs code with similar imports)
_PRELUDE = (
    "from typing import *\nfrom collections import *\nfrom heapq import *\nfrom bisect import *\n"
    "from itertools import *\nfrom functools import *\nfrom math import *\n"
    "import collections, heapq, bisect, itertools, functools, math, string, re, sys\n"
)

# Shared by every harness: a per-test timer. Runs inside the sandbox only.
_TIMER = '''
import signal as _signal

class _TestTimeout(Exception):
    pass

def _on_alarm(signum, frame):
    raise _TestTimeout("test exceeded {limit}s")

class _limit:
    def __enter__(self):
        try:
            _signal.signal(_signal.SIGALRM, _on_alarm)
            _signal.setitimer(_signal.ITIMER_REAL, {limit})
        except ValueError:  # not the main thread: the sandbox's wall-clock limit still applies
            pass
    def __exit__(self, *exc):
        try:
            _signal.setitimer(_signal.ITIMER_REAL, 0)
        except ValueError:
            pass
        return False
'''

_CHECK_HARNESS = '''
_ns = {{"__name__": "__candidate__"}}
with _limit():
    exec(compile({candidate!r}, "<solution>", "exec"), _ns)
if {entry!r} not in _ns:
    raise NameError("the solution defines no function named " + {entry!r})
exec(compile({test!r}, "<test>", "exec"), _ns)
with _limit():
    _ns["check"](_ns[{entry!r}])
'''

_ASSERTS_HARNESS = '''
_ns = {{"__name__": "__candidate__"}}
with _limit():
    exec(compile({candidate!r}, "<solution>", "exec"), _ns)
if {entry!r} not in _ns:
    raise NameError("the solution defines no function named " + {entry!r})
exec(compile({setup!r}, "<setup>", "exec"), _ns)
for _i, _assert in enumerate({asserts!r}):
    with _limit():
        exec(compile(_assert, "<test %d>" % _i, "exec"), _ns)
'''

_IO_HARNESS = '''
import copy as _copy
_ref_ns = {{"__name__": "__reference__"}}
exec(compile({reference!r}, "<reference>", "exec"), _ref_ns)
_cand_ns = {{"__name__": "__candidate__"}}
with _limit():
    exec(compile({candidate!r}, "<solution>", "exec"), _cand_ns)
if {entry!r} not in _cand_ns:
    raise NameError("the solution defines no function named " + {entry!r})
_ref, _cand, _atol = _ref_ns[{entry!r}], _cand_ns[{entry!r}], max({atol!r}, 1e-6)

def _is_floats(x):
    if isinstance(x, float):
        return True
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(v, float) for v in x)

def _close(a, b):
    return abs(a - b) <= _atol + 1e-7 * abs(b)

def _same(got, exp):
    if {entry!r} in {set_equal!r}:
        return set(got) == set(exp)
    if {entry!r} in {not_none!r}:
        return got is not None
    if got == exp:
        return True
    if _is_floats(exp):
        if isinstance(exp, float):
            return isinstance(got, (int, float)) and _close(got, exp)
        return (isinstance(got, (list, tuple)) and len(got) == len(exp)
                and all(isinstance(g, (int, float)) and _close(g, e) for g, e in zip(got, exp)))
    return False

import json as _json
for _i, _args in enumerate(_json.loads({inputs!r})):
    _exp = _ref(*_copy.deepcopy(_args))
    with _limit():
        _got = _cand(*_copy.deepcopy(_args))
    if {entry!r} == "find_zero":
        _ok = isinstance(_got, (int, float)) and abs(_ref_ns["poly"](_args[0], _got)) <= _atol
    else:
        _ok = _same(_got, _exp)
    if not _ok:
        raise AssertionError("input #%d: expected %.200r, got %.200r" % (_i, _exp, _got))
'''

_LCB_HARNESS = '''
import io as _io, json as _json, sys as _sys
from decimal import Decimal as _Decimal, InvalidOperation as _InvalidOperation
_code = compile({prelude!r} + {candidate!r}, "<solution>", "exec")

def _run_stdin(data):
    stdin = _io.TextIOWrapper(_io.BytesIO(data.encode()), encoding="utf-8")
    raw = _io.BytesIO()
    stdout = _io.TextIOWrapper(raw, encoding="utf-8", write_through=True)

    def _open(file, mode="r", *args, **kwargs):  # open(0) / open("/dev/stdin") read the test input too
        if file in (0, "/dev/stdin"):
            return _io.BytesIO(data.encode()) if "b" in mode else _io.StringIO(data)
        return open(file, mode, *args, **kwargs)

    saved = _sys.stdin, _sys.stdout
    _sys.stdin, _sys.stdout = stdin, stdout
    try:
        exec(_code, {{"__name__": "__main__", "open": _open}})
    except SystemExit:
        pass
    finally:
        stdout.flush()
        _sys.stdin, _sys.stdout = saved
    return raw.getvalue().decode("utf-8", "replace")

def _token_equal(a, b):
    if a == b:
        return True
    try:
        return _Decimal(a) == _Decimal(b)
    except (_InvalidOperation, ValueError):
        return False

def _same_text(got, exp):
    g = [line.strip() for line in got.strip().splitlines()]
    e = [line.strip() for line in exp.strip().splitlines()]
    if g == e:
        return True
    if len(g) != len(e):
        return False
    for gl, el in zip(g, e):
        gt, et = gl.split(), el.split()
        if len(gt) != len(et) or not all(_token_equal(x, y) for x, y in zip(gt, et)):
            return False
    return True

def _plain(x):
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {{k: _plain(v) for k, v in x.items()}}
    return x

if {kind!r} == "functional":
    _ns = {{"__name__": "__candidate__"}}
    with _limit():
        exec(_code, _ns)
    if "Solution" not in _ns:
        raise NameError("the solution defines no class Solution")

for _i, (_inp, _out) in enumerate({cases!r}):
    with _limit():
        if {kind!r} == "stdin":
            _got = _run_stdin(_inp)
            _ok = _same_text(_got, _out)
        else:
            _args = [_json.loads(line) for line in _inp.split("\\n") if line.strip()]
            _got = getattr(_ns["Solution"](), {func!r})(*_args)
            _ok = _plain(_got) == _plain(_json.loads(_out))
    if not _ok:
        raise AssertionError("test #%d: expected %.200r, got %.200r" % (_i, _out, _got))
'''


@dataclass
class CodeGrade:
    passed: bool
    status: str  # the sandbox status ("ok", "error", "timeout", ...) or "no_code"
    detail: str  # short error text for failures, "" on a pass


def _import_lines(source: str) -> str:
    return "".join(line + "\n" for line in source.splitlines() if re.match(r"(import|from)\s+\w", line))


SANITIZERS = ("definitions", "none")


def _test_names(problem: Problem) -> set[str]:
    """The names a function-level problem's tests expect the program to define (the sanitizer's roots beside the
    entry point)."""
    tests = problem.tests
    if tests.get("kind") == "check":
        return free_names(tests["test"])
    if tests.get("kind") == "asserts":
        return free_names("\n".join([tests.get("setup", ""), *tests["asserts"]]))
    return set()


def candidate_program(problem: Problem, code: str, sanitizer: str = "definitions") -> str:
    """The candidate's program: the extracted code, preceded by the stub's imports; when the code does not
    define the entry point but the problem has a function stub, the code is read as that stub's body. A
    function-level problem's program (HumanEval, MBPP and their EvalPlus versions) is then reduced to its imports
    and the definitions its entry point and tests use (``eval.sanitize``; ``sanitizer="none"`` runs it whole);
    LiveCodeBench's scripts and ``class Solution`` are never sanitized."""
    entry = problem.entry_point
    if problem.tests.get("kind") in ("stdin", "functional"):
        return code
    if entry and problem.starter_code and not re.search(rf"def\s+{re.escape(entry)}\s*\(", code):
        program = problem.starter_code + code
    else:
        program = _import_lines(problem.starter_code) + code
    if sanitizer not in SANITIZERS:
        raise ValueError(f"unknown code sanitizer {sanitizer!r} (one of {', '.join(SANITIZERS)})")
    if not entry or sanitizer == "none":
        return program
    return sanitize(program, {entry, *_test_names(problem)})


def harness(problem: Problem, code: str, per_test_timeout_s: float, sanitizer: str = "definitions") -> str:
    """The full program that tests ``code`` on ``problem`` inside one sandbox job (ends quietly on a pass)."""
    tests = problem.tests
    program = candidate_program(problem, code, sanitizer)
    timer = _TIMER.format(limit=float(per_test_timeout_s))
    kind = tests["kind"]
    if kind == "check":
        return timer + _CHECK_HARNESS.format(candidate=program, test=tests["test"], entry=problem.entry_point)
    if kind == "asserts":
        return timer + _ASSERTS_HARNESS.format(candidate=program, setup=tests.get("setup", ""),
                                               asserts=list(tests["asserts"]), entry=problem.entry_point)
    if kind == "io":
        return timer + _IO_HARNESS.format(
            reference=tests["reference"], candidate=program, entry=problem.entry_point, atol=float(tests["atol"]),
            inputs=json.dumps(tests["inputs"]), set_equal=_SET_EQUAL, not_none=_NOT_NONE,
        )
    return timer + _LCB_HARNESS.format(
        prelude=_PRELUDE, candidate=program, kind=kind, cases=[tuple(c) for c in tests["cases"]],
        func=tests.get("func_name", ""),
    )


def grade_code(
    problems: Sequence[Problem], codes: Sequence[str], sandbox: Any, per_test_timeout_s: float = 6.0,
    sanitizer: str = "definitions",
) -> list[CodeGrade]:
    """Run every (problem, code) pair's tests in ``sandbox`` (a started ``Sandbox``) and grade it (``sanitizer``:
    see ``candidate_program``)."""
    if len(problems) != len(codes):
        raise ValueError(f"{len(problems)} problems but {len(codes)} completions")
    grades: list[CodeGrade | None] = [None] * len(problems)
    jobs, where = [], []
    for i, (problem, code) in enumerate(zip(problems, codes, strict=True)):
        if not code.strip():
            grades[i] = CodeGrade(False, "no_code", "no code found in the completion")
            continue
        jobs.append((harness(problem, code, per_test_timeout_s, sanitizer), PASS_EXPR))
        where.append(i)
    for i, result in zip(where, sandbox.run(jobs) if jobs else [], strict=True):
        passed = result.status == "ok" and result.value == PASS_VALUE
        detail = "" if passed else str(result.error or result.value or "")[-400:]
        grades[i] = CodeGrade(passed, result.status, detail)
    return [g for g in grades if g is not None]
