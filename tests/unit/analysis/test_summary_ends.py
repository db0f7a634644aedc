"""summary.md's "first and last N steps" table: the means of each run's first and last N logged values.

Catches: the two windows swapped or both taken from one end, a window one step too wide or too narrow,
steps without the key counted, a run without the key shown as 0, and render_report ignoring ``ends``.
"""

import json

from openrlhf_populora.analysis.report import ends_table, first_and_last
from openrlhf_populora.analysis.runs import load_run
from openrlhf_populora.cli.report import main as report_main
from openrlhf_populora.metrics.keys import train_key

SOLVE, FORMAT = train_key("solve_rate"), train_key("format_rate")


def write_run(path, records):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_means_of_the_first_and_last_n_logged_values(tmp_path):
    # solve rate 0.0, 0.1, ..., 0.9 on steps 1..10; format rate missing on step 2
    records = [{"step": s, SOLVE: (s - 1) / 10} for s in range(1, 11)]
    for r in records:
        if r["step"] != 2:
            r[FORMAT] = r["step"]
    run = load_run(write_run(tmp_path / "a", records))
    first, last = first_and_last(run, SOLVE, 3)
    assert abs(first - 0.1) < 1e-12 and abs(last - 0.8) < 1e-12  # (0+.1+.2)/3, (.7+.8+.9)/3
    assert first_and_last(run, FORMAT, 2) == (2.0, 9.5)  # steps 1 and 3 (2 has none), then 9 and 10
    assert first_and_last(run, "train/nothing", 2) == (None, None)


def test_table_has_a_row_per_run_and_a_dash_for_a_missing_key(tmp_path):
    a = load_run(write_run(tmp_path / "a", [{"step": s, SOLVE: s, FORMAT: 1.0} for s in range(1, 5)]))
    b = load_run(write_run(tmp_path / "b", [{"step": s, SOLVE: 10 * s} for s in range(1, 4)]))
    lines = ends_table([a, b], 2)
    assert lines[1] == "## First and last 2 steps"
    assert lines[-4] == "| run | steps | `train/format_rate` | `train/solve_rate` |"
    assert lines[-2] == "| a | 4 | 1 -> 1 | 1.5 -> 3.5 |"
    assert lines[-1] == "| b | 3 | – | 15 -> 25 |"
    assert ends_table([b], 2)[-3].count("`") == 2  # only solve rate is a column when no run has format rate


def test_the_learning_diagnostics_are_columns(tmp_path):
    # results/cpu-signature-v2/README.md quotes these per arm from this table: dropping one from ENDS_KEYS must fail here
    keys = [train_key("validity"), "learning/update_size", "learning/probe_kl"]
    run = load_run(write_run(tmp_path / "a", [{"step": s, **{k: s for k in keys}} for s in range(1, 4)]))
    assert ends_table([run], 1)[-3] == "| run | steps | " + " | ".join(f"`{k}`" for k in keys) + " |"


def test_cli_default_is_ten_steps(tmp_path):
    run = write_run(tmp_path / "a", [{"step": s, SOLVE: s} for s in range(1, 31)])
    assert report_main([str(run), "--out", str(tmp_path / "out"), "--quiet", "--dpi", "30"]) == 0
    assert "| a | 30 | 5.5 -> 25.5 |" in (tmp_path / "out" / "summary.md").read_text()


def test_cli_passes_ends_to_the_summary(tmp_path):
    run = write_run(tmp_path / "a", [{"step": s, SOLVE: s} for s in range(1, 7)])
    assert report_main([str(run), "--out", str(tmp_path / "out"), "--ends", "4", "--quiet", "--dpi", "30"]) == 0
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "## First and last 4 steps" in summary and "| a | 6 | 2.5 -> 4.5 |" in summary
    assert report_main([str(run), "--out", str(tmp_path / "o2"), "--ends", "0"]) == 2
