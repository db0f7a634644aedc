"""The task record: one AZR code task as plain, JSON-serialisable data.

A task is a program ``p`` with entry function ``f`` plus input/output pairs with ``o = p(i)``:

- ``code_o`` (deduction): the solver sees ``p`` and ``inputs[0]`` and predicts ``outputs[0]``;
- ``code_i`` (abduction): the solver sees ``p`` and ``outputs[0]`` and predicts any input ``i'`` with
  ``p(i') == outputs[0]``;
- ``code_f`` (induction): the solver sees the pairs listed in ``shown`` plus ``message`` and writes a program
  that must reproduce every pair NOT in ``shown`` (the hidden pairs).

Inputs are argument-list source text (``"'abc', 3"``, keywords allowed: ``"xs=[1, 2]"``); outputs are the
``repr`` of the value ``f`` returned. Both are checked to be pure value literals before a task is accepted.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

TASK_TYPES = ("code_o", "code_i", "code_f")
TRIPLET_TYPES = ("code_o", "code_i")  # types whose tasks are single (program, input, output) triplets


def check_task_type(task_type: str) -> str:
    if task_type not in TASK_TYPES:
        raise ValueError(f"unknown task type {task_type!r}; expected one of {', '.join(TASK_TYPES)}")
    return task_type


@dataclass
class Task:
    """One task. ``proposer`` and ``step`` record who proposed it and at which self-play step."""

    task_type: str
    program: str
    inputs: list[str]
    outputs: list[str]
    message: str = ""
    shown: list[int] = field(default_factory=list)
    proposer: str = ""
    step: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_task_type(self.task_type)
        if not isinstance(self.program, str) or not self.program.strip():
            raise ValueError("Task.program must be a non-empty string")
        if not isinstance(self.inputs, (list, tuple)) or not isinstance(self.outputs, (list, tuple)):
            raise TypeError("Task.inputs and Task.outputs must be lists of strings")
        self.inputs = [str(x) for x in self.inputs]
        self.outputs = [str(x) for x in self.outputs]
        if len(self.inputs) != len(self.outputs) or not self.inputs:
            raise ValueError(f"Task needs as many outputs as inputs (>= 1); got {len(self.inputs)} inputs "
                             f"and {len(self.outputs)} outputs")
        if self.task_type in TRIPLET_TYPES:
            if len(self.inputs) != 1:
                raise ValueError(f"a {self.task_type} task holds exactly one input/output pair, "
                                 f"got {len(self.inputs)}")
            self.shown = [0]
        else:
            self.shown = sorted({int(i) for i in self.shown})
            if any(i < 0 or i >= len(self.inputs) for i in self.shown):
                raise ValueError(f"Task.shown indices {self.shown} out of range for {len(self.inputs)} pairs")
            if not self.shown or len(self.shown) == len(self.inputs):
                raise ValueError("a code_f task needs at least one shown and at least one hidden pair")

    @property
    def hidden(self) -> list[int]:
        """Indices of the pairs a code_f solver never sees (and is graded on)."""
        return [i for i in range(len(self.inputs)) if i not in set(self.shown)]

    def key(self) -> str:
        """Identity for de-duplication: type, program, pairs and message; not provenance."""
        body = json.dumps([self.task_type, self.program.strip(), self.inputs, self.outputs, self.message,
                           self.shown], ensure_ascii=True)
        return hashlib.sha1(body.encode()).hexdigest()

    def retyped(self, task_type: str) -> Task:
        """The same triplet as another triplet type (seeds fill both the code_o and code_i buffers)."""
        check_task_type(task_type)
        if task_type not in TRIPLET_TYPES or self.task_type not in TRIPLET_TYPES:
            raise ValueError(f"cannot retype {self.task_type} as {task_type}: only code_o <-> code_i")
        return replace(self, task_type=task_type, shown=[0], meta=dict(self.meta))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Task:
        if not isinstance(data, dict):
            raise TypeError(f"Task.from_dict expects a dict, got {type(data).__name__}")
        known = {"task_type", "program", "inputs", "outputs", "message", "shown", "proposer", "step", "meta"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"Task.from_dict: unknown fields {sorted(unknown)}")
        missing = {"task_type", "program", "inputs", "outputs"} - set(data)
        if missing:
            raise ValueError(f"Task.from_dict: missing fields {sorted(missing)}")
        if not isinstance(data["inputs"], list) or not isinstance(data["outputs"], list):
            raise TypeError("Task.from_dict: inputs and outputs must be lists of strings")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> Task:
        return cls.from_dict(json.loads(text))


IDENTITY_PROGRAM = "def f(x):\n    return x\n"


def zero_triplet(task_type: str = "code_o") -> Task:
    """AZR's seed: the identity function on the input ``'Hello world'`` (a code_o or code_i task)."""
    if task_type not in TRIPLET_TYPES:
        raise ValueError(f"zero_triplet is a code_o/code_i task, got {task_type!r}")
    return Task(task_type, IDENTITY_PROGRAM, ["'Hello world'"], ["'Hello world'"], proposer="seed", step=0)


def zero_induction_task() -> Task:
    """AZR's induction seed: the identity on six inputs, three shown, with a message saying what it does."""
    inputs = ["'Hello world'", "1", "[1, 2, 3]", "{'a': 1}", "(1, 'b')", "True"]
    return Task("code_f", IDENTITY_PROGRAM, inputs, list(inputs), message="Return the input unchanged.",
                shown=[0, 1, 2], proposer="seed", step=0)
