"""Selection and the evolution plan: who is replaced, who breeds, which operator; lineage and ratings."""

import random
from collections import Counter

import pytest

from openrlhf_populora.population import (
    CROSSOVER_NAMES,
    MUTATION_NAMES,
    EvolutionConfig,
    Member,
    Population,
    apply_plan,
    make_ratings,
    plan_evolution,
    should_evolve,
)
from openrlhf_populora.population.selection import _tournament


def _rated(teachers, students, spread=True):
    population = Population.create(teachers, students)
    ratings = make_ratings()
    for i, member in enumerate(population.alive()):
        ratings.add(member.id, mu=25.0 + (i % max(teachers, students) if spread else 0), sigma=1.0)
    return population, ratings


def test_plan_replaces_the_bottom_fraction_per_role_and_keeps_elites():
    population, ratings = _rated(8, 8)  # t7 and s7 rate best, t0 and s0 worst
    actions = plan_evolution(population, ratings, 25, EvolutionConfig(replace_fraction=0.25), seed=0)
    assert sorted(a.replaced for a in actions) == ["s0", "s1", "t0", "t1"]
    assert sorted(a.new_id for a in actions) == ["s8", "s9", "t8", "t9"]
    for action in actions:
        assert action.slot == action.replaced and action.role == population.get(action.replaced).role
        assert action.replaced not in action.parents
        assert all(population.get(p).role == action.role for p in action.parents)
        assert action.parent_adapters == tuple(population.adapter_of(p) for p in action.parents)
        assert len(action.parents) == (2 if action.operator in CROSSOVER_NAMES else 1)
        scores = [ratings.mu(p) for p in action.parents]
        assert scores == sorted(scores, reverse=True)  # best parent first


def test_only_on_evolution_steps_and_never_for_the_baseline():
    population, ratings = _rated(4, 4)
    cfg = EvolutionConfig(evolve_every=5)
    assert plan_evolution(population, ratings, 0, cfg) == []
    assert plan_evolution(population, ratings, 7, cfg) == []
    assert plan_evolution(population, ratings, 10, cfg) != []
    assert plan_evolution(population, ratings, 10, EvolutionConfig(evolve_every=5, enabled=False)) == []
    baseline = Population.baseline()
    assert plan_evolution(baseline, make_ratings(), 10, cfg) == []


@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 0.99])
@pytest.mark.parametrize("elites", [0, 1, 2])
def test_never_removes_every_member_or_an_elite(size, fraction, elites):
    population, ratings = _rated(size, size)
    cfg = EvolutionConfig(replace_fraction=fraction, elites=elites, evolve_every=1, min_age=0)
    actions = plan_evolution(population, ratings, 1, cfg, seed=3)
    for role, members in (("teacher", population.teachers()), ("student", population.students())):
        ranked = sorted(members, key=lambda m: -ratings.mu(m.id))
        replaced = {a.replaced for a in actions if a.role == role}
        assert len(replaced) < len(members) or not members
        assert not replaced & {m.id for m in ranked[:elites]}
        if fraction == 0.0 or size == 1:
            assert not replaced


def test_min_age_protects_young_members():
    population, ratings = _rated(4, 4)
    cfg = EvolutionConfig(evolve_every=5, min_age=10)
    assert plan_evolution(population, ratings, 5, cfg) == []
    assert plan_evolution(population, ratings, 10, cfg) != []
    assert EvolutionConfig(evolve_every=7).effective_min_age == 7


def _students(ratings, *members):
    """A population of one teacher and the given students ``(id, birth_step, mu, sigma)``, rated as given."""
    population = Population.create(1, 1)
    population.members = [m for m in population.members if m.role == "teacher"]
    ratings.add("t0", mu=25.0, sigma=1.0)
    for member_id, birth, mu, sigma in members:
        population.add(Member(member_id, "student", member_id, birth_step=birth))
        ratings.add(member_id, mu=mu, sigma=sigma)
    return population


def test_a_strong_child_survives_its_first_event():
    # The committed 40-step signature run at its step-20 event: the child s2 (born at step 10) had the higher mu,
    # 24.47 against its parent s1's 23.60, but the larger sigma, 3.34 against 2.17. Ranked by mu - 3 sigma
    # (14.45 against 17.09) the child was retired; ranked by mu the parent is.
    # Catches: selection by the conservative score (the code before this test).
    ratings = make_ratings()
    population = _students(ratings, ("s1", 0, 23.60, 2.17), ("s2", 10, 24.47, 3.34))
    cfg = EvolutionConfig(evolve_every=10, operators={"gaussian": 1.0})
    (action,) = [a for a in plan_evolution(population, ratings, 20, cfg, seed=0) if a.role == "student"]
    assert (action.replaced, action.parents) == ("s1", ("s2",))
    # the old rule, still selectable, retires the child: the test above fails under it
    (old,) = [a for a in plan_evolution(population, ratings, 20, EvolutionConfig(
        evolve_every=10, operators={"gaussian": 1.0}, score="conservative"), seed=0) if a.role == "student"]
    assert old.replaced == "s2"


