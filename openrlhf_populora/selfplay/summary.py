"""Turn one step's output into the tracker's records (schema: ``metrics/keys.py``).

``step_metrics`` gives the flat ``metrics.jsonl`` record: population means (``train/...``), the same per task
type and per member, complexity, coverage, matchups, ratings, the teacher x student solve-rate matrix,
training diagnostics and phase timings. ``problem_records`` gives the per-step problem archive.
"""

from __future__ import annotations

from collections import defaultdict
from statistics import fmean
from typing import Any

from openrlhf_populora.metrics.keys import (
    ALL,
    COMPLEXITY_AXES,
    SYNC_DIAGNOSTIC,
    SYNC_KEY,
    complexity_key,
    learning_key,
    matchup_key,
    matrix_key,
    member_key,
    rating_key,
    time_key,
    train_key,
)

_DIAGNOSTICS = {"loss": "policy_loss", "grad_norm": "grad_norm", "entropy": "entropy", "kl": "kl", "lr": "lr"}


def _mean(values: list[float]) -> float | None:
    return fmean(values) if values else None


def _student_stats(attempts: list[Any]) -> dict[str, float | None]:
    return {
        "solve_rate": _mean([float(a.verdict.correct) for a in attempts]),
        "format_rate": _mean([float(a.verdict.format_ok) for a in attempts]),
        "student_reward": _mean([a.reward for a in attempts]),
        "student_response_length": _mean([float(len(a.completion.response_ids)) for a in attempts]),
    }


def _teacher_stats(proposals: list[Any]) -> dict[str, float | None]:
    rated = [pr for pr in proposals if pr.check.valid and pr.solve_rates]
    return {
        "validity": _mean([float(pr.check.valid) for pr in proposals]),
        "difficulty": _mean([1.0 - fmean(pr.solve_rates.values()) for pr in rated]),
        "teacher_reward": _mean([pr.reward for pr in proposals]),
        "teacher_response_length": _mean([float(len(pr.completion.response_ids)) for pr in proposals]),
    }


def _complexity(proposals: list[Any]) -> dict[str, float | None]:
    valid = [pr.complexity for pr in proposals if pr.check.valid and pr.complexity]
    return {axis: _mean([c[axis] for c in valid if isinstance(c.get(axis), (int, float))])
            for axis in COMPLEXITY_AXES}


def step_metrics(loop: Any, output: Any) -> dict[str, Any]:
    """The ``metrics.jsonl`` record of one step (``None`` values mean "not measured this step")."""
    out: dict[str, Any] = {}
    task_types = list(loop.p.task_types)
    population = loop.population

    # population means, overall and per task type
    for tt in [ALL, *task_types]:
        attempts = [a for a in output.attempts if tt == ALL or a.task.task_type == tt]
        proposals = [pr for pr in output.proposals if tt == ALL or pr.task_type == tt]
        for name, value in {**_student_stats(attempts), **_teacher_stats(proposals)}.items():
            out[train_key(name, tt)] = value
        for axis, value in _complexity(proposals).items():
            out[complexity_key(axis, tt)] = value

    # per member and task type: every member that played this step, one that evolution has since replaced included
    played = {pr.teacher for pr in output.proposals} | {a.student for a in output.attempts}
    replaced = [population.get(i) for i in sorted(played) if not population.get(i).alive]
    for member in [*population.alive(), *replaced]:
        for tt in [ALL, *task_types]:
            if member.teaches:
                mine = [pr for pr in output.proposals if pr.teacher == member.id and (tt == ALL or pr.task_type == tt)]
                if mine:
                    for name, value in {**_teacher_stats(mine), **_complexity(mine)}.items():
                        out[member_key(member.id, "teacher", name, tt)] = value
            if member.solves:
                mine = [a for a in output.attempts if a.student == member.id and (tt == ALL or a.task.task_type == tt)]
                if mine:
                    for name, value in _student_stats(mine).items():
                        out[member_key(member.id, "student", name, tt)] = value

    # training diagnostics: per member that trained (evolution may since have put a child in its adapter slot),
    # under the role it trained in, and their mean
    per_metric: dict[str, list[float]] = defaultdict(list)
    for adapter, stats in output.train_stats.items():
        member = population.get(output.trained[adapter])
        role = "student" if member.role == "student" else "teacher"
        for source, name in _DIAGNOSTICS.items():
            if isinstance(stats.get(source), (int, float)):
                out[member_key(member.id, role, name)] = float(stats[source])
                per_metric[name].append(float(stats[source]))
    for name, values in per_metric.items():
        out[train_key(name)] = fmean(values)
    # the Ray engine's sync proof: vLLM against the trainer after each adapter's upload
    syncs = {adapter: float(stats[SYNC_DIAGNOSTIC]) for adapter, stats in output.train_stats.items()
             if isinstance(stats.get(SYNC_DIAGNOSTIC), (int, float))}
    for adapter, value in syncs.items():
        member = population.get(output.trained[adapter])
        out[member_key(member.id, "student" if member.role == "student" else "teacher", SYNC_DIAGNOSTIC)] = value
    if syncs:
        out[SYNC_KEY] = max(syncs.values())
        out[time_key("sync_probe")] = sum(float(stats.get("sync_seconds", 0.0)) for stats in output.train_stats.values())

    # how far each member has moved from the base, and the mean over members (a baseline member counts once,
    # with its probe KL averaged over its two roles)
    learning: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (member_id, role), values in output.learning.items():
        for name, value in values.items():
            out[member_key(member_id, role, name)] = value
            learning[name][member_id].append(value)
    for name, per_member in learning.items():
        out[learning_key(name)] = fmean(fmean(v) for v in per_member.values())

    # coverage (cumulative archive) and ratings
    out.update(loop.archive.metrics([m.id for m in population.teachers()]))
    if not loop.baseline:
        for member in population.alive():
            if loop.ratings.has(member.id):
                out[rating_key(member.id, member.role, "mu")] = loop.ratings.mu(member.id)
                out[rating_key(member.id, member.role, "sigma")] = loop.ratings.sigma(member.id)
        games = output.games
        out[matchup_key("count")] = float(len(games))
        if games:
            for outcome, key in (("student", "student_win_rate"), ("teacher", "teacher_win_rate"),
                                 ("draw", "draw_rate")):
                out[matchup_key(key)] = games.count(outcome) / len(games)

    # teacher x student solve-rate matrix (valid problems of the matchup)
    cells: dict[tuple[str, str], list[float]] = defaultdict(list)
    for pr in output.proposals:
        for student, rate in pr.solve_rates.items():
            cells[(pr.teacher, student)].append(rate)
    for (teacher, student), rates in cells.items():
        if teacher != student:
            out[matrix_key(teacher, student)] = fmean(rates)

    out["population/num_teachers"] = float(len(population.teachers()))
    out["population/num_students"] = float(len(population.students()))
    for phase, seconds in output.timings.items():
        out[time_key(phase)] = seconds
    return out


def problem_records(output: Any) -> list[dict[str, Any]]:
    """One record per proposal (valid or not) with its verdicts: the per-step problem archive."""
    records = []
    for pr in output.proposals:
        task = pr.check.task
        records.append({
            "teacher": pr.teacher,
            "task_type": pr.task_type,
            "valid": bool(pr.check.valid),
            "reason": pr.check.reason,
            "program": task.program if task else None,
            "inputs": task.inputs if task else None,
            "outputs": task.outputs if task else None,
            "message": task.message if task else None,
            "solve_rates": dict(pr.solve_rates),
            "reward": pr.reward,
            "complexity": pr.complexity or None,
            "completion": pr.completion.text,
        })
    return records
