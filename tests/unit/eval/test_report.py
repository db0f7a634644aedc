"""The table (Markdown + CSV) and the bar chart, from a fake set of graded samples and from results.json."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest

from openrlhf_populora.eval.report import (
    bootstrap_interval,
    chart_rows,
    csv_table,
    markdown_table,
    paired_against,
    report_from_results,
    summarize,
    wilson_interval,
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


MEANS = ["Population mean, students (2)", "Population mean, teachers (1)", "Population mean, all members (3)"]
BEST_S0 = "Best student s0 (picked on these benchmarks: optimistic)"
WORST_T0 = "Worst member t0 (picked on these benchmarks: pessimistic)"


def test_rows_means_per_role_best_and_members(summary):
    # catches: teachers averaged into the students' mean, no per-role means, an unlabelled "best", a worst
    # picked within a role or by the highest score (t0's overall 42.5 is the lowest of all three)
    rows = {r["label"]: r for r in summary["rows"]}
    assert list(rows) == ["Base model", "PopuLoRA baseline (B1)", *MEANS, BEST_S0, WORST_T0,
                          "s0 (student)", "s1 (student)", "t0 (teacher)"]
    assert rows[MEANS[0]]["scores"]["humaneval_plus"] == pytest.approx((80 + 60) / 2)
    assert rows[MEANS[1]]["scores"]["humaneval_plus"] == pytest.approx(70)
    assert rows[MEANS[2]]["scores"]["humaneval_plus"] == pytest.approx((80 + 60 + 70) / 3)
    # overalls: s0 55, s1 (60+40)/2 = 50, t0 (55+30)/2 = 42.5
    assert rows[MEANS[0]]["overall"] == pytest.approx((55 + 50) / 2)
    assert rows[MEANS[2]]["overall"] == pytest.approx((55 + 50 + 42.5) / 3)
    assert rows["PopuLoRA baseline (B1)"]["overall"] == pytest.approx(((60 + 50) / 2 + (30 + 20) / 2) / 2)
    assert [r["kind"] for r in summary["rows"]] == ["mean"] * 5 + ["best", "worst"] + ["member"] * 3
    assert rows[WORST_T0]["members"] == ["t0"] and rows[WORST_T0]["overall"] == pytest.approx(42.5)
    # one problem count per number: 10 problems per benchmark, their sums for the averages
    assert rows[MEANS[2]]["n"] == {**{b: 10 for b in BENCHMARKS}, "code_avg": 20, "math_avg": 20, "overall": 40}


def test_a_member_on_one_benchmark_gets_wilsons_interval(summary):
    # s0: 8 of 10 on HumanEval+. Wilson: (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), z = 1.959964
    # = (0.8 + 0.192073 -+ 1.959964 * sqrt(0.016 + 0.009604)) / 1.384146 = 0.716733 -+ 0.226577.
    # Catches: the Wald interval (0.8 -+ 0.248: 55.2 to 104.8), Clopper-Pearson (44.4 to 97.5), no interval.
    interval = summary["members"]["s0"]["intervals"]["humaneval_plus"]
    assert interval == pytest.approx([49.0156, 94.3310], abs=1e-3)
    rows = {r["label"]: r for r in summary["rows"]}
    assert rows["s0 (student)"]["intervals"]["humaneval_plus"] == pytest.approx(interval)
    assert rows[BEST_S0]["intervals"]["humaneval_plus"] == pytest.approx(interval)


def _two_students(passes: dict[str, dict[str, list[int]]]) -> dict:
    records = [{"member": m, "benchmark": b, "problem_id": f"{b}/{i}", "passed": bool(x)}
               for m, per in passes.items() for b, xs in per.items() for i, x in enumerate(xs)]
    return summarize(records, {"population": list(passes)}, sorted({b for per in passes.values() for b in per}),
                     roles={m: "student" for m in passes})


def _bootstrap(strata: list[list[int]]) -> list[float]:
    """The percentile bootstrap the report documents, written out: 2,000 resamples, seed 0, each stratum (a
    benchmark's per-problem pass rates) resampled on its own, the statistic the mean of the strata's means."""
    from scipy.stats import bootstrap

    result = bootstrap(tuple(np.array(x, dtype=float) for x in strata),
                       lambda *xs, axis=-1: 100 * sum(np.mean(x, axis=axis) for x in xs) / len(xs), paired=False,
                       vectorized=True, n_resamples=2000, confidence_level=0.95, method="percentile",
                       rng=np.random.default_rng(0))
    return [result.confidence_interval.low, result.confidence_interval.high]


def test_a_mean_over_members_resamples_problems_not_answers():
    # s0 and s1 answer alike: 5 of the same 10 problems. Members share problems, so the mean's uncertainty is
    # that of the 10 problems, not of 20 independent answers: its interval is the bootstrap of the 10 per-problem
    # rates. Catches: an interval over (member, problem) pairs (a binomial on 10 of 20: 29.9 to 70.1), or over
    # members resampled apart.
    summary = _two_students({"s0": {"humaneval": [1, 0] * 5}, "s1": {"humaneval": [1, 0] * 5}})
    (mean,) = [r for r in summary["rows"] if r["kind"] == "mean"]
    assert mean["scores"]["humaneval"] == 50.0 and mean["n"]["humaneval"] == 10
    assert mean["intervals"]["humaneval"] == pytest.approx(_bootstrap([[1, 0] * 5]))
    assert mean["intervals"]["humaneval"][0] < 29.0  # wider than 20 independent answers would give


def test_an_average_over_benchmarks_resamples_each_benchmark_on_its_own():
    # s0 passes 8 of 10 HumanEval+ problems and 2 of 10 MBPP+: Code Avg 50, its interval the bootstrap that
    # resamples each benchmark's problems alone. Catches: all 20 problems resampled together (a wider interval).
    he, mbpp = [1] * 8 + [0] * 2, [1] * 2 + [0] * 8
    summary = _two_students({"s0": {"humaneval_plus": he, "mbpp_plus": mbpp},
                             "s1": {"humaneval_plus": he, "mbpp_plus": mbpp}})
    s0 = summary["members"]["s0"]
    assert s0["code_avg"] == 50.0 and s0["intervals"]["code_avg"] == pytest.approx(_bootstrap([he, mbpp]))
    assert s0["intervals"]["code_avg"] != pytest.approx(_bootstrap([he + mbpp]))
    assert [r for r in summary["rows"] if r["label"] == "s0 (student)"][0]["n"]["code_avg"] == 20


def test_a_number_no_resample_can_move_gets_wilsons_interval():
    # Both members fail all 10 problems: every resample gives 0, a bootstrap interval of no width. The row shows
    # Wilson's interval for 0 of 10 instead: 0 to (z^2/n) / (1 + z^2/n) = 0.38415 / 1.38415 = 27.75%.
    # Catches: a mean row claiming [0.0, 0.0] from 10 problems.
    summary = _two_students({"s0": {"humaneval": [0] * 10}, "s1": {"humaneval": [0] * 10}})
    (mean,) = [r for r in summary["rows"] if r["kind"] == "mean"]
    assert mean["intervals"]["humaneval"] == pytest.approx([0.0, 27.753], abs=1e-3)
    assert mean["intervals"]["overall"] == pytest.approx([0.0, 27.753], abs=1e-3)


def test_untrained_members_stay_out_of_means_and_bests(summary):
    # catches: an untrained member (e.g. born at the run's last step) averaged into a mean or picked as a best
    untrained = {"t0": "born at step 40, the run's last step", "s1": "no update since its birth at step 0"}
    table = summarize(fake_records(), GROUPS, BENCHMARKS, totals={b: 10 for b in BENCHMARKS},
                      roles={"s0": "student", "s1": "student", "t0": "teacher"}, untrained=untrained)
    rows = {r["label"]: r for r in table["rows"]}
    assert list(rows) == ["Base model", "PopuLoRA baseline (B1)", "Population mean, students (1)", "s0 (student)",
                          "s1 (student, untrained: no update since its birth at step 0)",
                          "t0 (teacher, untrained: born at step 40, the run's last step)"]
    assert rows["Population mean, students (1)"]["members"] == ["s0"]
    assert rows["Population mean, students (1)"]["overall"] == 55.0
    assert not table["members"]["t0"]["trained"] and table["members"]["s0"]["trained"]
    assert "Untrained members, left out of every mean and best: t0 (born at step 40, the run's last step); s1 (" \
        in markdown_table(table)


def test_best_picked_on_a_separate_benchmark_is_labelled_so(summary):
    # s1 beats s0 on HumanEval (held out: not in the table) though s0 leads on the table's benchmarks.
    # Catches: --select-on ignored (s0 picked on the table's own benchmarks), or a held-out pick labelled optimistic.
    held_out = [{"member": m, "benchmark": "humaneval", "problem_id": f"HumanEval/{i}", "passed": i < k}
                for m, k in (("s0", 3), ("s1", 7), ("t0", 5), ("t1", 2)) for i in range(10)]
    t1 = [{"member": "t1", "benchmark": b, "problem_id": f"{b}/{i}", "passed": i < 9}
          for b in BENCHMARKS for i in range(10)]
    groups = {**GROUPS, "population": ["s0", "s1", "t0", "t1"]}
    roles = {"s0": "student", "s1": "student", "t0": "teacher", "t1": "teacher"}
    table = summarize(fake_records() + held_out + t1, groups, BENCHMARKS, roles=roles, select_on=["humaneval"])
    bests = [r["label"] for r in table["rows"] if r["kind"] == "best"]
    assert bests == ["Best student s1 (picked on HumanEval)", "Best teacher t0 (picked on HumanEval)"]
    # the worst on the held-out benchmark is t1 (2 of 10), though on the table's benchmarks it is the best (9 of 10)
    assert [r["label"] for r in table["rows"] if r["kind"] == "worst"] == ["Worst member t1 (picked on HumanEval)"]
    assert table["selection"]["held_out"] and table["selection"]["scores"]["s1"]["humaneval"] == 70.0
    assert "humaneval" not in table["benchmarks"] and "a benchmark not in this table" in markdown_table(table)
    same = summarize(fake_records() + t1, groups, BENCHMARKS, roles=roles)
    assert [r["label"] for r in same["rows"] if r["kind"] == "best"] == [
        BEST_S0, "Best teacher t1 (picked on these benchmarks: optimistic)"]
    assert [r["label"] for r in same["rows"] if r["kind"] == "worst"] == [WORST_T0]
    assert "biased upward and the minimum downward" in markdown_table(same)
    with pytest.raises(ValueError, match="also table benchmarks"):
        summarize(fake_records(), GROUPS, BENCHMARKS, select_on=["gsm8k"])


def test_markdown_and_csv_tables(summary):
    md = markdown_table(summary)
    assert ("| Model | HumanEval+ (n=10) | MBPP+ (n=10) | GSM8K (n=10) | MATH-500 (n=10) | Code Avg (n=20) "
            "| Math Avg (n=20) | Overall (n=40) |") in md
    assert f"| {BEST_S0} | 80.0 [49.0, 94.3] | 60.0 [31.3, 83.2] | 40.0 [16.8, 68.7] | 40.0 [16.8, 68.7] |" in md
    assert "Wilson's binomial interval" in md and "percentile bootstrap over problems" in md
    rows = list(csv.reader(io.StringIO(csv_table(summary))))
    assert rows[0][:5] == ["Model", "HumanEval+", "HumanEval+ low", "HumanEval+ high", "HumanEval+ n"]
    assert rows[0][-4:] == ["Overall", "Overall low", "Overall high", "Overall n"]
    assert rows[1][:5] == ["Base model", "50.0", "23.7", "76.3", "10"]
    assert rows[1][-4] == "35.0" and rows[1][-1] == "40"
    assert len(rows) == 1 + len(summary["rows"])


def test_a_number_on_fewer_problems_says_how_many():
    # s1 has only 4 of HumanEval's 10 problems graded: its cells say n=4, and the students' mean rests on the 4
    # problems both answered: s0 passes problems 0-7, s1 problems 0-1, so (4/4 + 2/4) / 2 = 75.
    # Catches: a mean over members that mixes each member's own problem set, or an n that is not shown.
    records = [{"member": "s0", "benchmark": "humaneval", "problem_id": f"HumanEval/{i}", "passed": i < 8}
               for i in range(10)]
    records += [{"member": "s1", "benchmark": "humaneval", "problem_id": f"HumanEval/{i}", "passed": i < 2}
                for i in range(4)]
    table = summarize(records, {"population": ["s0", "s1"]}, ["humaneval"], totals={"humaneval": 10},
                      roles={"s0": "student", "s1": "student"})
    mean = table["rows"][0]
    assert mean["scores"]["humaneval"] == 75.0 and mean["n"]["humaneval"] == 4
    md = markdown_table(table)
    assert "| Population mean, students (2) | 75.0 [" in md and "(n=4) |" in md
    assert "| s1 (student) | 50.0 [15.0, 85.0] (n=4) |" in md and "Incomplete" in md


def test_incomplete_members_are_flagged(summary):
    partial = summarize(fake_records(), GROUPS, BENCHMARKS, totals={b: 20 for b in BENCHMARKS})
    assert not partial["members"]["s0"]["complete"]
    assert "Incomplete" in markdown_table(partial)
    assert "Incomplete" not in markdown_table(summary)


def test_code_only_table_has_no_math_average():
    summary = summarize(fake_records(), {"population": ["s0"]}, ["humaneval_plus"])
    md = markdown_table(summary)
    assert "Code Avg" in md and "Math Avg" not in md
    # an average over one benchmark is that benchmark's number, with its interval
    s0 = summary["members"]["s0"]
    assert s0["intervals"]["code_avg"] == s0["intervals"]["overall"] == s0["intervals"]["humaneval_plus"]


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


def _records(passes: dict[str, dict[str, tuple[int, int]]]) -> list[dict]:
    """member -> benchmark -> (passed, graded): the first ``passed`` of its ``graded`` problems pass."""
    return [{"member": m, "benchmark": b, "problem_id": f"{b}/{i}", "passed": i < passed}
            for m, per in passes.items() for b, (passed, graded) in per.items() for i in range(graded)]


def test_members_graded_on_different_problems_are_ranked_on_the_shared_ones():
    # An evaluation still running: s3 has HumanEval only (2 of 4), s4 both (3 of 4, then 0 of 4 on MBPP).
    # Catches: ranking s3's HumanEval-only Overall (50) against s4's two-benchmark one (37.5), which makes the
    # weaker s3 the best student; and a pick on unfinished members not saying so.
    records = _records({"s3": {"humaneval": (2, 4)}, "s4": {"humaneval": (3, 4), "mbpp": (0, 4)}})
    summary = summarize(records, {"population": ["s3", "s4"]}, ["humaneval", "mbpp"],
                        totals={"humaneval": 4, "mbpp": 4}, roles={"s3": "student", "s4": "student"})
    best = next(r for r in summary["rows"] if r["kind"] == "best")
    assert best["members"] == ["s4"] and "provisional: not every problem graded" in best["label"], best["label"]
    finished = summarize(_records({"s3": {"humaneval": (2, 4), "mbpp": (4, 4)},
                                   "s4": {"humaneval": (3, 4), "mbpp": (0, 4)}}),
                         {"population": ["s3", "s4"]}, ["humaneval", "mbpp"], totals={"humaneval": 4, "mbpp": 4},
                         roles={"s3": "student", "s4": "student"})
    best = next(r for r in finished["rows"] if r["kind"] == "best")
    assert best["members"] == ["s3"] and "provisional" not in best["label"]  # 75 against 37.5, all graded


def test_a_tie_is_exact_and_names_every_tied_member():
    # 13/164 + 113/200 and 54/164 + 63/200 are the same Overall exactly, but not in floating point. Catches:
    # float comparison (s4, the second listed, "wins" by rounding), and a tie shown as a clear best and worst.
    assert (100 * 13 / 164 + 100 * 113 / 200) / 2 != (100 * 54 / 164 + 100 * 63 / 200) / 2
    records = _records({"s3": {"humaneval": (13, 164), "mbpp": (113, 200)},
                        "s4": {"humaneval": (54, 164), "mbpp": (63, 200)}})
    summary = summarize(records, {"population": ["s3", "s4"]}, ["humaneval", "mbpp"],
                        totals={"humaneval": 164, "mbpp": 200}, roles={"s3": "student", "s4": "student"})
    rows = {r["kind"]: r for r in summary["rows"] if r["kind"] in ("best", "worst")}
    assert rows["best"]["members"] == ["s3"] and "tied with s4" in rows["best"]["label"]
    assert rows["worst"]["members"] == ["s3"] and "tied with s4" in rows["worst"]["label"]


def test_an_untrained_baseline_member_is_not_averaged_into_b1():
    # Catches: B1's mean over every baseline member evaluated (--include-untrained), while the notes say
    # untrained members are left out of every mean
    records = _records({"baseline-b0": {"humaneval": (9, 10)}, "baseline-b1": {"humaneval": (1, 10)}})
    summary = summarize(records, {"baseline": ["baseline-b0", "baseline-b1"]}, ["humaneval"],
                        totals={"humaneval": 10}, untrained={"baseline-b1": "no update in metrics.jsonl"})
    rows = {r["label"]: r for r in summary["rows"]}
    assert rows["PopuLoRA baseline (B1)"]["members"] == ["baseline-b0"]
    assert rows["PopuLoRA baseline (B1)"]["scores"]["humaneval"] == 90.0
    assert rows["baseline-b1 (baseline, untrained: no update in metrics.jsonl)"]["scores"]["humaneval"] == 10.0


def test_a_sample_cut_by_limit_is_described_as_such():
    # Catches: "the 50 whose SHA-256 ... is smallest" for the first 50 (benchmark order) of a fixed sample of
    # 200, which are not the 50 smallest; and a bare --limit not mentioned at all
    summary = summarize(_records({"s0": {"mbpp": (3, 5), "humaneval": (2, 5)}}), {"population": ["s0"]},
                        ["humaneval", "mbpp"], totals={"humaneval": 5, "mbpp": 5})
    summary["samples"] = {"mbpp": {"size": 200, "of": 500}}
    summary["limit"] = {"humaneval": {"size": 5, "of": 164}, "mbpp": {"size": 5, "of": 500}}
    md = markdown_table(summary)
    assert "MBPP: the first 5 (in the benchmark's order, --limit) of a fixed sample of 200 of its 500" in md, md
    assert "SHA-256 of 'mbpp/<problem id>'" in md
    assert "HumanEval: the first 5 (in the benchmark's order, --limit) of its 164 problems: not a random sample" in md
    summary["limit"] = {}
    assert "MBPP: a fixed sample of 200 of its 500 problems, the 200 whose SHA-256" in markdown_table(summary)


def test_a_pick_before_every_member_is_graded_says_provisional():
    # the evaluation runs member by member: s3 and s4 done, s5 not started. Catches: "Best student s4" shown as
    # final although s5 may beat it.
    records = _records({"s3": {"humaneval": (2, 4)}, "s4": {"humaneval": (3, 4)}})
    summary = summarize(records, {"population": ["s3", "s4", "s5"]}, ["humaneval"], totals={"humaneval": 4},
                        roles={"s3": "student", "s4": "student", "s5": "student"})
    best = next(r for r in summary["rows"] if r["kind"] == "best")
    assert best["members"] == ["s4"] and "provisional: s5 not graded yet" in best["label"], best["label"]


def test_the_pick_averages_within_each_kind_then_across_kinds():
    # AZR's Overall: the mean of Code Avg and Math Avg. s3 passes both code benchmarks and fails the math one,
    # s4 the reverse: both have Overall (1 + 0) / 2 = (0 + 1) / 2, a tie. Catches (mutation testing): ranking on
    # the mean of all three benchmarks (s3 2/3 against s4 1/3) or on a per-kind sum instead of a mean.
    records = _records({"s3": {"humaneval": (1, 1), "mbpp": (1, 1), "gsm8k": (0, 1)},
                        "s4": {"humaneval": (0, 1), "mbpp": (0, 1), "gsm8k": (1, 1)}})
    summary = summarize(records, {"population": ["s3", "s4"]}, ["humaneval", "mbpp", "gsm8k"],
                        totals={"humaneval": 1, "mbpp": 1, "gsm8k": 1}, roles={"s3": "student", "s4": "student"})
    best = next(r for r in summary["rows"] if r["kind"] == "best")
    assert best["members"] == ["s3"] and "tied with s4" in best["label"], best["label"]


def test_each_model_is_paired_against_the_base_on_the_same_problems():
    # base passes problems 0-4 of 10, s3 passes 2-8: s3 gains 5, 6, 7, 8 and loses 0, 1. McNemar's exact p is
    # P(|X - 3| >= 1) for X ~ Binomial(6, 1/2) = 1 - P(X = 3) = 1 - 20/64 = 0.6875. Catches: gained and lost
    # swapped, or the net difference of pass counts (7 - 5 = +2) reported as if paired.
    records = [{"member": m, "benchmark": "humaneval", "problem_id": f"HumanEval/{i}", "passed": i in passing}
               for m, passing in (("base", range(0, 5)), ("s3", range(2, 9))) for i in range(10)]
    summary = summarize(records, {"base": ["base"], "population": ["s3"]}, ["humaneval"], totals={"humaneval": 10})
    member = next(r for r in summary["rows"] if r["members"] == ["s3"] and r["kind"] == "member")
    assert member["vs_base"] == {"gained": 4, "lost": 2, "problems": 10, "p": pytest.approx(0.6875)}
    assert "vs_base" not in next(r for r in summary["rows"] if r["label"] == "Base model")
    assert "+4 / -2 (p=0.69)" in markdown_table(summary)


def test_another_arms_solver_is_a_row_of_its_own_beside_the_base_never_in_the_population():
    # The control's agent solves 9 of 10, above both population students (5 and 6 of 10); the base 4 of 10.
    # Catches: an --arm member averaged into the population's means or picked as its best (it would be the
    # best student, and the students' mean 66.7), its row missing, or missing its paired count against the base.
    records = _records({"base": {"humaneval": (4, 10)}, "control-b0": {"humaneval": (9, 10)},
                        "s0": {"humaneval": (5, 10)}, "s1": {"humaneval": (6, 10)}})
    summary = summarize(records, {"base": ["base"], "arm": ["control-b0"], "population": ["s0", "s1"]},
                        ["humaneval"], totals={"humaneval": 10},
                        roles={"control-b0": "both", "s0": "student", "s1": "student"})
    rows = {r["label"]: r for r in summary["rows"]}
    arm = rows["control-b0 (both)"]
    assert (arm["group"], arm["kind"], arm["members"], arm["scores"]["humaneval"]) == ("arm", "member",
                                                                                       ["control-b0"], 90.0)
    assert arm["vs_base"]["gained"] == 5 and arm["vs_base"]["lost"] == 0  # problems 4-8: the arm's, not the base's
    assert rows["Population mean, students (2)"]["members"] == ["s0", "s1"]
    assert rows["Population mean, students (2)"]["scores"]["humaneval"] == pytest.approx(55.0)
    best = next(r for r in summary["rows"] if r["kind"] == "best")
    assert best["members"] == ["s1"]
    labels = [r["label"] for r in summary["rows"]]
    assert labels.index("control-b0 (both)") < labels.index("Population mean, students (2)")  # after B1/B2
    assert "control-b0 (both)" in markdown_table(summary)
    assert [row["label"] for row, _ in chart_rows(summary)] == [  # drawn too, beside the means; members are not
        "Base model", "control-b0 (both)", "Population mean, students (2)"]


def test_wilsons_interval_by_hand():
    # Wilson: centre (p + z^2/2n) / (1 + z^2/n), half-width z sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n).
    # 5 of 10 at 50% (z = 0.6745): 50 -+ 10.43; 1 of 1 at 95% (z = 1.96): centre 0.6031, half 0.3966; no problem:
    # no interval. Catches: the confidence level not passed on (95% given for 50%), one problem refused, and a
    # refusal of n = 0 that lets binomtest fail instead.
    assert wilson_interval(5, 10, 0.5) == pytest.approx((39.570, 60.430), abs=1e-3)
    assert wilson_interval(1, 1) == pytest.approx((20.655, 100.0), abs=1e-3)
    assert wilson_interval(0, 0) is None


def test_a_rows_intervals_are_at_the_confidence_asked_for():
    # At 50%: a single member's 5 of 10 gets Wilson's [39.57, 60.43]; a mean row that no resample can move (both
    # members fail all 10) Wilson's 0 of 10 at 50%, z^2/n / (1 + z^2/n) = 4.35%; and a bootstrap interval is
    # narrower than at 95%. Catches: the confidence dropped (95% used) on any of those three paths.
    records = [{"member": m, "benchmark": "humaneval", "problem_id": f"HumanEval/{i}", "passed": ok}
               for m, row in (("s0", [1, 0] * 5), ("s1", [1, 1, 0, 0, 1, 0, 1, 1, 0, 0]), ("t0", [0] * 10),
                              ("t1", [0] * 10))
               for i, ok in enumerate(map(bool, row))]
    groups = {"population": ["s0", "s1", "t0", "t1"]}
    roles = {"s0": "student", "s1": "student", "t0": "teacher", "t1": "teacher"}
    half, full = (summarize(records, groups, ["humaneval"], roles=roles, confidence=c) for c in (0.5, 0.95))
    rows = {r["label"]: r for r in half["rows"]}
    assert rows["s0 (student)"]["intervals"]["humaneval"] == pytest.approx([39.570, 60.430], abs=1e-3)
    assert rows["Population mean, teachers (2)"]["intervals"]["humaneval"] == pytest.approx([0.0, 4.351], abs=1e-3)
    students = rows["Population mean, students (2)"]["intervals"]["humaneval"]
    wide = next(r for r in full["rows"] if r["label"] == "Population mean, students (2)")["intervals"]["humaneval"]
    assert wide[0] < students[0] < students[1] < wide[1]


def test_a_mean_row_that_passes_everything_gets_wilsons_interval_for_all_passed():
    # Both members pass all 200 problems: no resample moves 100%, so Wilson's 200 of 200 stands in, lower end
    # 1 / (1 + z^2/n) = 98.115%. Catches: the stand-in computed from the wrong count (100 / 200 / 100 -> 0 of 200,
    # or 200 * 100 / 101 -> 198 of 200: [96.43, 99.72]) or the zero-width check letting [100, 100] through.
    summary = _two_students({"s0": {"humaneval": [1] * 200}, "s1": {"humaneval": [1] * 200}})
    (mean,) = [r for r in summary["rows"] if r["kind"] == "mean"]
    assert mean["intervals"]["humaneval"] == pytest.approx([98.115, 100.0], abs=1e-3)


def test_the_overall_of_code_and_math_averages_within_each_kind_then_across():
    # Samples no resample can move, so each interval is the number itself. Code: two benchmarks at 100% and 0%
    # (Code Avg 50); math: two at 100% (Math Avg 100); Overall (50 + 100) / 2 = 75. Catches: a kind's
    # benchmarks summed then multiplied by their count instead of divided (Math Avg 400), or the kinds' averages
    # multiplied by their count (Overall 300).
    samples, kinds = [[1, 1], [0, 0], [1, 1], [1, 1]], ["code", "code", "math", "math"]
    assert bootstrap_interval(samples, kinds, "overall") == (75.0, 75.0)
    assert bootstrap_interval(samples, kinds, "code_avg") == (50.0, 50.0)
    assert bootstrap_interval(samples, kinds, "math_avg") == (100.0, 100.0)


def test_two_problems_are_enough_to_bootstrap_and_one_is_not():
    # Catches: the two-problem floor moved up by one (a benchmark of 2 problems left without an interval).
    assert bootstrap_interval([[1, 0]], ["code"], "code_avg") is not None
    assert bootstrap_interval([[1]], ["code"], "code_avg") is None


def test_pairs_are_counted_on_shared_problems_and_a_member_without_any_gets_p_1():
    # a against base: shared problems 1 and 2 (3 is a's only, 4 the base's only): gained 1, lost 1, McNemar's p
    # for 1 of 2 discordant pairs is 1. a against the base on 5 problems it all fails: lost 5, p = 2 / 2^5 =
    # 0.0625. c was graded on nothing: 0 of 0 problems, p 1. Catches: the union of the problems instead of
    # their intersection (a KeyError), a member or benchmark without outcomes failing the lookup, and a p other
    # than 1 (or binomtest's error) when no pair is discordant.
    outcomes = {"a": {"humaneval": {"1": True, "2": False, "3": True}},
                "base": {"humaneval": {"1": False, "2": True, "4": True}, "mbpp": {"1": True}},
                "z": {"humaneval": {str(i): False for i in range(5)}},
                "ok": {"humaneval": {str(i): True for i in range(5)}}}
    assert paired_against(outcomes, "a", "base", ["humaneval"]) == {"gained": 1, "lost": 1, "problems": 2, "p": 1.0}
    assert paired_against(outcomes, "z", "ok", ["humaneval"]) == {"gained": 0, "lost": 5, "problems": 5,
                                                                  "p": pytest.approx(0.0625)}
    assert paired_against(outcomes, "c", "base", ["humaneval", "mbpp"]) == {"gained": 0, "lost": 0, "problems": 0,
                                                                           "p": 1.0}
    assert paired_against(outcomes, "base", "c", ["mbpp"]) == {"gained": 0, "lost": 0, "problems": 0, "p": 1.0}


def test_a_member_not_graded_on_the_first_benchmark_keeps_the_next_ones():
    # Catches: the loop over benchmarks stopping at the first one without graded problems (the later ones lost).
    records = [{"member": "s0", "benchmark": "mbpp", "problem_id": f"mbpp/{i}", "passed": i < 3} for i in range(4)]
    summary = summarize(records, {"population": ["s0"]}, ["humaneval", "mbpp"], roles={"s0": "student"})
    row = next(r for r in summary["rows"] if r["label"] == "s0 (student)")
    assert row["scores"] == {"mbpp": 75.0} and row["n"]["mbpp"] == 4


def test_every_group_makes_its_rows_with_the_group_and_kind_the_table_across_seeds_reads():
    # Four HumanEval problems, every row computed by hand: base 1100 (50); B1 = baseline-b0 1010 (50: +1 / -1),
    # its untrained twin 0000 a row of its own (-2); stock B2 0001 (25: +1 / -2); the arm's solver 1111 (100: +2);
    # students s0 1000 and s1 1110 (mean 50), teacher t0 0110 (50: +1 / -1), all members 50; best student s1,
    # worst member s0. Catches: the stock group's rows never made or mislabelled, any row's group or kind
    # mislabelled (cli.seeds_table matches rows across seeds by them), an untrained member in B1, a member's
    # group, role, trained or complete flag wrong, and the file's metadata keys.
    passes = {"base": "1100", "baseline-b0": "1010", "baseline-b1": "0000", "b2": "0001", "ctl-b0": "1111",
              "s0": "1000", "t0": "0110", "s1": "1110"}
    records = [{"member": m, "benchmark": "humaneval", "problem_id": f"HumanEval/{i}", "passed": c == "1"}
               for m, row in passes.items() for i, c in enumerate(row)]
    groups = {"base": ["base"], "baseline": ["baseline-b0", "baseline-b1"], "stock": ["b2"], "arm": ["ctl-b0"],
              "population": ["s0", "t0", "s1"]}
    roles = {"baseline-b0": "both", "baseline-b1": "both", "ctl-b0": "both", "s0": "student", "s1": "student",
             "t0": "teacher"}
    summary = summarize(records, groups, ["humaneval"], totals={"humaneval": 4}, roles=roles,
                        untrained={"baseline-b1": "no update"})
    got = [(r["label"], r["group"], r["kind"], r["members"], r["scores"]["humaneval"],
            (r["vs_base"]["gained"], r["vs_base"]["lost"]) if "vs_base" in r else None) for r in summary["rows"]]
    assert got == [
        ("Base model", "base", "mean", ["base"], 50.0, None),
        ("PopuLoRA baseline (B1)", "baseline", "mean", ["baseline-b0"], 50.0, (1, 1)),
        ("baseline-b1 (baseline, untrained: no update)", "baseline", "member", ["baseline-b1"], 0.0, (0, 2)),
        ("Stock OpenRLHF (B2): b2", "stock", "member", ["b2"], 25.0, (1, 2)),
        ("ctl-b0 (both)", "arm", "member", ["ctl-b0"], 100.0, (2, 0)),
        ("Population mean, students (2)", "population", "mean", ["s0", "s1"], 50.0, None),
        ("Population mean, teachers (1)", "population", "mean", ["t0"], 50.0, (1, 1)),
        ("Population mean, all members (3)", "population", "mean", ["s0", "t0", "s1"], 50.0, None),
        ("Best student s1 (picked on these benchmarks: optimistic)", "population", "best", ["s1"], 75.0, (1, 0)),
        ("Worst member s0 (picked on these benchmarks: pessimistic)", "population", "worst", ["s0"], 25.0, (0, 1)),
        ("s0 (student)", "population", "member", ["s0"], 25.0, (0, 1)),
        ("t0 (teacher)", "population", "member", ["t0"], 50.0, (1, 1)),
        ("s1 (student)", "population", "member", ["s1"], 75.0, (1, 0)),
    ]
    assert {m: (e["group"], e["role"], e["trained"], e["complete"]) for m, e in summary["members"].items()} == {
        "base": ("base", "base", True, True), "baseline-b0": ("baseline", "both", True, True),
        "baseline-b1": ("baseline", "both", False, True), "b2": ("stock", "stock", True, True),
        "ctl-b0": ("arm", "both", True, True), "s0": ("population", "student", True, True),
        "t0": ("population", "teacher", True, True), "s1": ("population", "student", True, True)}
    assert {k: summary[k] for k in ("metric", "confidence", "n_resamples", "totals", "untrained")} == {
        "metric": "greedy pass@1 (%)", "confidence": 0.95, "n_resamples": 2000, "totals": {"humaneval": 4},
        "untrained": {"baseline-b1": "no update"}}


def test_the_bootstrap_is_seeded_and_takes_the_resamples_asked_for():
    # 40 problems with rates 0, 0.5 or 1 (a mean over two members), on which the interval's ends move with the
    # draw (seed 1, or 200 resamples instead of 2,000, give other ends). Catches: an unseeded generator (a table
    # that changes from one run to the next), and the seed or the resample count not passed on.
    rates = [((i * 7) % 3) / 2 for i in range(40)]
    interval = bootstrap_interval([rates], ["code"], "code_avg")
    assert bootstrap_interval([rates], ["code"], "code_avg") == interval
    assert bootstrap_interval([rates], ["code"], "code_avg", seed=1) != interval
    assert bootstrap_interval([rates], ["code"], "code_avg", n_resamples=200) != interval
