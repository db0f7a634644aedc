"""Answers to code tasks, written the way the solver prompt asks for them (shared by several test modules)."""

from __future__ import annotations

import re

from openrlhf_populora.tasks import Task


def answer_block(task: Task, correct: bool) -> str:
    """The answer block the solver prompt asks for: right, or well formed and wrong."""
    if task.task_type == "code_o":
        return f"```output\n{task.outputs[0] if correct else repr('not the output')}\n```"
    if task.task_type == "code_i":
        return f"```input\n{task.inputs[0] if correct else repr('not the input')}\n```"
    return f"```python\n{task.program.strip() if correct else 'def f(x):' + chr(10) + '    return None'}\n```"


def scripted_output_answer(prompt: str, sample: int) -> str:
    """A scripted solver's answer to a code_o prompt: right for ``... x + 3``, wrong for ``... x * 2``, and for any
    other program right on even samples only (the programs are the tests' own or the shipped seeds: trusted)."""
    program = re.search(r"```python\n(.*?)\n```", prompt, re.S).group(1)
    arguments = re.search(r"```input\n(.*?)\n```", prompt, re.S).group(1)
    scope: dict = {}
    exec(program, scope)
    right = program.endswith("x + 3") or (not program.endswith("x * 2") and sample % 2 == 0)
    value = repr(eval(f"f({arguments})", scope)) if right else "-12345"
    return f"<think>t</think><answer>```output\n{value}\n```</answer>"


def proposal(program: str, inputs: str = "1", tags: bool = True) -> str:
    """A code_o / code_i proposal as the proposer prompt asks for it: the program, then one input."""
    body = f"```python\n{program}\n```\n```input\n{inputs}\n```"
    return f"<think>plan</think>\n<answer>\n{body}\n</answer>" if tags else body


class FixedSandbox:
    """A stand-in for the sandbox that answers every job with one given result object, and records the jobs."""

    def __init__(self, result):
        self.result, self.items = result, []

    def run(self, items):
        self.items.extend(items)
        return [self.result] * len(items)
