"""``cli.compare`` end to end on synthetic runs whose designed trends the verdicts must recover; bad input."""

import contextlib
import io
import json
import subprocess
import sys

import pytest

from openrlhf_populora.cli.compare import main
from openrlhf_populora.metrics.keys import COMPLEXITY_AXES, META_FILE, METRICS_FILE
from openrlhf_populora.metrics.synthetic import write_synthetic_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


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
    for axis in COMPLEXITY_AXES:
        assert verdicts[f"complexity/{axis}/population_rises"] == "holds"
        assert verdicts[f"complexity/{axis}/baseline_falls"] == "holds"
    assert verdicts["solve_rate/baseline_rises"] == "holds"
    assert verdicts["solve_rate/population_oscillates_more"] == "holds"
    assert verdicts["coverage/population_ends_higher"] == "holds"
    assert verdicts["coverage/population_still_adding"] == "holds"
    assert "14 claims: 14 holds, 0 does not hold, 0 not enough steps" in stdout


def test_files_hold_the_same_numbers_as_stdout(compared):
    _, stdout, out = compared
    data = json.loads((out / "compare.json").read_text())
    assert data["runs"]["population"]["label"] == "P3" and data["runs"]["baseline"]["label"] == "B1"
    assert data["runs"]["population"]["steps"] == 30
    loc = data["complexity"]["loc"]["population"]
    assert loc["lo"] < loc["slope"] < loc["hi"] and loc["n"] == 30
    cell = f"{loc['slope']:+.3g} [{loc['lo']:+.3g}, {loc['hi']:+.3g}] n=30"
    markdown = (out / "compare.md").read_text()
    assert cell in stdout and f"| loc | {cell} |" in markdown
    assert "P3" in stdout and "B1" in stdout
    assert data["coverage"]["population"]["overall_end"] > data["coverage"]["baseline"]["overall_end"]
    assert (out / "compare.png").read_bytes()[:8] == PNG_MAGIC


def test_allow_any_labels_roles_a_and_b_and_the_swapped_signature_fails(runs, tmp_path, capsys):
    assert main([str(runs[1]), str(runs[0]), "--allow-any", "--out", str(tmp_path)]) == 0
    stdout = capsys.readouterr().out
    assert "A rises" in stdout and "B falls" in stdout
    data = json.loads((tmp_path / "compare.json").read_text())
    assert data["roles"] == {"population": "A", "baseline": "B"} and set(data["runs"]) == {"A", "B"}
    verdicts = verdicts_of(tmp_path)
    for axis in COMPLEXITY_AXES:  # the baseline's complexity falls, the population's rises
        assert verdicts[f"complexity/{axis}/population_rises"] == "does not hold"
        assert verdicts[f"complexity/{axis}/baseline_falls"] == "does not hold"
    assert verdicts["solve_rate/population_oscillates_more"] == "does not hold"
    assert verdicts["coverage/population_ends_higher"] == "does not hold"


def test_a_run_under_ten_steps_gives_not_enough_steps(tmp_path, capsys):
    pop = write_synthetic_run(tmp_path / "pop", mode="population", steps=5, seed=2)
    base = write_synthetic_run(tmp_path / "base", mode="baseline", steps=30, seed=1)
    assert main([str(pop), str(base), "--out", str(tmp_path / "out")]) == 0
    verdicts = verdicts_of(tmp_path / "out")
    baseline_only = {f"complexity/{axis}/baseline_falls" for axis in COMPLEXITY_AXES} | {"solve_rate/baseline_rises"}
    for name, verdict in verdicts.items():  # what uses the population's series cannot be judged
        assert verdict == ("holds" if name in baseline_only else "not enough steps"), name
    assert "not enough steps" in capsys.readouterr().out


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
    same = write_synthetic_run(tmp_path / "same", mode="baseline", steps=12, seed=1)
    (same / "config.yaml").write_text("populora:\n  task_types: [code_o]\n")
    assert "different task types" in bad([runs[0], same], capsys)


def test_bad_flags_are_one_line(runs, capsys):
    assert "--smooth" in bad([runs[0], runs[1], "--smooth", "0"], capsys)
    with pytest.raises(SystemExit) as exit_info:
        main([str(runs[0])])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_the_module_runs_as_a_command(runs, tmp_path):
    done = subprocess.run([sys.executable, "-m", "openrlhf_populora.cli.compare", str(tmp_path / "nowhere"),
                           str(runs[1])], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == f"error: run directory {tmp_path / 'nowhere'} does not exist"
