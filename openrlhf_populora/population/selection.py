"""Selection: every ``evolve_every`` steps, which members are replaced, by whom, and with which operator.

``plan_evolution`` is a pure function of (population, ratings, step, config, seed). For each role
(teachers and students separately; the baseline never evolves), at a step ``t > 0`` with
``t % evolve_every == 0``:

1. Rank the living members of the role by their **selection score** (best first; ties by id):
   ``evolution.score``, by default ``mu``, the rating's skill estimate (see *Why mu* below);
   ``conservative`` ranks by ``mu - 3 sigma`` instead.
2. **Protect** the top ``elites`` and every member that has played fewer than ``min_age`` steps since its
   birth (default ``evolve_every``). Evolution runs at the end of a step, after that step's training, so a
   member born at step ``b`` (founders: 0; a child: the event that made it) has played steps ``b+1 .. t`` by
   the end of step ``t``: ``t - b`` steps (``Member.age``). With the default, a child always plays one full
   period before it can be retired.
3. **Replace** ``n = max(1, floor(replace_fraction * N))`` members (``0`` if ``replace_fraction == 0``), the
   lowest-ranked unprotected ones, but never so many that fewer than one member (and never fewer than the
   elites) survives (:meth:`EvolutionConfig.replacements`). So a role with one member never evolves, and a
   population in which no role can evolve is a configuration error while evolution is enabled.
4. For each replaced member, sample an operator from the weighted menu (readable names or the paper's codes,
   ``population/operators.py``). A crossover needs two distinct survivors (if there is only one, the operator
   is re-drawn among the menu's mutations). The operator's parameters come from ``evolution.params``; a
   fitness-aware crossover (``svd_fitness``) gets the parents' selection scores as ``fitness``.
5. **Parents** come from the survivors by tournament: draw ``tournament_size`` survivors uniformly without
   replacement, keep the best by selection score; a crossover's second parent is drawn the same way from the
   remaining survivors. Parents are listed best first (``extrapolate`` and ``sv_splice`` rely on this).
6. The child takes a new id (next free id of the role) and the replaced member's adapter slot; the engine
   writes the child's weights there and resets that slot's optimizer state. Its rating starts at its
   parents' mean ``mu`` with the prior ``sigma`` (``Ratings.add_child``).

The loop never runs an event at the run's last step (``SelfPlay.run_step``): a child made then would be
exported without a single update. A resume that extends the run makes it first (``SelfPlay.evolve_pending``).

**Why mu.** Who to retire is a question about skill, and ``mu`` is the rating's estimate of it. ``mu - 3
sigma`` is a lower bound instead: it ranks a member low for being *uncertain*, not for being weak. A child
starts with the prior ``sigma`` (8.33 by default) because its weights are new and its skill unknown; after
one period of ``k`` games its ``sigma`` is still well above that of a parent with several periods behind it,
so under ``mu - 3 sigma`` it is retired at its first event whatever it did (in a 40-step run of this project,
every student child was, one of them with the higher ``mu``). The large prior ``sigma`` is kept on purpose:
it makes the child's ``mu`` follow its own games quickly, so by its first event ``mu`` reflects the child
rather than its parent. The alternative of PBT-style inheritance (the parent's ``mu`` with a slightly
inflated ``sigma``) would shrink the penalty, not remove it, and would leave the child's ``mu`` stuck near its
parent's for many games. Ranking by ``mu`` can keep a lucky newcomer or retire an unlucky one, but that noise
has no sign; the lower bound's bias always goes against the young.

The randomness comes from ``random.Random(f"{seed}:{step}")``: the same inputs always give the same plan.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from openrlhf_populora.population.members import Population
from openrlhf_populora.population.operators import (
    CROSSOVER_NAMES,
    FITNESS_AWARE,
    MUTATION_NAMES,
    OperatorParams,
    canonical_operator,
    operator_code,
    operator_kind,
)

SCORES = ("mu", "conservative")  # what selection ranks by (``EvolutionConfig.score``)


def selection_score(ratings: Any, member_id: str, score: str = "mu") -> float:
    """A member's selection score: its rating's ``mu`` (default) or ``mu - 3 sigma`` (``conservative``)."""
    if score == "mu":
        return ratings.mu(member_id)
    if score == "conservative":
        return ratings.conservative(member_id)
    raise ValueError(f"unknown selection score {score!r}; choose from {', '.join(SCORES)}")


def default_operator_menu() -> dict[str, float]:
    """Default sampling weights over M1-M6 and X1-X9: mostly exact crossovers and gentle mutations. The controls
    (``copy_parent``, ``linear_0_5``) are off: they are the retention study's references, not evolution; name
    them in ``--populora.evolution.operators`` to use them."""
    return {"gaussian": 1.0, "layer_gaussian": 0.5, "sv_lognormal": 1.0, "subspace_rotation": 0.5,
            "drop_components": 0.25, "rescale": 0.25, "svd_mean": 1.0, "svd_fitness": 1.0, "layer_swap": 0.5,
            "ties": 0.5, "dare": 0.5, "sv_splice": 0.5, "extrapolate": 0.5, "slerp": 0.5, "task_arithmetic": 0.5}


@dataclass
class EvolutionConfig:
    """Knobs of the evolution step (``--populora.evolution.*``)."""

    enabled: bool = True
    evolve_every: int = 25  # k: evolve at steps k, 2k, ...
    replace_fraction: float = 0.25  # bottom fraction of each role replaced per event
    elites: int = 1  # top members per role that are never replaced
    min_age: int | None = None  # steps a member must play after its birth before it can be replaced; None: evolve_every
    tournament_size: int = 2  # parent selection pressure (1 = uniform among survivors)
    operators: dict = field(default_factory=default_operator_menu, metadata={
        "help": "operator -> sampling weight, as YAML, by readable name or the paper's code (M1-M6, X1-X9), "
                "controls copy_parent and linear_0_5 included"})
    params: OperatorParams = field(default_factory=OperatorParams)
    score: str = field(default="mu", metadata={
        "choices": SCORES,
        "help": "what selection ranks members by: mu (the rating's skill estimate; default) or conservative "
                "(mu - 3 sigma, which ranks a newborn child low for its prior uncertainty alone)"})

    def validate(self) -> None:
        if self.evolve_every <= 0:
            raise ValueError(f"evolution.evolve_every must be > 0, got {self.evolve_every}")
        if not 0.0 <= self.replace_fraction < 1.0:
            raise ValueError(f"evolution.replace_fraction must be in [0, 1), got {self.replace_fraction}")
        if self.elites < 0 or self.tournament_size < 1:
            raise ValueError("evolution.elites must be >= 0 and evolution.tournament_size >= 1")
        if self.score not in SCORES:
            raise ValueError(f"evolution.score must be one of {', '.join(SCORES)}, got {self.score!r}")
        if self.min_age is not None and self.min_age < 0:
            raise ValueError(f"evolution.min_age must be >= 0, got {self.min_age}")
        self.params.validate()
        if not isinstance(self.operators, dict) or not self.operators:
            raise ValueError("evolution.operators must be a non-empty mapping of operator name -> weight")
        seen: dict[str, str] = {}
        for name, weight in self.operators.items():
            canonical = canonical_operator(str(name))  # ValueError naming the unknown operator
            if canonical in seen:
                raise ValueError(f"evolution.operators names {canonical!r} twice ({seen[canonical]!r} and {name!r})")
            seen[canonical] = name
            if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
                raise ValueError(f"evolution.operators[{name!r}] must be a finite weight >= 0, "
                                 f"got {weight!r}")
        if sum(self.operators.values()) <= 0:
            raise ValueError("evolution.operators: at least one operator needs a positive weight")

    @property
    def effective_min_age(self) -> int:
        return self.evolve_every if self.min_age is None else self.min_age

    def menu(self) -> dict[str, float]:
        """The operators with a positive weight, by readable name."""
        return {canonical_operator(str(name)): float(w) for name, w in self.operators.items() if w > 0}

    def replacements(self, role_size: int) -> int:
        """How many members of a role with ``role_size`` members an evolution event replaces (at most)."""
        n = 0 if self.replace_fraction == 0 else max(1, math.floor(self.replace_fraction * role_size))
        return max(0, min(n, role_size - max(self.elites, 1)))


@dataclass(frozen=True)
class EvolutionAction:
    """Replace member ``replaced`` (in adapter ``slot``) by ``new_id``, made by ``operator`` from ``parents``.

    ``parents`` are member ids, best first; ``parent_adapters`` the slots they live in (read the parents'
    weights from these BEFORE writing any child of the same plan). ``params`` are extra keyword arguments for
    the operator (e.g. ``fitness`` for ``svd_fitness``); ``seed`` seeds the operator.
    """

    step: int
    slot: str
    replaced: str
    new_id: str
    role: str
    operator: str
    parents: tuple[str, ...]
    parent_adapters: tuple[str, ...]
    seed: int
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return operator_kind(self.operator)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "slot": self.slot, "replaced": self.replaced, "new_id": self.new_id,
                "role": self.role, "operator": self.operator, "operator_code": operator_code(self.operator),
                "parents": list(self.parents),
                "parent_adapters": list(self.parent_adapters), "seed": self.seed, "params": dict(self.params)}


def should_evolve(step: int, cfg: EvolutionConfig) -> bool:
    return cfg.enabled and step > 0 and step % cfg.evolve_every == 0


def _tournament(pool: list[str], size: int, score: dict[str, float], rng: random.Random) -> str:
    entrants = rng.sample(pool, min(size, len(pool)))
    return max(entrants, key=lambda m: (score[m], m))


def plan_evolution(population: Population, ratings: Any, step: int, cfg: EvolutionConfig,
                   seed: int = 0) -> list[EvolutionAction]:
    """The evolution actions for ``step`` (an empty list when this is not an evolution step)."""
    cfg.validate()
    if len(population) == 0:
        raise ValueError("cannot plan evolution for an empty population")
    if not should_evolve(step, cfg) or population.is_baseline:
        return []
    missing = [m.id for m in population.alive() if not ratings.has(m.id)]
    if missing:
        raise ValueError(f"members without a rating: {', '.join(missing)}")
    rng = random.Random(f"{seed}:{step}")
    weights = cfg.menu()
    menu = list(weights)
    mutation_menu = [name for name in menu if name in MUTATION_NAMES]
    actions: list[EvolutionAction] = []

    for role in ("teacher", "student"):
        group = [m for m in population.alive() if m.role == role]
        score = {m.id: selection_score(ratings, m.id, cfg.score) for m in group}
        ranked = sorted(group, key=lambda m: (-score[m.id], m.id))
        eligible = [m for m in ranked[cfg.elites:] if m.age(step) >= cfg.effective_min_age]
        victims = eligible[::-1][:cfg.replacements(len(group))]
        victim_ids = {m.id for m in victims}
        survivors = [m.id for m in ranked if m.id not in victim_ids]
        new_ids = population.next_ids(role, len(victims))
        for victim, new_id in zip(victims, new_ids, strict=True):
            operator = rng.choices(menu, weights=[weights[n] for n in menu])[0]
            if operator in CROSSOVER_NAMES and len(survivors) < 2:
                if not mutation_menu:
                    raise ValueError(f"step {step}: role {role!r} has one survivor, so it needs a mutation, "
                                     f"but the operator menu has none")
                operator = rng.choices(mutation_menu, weights=[weights[n] for n in mutation_menu])[0]
            first = _tournament(survivors, cfg.tournament_size, score, rng)
            parents = [first]
            if operator in CROSSOVER_NAMES:
                others = [m for m in survivors if m != first]
                parents.append(_tournament(others, cfg.tournament_size, score, rng))
                parents.sort(key=lambda m: (-score[m], m))
            params: dict[str, Any] = cfg.params.for_operator(operator)
            if operator in FITNESS_AWARE:
                params["fitness"] = [score[p] for p in parents]
            actions.append(EvolutionAction(
                step=step, slot=victim.adapter, replaced=victim.id, new_id=new_id, role=role,
                operator=operator, parents=tuple(parents),
                parent_adapters=tuple(population.adapter_of(p) for p in parents),
                seed=rng.randrange(2**31), params=params))
    return actions


def apply_plan(population: Population, ratings: Any, actions: list[EvolutionAction],
               infos: list[dict[str, Any]] | None = None) -> None:
    """Record applied actions: lineage in the population, a rating for each child (``Ratings.add_child``).

    Call it after the engine wrote every child. ``infos`` (one per action, e.g. from
    ``evolution.apply_action``) are stored on the children. All checks run before anything changes.
    """
    infos = infos if infos is not None else [{} for _ in actions]
    if len(infos) != len(actions):
        raise ValueError(f"{len(actions)} actions but {len(infos)} infos")
    trial = Population.from_dict(population.to_dict())  # dry run: fail before anything changes
    for action, info in zip(actions, infos, strict=True):
        trial.record(action, info)
        if ratings.has(action.new_id):
            raise ValueError(f"member {action.new_id!r} is already rated")
        for parent in action.parents:
            ratings.mu(parent)
    for action, info in zip(actions, infos, strict=True):
        population.record(action, info)
        ratings.add_child(action.new_id, list(action.parents), step=action.step)
