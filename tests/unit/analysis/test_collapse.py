"""The collapse definition of the 120-step study (``analysis/collapse.py``, ``cli/collapse.py``) on runs whose
collapse is planted at a known step, and on runs that fail exactly one of its three conditions."""

import json

import pytest

from openrlhf_populora.analysis.collapse import collapse, collapse_table
from openrlhf_populora.analysis.runs import load_run
from openrlhf_populora.cli.collapse import main


def program(n: int) -> str:
    return f"def f(x):\n    return x + {n}\n"


def write_run(path, steps, solve, nodes, proposals, answer_length=lambda t: 20.0 - t / 10):
    """A run directory: ``solve(t)`` and ``nodes(t)`` per step (``solve`` None: no solve rate logged),
    ``proposals(t)`` the step's valid programs (plus one invalid proposal a step, a program never proposed
    before, which the definition must not count)."""
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as f:
        for t in range(1, steps + 1):
            row = {"step": t, "complexity/ast_nodes": nodes(t), "coverage/new_cells": 1.0 if t <= 10 else 0.0,
                   "train/student_response_length": answer_length(t)}
            if solve is not None:
                row["train/solve_rate"] = solve(t)
            f.write(json.dumps(row) + "\n")
    with open(path / "problems.jsonl", "w") as f:
        for t in range(1, steps + 1):
            for code in proposals(t):
                f.write(json.dumps({"step": t, "valid": True, "program": code}) + "\n")
            f.write(json.dumps({"step": t, "valid": False, "program": program(-t)}) + "\n")  # never valid
    return path


def planted(t):
    # steps 1-40: 5 programs never seen before each step; from 41: step 1's first program four times
    return [program(5 * t + i) for i in range(5)] if t <= 40 else [program(5)] * 4


def solve_planted(t):
    return 0.5 if t <= 40 else 1.0


def nodes_planted(t):
    return 10.0 if t <= 40 else 8.0


def test_a_planted_collapse_is_found_at_the_step_computed_by_hand(tmp_path):
    # Window ending at t (steps t-19..t), for t from 41 to 60: solve rate ((t-40) + 0.5 (60-t)) / 20 >= 0.9 from
    # t = 56; AST nodes below steps 1-20's 10 from t = 41; new programs: 5 a step for each step up to 40 in the
    # window, over 5 a step up to 40 and 4 after: 0 of 80 only at t = 60 (t = 59: 5 of 81, 6.2%).
    # Catches: a window of 21 steps (t = 60 would hold step 40's 5 new of 85, 5.9%, and collapse at 61), the 0.9
    # or 5% compared the wrong way, the invalid proposals counted, "new" counted per step instead of per run.
    result = collapse(load_run(write_run(tmp_path / "run", 80, solve_planted, nodes_planted, planted)))
    assert result.first_collapsed == 60 and result.collapsed
    assert result.reference_ast_nodes == 10.0
    by_end = {w.last: w for w in result.windows}
    assert min(by_end) == 20 and max(by_end) == 80 and len(result.windows) == 61
    assert [t for t in range(41, 61) if by_end[t].easy] == list(range(56, 61))
    assert by_end[55].solve_rate == pytest.approx(0.875) and by_end[56].solve_rate == pytest.approx(0.9)
    assert (by_end[59].valid, by_end[59].new_programs, by_end[59].not_new) == (81, 5, False)
    assert (by_end[60].valid, by_end[60].new_programs, by_end[60].not_new) == (80, 0, True)
    assert by_end[60].first == 41 and by_end[60].simpler and by_end[60].collapsed
    assert by_end[20].new_cells == 10.0 and by_end[60].new_cells == 0.0


def test_a_run_that_recovers_collapsed_once_but_not_at_the_end(tmp_path):
    # Catches: "collapses" read from any window instead of the last one.
    result = collapse(load_run(write_run(tmp_path / "run", 90, lambda t: 0.5 if t <= 40 or t > 70 else 1.0,
                                         nodes_planted, planted)))
    assert result.first_collapsed == 60 and not result.collapsed


@pytest.mark.parametrize("fails", ["easy", "simpler", "not_new"])
def test_each_condition_alone_blocks_a_collapse(tmp_path, fails):
    # The planted run with one condition undone: solve rate 0.85 (just under 0.9), AST nodes rising above steps
    # 1-20's, or one new program in every step after 40 (20 of the last window's 80: 25%).
    # Catches: a collapse that needs only two of the three conditions (or only one).
    solve = (lambda t: 0.85) if fails == "easy" else solve_planted
    nodes = (lambda t: 10.0 + t / 100) if fails == "simpler" else nodes_planted
    proposals = ((lambda t: planted(t) if t <= 40 else [program(5)] * 3 + [program(1000 + t)])
                 if fails == "not_new" else planted)
    result = collapse(load_run(write_run(tmp_path / "run", 80, solve, nodes, proposals)))
    assert result.first_collapsed is None and not result.collapsed
    last = result.windows[-1]
    assert [last.easy, last.simpler, last.not_new].count(False) == 1
    assert getattr(last, fails) is False


