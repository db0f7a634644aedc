"""``python -m openrlhf_populora.cli.compare POP_RUN BASELINE_RUN [--out DIR] [--smooth N] [--labels A B] [--allow-any]``

Prints the paper's signature (Figs 3, 4, 9, 11) for a population run against a baseline run, side by side,
with a verdict per claim: ``holds``, ``does not hold`` or ``not enough steps`` (fewer than 10 steps with a
finite value in a series the claim uses, or the series is missing). Either engine's run directories work
(same schema, ``metrics/keys.py``). The statistics (``metrics/signature.py``), all on the raw series:

1. complexity: for each ``complexity/<axis>``, the ordinary least squares slope per step with a 95%
   t-based confidence interval (slope +- t(0.975, n-2) x standard error). Claims: the population rises
   (CI above 0) and the baseline falls (CI below 0), separately per axis.
2. coverage: ``coverage/overall`` and ``coverage/distinct_programs`` at each run's last step, and how many
   steps had ``coverage/new_cells`` > 0 (overall, and in the last third of the steps). Claims: the
   population's coverage ends higher, and the population still adds cells in its last third.
3. solve-rate oscillation: a sinusoid fitted jointly with a linear trend to ``train/solve_rate`` (the
   spectral peak of the residual off that trend) over periods of span/k steps, k = 1.5, 2, ... n/2; the
   measure is the largest amplitude (solve-rate units) with its period, and a p-value from 999 seeded
   permutations of the residual. Claim: the population's amplitude is larger than the baseline's and
   significant (p < 0.05). Also the baseline's solve-rate slope; claim: it rises (CI above 0).
4. trends: the slopes of ``train/validity`` and ``train/solve_rate`` for both runs, reported.

``--out DIR`` writes ``compare.md`` (the tables in Markdown), ``compare.json`` (every number and verdict;
verdict ids are fixed, e.g. ``complexity/loc/population_rises``) and ``compare.png`` (the series with
their fitted lines; population blue, baseline black). ``--smooth N`` smooths the figure's lines only.
The first run must be a population run and the second a baseline (``mode`` in ``run_meta.json`` or
``config.yaml``); ``--allow-any`` compares any two runs, roles then labelled A and B.
Exit status: 0 when the comparison ran (whatever the verdicts), 2 on bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from openrlhf_populora.cli.errors import InputError, OneLineParser
from openrlhf_populora.metrics.keys import METRICS_FILE

MIN_STEPS = 3
ROLES = ("population", "baseline")
ANY_ROLES = ("A", "B")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m openrlhf_populora.cli.compare", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pop_run", type=Path, help="the population run directory")
    parser.add_argument("baseline_run", type=Path, help="the baseline run directory")
    parser.add_argument("--out", type=Path, default=None, help="write compare.md, compare.json, compare.png here")
    parser.add_argument("--smooth", type=int, default=1, help="trailing moving-average window for the figure")
    parser.add_argument("--labels", nargs=2, metavar=("A", "B"), default=None, help="labels of the two runs")
    parser.add_argument("--allow-any", action="store_true",
                        help="compare any two runs (e.g. two populations); roles are then A and B")
    return parser


def load(path: Path, label: str | None):
    from openrlhf_populora.metrics.runs import load_run

    if not path.is_dir():
        raise InputError(f"run directory {path} does not exist")
    if not (path / METRICS_FILE).is_file():
        raise InputError(f"{path} has no {METRICS_FILE}: not a run directory")
    run = load_run(path, label=label)
    if len(run.steps) < MIN_STEPS:
        raise InputError(f"{path} has {len(run.steps)} step(s) in {METRICS_FILE}; "
                         f"the comparison needs at least {MIN_STEPS}")
    return run


def check_roles(first, second) -> None:
    """The first run must be a population, the second a baseline."""
    for run in (first, second):
        if run.mode not in ROLES:
            raise InputError(f"cannot tell whether {run.path} is a population or a baseline run (mode "
                             f"{run.mode!r} in run_meta.json / config.yaml); pass --allow-any to compare anyway")
    if first.mode == "baseline" and second.mode == "population":
        raise InputError(f"the runs are swapped: {first.path} is a baseline run and {second.path} a population "
                         "run; give the population run first")
    for run, wanted in ((first, "population"), (second, "baseline")):
        if run.mode != wanted:
            raise InputError(f"{run.path} is a {run.mode} run where a {wanted} run is expected; "
                             "pass --allow-any to compare two runs of the same mode")


def configured_task_types(path: Path) -> list[str] | None:
    """``populora.task_types`` from the run's ``config.yaml``, or None."""
    try:
        import yaml

        data = yaml.safe_load((path / "config.yaml").read_text())
    except Exception:
        return None
    section = data.get("populora") if isinstance(data, dict) else None
    types = section.get("task_types") if isinstance(section, dict) else None
    return list(types) if isinstance(types, list) and all(isinstance(t, str) for t in types) else None


def check_task_types(first, second) -> None:
    found = [set(configured_task_types(r.path) or r.task_types()) for r in (first, second)]
    if all(found) and found[0] != found[1]:
        raise InputError(f"the runs played different task types: {first.path}: {', '.join(sorted(found[0]))}; "
                         f"{second.path}: {', '.join(sorted(found[1]))}")


def json_safe(value: Any) -> Any:
    """NaN and infinities become null (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_outputs(out: Path, first, second, comparison, smooth: int) -> None:
    from openrlhf_populora.metrics.signature import comparison_figure, format_markdown

    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.md").write_text(format_markdown(comparison), encoding="utf-8")
    data = json_safe(comparison.to_dict())
    (out / "compare.json").write_text(json.dumps(data, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    comparison_figure(first, second, comparison, smooth=smooth).savefig(out / "compare.png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smooth < 1:
        print("error: --smooth must be >= 1", file=sys.stderr)
        return 2
    labels = args.labels or (None, None)
    try:
        first, second = load(args.pop_run, labels[0]), load(args.baseline_run, labels[1])
        if not args.allow_any:
            check_roles(first, second)
        check_task_types(first, second)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from openrlhf_populora.metrics.signature import compare_runs, format_text

    for run in (first, second):
        for warning in run.warnings:
            print(f"warning: {run.label}: {warning}", file=sys.stderr)
    comparison = compare_runs(first, second, roles=ANY_ROLES if args.allow_any else ROLES)
    print(format_text(comparison), end="")
    if args.out is not None:
        try:
            write_outputs(args.out, first, second, comparison, args.smooth)
        except OSError as err:
            print(f"error: cannot write to {args.out}: {err}", file=sys.stderr)
            return 2
        print(f"wrote compare.md, compare.json and compare.png to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
