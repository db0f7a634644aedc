"""Verification of solver answers: raw solver completion -> ``Verdict`` (format_ok, correct).

- ``code_o``: the answer (last ```output block) must be a value literal; it is correct iff
  ``gold == predicted`` evaluated in the sandbox with the program's definitions in scope (custom
  ``__eq__`` works). Python value equality: ``1 == 1.0 == True``, ``{1, 2} == {2, 1}``, ``(1, 2) != [1, 2]``.
  When no class is involved (builtin literals only) the same ``==`` is computed in the trainer on values
  built from the parsed literals, without evaluating anything and without a sandbox job.
- ``code_i``: the answer (last ```input block) must be an argument list of value literals; correct iff
  ``f(*predicted) == gold`` in the sandbox (any input that yields the output counts).
- ``code_f``: the answer (last ```python block) must parse as a program with an entry ``f``; it runs in
  the sandbox on every HIDDEN input and its output reprs are compared with the gold reprs as values, in the
  trainer process and without evaluating anything (``values.literal_value``): the predicted program never
  shares a process with the gold data, so it cannot read or fake it. Correct iff all hidden pairs match.

No reward hacks: a predicted output or input is a value, never a computation. Calls (``f(x)``, ``eval``,
``type(...)``), names, attributes, lambdas and operators make the answer malformed, so ``format_ok`` is
False. The one exception: constructing instances of classes the program defines, when the gold value
itself is such an instance (for code_i: when the gold input or output uses that class).

Completions for the same task share work: identical answers run once, and the answers to one code_o /
code_i task share the program's code (the sandbox execs it once and forks per answer, each with its own
time limit). Everything of one call goes to the sandbox as ONE batch.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from openrlhf_populora.tasks.checks import _call_arguments
from openrlhf_populora.tasks.harness import input_gives_item, outputs_item, read_result, same_output_item
from openrlhf_populora.tasks.parsing import (
    ParseError,
    blocks_tagged,
    extract_answer,
    find_program_block,
    find_value_block,
)
from openrlhf_populora.tasks.programs import parse_program
from openrlhf_populora.tasks.records import Task
from openrlhf_populora.tasks.rules import TaskRules
from openrlhf_populora.tasks.values import (
    BUILTIN_CONSTRUCTORS,
    called_names,
    literal_value,
    parse_arguments,
    parse_value,
)


@dataclass
class Verdict:
    """Outcome of one answer. ``format_ok``: an answer of the right kind was found and parsed."""

    format_ok: bool
    correct: bool
    reason: str = ""  # "correct", "wrong", or why the format failed / the run failed
    tags_ok: bool = False
    answer: str | None = None  # the canonical parsed answer
    exec_s: float = 0.0  # sandbox seconds of its (possibly shared) execution

    def to_dict(self) -> dict:
        return {"format_ok": self.format_ok, "correct": self.correct, "reason": self.reason,
                "tags_ok": self.tags_ok, "answer": self.answer, "exec_s": self.exec_s}


@lru_cache(maxsize=4096)
def _program_classes(source: str) -> frozenset[str]:
    try:
        return parse_program(source, strip_top_level=False).classes
    except ParseError:
        return frozenset()


def _allowed_classes(task: Task) -> frozenset[str]:
    """Program classes a predicted value may construct: those the gold values themselves construct."""
    program_classes = _program_classes(task.program)
    used = called_names(task.outputs[0])
    if task.task_type == "code_i":
        used |= called_names(task.inputs[0])
    return program_classes & used


def _entry_parameters(program: str) -> list[str] | None:
    """The positional parameter names of the program's ``f`` (None when it has ``*args``, keyword-only or
    ``**kwargs`` parameters, or no top-level ``f``)."""
    try:
        tree = ast.parse(program)
    except SyntaxError:
        return None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "f":
            a = node.args
            if a.vararg or a.kwarg or a.kwonlyargs:
                return None
            return [p.arg for p in [*a.posonlyargs, *a.args]]
    return None


def _assigned_arguments(block: str, parameters: list[str]) -> str | None:
    """``x = 3`` / ``a = 'x'; b = [1]``: the block assigns each of ``f``'s parameters exactly once and does
    nothing else; the values, in parameter order, as call arguments (the caller checks they are literals)."""
    try:
        tree = ast.parse(textwrap.dedent(block))
    except SyntaxError:
        return None
    values: dict[str, str] = {}
    for stmt in tree.body:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            return None
        name = stmt.targets[0].id
        if name in values:
            return None
        values[name] = ast.unparse(stmt.value)
    if not parameters or sorted(values) != sorted(parameters):
        return None
    return ", ".join(values[p] for p in parameters)


def _value_from_code(region: str, kind: str, task: Task) -> str | None:
    """A solver answer written as code instead of the ```output / ```input block asked for (what small instruct
    models do): the last ```python block holding only the value (code_o), or only a call ``f(...)`` (bare or
    printed) or assignments to exactly ``f``'s parameters (code_i). The text returned still has to parse as a
    value literal or an argument list: nothing here is executed or evaluated."""
    blocks = blocks_tagged(region, "python", "py", "python3")
    if not blocks:
        return None
    block = blocks[-1].strip()
    if kind == "output":
        return block
    call = _call_arguments(block, "f")
    if call and len([s for s in block.splitlines() if s.strip()]) == 1:
        return call[0]
    parameters = _entry_parameters(task.program)
    return _assigned_arguments(block, parameters) if parameters is not None else None


def _parse_answer(task: Task, text: str, rules: TaskRules) -> Verdict:
    """Static part: find and parse the answer; ``answer`` holds it canonically when format_ok."""
    if not isinstance(text, str):
        return Verdict(False, False, "not_text")
    region, tags_ok = extract_answer(text)
    if rules.require_tags and not tags_ok:
        return Verdict(False, False, "format", tags_ok)
    try:
        if task.task_type == "code_f":
            block = find_program_block(region, last=True)
            if block is None:
                return Verdict(False, False, "no_program", tags_ok)
            answer = parse_program(block, strip_top_level=rules.strip_top_level).source
        else:
            kind = "output" if task.task_type == "code_o" else "input"
            block = find_value_block(region, kind)
            if block is None and rules.answer_from_code:
                block = _value_from_code(region, kind, task)
            if block is None:
                return Verdict(False, False, f"no_{kind}", tags_ok)
            classes = _allowed_classes(task)
            answer = parse_value(block, classes) if kind == "output" else parse_arguments(block, classes)
    except ParseError as e:
        return Verdict(False, False, e.reason, tags_ok)
    return Verdict(True, False, "pending", tags_ok, answer)


def _same_values(pred_reprs: object, task: Task) -> bool:
    if not isinstance(pred_reprs, tuple) or len(pred_reprs) != len(task.hidden):
        return False
    for pred, i in zip(pred_reprs, task.hidden, strict=True):
        if not isinstance(pred, str):
            return False
        gold = task.outputs[i]
        classes = called_names(gold)
        try:
            if literal_value(pred, classes) != literal_value(gold, classes):
                return False
        except ParseError:
            return False
    return True


def _builtin_literal_verdict(task: Task, answer: str) -> bool | None:
    """code_o fast path: when neither the gold output nor the answer constructs a class, both are builtin
    literals and Python ``==`` on their values (built by ``literal_value``, nothing evaluated) is exactly
    what the sandbox would compute. None: the sandbox must decide (program classes are involved)."""
    if called_names(task.outputs[0]) - BUILTIN_CONSTRUCTORS or called_names(answer) - BUILTIN_CONSTRUCTORS:
        return None
    try:
        return bool(literal_value(answer) == literal_value(task.outputs[0]))
    except ParseError:
        return None


def verify_answers(tasks: Sequence[Task], completions: Sequence[str], sandbox, *,
                   rules: TaskRules | None = None, fast_literals: bool = True) -> list[Verdict]:
    """Verify ``completions[k]`` as an answer to ``tasks[k]`` for every k, with a single sandbox batch.

    ``fast_literals``: decide code_o answers on builtin values without the sandbox (same result).
    """
    rules = rules or TaskRules()
    tasks, completions = list(tasks), list(completions)
    if len(tasks) != len(completions):
        raise ValueError(f"verify_answers: {len(tasks)} tasks for {len(completions)} completions")
    for t in tasks:
        if not isinstance(t, Task):
            raise TypeError(f"verify_answers expects Task records, got {type(t).__name__}")
    verdicts = [_parse_answer(t, c, rules) for t, c in zip(tasks, completions, strict=True)]

    items: list[tuple[str, str]] = []
    item_of: dict[tuple[str, str], int] = {}  # (task key, canonical answer) -> sandbox item
    for t, v in zip(tasks, verdicts, strict=True):
        if fast_literals and v.format_ok and t.task_type == "code_o":
            decided = _builtin_literal_verdict(t, v.answer)
            if decided is not None:
                v.correct, v.reason = decided, ("correct" if decided else "wrong")
                continue
        if not v.format_ok or v.reason != "pending" or (t.key(), v.answer) in item_of:
            continue
        item_of[(t.key(), v.answer)] = len(items)
        if t.task_type == "code_o":
            items.append(same_output_item(t.program, t.outputs[0], v.answer))
        elif t.task_type == "code_i":
            items.append(input_gives_item(t.program, v.answer, t.outputs[0]))
        else:
            items.append(outputs_item(v.answer, [t.inputs[i] for i in t.hidden], rules.max_output_chars))

    results = sandbox.run(items) if items else []
    for t, v in zip(tasks, verdicts, strict=True):
        if not v.format_ok or v.reason != "pending":
            continue
        result = results[item_of[(t.key(), v.answer)]]
        read = read_result(result)
        ok = (read is True) if t.task_type != "code_f" else _same_values(read, t)
        v.correct = bool(ok)
        v.exec_s = float(getattr(result, "wall_s", 0.0))
        status = getattr(result, "status", "")
        v.reason = "correct" if ok else ("wrong" if status == "ok" else f"run_{status or 'failed'}")
    return verdicts


def verify_answer(task: Task, completion: str, sandbox, *, rules: TaskRules | None = None) -> Verdict:
    """Single-answer form of ``verify_answers``."""
    return verify_answers([task], [completion], sandbox, rules=rules)[0]
