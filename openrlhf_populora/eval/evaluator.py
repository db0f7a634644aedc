"""The evaluation loop: greedy pass@1 of every member on every benchmark, resumable.

pass@1 with greedy decoding: each (member, problem) gets exactly one completion at temperature 0, graded
1 (correct) or 0; a member's score on a benchmark is 100 * mean grade over the benchmark's problems.

Work items are every (member, benchmark, problem) not yet in the ``ResultStore``, in a fixed order
(member, then benchmark, then problem). They are generated ``batch_size`` at a time (rows of different
members share a batch), graded (code in the ``Sandbox``, math with math-verify) and appended to the store
before the next batch starts, so an interruption loses at most one batch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from openrlhf_populora.eval.code_grading import SANITIZERS, grade_code
from openrlhf_populora.eval.extract import extract_code
from openrlhf_populora.eval.math_grading import answers_match
from openrlhf_populora.eval.problems import CODE, Problem
from openrlhf_populora.eval.prompts import DEFAULT_TEMPLATES, TEMPLATES, render_prompt
from openrlhf_populora.eval.store import ResultStore


@dataclass
class EvalSettings:
    """Knobs that change what a sample is (recorded in the store; ``batch_size`` and sandbox sizes do not)."""

    code_template: str = DEFAULT_TEMPLATES["code"]
    math_template: str = DEFAULT_TEMPLATES["math"]
    max_new_tokens: int = 1024
    per_test_timeout_s: float = 6.0
    # how a function-level program is cleaned before its tests run (``eval.sanitize``); stores graded before
    # there was a sanitizer read as "none" (``store.IMPLIED_BY_ABSENCE``)
    code_sanitizer: str = "definitions"
    # execution resources: not part of a sample's identity
    batch_size: int = 32
    sandbox_timeout_s: float = 60.0
    sandbox_workers: int = 2
    sandbox_memory_mb: int = 1024

    def validate(self) -> None:
        for name in ("code_template", "math_template"):
            if getattr(self, name) not in TEMPLATES:
                raise ValueError(f"{name} must be one of {', '.join(TEMPLATES)}, got {getattr(self, name)!r}")
        if self.code_sanitizer not in SANITIZERS:
            raise ValueError(f"code_sanitizer must be one of {', '.join(SANITIZERS)}, got {self.code_sanitizer!r}")
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.sandbox_workers < 1:
            raise ValueError("max_new_tokens, batch_size and sandbox_workers must be >= 1")
        if self.per_test_timeout_s <= 0 or self.sandbox_timeout_s <= 0:
            raise ValueError("per_test_timeout_s and sandbox_timeout_s must be > 0")

    def identity(self) -> dict[str, Any]:
        """The settings a stored sample depends on."""
        keep = ("code_template", "math_template", "max_new_tokens", "per_test_timeout_s", "code_sanitizer")
        return {k: v for k, v in asdict(self).items() if k in keep}


def grade(problems: Sequence[Problem], completions: Sequence[str], sandbox: Any, settings: EvalSettings) -> list[dict]:
    """Grade completions: ``{"passed", "status", "detail"}`` per problem (code needs a started ``sandbox``)."""
    out: list[dict | None] = [None] * len(problems)
    code_idx = [i for i, p in enumerate(problems) if p.kind == CODE]
    if code_idx:
        if sandbox is None:
            raise ValueError("code problems need a sandbox")
        completion_mode = settings.code_template == "completion"
        codes = [extract_code(completions[i], completion_mode and bool(problems[i].starter_code)) for i in code_idx]
        grades = grade_code([problems[i] for i in code_idx], codes, sandbox, settings.per_test_timeout_s,
                            settings.code_sanitizer)
        for i, g in zip(code_idx, grades, strict=True):
            out[i] = {"passed": g.passed, "status": g.status, "detail": g.detail}
    for i, problem in enumerate(problems):
        if problem.kind != CODE:
            ok = answers_match(problem.answer, completions[i])
            out[i] = {"passed": ok, "status": "ok", "detail": "" if ok else "answer differs from gold"}
    return [o for o in out if o is not None]


def _open_sandbox(settings: EvalSettings, problems: Iterable[Problem]):
    """A sandbox for grading ``problems`` when any of them is code, else a context that yields None."""
    if not any(p.kind == CODE for p in problems):
        return contextlib.nullcontext()
    from openrlhf_populora.sandbox import Sandbox

    return Sandbox(workers=settings.sandbox_workers, timeout_s=settings.sandbox_timeout_s,
                   memory_mb=settings.sandbox_memory_mb)


def missing_samples(store: ResultStore, members: Iterable[str],
                    problems: Mapping[str, Sequence[Problem]]) -> list[tuple[str, str, Problem]]:
    """Every (member, benchmark, problem) of ``members`` not in ``store`` yet, in member, benchmark order."""
    return [(member, bench, p) for member in members for bench, plist in problems.items() for p in plist
            if not store.has(member, bench, p.problem_id)]


def run_evaluation(
    backend: Any,
    slots: Mapping[str, str],
    problems: Mapping[str, Sequence[Problem]],
    store: ResultStore,
    settings: EvalSettings,
    log: Callable[[str], None] = print,
) -> int:
    """Generate and grade every missing (member, benchmark, problem); returns how many samples were added.

    ``slots`` maps member name -> backend adapter slot; ``problems`` maps benchmark -> problems.
    """
    settings.validate()
    todo = missing_samples(store, slots, problems)
    total = sum(len(plist) for plist in problems.values()) * len(slots)
    log(f"[eval] {total - len(todo)}/{total} samples already graded; {len(todo)} to go")
    if not todo:
        return 0
    added, start = 0, time.time()
    with _open_sandbox(settings, (p for _, _, p in todo)) as sandbox:
        for first in range(0, len(todo), settings.batch_size):
            chunk = todo[first:first + settings.batch_size]
            prompts = [render_prompt(p, settings.code_template if p.kind == CODE else settings.math_template,
                                     backend.render_chat) for _, _, p in chunk]
            outputs = backend.generate([(slots[m], prompt) for (m, _, _), prompt in zip(chunk, prompts, strict=True)],
                                       settings.max_new_tokens)
            grades = grade([p for _, _, p in chunk], [text for text, _ in outputs], sandbox, settings)
            store.append(
                {"member": m, "benchmark": b, "problem_id": p.problem_id, **g, "completion": text, "finished": fin}
                for (m, b, p), (text, fin), g in zip(chunk, outputs, grades, strict=True)
            )
            added += len(chunk)
            log(f"[eval] {total - len(todo) + added}/{total} graded ({time.time() - start:.0f}s)")
    return added


def regrade_samples(store: ResultStore, problems: Mapping[str, Sequence[Problem]], settings: EvalSettings,
                    log: Callable[[str], None] = print) -> int:
    """Grade every stored sample again from its stored completion under ``settings`` (``--regrade``: the grader
    changed, the completions did not) and hand the grades to ``store.replace_grades``; ``problems`` maps each
    benchmark the store holds to its problems. Returns how many verdicts changed."""
    records = store.records()
    by_id = {bench: {p.problem_id: p for p in plist} for bench, plist in problems.items()}
    others = sorted({str(r["benchmark"]) for r in records} - set(by_id))
    if others:
        raise ValueError(f"--regrade: {store.samples_path} also holds samples of {', '.join(others)}; name them in "
                         "--benchmarks too, so that no sample keeps the old grader")
    unknown = [r for r in records if str(r["problem_id"]) not in by_id[str(r["benchmark"])]]
    if unknown:
        raise ValueError(f"--regrade: stored problem {unknown[0]['problem_id']!r} is not in the loaded "
                         f"{unknown[0]['benchmark']} (a different copy of the benchmark?)")
    bare = [r for r in records if not isinstance(r.get("completion"), str)]
    if bare:
        raise ValueError(f"--regrade: the stored sample {store.key(bare[0])} has no completion to grade again "
                         f"({len(bare)} such); evaluate into a new --out directory instead")
    chosen = [by_id[str(r["benchmark"])][str(r["problem_id"])] for r in records]
    grades: list[dict] = []
    start = time.time()
    with _open_sandbox(settings, chosen) as sandbox:
        for first in range(0, len(records), settings.batch_size):
            grades += grade(chosen[first:first + settings.batch_size],
                            [r["completion"] for r in records[first:first + settings.batch_size]], sandbox, settings)
            log(f"[eval] regraded {len(grades)}/{len(records)} ({time.time() - start:.0f}s)")
    changed = sum(bool(r["passed"]) != bool(g["passed"]) for r, g in zip(records, grades, strict=True))
    store.replace_grades({store.key(r): g for r, g in zip(records, grades, strict=True)})
    log(f"[eval] regraded {len(records)} stored samples: {changed} changed verdict")
    return changed

