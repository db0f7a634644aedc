"""The collapse definition of the 120-step study (``analysis/collapse.py``, ``cli/collapse.py``) on runs whose
collapse is planted at a known step, and on runs that fail exactly one of its three conditions."""

import json

import pytest

from openrlhf_populora.analysis.collapse import collapse
from openrlhf_populora.analysis.runs import load_run
from openrlhf_populora.cli.collapse import main


def program(n: int) -> str:
    return f"def f(x):\n    return x + {n}\n"


def write_run(path, steps, solve, nodes, proposals):
    """A run directory: ``solve(t)`` and ``nodes(t)`` per step, ``proposals(t)`` the step's valid programs
    (plus one invalid proposal a step, a program never proposed before, which the definition must not count)."""
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as f:
        for t in range(1, steps + 1):
            f.write(json.dumps({"step": t, "train/solve_rate": solve(t), "complexity/ast_nodes": nodes(t),
                                "coverage/new_cells": 1.0 if t <= 10 else 0.0,
                                "train/student_response_length": 20.0 - t / 10}) + "\n")
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
    assert (tmp_path / "out" / "collapse.md").read_text() in out
    assert main([str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
