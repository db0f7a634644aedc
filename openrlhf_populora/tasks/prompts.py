"""Prompt templates for proposers and solvers of the three task types, in one place.

The structure follows AZR (R1-style ``<think>``/``<answer>`` answers, fenced ```python / ```input /
```output / ```message blocks, K reference tasks for proposers, a banned-words list), in our own words.
Builders return the USER MESSAGE text; the engine renders it with the tokenizer's chat template, or
``render_raw`` wraps it in an R1-style plain-text conversation (AZR's base-model setting).

Templates use ``string.Template`` (``$name``) so code examples may contain braces. To swap prompts, pass a
``PromptTemplates`` with other strings.

AZR parity note: AZR's abduction proposer prompt talks about the difficulty of predicting the *output* and
its deduction prompt about predicting the *input* (swapped). We describe the solver's real job;
``azr_swapped_difficulty=True`` restores the swap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from string import Template

from openrlhf_populora.tasks.records import Task, check_task_type
from openrlhf_populora.tasks.rules import TaskRules

R1_SYSTEM = (
    "This is a conversation between a User and an Assistant. The User asks a question and the Assistant "
    "answers it. The Assistant first reasons about the question privately, then gives the answer. The "
    "reasoning goes inside <think> </think> tags and the answer inside <answer> </answer> tags, like this: "
    "<think> reasoning here </think> <answer> answer here </answer>."
)

ANSWER_FORMAT = "First reason inside <think> </think>, then give your final answer inside <answer> </answer>."

PROPOSE_TRIPLET = """\
## Task: write a new Python program and one test input for it

Write a new, original Python program together with one input. It becomes a puzzle: a test subject who \
is shown $shown will have to work out $hidden by reasoning about the code alone. The reference programs \
at the end show the format; make yours clearly different from them.

### Rules for the program
- The entry point is a function named `f`. Helper functions, nested functions and classes are allowed; \
put imports and class definitions at the top.
- `f` takes at least one argument and returns a value.
- It is deterministic: no randomness, no dates or times, no files, network, printing, logging or other \
external state.
- It finishes within $timeout seconds.
- Do not use any of these words anywhere, not even in comments: $banned.

### Rules for the input
- Exactly one input, written as the arguments of a call to `f`: `arg1, arg2, ...`.
- Plain values only (numbers, quoted strings, lists, tuples, dicts, sets, booleans, None).

### Answer format
$answer_format The answer holds one ```python block and one ```input block, for example:
<answer>
```python
def f(name, info):
    # your code
    return result
```
```input
'Sammy', {'age': 37, 'city': 'Los Angeles'}
```
</answer>

### What makes a good program
- It runs: no syntax errors, `f` returns for the given input.
- It is hard: $difficulty should take several steps of careful reasoning (state tracked through loops, \
branches and data structures such as trees, heaps, stacks, queues or graphs; dynamic programming, \
recursion, divide and conquer, greedy search, backtracking).
- It is new: different in idea, not just in names, from every reference program.

### Reference programs
$references
"""

PROPOSE_INDUCTION = """\
## Task: design $n inputs for a program, and a message about it

Below is a program. Write $n inputs that, passed to `f`, give varied outputs, and a message. A test \
subject will see some of the input/output pairs and your message, must write a function that behaves \
like `f`, and is graded on the pairs it did not see.

```python
$program
# f(<your input>)
```

### Rules for the inputs
- Exactly $n ```input blocks, each holding the arguments of one call to `f`: `arg1, arg2, ...`.
- Plain values only (numbers, quoted strings, lists, tuples, dicts, sets, booleans, None); all different.
- Together they should cover the interesting cases of the program.

### Rules for the message
- One ```message block. It may describe what `f` does, give a hint, or pose it as a coding question.
- It must not contain the code.

### Answer format
$answer_format The answer holds the $n ```input blocks and then the ```message block, for example:
<answer>
```input
'abc', 3
```
... ($n input blocks in total)
```message
A short description or question.
```
</answer>

### What makes a good set of inputs
- Every input runs without error.
- The pairs are hard but possible to generalise from: enough shown to infer `f`, with varied outputs.
"""

SOLVE_OUTPUT = """\
## Task: predict the output of a program

Given the program and an input, work out exactly what `f` returns. Reason step by step.

```python
$program
```
```input
$input
```

### Answer format
$answer_format Put the returned value as a Python literal in one ```output block: quote strings, write \
several returned values as a tuple. For example:
<answer>
```output
{'age': 37, 'name': 'Sammy'}
```
</answer>
"""

SOLVE_INPUT = """\
## Task: find an input that produces a given output

Given the program and one of its outputs, find an input for which `f` returns exactly this output. Any \
such input is correct. Reason step by step.

```python
$program
```
```output
$output
```

### Answer format
$answer_format Put the input in one ```input block as the arguments of a call to `f`: `arg1, arg2, ...`, \
plain values only, strings quoted. For example:
<answer>
```input
'Sammy', {'age': 37}
```
</answer>
"""

SOLVE_FUNCTION = """\
## Task: write the function behind some input/output pairs

A hidden function `f` gave the outputs below for the inputs below. Write a function `f` that reproduces \
them; it will also be tested on other inputs. A message from the author of `f`:

$message

$pairs

### Rules for the program
- Name the entry function `f`; helpers and classes are allowed, imports and classes go at the top.
- It is deterministic: no randomness, dates or times, files, network or printing.

### Answer format
$answer_format Put the program in one ```python block. For example:
<answer>
```python
def f(a):
    return a
