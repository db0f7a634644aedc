"""Published pass@1 of known models, and a check that this harness reproduces them.

``python -m openrlhf_populora.cli.evaluate --base-model embedded-coder --base --benchmarks humaneval
--dtype bf16 --check-published`` grades the bare base model and compares its greedy pass@1 with the number
its makers published (``PUBLISHED``). It is a check of the harness (prompt template, answer extraction,
sandboxed grading, the model conversion), not of the model.

The published number. ``PUBLISHED`` holds 61.6, the HumanEval pass@1 of Qwen2.5-Coder-0.5B-Instruct in the
instruct-model table of the Qwen2.5-Coder Technical Report (arXiv 2409.12186). The table itself could not be
read when this was written (only the report's opening pages were reachable); the number was taken from two
public pages that quote it from the report: whatmodel.sh's page of the model ("HumanEval (maker) 61.6%", with
HumanEval+ 57.3% and MBPP 52.4%) and a results table citing arXiv:2409.12186v3 for 61.6%. Check it against
the report's table before relying on the verdict. The report prompts the model through its chat template,
as our ``chat`` template does, but not with our words; that difference is part of what the margin covers.

The margin. Call p the published rate and n the number of problems graded. Each problem's outcome is taken
as an independent Bernoulli(p) trial (a different prompt wording, tokenisation or rounding flips some
problems either way), so the count of passes is Binomial(n, p); the accepted counts are the central range
of that distribution holding at least 95% of it (at most 2.5% in each tail, computed exactly). Then the
lower end is lowered by an allowance for quantised weights (``QUANTISATION_ALLOWANCE``), because 4-bit
weights can only be expected to lose accuracy, never to gain it. Measured above the range fails too: it
points at grading that is too lenient as much as a low score points at a broken prompt or extraction.

The quantisation allowance, 6 percentage points, applies to the shipped model only (a Q4_K_M GGUF,
dequantised to bf16/fp32; the GGUF's header names an AWQ model, so its weights were probably quantised to
4 bits twice). Qwen's own benchmark of its quantised models (qwen.readthedocs.io, "Performance of Quantized
Models", greedy decoding) measured Qwen2-0.5B-Instruct losing 3.3 (AWQ) and 4.7 (GPTQ-Int4) points of its
average over MMLU, C-Eval and IFEval against bf16, and up to 6.0 points on one benchmark; 6 points covers
that worst case. A model directory of the original weights gets no allowance.

The first N problems (``--limit N``) are not a random sample of a benchmark: they are its head in the
published order, which nobody shuffled, so their pass@1 can sit away from the whole benchmark's for reasons
the binomial range does not cover. The check says so whenever it grades fewer than all the problems; only
a run over every problem is the real check.

Measured (the shipped model, bf16, local engine, on a shared 2-core CPU): all 164 problems, 91 passed = 55.5,
inside 48.3 .. 68.9: PASS, in 22 min 51 s. The head is easier for this model than the rest: the first 20 gave
16/20 = 80.0 (range 34.0 .. 80.0, PASS) and the first 40 gave 32/40 = 80.0, above its range 41.5 .. 77.5
(FAIL), while problems 40-163 gave 59/124 = 47.6.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LEVEL = 0.95  # the binomial range holds at least this much probability
QUANTISATION_ALLOWANCE = 6.0  # percentage points, for the shipped 4-bit GGUF (see the module docstring)


@dataclass(frozen=True)
class PublishedScore:
    """One published greedy pass@1 (percent) of one model on one benchmark of ``eval.benchmarks``."""

    model: str  # the model's name as published (matched case-insensitively; see ``model_key``)
    benchmark: str
    pass_at_1: float
    source: str
    template: str  # the prompt template of ours that matches how the source prompted the model


QWEN_CODER_REPORT = ("Qwen2.5-Coder Technical Report (Hui et al., arXiv 2409.12186 v3, Nov 2024), the table of "
                     "instruct models on HumanEval, MBPP and their EvalPlus versions")
PUBLISHED: tuple[PublishedScore, ...] = (
    PublishedScore("Qwen2.5-Coder-0.5B-Instruct", "humaneval", 61.6, QWEN_CODER_REPORT, "chat"),
)
# names this package gives published models (models/embedded.py): the shipped Qwen2.5-Coder-0.5B-Instruct
ALIASES = {"embedded-coder": "qwen2.5-coder-0.5b-instruct"}


def model_key(name_or_path: str) -> str:
    """A model name or directory as a lookup key: its last path component, lower-cased, aliases resolved."""
    key = Path(str(name_or_path).rstrip("/")).name.lower()
    return ALIASES.get(key, key)


def find_published(model: str, benchmark: str) -> PublishedScore | None:
    """The published score of ``model`` (a name, an alias or a directory named after it) on ``benchmark``."""
    key = model_key(model)
    return next((s for s in PUBLISHED if s.benchmark == benchmark and model_key(s.model) == key), None)


def is_shipped_gguf(model_dir: str) -> bool:
    """Whether ``model_dir`` is a shipped GGUF converted by this package (4-bit weights, dequantised)."""
    from openrlhf_populora.models.cache import DONE_MARKER

    marker = Path(model_dir) / DONE_MARKER
    return marker.is_file() and marker.read_text().startswith("converted from")


def _log_pmf(k: int, n: int, p: float) -> float:
    if p <= 0.0:
        return 0.0 if k == 0 else -math.inf
    if p >= 1.0:
        return 0.0 if k == n else -math.inf
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
            + k * math.log(p) + (n - k) * math.log1p(-p))


def binomial_range(n: int, p: float, level: float = LEVEL) -> tuple[int, int]:
    """The central range ``[lo, hi]`` of pass counts of Binomial(n, p): P(X < lo) <= (1 - level) / 2 and
    P(X > hi) <= (1 - level) / 2, each end as tight as that allows."""
    if n < 1 or not 0.0 <= p <= 1.0 or not 0.0 < level < 1.0:
        raise ValueError(f"binomial_range needs n >= 1, 0 <= p <= 1, 0 < level < 1; got {n}, {p}, {level}")
    tail = (1.0 - level) / 2
    pmf = [math.exp(_log_pmf(k, n, p)) for k in range(n + 1)]
    lo, below = 0, 0.0
    while lo < n and below + pmf[lo] <= tail:
        below += pmf[lo]
        lo += 1
    hi, above = n, 0.0
    while hi > 0 and above + pmf[hi] <= tail:
        above += pmf[hi]
        hi -= 1
    return lo, hi


def accepted_range(published: float, n: int, allowance: float) -> tuple[float, float]:
    """The pass@1 range (percent) accepted for ``n`` problems around ``published`` (percent), its lower end
    lowered by ``allowance`` points."""
    lo, hi = binomial_range(n, published / 100.0)
    return max(0.0, 100.0 * lo / n - allowance), 100.0 * hi / n


def check_published(
    score: PublishedScore, passed: int, graded: int, total: int, *, quantised: bool, template: str,
) -> dict[str, Any]:
    """Compare ``passed`` of ``graded`` problems (of the benchmark's ``total``) with ``score``.

    Returns a record: measured and published pass@1, the accepted range and how it was built, notes, and
    ``verdict`` PASS or FAIL (FAIL too when nothing was graded).
    """
    allowance = QUANTISATION_ALLOWANCE if quantised else 0.0
    notes = []
    if graded < total:
        notes.append(f"only the first {graded} of the {total} problems were graded, and the first N problems are "
                     "not a random sample of the benchmark: their pass@1 can differ from the whole benchmark's "
                     "beyond this range. Grade all of them (no --limit) for the real check")
    if template != score.template:
        notes.append(f"the source prompted the model the way our '{score.template}' template does; this run used "
                     f"'{template}', so the comparison is not like for like")
    record: dict[str, Any] = {
        "model": score.model, "benchmark": score.benchmark, "published": score.pass_at_1, "source": score.source,
        "passed": passed, "graded": graded, "total": total, "template": template, "level": LEVEL,
        "quantisation_allowance": allowance, "notes": notes,
    }
    if graded < 1:
        return {**record, "measured": None, "range": None, "verdict": "FAIL"}
    low, high = accepted_range(score.pass_at_1, graded, allowance)
    measured = 100.0 * passed / graded
    return {**record, "measured": measured, "range": [low, high],
            "verdict": "PASS" if low - 1e-9 <= measured <= high + 1e-9 else "FAIL"}


def format_check(record: Mapping[str, Any]) -> str:
    """The check as a few printable lines, ending with PASS or FAIL."""
    lines = [f"[check] published: {record['model']} on {record['benchmark']}: pass@1 {record['published']:.1f} "
             f"({record['source']})"]
    if record["measured"] is None:
        lines.append("[check] measured: nothing graded")
    else:
        low, high = record["range"]
        lines.append(f"[check] measured: {record['passed']}/{record['graded']} = {record['measured']:.1f} "
                     f"(template {record['template']})")
        allowance = record["quantisation_allowance"]
        why = (f"exact binomial {100 * record['level']:.0f}% range of n={record['graded']} problems around "
               f"{record['published']:.1f}")
        if allowance:
            why += f", its lower end lowered {allowance:.1f} points for the 4-bit quantised weights"
        lines.append(f"[check] accepted: {low:.1f} .. {high:.1f} ({why})")
    lines += [f"[check] note: {note}" for note in record["notes"]]
    lines.append(f"[check] {record['verdict']}")
    return "\n".join(lines)