def test_a_child_that_wins_its_games_survives_its_first_event():
    # The same through the ratings themselves: s1 and s0 play 10 steps, s0 is retired at step 10 for a child of
    # s1 (s2: s1's mu, the prior sigma), then s1 and s2 each play one game a step against t0 for 10 steps, s2
    # winning 6 and s1 winning 5. s2 ends with the higher mu but, having played 10 games against s1's 20, the
    # larger sigma (2.42 against 1.80), so the lower mu - 3 sigma (20.82 against 21.11). At step 20 the parent is
    # replaced, not the child.
    # Catches: selection by mu - 3 sigma (the child is retired).
    population = Population.create(1, 2)
    ratings = make_ratings()
    for member in population.alive():
        ratings.add(member.id)
    for step in range(1, 11):
        ratings.record_matchup("t0", "s1", [1.0 if step % 2 else 0.0], step=step)  # s1: 5 wins of 10
        ratings.record_matchup("t0", "s0", [1.0 if step % 5 == 0 else 0.0], step=step)  # s0: 2 of 10
    cfg = EvolutionConfig(evolve_every=10, operators={"gaussian": 1.0})
    first = [a for a in plan_evolution(population, ratings, 10, cfg, seed=0) if a.role == "student"]
    assert [(a.replaced, a.new_id, a.parents) for a in first] == [("s0", "s2", ("s1",))]
    apply_plan(population, ratings, first)
    assert ratings.mu("s2") == ratings.mu("s1") and ratings.sigma("s2") == pytest.approx(25.0 / 3)
    for step in range(11, 21):
        ratings.record_matchup("t0", "s1", [1.0 if step % 2 else 0.0], step=step)  # 5 of 10
        ratings.record_matchup("t0", "s2", [1.0 if step % 2 or step == 20 else 0.0], step=step)  # 6 of 10
    assert ratings.mu("s2") > ratings.mu("s1") and ratings.conservative("s2") < ratings.conservative("s1")
    second = [a for a in plan_evolution(population, ratings, 20, cfg, seed=0) if a.role == "student"]
    assert [(a.replaced, a.parents) for a in second] == [("s1", ("s2",))]


def test_a_weak_old_member_is_replaced():
    # Three students, one replaced per event (replace_fraction 0.34, elites 1, min_age = evolve_every = 10).
    # At step 10 the founders have played exactly min_age steps: the weakest founder goes.
    # Catches: an age test with > instead of >= (nobody would be old enough), and a ranking turned upside down.
    ratings = make_ratings()
    population = _students(ratings, ("s0", 0, 20.0, 1.5), ("s1", 0, 30.0, 1.5), ("s2", 0, 26.0, 1.5))
    cfg = EvolutionConfig(evolve_every=10, replace_fraction=0.34, operators={"gaussian": 1.0})
    assert [a.replaced for a in plan_evolution(population, ratings, 10, cfg, seed=0) if a.role == "student"] == ["s0"]
    # At step 20 beside them lives s3, born at step 10, with a mu above s0's and a sigma far above (mu - 3 sigma:
    # s0 15.5, s3 13.0): the weak old member goes, not the uncertain young one.
    # Catches also: ranking by mu - 3 sigma (s3 would be retired).
    ratings = make_ratings()
    population = _students(ratings, ("s0", 0, 20.0, 1.5), ("s1", 0, 30.0, 1.5), ("s3", 10, 22.0, 3.0))
    assert [a.replaced for a in plan_evolution(population, ratings, 20, cfg, seed=0) if a.role == "student"] == ["s0"]


def test_min_age_counts_the_steps_played_since_birth():
    # min_age 20 with events every 10 steps: s3, born at step 10 and the weakest, has played 10 steps at the
    # step-20 event (protected: the next weakest, s0, goes) and 20 at the step-30 event (retired).
    # Catches: age measured from the run's start instead of the member's birth (s3 retired at step 20), and an
    # age test with > instead of >= (s3 still protected at step 30).
    ratings = make_ratings()
    population = _students(ratings, ("s0", 0, 20.0, 1.5), ("s1", 0, 30.0, 1.5), ("s3", 10, 15.0, 1.5))
    cfg = EvolutionConfig(evolve_every=10, min_age=20, replace_fraction=0.34, operators={"gaussian": 1.0})
    assert [a.replaced for a in plan_evolution(population, ratings, 20, cfg, seed=0) if a.role == "student"] == ["s0"]
    assert [a.replaced for a in plan_evolution(population, ratings, 30, cfg, seed=0) if a.role == "student"] == ["s3"]


def test_single_survivor_forces_a_mutation():
    population, ratings = _rated(2, 2)
    cfg = EvolutionConfig(replace_fraction=0.5, operators={"svd_mean": 1.0, "gaussian": 1e-9})
    for seed in range(10):
        for action in plan_evolution(population, ratings, 25, cfg, seed=seed):
            assert action.operator == "gaussian" and len(action.parents) == 1
    with pytest.raises(ValueError, match="mutation"):
        plan_evolution(population, ratings, 25, EvolutionConfig(operators={"svd_mean": 1.0}))


