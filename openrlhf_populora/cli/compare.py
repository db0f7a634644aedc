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
import json
import math
import sys
from pathlib import Path
from typing import Any

from openrlhf_populora.cli.errors import InputError, OneLineParser
from openrlhf_populora.metrics.keys import METRICS_FILE, PROBLEMS_FILE

MIN_STEPS = 3
ROLES = ("population", "baseline")
ANY_ROLES = ("A", "B")


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


def load(path: Path, label: str | None, window: tuple[int, int | None] | None = None):
    from openrlhf_populora.analysis.runs import load_run

    if not path.is_dir():
        raise InputError(f"run directory {path} does not exist")
    if not (path / METRICS_FILE).is_file():
        raise InputError(f"{path} has no {METRICS_FILE}: not a run directory")
    if not (path / PROBLEMS_FILE).is_file():
        raise InputError(f"{path} has no {PROBLEMS_FILE}: the coverage and complexity claims read its programs")
    run = load_run(path, label=label)
    run.problems()  # read now, so that its warnings (a damaged line, say) are printed with the others
    if window is not None:
        run = run.between(*window)
    if len(run.steps) < MIN_STEPS:
        where = "" if window is None else f" within --steps {window[0]}:{window[1] or ''}"
        raise InputError(f"{path} has {len(run.steps)} step(s) in {METRICS_FILE}{where}; "
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


def run_config(path: Path) -> dict | None:
    """The run's ``config.yaml`` as a mapping, or None."""
    try:
        import yaml

        data = yaml.safe_load((path / "config.yaml").read_text())
    except Exception:
        return None
    return data if isinstance(data, dict) else None


def configured_task_types(path: Path) -> list[str] | None:
    """``populora.task_types`` from the run's ``config.yaml``, or None."""
    data = run_config(path)
    section = data.get("populora") if isinstance(data, dict) else None
    types = section.get("task_types") if isinstance(section, dict) else None
    return list(types) if isinstance(types, list) and all(isinstance(t, str) for t in types) else None


def check_task_types(runs) -> None:
    found = [(r.path, set(configured_task_types(r.path) or r.task_types())) for r in runs]
    known = [(path, types) for path, types in found if types]
    for path, types in known[1:]:
        if types != known[0][1]:
            raise InputError(f"the runs played different task types: {known[0][0]}: {', '.join(sorted(known[0][1]))}; "
                             f"{path}: {', '.join(sorted(types))}")


# --- attribution: what else differs between the arms ---------------------------------------------------------

RULE_KEY = "teacher reward rule"  # describe_arm's resolved rule (failure_rate or learnability)
# what may differ between the arms without confounding the population: its shape (and what comes with it), the
# run's own directory, loggers, seed, machine and threads
SHAPE_KEYS = ("ckpt.", "logger.", "train.seed", "populora.mode", "populora.num_teachers", "populora.num_students",
              "populora.matchmaking", "populora.rating", "populora.evolution.", "populora.baseline_for",
              "populora.device", "populora.num_threads", "populora.sandbox.workers", "populora.teacher_reward")


def describe_arm(path: Path) -> tuple[str, dict[str, Any]]:
    """One line on a run's reward rule, shape and per-adapter budget; its settings as dotted keys ({} unknown)."""
    from openrlhf_populora.config import _flatten, config_from_dict

    data = run_config(path)
    if data is None:
        return f"{path}: no readable config.yaml: reward rule, shape and budget unknown", {}
    config = config_from_dict(data)
    p = config.populora
    types = len(p.task_types)
    shape = ("single agent (one adapter in both roles)" if p.mode == "baseline"
             else f"{p.num_teachers} teacher(s) x {p.num_students} student(s)")
    flat = _flatten(config.to_dict())
    flat[RULE_KEY] = p.teacher_reward_mode()
    line = (f"{path}: reward rule {p.teacher_reward_mode()} (teacher_reward {p.teacher_reward}); {shape}; per adapter "
            f"and step: {p.proposals_per_teacher * types} proposals, {p.solver_tasks * p.solver_samples * types} "
            f"answers ({p.solver_tasks} tasks x {p.solver_samples} samples x {types} types), "
            f"{config.train.max_epochs} update(s); {p.total_steps} steps")
    return line, flat


def confounds(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> list[str]:
    """The settings (outside the population's shape) whose values differ between the two arms' runs whose
    settings are known."""
    first, second = [f for f in first if f], [f for f in second if f]
    if not first or not second:
        return []
    keys = sorted(set().union(*first, *second))
    out = []
    for key in keys:
        if key.startswith(SHAPE_KEYS):
            continue
        a = {repr(flat.get(key)) for flat in first}
        b = {repr(flat.get(key)) for flat in second}
        if a != b:
            out.append(f"{key}: {', '.join(sorted(a))} vs {', '.join(sorted(b))}")
    return out


def attribution(roles: tuple[str, str], groups: tuple[list, list]
                ) -> tuple[list[str], list[str], tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """Lines describing each arm, warnings for every other difference between them, and each run's settings
    (``describe_arm``'s; {} when unknown)."""
    lines, flats = [], ([], [])
    for i, role in enumerate(roles):
        for run in groups[i]:
            line, flat = describe_arm(run.path)
            lines.append(f"{role}: {line}")
            flats[i].append(flat)
    differences = confounds(*flats)
    warnings = ([f"the arms differ in more than the population's shape, so a difference between them may come "
                 f"from these too: {'; '.join(differences)}"] if differences else [])
    unknown = [str(run.path) for group, flat in zip(groups, flats, strict=True)
               for run, f in zip(group, flat, strict=True) if not f]
    if unknown:
        warnings.append(f"no readable config.yaml in {', '.join(unknown)}: what else differs between the arms is "
                        "checked without them")
    for role, flat in zip(roles, flats, strict=True):
        varied = replicate_differences([f for f in flat if f])
        if varied:
            warnings.append(f"the {role}'s runs are not replicates of one setting: they differ in {'; '.join(varied)}")
    steps = {str(run.path): len(run.steps) for group in groups for run in group}
    if len(set(steps.values())) > 1:
        warnings.append("the runs have different numbers of steps (" + ", ".join(f"{p}: {n}" for p, n in
                        steps.items()) + "): their slopes and last thirds cover different spans")
    return lines, warnings, flats


# settings that differ between the seeds of one arm without making them different experiments
REPLICATE_KEYS = ("ckpt.", "logger.", "train.seed", "populora.device", "populora.num_threads",
                  "populora.sandbox.workers", "populora.total_steps")  # lengths: the steps warning


def replicate_differences(flats: list[dict[str, Any]]) -> list[str]:
    """The settings, other than the seed and where and how a run was written, whose values differ among one
    arm's runs."""
    keys = sorted(set().union(*flats)) if flats else []
    out = []
    for key in keys:
        if key.startswith(REPLICATE_KEYS):
            continue
        values = {repr(flat.get(key)) for flat in flats}
        if len(values) > 1:
            out.append(f"{key}: {', '.join(sorted(values))}")
    return out


def check_seeds(groups: tuple[list, list]) -> None:
    """No run twice, and within an arm no seed twice: a seeded run repeats exactly on one machine, so such runs
    are copies, not independent seeds."""
    seen: dict[Path, Path] = {}
    for run in (*groups[0], *groups[1]):
        resolved = run.path.resolve()
        if resolved in seen:
            raise InputError(f"{run.path} is given twice: each run must be a different seed")
        seen[resolved] = run.path
    for group in groups:
        seeds: dict[Any, Path] = {}
        for run in group:
            data = run_config(run.path) or {}
            train = data.get("train")
            seed = train.get("seed") if isinstance(train, dict) else None
            if seed is None:
                continue
            if seed in seeds:
                raise InputError(f"{seeds[seed]} and {run.path} have the same train.seed ({seed}): a seeded run "
                                 "repeats on one machine, so they are not independent seeds")
            seeds[seed] = run.path


# the claims about the baseline alone: AZR's collapse under its learnability reward
BASELINE_CLAIMS = ("complexity/baseline_falls", "solve_rate/baseline_rises")


def json_safe(value: Any) -> Any:
    """NaN and infinities become null (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "tolist"):
        return json_safe(value.tolist())
    return value


def write_outputs(out: Path, comparison, smooth: int, header: list[str]) -> None:
    from openrlhf_populora.analysis.signature import comparison_figure, format_markdown

    out.mkdir(parents=True, exist_ok=True)
    markdown = format_markdown(comparison).split("\n", 2)
    markdown.insert(2, "\n".join(f"- {line}" for line in header) + "\n")
    (out / "compare.md").write_text("\n".join(markdown), encoding="utf-8")
    data = json_safe({**comparison.to_dict(), "attribution": header})
    (out / "compare.json").write_text(json.dumps(data, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    comparison_figure(comparison, smooth=smooth).savefig(out / "compare.png", dpi=110)


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
        rules = [flat.get(RULE_KEY) for flat in flats[1]]  # resolved by describe_arm; None when unknown
        known = {rule for rule in rules if rule is not None}
        if known and "learnability" not in known:
            why = (f"the paper predicts the baseline's collapse for AZR's learnability reward; this baseline's is "
                   f"{', '.join(sorted(known))}" + (f" ({rules.count(None)} run(s) without a readable config.yaml)"
                                                     if None in rules else ""))
            comparison.not_predicted = {claim: why for claim in BASELINE_CLAIMS}
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
