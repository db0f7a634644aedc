"""Matchmaking: cross-evaluation, every member plays, balanced load, PFSP preferences, determinism."""

import random
from collections import Counter

import pytest

from openrlhf_populora.population import STRATEGIES, Population, make_ratings, matchmake, pfsp_weight

TASKS = ["code_o", "code_i", "code_f"]


def _rated(teachers, students, mus=None):
    population = Population.create(teachers, students)
    ratings = make_ratings()
    for member in population.alive():
        ratings.add(member.id, mu=(mus or {}).get(member.id), sigma=2.0)
    return population, ratings


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("teachers,students", [(1, 1), (4, 4), (8, 8), (3, 5), (5, 2), (1, 4)])
def test_every_member_plays_every_task_type_with_balanced_load(strategy, teachers, students):
    population, ratings = _rated(teachers, students)
    matchups = matchmake(population, ratings, TASKS, strategy, 0, step=3)
    assert len(matchups) == len(TASKS) * max(teachers, students)
    for task_type in TASKS:
        games = [m for m in matchups if m.task_type == task_type]
        t_load = Counter(m.teacher for m in games)
        s_load = Counter(m.student for m in games)
        assert set(t_load) == {m.id for m in population.teachers()}
        assert set(s_load) == {m.id for m in population.students()}
        assert max(t_load.values()) - min(t_load.values()) <= 1
        assert max(s_load.values()) - min(s_load.values()) <= 1
        assert len({(m.teacher, m.student) for m in games}) == len(games)
    # cross-evaluation only: teachers never solve, students never teach
    assert all(m.teacher.startswith("t") and m.student.startswith("s") for m in matchups)


@pytest.mark.parametrize("strategy", ["pfsp_hard", "pfsp_variance", "random"])
def test_deterministic_under_a_seed(strategy):
    population, ratings = _rated(4, 4, {"t0": 30.0, "s1": 20.0})
    first = matchmake(population, ratings, TASKS, strategy, 123)
    assert first == matchmake(population, ratings, TASKS, strategy, random.Random(123))
    draws = {tuple(matchmake(population, ratings, TASKS, strategy, seed)) for seed in range(20)}
    assert len(draws) > 1  # the seed matters


def _pairing_frequency(strategy, trials=400):
    # t0 ~ s0 and t1 ~ s1 are balanced; the cross pairings are lopsided (t0 much stronger than s1,
    # s0 much stronger than t1)
    population, ratings = _rated(2, 2, {"t0": 35.0, "s0": 35.0, "t1": 15.0, "s1": 15.0})
    rng = random.Random(0)
    balanced = 0
    for _ in range(trials):
        pairs = {(m.teacher, m.student) for m in matchmake(population, ratings, ["code_o"], strategy, rng)}
        balanced += pairs == {("t0", "s0"), ("t1", "s1")}
    return balanced / trials


def test_pfsp_variance_prefers_balanced_matchups():
    assert _pairing_frequency("pfsp_variance") > 0.9
    assert 0.35 < _pairing_frequency("random") < 0.65


def _mean_over_draws(strategy, stat, draws=1500):
    mus = {"t0": 40.0, "t1": 25.0, "t2": 10.0, "s0": 40.0, "s1": 25.0, "s2": 10.0}
    population, ratings = _rated(3, 3, mus)
    rng = random.Random(7)
    values = [stat(ratings.win_probability(m.student, m.teacher))
              for _ in range(draws) for m in matchmake(population, ratings, ["code_o"], strategy, rng)]
    return sum(values) / len(values)


def test_pfsp_hard_makes_matchups_harder_for_students_than_random():
    def student_wins(x):
        return x

    assert _mean_over_draws("random", student_wins) == pytest.approx(0.5, abs=0.02)
    assert _mean_over_draws("pfsp_hard", student_wins) < _mean_over_draws("random", student_wins) - 0.02


def test_pfsp_variance_maximises_outcome_uncertainty():
    def uncertainty(x):
        return x * (1 - x)

    variance = _mean_over_draws("pfsp_variance", uncertainty)
    assert variance > _mean_over_draws("random", uncertainty) + 0.05
    assert variance > _mean_over_draws("pfsp_hard", uncertainty) + 0.05


def test_pfsp_weights():
    assert pfsp_weight("pfsp_hard", 0.0) > pfsp_weight("pfsp_hard", 0.5) > pfsp_weight("pfsp_hard", 1.0)
    assert pfsp_weight("pfsp_variance", 0.5) > pfsp_weight("pfsp_variance", 0.1)
    assert pfsp_weight("pfsp_variance", 0.1) == pytest.approx(pfsp_weight("pfsp_variance", 0.9))
    assert pfsp_weight("pfsp_hard", 1.0) > 0  # eps keeps every pairing possible


def test_round_robin_rotates_with_the_step():
    population, ratings = _rated(3, 3)
    seen = set()
    for step in range(3):
        matchups = matchmake(population, None, ["code_o"], "round_robin", 0, step=step)
        seen |= {(m.teacher, m.student) for m in matchups}
    assert len(seen) == 9  # every teacher met every student in 3 steps


def test_baseline_plays_itself():
    population = Population.baseline()
    matchups = matchmake(population, None, TASKS, "pfsp_hard", 0)
    assert [(m.teacher, m.student, m.task_type) for m in matchups] == [("b0", "b0", t) for t in TASKS]


def test_bad_input():
    population, ratings = _rated(2, 2)
    with pytest.raises(ValueError, match="strategy"):
        matchmake(population, ratings, TASKS, "swiss", 0)
    with pytest.raises(ValueError, match="task_types"):
        matchmake(population, ratings, [], "random", 0)
    with pytest.raises(ValueError, match="needs ratings"):
        matchmake(population, None, TASKS, "pfsp_hard", 0)
    with pytest.raises(ValueError, match="empty"):
        matchmake(Population(), ratings, TASKS, "random", 0)
    partial = make_ratings()
    partial.add("t0")
    with pytest.raises(ValueError, match="without a rating"):
        matchmake(population, partial, TASKS, "pfsp_variance", 0)


def test_pfsp_weights_clamp_the_probability_and_are_uniform_for_random():
    """Catches: a clamp that lets a probability above 1 through, and a non-unit weight for random and round
    robin pairing."""
    from openrlhf_populora.population import pfsp_weight

    assert pfsp_weight("pfsp_hard", 1.5) == pfsp_weight("pfsp_hard", 1.0) == pytest.approx(1e-3)
    assert pfsp_weight("random", 0.3) == pfsp_weight("round_robin", 0.9) == 1.0
