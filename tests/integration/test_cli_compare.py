"""``cli.compare`` end to end on synthetic runs whose designed trends the verdicts must recover; bad input."""

import contextlib
import io
import json
import subprocess
import sys

import pytest

from openrlhf_populora.analysis.signature import CLAIMS
from openrlhf_populora.analysis.synthetic import write_synthetic_run
from openrlhf_populora.cli.compare import main
from openrlhf_populora.metrics.keys import META_FILE, METRICS_FILE

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BASELINE_ONLY = {"complexity/baseline_falls", "solve_rate/baseline_rises"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return (write_synthetic_run(root / "pop", mode="population", steps=30, seed=2),
            write_synthetic_run(root / "base", mode="baseline", steps=30, seed=1))


@pytest.fixture(scope="module")
def compared(runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main([str(runs[0]), str(runs[1]), "--out", str(out), "--smooth", "3", "--labels", "P3", "B1"])
    return code, stdout.getvalue(), out


def verdicts_of(out):
    return {k: v["verdict"] for k, v in json.loads((out / "compare.json").read_text())["verdicts"].items()}


def test_the_designed_signature_is_recovered(compared):
    code, stdout, out = compared
    assert code == 0
    verdicts = verdicts_of(out)
    for claim in ("complexity/population_rises", "complexity/baseline_falls",
                  "complexity/population_minus_baseline", "solve_rate/baseline_rises"):
        assert verdicts[claim] == "holds", claim
    assert list(verdicts) == list(CLAIMS)
    assert set(verdicts.values()) <= {"holds", "does not hold"}
    assert "7 claims: " in stdout and "seeds: 1 population, 1 baseline (per-run intervals)" in stdout


def test_files_hold_the_same_numbers_as_stdout(compared):
    _, stdout, out = compared
    data = json.loads((out / "compare.json").read_text())
    population = data["arms"]["population"][0]
    assert population["run"]["label"] == "P3" and data["arms"]["baseline"][0]["run"]["label"] == "B1"
    assert population["run"]["steps"] == 30 and data["seeds"] == {"population": 1, "baseline": 1}
    loc = population["axes"]["loc"]
    assert loc["lo"] < loc["slope"] < loc["hi"] and loc["n"] == 30
    cell = f"{loc['slope']:+.3g} [{loc['lo']:+.3g}, {loc['hi']:+.3g}] n=30"
    markdown = (out / "compare.md").read_text()
    assert cell in stdout and f"| loc | {cell}" in markdown
    assert "P3" in stdout and "B1" in stdout
    coverage = population["coverage"], data["arms"]["baseline"][0]["coverage"]
    assert data["programs_compared"] == min(c["programs"] for c in coverage)
    assert f"cells at {data['programs_compared']} programs (rarefied)" in stdout
    assert (out / "compare.png").read_bytes()[:8] == PNG_MAGIC


def test_allow_any_labels_roles_a_and_b_and_the_swapped_signature_fails(runs, tmp_path, capsys):
    assert main([str(runs[1]), str(runs[0]), "--allow-any", "--out", str(tmp_path)]) == 0
    stdout = capsys.readouterr().out
    assert "A complexity rises" in stdout and "B complexity falls" in stdout
    data = json.loads((tmp_path / "compare.json").read_text())
    assert data["roles"] == {"population": "A", "baseline": "B"} and set(data["arms"]) == {"A", "B"}
    verdicts = verdicts_of(tmp_path)
    for claim in ("complexity/population_rises", "complexity/baseline_falls", "complexity/population_minus_baseline",
                  "solve_rate/population_oscillates_more", "coverage/population_covers_more"):
        assert verdicts[claim] == "does not hold", claim


def test_a_run_under_ten_steps_gives_not_enough_steps(tmp_path, capsys):
    pop = write_synthetic_run(tmp_path / "pop", mode="population", steps=5, seed=2)
    base = write_synthetic_run(tmp_path / "base", mode="baseline", steps=30, seed=1)
    assert main([str(pop), str(base), "--out", str(tmp_path / "out")]) == 0
    verdicts = verdicts_of(tmp_path / "out")
    for name, verdict in verdicts.items():  # what uses the population's series cannot be judged
        assert verdict == ("holds" if name in BASELINE_ONLY else "not enough steps"), name
    assert "not enough steps" in capsys.readouterr().out


def test_several_seeds_per_arm_are_tested_across_seeds(runs, tmp_path, capsys):
    # Catches: the seed groups ignored (only the first run of each arm compared), or per-run intervals used.
    root = tmp_path / "seeds"
    pops = [write_synthetic_run(root / f"pop{i}", mode="population", steps=20, seed=10 + i) for i in range(3)]
    bases = [write_synthetic_run(root / f"base{i}", mode="baseline", steps=20, seed=20 + i) for i in range(3)]
    argv = ["--population", *map(str, pops), "--baseline", *map(str, bases), "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "seeds: 3 population, 3 baseline (t tests across seeds)" in stdout
    # which seed gave what (catches: only the mean and its interval printed)
    per_seed = stdout[stdout.index("5. Per seed"):].splitlines()[2:8]
    assert [line.split()[:3] for line in per_seed] == [
        ["population", f"pop{i}", "20"] for i in range(3)] + [["baseline", f"base{i}", "20"] for i in range(3)]
    data = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert [a["run"]["label"] for a in data["arms"]["population"]] == ["pop0", "pop1", "pop2"]
    rises = data["verdicts"]["complexity/population_rises"]
    assert rises["method"] == "t across 3 seeds" and rises["verdict"] == "holds"
    slopes = [a["composite"]["slope"] for a in data["arms"]["population"]]
    assert rises["estimate"] == pytest.approx(sum(slopes) / 3)
    assert data["verdicts"]["complexity/population_minus_baseline"]["method"] == "Welch t, 3 vs 3 seeds"
    assert "error: give one run per arm" in bad(["--population", *pops, "--baseline", bases[0]], capsys)
    assert "not both" in bad([pops[0], bases[0], "--population", pops[1], "--baseline", bases[1]], capsys)
    assert "go together" in bad(["--population", *pops], capsys)


def config_yaml(mode: str, reward: str = "auto", lr: float = 2e-5) -> str:
    return (f"actor:\n  adam: {{lr: {lr}}}\npopulora:\n  mode: {mode}\n  teacher_reward: {reward}\n"
            f"  num_teachers: 2\n  num_students: 2\n  task_types: [code_o, code_i, code_f]\n")


def test_attribution_names_each_arms_rule_shape_and_budget_and_warns_on_other_differences(runs, tmp_path, capsys):
    # Catches: the reward rule left out of the comparison of the arms (the review's confound: failure rate
    # against learnability), or a warning for what only the population's shape changes.
    (runs[0] / "config.yaml").write_text(config_yaml("population"))
    (runs[1] / "config.yaml").write_text(config_yaml("baseline"))
    try:
        assert main([str(runs[0]), str(runs[1])]) == 0
        captured = capsys.readouterr()
        assert "reward rule failure_rate (teacher_reward auto); 2 teacher(s) x 2 student(s)" in captured.out
        assert "reward rule learnability (teacher_reward auto); single agent" in captured.out
        assert "per adapter and step: 12 proposals, 24 answers (4 tasks x 2 samples x 3 types)" in captured.out
        assert "teacher reward rule: 'failure_rate' vs 'learnability'" in captured.err
        (runs[1] / "config.yaml").write_text(config_yaml("baseline", reward="failure_rate"))
        assert main([str(runs[0]), str(runs[1])]) == 0
        assert "WARNING" not in capsys.readouterr().out  # the same rule: only the shape differs
        (runs[1] / "config.yaml").write_text(config_yaml("baseline", reward="failure_rate", lr=1e-5))
        assert main([str(runs[0]), str(runs[1])]) == 0
        assert "actor.adam.lr: 2e-05 vs 1e-05" in capsys.readouterr().err
    finally:
        for run in runs:
            (run / "config.yaml").unlink()


def bad(argv, capsys):
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


def test_missing_directory_and_missing_metrics(runs, tmp_path, capsys):
    assert "does not exist" in bad([tmp_path / "nowhere", runs[1]], capsys)
    (tmp_path / "empty").mkdir()
    assert f"no {METRICS_FILE}" in bad([runs[0], tmp_path / "empty"], capsys)


def test_fewer_than_three_steps(runs, tmp_path, capsys):
    short = write_synthetic_run(tmp_path / "short", mode="baseline", steps=2, seed=1)
    err = bad([runs[0], short], capsys)
    assert "2 step(s)" in err and "at least 3" in err
    three = write_synthetic_run(tmp_path / "three", mode="baseline", steps=3, seed=1)
    assert main([str(runs[0]), str(three)]) == 0


def test_swapped_and_same_mode_runs(runs, tmp_path, capsys):
    assert "swapped" in bad([runs[1], runs[0]], capsys)
    other = write_synthetic_run(tmp_path / "pop2", mode="population", steps=12, seed=3)
    err = bad([runs[0], other], capsys)
    assert "baseline run is expected" in err and "--allow-any" in err
    assert main([str(runs[0]), str(other), "--allow-any"]) == 0


def test_a_run_without_a_mode(runs, tmp_path, capsys):
    anonymous = write_synthetic_run(tmp_path / "anon", mode="baseline", steps=12, seed=1)
    (anonymous / META_FILE).unlink()
    assert "cannot tell" in bad([runs[0], anonymous], capsys)
    (anonymous / "config.yaml").write_text("populora:\n  mode: baseline\n")
    assert main([str(runs[0]), str(anonymous)]) == 0  # config.yaml's mode is enough


def test_different_task_types(runs, tmp_path, capsys):
    narrow = write_synthetic_run(tmp_path / "narrow", mode="baseline", steps=12, seed=1, task_types=("code_o",))
    err = bad([runs[0], narrow], capsys)
    assert "different task types" in err and "code_f" in err
    # config.yaml's populora.task_types is what counts when present
    (narrow / "config.yaml").write_text("populora:\n  mode: baseline\n  task_types: [code_o, code_i, code_f]\n")
    assert main([str(runs[0]), str(narrow)]) == 0
    assert "no readable config.yaml in" in capsys.readouterr().err  # runs[0] has none: said, not silent
    same = write_synthetic_run(tmp_path / "same", mode="baseline", steps=12, seed=1)
    (same / "config.yaml").write_text("populora:\n  task_types: [code_o]\n")
    assert "different task types" in bad([runs[0], same], capsys)


def test_bad_flags_are_one_line(runs, capsys):
    assert "--smooth" in bad([runs[0], runs[1], "--smooth", "0"], capsys)
    assert "got 1 run(s)" in bad([runs[0]], capsys)
    with pytest.raises(SystemExit) as exit_info:
        main([str(runs[0]), str(runs[1]), "--nonsense"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_the_module_runs_as_a_command(runs, tmp_path):
    done = subprocess.run([sys.executable, "-m", "openrlhf_populora.cli.compare", str(tmp_path / "nowhere"),
                           str(runs[1])], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == f"error: run directory {tmp_path / 'nowhere'} does not exist"


def test_seeds_must_be_different_runs_and_seeds(tmp_path, capsys):
    # a seeded run repeats exactly on one machine: a run given twice, or two runs of one train.seed, are copies.
    # Catches: counting them as independent seeds (the review's 6 "holds" from one seed per arm given twice).
    root = tmp_path / "seeds"
    pops = [write_synthetic_run(root / f"pop{i}", mode="population", steps=12, seed=10 + i) for i in range(2)]
    bases = [write_synthetic_run(root / f"base{i}", mode="baseline", steps=12, seed=20 + i) for i in range(2)]
    assert "is given twice" in bad(["--population", pops[0], pops[0], "--baseline", *bases], capsys)
    for run in pops:
        (run / "config.yaml").write_text(config_yaml("population") + "train:\n  seed: 7\n")
    assert "have the same train.seed (7)" in bad(["--population", *pops, "--baseline", *bases], capsys)


def test_seeds_that_agree_exactly_cannot_tell():
    # Catches: a zero-width t interval from seeds whose statistic ties (small cell counts do), read as "holds".
    from openrlhf_populora.analysis import signature_stats as st
    from openrlhf_populora.analysis.signature import CANNOT_TELL, HOLDS, interval_verdict

    tied = st.welch([3.0, 3.0, 3.0], [1.0, 1.0, 1.0])
    assert interval_verdict("c", tied, +1, "difference").verdict == CANNOT_TELL
    assert interval_verdict("c", st.seed_mean([0.5, 0.5, 0.5]), +1, "mean").verdict == CANNOT_TELL
    # ties of non-dyadic floats (means over thinnings: 0.7) differ from each other's mean in the last bit
    assert interval_verdict("c", st.welch([0.7] * 3, [0.1] * 3), +1, "difference").verdict == CANNOT_TELL
    assert interval_verdict("c", st.seed_mean([0.1] * 3), +1, "mean").verdict == CANNOT_TELL
    assert interval_verdict("c", st.welch([3.0, 3.1, 2.9], [1.0, 1.0, 1.0]), +1, "difference").verdict == HOLDS


def test_what_makes_seeds_incomparable_is_said(tmp_path, capsys):
    # Catches: one run without config.yaml silencing every attribution warning (the reward-rule confound
    # included); seeds of one arm at different settings; runs of different lengths averaged silently; a damaged
    # problems.jsonl line never reported; a missing problems.jsonl read as "no valid program".
    root = tmp_path / "seeds"
    pops = [write_synthetic_run(root / f"pop{i}", mode="population", steps=12 + 3 * (i == 1), seed=10 + i)
            for i in range(2)]
    bases = [write_synthetic_run(root / f"base{i}", mode="baseline", steps=12, seed=20 + i) for i in range(2)]
    for i, run in enumerate(pops):
        (run / "config.yaml").write_text(config_yaml("population", lr=2e-5 * (1 + i)) + f"train:\n  seed: {i}\n")
    (bases[0] / "config.yaml").write_text(config_yaml("baseline") + "train:\n  seed: 0\n")
    with open(bases[1] / "problems.jsonl", "a") as handle:
        handle.write('{"step": 5, "valid": tr\n')
    out = tmp_path / "out"
    assert main(["--population", *map(str, pops), "--baseline", *map(str, bases), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "teacher reward rule: 'failure_rate' vs 'learnability'" in err  # base1 has no config: still compared
    assert f"no readable config.yaml in {bases[1]}" in err
    assert "the population's runs are not replicates of one setting: they differ in actor.adam.lr" in err
    assert "different numbers of steps" in err and f"{pops[1]}: 15" in err
    assert "not valid JSON, skipped" in err and "not valid JSON" in (out / "compare.md").read_text()
    (bases[1] / "problems.jsonl").unlink()
    assert "has no problems.jsonl" in bad(["--population", *pops, "--baseline", *bases], capsys)


def test_against_the_reward_rule_control_the_collapse_claims_are_not_counted(runs, tmp_path, capsys):
    # the control arm is the baseline on the failure-rate reward: the paper predicts the baseline's collapse
    # (complexity falls, solve rate rises) for AZR's learnability reward only. Catches: counting those two
    # verdicts in the control comparison's tally as if they were the signature.
    (runs[0] / "config.yaml").write_text(config_yaml("population"))
    (runs[1] / "config.yaml").write_text(config_yaml("baseline", reward="failure_rate"))
    try:
        assert main([str(runs[0]), str(runs[1]), "--out", str(tmp_path / "out")]) == 0
        tally = capsys.readouterr().out.strip().splitlines()[-2]
        assert tally.startswith("5 claims: ") and "reported, not counted" in tally, tally
        assert "complexity/baseline_falls holds" in tally and "solve_rate/baseline_rises holds" in tally
        data = json.loads((tmp_path / "out" / "compare.json").read_text())
        assert set(data["not_predicted"]) == BASELINE_ONLY
        # the control's seeds, one of them without config.yaml: decided on the known ones
        control = [runs[1], write_synthetic_run(tmp_path / "control2", mode="baseline", steps=30, seed=5)]
        pops = [runs[0], write_synthetic_run(tmp_path / "pop2", mode="population", steps=30, seed=6)]
        assert main(["--population", *map(str, pops), "--baseline", *map(str, control)]) == 0
        assert "reported, not counted" in capsys.readouterr().out
        (runs[1] / "config.yaml").write_text(config_yaml("baseline"))  # learnability: the paper's baseline
        assert main([str(runs[0]), str(runs[1])]) == 0
        assert "7 claims: " in capsys.readouterr().out
    finally:
        for run in runs:
            (run / "config.yaml").unlink()


def _cut_run(run, out, first, last):
    """A copy of ``run`` whose files hold only steps ``first``..``last``: what ``--steps`` must be equivalent to."""
    import shutil

    from openrlhf_populora.metrics.keys import EVENTS_FILE, PROBLEMS_FILE

    shutil.copytree(run, out)
    for name in (METRICS_FILE, PROBLEMS_FILE, EVENTS_FILE):
        lines = (run / name).read_text().splitlines() if (run / name).exists() else []
        kept = [line for line in lines if first <= json.loads(line)["step"] <= last]
        (out / name).write_text("".join(f"{line}\n" for line in kept))
    return out


def test_a_step_window_equals_runs_cut_to_those_steps(runs, tmp_path, capsys):
    # --steps 11:24 must give exactly what runs whose files hold only steps 11..24 give: every number and verdict.
    # Catches: an end left out (11:24 as 11..23), the window applied to metrics but not to the problems (the
    # coverage claims would count the programs of steps 1-10 and 25-30), the flag parsed but not applied.
    window, cut = tmp_path / "window", tmp_path / "cut"
    assert main([str(runs[0]), str(runs[1]), "--steps", "11:24", "--out", str(window)]) == 0
    stdout = capsys.readouterr().out
    pop, base = _cut_run(runs[0], tmp_path / "pop", 11, 24), _cut_run(runs[1], tmp_path / "base", 11, 24)
    assert main([str(pop), str(base), "--labels", "pop", "base", "--out", str(cut)]) == 0
    capsys.readouterr()
    windowed, whole = (json.loads((d / "compare.json").read_text()) for d in (window, cut))
    assert windowed["verdicts"] == whole["verdicts"] and windowed["programs_compared"] == whole["programs_compared"]
    for role in ("population", "baseline"):
        (a,), (b,) = windowed["arms"][role], whole["arms"][role]
        assert a["run"]["steps"] == 14 and (a["run"]["first_step"], a["run"]["last_step"]) == (11, 24)
        assert {k: v for k, v in a.items() if k not in ("run", "label")} == \
            {k: v for k, v in b.items() if k not in ("run", "label")}
    assert "steps 11 to 24 of each run (--steps 11:24)" in stdout
    # the whole runs differ from the window (so the equality above is not trivially true)
    full = tmp_path / "full"
    assert main([str(runs[0]), str(runs[1]), "--out", str(full)]) == 0
    assert json.loads((full / "compare.json").read_text())["arms"]["population"][0]["composite"] != \
        windowed["arms"]["population"][0]["composite"]


def test_an_open_window_runs_to_the_end_and_bad_windows_are_refused(runs, tmp_path, capsys):
    # Catches: 'A:' read as an empty window or as A..A; a reversed or malformed window accepted silently; a window
    # with too few steps compared anyway.
    out = tmp_path / "open"
    assert main([str(runs[0]), str(runs[1]), "--steps", "21:", "--out", str(out)]) == 0
    arm = json.loads((out / "compare.json").read_text())["arms"]["population"][0]["run"]
    assert (arm["first_step"], arm["last_step"], arm["steps"]) == (21, 30, 10)
    assert "steps 21 to the end of each run (--steps 21:)" in capsys.readouterr().out
    assert "--steps '24:11'" in bad([runs[0], runs[1], "--steps", "24:11"], capsys)
    assert "expected A:B" in bad([runs[0], runs[1], "--steps", "11-24"], capsys)
    assert "expected A:B" in bad([runs[0], runs[1], "--steps", "a:b"], capsys)
    assert "steps start at 1" in bad([runs[0], runs[1], "--steps", "0:5"], capsys)
    assert "2 step(s) in metrics.jsonl within --steps 29:30" in bad([runs[0], runs[1], "--steps", "29:30"], capsys)
