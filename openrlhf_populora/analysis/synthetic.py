"""Synthetic run directories in the tracker's schema, for tests and the report's ``--synthetic`` smoke mode.

The numbers only imitate the paper's qualitative picture (baseline: solve rate up, complexity down;
population: solve rates oscillating with a period of 7 steps, rising complexity, inputs growing with the
step so coverage keeps expanding, members replaced by evolution).
They are written through ``Tracker``, so they exercise the real schema.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np

from openrlhf_populora.metrics.complexity import program_complexity
from openrlhf_populora.metrics.keys import (
    COMPLEXITY_AXES,
    METRICS_FILE,
    PROBLEMS_FILE,
    complexity_key,
    coverage_key,
    learning_key,
    matchup_key,
    matrix_key,
    member_key,
    rating_key,
    time_key,
    train_key,
)
from openrlhf_populora.metrics.tracker import Tracker

TASK_TYPES = ("code_o", "code_i", "code_f")


def synthetic_program(level: int, rng: random.Random) -> str:
    """A valid program whose size grows with ``level`` (0 = trivial)."""
    lines = ["def f(x):"]
    body = ["    y = x"]
    for i in range(level):
        kind = rng.choice(("if", "for", "expr"))
        if kind == "if":
            body += [f"    if y > {rng.randint(0, 9)}:", f"        y = y - {i + 1}"]
        elif kind == "for":
            body += [f"    for i in range({rng.randint(1, 4)}):", f"        y += i * {i + 1}"]
        else:
            body += [f"    y = (y * {rng.randint(2, 5)}) % {rng.randint(7, 97)}"]
    return "\n".join(lines + body + ["    return y", ""])


def _clip(x: float, lo: float = 0.0, hi: float = 1.0) -> float:
    return max(lo, min(hi, x))


def write_synthetic_run(run_dir: str | Path, mode: str = "population", steps: int = 30, num_teachers: int = 3,
                        num_students: int = 3, evolve_every: int = 10, problems_per_step: int = 4,
                        task_types: tuple[str, ...] = TASK_TYPES, seed: int = 0, truncate: bool = False,
                        label: str | None = None) -> Path:
    """Write a run directory (``metrics.jsonl``, ``problems.jsonl``, ``events.jsonl``, ``run_meta.json``).

    ``mode="baseline"``: one member ``b0`` logging as teacher and student, no ratings or matrix.
    ``mode="population"``: teachers ``t*`` and students ``s*``; every ``evolve_every`` steps the lowest-rated
    teacher and student are replaced by children with new ids (evolution events). ``truncate``: end
    ``metrics.jsonl`` and ``problems.jsonl`` with a half-written line, as a crash would.
    """
    if mode not in ("population", "baseline"):
        raise ValueError(f"mode must be 'population' or 'baseline', got {mode!r}")
    rng = random.Random(seed)
    run_dir = Path(run_dir)
    baseline = mode == "baseline"
    teachers = ["b0"] if baseline else [f"t{i}" for i in range(num_teachers)]
    students = ["b0"] if baseline else [f"s{i}" for i in range(num_students)]
    next_id = {"teacher": len(teachers), "student": len(students)}
    mu = {("teacher", m): 25.0 for m in teachers} | {("student", m): 25.0 for m in students}
    coverage, distinct = 0.0, 0
    meta = {"label": label or run_dir.name, "mode": mode, "synthetic": True}
    with Tracker(run_dir, meta=meta) as tracker:
        for step in range(1, steps + 1):
            frac = step / steps
            if baseline:
                solve_base, level = 0.55 + 0.4 * frac, max(1, round(5 - 4 * frac))
            else:
                solve_base, level = 0.45 + 0.2 * math.sin(2 * math.pi * step / 7), 2 + round(6 * frac)
            m: dict[str, float] = {}
            student_rates, teacher_valid = {}, {}
            for s in students:
                rates = {tt: _clip(solve_base + rng.gauss(0, 0.06)) for tt in task_types}
                student_rates[s] = rates
                for tt, r in rates.items():
                    m[member_key(s, "student", "solve_rate", tt)] = r
                m[member_key(s, "student", "solve_rate")] = sum(rates.values()) / len(rates)
                m[member_key(s, "student", "format_rate")] = _clip(0.9 + rng.gauss(0, 0.03))
                m[member_key(s, "student", "student_response_length")] = 300 + (800 * frac if not baseline
                                                                                else -100 * frac) + rng.gauss(0, 20)
            for t in teachers:
                valid = {tt: _clip(0.7 + 0.2 * frac + rng.gauss(0, 0.05)) for tt in task_types}
                teacher_valid[t] = valid
                for tt, v in valid.items():
                    m[member_key(t, "teacher", "validity", tt)] = v
                m[member_key(t, "teacher", "validity")] = sum(valid.values()) / len(valid)
                m[member_key(t, "teacher", "difficulty")] = _clip(1 - solve_base + rng.gauss(0, 0.05))
                for axis, scale in zip(COMPLEXITY_AXES, (1.0, 8.0, 0.8, 1.5, 20.0), strict=True):
                    m[member_key(t, "teacher", axis)] = max(0.0, scale * (level + 2) + rng.gauss(0, scale * 0.3))
                m[member_key(t, "teacher", "coverage")] = coverage / max(1, len(teachers)) * rng.uniform(0.8, 1.2)
            # how far each member moved from the base (no draws from rng: the other series stay as they were)
            for k, (member, role) in enumerate([(s, "student") for s in students] + [(t, "teacher") for t in teachers]):
                m[member_key(member, role, "update_size")] = 0.004 * frac * (1 + 0.1 * k)
                m[member_key(member, role, "probe_kl")] = 0.05 * frac * (1 + 0.1 * k)
            m[learning_key("update_size")] = 0.004 * frac
            for metric, role_rates in (("solve_rate", student_rates), ("validity", teacher_valid)):
                for tt in task_types:
                    m[train_key(metric, tt)] = sum(r[tt] for r in role_rates.values()) / len(role_rates)
            m[train_key("solve_rate")] = sum(m[member_key(s, "student", "solve_rate")] for s in students) / len(students)
            m[train_key("format_rate")] = sum(m[member_key(s, "student", "format_rate")]
                                              for s in students) / len(students)
            m[train_key("validity")] = sum(m[member_key(t, "teacher", "validity")] for t in teachers) / len(teachers)
            m[train_key("difficulty")] = 1 - m[train_key("solve_rate")]
            m[train_key("teacher_reward")] = m[train_key("difficulty")] * m[train_key("validity")]
            m[train_key("student_response_length")] = sum(
                m[member_key(s, "student", "student_response_length")] for s in students) / len(students)
            m[train_key("teacher_response_length")] = 200 + 100 * level + rng.gauss(0, 10)
            for axis in COMPLEXITY_AXES:
                m[complexity_key(axis)] = sum(m[member_key(t, "teacher", axis)] for t in teachers) / len(teachers)
            m[train_key("policy_loss")] = rng.gauss(0, 0.05)
            m[train_key("grad_norm")] = abs(rng.gauss(1.0, 0.3))
            m[train_key("entropy")] = 0.8 - 0.3 * frac + rng.gauss(0, 0.02)
            m[train_key("lr")] = 1e-6
            if step % 7 == 0:  # missing values happen (e.g. a skipped update): the report must cope
                m[train_key("grad_norm")] = float("nan")
            growth = 0.004 if baseline else 0.012
            new = rng.randint(0, 3) if baseline and frac > 0.5 else rng.randint(2, 8)
            coverage = min(1.0, coverage + growth * new / 4)
            distinct += new
            m[coverage_key("overall")] = coverage
            m[coverage_key("distinct_programs")] = float(distinct)
            m[coverage_key("num_programs")] = float(step * problems_per_step * len(teachers))
            m[coverage_key("diversity")] = 1.0 + 400 * coverage
            m[coverage_key("new_cells")] = float(new)
            for phase, seconds in (("generate_propose", 4.0), ("execute_check", 0.5), ("generate_solve", 6.0),
                                   ("execute_verify", 0.8), ("train", 3.0), ("evolve", 0.0)):
                m[time_key(phase)] = seconds * (len(teachers) + len(students)) / 2 * rng.uniform(0.9, 1.1)
            if not baseline:
                lead = math.sin(step / 2.5)
                m[matchup_key("student_win_rate")] = _clip(0.5 + 0.3 * lead)
                m[matchup_key("teacher_win_rate")] = 1 - m[matchup_key("student_win_rate")]
                m[matchup_key("count")] = float(len(students) * len(task_types))
                for (role, member), value in mu.items():
                    mu[(role, member)] = value + rng.gauss(0, 0.6)
                    m[rating_key(member, role, "mu")] = mu[(role, member)]
                    m[rating_key(member, role, "sigma")] = 8.33 * math.exp(-step / 20) + 1
                for t in teachers:
                    for s in students:
                        m[matrix_key(t, s)] = _clip(sum(student_rates[s].values()) / len(task_types)
                                                    + rng.gauss(0, 0.1))
            tracker.log(step, m)
            problems = []
            for t in teachers:
                for _ in range(problems_per_step):
                    tt = rng.choice(task_types)
                    code = synthetic_program(max(0, level + rng.randint(-1, 1)), rng)
                    # the population's inputs and outputs grow with the step: its programs keep reaching new cells
                    inputs = [str(rng.randint(0, 50)) * (1 if baseline else step * step)]
                    outputs = ["0" * (1 if baseline else step * len(teachers))]
                    record = {"teacher": t, "task_type": tt, "program": code, "inputs": inputs,
                              "outputs": outputs, "valid": rng.random() < 0.85, "reward": rng.random()}
                    if rng.random() < 0.5:  # older runs may lack precomputed complexity
                        record["complexity"] = program_complexity(code)
                    problems.append(record)
            tracker.log_problems(step, problems)
            if not baseline and evolve_every > 0 and step % evolve_every == 0 and step < steps:
                for role, pool in (("teacher", teachers), ("student", students)):
                    weakest = min(pool, key=lambda x, r=role: mu[(r, x)])
                    parents = sorted(pool, key=lambda x, r=role: -mu[(r, x)])[:2]
                    child = f"{role[0]}{next_id[role]}"
                    next_id[role] += 1
                    pool[pool.index(weakest)] = child
                    mu[(role, child)] = sum(mu[(role, p)] for p in parents) / 2
                    del mu[(role, weakest)]
                    operator = rng.choice(("M1", "M3", "X2", "X5"))
                    tracker.log_event(step, {
                        "kind": "evolution", "replaced": weakest, "child": child, "role": role,
                        "parents": parents[:1] if operator.startswith("M") else parents, "operator": operator,
                        "truncation_energy": round(rng.uniform(0.9, 1.0), 3)})
    if truncate:
        for name in (METRICS_FILE, PROBLEMS_FILE):
            with open(run_dir / name, "a", encoding="utf-8") as f:
                f.write(f'{{"step": {steps + 1}, "train/solve_rate": 0.5, "train/vali')
    return run_dir


# --- series for calibrating cli.compare's verdicts (benchmarks/compare_calibration.py, its CI test) ------------
#
# Each draw makes the arrays the signature's statistics read (``signature.ArmSeries``) for a population and a
# baseline arm, one or more seeds each. Noise has unit stationary standard deviation; a step's programs fall in
# CVT cells ``floor(Exponential(scale))``, so cells keep being found ever more slowly, and a larger scale
# spreads programs over more cells. The population proposes ``POPULATION_TEACHERS`` times as many programs a
# step as the baseline, as a 2-teacher population does.

NULLS = ("iid", "ar0.5", "ar0.8", "ar0.95", "random_walk", "saturating", "same_signal")
PLANTED = "planted"
BASELINE_PROGRAMS = 6  # valid programs a step (the committed CPU baseline made 5.4)
POPULATION_TEACHERS = 2
CELL_SCALE = 3.0
# the planted signature, in units of the noise's standard deviation (results/compare-calibration/README.md)
PLANTED_CHANGE = 3.0  # complexity: total change over the run (population up, baseline down)
PLANTED_AMPLITUDE = 2.0  # solve-rate oscillation amplitude, period n / 4
PLANTED_CELL_RATIO = 1.5  # population cell scale / baseline's (coverage at equal programs)


def red_noise(phi: float, n: int, rng) -> np.ndarray:
    """AR(1) noise with unit stationary standard deviation (``phi`` 0: white noise)."""
    from openrlhf_populora.analysis.signature_stats import ar1_series

    return ar1_series(phi, n, 1, rng)[:, 0] * np.sqrt(1 - phi * phi)


def noise_series(kind: str, n: int, rng) -> np.ndarray:
    """A null's noise: ``iid``, ``ar<phi>``, ``random_walk`` (unit steps); anything else: AR(1) phi 0.5."""
    if kind == "iid":
        return rng.standard_normal(n)
    if kind == "random_walk":
        return np.cumsum(rng.standard_normal(n))
    if kind.startswith("ar"):
        return red_noise(float(kind[2:]), n, rng)
    return red_noise(0.5, n, rng)


