"""``python -m openrlhf_populora.cli.report RUN_DIR [RUN_DIR ...] --out DIR [--smooth N] [--ends N] [--retention STUDY_DIR]``

Draws the comparison figures (PNG) and ``summary.md`` for one or more run directories, e.g. a baseline
and a population run. ``--synthetic`` writes two synthetic runs (baseline + population) under
``DIR/synthetic_runs`` first and reports on them: a smoke test of the whole pipeline. ``--retention STUDY_DIR``
draws an operator retention study (``cli/retention.py``) into ``DIR``: its grid figure, its measures and its
table (``retention.md``, ``retention.json``; ``analysis/retention.py``), with or without run directories.

A RUN_DIR may also be the output of a stock OpenRLHF run (baseline B2, ``openrlhf.cli.train_ppo_ray`` with
``--logger.tensorboard_dir``): a directory without ``metrics.jsonl`` holding TensorBoard event files
(``events.out.tfevents.*``) directly, under ``tensorboard/<run_name>/`` or under ``<run_name>/``. Its scalars
become per-step records (``analysis/stock_logs.py``): every tag is kept as ``stock/<tag>``, and the tags that
mean the same as a PopuLoRA key are also shown under it: ``train/correct`` as ``train/solve_rate``,
``train/format_ok`` as ``train/format_rate``, ``train/response_length`` as ``train/student_response_length``
(``train/reward``, the losses and the timings are not mapped). It is labelled "stock OpenRLHF" unless
``--labels`` says otherwise, and is left out of the figures whose keys it lacks.

Exit status: 0 when at least one figure was drawn, 1 when none could be, 2 on bad arguments (including a
RUN_DIR with neither ``metrics.jsonl`` nor TensorBoard event files).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m openrlhf_populora.cli.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="*", type=Path, help="run directories (each holds metrics.jsonl, or a stock OpenRLHF run's TensorBoard "
                        "event files)")
    parser.add_argument("--out", type=Path, required=True, help="output directory for PNGs and summary.md")
    parser.add_argument("--smooth", type=int, default=1, help="trailing moving-average window in steps (1: raw)")
    parser.add_argument("--ends", type=int, default=10, metavar="N",
                        help="summary.md's 'first and last N steps' table: the mean of each run's first N and last N "
                             "steps (default 10)")
    parser.add_argument("--labels", nargs="+", default=None, help="one label per run (default: directory names)")
    parser.add_argument("--dpi", type=int, default=110)
    parser.add_argument("--synthetic", action="store_true", help="report on two generated synthetic runs")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--retention", type=Path, default=None, metavar="STUDY_DIR",
                        help="also draw this operator retention study (cli/retention.py): grid, measures, table")
    return parser


def report_retention(study_dir: Path, out: Path, dpi: int) -> int:
    """Draw a retention study into ``out``; returns the number of figures (-1 when it is not a study)."""
    from openrlhf_populora.analysis.retention import render_retention

    try:
        result = render_retention(study_dir, out, dpi=dpi)
    except FileNotFoundError as err:
        print(f"error: --retention: {err}", file=sys.stderr)
        return -1
    print(f"wrote {', '.join(p.name for p in result.files)} to {result.out_dir}")
    for name, why in result.skipped.items():
        print(f"not rendered: {name}: {why}", file=sys.stderr)
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return sum(p.suffix == ".png" for p in result.files)


def check_run_dir(run_dir: Path) -> str | None:
    """Why ``run_dir`` cannot be reported on (None when it can, or when it does not exist: said later)."""
    from openrlhf_populora.analysis.stock_logs import EVENT_GLOB, find_event_dir
    from openrlhf_populora.metrics.keys import METRICS_FILE

    if not run_dir.is_dir() or (run_dir / METRICS_FILE).exists():
        return None
    try:
        if find_event_dir(run_dir) is not None:
            return None
    except ValueError as err:
        return str(err)
    return (f"{run_dir}: neither {METRICS_FILE} nor TensorBoard event files ({EVENT_GLOB}, directly or under "
            "tensorboard/<run_name>/ or <run_name>/)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smooth < 1 or args.ends < 1:
        print("error: --smooth and --ends must be >= 1", file=sys.stderr)
        return 2
    for run_dir in args.run_dirs:
        why = check_run_dir(run_dir)
        if why:
            print(f"error: {why}", file=sys.stderr)
            return 2
    run_dirs = list(args.run_dirs)
    if args.synthetic:
        from openrlhf_populora.analysis.synthetic import write_synthetic_run

        root = args.out / "synthetic_runs"
        run_dirs += [write_synthetic_run(root / "baseline", mode="baseline", seed=1, label="synthetic baseline"),
                     write_synthetic_run(root / "population", mode="population", seed=2,
                                         label="synthetic population 3T3S")]
    if not run_dirs and args.retention is None:
        print("error: give at least one RUN_DIR (or --synthetic, or --retention STUDY_DIR)", file=sys.stderr)
        return 2
    retention_figures = 0
    if args.retention is not None:
        retention_figures = report_retention(args.retention, args.out, args.dpi)
        if retention_figures < 0:
            return 2
        if not run_dirs:
            return 0 if retention_figures else 1
    from openrlhf_populora.analysis.report import render_report

    try:
        result = render_report(run_dirs, args.out, smooth=args.smooth, ends=args.ends, labels=args.labels,
                               progress=not args.quiet, dpi=args.dpi)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {len(result.figures)} figures and {result.summary} to {result.out_dir}")
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return 0 if result.figures or retention_figures else 1


if __name__ == "__main__":
    sys.exit(main())
