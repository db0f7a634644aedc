"""The names of the LoRA weight-space operators, without torch.

``evolution/`` implements these operators on tensors; ``population/`` only needs their names and kinds to
plan evolution (a crossover needs two parents, a mutation one). The evolution registries are tested to
hold exactly these names, so this is the single list both packages agree on.

Each operator's maths is documented where it is implemented: ``evolution/mutations.py`` and
``evolution/crossovers.py``.
"""

from __future__ import annotations

MUTATION_NAMES: tuple[str, ...] = (
    "copy_parent",  # control: an exact copy of the parent
    "gaussian",  # noise scaled to each tensor's std
    "layer_gaussian",  # the same noise on a random subset of layers
    "sv_lognormal",  # log-normal jitter of the singular values
    "subspace_rotation",  # small random tilt of the left and right singular subspaces
    "drop_components",  # zero random singular components
    "rescale",  # global log-normal rescale of the delta
)

CROSSOVER_NAMES: tuple[str, ...] = (
    "linear_0_5",  # control: naive average of the A and B factors (mathematically wrong, kept as a control)
    "svd_mean",  # exact weighted average of the deltas, re-factored to rank r
    "svd_fitness",  # the same with softmax(fitness / temperature) weights
    "layer_swap",  # whole layers taken from one parent or the other
    "ties",  # TIES (trim, elect sign, disjoint mean) on the deltas in a joint basis
    "dare",  # DARE (drop and rescale) on the deltas in a joint basis
    "sv_splice",  # top singular components of parent 0, the rest from parent 1
    "extrapolate",  # step past the better parent, away from the worse one
    "slerp",  # spherical interpolation between the two deltas
)

# crossovers that use the parents' fitness (their conservative ratings, best parent first)
FITNESS_AWARE: frozenset[str] = frozenset({"svd_fitness"})

# crossovers defined for exactly two parents; the others take any number >= 2
TWO_PARENT_ONLY: frozenset[str] = frozenset({"sv_splice", "extrapolate", "slerp"})


def operator_kind(name: str) -> str:
    """``"mutation"`` or ``"crossover"``; ValueError for an unknown name."""
    if name in MUTATION_NAMES:
        return "mutation"
    if name in CROSSOVER_NAMES:
        return "crossover"
    raise ValueError(f"unknown evolution operator {name!r}; mutations: {', '.join(MUTATION_NAMES)}; "
                     f"crossovers: {', '.join(CROSSOVER_NAMES)}")
