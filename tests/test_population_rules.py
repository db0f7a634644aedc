"""Rules of the population package that mutation testing (scripts/mutation.sh) found unguarded: who wins a
tournament, which way a teacher's win moves the ratings, when evolution may fire, and the checks and records
that name what they hold. Each test names the broken implementation it catches."""

from __future__ import annotations

import random

import pytest

from openrlhf_populora.population import (
    EvolutionConfig,
    OperatorParams,
    Population,
    canonical_operator,
    make_ratings,
    operator_params,
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
                                         r"task_arithmetic, copy_parent, linear_0_5$"):
        canonical_operator("M99")


@pytest.mark.parametrize("field, value, message", [
    ("sv_splice_top", 2.5, "evolution.params.sv_splice_top must be an integer, got 2.5"),
    ("sv_splice_top", True, "evolution.params.sv_splice_top must be an integer, got True"),
    ("sv_splice_top", -1, r"evolution.params.sv_splice_top must be in \[0, inf\), got -1"),
    ("slerp_t", 1.5, r"evolution.params.slerp_t must be in \[0, 1\], got 1.5"),
])
def test_operator_parameters_are_checked_even_where_the_default_is_none(field, value, message):
    """Catches: the integer check skipped (a float or a bool taken as a component count), and a parameter whose
    default is None (chosen at run time) never checked once it is set."""
    OperatorParams(sv_splice_top=3, slerp_t=0.5).validate()
    with pytest.raises(ValueError, match=f"^{message}$"):
        OperatorParams(**{field: value}).validate()


def test_an_operator_without_parameters_says_so():
    with pytest.raises(ValueError, match=r"^operator 'svd_mean' takes no parameters, got \['x'\]$"):
        operator_params("svd_mean", {"x": 1})


def test_openskill_gets_the_configured_tau():
    """Catches: the OpenSkill model built without tau (its own default, mu / 300, only equals ours at the
    default sigma)."""
    pytest.importorskip("openskill")
    assert make_ratings("openskill", tau=0.5)._model.tau == 0.5


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


def test_a_mean_solve_rate_on_the_margin_is_a_draw():
    """With draw_margin 0.25 the student wins above 0.75 and the teacher below 0.25; exactly 0.75 or 0.25 is a
    draw. Catches: >= for > (a student win on the margin)."""
    from openrlhf_populora.population import outcomes_from_solve_rates

    assert outcomes_from_solve_rates([0.75], draw_margin=0.25) == ["draw"]
    assert outcomes_from_solve_rates([0.25], draw_margin=0.25) == ["draw"]
    assert outcomes_from_solve_rates([0.8], draw_margin=0.25) == ["student"]
    with pytest.raises(ValueError, match=r"^draw_margin must be in \[0, 0.5\), got 0.5$"):
        outcomes_from_solve_rates([0.5], draw_margin=0.5)


def test_rating_parameters_are_checked_one_by_one():
    """Catches: sigma <= 0 accepted unless beta is also bad, a beta below 1 refused, and a draw probability of 0
    (TrueSkill without draws) refused."""
    with pytest.raises(ValueError, match="sigma > 0"):
        make_ratings(sigma=0.0)
    make_ratings(beta=0.5)
    make_ratings(draw_probability=0.0)


def test_rating_history_entries_hold_mu_sigma_and_the_conservative_score():
    ratings = make_ratings()
    ratings.add("t0", step=3)
    (entry,) = ratings.history["t0"]
    assert entry == {"step": 3, "mu": 25.0, "sigma": 25.0 / 3.0, "conservative": pytest.approx(0.0)}


def test_pfsp_weights_clamp_the_probability_and_are_uniform_for_random():
    """Catches: a clamp that lets a probability above 1 through, and a non-unit weight for random and round
    robin pairing."""
    from openrlhf_populora.population import pfsp_weight

    assert pfsp_weight("pfsp_hard", 1.5) == pfsp_weight("pfsp_hard", 1.0) == pytest.approx(1e-3)
    assert pfsp_weight("random", 0.3) == pfsp_weight("round_robin", 0.9) == 1.0


def test_a_population_reads_as_its_living_members():
    assert "t0@t0, s0@s0" in repr(Population.create(1, 1))
