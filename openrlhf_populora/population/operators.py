"""The LoRA weight-space operators by name, and their hyperparameters, without torch.

``evolution/`` implements these operators on tensors; ``population/`` only needs their names, kinds and
parameters to plan evolution (a crossover needs two parents, a mutation one). The evolution registries are
tested to hold exactly these names, so this is the single list both packages agree on.

**Names.** Every operator has a readable name (used in configs, events and code) and a code in the paper's
numbering, M1-M6 for the mutations and X1-X9 for the crossovers, plus the two controls the paper's retention
study uses, ``copy_parent`` (a mutation that changes nothing) and ``linear_0_5`` (the plain factor average).
The paper names its operators M1-M6 and X1-X9 without defining each one in its public text, so which
operator carries which code is this project's choice, fixed here once (``OPERATOR_CODES``). Either name
selects an operator (``--populora.evolution.operators '{M1: 1.0, svd_mean: 2.0}'``); events carry both.

Each operator's maths is documented where it is implemented: ``evolution/mutations.py`` and
``evolution/crossovers.py``. Its hyperparameters are the fields of :class:`OperatorParams`, one flag each
(``--populora.evolution.params.gaussian_scale 0.05``): the one place their defaults are written.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

MUTATION_NAMES: tuple[str, ...] = (
    "copy_parent",  # control: an exact copy of the parent
    "gaussian",  # M1: noise scaled to each tensor's std
    "layer_gaussian",  # M2: the same noise on a random subset of layers
    "sv_lognormal",  # M3: log-normal jitter of the singular values
    "subspace_rotation",  # M4: small random tilt of the left and right singular subspaces
    "drop_components",  # M5: zero random singular components
    "rescale",  # M6: global log-normal rescale of the delta
)

CROSSOVER_NAMES: tuple[str, ...] = (
    "linear_0_5",  # control: naive average of the A and B factors (mathematically wrong, kept as a control)
    "svd_mean",  # X1: exact weighted average of the deltas, re-factored to rank r
    "svd_fitness",  # X2: the same with softmax(fitness / temperature) weights
    "layer_swap",  # X3: whole layers taken from one parent or the other
    "ties",  # X4: TIES (trim, elect sign, disjoint mean) on the deltas in a joint basis
    "dare",  # X5: DARE (drop and rescale) on the deltas in a joint basis
    "sv_splice",  # X6: top singular components of parent 0, the rest from parent 1
    "extrapolate",  # X7: step past the better parent, away from the worse one
    "slerp",  # X8: spherical interpolation between the two deltas
    "task_arithmetic",  # X9: the scaled sum of the deltas (task vectors added, not averaged)
)

CONTROLS: tuple[str, ...] = ("copy_parent", "linear_0_5")

# readable name -> the paper's numbering (the controls keep their names as codes)
OPERATOR_CODES: dict[str, str] = {
    **{name: f"M{i}" for i, name in enumerate(MUTATION_NAMES[1:], 1)},
    **{name: f"X{i}" for i, name in enumerate(CROSSOVER_NAMES[1:], 1)},
    **{name: name for name in CONTROLS},
}
_BY_CODE = {code: name for name, code in OPERATOR_CODES.items()}

# crossovers that use the parents' fitness (their selection scores, evolution.score: mu by default; best parent first)
FITNESS_AWARE: frozenset[str] = frozenset({"svd_fitness"})

# crossovers defined for exactly two parents; the others take any number >= 2
TWO_PARENT_ONLY: frozenset[str] = frozenset({"sv_splice", "extrapolate", "slerp"})


def canonical_operator(name: str) -> str:
    """The readable name of an operator given by either name (``"M1"`` -> ``"gaussian"``); ValueError if unknown."""
    if name in OPERATOR_CODES:
        return name
    if name in _BY_CODE:
        return _BY_CODE[name]
    listing = ", ".join(f"{code} {n}" if code != n else n for n, code in OPERATOR_CODES.items())
    raise ValueError(f"unknown evolution operator {name!r}; choose from: {listing}")


def operator_code(name: str) -> str:
    """The paper-numbering code of an operator (``"gaussian"`` -> ``"M1"``; the controls keep their names)."""
    return OPERATOR_CODES[canonical_operator(name)]


def operator_kind(name: str) -> str:
    """``"mutation"`` or ``"crossover"``; ValueError for an unknown name."""
    return "mutation" if canonical_operator(name) in MUTATION_NAMES else "crossover"


def _param(operator: str, name: str, default: Any, valid: str, help: str) -> Any:
    """A field of :class:`OperatorParams`: operator ``operator``'s keyword ``name``, whose values must lie in the
    interval ``valid`` (``"[0, 1)"``, ``"(0, inf)"``, ...; None is allowed where the default is None)."""
    return field(default=default, metadata={"operator": operator, "param": name, "valid": valid,
                                            "help": f"{help}; in {valid}"})


def _in_interval(value: float, interval: str) -> bool:
    low, high = (part.strip() for part in interval[1:-1].split(","))
    lo, hi = float(low), float(high)
    above = value >= lo if interval[0] == "[" else value > lo
    below = value <= hi if interval[-1] == "]" else value < hi
    return math.isfinite(value) and above and below


@dataclass
class OperatorParams:
    """Every operator's hyperparameters (``--populora.evolution.params.<field>``), defaults written once.

    The paper does not publish its operators' settings; these defaults keep a child within a few percent of
    its parent's delta (mutations) or combine the parents exactly (crossovers), see ``benchmarks/evolution.py``.
    """

    gaussian_scale: float = _param("gaussian", "scale", 0.05, "[0, inf)", "M1: noise std as a fraction of each tensor's std")
    layer_gaussian_scale: float = _param("layer_gaussian", "scale", 0.1, "[0, inf)", "M2: noise std, fraction of tensor std")
    layer_gaussian_fraction: float = _param("layer_gaussian", "fraction", 0.25, "(0, 1]", "M2: fraction of layers mutated")
    sv_lognormal_sigma: float = _param("sv_lognormal", "sigma", 0.1, "[0, inf)", "M3: singular values times exp(sigma N)")
    subspace_rotation_angle: float = _param("subspace_rotation", "angle", 0.05, "[0, inf)",
                                            "M4: tilt of the singular subspaces, in radians")
    drop_components_p: float = _param("drop_components", "p", 0.1, "[0, 1)", "M5: probability of zeroing a component")
    rescale_sigma: float = _param("rescale", "sigma", 0.1, "[0, inf)", "M6: the delta times exp(sigma N), one N per adapter")
    svd_fitness_temperature: float = _param("svd_fitness", "temperature", 1.0, "(0, inf)",
                                            "X2: softmax temperature over the parents' ratings")
    ties_density: float = _param("ties", "density", 0.5, "(0, 1]", "X4: fraction of each core's entries kept")
    dare_p: float = _param("dare", "p", 0.3, "[0, 1)", "X5: drop probability of each core entry")
    sv_splice_top: int | None = _param("sv_splice", "top", None, "[0, inf)",
                                       "X6: components taken from parent 0 (default: rank // 2)")
    extrapolate_lam: float = _param("extrapolate", "lam", 0.5, "[0, inf)", "X7: D0 + lam (D0 - D1)")
    slerp_t: float | None = _param("slerp", "t", None, "[0, 1]", "X8: interpolation point (default: parent 1's weight)")
    task_arithmetic_lam: float = _param("task_arithmetic", "lam", 1.0, "(0, inf)", "X9: lam (D0 + D1 + ...)")

    def for_operator(self, name: str) -> dict[str, Any]:
        """The keyword arguments of operator ``name`` (either name), e.g. ``{"scale": 0.05}``."""
        name = canonical_operator(name)
        return {f.metadata["param"]: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.metadata["operator"] == name}

    def validate(self) -> None:
        """ValueError naming the flag of the first value outside its interval."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            if f.type in ("int | None", int) and not (isinstance(value, int) and not isinstance(value, bool)):
                raise ValueError(f"evolution.params.{f.name} must be an integer, got {value!r}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not _in_interval(float(value), f.metadata["valid"]):
                raise ValueError(f"evolution.params.{f.name} must be in {f.metadata['valid']}, got {value!r}")


# operator -> keyword arguments given per call rather than configured: the parents' ratings (the plan passes
# them), and a fixed rescale factor (for studies and tests; the run draws one from rescale_sigma)
RUNTIME_PARAMS: dict[str, frozenset[str]] = {"svd_fitness": frozenset({"fitness"}),
                                             "rescale": frozenset({"factor"})}


def operator_params(name: str, given: dict[str, Any], defaults: OperatorParams | None = None) -> dict[str, Any]:
    """Operator ``name``'s full keyword arguments: ``defaults`` (``OperatorParams()`` when None) overridden by
    ``given``. ValueError for a keyword the operator does not take, or a value outside its interval."""
    name = canonical_operator(name)
    merged = (defaults or OperatorParams()).for_operator(name)
    unknown = set(given) - set(merged) - RUNTIME_PARAMS.get(name, frozenset())
    if unknown:
        takes = sorted(set(merged) | RUNTIME_PARAMS.get(name, frozenset()))
        raise ValueError(f"operator {name!r} takes {', '.join(takes) or 'no parameters'}, got {sorted(unknown)}")
    merged.update(given)
    check = OperatorParams(**{f.name: merged[f.metadata["param"]] for f in dataclasses.fields(OperatorParams)
                              if f.metadata["operator"] == name})
    check.validate()
    return merged

