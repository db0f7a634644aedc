"""Parsing of model text into regions: the answer region and the fenced blocks inside it.

Pure string work; nothing is executed. Values live in ``values.py``, programs in ``programs.py``.
"""

from __future__ import annotations

import re

MAX_ANSWER_CHARS = 200_000  # only this much of an answer region is looked at

_FENCE = "```"
_TAG = re.compile(r"[ \t]*([A-Za-z0-9_+-]*)")
_ANSWER_OPEN, _ANSWER_CLOSE = "<answer>", "</answer>"


class ParseError(ValueError):
    """Model text that cannot be read as what was asked for. ``reason`` is a short machine-readable tag."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# ----------------------------------------------------------------------------------------------- regions


def extract_answer(text: str) -> tuple[str, bool]:
    """The answer region of a completion, and whether the R1 tag structure is present.

    Region: the text after the LAST ``<answer>`` up to the next ``</answer>`` (or the end); with no
    ``<answer>`` at all, the text after the last ``</think>`` (or the whole text). ``tags_ok`` is True iff a
    ``</think>`` precedes a closed ``<answer>...</answer>`` (AZR's format rule, minus the leading ``<think>``,
    which the prompt supplies).
    """
    if not isinstance(text, str):
        return "", False
    start = text.rfind(_ANSWER_OPEN)
    if start >= 0:
        body = text[start + len(_ANSWER_OPEN):]
        end = body.find(_ANSWER_CLOSE)
        closed = end >= 0
        region = body[:end] if closed else body
        tags_ok = closed and text.rfind("</think>", 0, start) >= 0
    else:
        think = text.rfind("</think>")
        region = text[think + len("</think>"):] if think >= 0 else text
        tags_ok = False
    return region[:MAX_ANSWER_CHARS], tags_ok


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """All ```` ```tag ... ``` ```` blocks as (lower-case tag, body); an unclosed last block runs to the end.

    A linear scan with ``str.find`` (a regex here backtracked quadratically on fence-heavy text).
    """
    blocks: list[tuple[str, str]] = []
    pos = text.find(_FENCE)
    while pos >= 0:
        header_end = text.find("\n", pos + 3)
        if header_end < 0:
            break
        tag = _TAG.match(text, pos + 3, header_end).group(1).lower()
        close = text.find(_FENCE, header_end + 1)
        if close < 0:
            blocks.append((tag, text[header_end + 1:]))
            break
        blocks.append((tag, text[header_end + 1:close]))
        pos = text.find(_FENCE, close + 3)
    return blocks


def blocks_tagged(text: str, *tags: str) -> list[str]:
    wanted = {t.lower() for t in tags}
    return [body for tag, body in fenced_blocks(text) if tag in wanted]


def _tagged_span(text: str, tag: str) -> str | None:
    """Text of the last complete ``<tag>...</tag>`` span (linear: two ``rfind``)."""
    close = text.rfind(f"</{tag}>")
    if close < 0:
        return None
    start = text.rfind(f"<{tag}>", 0, close)
    return text[start + len(tag) + 2:close] if start >= 0 else None


def find_program_block(region: str, last: bool = False) -> str | None:
    """A program: a ```python/```py block, else an untagged block, else any block holding ``def ``."""
    for candidates in (blocks_tagged(region, "python", "py", "python3"), blocks_tagged(region, ""),
                       [b for _, b in fenced_blocks(region) if "def " in b]):
        if candidates:
            return candidates[-1] if last else candidates[0]
    return None


def find_value_block(region: str, kind: str) -> str | None:
    """A solver's ``input``/``output`` answer: the last ```kind block, else ``<kind>`` tags, else the last
    untagged block, else the whole region (stripped) when it is a single short line."""
    blocks = blocks_tagged(region, kind)
    if blocks:
        return blocks[-1]
    tagged = _tagged_span(region, kind)
    if tagged is not None:
        return tagged
    untagged = blocks_tagged(region, "")
    if untagged:
        return untagged[-1]
    stripped = region.strip()
    if stripped and "\n" not in stripped and "```" not in stripped:
        return stripped
    return None


def find_message(region: str) -> str | None:
    """An induction proposer's message: last ```message block, ``<message>`` tags, or a ``# Message:`` line."""
    blocks = blocks_tagged(region, "message")
    if blocks:
        return blocks[-1].strip()
    tagged = _tagged_span(region, "message")
    if tagged is not None:
        return tagged.strip()
    m = re.search(r"^#[ \t]*Message:[ \t]*(.+)$", region, re.MULTILINE)
    return m.group(1).strip() if m else None
