"""Render a report (PNG figures + ``summary.md``) from one or more run directories.

``render_report(run_dirs, out_dir)`` draws every figure it can and records, for each one it cannot, why
(``ReportResult.skipped``, also listed in ``summary.md``). Figures compare all runs (baseline black);
ratings, solve-rate matrices and lineage are drawn per run. A run directory without ``metrics.jsonl`` that
holds TensorBoard event files is read as a stock OpenRLHF run (``analysis/stock_logs.py``): it shows in every
figure whose keys it has (solve rate, format rate, answer length) and is left out of the others.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from openrlhf_populora.analysis import plots
from openrlhf_populora.analysis.runs import RunData, load_run
from openrlhf_populora.analysis.stock_logs import is_stock_run, load_stock_run
from openrlhf_populora.metrics.keys import (
    COMPLEXITY_AXES,
    complexity_key,
    coverage_key,
    learning_key,
    train_key,
)

COMPARISON_FIGURES: tuple[tuple[str, Callable], ...] = (
    ("training_dynamics", plots.training_dynamics),
    ("complexity", plots.complexity),
    ("coverage", plots.coverage),
    ("task_types", plots.task_types),
    ("response_length", plots.response_length),
    ("diagnostics", plots.diagnostics),
    ("learning", plots.learning),
    ("timing", plots.timing),
)
PER_RUN_FIGURES: tuple[tuple[str, Callable], ...] = (
    ("ratings", plots.ratings),
    ("matrix", lambda run, window: plots.solve_matrix(run)),
    ("lineage", lambda run, window: plots.lineage(run)),
)
SUMMARY_KEYS = (
    [train_key(m) for m in ("solve_rate", "format_rate", "student_reward", "validity", "difficulty",
                            "teacher_reward", "student_response_length", "teacher_response_length")]
    + [complexity_key(a) for a in COMPLEXITY_AXES]
    + [coverage_key(n) for n in ("overall", "distinct_programs", "diversity")]
)
# the "first and last steps" table of summary.md: one row per run, so that nine runs still read as a table
ENDS_KEYS = (train_key("format_rate"), train_key("validity"), train_key("solve_rate"),
             complexity_key("ast_nodes"), coverage_key("overall"), learning_key("update_size"),
             learning_key("probe_kl"))
ENDS_STEPS = 10  # its default window at each end


@dataclass
class ReportResult:
    out_dir: Path
    figures: dict[str, int] = field(default_factory=dict)  # PNG file name -> number of matplotlib axes
    skipped: dict[str, str] = field(default_factory=dict)  # figure name -> why it was not drawn
    warnings: list[str] = field(default_factory=list)  # problems met while reading the runs
    summary: Path | None = None


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_") or "run"


def _unique_labels(runs: list[RunData]) -> None:
    seen: dict[str, int] = {}
    for run in runs:
        count = seen.get(run.label, 0)
        seen[run.label] = count + 1
        if count:
            run.label = f"{run.label}#{count + 1}"


def final_and_best(run: RunData, key: str, window: int) -> tuple[float | None, float | None]:
    """Last value and maximum of the smoothed series (None when the key is absent)."""
    _, ys = run.series(key)
    if not len(ys):
        return None, None
    smoothed = plots.smooth(ys, window)
    return float(smoothed[-1]), float(np.max(smoothed))


def first_and_last(run: RunData, key: str, n: int) -> tuple[float | None, float | None]:
    """Means of the first ``n`` and the last ``n`` logged values of ``key`` (None when it was never logged).

    A run shorter than ``2 n`` steps shares values between the two means.
    """
    _, ys = run.series(key)
    if not len(ys):
        return None, None
    return float(np.mean(ys[:n])), float(np.mean(ys[-n:]))


def _fmt(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.4g}"


def ends_table(runs: Sequence[RunData], n: int) -> list[str]:
    """Markdown: per run, the mean of the first ``n`` and of the last ``n`` steps of each of ``ENDS_KEYS``."""
    keys = [k for k in ENDS_KEYS if any(run.has(k) for run in runs)]
    if not keys:
        return []
    lines = ["", f"## First and last {n} steps", "",
             f"per run and metric: the mean of the first {n} steps that logged it -> the mean of the last {n} "
             "(a metric logged every k steps spans about k times as many steps).", "",
             "| run | steps | " + " | ".join(f"`{k}`" for k in keys) + " |", "|---|---|" + "---|" * len(keys)]
    for run in runs:
        cells = []
        for key in keys:
            first, last = first_and_last(run, key, n)
            cells.append("–" if first is None else f"{_fmt(first)} -> {_fmt(last)}")
        lines.append(f"| {run.label} | {len(run.steps)} | " + " | ".join(cells) + " |")
    return lines


def write_summary(runs: Sequence[RunData], result: ReportResult, window: int, ends: int) -> Path:
    lines = ["# Run report", ""]
    synthetic = [run.label for run in runs if run.synthetic]
    if synthetic:
        lines += [f"**Synthetic data** ({', '.join(synthetic)}): generated by `analysis/synthetic.py` to test the "
                  "report, not measured in any run.", ""]
    lines += ["| run | mode | steps logged | last step | members seen | evolution events | directory |",
              "|---|---|---|---|---|---|---|"]
    for run in runs:
        last = run.steps[-1] if run.steps else "–"
        lines.append(f"| {run.label} | {run.mode or '?'} | {len(run.steps)} | {last} | "
                     f"{len(run.member_lifetimes())} | {len(run.evolution_events())} | `{run.path}` |")
    eval_keys = sorted({k for run in runs for k in run.keys() if k.startswith("eval/")})
    keys = [k for k in (*SUMMARY_KEYS, *eval_keys) if any(run.has(k) for run in runs)]
    lines += ["", "## Final and best values", "",
              f"final = last value, best = maximum, both after a {window}-step trailing moving average.", ""]
    if keys:
        header = "| metric | " + " | ".join(f"{r.label} final | {r.label} best" for r in runs) + " |"
        lines += [header, "|---|" + "---|---|" * len(runs)]
        for key in keys:
            cells = []
            for run in runs:
                final, best = final_and_best(run, key, window)
                cells += [_fmt(final), _fmt(best)]
            lines.append(f"| `{key}` | " + " | ".join(cells) + " |")
    else:
        lines.append("No metric values found.")
    lines += ends_table(runs, ends)
    lines += ["", "## Figures", ""]
    lines += [f"- `{name}` ({n} axes)" for name, n in result.figures.items()] or ["- none"]
    if result.skipped:
        lines += ["", "## Not rendered", ""]
        lines += [f"- `{name}`: {why}" for name, why in result.skipped.items()]
    if result.warnings:
        lines += ["", "## Warnings while reading", ""]
        lines += [f"- {w}" for w in result.warnings]
    path = result.out_dir / "summary.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def render_report(run_dirs: Sequence[str | Path], out_dir: str | Path, smooth: int = 1,
                  labels: Sequence[str] | None = None, progress: bool = False, dpi: int = 110,
                  ends: int = ENDS_STEPS) -> ReportResult:
    """Write the figures and ``summary.md`` for ``run_dirs`` into ``out_dir``.

    Raises ``ValueError`` for bad arguments (and for a directory holding several stock TensorBoard runs) and
    ``FileNotFoundError`` for a run directory that does not exist; anything wrong *inside* a run directory only
    costs the figures that need it. A directory without ``metrics.jsonl`` but with TensorBoard event files is
    read as a stock OpenRLHF run (``analysis/stock_logs.py``).
    """
    if isinstance(run_dirs, (str, Path)):
        run_dirs = [run_dirs]
    if not run_dirs:
        raise ValueError("render_report needs at least one run directory")
    if isinstance(smooth, bool) or not isinstance(smooth, int) or smooth < 1:
        raise ValueError(f"smooth must be an int >= 1 (a window in steps), got {smooth!r}")
    if isinstance(ends, bool) or not isinstance(ends, int) or ends < 1:
        raise ValueError(f"ends must be an int >= 1 (steps at each end of a run), got {ends!r}")
    if labels is not None and len(labels) != len(run_dirs):
        raise ValueError(f"got {len(labels)} labels for {len(run_dirs)} run directories")
    from tqdm.auto import tqdm

    missing = [str(d) for d in run_dirs if not Path(d).is_dir()]
    if missing:
        raise FileNotFoundError(f"run directory does not exist: {', '.join(missing)}")
    result = ReportResult(out_dir=Path(out_dir))
    result.out_dir.mkdir(parents=True, exist_ok=True)
    runs: list[RunData] = []
    for i, run_dir in enumerate(tqdm(run_dirs, desc="reading runs", unit="run", disable=not progress)):
        label = labels[i] if labels else None
        run = load_stock_run(run_dir, label=label) if is_stock_run(run_dir) else load_run(run_dir, label=label)
        run.problems()  # read now, so its warnings are listed too
        runs.append(run)
    _unique_labels(runs)
    for run in runs:
        result.warnings += [f"{run.label}: {w}" for w in run.warnings]
        if not run.steps:
            result.warnings.append(f"{run.label}: no step records")

    def save(name: str, draw: Callable[[], object]) -> None:
        try:
            fig = draw()
        except plots.Skip as why:
            result.skipped[name] = str(why)
            return
        except Exception as err:  # one broken figure must not cost the others
            result.skipped[name] = f"error: {type(err).__name__}: {err}"
            return
        if any(run.synthetic for run in runs):
            plots.mark_synthetic(fig)
        fig.savefig(result.out_dir / f"{name}.png", dpi=dpi)
        result.figures[f"{name}.png"] = len(fig.axes)

    jobs: list[tuple[str, Callable[[], object]]] = []
    for name, draw in COMPARISON_FIGURES:
        jobs.append((name, lambda d=draw: d(runs, smooth)))
    for run in runs:
        for name, draw in PER_RUN_FIGURES:
            jobs.append((f"{name}_{_slug(run.label)}", lambda d=draw, r=run: d(r, smooth)))
    jobs.append(("problems", lambda: plots.example_problems(runs)))
    for name, draw in tqdm(jobs, desc="figures", unit="fig", disable=not progress):
        save(name, draw)
    result.summary = write_summary(runs, result, smooth, ends)
    if progress:
        for name, why in result.skipped.items():
            print(f"not rendered: {name}: {why}", file=sys.stderr)
    return result
