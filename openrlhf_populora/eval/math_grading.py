"""Grade math answers by mathematical equivalence with ``math-verify`` (Hugging Face), not string equality.

``answers_match(gold, response)``: the gold answer is parsed as LaTeX (``$gold$``, so ``\\frac{1}{2}``,
``0.5``, ``1/2`` and ``\\dfrac12`` all read as 1/2), the response is parsed with math-verify's default
extraction (``\\boxed{}`` first, then the last LaTeX or plain expression), and the two are compared
symbolically and numerically (math-verify's ``verify``: floats rounded to 6 places, set/interval/equation
aware). Parsing and verification each have math-verify's own 5 s timeout; a timeout or an unparsable
answer counts as wrong.
"""

from __future__ import annotations

from functools import lru_cache

from openrlhf_populora.eval.extract import extract_math_answer


def _math_verify():
    try:
        import math_verify
    except ImportError as exc:  # pragma: no cover - the package is a project dependency
        raise ImportError("math benchmarks need the package: pip install math-verify==0.9.0") from exc
    return math_verify


@lru_cache(maxsize=4096)
def _parse_gold(gold: str):
    math_verify = _math_verify()
    text = gold.strip()
    if not (text.startswith("$") or text.startswith("\\(") or text.startswith("\\[")):
        text = f"${text}$"
    parsed = math_verify.parse(text)
    return parsed or math_verify.parse(gold)


def answers_match(gold: str, response: str) -> bool:
    """True iff the final answer in ``response`` (a completion or a bare answer) equals ``gold``."""
    math_verify = _math_verify()
    gold_parsed = _parse_gold(gold)
    if not gold_parsed:
        raise ValueError(f"math-verify cannot parse the gold answer {gold!r}; check the benchmark file")
    predicted = math_verify.parse(extract_math_answer(response))
    if not predicted:
        return False
    return bool(math_verify.verify(gold_parsed, predicted))
