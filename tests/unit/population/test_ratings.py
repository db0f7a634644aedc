"""Ratings: TrueSkill against hand-computed updates, OpenSkill, games from solve rates, history, JSON."""

import math
from statistics import NormalDist

import pytest

from openrlhf_populora.population import Population, Ratings, make_ratings, outcomes_from_solve_rates

_N = NormalDist()


def _hand_trueskill(winner, loser, drawn, beta, tau, draw_probability):
    """The closed-form 1-vs-1 TrueSkill update (Herbrich et al. 2007), dynamics tau applied first."""
    (mu_w, s_w), (mu_l, s_l) = winner, loser
    var_w, var_l = s_w**2 + tau**2, s_l**2 + tau**2
    c = math.sqrt(2 * beta**2 + var_w + var_l)
    eps = _N.inv_cdf((draw_probability + 1) / 2) * math.sqrt(2) * beta
    t, a = (mu_w - mu_l) / c, eps / c
    if not drawn:
        v = _N.pdf(t - a) / _N.cdf(t - a)
        wf = v * (v + t - a)
    else:
        denom = _N.cdf(a - t) - _N.cdf(-a - t)
        v = (_N.pdf(-a - t) - _N.pdf(a - t)) / denom
        wf = v**2 + ((a - t) * _N.pdf(a - t) + (a + t) * _N.pdf(a + t)) / denom
    new_w = (mu_w + var_w / c * v, math.sqrt(var_w * (1 - var_w / c**2 * wf)))
    new_l = (mu_l - var_l / c * v, math.sqrt(var_l * (1 - var_l / c**2 * wf)))
    return new_w, new_l


@pytest.mark.parametrize("drawn", [False, True])
def test_trueskill_matches_hand_computed_update(drawn):
    ratings = make_ratings("trueskill")
    ratings.add("t0", mu=29.0, sigma=6.0)
    ratings.add("s0", mu=23.0, sigma=4.0)
    p = ratings.params
    (mu_w, s_w), (mu_l, s_l) = _hand_trueskill((29.0, 6.0), (23.0, 4.0), drawn, p["beta"], p["tau"],
                                               p["draw_probability"])
    ratings.record_game("t0", "s0", drawn=drawn, step=1)
    assert ratings.mu("t0") == pytest.approx(mu_w, rel=1e-6)
    assert ratings.sigma("t0") == pytest.approx(s_w, rel=1e-6)
    assert ratings.mu("s0") == pytest.approx(mu_l, rel=1e-6)
    assert ratings.sigma("s0") == pytest.approx(s_l, rel=1e-6)
    assert ratings.conservative("t0") == pytest.approx(mu_w - 3 * s_w)


def test_trueskill_default_prior_first_game():
    # the textbook example: two fresh players, one win -> mu 29.396 / 20.604, sigma 7.171
    ratings = make_ratings()
    ratings.add("a")
    ratings.add("b")
    ratings.record_game("a", "b")
    assert ratings.mu("a") == pytest.approx(29.396, abs=1e-3)
    assert ratings.mu("b") == pytest.approx(20.604, abs=1e-3)
    assert ratings.sigma("a") == pytest.approx(7.171, abs=1e-3)


def test_win_probability_formula_and_symmetry():
    ratings = make_ratings("trueskill")
    ratings.add("a", mu=30.0, sigma=3.0)
    ratings.add("b", mu=25.0, sigma=4.0)
    beta = ratings.params["beta"]
    expected = _N.cdf(5.0 / math.sqrt(2 * beta**2 + 9.0 + 16.0))
    assert ratings.win_probability("a", "b") == pytest.approx(expected)
    assert ratings.win_probability("a", "b") + ratings.win_probability("b", "a") == pytest.approx(1.0)


def test_outcomes_from_solve_rates():
    assert outcomes_from_solve_rates([1.0, 1.0, 0.5]) == ["student"]
    assert outcomes_from_solve_rates([0.0, 0.25]) == ["teacher"]
    assert outcomes_from_solve_rates([0.5, 0.5, 0.6]) == ["draw"]
    assert outcomes_from_solve_rates([]) == []
    assert outcomes_from_solve_rates([1.0, 0.0, 0.5], mode="per_problem") == ["student", "teacher", "draw"]
    with pytest.raises(ValueError, match="solve rates"):
        outcomes_from_solve_rates([1.5])
    with pytest.raises(ValueError, match="solve rates"):
        outcomes_from_solve_rates([float("nan")])
    with pytest.raises(ValueError, match="game mode"):
        outcomes_from_solve_rates([1.0], mode="best_of_3")