def test_operator_menu_weights_and_fitness_params():
    population, ratings = _rated(8, 8)
    cfg = EvolutionConfig(replace_fraction=0.5, operators={"svd_fitness": 3.0, "sv_lognormal": 1.0,
                                                           "rescale": 0.0})
    counts = Counter()
    for seed in range(60):
        for action in plan_evolution(population, ratings, 25, cfg, seed=seed):
            counts[action.operator] += 1
            if action.operator == "svd_fitness":
                assert action.params["fitness"] == [ratings.mu(p) for p in action.parents]
                assert action.params["temperature"] == cfg.params.svd_fitness_temperature
            else:
                assert action.params == {"sigma": cfg.params.sv_lognormal_sigma}
    assert set(counts) == {"svd_fitness", "sv_lognormal"}
    assert counts["svd_fitness"] > 2 * counts["sv_lognormal"]


def test_tournament_prefers_strong_parents():
    population, ratings = _rated(8, 8)
    parents = Counter()
    cfg = EvolutionConfig(tournament_size=3, operators={"gaussian": 1.0})
    for seed in range(100):
        parents.update(a.parents[0] for a in plan_evolution(population, ratings, 25, cfg, seed=seed)
                       if a.role == "teacher")
    assert parents["t7"] > parents["t2"]


def test_plan_is_pure_and_deterministic():
    population, ratings = _rated(4, 4)
    before = (population.to_dict(), ratings.state_dict())
    first = plan_evolution(population, ratings, 25, EvolutionConfig(), seed=11)
    assert first == plan_evolution(population, ratings, 25, EvolutionConfig(), seed=11)
    assert (population.to_dict(), ratings.state_dict()) == before
    plans = {tuple(a.seed for a in plan_evolution(population, ratings, 25, EvolutionConfig(), seed=s))
             for s in range(5)}
    assert len(plans) == 5


def test_apply_plan_records_lineage_and_rates_children():
    population, ratings = _rated(4, 4)
    actions = plan_evolution(population, ratings, 25, EvolutionConfig(), seed=0)
    infos = [{"truncation_energy": 0.1 * i} for i in range(len(actions))]
    apply_plan(population, ratings, actions, infos)
    for action, info in zip(actions, infos, strict=True):
        child = population.get(action.new_id)
        assert child.adapter == action.slot and child.parents == list(action.parents)
        assert child.operator == action.operator and child.op_seed == action.seed and child.info == info
        assert not population.get(action.replaced).alive
        assert ratings.has(action.new_id)
        mean_mu = sum(ratings.mu(p) for p in action.parents) / len(action.parents)
        assert ratings.mu(action.new_id) == pytest.approx(mean_mu)
    assert len(population.teachers()) == 4 and len(population.students()) == 4
    # applying the same plan twice fails before changing anything
    snapshot = population.to_dict()
    with pytest.raises(ValueError):
        apply_plan(population, ratings, actions)
    assert population.to_dict() == snapshot
    # the next plan uses fresh ids
    later = plan_evolution(population, ratings, 50, EvolutionConfig(min_age=0), seed=0)
    assert not {a.new_id for a in later} & {m.id for m in population.members}


def test_action_round_trips_to_dict():
    population, ratings = _rated(4, 4)
    (action, *_) = plan_evolution(population, ratings, 25, EvolutionConfig(), seed=0)
    data = action.to_dict()
    assert data["slot"] == action.slot and data["parents"] == list(action.parents)
    assert action.kind in ("mutation", "crossover")


def test_bad_input():
    population, ratings = _rated(2, 2)
    with pytest.raises(ValueError, match="evolve_every"):
        plan_evolution(population, ratings, 10, EvolutionConfig(evolve_every=0))
    with pytest.raises(ValueError, match="evolve_every"):
        EvolutionConfig(evolve_every=-3).validate()
    with pytest.raises(ValueError, match="unknown evolution operator 'crossbreed'"):
        plan_evolution(population, ratings, 25, EvolutionConfig(operators={"crossbreed": 1.0}))
    with pytest.raises(ValueError, match="empty"):
        plan_evolution(Population(), ratings, 25, EvolutionConfig())
    with pytest.raises(ValueError, match="replace_fraction"):
        EvolutionConfig(replace_fraction=1.0).validate()
    with pytest.raises(ValueError, match="evolution.score must be one of mu, conservative"):
        EvolutionConfig(score="sigma").validate()
    with pytest.raises(ValueError, match="weight"):
        EvolutionConfig(operators={"gaussian": -1.0}).validate()
    with pytest.raises(ValueError, match="positive weight"):
        EvolutionConfig(operators={"gaussian": 0.0}).validate()
    with pytest.raises(ValueError, match="without a rating"):
        plan_evolution(population, make_ratings(), 25, EvolutionConfig())


def test_default_menu_names_are_known_operators():
    cfg = EvolutionConfig()
    cfg.validate()
    assert set(cfg.operators) <= set(MUTATION_NAMES) | set(CROSSOVER_NAMES)
    assert "copy_parent" not in cfg.operators and "linear_0_5" not in cfg.operators  # controls are opt-in


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
