"""Matchmaking: which teacher's problems go to which student, per task type, each step.

**Cross-evaluation only.** Teachers' problems are solved by students of the other sub-population, never by
the teacher itself. The one exception is the baseline population (one ``"both"`` member), which plays
itself like AZR: it gets one self-matchup per task type.

**Every member plays every step**, per task type, with balanced load: with ``T`` teachers and ``S`` students
there are ``max(T, S)`` matchups per task type; every member of the larger side plays exactly once and every
member of the smaller side ``floor`` or ``ceil`` of ``max(T, S) / min(T, S)`` times. A pairing is drawn
by visiting the larger side in a random order; each visited member picks a partner among those of the
smaller side with capacity left, with probability proportional to a weight ``w(teacher, student)``:

- ``"pfsp_hard"``: ``w = (1 - x)^p + eps`` with ``x = P[student beats teacher]`` (AlphaStar's f_hard from
  the student's side: students are sent to the teachers they are least likely to beat);
- ``"pfsp_variance"``: ``w = x (1 - x) + eps`` (AlphaStar's f_var: near-balanced matchups, where the
  outcome is most uncertain);
- ``"random"``: ``w = 1`` (uniform);
- ``"round_robin"``: no sampling; in matchup ``j`` (``j < max(T, S)``) teacher ``j mod T`` meets student
  ``(j + step + task_index) mod S``, so the pairing rotates with the step and the task type.

``eps`` (default 1e-3) keeps every pairing possible. Draws are deterministic given the seed.

Because everyone plays, a step's matchups form a balanced assignment, and the game is zero-sum: a pairing
that is hard for one student leaves an easier teacher for another. So ``pfsp_hard`` only tilts the
assignment (in tests, students' mean win probability drops from 0.50 under ``random`` to about 0.47 on a
3 x 3 population with widely spread ratings), while ``pfsp_variance`` pairs like with like much more
strongly. The sequential draw is an approximation of sampling whole assignments by their weights.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from openrlhf_populora.population.members import Population

STRATEGIES = ("pfsp_hard", "pfsp_variance", "random", "round_robin")


@dataclass(frozen=True)
class Matchup:
    """The teacher's problems of ``task_type`` go to the student (member ids)."""

    teacher: str
    student: str
    task_type: str


def pfsp_weight(strategy: str, p_student_wins: float, power: float = 2.0, eps: float = 1e-3) -> float:
    """The PFSP weight of one (teacher, student) pairing; see the module doc."""
    x = min(max(p_student_wins, 0.0), 1.0)
    if strategy == "pfsp_hard":
        return (1.0 - x) ** power + eps
    if strategy == "pfsp_variance":
        return x * (1.0 - x) + eps
    if strategy in ("random", "round_robin"):
        return 1.0
    raise ValueError(f"unknown matchmaking strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")


def _capacities(small: list[str], total: int, rng: random.Random) -> dict[str, int]:
    base, extra = divmod(total, len(small))
    lucky = set(rng.sample(small, extra))
    return {m: base + (m in lucky) for m in small}


def _sample_pairing(teachers: list[str], students: list[str], weight,
                    rng: random.Random) -> list[tuple[str, str]]:
    teachers_larger = len(teachers) >= len(students)
    large, small = (teachers, students) if teachers_larger else (students, teachers)
    capacity = _capacities(small, len(large), rng)
    order = list(large)
    rng.shuffle(order)
    pairs = []
    for picker in order:
        options = [m for m in small if capacity[m] > 0]
        weights = [weight(picker, m) if teachers_larger else weight(m, picker) for m in options]
        partner = rng.choices(options, weights=weights)[0]
        capacity[partner] -= 1
        pairs.append((picker, partner) if teachers_larger else (partner, picker))
    return sorted(pairs, key=lambda pair: (teachers.index(pair[0]), students.index(pair[1])))


def matchmake(population: Population, ratings: Any, task_types: Sequence[str], strategy: str = "pfsp_hard",
              rng_or_seed: random.Random | int = 0, *, step: int = 0, power: float = 2.0,
              eps: float = 1e-3) -> list[Matchup]:
    """Matchups for one step: for each task type (in order), ``max(T, S)`` pairings (see the module doc).

    ``ratings`` is a ``population.ratings.Ratings`` holding every living member (it may be ``None`` for
    ``"random"`` and ``"round_robin"``). ``rng_or_seed`` is a ``random.Random`` (advanced in place) or an int.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown matchmaking strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    if not task_types or len(set(task_types)) != len(task_types):
        raise ValueError(f"task_types must be a non-empty list without duplicates, got {list(task_types)}")
    if len(population) == 0:
        raise ValueError("cannot matchmake an empty population")
    rng = rng_or_seed if isinstance(rng_or_seed, random.Random) else random.Random(rng_or_seed)

    if population.is_baseline:
        (agent,) = population.alive()
        return [Matchup(agent.id, agent.id, task_type) for task_type in task_types]

    teachers = [m.id for m in population.teachers()]
    students = [m.id for m in population.students()]
    if not teachers or not students:
        raise ValueError(f"cross-evaluation needs >= 1 living teacher and student, "
                         f"got {teachers} / {students}")
    if strategy.startswith("pfsp"):
        if ratings is None:
            raise ValueError(f"strategy {strategy!r} needs ratings")
        missing = [m for m in teachers + students if not ratings.has(m)]
        if missing:
            raise ValueError(f"members without a rating: {', '.join(missing)}")

    def weight(teacher: str, student: str) -> float:
        if strategy == "random":
            return 1.0
        return pfsp_weight(strategy, ratings.win_probability(student, teacher), power, eps)

    matchups = []
    for index, task_type in enumerate(task_types):
        if strategy == "round_robin":
            pairs = [(teachers[j % len(teachers)], students[(j + step + index) % len(students)])
                     for j in range(max(len(teachers), len(students)))]
        else:
            pairs = _sample_pairing(teachers, students, weight, rng)
        matchups += [Matchup(t, s, task_type) for t, s in pairs]
    return matchups
