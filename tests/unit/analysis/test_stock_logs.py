"""The report reads a stock OpenRLHF run (TensorBoard event files) beside a PopuLoRA run."""

from pathlib import Path

import pytest

from openrlhf_populora.analysis import stock_logs
from openrlhf_populora.analysis.report import render_report
from openrlhf_populora.analysis.synthetic import write_synthetic_run
from openrlhf_populora.cli.report import main as report_main

# per step: values exactly representable in float32 (event files store float32), so equality is exact
SCALARS = {
    1: {"train/reward": -0.5, "train/correct": 0.125, "train/format_ok": 0.5, "train/policy_loss": 0.75},
    2: {"train/reward": 0.25, "train/correct": 0.375, "train/format_ok": 0.625, "train/policy_loss": -0.25},
    3: {"train/reward": 0.5, "train/correct": 0.25, "train/format_ok": 0.875, "train/policy_loss": 0.0625},
}


def write_events(log_dir: Path, scalars=SCALARS) -> Path:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(log_dir))
    for step, values in scalars.items():
        for tag, value in values.items():
            writer.add_scalar(tag, value, step)
    writer.close()
    return log_dir


@pytest.fixture
def stock_dir(tmp_path):
    root = tmp_path / "stock"
    write_events(root / "tensorboard" / "ppo_x")
    return root


def test_loader_values_and_mapping(stock_dir):
    run = stock_logs.load_stock_run(stock_dir)
    assert run.label == "stock OpenRLHF" and run.mode == "stock" and not run.is_baseline
    assert run.steps == [1, 2, 3]
    for step, values in SCALARS.items():
        record = run.records[step]
        for tag, value in values.items():
            assert record[f"stock/{tag}"] == value
        assert record["train/solve_rate"] == values["train/correct"]
        assert record["train/format_rate"] == values["train/format_ok"]
        assert set(record) == {"step", "train/solve_rate", "train/format_rate", *(f"stock/{t}" for t in values)}
    # not the same quantity as PopuLoRA's: kept only under stock/
    assert not run.has("train/student_reward") and not run.has("train/reward") and not run.has("train/policy_loss")
    assert run.series("train/solve_rate")[1].tolist() == [0.125, 0.375, 0.25]
    # the plugin's response-length tag is absent here: said so
    assert any("train/response_length" in w for w in run.warnings)
    assert stock_logs.is_stock_run(stock_dir)


def test_event_file_layouts(tmp_path):
    direct = write_events(tmp_path / "direct")
    assert stock_logs.find_event_dir(direct) == direct
    nested = tmp_path / "nested"
    write_events(nested / "my_run")
    assert stock_logs.find_event_dir(nested) == nested / "my_run"
    assert stock_logs.load_stock_run(nested, label="B2").records[2]["train/solve_rate"] == 0.375
    two = tmp_path / "two"
    write_events(two / "tensorboard" / "a")
    write_events(two / "tensorboard" / "b")
    with pytest.raises(ValueError, match="several"):
        stock_logs.find_event_dir(two)
    (tmp_path / "plain" / "sub").mkdir(parents=True)
    assert stock_logs.find_event_dir(tmp_path / "plain") is None
    assert not stock_logs.is_stock_run(tmp_path / "plain")
    # a PopuLoRA run (metrics.jsonl) is never read as a stock run, even beside event files
    run = write_synthetic_run(tmp_path / "pop", mode="population", steps=3, seed=1)
    write_events(run / "tensorboard" / "x")
    assert not stock_logs.is_stock_run(run)
    assert render_report([run], tmp_path / "out", dpi=30).figures


def test_report_draws_stock_beside_population(stock_dir, tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    population = write_synthetic_run(tmp_path / "population", mode="population", steps=6, seed=2,
                                     label="pop 3T3S")
    lines = {}
    original = Figure.savefig

    def savefig(fig, path, *args, **kwargs):  # record the solve-rate panel's curves
        if Path(path).name == "training_dynamics.png":
            lines["solve"] = {ln.get_label(): ln.get_ydata().tolist() for ln in fig.axes[0].get_lines()}
        return original(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    out = tmp_path / "out"
    assert report_main([str(population), str(stock_dir), "--out", str(out), "--quiet", "--dpi", "30"]) == 0
    assert (out / "training_dynamics.png").exists()
    assert lines["solve"]["stock OpenRLHF"] == [0.125, 0.375, 0.25]
    assert "pop 3T3S" in lines["solve"]
    summary = (out / "summary.md").read_text()
    assert "stock OpenRLHF final | stock OpenRLHF best" in summary
    row = next(line for line in summary.splitlines() if line.startswith("| `train/solve_rate` |"))
    assert row.rstrip(" |").endswith("| 0.25 | 0.375")  # the stock run's final and best solve rate
    assert "| stock OpenRLHF | stock | 3 | 3 |" in summary
    # figures with keys the stock run lacks still draw the population alone
    assert "complexity.png" in (out / "summary.md").read_text()

    labelled = tmp_path / "labelled"
    assert report_main([str(stock_dir), "--labels", "B2 stock", "--out", str(labelled), "--quiet",
                        "--dpi", "30"]) == 0
    assert "| B2 stock | stock | 3 | 3 |" in (labelled / "summary.md").read_text()


def test_directory_without_metrics_or_events(tmp_path, capsys):
    (tmp_path / "empty" / "tensorboard" / "ppo_x").mkdir(parents=True)
    assert report_main([str(tmp_path / "empty"), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "empty" in err[0] and "event files" in err[0]
    assert not (tmp_path / "out" / "summary.md").exists()
    two = tmp_path / "two"
    write_events(two / "a")
    write_events(two / "b")
    assert report_main([str(two), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    assert "several" in capsys.readouterr().err
