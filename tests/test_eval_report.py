"""The table (Markdown + CSV) and the bar chart, from a fake set of graded samples and from results.json."""

from __future__ import annotations

import csv
import io
import json

import pytest

from openrlhf_populora.eval.report import (
    csv_table,
    markdown_table,
    report_from_results,
    summarize,
    write_report,
)

BENCHMARKS = ["humaneval_plus", "mbpp_plus", "gsm8k", "math500"]
# pass counts out of 10 problems per benchmark
PASSES = {
    "base": {"humaneval_plus": 5, "mbpp_plus": 5, "gsm8k": 2, "math500": 2},
    "baseline-b0": {"humaneval_plus": 6, "mbpp_plus": 5, "gsm8k": 3, "math500": 2},
    "s0": {"humaneval_plus": 8, "mbpp_plus": 6, "gsm8k": 4, "math500": 4},
    "s1": {"humaneval_plus": 6, "mbpp_plus": 6, "gsm8k": 6, "math500": 2},
    "t0": {"humaneval_plus": 7, "mbpp_plus": 4, "gsm8k": 3, "math500": 3},
}
GROUPS = {"base": ["base"], "baseline": ["baseline-b0"], "population": ["s0", "s1", "t0"]}


def fake_records() -> list[dict]:
    return [
        {"member": m, "benchmark": b, "problem_id": f"{b}/{i}", "passed": i < n}
        for m, per in PASSES.items() for b, n in per.items() for i in range(10)
    ]


@pytest.fixture()
def summary():
    return summarize(fake_records(), GROUPS, BENCHMARKS, totals={b: 10 for b in BENCHMARKS},
                     roles={"s0": "student", "s1": "student", "t0": "teacher"})


def test_member_scores_and_averages(summary):
    s0 = summary["members"]["s0"]
    assert s0["scores"] == {"humaneval_plus": 80.0, "mbpp_plus": 60.0, "gsm8k": 40.0, "math500": 40.0}
    assert s0["code_avg"] == 70.0 and s0["math_avg"] == 40.0 and s0["overall"] == 55.0  # AZR: (CAvg + MAvg) / 2
    assert s0["complete"] and s0["role"] == "student"


def test_rows_population_mean_best_worst(summary):
    rows = {r["label"]: r for r in summary["rows"]}
    assert list(rows) == ["Base model", "PopuLoRA baseline (B1)", "Population mean", "Population best (s0)",
                          "Population worst (t0)", "s0 (student)", "s1 (student)", "t0 (teacher)"]
    mean = rows["Population mean"]
    assert mean["scores"]["humaneval_plus"] == pytest.approx((80 + 60 + 70) / 3)
    # overalls: s0 55, s1 (60+40)/2 = 50, t0 (55+30)/2 = 42.5
    assert mean["overall"] == pytest.approx((55 + 50 + 42.5) / 3)
    assert rows["PopuLoRA baseline (B1)"]["overall"] == pytest.approx(((60 + 50) / 2 + (30 + 20) / 2) / 2)


def test_markdown_and_csv_tables(summary):
    md = markdown_table(summary)
    assert "| Model | HumanEval+ | MBPP+ | GSM8K | MATH-500 | Code Avg | Math Avg | Overall |" in md
    assert "| Population best (s0) | 80.0 | 60.0 | 40.0 | 40.0 | 70.0 | 40.0 | 55.0 |" in md
    rows = list(csv.reader(io.StringIO(csv_table(summary))))
    assert rows[0][0] == "Model" and rows[0][-1] == "Overall"
    assert rows[1] == ["Base model", "50.0", "50.0", "20.0", "20.0", "50.0", "20.0", "35.0"]
    assert len(rows) == 1 + len(summary["rows"])


def test_incomplete_members_are_flagged(summary):
    partial = summarize(fake_records(), GROUPS, BENCHMARKS, totals={b: 20 for b in BENCHMARKS})
    assert not partial["members"]["s0"]["complete"]
    assert "Incomplete" in markdown_table(partial)
    assert "Incomplete" not in markdown_table(summary)


def test_code_only_table_has_no_math_average():
    summary = summarize(fake_records(), {"population": ["s0"]}, ["humaneval_plus"])
    md = markdown_table(summary)
    assert "Code Avg" in md and "Math Avg" not in md


def test_write_report_and_rerender_from_results_json(summary, tmp_path):
    paths = write_report(summary, tmp_path / "eval")
    for path in paths.values():
        assert path.is_file() and path.stat().st_size > 0
    assert paths["chart"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(paths["json"].read_text())["members"]["s1"]["scores"]["gsm8k"] == 60.0
    again = report_from_results(paths["json"], tmp_path / "again")
    assert again["markdown"].read_text() == paths["markdown"].read_text()
    assert again["chart"].read_bytes()[:4] == b"\x89PNG"


def test_bad_results_file(tmp_path):
    with pytest.raises(ValueError, match="not found: run the evaluation first"):
        report_from_results(tmp_path / "results.json")
    (tmp_path / "results.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="lacks 'benchmarks'"):
        report_from_results(tmp_path / "results.json")


def test_unknown_group_is_rejected():
    with pytest.raises(ValueError, match="unknown member groups"):
        summarize(fake_records(), {"teachers": ["t0"]}, BENCHMARKS)
