"""Seed files (``--populora.seed_file``): JSONL of ``Task`` records, each verified in the sandbox when it loads.

A seed task's gold outputs grade every answer to it, so a wrong one would silently mark every right answer
wrong. ``load_seed_file`` therefore re-runs every (program, input) pair of the file through the same check a
teacher's proposal goes through (``checks.check_proposals``: the rule list, separate runs that must agree, a
value-literal output) and compares the output with the file's. A pair that fails, or disagrees, is an error
naming the file and line. Every pair of the file goes to the sandbox in ONE batch (identical pairs once), so
loading costs about one step's validity checks (``configs/seeds/basic.jsonl``: 50 distinct pairs, 100
executions, about half a second on 2 cores).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from openrlhf_populora.tasks.buffers import TaskBuffers
from openrlhf_populora.tasks.checks import check_proposals
from openrlhf_populora.tasks.records import Task
from openrlhf_populora.tasks.rules import TaskRules


class SeedFileError(ValueError):
    """A seed file that cannot be used: a malformed record, or a task whose program does not give its outputs."""


@dataclass(frozen=True)
class _Pair:
    line: int
    index: int  # which input/output pair of the task
    task: Task


def read_seed_tasks(path: str | Path) -> list[tuple[int, Task]]:
    """The file's tasks with their line numbers (records checked for their fields only)."""
    tasks = []
    with Path(path).open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                tasks.append((lineno, Task.from_dict(json.loads(line))))
            except (ValueError, TypeError) as e:
                raise SeedFileError(f"{path}:{lineno}: not a task record ({e})") from None
    return tasks


def _as_proposal(program: str, input_src: str) -> str:
    """A program and one input written the way a teacher proposes a code_o task."""
    return f"<answer>\n```python\n{program}\n```\n```input\n{input_src}\n```\n</answer>"


def verify_seed_tasks(path: str | Path, tasks: list[tuple[int, Task]], sandbox,
                      rules: TaskRules | None = None) -> None:
    """Run every (program, input) pair of ``tasks`` in the sandbox (one batch); raise ``SeedFileError`` naming
    the first bad line (and how many others are bad) if a pair is not a valid task or its output differs."""
    pairs: dict[tuple[str, str], list[_Pair]] = {}
    for lineno, task in tasks:
        for i, input_src in enumerate(task.inputs):
            pairs.setdefault((task.program, input_src), []).append(_Pair(lineno, i, task))
    keys = list(pairs)
    checks = check_proposals("code_o", [_as_proposal(program, input_src) for program, input_src in keys], sandbox,
                             rules=rules)
    problems: dict[int, str] = {}
    for (program, input_src), check in zip(keys, checks, strict=True):
        for pair in pairs[(program, input_src)]:
            if pair.line in problems:
                continue
            gold = pair.task.outputs[pair.index]
            if not check.valid:
                problems[pair.line] = (f"its program is not a valid task on input {input_src!r} ({check.reason}), "
                                       f"so its output {gold!r} cannot be checked")
            elif check.task.outputs[0] != gold:
                problems[pair.line] = (f"its program returns {check.task.outputs[0]!r} on input {input_src!r}, but "
                                       f"the file says {gold!r}")
    if problems:
        first = min(problems)
        more = f" ({len(problems) - 1} more bad line(s): {', '.join(map(str, sorted(problems)[1:6]))}" \
               f"{', ...' if len(problems) > 6 else ''})" if len(problems) > 1 else ""
        task_type = next(task.task_type for lineno, task in tasks if lineno == first)
        raise SeedFileError(f"{path}:{first}: wrong seed task ({task_type}): {problems[first]}{more}")


def load_seed_file(path: str | Path, sandbox, capacity: int = 16384, rules: TaskRules | None = None) -> TaskBuffers:
    """Task buffers holding the seed file's tasks, every one verified in the sandbox (``verify_seed_tasks``)."""
    tasks = read_seed_tasks(path)
    verify_seed_tasks(path, tasks, sandbox, rules=rules)
    buffers = TaskBuffers(capacity)
    buffers.extend(task for _, task in tasks)
    return buffers
