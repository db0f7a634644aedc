"""What one benchmark problem is, independent of where it was read from.

A ``Problem`` carries the text the model sees and the data that grades an answer:

- math problems: ``answer`` holds the gold final answer (LaTeX or a number, as published);
- code problems: ``tests`` holds one of four test kinds, all run in the project's ``Sandbox``:

  ``{"kind": "check", "test": SRC}``
      HumanEval style: ``SRC`` defines ``check(candidate)`` made of asserts; pass iff
      ``check(<entry_point>)`` returns without raising.
  ``{"kind": "asserts", "setup": SRC, "asserts": [SRC, ...], "reference": SRC}``
      MBPP style: ``setup`` and then each assert statement run in the candidate's own namespace (they call the
      function by its name, which may be anything, ``check`` included); pass iff none raises. ``reference``
      (the published solution) is kept for checking the benchmark, never shown or run in grading.
  ``{"kind": "io", "reference": SRC, "inputs": [[args...], ...], "atol": float}``
      EvalPlus style (differential testing): the reference solution ``SRC`` is run on every input to get
      the expected output; the candidate passes iff it returns an equal value on every input (floats
      within ``atol``, see ``code_grading``).
  ``{"kind": "stdin" | "functional", "cases": [[input, output], ...], "func_name": str}``
      LiveCodeBench style: standard-input programs compared on their printed output, or LeetCode
      ``class Solution`` methods called on JSON-encoded arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CODE = "code"
MATH = "math"


@dataclass
class Problem:
    """One problem of one benchmark. ``problem_id`` is unique within the benchmark."""

    benchmark: str
    problem_id: str
    kind: str  # CODE or MATH
    question: str  # the statement shown to the model (a function stub for HumanEval)
    answer: str = ""  # math: gold final answer
    entry_point: str = ""  # code: name of the function under test (empty for stdin programs)
    starter_code: str = ""  # code: stub to complete (HumanEval prompt, LeetCode starter), may be empty
    tests: dict[str, Any] = field(default_factory=dict)  # code: see the module docstring

    def __post_init__(self) -> None:
        if self.kind not in (CODE, MATH):
            raise ValueError(f"Problem.kind must be {CODE!r} or {MATH!r}, got {self.kind!r}")
        if self.kind == MATH and not self.answer:
            raise ValueError(f"math problem {self.benchmark}/{self.problem_id} has no gold answer")
        if self.kind == CODE and self.tests.get("kind") not in ("check", "asserts", "io", "stdin", "functional"):
            raise ValueError(f"code problem {self.benchmark}/{self.problem_id} has no valid tests: {self.tests!r}")
