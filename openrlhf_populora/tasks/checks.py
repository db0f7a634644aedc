"""Validity of proposals: raw proposer completion -> a checked ``Task`` (or the reason it is invalid).

code_o / code_i proposal (a program and one input), valid iff, in order:
1. the answer has a program block that parses and has an entry ``f`` (renamed if needed);
2. the program obeys the rule list (``rules.py``: banned modules on dotted names, banned calls);
3. an ```input block parses as an argument list of value literals (at most ``max_input_chars``);
4. ``f(input)`` runs within the sandbox limits in ``determinism_runs`` SEPARATE executions (fresh
   processes) that all return the same ``repr``;
5. the ``repr`` is at most ``max_output_chars`` (AZR truncated it silently), is a value literal, and
   ``eval(repr(out)) == out`` (rejects NaN-like values and objects with lossy reprs); ``None`` is
   rejected when ``reject_none_output``.

code_f proposal (inputs and a message for a given program): the last ``induction_inputs`` distinct
argument lists (at least ``induction_min_inputs``) each pass 3-5 above, and a message is present. The task
shows the first half of the pairs and hides the rest (AZR: ``num_given = n // 2``).

All executions of one call go to the sandbox as ONE batch.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

from openrlhf_populora.tasks.harness import probe_item, read_result
from openrlhf_populora.tasks.parsing import (
    ParseError,
    blocks_tagged,
    extract_answer,
    fenced_blocks,
    find_message,
    find_program_block,
)
from openrlhf_populora.tasks.programs import Program, parse_program
from openrlhf_populora.tasks.records import TRIPLET_TYPES, Task, check_task_type
from openrlhf_populora.tasks.rules import TaskRules, rule_violations
from openrlhf_populora.tasks.values import parse_arguments, parse_value


@dataclass
class ProposalCheck:
    """Outcome of checking one proposal. ``task`` is set iff ``valid``."""

    valid: bool
    reason: str  # "ok" or a short tag such as "no_program", "banned_module:os", "nondeterministic"
    task: Task | None = None
    tags_ok: bool = False
    exec_s: float = 0.0  # sandbox seconds spent on this proposal (for per-step logging)

    def to_dict(self) -> dict:
        return {"valid": self.valid, "reason": self.reason, "tags_ok": self.tags_ok, "exec_s": self.exec_s,
                "task": self.task.to_dict() if self.task else None}


@dataclass
class _Pending:
    """A proposal that passed the static checks and waits for its sandbox runs."""

    index: int
    program: Program
    arg_srcs: list[str]
    message: str
    first_item: int  # index of its first sandbox item; items are arg-major, runs-minor
    source_key: str | None = None  # code_f: key of the buffer task whose program was used


def _program_of(item: Task | str) -> Program:
    source = item.program if isinstance(item, Task) else item
    return parse_program(source, strip_top_level=False)


def _call_arguments(block: str, entry: str) -> list[str]:
    """Argument text of the first top-level ``entry(...)`` call (bare or inside ``print``), or [].

    Only the call's syntax is read here; the arguments still go through the value-literal check.
    """
    try:
        tree = ast.parse(textwrap.dedent(block))
    except SyntaxError:
        return []
    for stmt in tree.body:
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "print" \
                and len(call.args) == 1:
            call = call.args[0]
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == entry \
                and (call.args or call.keywords):
            parts = [ast.unparse(a) for a in call.args] + [ast.unparse(k) for k in call.keywords]
            return [", ".join(parts)]
    return []


def _unlabelled_arguments(region: str, program_block: str, program: Program) -> list[str]:
    """Arguments from the first unlabelled fenced block after the program block that holds either a call of
    the entry function (``f(2)``) or text that parses as call arguments (``4, 5``); [] if none does."""
    blocks = fenced_blocks(region)
    after = next((i for i, (_, body) in enumerate(blocks) if body == program_block), len(blocks))
    for tag, body in blocks[after + 1:]:
        if tag:
            continue
        call = _call_arguments(body, program.renamed_from or "f")
        candidates = call or [body]
        try:
            parse_arguments(candidates[0], program.classes)
        except ParseError:
            continue
        return candidates
    return []


def _static_check(task_type: str, text: str, program_context: Task | str | None,
                  rules: TaskRules) -> tuple[Program, list[str], str, bool] | ProposalCheck:
    region, tags_ok = extract_answer(text)
    if rules.require_tags and not tags_ok:
        return ProposalCheck(False, "format", tags_ok=tags_ok)
    if task_type in TRIPLET_TYPES:
        block = find_program_block(region)
        if block is None:
            return ProposalCheck(False, "no_program", tags_ok=tags_ok)
        try:
            program = parse_program(block, strip_top_level=rules.strip_top_level)
        except ParseError as e:
            return ProposalCheck(False, f"program_{e.reason}", tags_ok=tags_ok)
        violations = rule_violations(program.tree, rules)
        if violations:
            return ProposalCheck(False, violations[0], tags_ok=tags_ok)
        inputs = blocks_tagged(region, "input")
        if not inputs and rules.input_from_call:
            inputs = _call_arguments(block, program.renamed_from or "f")
        if not inputs and rules.input_from_unlabelled:
            inputs = _unlabelled_arguments(region, block, program)
        if not inputs:
            return ProposalCheck(False, "no_input", tags_ok=tags_ok)
        raw_inputs, message = [inputs[0]], ""
    else:
        if program_context is None:
            raise ValueError("check_proposals('code_f', ...) needs the program each proposer was given")
        program = _program_of(program_context)
        raw_inputs = blocks_tagged(region, "input")
        message = find_message(region) or ""
        if not message:
            return ProposalCheck(False, "no_message", tags_ok=tags_ok)
    arg_srcs: list[str] = []
    for raw in raw_inputs:
        if len(raw.strip()) > rules.max_input_chars:
            return ProposalCheck(False, "input_too_long", tags_ok=tags_ok)
        try:
            arg_srcs.append(parse_arguments(raw, program.classes))
        except ParseError as e:
            return ProposalCheck(False, f"input_{e.reason}", tags_ok=tags_ok)
    if task_type == "code_f":
        arg_srcs = list(dict.fromkeys(arg_srcs))[-rules.induction_inputs:]
        if len(arg_srcs) < rules.induction_min_inputs:
            return ProposalCheck(False, "too_few_inputs", tags_ok=tags_ok)
    return program, arg_srcs, message, tags_ok


def _judge_runs(results: list, program: Program, rules: TaskRules) -> tuple[str, str]:
    """(reason, output repr) from the determinism runs of one input; reason "ok" when valid."""
    reads = [read_result(r) for r in results]
    for r, read in zip(results, reads, strict=True):
        if not (isinstance(read, tuple) and len(read) == 3):
            status = getattr(r, "status", "")
            if status == "timeout":
                return "timeout", ""
            return (f"run_{status}" if status not in ("", "ok") else "run_failed"), ""
    if any(read != reads[0] for read in reads[1:]):
        return "nondeterministic", ""
    status, text, round_trips = reads[0]
    if status == "too_long":
        return "output_too_long", ""
    if len(text) > rules.max_output_chars:
        return "output_too_long", ""
    try:
        parse_value(text, program.classes)
    except ParseError:
        return "output_not_literal", ""
    if not round_trips:
        return "output_not_round_trip", ""
    if rules.reject_none_output and text == "None":
        return "output_none", ""
    return "ok", text


def check_proposals(task_type: str, completions: Sequence[str], sandbox, *,
                    programs: Sequence[Task | str] | Task | str | None = None,
                    proposer: str | Sequence[str] = "", step: int = 0,
                    rules: TaskRules | None = None) -> list[ProposalCheck]:
    """Check many proposer completions of one task type with a single sandbox batch.

    ``programs`` (code_f only): the program each proposer was shown, one per completion (or one for all).
    ``proposer``: one name for all, or one per completion; recorded with ``step`` in each valid task.
    """
    check_task_type(task_type)
    rules = rules or TaskRules()
    completions = list(completions)
    n = len(completions)
    proposers = [proposer] * n if isinstance(proposer, str) else list(proposer)
    if len(proposers) != n:
        raise ValueError(f"check_proposals: {len(proposers)} proposer names for {n} completions")
    if programs is None or isinstance(programs, (Task, str)):
        contexts = [programs] * n
    else:
        contexts = list(programs)
        if len(contexts) != n:
            raise ValueError(f"check_proposals: {len(contexts)} programs for {n} completions")

    out: list[ProposalCheck | None] = [None] * n
    pending: list[_Pending] = []
    items: list[tuple[str, str]] = []
    for i, text in enumerate(completions):
        if not isinstance(text, str):
            out[i] = ProposalCheck(False, "not_text")
            continue
        static = _static_check(task_type, text, contexts[i], rules)
        if isinstance(static, ProposalCheck):
            out[i] = static
            continue
        program, arg_srcs, message, tags_ok = static
        source_key = contexts[i].key() if isinstance(contexts[i], Task) else None
        pending.append(_Pending(i, program, arg_srcs, message, len(items), source_key))
        out[i] = ProposalCheck(False, "pending", tags_ok=tags_ok)
        for args_src in arg_srcs:
            items.extend(probe_item(program.source, args_src, rules.max_output_chars, run=k)
                         for k in range(rules.determinism_runs))

    results = sandbox.run(items) if items else []
    runs = rules.determinism_runs
    for p in pending:
        tags_ok = out[p.index].tags_ok
        n_items = len(p.arg_srcs) * runs
        exec_s = float(sum(getattr(r, "wall_s", 0.0) for r in results[p.first_item:p.first_item + n_items]))
        outputs: list[str] = []
        reason = "ok"
        for j in range(len(p.arg_srcs)):
            start = p.first_item + j * runs
            reason, text = _judge_runs(results[start:start + runs], p.program, rules)
            if reason != "ok":
                break
            outputs.append(text)
        if reason != "ok":
            out[p.index] = ProposalCheck(False, reason, tags_ok=tags_ok, exec_s=exec_s)
            continue
        meta = {"renamed_from": p.program.renamed_from} if p.program.renamed_from else {}
        if p.source_key:
            meta["source"] = p.source_key
        shown = list(range(len(p.arg_srcs) // 2)) if task_type == "code_f" else [0]
        task = Task(task_type, p.program.source, p.arg_srcs, outputs, message=p.message, shown=shown,
                    proposer=proposers[p.index], step=int(step), meta=meta)
        out[p.index] = ProposalCheck(True, "ok", task, tags_ok=tags_ok, exec_s=exec_s)
    return out  # type: ignore[return-value]


def check_proposal(task_type: str, completion: str, sandbox, *, program: Task | str | None = None,
                   proposer: str = "", step: int = 0, rules: TaskRules | None = None) -> ProposalCheck:
    """Single-proposal form of ``check_proposals``."""
    return check_proposals(task_type, [completion], sandbox, programs=program, proposer=proposer, step=step,
                           rules=rules)[0]