@pytest.mark.parametrize("backend", ["trueskill", "openskill"])
def test_matchup_updates_direction_and_history(backend):
    pytest.importorskip(backend)
    ratings = make_ratings(backend)
    for member in Population.create(1, 1).alive():
        ratings.add(member.id)
    assert ratings.record_matchup("t0", "s0", [1.0, 1.0, 1.0], step=1) == ["student"]
    assert ratings.mu("s0") > ratings.mu("t0")
    assert ratings.win_probability("s0", "t0") > 0.5
    assert ratings.record_matchup("t0", "s0", [0.0, 0.0], step=2) == ["teacher"]
    assert ratings.record_matchup("t0", "s0", [], step=2) == []  # no valid problem: no game
    assert [e["step"] for e in ratings.history["s0"]] == [0, 1, 2]  # one entry per step
    assert ratings.history["s0"][-1]["mu"] == ratings.mu("s0")
    assert ratings.games == 2


@pytest.mark.parametrize("backend", ["trueskill", "openskill"])
def test_draw_between_equals_keeps_mu_and_shrinks_sigma(backend):
    pytest.importorskip(backend)
    ratings = make_ratings(backend)
    ratings.add("t0")
    ratings.add("s0")
    ratings.record_matchup("t0", "s0", [0.5], step=1)
    assert ratings.mu("t0") == pytest.approx(25.0) and ratings.mu("s0") == pytest.approx(25.0)
    assert ratings.sigma("t0") < 25.0 / 3


@pytest.mark.parametrize("backend", ["trueskill", "openskill"])
def test_json_round_trip(backend):
    pytest.importorskip(backend)
    ratings = make_ratings(backend, mu=20.0, draw_margin=0.2)
    ratings.add("t0")
    ratings.add("s0")
    ratings.record_matchup("t0", "s0", [0.9, 1.0], step=3)
    again = Ratings.from_json(ratings.to_json())
    assert again.backend == backend and again.state_dict() == ratings.state_dict()
    again.record_game("t0", "s0", step=4)
    ratings.record_game("t0", "s0", step=4)
    assert again.mu("t0") == ratings.mu("t0")


def test_add_child_inherits_mean_mu_with_fresh_sigma():
    ratings = make_ratings()
    ratings.add("t0", mu=30.0, sigma=2.0)
    ratings.add("t1", mu=20.0, sigma=3.0)
    ratings.add_child("t2", ["t0", "t1"], step=5)
    assert ratings.mu("t2") == 25.0 and ratings.sigma("t2") == pytest.approx(25.0 / 3)


def test_bad_input():
    with pytest.raises(ValueError, match="backend"):
        make_ratings("elo")
    ratings = make_ratings()
    ratings.add("t0")
    with pytest.raises(ValueError, match="already"):
        ratings.add("t0")
    with pytest.raises(ValueError, match="itself"):
        ratings.record_matchup("t0", "t0", [1.0])
    with pytest.raises(KeyError, match="s9"):
        ratings.record_matchup("t0", "s9", [1.0])
    assert ratings.games == 0
    with pytest.raises(ValueError, match="draw_probability"):
        make_ratings(draw_probability=1.5)


def test_a_teachers_win_raises_the_teacher_and_lowers_the_student():
    """Mean solve rate 0 < 0.4: the teacher wins one game; between two fresh players the winner goes to
    29.396 and the loser to 20.604. Catches: a teacher win recorded as a draw (or as a student win)."""
    ratings = make_ratings()
    ratings.add("t0")
    ratings.add("s0")
    assert ratings.record_matchup("t0", "s0", [0.0, 0.25]) == ["teacher"]
    assert ratings.mu("t0") == pytest.approx(29.396, abs=1e-3)
    assert ratings.mu("s0") == pytest.approx(20.604, abs=1e-3)


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