def test_a_run_shorter_than_the_window_has_no_verdict_and_the_command_writes_its_files(tmp_path, capsys):
    # Catches: windows starting before step 1 (a 10-step run judged on a partial window); the table and the JSON
    # disagreeing; a bad run directory accepted.
    short = write_run(tmp_path / "short", 10, lambda t: 1.0, lambda t: 5.0, lambda t: [program(0)])
    long = write_run(tmp_path / "long", 80, solve_planted, nodes_planted, planted)
    assert main([str(short), str(long), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "| short | 10 | fewer than 20 steps |" in out
    assert "| long | 80 | 60 | yes | 61-80 | 1 ✓ | 8 vs 10 ✓ | 0/80 (0.0%) ✓ | 0 | 12.9 |" in out
    data = json.loads((tmp_path / "out" / "collapse.json").read_text())
    assert [(r["label"], r["first_collapsed"], r["collapsed"], len(r["windows"])) for r in data] == \
        [("short", None, False, 0), ("long", 60, True, 61)]
    assert [w["collapsed"] for w in data[1]["windows"]][39:42] == [False, True, True]  # windows ending 59-61
    assert (tmp_path / "out" / "collapse.md").read_text() in out
    assert main([str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def boundary_nodes(t):
    return float(t) if t <= 20 else 10.5  # steps 1-20 average 10.5: every later window equals it exactly


def test_each_condition_at_its_boundary_computed_by_hand(tmp_path):
    # 40 steps. AST nodes: t on steps 1-20 (reference 10.5; 11 if step 1 were left out), then 10.5, so the
    # window 21-40 is exactly as complex as the reference. Solve rate 0.5, then 1.0. Valid proposals: 4 new ones
    # a step on steps 1-20, then 4 repeats of one earlier program a step, except one new program at step 40.
    # Window 21-40: 80 valid, 1 new (1 < 4), 10.5 <= 10.5, solve 1.0: collapsed, at the last step only. Window
    # 20-39: 80 valid, 4 new (step 20's): not under 5% (4 < 4.0 is false). Catches: the reference taken from
    # another span, "simpler" as strictly below, 5% compared with <=, the share divided by the valid count
    # instead of multiplied, the new programs counted over a window one step short or long, and "collapsed at the
    # end" read from the window before the last.
    def proposals(t):
        if t <= 20:
            return [program(4 * t + i) for i in range(4)]
        return [program(4)] * 3 + [program(10_000)] if t == 40 else [program(4)] * 4

    result = collapse(load_run(write_run(tmp_path / "run", 40, lambda t: 0.5 if t <= 20 else 1.0, boundary_nodes,
                                         proposals)))
    assert result.reference_ast_nodes == 10.5
    by_end = {w.last: w for w in result.windows}
    assert (by_end[39].valid, by_end[39].new_programs, by_end[39].not_new) == (80, 4, False)
    assert (by_end[40].valid, by_end[40].new_programs, by_end[40].not_new) == (80, 1, True)
    assert by_end[40].ast_nodes == 10.5 and by_end[40].simpler and by_end[40].easy
    assert result.first_collapsed == 40 and result.collapsed


def test_a_window_without_a_valid_proposal_proposes_nothing_new_and_a_missing_series_reads_as_absent(tmp_path):
    # Steps 21-40 propose nothing valid, and no step logs a solve rate. Window 21-40: 0 valid, 0 new, "not new"
    # holds; its solve rate is absent ("-"), so it is not easy and nothing collapses. The table's row, by hand.
    # Catches: a step without valid proposals counted as one valid or one new program, or a lookup failing on
    # it; "valid == 0" read as "valid == 1"; an empty series averaged (division by zero) or shown as a number;
    # the row's cells and marks, the table's header and separator.
    result = collapse(load_run(write_run(tmp_path / "quiet", 40, None, boundary_nodes,
                                         lambda t: [program(t)] if t <= 20 else [], answer_length=lambda t: 1234.5)))
    last = result.windows[-1]
    assert (last.first, last.valid, last.new_programs, last.not_new) == (21, 0, 0, True)
    assert last.solve_rate != last.solve_rate and not last.easy  # nan
    assert result.first_collapsed is None and not result.collapsed
    assert collapse_table([result]).splitlines() == [
        "| run | steps | first collapsed (window of 20) | collapsed at the end | last window | solve rate (>= 0.9) | "
        "AST nodes (<= steps 1-20) | new programs (< 5%) | new cells | answer length |",
        "|---|---|---|---|---|---|---|---|---|---|",
        "| quiet | 40 | never | no | 21-40 | - ✗ | 10.5 vs 10.5 ✓ | 0/0 ✓ | 0 | 1.23e+03 |",
    ]


def test_a_window_more_complex_than_the_reference_is_marked_so(tmp_path):
    # Catches: the table's marks for a failed condition ("✗") and a share with its percentage, on a run whose
    # last window fails "simpler" and "not new" (AST nodes 12 against 10.5; 20 of 20 programs new). Answer
    # length: 20 - t/10 over steps 21-40 averages 16.95, which three significant digits print as 16.9 (the
    # double nearest 16.95 lies below it).
    result = collapse(load_run(write_run(tmp_path / "busy", 40, lambda t: 1.0,
                                         lambda t: boundary_nodes(t) if t <= 20 else 12.0, lambda t: [program(t)])))
    assert collapse_table([result]).splitlines()[2] == \
        "| busy | 40 | never | no | 21-40 | 1 ✓ | 12 vs 10.5 ✗ | 20/20 (100.0%) ✗ | 0 | 16.9 |"
