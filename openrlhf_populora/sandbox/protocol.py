"""What the rest of the project needs from a sandbox: ``run(jobs)``. ``Sandbox`` is the implementation;
tests may pass anything with the same method (a recording wrapper, say)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from .result import ExecResult


@runtime_checkable
class Executor(Protocol):
    def run(self, jobs: Sequence[tuple[str, str]]) -> list[ExecResult]:
        """One result per ``(code, expression)`` job, in order: exec(code), then repr(eval(expression))."""
        ...
