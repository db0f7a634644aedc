"""Prompt templates for evaluation, following AZR's evaluation (paraphrased, not quoted).

Templates (``--code-template`` / ``--math-template``):

``azr`` (default for code)
    DeepSeek-R1-Zero style raw text, no chat template, as AZR trains and evaluates: a short system text saying
    the assistant thinks inside ``<think> </think>`` and answers inside ``<answer> </answer>``, then
    ``User: <task>``, then ``Assistant: <think>``. Code tasks ask for the complete program in a
    ```` ```python ```` block inside ``<answer>``; math tasks give the question alone.
``azr_boxed`` (default for math)
    ``azr`` plus an instruction to put the final answer in ``\\boxed{}`` (AZR's template for Coder models).
``chat``
    The task text (code: "answer in a python block"; math: "reason step by step, final answer in
    ``\\boxed{}``", the Qwen-boxed style) rendered through the model's own chat template.
``completion``
    Plain completion, no instructions: code problems give the function stub (HumanEval style) or the
    statement; math gives ``Question: ...\\nAnswer:``.

The answer is extracted the same way for every template (see ``extract``).
"""

from __future__ import annotations

from collections.abc import Callable

from openrlhf_populora.eval.problems import CODE, Problem

TEMPLATES = ("azr", "azr_boxed", "chat", "completion")
DEFAULT_TEMPLATES = {"code": "azr", "math": "azr_boxed"}

R1_SYSTEM = (
    "A conversation between User and Assistant. The User asks a question and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in its mind and then gives the User the answer. "
    "The reasoning process and the answer are enclosed within <think> </think> and <answer> </answer> tags, "
    "respectively, i.e., <think> reasoning process here </think> <answer> answer here </answer>."
)

_CODE_FORMAT = "Write your final solution as complete, self-contained Python code in one ```python``` block."
_BOXED = "Please reason step by step, and put your final answer within \\boxed{}."


def code_task_text(problem: Problem) -> str:
    """The instruction text for a code problem (without any template wrapping)."""
    tests = problem.tests
    if tests.get("kind") in ("stdin", "functional"):  # LiveCodeBench
        parts = ["You will be given a programming problem. Write a correct Python program that passes all tests.",
                 "", "### Question:", problem.question.strip(), ""]
        if problem.starter_code.strip():
            parts += ["### Starter code (complete it; keep the class and method names):",
                      f"```python\n{problem.starter_code.rstrip()}\n```"]
        else:
            parts += ["### Input/output: read the input from standard input and write the answer to standard output "
                      "(do not test on the sample inputs yourself)."]
        return "\n".join(parts)
    if problem.starter_code.strip():  # HumanEval / HumanEval+: complete a function stub
        return ("Complete the following Python function; return the whole function, including the signature and "
                f"any imports it needs.\n```python\n{problem.starter_code.rstrip()}\n```")
    return (f"Solve the following problem with a self-contained Python function named `{problem.entry_point}`."
            f"\n```python\n{problem.question.strip()}\n```")


def render_prompt(problem: Problem, template: str, chat_render: Callable[[str], str] | None = None) -> str:
    """The exact text given to the model for ``problem`` under ``template``.

    ``chat_render`` turns one user message into the model's chat-formatted prompt; only ``chat`` needs it.
    """
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; choose one of {', '.join(TEMPLATES)}")
    code = problem.kind == CODE
    if template == "completion":
        if code:
            return problem.starter_code or problem.question
        return f"Question: {problem.question.strip()}\nAnswer:"
    if code:
        task = code_task_text(problem) + "\n" + _CODE_FORMAT
    else:
        task = problem.question.strip() + ("\n" + _BOXED if template in ("azr_boxed", "chat") else "")
    if template == "chat":
        if chat_render is None:
            raise ValueError("template 'chat' needs the model's chat template (chat_render)")
        return chat_render(task)
    if code:
        task += " Put that block inside <answer> </answer>."
    return f"{R1_SYSTEM}\nUser: {task}\nAssistant: <think>"
