"""Mode collapse, as defined before the 120-step study ran (``results/cpu-horizon/README.md``).

The paper's single agent collapses onto easy problems: its solver self-calibrates to what it reliably solves
while the problems get simpler and stop being new. With ``W = 20`` steps, a run is *collapsed at step t*
(t >= W) when the window of steps t-W+1..t meets all three conditions:

1. easy: the mean ``train/solve_rate`` over the window is at least ``EASY`` (0.9);
2. simpler: the mean ``complexity/ast_nodes`` over the window is at most its mean over steps 1..W;
3. not new: fewer than ``NEW_SHARE`` (5%) of the window's valid proposals are programs the run had not proposed
   before (distinct up to formatting, as the coverage archive counts them: ``program_fingerprint``). A window
   without a valid proposal proposes nothing new.

A run *collapses* when its last window is collapsed; *when*: the first step whose window is. Reported beside
each window, not part of the definition: new CVT cells (``coverage/new_cells``) and the students' answer length.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from openrlhf_populora.analysis.runs import RunData
from openrlhf_populora.metrics.coverage import program_fingerprint
from openrlhf_populora.metrics.keys import complexity_key, coverage_key, train_key

WINDOW = 20
EASY = 0.9
NEW_SHARE = 0.05
SOLVE_RATE = train_key("solve_rate")
AST_NODES = complexity_key("ast_nodes")
NEW_CELLS = coverage_key("new_cells")
ANSWER_LENGTH = train_key("student_response_length")


@dataclass(frozen=True)
class WindowCheck:
    """The three conditions on the window of steps ``first``..``last``."""

    first: int
    last: int
    solve_rate: float  # mean over the window's steps with a value (nan: none)
    ast_nodes: float
    valid: int  # valid proposals in the window
    new_programs: int  # of them, programs the run had not proposed before
    new_cells: float  # reported, not part of the definition
    answer_length: float  # reported
    easy: bool
    simpler: bool
    not_new: bool

    @property
    def collapsed(self) -> bool:
        return self.easy and self.simpler and self.not_new


@dataclass(frozen=True)
class Collapse:
    label: str
    steps: int
    reference_ast_nodes: float  # mean AST nodes over steps 1..W: what "simpler" compares with
    windows: list[WindowCheck]
    first_collapsed: int | None  # the first step whose window is collapsed
    collapsed: bool  # the last window is collapsed

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "windows": [{**asdict(w), "collapsed": w.collapsed} for w in self.windows]}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _values(run: RunData, key: str, first: int, last: int) -> list[float]:
    steps, values = run.series(key)
    return [float(v) for s, v in zip(steps, values, strict=True) if first <= s <= last]


def new_programs_by_step(run: RunData) -> dict[int, tuple[int, int]]:
    """``step -> (valid proposals, of them programs not proposed at an earlier step or earlier in that step)``."""
    seen: set[str] = set()
    out: dict[int, list[int]] = {}
    for record in sorted(run.problems(), key=lambda r: r["step"]):  # stable: a step's records keep their order
        if not record.get("valid") or not isinstance(record.get("program"), str):
            continue
        counts = out.setdefault(int(record["step"]), [0, 0])
        counts[0] += 1
        fingerprint = program_fingerprint(record["program"])
        if fingerprint not in seen:
            seen.add(fingerprint)
            counts[1] += 1
    return {step: (valid, new) for step, (valid, new) in out.items()}


def collapse(run: RunData, window: int = WINDOW, easy: float = EASY, new_share: float = NEW_SHARE) -> Collapse:
    """Every window of ``window`` steps of the run, checked against the definition."""
    steps = run.steps
    reference = _mean(_values(run, AST_NODES, 1, window))
    programs = new_programs_by_step(run)
    checks = []
    for last in steps:
        first = last - window + 1
        if first < 1:
            continue
        solve = _mean(_values(run, SOLVE_RATE, first, last))
        nodes = _mean(_values(run, AST_NODES, first, last))
        valid = sum(programs.get(s, (0, 0))[0] for s in range(first, last + 1))
        new = sum(programs.get(s, (0, 0))[1] for s in range(first, last + 1))
        checks.append(WindowCheck(
            first, last, solve, nodes, valid, new, sum(_values(run, NEW_CELLS, first, last)),
            _mean(_values(run, ANSWER_LENGTH, first, last)),
            easy=solve >= easy, simpler=nodes <= reference, not_new=new < new_share * valid or valid == 0))
    first_collapsed = next((c.last for c in checks if c.collapsed), None)
    return Collapse(run.label, len(steps), reference, checks, first_collapsed,
                    bool(checks) and checks[-1].collapsed)


def _cell(value: float, fmt: str = ".3g") -> str:
    return "-" if math.isnan(value) else format(value, fmt)


def collapse_table(results: list[Collapse]) -> str:
    """One Markdown row per run: when it first collapsed, whether it ends collapsed, and its last window."""
    head = (f"| run | steps | first collapsed (window of {WINDOW}) | collapsed at the end | last window | solve rate "
            f"(>= {EASY:g}) | AST nodes (<= steps 1-{WINDOW}) | new programs (< {NEW_SHARE:.0%}) | new cells | "
            "answer length |")
    rows = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in results:
        if not r.windows:
            rows.append(f"| {r.label} | {r.steps} | fewer than {WINDOW} steps | - | - | - | - | - | - | - |")
            continue
        w = r.windows[-1]
        share = f"{w.new_programs}/{w.valid}" + (f" ({w.new_programs / w.valid:.1%})" if w.valid else "")
        rows.append(f"| {r.label} | {r.steps} | {r.first_collapsed if r.first_collapsed is not None else 'never'} | "
                    f"{'yes' if r.collapsed else 'no'} | {w.first}-{w.last} | {_cell(w.solve_rate)} "
                    f"{'✓' if w.easy else '✗'} | {_cell(w.ast_nodes)} vs {_cell(r.reference_ast_nodes)} "
                    f"{'✓' if w.simpler else '✗'} | {share} {'✓' if w.not_new else '✗'} | {_cell(w.new_cells, 'g')} | "
                    f"{_cell(w.answer_length)} |")
    return "\n".join(rows) + "\n"
