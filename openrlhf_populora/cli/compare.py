"""``python -m openrlhf_populora.cli.compare POP_RUN BASELINE_RUN [--out DIR] [--smooth N] [--labels A B] [--allow-any]``
``python -m openrlhf_populora.cli.compare --population P1 P2 P3 --baseline B1 B2 B3 [--out DIR] [--steps A:B] ...``

Prints the paper's signature (Figs 3, 4, 9, 11) for population runs against baseline runs, side by side, with
a verdict per claim: ``holds``, ``does not hold``, ``cannot tell`` (one run too persistent to tell a trend
from wander) or ``not enough steps`` (fewer than 10 steps with a finite value in a series the claim uses).
Give one run per arm (positional, as before) or several seeds per arm (``--population ... --baseline ...``,
at least two each): the claims are then tested across seeds. Either engine's run directories work (same
schema, ``metrics/keys.py``). The seven claims and their statistics are in ``analysis/signature.py`` and
``analysis/signature_stats.py``:

1. complexity: the slope per step of a composite of the five complexity axes (each standardised, then
   averaged: one claim, not five correlated ones): the population's rises, the baseline's falls, and the
   difference of the two slopes lies above 0. Intervals: the wider of Newey-West (HAC) and red noise (AR(1)
   fitted to the residual); each axis's slope is reported.
2. coverage: the CVT cells of the valid programs, every run brought to the smallest run's number of
   programs (rarefied, or thinned at random): the population covers more cells, and finds more new cells in
   the last third of its steps than the baseline in its own.
3. solve rate: the population's oscillation beyond AR(1) red noise (surrogates) and larger than the
   baseline's (a difference with its interval); the baseline's slope rises.

Each claim is tested on its own: a directional claim holds when its two-sided 95% interval lies on the
claimed side of 0, a one-sided test at 2.5% (calibrated by ``benchmarks/compare_calibration.py``;
``results/compare-calibration`` has its table). Before the tables it prints each arm's reward rule, population shape and per-adapter budget
(from each run's ``config.yaml``) and a warning when the arms differ in more than the population's shape: then a
difference may come from that instead (e.g. the failure-rate reward against AZR's learnability reward: run
``configs/signature-baseline-failure-rate.yaml`` to take it out). Against such a control (a baseline on the
failure-rate reward) the two claims about the baseline's collapse, which the paper predicts for the
learnability reward only, are reported but not counted in the tally.

Several seeds per arm: each run must be a different directory and, within an arm, a different ``train.seed``
(a seeded run repeats exactly on one machine: copies are not seeds); seeds whose statistic agrees exactly give
"cannot tell" (no spread to measure the noise by), not a zero-width interval; and a warning names runs without
a readable ``config.yaml``, seeds of one arm at different settings, and runs of different lengths.

``--steps A:B`` compares steps A to B of every run (both included; ``A:`` runs to each run's end), as if the runs
held only those steps: slopes, oscillation and coverage are measured on the window alone (a program counts as
new in it when the window had not seen it before, whatever earlier steps proposed). Windows of a long run
(``1:40``, ``41:80``, ``81:``) tell whether a claim holds early, late or throughout.

``--out DIR`` writes ``compare.md`` (the tables in Markdown), ``compare.json`` (every number and verdict;
verdict ids are fixed, e.g. ``complexity/population_rises``) and ``compare.png`` (the series with their
fitted lines; population blue, baseline black). ``--smooth N`` smooths the figure's lines only. The
population runs must be population runs and the baseline runs baselines (``mode`` in ``run_meta.json`` or
``config.yaml``); ``--allow-any`` compares any runs, roles then labelled A and B.
Exit status: 0 when the comparison ran (whatever the verdicts), 2 on bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from openrlhf_populora.analysis.compare import (
    ANY_ROLES,
    ROLES,
    attribution,
    check_roles,
    check_seeds,
    check_task_types,
    load,
    mark_unpredicted,
    write_outputs,
)
from openrlhf_populora.cli.errors import OneLineParser
from openrlhf_populora.errors import InputError


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m openrlhf_populora.cli.compare", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="*", metavar="RUN",
                        help="POP_RUN BASELINE_RUN: one population run and one baseline run")
    parser.add_argument("--population", type=Path, nargs="+", default=None, metavar="RUN",
                        help="the population's runs, one per seed (with --baseline)")
    parser.add_argument("--baseline", type=Path, nargs="+", default=None, metavar="RUN",
                        help="the baseline's runs, one per seed (with --population)")
    parser.add_argument("--out", type=Path, default=None, help="write compare.md, compare.json, compare.png here")
    parser.add_argument("--smooth", type=int, default=1, help="trailing moving-average window for the figure")
    parser.add_argument("--labels", nargs="+", metavar="LABEL", default=None,
                        help="one label per run, population's first (default: each run's own)")
    parser.add_argument("--steps", type=str, default=None, metavar="A:B",
                        help="compare steps A to B only (both included; 'A:' to the end)")
    parser.add_argument("--allow-any", action="store_true",
                        help="compare any runs (e.g. two populations); roles are then A and B")
    return parser


def run_groups(args) -> tuple[list[Path], list[Path]]:
    """The population's and the baseline's run directories, from either form of the command line."""
    if args.population is not None or args.baseline is not None:
        if args.runs:
            raise InputError("give the runs either as POP_RUN BASELINE_RUN or with --population/--baseline, not both")
        if args.population is None or args.baseline is None:
            raise InputError("--population and --baseline go together")
        if (len(args.population) == 1) != (len(args.baseline) == 1):
            raise InputError(f"give one run per arm, or at least two per arm (seed-level tests); got "
                             f"{len(args.population)} population and {len(args.baseline)} baseline runs")
        return list(args.population), list(args.baseline)
    if len(args.runs) != 2:
        raise InputError(f"expected POP_RUN BASELINE_RUN (or --population ... --baseline ...), got {len(args.runs)} "
                         "run(s)")
    return [args.runs[0]], [args.runs[1]]


def step_window(text: str) -> tuple[int, int | None]:
    """``--steps``'s ``A:B`` (or ``A:``) as ``(A, B or None)``."""
    first, sep, last = text.partition(":")
    try:
        if not sep:
            raise ValueError
        window = int(first), (int(last) if last.strip() else None)
    except ValueError:
        raise InputError(f"--steps {text!r}: expected A:B or A: with whole step numbers, e.g. 41:80") from None
    if window[0] < 1 or (window[1] is not None and window[1] < window[0]):
        raise InputError(f"--steps {text!r}: steps start at 1 and B must not come before A")
    return window


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smooth < 1:
        print("error: --smooth must be >= 1", file=sys.stderr)
        return 2
    try:
        paths = run_groups(args)
        count = len(paths[0]) + len(paths[1])
        if args.labels is not None and len(args.labels) != count:
            raise InputError(f"--labels: got {len(args.labels)} label(s) for {count} runs")
        labels = iter(args.labels or [None] * count)
        window = step_window(args.steps) if args.steps is not None else None
        groups = ([load(p, next(labels), window) for p in paths[0]],
                  [load(p, next(labels), window) for p in paths[1]])
        if not args.allow_any:
            for first in groups[0]:
                for second in groups[1]:
                    check_roles(first, second)
        check_task_types([*groups[0], *groups[1]])
        if len(groups[0]) > 1:
            check_seeds(groups)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from openrlhf_populora.analysis.signature import compare_runs, format_text

    roles = ANY_ROLES if args.allow_any else ROLES
    header, warnings, flats = attribution(roles, groups)
    if window is not None:
        header.insert(0, f"steps {window[0]} to {window[1] if window[1] is not None else 'the end'} of each run "
                         f"(--steps {args.steps})")
    warnings = [f"{run.label}: {w}" for run in (*groups[0], *groups[1]) for w in run.warnings] + warnings
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    comparison = compare_runs(groups[0], groups[1], roles=roles)
    if not args.allow_any:
        mark_unpredicted(comparison, flats[1])
    text = format_text(comparison).split("\n", 1)
    print("\n".join([text[0], *header, *(f"WARNING: {w}" for w in warnings), text[1]]), end="")
    if args.out is not None:
        try:
            write_outputs(args.out, comparison, args.smooth, header + [f"WARNING: {w}" for w in warnings])
        except OSError as err:
            print(f"error: cannot write to {args.out}: {err}", file=sys.stderr)
            return 2
        print(f"wrote compare.md, compare.json and compare.png to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
