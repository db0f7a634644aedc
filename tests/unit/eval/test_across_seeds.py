"""The pass@1 table across seeds (eval/across_seeds.py, cli.seeds_table): rows matched by meaning, means over
seeds, per-seed numbers and the paired differences, all computed by hand on two seeds of four problems."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openrlhf_populora.cli.seeds_table import main
from openrlhf_populora.eval.across_seeds import chart, combine, load_seed, markdown, row_key, write
from openrlhf_populora.eval.report import summarize

ROLES = {"base": "base", "baseline-b0": "both", "control-b0": "both"}
# member -> passes on HumanEval/0..3, per seed; the population's members have other ids in each seed
SEEDS = [
    {"base": [1, 1, 0, 0], "baseline-b0": [1, 0, 1, 0], "control-b0": [1, 1, 1, 1],
     "s0": [1, 0, 0, 0], "s1": [1, 1, 0, 0], "t0": [0, 0, 0, 0], "t1": [1, 0, 0, 0]},
    {"base": [1, 1, 0, 0], "baseline-b0": [1, 1, 1, 0], "control-b0": [0, 0, 1, 1],
     "s2": [0, 1, 0, 0], "s3": [1, 1, 1, 0], "t2": [1, 0, 0, 0], "t3": [0, 0, 0, 0]},
]


def write_seed(directory: Path, passes: dict[str, list[int]], arm: bool = True) -> Path:
    """One seed's cli.evaluate output, its rows made by the real summarize."""
    records = [{"member": m, "benchmark": "humaneval", "problem_id": f"HumanEval/{i}", "passed": bool(p)}
               for m, row in passes.items() for i, p in enumerate(row)]
    population = [m for m in passes if m[0] in "st"]
    groups = {"base": ["base"], "baseline": ["baseline-b0"], "population": population}
    if arm:
        groups["arm"] = ["control-b0"]
    roles = {**ROLES, **{m: "student" if m[0] == "s" else "teacher" for m in population}}
    summary = summarize([r for r in records if r["member"] in {m for g in groups.values() for m in g}], groups,
                        ["humaneval"], totals={"humaneval": len(passes["base"])}, roles=roles)
    directory.mkdir(parents=True)
    (directory / "results.json").write_text(json.dumps(summary))
    (directory / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


@pytest.fixture()
def table(tmp_path):
    return combine([load_seed(write_seed(tmp_path / f"s{i}", passes)) for i, passes in enumerate(SEEDS)],
                   n_resamples=500)


def test_rows_are_matched_by_meaning_and_averaged_over_seeds(table):
    # catches: matching rows by label (the best student is s1 in one seed and s3 in the other; the means carry
    # a count), member rows kept (their ids differ between seeds), or a mean over seeds pooled wrongly
    rows = {r["label"]: r for r in table["rows"]}
    assert list(rows) == ["Base model", "PopuLoRA baseline (B1)", "control", "Population mean, students",
                          "Population mean, teachers", "Population mean, all members", "Best student",
                          "Best teacher", "Worst member"]
    expected = {"Base model": (50, [50, 50]), "PopuLoRA baseline (B1)": (62.5, [50, 75]),
                "control": (75, [100, 50]), "Population mean, students": (43.75, [37.5, 50]),
                "Population mean, teachers": (12.5, [12.5, 12.5]), "Best student": (62.5, [50, 75]),
                "Best teacher": (25, [25, 25]), "Worst member": (0, [0, 0])}
    for label, (value, per_seed) in expected.items():
        assert rows[label]["values"]["humaneval"] == pytest.approx(value), label
        assert rows[label]["values"]["overall"] == pytest.approx(value), label
        assert rows[label]["per_seed"] == pytest.approx(per_seed), label
    assert rows["Best student"]["members"] == [["s1"], ["s3"]] and table["problems"] == {"humaneval": 4}


def test_differences_are_seed_matched_and_gains_and_losses_summed(table):
    # catches: B1 of another seed as the comparison, gains and losses of one seed only, or counts given for a
    # mean over several members (a member-problem pair is not a problem)
    rows = {r["label"]: r for r in table["rows"]}
    control, b1 = rows["control"], rows["PopuLoRA baseline (B1)"]
    assert control["vs_base"]["delta"] == pytest.approx(25)
    assert (control["vs_base"]["gained"], control["vs_base"]["lost"]) == (4, 2)
    assert control["vs_b1"]["delta"] == pytest.approx(12.5)
    assert (control["vs_b1"]["gained"], control["vs_b1"]["lost"]) == (3, 2)  # the other seed's B1: +2 / -1
    assert (b1["vs_base"]["gained"], b1["vs_base"]["lost"]) == (2, 1) and "vs_b1" not in b1
    assert (rows["Best student"]["vs_base"]["gained"], rows["Best student"]["vs_base"]["lost"]) == (1, 0)
    assert (rows["Worst member"]["vs_base"]["gained"], rows["Worst member"]["vs_base"]["lost"]) == (0, 4)
    students = rows["Population mean, students"]["vs_base"]
    assert students["delta"] == pytest.approx(-6.25) and "gained" not in students
    assert "vs_base" not in rows["Base model"]


def test_intervals_hold_the_estimate_and_a_paired_difference_of_equals_is_zero(tmp_path):
    # catches: a difference's interval made from the two rows' own intervals, unpaired (for two identical rows
    # it would be as wide as theirs together), and an interval that misses its own estimate
    same = [{**passes, "control-b0": passes["base"]} for passes in SEEDS]
    table = combine([load_seed(write_seed(tmp_path / f"s{i}", p)) for i, p in enumerate(same)], n_resamples=300)
    for row in table["rows"]:
        low, high = row["intervals"]["overall"]
        assert low <= row["values"]["overall"] <= high, row["label"]
    control = next(r for r in table["rows"] if r["label"] == "control")
    assert control["vs_base"]["interval"] == [0.0, 0.0] and control["vs_base"]["delta"] == 0.0


def test_a_row_missing_from_a_seed_is_left_out_and_named(tmp_path):
    seeds = [load_seed(write_seed(tmp_path / "s0", SEEDS[0])), load_seed(write_seed(tmp_path / "s1", SEEDS[1],
                                                                                   arm=False))]
    table = combine(seeds, n_resamples=100)
    assert "control" not in [r["label"] for r in table["rows"]] and table["rows_not_in_every_seed"] == ["control"]
    assert "Rows not in every seed, left out: control." in markdown(table)


def test_an_arm_with_two_solvers_is_refused_not_halved(tmp_path):
    # catches: keeping the first of two rows that read as the same arm (the other solver silently dropped)
    seed = write_seed(tmp_path / "s0", SEEDS[0])
    results = json.loads((seed / "results.json").read_text())
    twin = {**next(r for r in results["rows"] if r["group"] == "arm"), "label": "control-b1 (both)",
            "members": ["control-b1"]}
    results["rows"].append(twin)
    (seed / "results.json").write_text(json.dumps(results))
    with pytest.raises(ValueError, match="'control-b0 \\(both\\)' and 'control-b1 \\(both\\)' both stand for 'control'"):
        load_seed(seed)


def test_row_keys():
    assert row_key({"label": "Best student s4 (picked on these benchmarks: optimistic)", "group": "population",
                    "kind": "best", "members": ["s4"]}) == "Best student"
    assert row_key({"label": "1t1s-s1 (student)", "group": "arm", "kind": "member", "members": ["1t1s-s1"]}) == "1t1s"
    assert row_key({"label": "s4 (student)", "group": "population", "kind": "member", "members": ["s4"]}) is None
    assert row_key({"label": "Stock OpenRLHF (B2): b2", "group": "stock", "kind": "member",
                    "members": ["b2"]}) == "Stock OpenRLHF (B2): b2"


def test_the_command_writes_the_table_and_refuses_bad_input(tmp_path, capsys):
    dirs = [str(write_seed(tmp_path / f"s{i}", passes)) for i, passes in enumerate(SEEDS)]
    assert main([*dirs, "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "| control | 75.0 [" in printed and "| 100.0, 50.0 | +25.0 [" in printed
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"results.json", "results.md", "results.png"}
    written = json.loads((tmp_path / "out" / "results.json").read_text())  # what a reader of the file relies on
    assert written["metric"] == "greedy pass@1 (%), mean over seeds" and written["seeds"] == dirs
    assert written["kinds"] == {"humaneval": "code"} and written["titles"] == {"humaneval": "HumanEval"}
    control = next(r for r in written["rows"] if r["label"] == "control")
    assert control["vs_base"]["against"] == "Base model" and control["vs_b1"]["against"] == "PopuLoRA baseline (B1)"
    assert main([dirs[0], "--out", str(tmp_path / "o")]) == 2  # one seed is not "across seeds"
    assert "at least two seeds" in capsys.readouterr().err
    assert main([dirs[0], str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    assert "results.json not found" in capsys.readouterr().err


def test_the_interval_of_a_known_rate_is_the_binomials(tmp_path):
    # Every row passes the same 50 of 100 problems in both seeds, so resampling problems draws Binomial(100, 0.5)
    # / 100, whose 2.5% and 97.5% quantiles are 40 and 60 (P(X <= 39) = 0.018 < 0.025 < P(X <= 40) = 0.028, and
    # the mirror image above): with 2,000 resamples the percentile interval is [40, 60], the planted answer.
    # Catches: the tails doubled (a 90% interval, about [44, 56]) or cut to a third (about [39, 61]), the upper
    # percentile at 101 - tail, and the bootstrap scaled by 101 (40.4).
    passes = [1, 0] * 50
    seeds = [load_seed(write_seed(tmp_path / f"s{i}", {m: passes for m in SEEDS[i]})) for i in range(2)]
    table = combine(seeds)
    base = next(r for r in table["rows"] if r["label"] == "Base model")
    assert base["values"]["overall"] == 50.0
    assert base["intervals"]["humaneval"] == [40.0, 60.0] and base["intervals"]["overall"] == [40.0, 60.0]


def test_the_bootstrap_draw_is_fixed(tmp_path):
    # 40 problems with a different pass pattern per member and seed, on which another draw (random_seed=1)
    # moves the intervals: so two tables that agree say the draw is fixed. Catches: an unseeded generator (the
    # table changing from one run of the command to the next).
    def pattern(member, seed):
        k = sum(map(ord, member)) + 7 * seed
        return [int((i * k + seed) % 5 < 2 + k % 2) for i in range(40)]

    seeds = [load_seed(write_seed(tmp_path / f"s{i}", {m: pattern(m, i) for m in SEEDS[i]})) for i in range(2)]
    table = combine(seeds)
    assert combine(seeds) == table and combine(seeds, random_seed=1) != table


def test_only_problems_graded_for_every_row_in_every_seed_count(tmp_path):
    # Seed 1's s3 (its best student) was not graded on HumanEval/3: every row is computed on HumanEval/0-2.
    # By hand on those three: base 1,1,0 in both seeds (66.7); B1 1,0,1 and 1,1,1 (66.7 and 100, mean 83.3).
    # Catches: the union of the graded problems instead of their intersection (a KeyError, or a row on problems
    # another row was not graded on).
    dirs = [write_seed(tmp_path / f"s{i}", passes) for i, passes in enumerate(SEEDS)]
    samples = dirs[1] / "samples.jsonl"
    lines = samples.read_text().splitlines(keepends=True)
    samples.write_text("".join(line for line in lines if '"s3"' not in line or '"HumanEval/3"' not in line))
    table = combine([load_seed(d) for d in dirs], n_resamples=100)
    rows = {r["label"]: r for r in table["rows"]}
    assert table["problems"] == {"humaneval": 3}
    assert rows["Base model"]["values"]["overall"] == pytest.approx(200 / 3)
    assert rows["PopuLoRA baseline (B1)"]["per_seed"] == pytest.approx([200 / 3, 100])
    assert rows["PopuLoRA baseline (B1)"]["values"]["overall"] == pytest.approx(250 / 3)


def test_a_row_member_never_graded_is_refused_by_name(tmp_path):
    # Catches: a member without samples read as an empty set by a lookup that fails (TypeError, AttributeError)
    # instead of the message that says what to do.
    dirs = [write_seed(tmp_path / f"s{i}", passes) for i, passes in enumerate(SEEDS)]
    samples = dirs[1] / "samples.jsonl"
    samples.write_text("".join(line for line in samples.read_text().splitlines(keepends=True) if '"t3"' not in line))
    with pytest.raises(ValueError, match=r"^no humaneval problem was graded for every row's members in every seed: "
                                         r"finish the evaluations first \(cli.evaluate resumes\)$"):
        combine([load_seed(d) for d in dirs], n_resamples=100)


def test_seeds_evaluated_on_other_benchmarks_are_refused(tmp_path):
    # Catches: the check skipping a seed (the first compared with itself, or the second never compared).
    one, two = (load_seed(write_seed(tmp_path / f"s{i}", passes)) for i, passes in enumerate(SEEDS))
    two = two._replace(benchmarks=["humaneval", "mbpp"])
    with pytest.raises(ValueError, match="s1 has benchmarks \\['humaneval', 'mbpp'\\], .*s0 \\['humaneval'\\]: "
                                         "evaluate every seed on the same ones"):
        combine([one, two], n_resamples=100)


def test_row_keys_of_rows_that_stand_for_nothing_across_seeds():
    # Catches: a member row of B1 taken for B1 itself; an untrained arm matched across seeds; an arm whose name
    # holds '-' cut at its first '-' instead of before its member id.
    assert row_key({"label": "baseline-b0 (both)", "group": "baseline", "kind": "member",
                    "members": ["baseline-b0"]}) is None
    assert row_key({"label": "control-b0 (both, untrained)", "group": "arm", "kind": "member",
                    "members": ["control-b0"]}) is None
    assert row_key({"label": "failure-rate-b0 (both)", "group": "arm", "kind": "member",
                    "members": ["failure-rate-b0"]}) == "failure-rate"


def test_the_markdown_of_a_table_written_by_hand():
    # Every cell and note of a small table made by hand: a column average absent from every row is not a column,
    # a value without an interval has no brackets, a missing value is an empty cell, gained/lost only where
    # counted. Catches: any cell or note dropped, misplaced or misformatted, the confidence printed wrongly.
    table = {
        "seeds": ["runs/a", "runs/b"], "benchmarks": ["humaneval", "mbpp"],
        "titles": {"humaneval": "HumanEval", "mbpp": "MBPP"}, "problems": {"humaneval": 164, "mbpp": 200},
        "confidence": 0.9, "n_resamples": 2000, "headline": "overall",
        "rows_not_in_every_seed": ["Best teacher", "control"],
        "rows": [
            {"label": "Base model", "values": {"humaneval": 55.49, "mbpp": 37.5, "code_avg": 46.49, "overall": 46.49},
             "intervals": {"humaneval": [47.84, 62.88], "mbpp": [31.0, 44.0], "code_avg": [41.3, 51.9],
                           "overall": [41.3, 51.9]},
             "per_seed": [46.49, 46.49]},
            {"label": "PopuLoRA baseline (B1)", "values": {"humaneval": 54.0, "code_avg": 54.0, "overall": 54.0},
             "intervals": {"humaneval": [46.0, 61.0]}, "per_seed": [53.0, 55.0],
             "vs_base": {"against": "Base model", "delta": -1.04, "interval": [-3.2, 1.15], "gained": 6, "lost": 10}},
            {"label": "Population mean, students", "values": {"humaneval": 57.0, "mbpp": 36.5, "code_avg": 46.75,
                                                              "overall": 46.75},
             "intervals": {"overall": [41.6, 51.9]}, "per_seed": [46.0, 47.5],
             "vs_base": {"against": "Base model", "delta": 0.26, "interval": [-1.0, 1.5]},
             "vs_b1": {"against": "PopuLoRA baseline (B1)", "delta": -7.25, "interval": [-9.0, -5.5]}},
        ],
    }
    assert markdown(table) == """Greedy pass@1 (%), mean over 2 seeds.

| Model | HumanEval (n=164) | MBPP (n=200) | Code Avg | Overall | Overall, per seed | vs base: Δ Overall, +gained / -lost \
| vs B1: Δ Overall, +gained / -lost |
|---|---|---|---|---|---|---|---|
| Base model | 55.5 [47.8, 62.9] | 37.5 [31.0, 44.0] | 46.5 [41.3, 51.9] | 46.5 [41.3, 51.9] | 46.5, 46.5 |  |  |
| PopuLoRA baseline (B1) | 54.0 [46.0, 61.0] |  | 54.0 | 54.0 | 53.0, 55.0 | -1.0 [-3.2, +1.1], +6 / -10 |  |
| Population mean, students | 57.0 | 36.5 | 46.8 | 46.8 [41.6, 51.9] | 46.0, 47.5 | +0.3 [-1.0, +1.5] \
| -7.2 [-9.0, -5.5] |

Brackets: 90% percentile-bootstrap intervals over problems (2,000 resamples; each benchmark's problems resampled \
on their own, the same draw for every row and seed; a difference resamples the per-problem differences, so it is \
paired). They do not include how much seeds differ: the per-seed column shows that.

Per seed: the row's Overall in each seed, in the order of the seeds below. A best or worst row is that seed's pick \
(picked on the benchmarks themselves: optimistic or pessimistic).

vs base, vs B1: the row's Overall minus the base model's, or minus B1's of the same seed, with its paired \
interval; for rows of one member per seed, the problems it solves that the other does not (+) and the reverse \
(-), summed over the 2 seeds (a problem counts once per seed).

n: the problems every row's members were graded on in every seed.

Seeds: `runs/a`, `runs/b`.

Rows not in every seed, left out: Best teacher, control.
"""


def test_the_files_written_hold_the_table(tmp_path, table):
    # Catches: results.json not the table, results.md not its markdown, a missing chart, an output directory
    # whose parents do not exist refused, and writing twice into one directory refused.
    out = tmp_path / "a" / "b"
    for _ in range(2):
        paths = write(table, out)
    assert json.loads(paths["json"].read_text()) == json.loads(json.dumps(table))
    assert paths["md"].read_text() == markdown(table)
    assert paths["png"] == out / "results.png" and paths["png"].read_bytes()[:4] == b"\x89PNG"


def test_the_chart_draws_each_rows_mean_interval_and_seeds(tmp_path, monkeypatch):
    # The figure as saved: one bar per row at its headline mean, its error bar spanning the row's interval, one dot
    # per seed at that seed's number, the rows' labels under the bars, the seed count and confidence in the title.
    # Catches: bars at another number than the mean (a seed's, or another average), error bars drawn as the
    # interval's ends instead of distances from the mean (or swapped), dots missing or misplaced, labels out of
    # order, a title that misstates the seeds or the confidence, an unlabelled axis.
    from matplotlib.collections import LineCollection, PathCollection
    from matplotlib.figure import Figure

    table = {"seeds": ["a", "b", "c"], "confidence": 0.9, "headline": "overall", "rows": [
        {"label": "Base model", "values": {"overall": 46.5}, "intervals": {"overall": [41.0, 52.0]},
         "per_seed": [46.5, 46.5, 46.5]},
        {"label": "control", "values": {"overall": 50.0}, "intervals": {"overall": [44.0, 57.0]},
         "per_seed": [48.0, 50.0, 52.0]},
    ]}
    seen = {}
    original = Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        ax = fig.axes[0]
        seen["bars"] = [(round(p.get_x() + p.get_width() / 2, 6), p.get_height()) for p in ax.patches]
        seen["errors"] = sorted((seg[0, 0], *sorted(seg[:, 1].tolist())) for c in ax.collections
                                if isinstance(c, LineCollection) for seg in c.get_segments())
        seen["dots"] = sorted(tuple(xy) for c in ax.collections if isinstance(c, PathCollection)
                              for xy in c.get_offsets().tolist())
        seen["labels"] = [t.get_text() for t in ax.get_xticklabels()]
        seen["title"], seen["ylabel"] = ax.get_title(), ax.get_ylabel()
        return original(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    assert chart(table, tmp_path / "chart.png").read_bytes()[:4] == b"\x89PNG"
    assert seen["bars"] == [(0.0, 46.5), (1.0, 50.0)]
    assert seen["errors"] == [(0.0, 41.0, 52.0), (1.0, 44.0, 57.0)]
    assert seen["dots"] == [(0.0, 46.5)] * 3 + [(1.0, 48.0), (1.0, 50.0), (1.0, 52.0)]
    assert seen["labels"] == ["Base model", "control"]
    assert seen["title"] == "mean over 3 seeds (90% intervals over problems); dots: each seed"
    assert seen["ylabel"] == "greedy pass@1 (%), Overall"