def synthetic_arm(label: str, n: int, composite, solve_rate, programs_per_step: int, cell_scale, rng):
    """An ``ArmSeries`` of ``n`` steps; ``cell_scale`` is a number or one per step."""
    from openrlhf_populora.analysis.signature import ArmSeries

    steps = np.arange(1, n + 1)
    scales = np.broadcast_to(np.asarray(cell_scale, dtype=float), (n,))
    program_steps = np.repeat(steps, programs_per_step)
    cells = np.floor(rng.exponential(np.repeat(scales, programs_per_step))).astype(np.int64)
    return ArmSeries(label, steps, np.asarray(composite, float), 0.3 + 0.05 * np.asarray(solve_rate, float),
                     0.5 + 0.05 * noise_series("iid", n, rng), {}, program_steps, cells)


def calibration_arms(kind: str, n: int, seeds: int, rng) -> tuple[list, list]:
    """``(population, baseline)`` lists of ``seeds`` ArmSeries each, for a null of ``NULLS`` or ``PLANTED``.

    Nulls: both arms' series are the named noise (``saturating``: the population's rise ``3 (1 - exp(-6 t/n))``
    and level off, the baseline's rise linearly by as much; ``same_signal``: both arms rise by
    ``PLANTED_CHANGE``, oscillate by ``PLANTED_AMPLITUDE`` and keep finding cells alike), with the same
    coverage process. ``PLANTED``: the population's complexity rises and the baseline's falls by
    ``PLANTED_CHANGE``, the population's solve rate oscillates by ``PLANTED_AMPLITUDE`` while the baseline's
    rises by ``PLANTED_CHANGE``, and the population's programs spread over ``PLANTED_CELL_RATIO`` times the
    cell scale, growing to twice that by the end (still adding), noise AR(1) phi 0.5."""
    t = np.arange(n) / (n - 1)
    wave = PLANTED_AMPLITUDE * np.sin(2 * np.pi * np.arange(n) / (n / 4))
    many = BASELINE_PROGRAMS * POPULATION_TEACHERS
    arms: tuple[list, list] = ([], [])
    for seed in range(seeds):
        noise = [noise_series(kind, n, rng) for _ in range(4)]
        if kind == PLANTED:
            pop = (PLANTED_CHANGE * t + noise[0], wave + noise[1], CELL_SCALE * PLANTED_CELL_RATIO * (1 + t))
            base = (-PLANTED_CHANGE * t + noise[2], PLANTED_CHANGE * t + noise[3], CELL_SCALE)
        elif kind == "saturating":
            rise = 3.0 * (1 - np.exp(-6 * t))
            pop = (rise + noise[0], rise + noise[1], CELL_SCALE)
            base = (3.0 * t + noise[2], 3.0 * t + noise[3], CELL_SCALE)
        elif kind == "same_signal":
            pop = (PLANTED_CHANGE * t + noise[0], wave + noise[1], CELL_SCALE * (1 + t))
            base = (PLANTED_CHANGE * t + noise[2], wave + noise[3], CELL_SCALE * (1 + t))
        else:
            pop, base = (noise[0], noise[1], CELL_SCALE), (noise[2], noise[3], CELL_SCALE)
        arms[0].append(synthetic_arm(f"population-{seed}", n, *pop[:2], many, pop[2], rng))
        arms[1].append(synthetic_arm(f"baseline-{seed}", n, *base[:2], BASELINE_PROGRAMS, base[2], rng))
    return arms


def false_claims(kind: str) -> tuple[str, ...]:
    """The claims (``signature.CLAIMS``) that are false under a null: a "holds" on one is a false positive."""
    from openrlhf_populora.analysis.signature import CLAIMS

    true = {"saturating": {"complexity/population_rises", "solve_rate/baseline_rises"},
            "same_signal": {"complexity/population_rises", "solve_rate/baseline_rises"}}.get(kind, set())
    return tuple(c for c in CLAIMS if c not in true)
