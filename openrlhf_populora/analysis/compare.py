"""Comparing population runs with baseline runs, around the signature's statistics (``signature.py``): reading
and checking the runs (roles, task types, seeds), what else differs between the arms (attribution), the claims a
control does not predict, and the written outputs (``compare.md``, ``compare.json``, ``compare.png``).

``cli/compare.py`` is the command; its help says what the verdicts mean. Bad input raises ``InputError``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from openrlhf_populora.errors import InputError
from openrlhf_populora.metrics.keys import METRICS_FILE, PROBLEMS_FILE

MIN_STEPS = 3
ROLES = ("population", "baseline")
ANY_ROLES = ("A", "B")


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


def mark_unpredicted(comparison, baseline_flats: list[dict[str, Any]]) -> None:
    """Against a control (a baseline on another reward than AZR's learnability one), the claims about the
    baseline's collapse, which the paper predicts for the learnability reward only, are reported but not counted
    (``comparison.not_predicted``). ``baseline_flats``: the baseline runs' settings (``describe_arm``'s)."""
    rules = [flat.get(RULE_KEY) for flat in baseline_flats]  # resolved by describe_arm; None when unknown
    known = {rule for rule in rules if rule is not None}
    if known and "learnability" not in known:
        why = (f"the paper predicts the baseline's collapse for AZR's learnability reward; this baseline's is "
               f"{', '.join(sorted(known))}" + (f" ({rules.count(None)} run(s) without a readable config.yaml)"
                                                 if None in rules else ""))
        comparison.not_predicted = {claim: why for claim in BASELINE_CLAIMS}
