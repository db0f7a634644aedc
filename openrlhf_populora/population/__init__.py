"""The population: members and lineage, skill ratings, matchmaking, and selection for evolution.

Pure logic (stdlib + the rating packages); no torch and no engine. The tensor side of evolution lives in
``openrlhf_populora.evolution``.
"""

from openrlhf_populora.population.matchmaking import STRATEGIES, Matchup, matchmake, pfsp_weight
from openrlhf_populora.population.members import ROLES, Member, Population
from openrlhf_populora.population.operators import (
    CONTROLS,
    CROSSOVER_NAMES,
    FITNESS_AWARE,
    MUTATION_NAMES,
    OPERATOR_CODES,
    TWO_PARENT_ONLY,
    OperatorParams,
    canonical_operator,
    operator_code,
    operator_kind,
    operator_params,
)
from openrlhf_populora.population.ratings import (
    BACKENDS,
    OpenSkillRatings,
    Ratings,
    TrueSkillRatings,
    make_ratings,
    outcomes_from_solve_rates,
)
from openrlhf_populora.population.selection import (
    EvolutionAction,
    EvolutionConfig,
    apply_plan,
    default_operator_menu,
    plan_evolution,
    should_evolve,
)

__all__ = [
    "BACKENDS", "CONTROLS", "CROSSOVER_NAMES", "FITNESS_AWARE", "MUTATION_NAMES", "OPERATOR_CODES", "ROLES",
    "STRATEGIES", "TWO_PARENT_ONLY",
    "EvolutionAction", "EvolutionConfig", "Matchup", "Member", "OpenSkillRatings", "OperatorParams", "Population",
    "Ratings", "TrueSkillRatings", "apply_plan", "canonical_operator", "default_operator_menu", "make_ratings",
    "matchmake", "operator_code", "operator_kind", "operator_params", "outcomes_from_solve_rates", "pfsp_weight",
    "plan_evolution", "should_evolve",
]
