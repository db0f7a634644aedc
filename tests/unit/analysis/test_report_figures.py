"""The report: every figure from synthetic runs (baseline + evolving population), truncated, empty and old runs."""

import json
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from openrlhf_populora.analysis import plots
from openrlhf_populora.analysis.report import render_report
from openrlhf_populora.analysis.runs import load_run
from openrlhf_populora.analysis.synthetic import write_synthetic_run
from openrlhf_populora.cli.report import main as report_main
from openrlhf_populora.metrics import keys

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = 24


def assert_png(path):
    assert path.read_bytes()[:8] == PNG_MAGIC
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    baseline = write_synthetic_run(root / "baseline", mode="baseline", steps=STEPS, seed=1)
    population = write_synthetic_run(root / "population", mode="population", steps=STEPS, evolve_every=8,
                                     seed=2, truncate=True)
    return baseline, population


@pytest.fixture(scope="module")
def report(runs, tmp_path_factory):
    return render_report(list(runs), tmp_path_factory.mktemp("report"), smooth=3, dpi=50)


# number of matplotlib axes per figure: panels (+1 colour bar for the matrix)
EXPECTED = {
    "training_dynamics.png": 4,
    "complexity.png": 5,
    "coverage.png": 3,
    "task_types.png": 6,  # 3 task types x (solve rate, validity)
    "response_length.png": 2,
    "diagnostics.png": 5,
    "learning.png": 9,  # update size, 2 x probe KL, 3 task types x (format rate, validity)
    "timing.png": 2,  # one per run
    "ratings_population.png": 3,
    "matrix_population.png": 6,  # 5 snapshots + colour bar
    "lineage_population.png": 1,
    "problems.png": 8,  # 4 matched steps x 2 runs
}


@pytest.mark.slow
def test_every_figure_is_rendered(report):
    assert report.figures == EXPECTED
    for name in EXPECTED:
        assert_png(report.out_dir / name)
    # a single agent has no ratings, matrix or lineage: said so, not silently dropped
    assert set(report.skipped) == {"ratings_baseline", "matrix_baseline", "lineage_baseline"}
    assert "no rating" in report.skipped["ratings_baseline"]


@pytest.mark.slow
def test_summary_table_and_truncation_warning(report):
    text = report.summary.read_text()
    assert "| `train/solve_rate` |" in text and "| `coverage/overall` |" in text
    assert "baseline final" in text and "population best" in text
    assert "## Not rendered" in text and "ratings_baseline" in text
    assert any("truncated last line" in w and "metrics.jsonl" in w for w in report.warnings)
    assert any("truncated last line" in w and "problems.jsonl" in w for w in report.warnings)
    assert "truncated last line" in text


def test_members_appear_and_disappear(runs):
    run = load_run(runs[1])
    spans = run.member_lifetimes()
    assert spans["t0"] == ("teacher", 1, STEPS)
    replaced = [e["replaced"] for e in run.evolution_events()]
    children = [e["child"] for e in run.evolution_events()]
    assert len(replaced) == 4
    for member in replaced:
        assert spans[member][2] < STEPS
    for member in children:
        assert spans[member][1] > 1 and spans[member][2] == STEPS
    # the per-member mean never averages a member that is not alive
    mean, band = plots.population_series(run, None, ["student"], "solve_rate")
    assert len(mean[0]) == STEPS and band is not None
    assert np.all(band[1] <= mean[1] + 1e-12) and np.all(mean[1] <= band[2] + 1e-12)


def test_truncated_run_reads_all_complete_records(runs):
    run = load_run(runs[1])
    assert run.steps == list(range(1, STEPS + 1))
    assert len(run.warnings) == 1 and "truncated" in run.warnings[0]


def test_old_run_with_few_keys(tmp_path):
    run_dir = tmp_path / "old"
    run_dir.mkdir()
    lines = [{"step": s, "train/solve_rate": 0.1 * s, "train/validity": 0.5} for s in range(1, 6)]
    lines.insert(2, ["not", "a", "record"])
    (run_dir / keys.METRICS_FILE).write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    result = render_report([run_dir], tmp_path / "out", dpi=40)
    assert result.figures == {"training_dynamics.png": 4}  # two panels say "no data"
    assert_png(tmp_path / "out" / "training_dynamics.png")
    for name in ("complexity", "coverage", "diagnostics", "timing", "problems", "ratings_old", "lineage_old"):
        assert name in result.skipped
    assert any("line 3" in w for w in result.warnings)


def test_empty_run_directory(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    result = render_report([tmp_path / "empty"], tmp_path / "out")
    assert result.figures == {}
    assert "training_dynamics" in result.skipped
    assert result.summary.exists() and "no metrics.jsonl" in result.summary.read_text()
    assert report_main([str(tmp_path / "empty"), "--out", str(tmp_path / "out2"), "--quiet"]) == 2  # neither metrics.jsonl nor a stock run: bad input


def test_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        render_report([tmp_path / "missing"], tmp_path / "out")
    with pytest.raises(ValueError, match="smooth"):
        render_report([tmp_path], tmp_path / "out", smooth=0)
    with pytest.raises(ValueError, match="at least one"):
        render_report([], tmp_path / "out")
    assert report_main([str(tmp_path / "missing"), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    assert report_main(["--out", str(tmp_path / "out"), "--quiet"]) == 2


def test_smoothing_is_a_trailing_mean():
    assert plots.smooth(np.array([1.0, 2.0, 3.0, 4.0]), 2).tolist() == [1.0, 1.5, 2.5, 3.5]
    assert plots.smooth(np.array([1.0, 5.0]), 1).tolist() == [1.0, 5.0]


def test_median_problem_is_deterministic_and_short():
    long_program = "def f(x):\n" + "    x += 1\n" * 30 + "    return x\n"
    records = [{"program": long_program}] + [
        {"program": "def f(x):\n" + "    x += 1\n" * n + "    return x\n"} for n in (1, 2, 3, 4, 5)]
    record, complexity = plots.median_problem(records)
    assert record["program"].count("x += 1") == 3  # median of the five short ones; the long one is excluded
    assert complexity["loc"] == 5


@pytest.mark.slow
def test_cli_synthetic_smoke(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    stamped = {}
    original = Figure.savefig

    def savefig(fig, path, *args, **kwargs):  # record whether each saved figure carries the synthetic stamp
        stamped[Path(path).name] = any(t.get_text() == plots.SYNTHETIC_MARK for t in fig.texts)
        return original(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    assert report_main(["--synthetic", "--out", str(tmp_path), "--quiet", "--dpi", "40", "--smooth", "2"]) == 0
    assert "**Synthetic data**" in (tmp_path / "summary.md").read_text()
    assert_png(tmp_path / "training_dynamics.png")
    assert stamped and all(stamped.values()), stamped
    assert "synthetic population 3T3S final" in (tmp_path / "summary.md").read_text()


@pytest.mark.slow
def test_real_runs_are_not_stamped_synthetic(tmp_path):
    run = write_synthetic_run(tmp_path / "run", steps=6, seed=3)
    meta = json.loads((run / "run_meta.json").read_text())
    (run / "run_meta.json").write_text(json.dumps({**meta, "synthetic": False}))
    result = render_report([run], tmp_path / "out", dpi=40)
    assert "Synthetic data" not in result.summary.read_text()
