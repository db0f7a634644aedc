"""The pass@1 table across seeds (eval/across_seeds.py, cli.seeds_table): rows matched by meaning, means over
seeds, per-seed numbers and the paired differences, all computed by hand on two seeds of four problems."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openrlhf_populora.cli.seeds_table import main
from openrlhf_populora.eval.across_seeds import combine, load_seed, markdown, row_key
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
                        ["humaneval"], totals={"humaneval": 4}, roles=roles)
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
    assert main([dirs[0], "--out", str(tmp_path / "o")]) == 2  # one seed is not "across seeds"
    assert "at least two seeds" in capsys.readouterr().err
    assert main([dirs[0], str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    assert "results.json not found" in capsys.readouterr().err
