"""Task-validity rules for proposed programs (a *task* rule list, not the security boundary: that is the
sandbox). A program must be deterministic and self-contained, so it may not import modules that bring
randomness, time, I/O, processes or introspection, nor call the escape hatches listed in ``banned_calls``.

Module matching works on dotted names: an entry ``os`` bans ``import os``, ``import os.path as p`` and
``from os import path``; an entry ``numpy.random`` bans ``from numpy import random`` but not ``import
numpy``. (AZR compared each banned word with single name components, so its dotted entries never matched
and ``import os``, ``import sys`` and ``__import__('subprocess')`` all passed.)
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

# AZR's banned-word list (azr.data_selection_strategy.banned_words), shown to proposers for parity.
AZR_BANNED_WORDS = ("logging", "random", "multiprocessing", "pebble", "subprocess", "threading", "datetime",
                    "time", "hashlib", "hmac", "bcrypt", "os.sys", "os.path", "sys.exit", "os.environ",
                    "calendar", "datetime")

DEFAULT_BANNED_MODULES = (
    "logging", "random", "multiprocessing", "pebble", "subprocess", "threading", "_thread", "datetime",
    "time", "timeit", "sched", "calendar", "zoneinfo", "hashlib", "hmac", "bcrypt", "secrets", "uuid",
    "os", "sys", "shutil", "pathlib", "glob", "tempfile", "io", "socket", "ssl", "select", "selectors",
    "signal", "asyncio", "concurrent", "ctypes", "importlib", "builtins", "gc", "inspect", "resource",
    "mmap", "fcntl", "pty", "platform", "pickle", "marshal", "shelve", "sqlite3", "urllib", "http",
    "requests", "webbrowser", "code", "codeop", "runpy", "atexit", "faulthandler", "numpy.random",
)
DEFAULT_BANNED_CALLS = ("input", "open", "eval", "exec", "compile", "globals", "locals", "vars", "__import__",
                        "breakpoint", "exit", "quit")
BANNED_NAMES = ("__import__", "__builtins__", "__loader__", "__spec__")


@dataclass
class TaskRules:
    """Every knob of proposal validity and answer parsing (AZR parity values noted)."""

    banned_modules: tuple[str, ...] = DEFAULT_BANNED_MODULES
    banned_calls: tuple[str, ...] = DEFAULT_BANNED_CALLS
    prompt_banned_words: tuple[str, ...] = field(default=AZR_BANNED_WORDS)  # listed in proposer prompts
    max_output_chars: int = 400  # AZR truncated reprs over 400 chars; we reject them
    max_input_chars: int = 1000
    induction_inputs: int = 10  # AZR: 10 inputs, the last 10 ```input blocks count
    induction_min_inputs: int = 10  # fewer distinct valid inputs -> invalid proposal
    reject_none_output: bool = True  # AZR accepted f returning None; the prompt asks for a value
    require_tags: bool = False  # demand </think> ... <answer>...</answer> (AZR's format rule)
    strip_top_level: bool = True  # drop top-level calls/prints/asserts/__main__ guards from programs
    # no ```input block: take the arguments of the program's own top-level call of its entry function
    # (``f(3, 'a')`` or ``print(f(3, 'a'))``), which small models often write instead of the block
    input_from_call: bool = True
    # still none: the first UNLABELLED fenced block after the program holding a call of f or text that reads
    # as arguments ("```\nf(2)\n```", "```\n4, 5\n```"), the other ways small models drop the ```input label
    input_from_unlabelled: bool = True
    # a solver's answer written as code when no ```output / ```input block is found: a ```python block holding
    # only the value (code_o), or only a call of f or assignments to exactly f's parameters (code_i); the
    # 0.5B instruct model answers code_i this way almost every time (benchmarks/format_rate.py)
    answer_from_code: bool = True
    determinism_runs: int = 2  # separate sandbox executions that must agree (AZR: j = 2, in one process)

    def __post_init__(self) -> None:
        self.banned_modules = tuple(self.banned_modules)
        self.banned_calls = tuple(self.banned_calls)
        self.prompt_banned_words = tuple(self.prompt_banned_words)
        if self.max_output_chars < 1 or self.max_input_chars < 1:
            raise ValueError("TaskRules.max_output_chars and max_input_chars must be >= 1")
        if self.induction_inputs < 2 or not 2 <= self.induction_min_inputs <= self.induction_inputs:
            raise ValueError("TaskRules needs 2 <= induction_min_inputs <= induction_inputs")
        if self.determinism_runs < 1:
            raise ValueError("TaskRules.determinism_runs must be >= 1")


def _module_hits(full_name: str, banned: set[str]) -> str | None:
    parts = full_name.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix in banned:
            return prefix
    return None


def _bound_names(tree: ast.AST) -> set[str]:
    """Names the program binds itself (parameters, assignments, defs): calling those is fine."""
    bound: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.arg):
            bound.add(n.arg)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            bound.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(n.name)
    return bound


def rule_violations(tree: ast.Module, rules: TaskRules) -> list[str]:
    """All rule violations of a parsed program, as short strings (empty list: the program is allowed)."""
    banned_modules = set(rules.banned_modules)
    banned_calls = set(rules.banned_calls) - _bound_names(tree)
    found: list[str] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for alias in n.names:
                hit = _module_hits(alias.name, banned_modules)
                if hit:
                    found.append(f"banned_module:{hit}")
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                found.append("relative_import")
                continue
            module = n.module or ""
            hit = _module_hits(module, banned_modules)
            for alias in n.names:
                hit = hit or _module_hits(f"{module}.{alias.name}", banned_modules)
            if hit:
                found.append(f"banned_module:{hit}")
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in banned_calls:
            found.append(f"banned_call:{n.func.id}")
        elif isinstance(n, ast.Name) and n.id in BANNED_NAMES:
            found.append(f"banned_name:{n.id}")
        elif isinstance(n, ast.Attribute) and n.attr in BANNED_NAMES:
            found.append(f"banned_name:{n.attr}")
    return list(dict.fromkeys(found))
