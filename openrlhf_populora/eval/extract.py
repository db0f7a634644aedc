"""Pull the final answer out of a model's completion.

AZR's evaluation (R1-style prompts) asks for ``<think> ... </think> <answer> ... </answer>``:
- the *answer region* is the text after the **last** ``<answer>`` up to ``</answer>`` (or the end when the
  tag was never closed); without any ``<answer>`` tag it is the whole completion;
- code: the **last** fenced block (```` ```python ```` or a bare fence) in the answer region, else the answer
  region itself (which is the raw completion when there is no tag); with the ``completion`` template the text
  continues a function stub and is cut at the first new top-level statement (Codex-style stop sequences);
- math: the answer region, in which ``math-verify`` looks for ``\\boxed{}`` first (see ``math_grading``).
"""

from __future__ import annotations

import re

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def answer_region(text: str) -> tuple[str, bool]:
    """(text inside the last ``<answer>`` tag, whether the tag was present)."""
    start = text.rfind("<answer>")
    if start < 0:
        return text, False
    body = text[start + len("<answer>"):]
    end = body.find("</answer>")
    return (body if end < 0 else body[:end]), True


def last_fenced_block(text: str) -> str | None:
    """Body of the last ```` ``` ```` block (an unclosed final fence runs to the end), or None."""
    blocks = _FENCE.findall(text)
    if not blocks:
        return None
    return blocks[-1][1]


# Codex-style stop sequences for plain completion of a function stub: a new top-level statement ends the body
COMPLETION_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```", "\nassert ")


def truncate_completion(text: str) -> str:
    """A plain completion of a function stub, cut at the first top-level stop sequence (``COMPLETION_STOPS``)."""
    cut = min((i for i in (text.find(stop) for stop in COMPLETION_STOPS) if i >= 0), default=len(text))
    return text[:cut]


def extract_code(text: str, completion_mode: bool = False) -> str:
    """The program a completion proposes (see the module docstring for the fallback order).

    ``completion_mode``: the text continues a function stub (template ``completion``) and is cut at the first
    top-level stop sequence instead.
    """
    if completion_mode:
        return truncate_completion(text).rstrip()
    region, _ = answer_region(text)
    code = last_fenced_block(region)
    return (region if code is None else code).strip("\n")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1:i]
    return None  # unbalanced: the completion was cut off


def extract_math_answer(text: str) -> str:
    """The text a math completion answers with: the answer region (boxed content is found by the checker)."""
    region, _ = answer_region(text)
    return region.strip()