```
</answer>
"""


@dataclass(frozen=True)
class PromptTemplates:
    """The five templates (``string.Template`` syntax). Replace any to change the prompts."""

    propose_triplet: str = PROPOSE_TRIPLET
    propose_induction: str = PROPOSE_INDUCTION
    solve_output: str = SOLVE_OUTPUT
    solve_input: str = SOLVE_INPUT
    solve_function: str = SOLVE_FUNCTION
    answer_format: str = ANSWER_FORMAT
    # show each reference's output block to proposers (AZR does); small models then copy the ```output
    # block into their own proposal instead of the ```input block the answer needs
    reference_outputs: bool = True


DEFAULT_TEMPLATES = PromptTemplates()

# Short versions with the same structure and answer format, for small models and short context windows
# (the default proposer prompt is about 2,000 characters before its references). The 0.5B instruct model
# copies whatever example answer a prompt holds: solver prompts with an example value got it back in 68 answers
# of 96 (solved 0/96), with a placeholder ("(the value f returns)") got the placeholder in 14 and code_o's
# format rate fell from 0.62 to 0.21; so the solver prompts name the block and nothing more
# (benchmarks/format_rate.py). The proposer prompt shows the answer's shape with
# placeholders, which raised valid proposals from 6/16 to 12/16 on the same references.
COMPACT_TEMPLATES = PromptTemplates(
    propose_triplet=(
        "Write a new Python function `f` (at least one argument, deterministic, returns a value; helpers and "
        "classes allowed) and one input for it. Someone shown $shown must find $hidden. Make $difficulty "
        "hard, and make it different from the examples. Do not use: $banned.\n$answer_format Answer with "
        "one ```python block and one ```input block, in this shape:\n<answer>\n```python\n(your function f)\n```"
        "\n```input\n(the arguments of one call of f, as Python literals)\n```\n</answer>\nExamples:\n"
        "$references\n"),
    propose_induction=(
        "Here is a program:\n```python\n$program\n```\nWrite $n different inputs for `f` (each in its own "
        "```input block, as the call's arguments) that give varied outputs, and a ```message block hinting "
        "at what `f` does, without code.\n$answer_format\n"),
    solve_output=("What does `f` return?\n```python\n$program\n```\n```input\n$input\n```\n$answer_format "
                  "Give the value as a Python literal in one ```output block.\n"),
    solve_input=("Find an input for which `f` returns this output.\n```python\n$program\n```\n```output\n"
                 "$output\n```\n$answer_format Give the call's arguments in one ```input block.\n"),
    solve_function=("Write a function `f` that gives these outputs (it is also tested on other inputs). Hint: "
                    "$message\n$pairs\n$answer_format Give the program in one ```python block.\n"),
    reference_outputs=False,
)


def render_raw(user_text: str, system: str = R1_SYSTEM) -> str:
    """AZR-style plain-text rendering (no chat template): system text, ``User:``, ``Assistant: <think>``."""
    return f"{system}\nUser: {user_text}\nAssistant: <think>"


def _references_block(references: Sequence[Task], outputs: bool = True) -> str:
    parts = []
    for i, ref in enumerate(references):
        output = f"```output\n{ref.outputs[0]}\n```\n" if outputs else ""
        parts.append(f"<snippet_{i}>\n```python\n{ref.program.strip()}\n```\n```input\n{ref.inputs[0]}\n```\n"
                     f"{output}</snippet_{i}>")
    return "\n".join(parts) if parts else "(none)"


def proposer_prompt(task_type: str, references: Sequence[Task], *, program: Task | None = None,
                    rules: TaskRules | None = None, timeout_s: float = 10.0,
                    azr_swapped_difficulty: bool = False,
                    templates: PromptTemplates = DEFAULT_TEMPLATES) -> str:
    """The proposer's user message.

    code_o / code_i: ``references`` are the K reference tasks shown as examples (may be empty).
    code_f: the proposer designs inputs for ONE program: ``program``, or ``references[0]`` when not given.
    """
    check_task_type(task_type)
    rules = rules or TaskRules()
    if task_type == "code_f":
        source = program if program is not None else (references[0] if references else None)
        if source is None:
            raise ValueError("proposer_prompt('code_f', ...) needs a program (program= or references[0])")
        return Template(templates.propose_induction).substitute(
            n=rules.induction_inputs, program=source.program.strip(), answer_format=templates.answer_format)
    predicts_output = task_type == "code_o"
    if azr_swapped_difficulty:
        predicts_output = not predicts_output
    shown, hidden = ("the program and the input", "the output") if task_type == "code_o" else \
        ("the program and the output", "an input that produces it")
    difficulty = ("predicting the output from the input" if predicts_output
                  else "finding an input from the output")
    timeout = f"{timeout_s:g}"
    return Template(templates.propose_triplet).substitute(
        shown=shown, hidden=hidden, timeout=timeout, banned=", ".join(dict.fromkeys(rules.prompt_banned_words)),
        answer_format=templates.answer_format, difficulty=difficulty,
        references=_references_block(references, templates.reference_outputs))


def _pairs_block(task: Task) -> str:
    parts = []
    for k, i in enumerate(task.shown):
        parts.append(f"```input_{k}\n{task.inputs[i]}\n```\n```output_{k}\n{task.outputs[i]}\n```")
    return "\n".join(parts)


def solver_prompt(task: Task, templates: PromptTemplates = DEFAULT_TEMPLATES) -> str:
    """The solver's user message for ``task`` (code_f shows only the ``shown`` pairs)."""
    if task.task_type == "code_o":
        return Template(templates.solve_output).substitute(
            program=task.program.strip(), input=task.inputs[0], answer_format=templates.answer_format)
    if task.task_type == "code_i":
        return Template(templates.solve_input).substitute(
            program=task.program.strip(), output=task.outputs[0], answer_format=templates.answer_format)
    return Template(templates.solve_function).substitute(
        message=task.message.strip() or "(no message)", pairs=_pairs_block(task),
        answer_format=templates.answer_format)
