"""Rules of the population package that mutation testing (scripts/mutation.sh) found unguarded: who wins a
tournament, which way a teacher's win moves the ratings, when evolution may fire, and the checks and records
that name what they hold. Each test names the broken implementation it catches."""

from __future__ import annotations

import random

import pytest

from openrlhf_populora.population import (
    EvolutionConfig,
    Population,
    canonical_operator,
    make_ratings,
    should_evolve,
)
from openrlhf_populora.population.selection import _tournament


def test_a_teachers_win_raises_the_teacher_and_lowers_the_student():
    """Mean solve rate 0 < 0.4: the teacher wins one game; between two fresh players the winner goes to
    29.396 and the loser to 20.604. Catches: a teacher win recorded as a draw (or as a student win)."""
    ratings = make_ratings()
    ratings.add("t0")
    ratings.add("s0")
    assert ratings.record_matchup("t0", "s0", [0.0, 0.25]) == ["teacher"]
    assert ratings.mu("t0") == pytest.approx(29.396, abs=1e-3)
    assert ratings.mu("s0") == pytest.approx(20.604, abs=1e-3)


def test_a_tournament_is_won_by_the_best_score():
    """Catches: a tournament that ignores the scores (picks by name)."""
    score = {"a": 3.0, "b": 1.0, "c": 2.0}
    for seed in range(5):
        assert _tournament(list(score), 3, score, random.Random(seed)) == "a"


def test_evolution_never_fires_before_the_first_step():
    """Catches: step >= 0 for step > 0 (an event at step 0, before anyone has played)."""
    cfg = EvolutionConfig(evolve_every=2)
    assert [should_evolve(t, cfg) for t in range(5)] == [False, False, True, False, True]


@pytest.mark.parametrize("change, message", [
    ({"tournament_size": 0}, "evolution.elites must be >= 0 and evolution.tournament_size >= 1"),
    ({"elites": -1}, "evolution.elites must be >= 0 and evolution.tournament_size >= 1"),
    ({"operators": {}}, "evolution.operators must be a non-empty mapping of operator name -> weight"),
    ({"operators": ["gaussian"]}, "evolution.operators must be a non-empty mapping of operator name -> weight"),
    ({"operators": {"gaussian": -1.0}}, r"evolution.operators\['gaussian'\] must be a finite weight >= 0"),
    ({"operators": {"gaussian": 0.0}}, "evolution.operators: at least one operator needs a positive weight"),
])
def test_evolution_config_names_what_is_wrong(change, message):
    """Catches: a check that lets a bad value through (tournament size 1 refused, a list of operators or a
    negative weight accepted) and messages that lose what was wrong."""
    EvolutionConfig(tournament_size=1).validate()  # a tournament of one is a uniform pick: allowed
    cfg = EvolutionConfig()
    for key, value in change.items():
        setattr(cfg, key, value)
    with pytest.raises(ValueError, match=f"^{message}"):
        cfg.validate()


def test_an_unknown_operator_is_refused_with_the_menu():
    with pytest.raises(ValueError, match=r"unknown evolution operator 'M99'; choose from: M1 gaussian, .*X9 "
                                         r"task_arithmetic, copy_parent"):
        canonical_operator("M99")


def test_saved_ratings_and_lineage_keep_their_field_names():
    """population.json and ratings.json are read by other tools (cli.report, resume): catches renamed keys, a
    ratings state without its game count no longer loading, and a missing 'members' list not named."""
    population = Population.create(1, 1)
    ratings = make_ratings()
    for member in population.alive():
        ratings.add(member.id)
    ratings.record_matchup("t0", "s0", [1.0])
    population.snapshot_ratings(ratings)
    t0 = population.get("t0")
    assert set(t0.rating) == {"mu", "sigma", "conservative"}
    assert t0.rating["conservative"] == pytest.approx(t0.rating["mu"] - 3 * t0.rating["sigma"])
    assert population.to_dict()["version"] == 1
    state = ratings.state_dict()
    assert state["games"] == 1
    del state["games"]  # a state written before games were counted
    assert type(ratings).from_state(state).games == 0
    with pytest.raises(ValueError, match="^population JSON must be an object with a 'members' list$"):
        Population.from_dict({"version": 1})
    with pytest.raises(ValueError, match="^add_child needs at least one parent$"):
        ratings.add_child("t9", [])
