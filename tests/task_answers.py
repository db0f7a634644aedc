"""Answers to code tasks, written the way the solver prompt asks for them (shared by the reward-file tests)."""

from __future__ import annotations

from openrlhf_populora.tasks import Task


def answer_block(task: Task, correct: bool) -> str:
    """The answer block the solver prompt asks for: right, or well formed and wrong."""
    if task.task_type == "code_o":
        return f"```output\n{task.outputs[0] if correct else repr('not the output')}\n```"
    if task.task_type == "code_i":
        return f"```input\n{task.inputs[0] if correct else repr('not the input')}\n```"
    return f"```python\n{task.program.strip() if correct else 'def f(x):' + chr(10) + '    return None'}\n```"
